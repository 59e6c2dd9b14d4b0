"""Checkpoints of embedding tables that restore at another worker count.

Each worker writes only what it owns: the rows of its shards (with their
global ids), its EmbeddingVariables' keys with values, frequencies,
versions and optimizer slots, and (worker 0 only) replicated tables. A
restore at M workers reads every shard file and keeps what it owns under
the new layout, so N -> M works for any N and M (1 included).

A save is all-or-nothing: shard files go to `ckpt-STEP.partial/`; only when
every worker has written its file does worker 0 rename the folder and
repoint `latest` (atomic renames). A save that fails midway leaves the
previous checkpoint as `latest`. The folder must be visible to all workers
(a shared filesystem when they run on several hosts).

Dense variables and the optimizer slots of `tf.Variable` shards are not
resharded: save them with `tf.train.Checkpoint` on worker 0 (dense values
are identical on every worker).
"""

import os
import shutil
from typing import Dict

import numpy as np
import tensorflow as tf

from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.distributed.sharded_variable import shard_rows

LATEST = "latest"


def _barrier_all_ok(ok: bool) -> bool:
    """True on every worker iff `ok` on every worker (also a barrier)."""
    if not distributed_strategy.is_collective():
        return ok
    hvd = distributed_strategy.horovod()
    failed = hvd.allreduce(tf.constant(0 if ok else 1, tf.int32),
                           op=hvd.Sum, name="ge_ckpt_barrier")
    return int(failed) == 0


def _is_ev(table) -> bool:
    return hasattr(table, "lookup_rows")


def _to_numpy(tensor) -> np.ndarray:
    # String tensors come out as object arrays of bytes, which np.load
    # refuses without pickle; store them as fixed-width unicode.
    value = np.asarray(tensor)
    if value.dtype == object:
        value = np.asarray([v.decode() for v in value.ravel()],
                           dtype=str).reshape(value.shape)
    return value


def _table_arrays(name, table, rank) -> Dict[str, np.ndarray]:
    """What this worker stores for one table (prefix `name/`)."""
    if _is_ev(table):
        # The EV's own checkpoint tensors: keys, values, freqs, versions,
        # slots (per key) and slot_names, slot_inits, step (per variable).
        arrays = {f"{name}/{f}": _to_numpy(t)
                  for f, t in table._serialize_to_tensors().items()}
        # New keys start from these rows: restore them too, so keys first
        # seen after a restore get the values they would have had.
        arrays[f"{name}/default_values"] = table.default_values.numpy()
        return arrays
    if isinstance(table, ShardedVariable):
        return {f"{name}/rows": table.global_rows(),
                f"{name}/values": table.shard.numpy()}
    if rank != 0:  # replicated: identical everywhere, written once
        return {}
    return {f"{name}/rows": np.arange(table.shape[0], dtype=np.int64),
            f"{name}/values": table.numpy()}


def save_tables(directory: str, tables: Dict[str, object], step: int) -> str:
    """Writes this worker's part of `tables`; call on every worker.

    Args:
        directory: checkpoint folder (shared by all workers).
        tables: name -> `ShardedVariable`, `tf.Variable` or
            `EmbeddingVariable`; names must be the same on every worker.
        step: number used in the checkpoint folder's name.

    Returns:
        The path of the finished checkpoint.

    Raises:
        RuntimeError: any worker failed to write (the previous checkpoint
            stays `latest`); the error names the failure on this worker.
    """
    rank, size = distributed_strategy.world()
    final = os.path.join(directory, f"ckpt-{step}")
    partial = final + ".partial"
    error = None
    try:
        os.makedirs(partial, exist_ok=True)
        arrays = {"num_shards": np.asarray(size)}
        for name, table in tables.items():
            arrays.update(_table_arrays(name, table, rank))
        path = os.path.join(partial, f"shard-{rank}-of-{size}.npz")
        with open(path + ".tmp", "wb") as f:
            np.savez(f, **arrays)
        os.replace(path + ".tmp", path)
    except Exception as e:  # noqa: BLE001 - reported to all workers below
        error = e
    if not _barrier_all_ok(error is None):
        raise RuntimeError(
            f"Saving checkpoint {final} failed on "
            f"{'this worker: ' + repr(error) if error else 'another worker'}"
            f"; '{LATEST}' still names the previous checkpoint.")
    if rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        with open(os.path.join(directory, LATEST + ".tmp"), "w") as f:
            f.write(os.path.basename(final))
        os.replace(os.path.join(directory, LATEST + ".tmp"),
                   os.path.join(directory, LATEST))
    _barrier_all_ok(True)  # nobody reads `latest` before it moved
    return final


def latest_checkpoint(directory: str):
    """Path of the newest finished checkpoint in `directory`, or None."""
    pointer = os.path.join(directory, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(directory, f.read().strip())


def _load_shards(path):
    names = sorted(n for n in os.listdir(path) if n.endswith(".npz"))
    if not names:
        raise ValueError(f"No shard files in checkpoint {path}.")
    return [dict(np.load(os.path.join(path, n))) for n in names]


def _restore_rows(name, table, shards, rank, size):
    """Dense tables: copy the saved rows this worker now holds."""
    if isinstance(table, ShardedVariable):
        wanted = shard_rows(table.vocab_size, table.partition_strategy,
                            size, rank)
        target, vocab = table.shard, table.vocab_size
    else:
        wanted = np.arange(table.shape[0], dtype=np.int64)
        target, vocab = table, table.shape[0]
    value = np.zeros(target.shape, target.dtype.as_numpy_dtype)
    found = np.zeros(len(wanted), bool)
    position = np.full(vocab, -1, np.int64)
    position[wanted] = np.arange(len(wanted))
    for shard in shards:
        if f"{name}/rows" not in shard:
            continue
        rows, values = shard[f"{name}/rows"], shard[f"{name}/values"]
        if values.shape[1:] != tuple(target.shape[1:]) or rows.max(
                initial=-1) >= vocab:
            raise ValueError(
                f"Table '{name}': checkpoint rows/dim {values.shape} do not "
                f"fit the table's shape [{vocab}, {target.shape[1]}].")
        at = position[rows]
        keep = at >= 0
        value[at[keep]] = values[keep]
        found[at[keep]] = True
    if not found.all():
        raise ValueError(f"Table '{name}': checkpoint lacks "
                         f"{int((~found).sum())} of this worker's rows.")
    target.assign(value)


_EV_PER_KEY = ("keys", "values", "freqs", "versions", "slots")
_EV_PER_VARIABLE = ("slot_names", "slot_inits", "step")


def _restore_ev(name, table, shards, rank, size):
    """EVs: merge every worker's keys, keep those this worker owns."""
    fields = _EV_PER_KEY
    parts = {f: [] for f in fields}
    meta = None
    for shard in shards:
        if f"{name}/keys" not in shard:
            continue
        keys = shard[f"{name}/keys"]
        mine = np.mod(keys, size) == rank
        for f in fields:
            parts[f].append(shard[f"{name}/{f}"][mine])
        meta = shard
    if meta is None:
        raise ValueError(f"EmbeddingVariable '{name}' is not in the "
                         "checkpoint.")
    restored = {f: tf.convert_to_tensor(np.concatenate(parts[f]))
                for f in fields}
    for f in _EV_PER_VARIABLE:
        restored[f] = tf.convert_to_tensor(meta[f"{name}/{f}"])
    table._restore_from_tensors(restored)
    table.default_values.assign(meta[f"{name}/default_values"])


def restore_tables(path: str, tables: Dict[str, object]):
    """Loads `tables` from a checkpoint written at any worker count.

    Args:
        path: a checkpoint folder, or a directory holding `latest`.
        tables: name -> table, as given to `save_tables` (the layout, i.e.
            the number of workers, may differ).

    Raises:
        ValueError: no checkpoint, a table missing from it, or rows that do
            not fit the table.
    """
    if os.path.exists(os.path.join(path, LATEST)):
        path = latest_checkpoint(path)
    rank, size = distributed_strategy.world()
    shards = _load_shards(path)
    for name, table in tables.items():
        if _is_ev(table):
            owner_size = size if distributed_strategy.is_collective() else 1
            _restore_ev(name, table, shards, rank % owner_size, owner_size)
        else:
            _restore_rows(name, table, shards, rank, size)
