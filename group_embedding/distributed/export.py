"""ONE servable SavedModel from a model trained in collective mode.

Each worker holds only its shards, so no worker can export the whole model
from memory. `ge.save_tables` already writes every shard, and
`ge.restore_tables` reads them at any worker count: one plain process that
builds the tables as the training script does restores all of them and
exports with `ge.export_saved_model` (stock TF ops only).
"""

from typing import Any
from typing import Mapping

from group_embedding.distributed import checkpoint
from group_embedding.distributed import strategy
from group_embedding.export.saved_model import export_saved_model


def export_from_checkpoint(checkpoint_path: str, tables: Mapping[str, Any],
                           obj: Any, export_dir: str,
                           signatures: Any = None,
                           options: Any = None) -> str:
    """Restores a `ge.save_tables` checkpoint (written by any number of
    workers) into `tables` and exports `obj` as ONE SavedModel.

    Run it in one process outside collective mode (no horovodrun), after
    building the model as the training script builds it: its tables are
    then whole plain variables and EmbeddingVariables, and every shard's
    rows and keys land in them.

    Args:
        checkpoint_path: a checkpoint folder, or the directory given to
            `ge.save_tables` (its latest checkpoint).
        tables: {name: table} as passed to `ge.save_tables`.
        obj: the model or module to export (it serves from `tables`).
        export_dir: the SavedModel folder.
        signatures, options: as for `ge.export_saved_model`.

    Returns:
        `export_dir`.

    Raises:
        RuntimeError: called in collective mode (each worker holds only
            its shards).
        ValueError: the checkpoint does not match `tables` (as
            `ge.restore_tables`).
    """
    if strategy.is_collective():
        raise RuntimeError(
            "export_from_checkpoint runs in one plain process (no "
            "horovodrun, no enable_distributed_strategy): in collective "
            "mode each worker holds only its shards of the tables.")
    checkpoint.restore_tables(checkpoint_path, dict(tables))
    return export_saved_model(obj, export_dir, signatures, options)
