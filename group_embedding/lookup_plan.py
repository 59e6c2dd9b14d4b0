"""The plan of a grouped lookup: which tables fuse, and what serves them.

Decided once per call, before any op is built: `group_tables` splits the
tables into fusable groups and gives each a frozen `TableGroup` naming its
`TableKind` (plain variable, EmbeddingVariable, sharded table) and its
`Backend` (the C++ CPU kernels, the CUDA kernels, stock TF ops, or the
collective runtime), chosen from ONE `capabilities.Capabilities` snapshot
(kernels loaded, GPU present, GPU kernels, inside a SavedModel save) that
the group carries; `lookup.py` then calls the ONE function that its
(kind, backend, `Mode`) key names. Nothing below the plan probes a
table's type or the machine again.
"""

import dataclasses
import warnings
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Set
from typing import Tuple

import tensorflow as tf

from group_embedding import model_parallel
from group_embedding.ops import capabilities
from group_embedding.ops import lookup_kernels
from group_embedding.ops.capabilities import Capabilities
from group_embedding.ops.config import Choice
from group_embedding.ops.ragged_ids import FeatureIds


class TableKind(Choice):
    """What a table is. A table class states its own kind in
    `ge_table_kind` (EmbeddingVariable: "ev", or "hbm_ev" for one in GPU
    memory, StorageType.HBM; ShardedVariable: "sharded"); anything else
    that reaches the plan is a plain `tf.Variable`."""

    VARIABLE = "variable"
    EV = "ev"
    HBM_EV = "hbm_ev"
    SHARDED = "sharded"


class Backend(Choice):
    """What runs a group's lookup: the C++ CPU kernels, the CUDA kernels
    (the same TF ops, on GPU tables), stock TF ops, or the registered
    collective runtime (model parallel)."""

    CPU_KERNELS = "cpu_kernels"
    GPU_KERNELS = "gpu_kernels"
    TF_OPS = "tf_ops"
    COLLECTIVE = "collective"


class Mode(Choice):
    """What a lookup call returns: pooled `[B, D]` per table, one
    concatenated `[B, sum D]`, or unpooled sequences `[B, T, D]`."""

    POOLED = "pooled"
    SEQUENCE = "sequence"
    CONCAT = "concat"


@capabilities.not_converted
def table_kind(table: Any) -> TableKind:
    """The `TableKind` a table class declares (VARIABLE by default)."""
    return TableKind(getattr(table, "ge_table_kind", TableKind.VARIABLE))


@dataclasses.dataclass(frozen=True)
class LookupCall:
    """The settings of one lookup call, shared by all its groups.

    Attributes:
        mode: the `Mode` (CONCAT: pooled, one `[B, sum D]` out).
        max_norm: None, or the L2 bound rows are clipped to.
        training: Python or tensor bool (EmbeddingVariables insert keys).
        partition_strategy: "mod" or "div" (sharded tables).
        ids_checked: one `GroupEmbeddingCheckIds` checked the ids of the
            call's GPU-kernel groups (the lookup's doing, never the
            caller's): their forward ops do not wait to check again.
    """

    mode: Mode
    max_norm: Any = None
    training: Any = True
    partition_strategy: str = "mod"
    ids_checked: bool = False


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """One fused lookup: same-dim, same-dtype, same-kind tables.

    Attributes:
        members: the tables' indices in the call's `params`.
        tables: the tables (a 1-worker ShardedVariable as its shard).
        feats: their ids, one `FeatureIds` per table.
        names: their names for error messages.
        combiners: "sum" | "mean" | "sqrtn" per table.
        kind: the tables' common `TableKind`.
        backend: the `Backend` that runs the group.
        capabilities: the snapshot the backend was chosen from (what the
            backends below read instead of probing again).
    """

    members: Tuple[int, ...]
    tables: Tuple[Any, ...]
    feats: Tuple[FeatureIds, ...]
    names: Tuple[str, ...]
    combiners: Tuple[str, ...]
    kind: TableKind
    backend: Backend
    capabilities: Capabilities

    @property
    def consecutive(self) -> bool:
        """Whether the members are adjacent in `params` (their pooled
        outputs are then one block of a concatenated output)."""
        return self.members[-1] - self.members[0] + 1 == len(self.members)


def _local_table(table: Any) -> Any:
    """A sharded table that one worker holds whole plans as its shard: the
    single-process path (collective mode with one worker)."""
    if table_kind(table) == TableKind.SHARDED and table.num_shards == 1:
        return table.shard_variable
    return table


def _group_key(table: Any) -> Tuple[int, tf.DType, TableKind]:
    return (int(table.shape[-1]), table.dtype, table_kind(table))


def kernel_eligible(tables: Sequence[Any], max_norm: Any,
                    found: Optional[Capabilities] = None) -> bool:
    """Whether the variable lookup kernels (CPU, or CUDA with a GPU) can
    serve these plain variables, given `found` (default: the current
    `capabilities` snapshot).

    With a GPU, the lookup ops run where the tables live: on the GPU
    through the GPU kernels when they are loaded (every mode, weighted or
    not, with or without `max_norm`: the backward's clip, snapshot and
    weight-gradient ops have GPU kernels too), else the pure-TF path
    (whose ops TF has GPU kernels for). Both kernels take float32 tables
    and a `max_norm` that is a number >= 0.
    """
    if lookup_kernels.kernel_max_norm(max_norm) is None:
        return False
    found = found or capabilities.current()
    if found.gpu and not found.use_gpu_kernels():
        return False
    return all(is_kernel_dtype(t) for t in tables)


def is_kernel_dtype(table: Any) -> bool:
    """Whether the kernels take this table: a float32 `tf.Variable`."""
    return isinstance(table, tf.Variable) and table.dtype == tf.float32


_warned_groups: Set[Tuple[str, ...]] = set()


def _warn_pure_tf_on_gpu(names: Sequence[str],
                         tables: Sequence[Any]) -> None:
    """One warning per group (per process) whose tables the GPU kernels
    cannot take because of their dtype, naming its tables."""
    key = tuple(names)
    if key in _warned_groups:
        return
    _warned_groups.add(key)
    dtypes = sorted({t.dtype.name for t in tables if not is_kernel_dtype(t)})
    warnings.warn(
        f"group-embedding: the group of tables {', '.join(key)} runs the "
        f"pure-TF path on the GPU: the GPU kernels take float32 tables, "
        f"got {', '.join(dtypes)}.", RuntimeWarning, stacklevel=3)


def _backend(kind: TableKind, tables: Sequence[Any],
             feats: Sequence[FeatureIds], names: Sequence[str],
             call: LookupCall, found: Capabilities) -> Backend:
    if kind == TableKind.SHARDED:
        return Backend.COLLECTIVE
    if kind == TableKind.HBM_EV:
        return _hbm_backend(names, call, found)
    if kind == TableKind.EV:
        runtime = model_parallel.runtime()
        if runtime is not None and runtime.size > 1:
            # Every key is owned by worker `key mod N`.
            return Backend.COLLECTIVE
        if (found.kernels is not None and call.max_norm is None
                and (call.mode != Mode.SEQUENCE
                     or all(f.weights is None for f in feats))):
            return Backend.CPU_KERNELS
        return Backend.TF_OPS
    if (found.kernels is None
            or not kernel_eligible(tables, call.max_norm, found)):
        if (found.gpu
                and lookup_kernels.kernel_max_norm(call.max_norm) is not None
                and not all(is_kernel_dtype(t) for t in tables)
                and found.use_gpu_kernels()):
            _warn_pure_tf_on_gpu(names, tables)
        return Backend.TF_OPS
    return Backend.GPU_KERNELS if found.gpu else Backend.CPU_KERNELS


def _hbm_backend(names: Sequence[str], call: LookupCall,
                 found: Capabilities) -> Backend:
    """HBM EVs (their tables in GPU memory) run the GPU library's HBM EV
    ops (on the host stand-in in tests). In collective mode, as DRAM
    EVs, the collective backend: worker `key mod N` owns a key and looks
    up what it receives with those ops (collective_lookup). Inside a
    SavedModel save, the stock-TF path, which reads the EVs' frozen
    snapshots as for DRAM EVs (export/ev_snapshot.py).

    Raises:
        RuntimeError: no GPU kernels serve HBM EVs here (naming the EVs).
        NotImplementedError: a tensor max_norm outside collective mode
            (naming the EVs): the HBM lookup op takes a number.
    """
    runtime = model_parallel.runtime()
    if runtime is not None and runtime.size > 1:
        if not found.in_save:
            found.hbm_ev_module(names)
        return Backend.COLLECTIVE
    if found.in_save:
        return Backend.TF_OPS
    found.hbm_ev_module(names)
    if lookup_kernels.kernel_max_norm(call.max_norm) is None:
        raise NotImplementedError(
            f"{', '.join(names)}: StorageType.HBM tables do not support "
            f"a max_norm that is not a number >= 0 yet.")
    return Backend.GPU_KERNELS


def group_tables(tables: Sequence[Any], feats: Sequence[FeatureIds],
                 names: Sequence[str], combiners: Sequence[str],
                 call: LookupCall,
                 params_num_per_group: int) -> List[TableGroup]:
    """Splits the tables into fusable groups and plans each.

    Tables of the same dim, dtype and kind share a group, in input order;
    a group holds at most `params_num_per_group` tables. Every group's
    backend is chosen from one `capabilities.current()` snapshot, which
    the group carries.

    Args:
        tables: the checked tables (`lookup_inputs.prepare_tables`).
        feats: their ids, one `FeatureIds` per table.
        names: their names for error messages.
        combiners: one combiner per table.
        call: the call's settings (mode, max_norm, ...).
        params_num_per_group: the largest group.

    Returns:
        The groups, in the order of their first member.

    Raises:
        ValueError: a table sharded over several workers outside
            collective mode (naming it).
        RuntimeError: kernels required by `GROUP_EMBEDDING_KERNELS`
            (custom, cuda) cannot be had (see `capabilities.current`).
    """
    tables = [_local_table(t) for t in tables]
    runtime = model_parallel.runtime()
    by_key: Dict[Tuple[int, tf.DType, TableKind], List[int]] = {}
    for i, t in enumerate(tables):
        if table_kind(t) == TableKind.SHARDED and runtime is None:
            raise ValueError(
                f"{names[i]} is sharded over {t.num_shards} workers but "
                "collective mode is not enabled: call "
                "ge.enable_distributed_strategy('collective') first.")
        by_key.setdefault(_group_key(t), []).append(i)
    found = capabilities.current()
    groups = []
    for (_, _, kind), members in by_key.items():
        for s in range(0, len(members), params_num_per_group):
            part = tuple(members[s:s + params_num_per_group])
            g_tables = tuple(tables[i] for i in part)
            g_feats = tuple(feats[i] for i in part)
            g_names = tuple(names[i] for i in part)
            groups.append(TableGroup(
                members=part, tables=g_tables, feats=g_feats, names=g_names,
                combiners=tuple(combiners[i] for i in part), kind=kind,
                backend=_backend(kind, g_tables, g_feats, g_names, call,
                                 found),
                capabilities=found))
    return groups


def describe(groups: Sequence[TableGroup]) -> List[Dict[str, Any]]:
    """The plan as plain values (for `python -m group_embedding`, tests
    and debugging): per group its members, kind and backend."""
    return [{"members": list(g.members), "names": list(g.names),
             "kind": g.kind.value, "backend": g.backend.value}
            for g in groups]

