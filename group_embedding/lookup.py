"""Public grouped lookups: `group_embedding_lookup_sparse` and
`group_embedding_lookup`.

A lookup reads prepare -> plan -> run: `lookup_inputs` checks and converts
the arguments once (`PreparedInputs`); `lookup_plan` groups the tables by
(dim, dtype, storage kind) and decides once per call which backend serves
each group, from one capability snapshot; `_DISPATCH` below maps each
group's (kind, backend, mode) to the one function that runs its ONE fused
lookup, whatever its number of tables. Results come back in the order of
`params`.
"""

import dataclasses
import sys
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple
from typing import Union

import tensorflow as tf

from group_embedding import lookup_inputs
from group_embedding import lookup_plan
from group_embedding import model_parallel
from group_embedding.lookup_plan import Backend
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import Mode
from group_embedding.lookup_plan import TableGroup
from group_embedding.lookup_plan import TableKind
from group_embedding.ops import hbm_ev_storage
from group_embedding.ops import lookup_kernels
from group_embedding.ops import lookup_tf
from group_embedding.ops.ragged_ids import FeatureIds
from group_embedding.packed_ids import PackedIds


def group_embedding_lookup_sparse(
        params: Sequence[Any], sp_ids: Union[Sequence[Any], PackedIds],
        combiners: Union[str, Sequence[str]],
        sp_weights: Optional[Sequence[Any]] = None,
        partition_strategy: str = "mod", is_sequence: bool = False,
        params_num_per_group: int = sys.maxsize,
        name: Optional[str] = None, *, max_norm: Any = None,
        training: Any = True, concat_outputs: bool = False
) -> Union[List[tf.Tensor], tf.Tensor]:
    """Looks up and pools many embedding tables with one fused op per group.

    Row b of output i equals stock
    `tf.nn.embedding_lookup_sparse(params[i], sp_ids[i], sp_weights[i],
    combiner=combiners[i], max_norm=max_norm)` for that row (zeros for an
    empty row), forward and backward.

    Shapes: K tables, B rows per batch, D embedding dim of a table,
    T padded row length (for `is_sequence=True`).

    Example::

        # 2 features x batch of 3:      row 0     row 1   row 2
        #   sp_ids[0] (user, one-hot)   [7]       [2]     []
        #   sp_ids[1] (tags, multi-hot) [1, 4]    []      [4, 4, 9]
        user, tags = ge.group_embedding_lookup_sparse(
            [user_table, tag_table], [user_ids, tag_ids], ["sum", "mean"])
        # user: [3, D_user], tags: [3, D_tags]; row 1 of tags is zeros.

    Args:
        params: list of K tables: `tf.Variable`/`keras.Variable` of shape
            `[vocab_i, D_i]`, or `EmbeddingVariable`. Tables with equal D,
            dtype and kind are fused into one lookup.
        sp_ids: list of K id batches, each a `tf.SparseTensor [B, T]` (indices
            in any order, duplicate ids allowed) or `tf.RaggedTensor
            [B, None]`, int32 or int64. For a `tf.Variable` table every id
            must lie in `[0, vocab_i)`. Or all K at once as the
            `PackedIds` of `ge.pack_ids` (packed in the input pipeline:
            cheaper to pass into a `tf.function` step, nothing left to
            convert).
        combiners: "sum", "mean" or "sqrtn", one per table, or one string
            for all; honoured per table even inside one group.
        sp_weights: None, or a list of K entries, each None or float weights
            of the same kind and layout as the matching ids (None with
            `PackedIds`, which carry their weights).
        partition_strategy: "mod" (default) or "div": which shard owns an id
            once tables are sharded (collective mode); validated always.
        is_sequence: if True, return unpooled `[B, T, D]` tensors (zeros at
            padding; weights multiply their rows, combiners are unused).
        params_num_per_group: at most this many tables per fused op
            (default: no cap). On CPU a smaller value yields several
            smaller ops that TF can run concurrently on its inter-op
            threads; a bigger one means fewer ops and less overhead, while
            the C++ kernel already spreads one op over all intra-op
            threads. Keep the default unless profiling says otherwise.
        name: optional name scope.
        max_norm: (keyword only) if set, each looked-up row whose L2 norm
            exceeds it is rescaled to `max_norm` before pooling.
        training: (keyword only) Python or tensor bool, default True. For
            `EmbeddingVariable` params, True inserts keys seen for the
            first time and counts occurrences; False (inference) inserts
            nothing and reads default rows for unknown keys. Ignored by
            `tf.Variable` params.
        concat_outputs: (keyword only) if True, return ONE `[B, sum_i D_i]`
            tensor, the K pooled outputs side by side in the order of
            `params`: what `tf.concat(outputs, 1)` gives, which is what a
            model feeding a dense layer wants. The fused CPU kernel then
            writes each table's rows straight into their columns, and reads
            its gradient from there: no concat copy, no split of the
            gradient. Needs pooled lookups (`is_sequence=False`).

    Returns:
        A list of K dense tensors, `[B, D_i]` (or `[B, T_i, D_i]`), in the
        order of `params`; one `[B, sum_i D_i]` tensor with
        `concat_outputs=True`.

    Raises:
        TypeError: a table is not a variable, ids are not integers, weights
            are not floats, or an id batch is neither Sparse nor Ragged.
        ValueError: lists of different lengths, unknown combiner or
            partition strategy, rank != 2 ids, or batch sizes that differ.
        tf.errors.InvalidArgumentError: (at run time) an id outside
            `[0, vocab)` of its table, or batch sizes that differ.
    """
    call = LookupCall(
        mode=lookup_inputs.lookup_mode(is_sequence, concat_outputs),
        max_norm=max_norm, training=training,
        partition_strategy=partition_strategy)
    with tf.name_scope(name or "group_embedding_lookup_sparse"):
        inputs = lookup_inputs.prepare_sparse(
            params, sp_ids, combiners, sp_weights, call,
            params_num_per_group)
        return lookup_feature_ids(inputs.tables, inputs.feats,
                                  inputs.combiners, inputs.names, call,
                                  params_num_per_group)


# One entry of the dispatch table: run(group, call) -> the group's outputs.
_Run = Callable[[TableGroup, LookupCall], Any]


def _collective(kind_fn: str) -> _Run:
    def run(group: TableGroup, call: LookupCall) -> Any:
        runtime = model_parallel.runtime()
        return getattr(runtime, kind_fn)(group, call)
    return run


def _concat_of(pooled: _Run) -> _Run:
    # Concatenated outputs from per-table ones (backends without a
    # concatenating kernel).
    return lambda g, c: tf.concat(pooled(g, c), 1)


def _variables_kernel_pooled(g: TableGroup, c: LookupCall) -> Any:
    return lookup_kernels.pooled_variables(g.tables, g.feats, g.combiners,
                                           g.names, c.max_norm,
                                           c.ids_checked)


def _variables_tf_pooled(g: TableGroup, c: LookupCall) -> Any:
    return lookup_tf.pooled_variables(g.tables, g.feats, g.combiners,
                                      g.names, c.max_norm)


def _ev_kernel_pooled(g: TableGroup, c: LookupCall) -> Any:
    return lookup_kernels.pooled_ev(g.tables, g.feats, g.combiners,
                                    c.training)


def _ev_tf_pooled(g: TableGroup, c: LookupCall) -> Any:
    return lookup_tf.pooled_ev(g.tables, g.feats, g.combiners, c.max_norm,
                               c.training)


def _hbm_ev_pooled(g: TableGroup, c: LookupCall) -> Any:
    return hbm_ev_storage.pooled_lookup(
        g.capabilities.hbm_ev_module(g.names), g.tables, g.feats,
        g.combiners, c.max_norm, c.training)


_Key = Tuple[TableKind, Backend, Mode]


def _variable_entries(backend: Backend) -> Dict[_Key, _Run]:
    return {
        (TableKind.VARIABLE, backend, Mode.POOLED): _variables_kernel_pooled,
        (TableKind.VARIABLE, backend, Mode.CONCAT): lambda g, c:
            lookup_kernels.concat_variables(g.tables, g.feats, g.combiners,
                                            g.names, c.max_norm,
                                            c.ids_checked),
        (TableKind.VARIABLE, backend, Mode.SEQUENCE): lambda g, c:
            lookup_kernels.sequence_variables(g.tables, g.feats, g.names,
                                              c.max_norm, c.ids_checked),
    }


# (kind, backend, mode) -> run(group, call): the only place a lookup's
# path is chosen. The CPU and GPU kernels are the same TF ops (TF runs
# the kernel of the device the tables live on).
_DISPATCH: Dict[_Key, _Run] = {
    **_variable_entries(Backend.CPU_KERNELS),
    **_variable_entries(Backend.GPU_KERNELS),
    (TableKind.VARIABLE, Backend.TF_OPS, Mode.POOLED): _variables_tf_pooled,
    (TableKind.VARIABLE, Backend.TF_OPS, Mode.CONCAT):
        _concat_of(_variables_tf_pooled),
    (TableKind.VARIABLE, Backend.TF_OPS, Mode.SEQUENCE):
        lambda g, c: lookup_tf.sequence_variables(g.tables, g.feats,
                                                  g.names, c.max_norm),
    (TableKind.EV, Backend.CPU_KERNELS, Mode.POOLED): _ev_kernel_pooled,
    (TableKind.EV, Backend.CPU_KERNELS, Mode.CONCAT):
        _concat_of(_ev_kernel_pooled),
    (TableKind.EV, Backend.CPU_KERNELS, Mode.SEQUENCE):
        lambda g, c: lookup_kernels.sequence_ev(g.tables, g.feats,
                                                c.training),
    (TableKind.HBM_EV, Backend.GPU_KERNELS, Mode.POOLED): _hbm_ev_pooled,
    (TableKind.HBM_EV, Backend.GPU_KERNELS, Mode.CONCAT):
        _concat_of(_hbm_ev_pooled),
    (TableKind.HBM_EV, Backend.GPU_KERNELS, Mode.SEQUENCE):
        lambda g, c: hbm_ev_storage.sequence_lookup(
            g.capabilities.hbm_ev_module(g.names), g.tables, g.feats,
            c.max_norm, c.training),
    # Inside a SavedModel save only: the frozen snapshots' stock ops.
    (TableKind.HBM_EV, Backend.TF_OPS, Mode.POOLED): _ev_tf_pooled,
    (TableKind.HBM_EV, Backend.TF_OPS, Mode.CONCAT):
        _concat_of(_ev_tf_pooled),
    (TableKind.HBM_EV, Backend.TF_OPS, Mode.SEQUENCE):
        lambda g, c: lookup_tf.sequence_ev(g.tables, g.feats, c.max_norm,
                                           c.training),
    (TableKind.EV, Backend.TF_OPS, Mode.POOLED): _ev_tf_pooled,
    (TableKind.EV, Backend.TF_OPS, Mode.CONCAT): _concat_of(_ev_tf_pooled),
    (TableKind.EV, Backend.TF_OPS, Mode.SEQUENCE):
        lambda g, c: lookup_tf.sequence_ev(g.tables, g.feats, c.max_norm,
                                           c.training),
}
for _kind in (TableKind.SHARDED, TableKind.EV, TableKind.HBM_EV):
    _DISPATCH[(_kind, Backend.COLLECTIVE, Mode.POOLED)] = (
        _collective("pooled_lookup"))
    _DISPATCH[(_kind, Backend.COLLECTIVE, Mode.CONCAT)] = (
        _concat_of(_collective("pooled_lookup")))
    _DISPATCH[(_kind, Backend.COLLECTIVE, Mode.SEQUENCE)] = (
        _collective("sequence_lookup"))


def run_group(group: TableGroup, call: LookupCall) -> Any:
    """Runs one planned group: a list of per-table outputs, or for
    `call.mode == CONCAT` one `[B, sum D]` tensor."""
    return _DISPATCH[(group.kind, group.backend, call.mode)](group, call)


def lookup_feature_ids(tables: Sequence[Any], feats: Sequence[FeatureIds],
                       combiners: Sequence[str], names: Sequence[str],
                       call: LookupCall,
                       params_num_per_group: int = sys.maxsize) -> Any:
    """Plans and runs a lookup of prepared tables and ids.

    With `call.mode == CONCAT`, returns one tensor: the pooled outputs
    concatenated in the order of `tables`; a group whose tables are
    consecutive there gives its columns with one concatenated lookup.
    Else the per-table outputs, in order. (The collective layer's owners
    look their received ids up through this too.)
    """
    concat = call.mode == Mode.CONCAT
    # A group whose members are not adjacent cannot give one block.
    pooled = dataclasses.replace(call, mode=Mode.POOLED)
    groups = lookup_plan.group_tables(tables, feats, names, combiners,
                                      call, params_num_per_group)
    outputs: List[Optional[tf.Tensor]] = [None] * len(tables)
    # With `concat`: first table index -> columns of consecutive tables.
    blocks: Dict[int, tf.Tensor] = {}
    check = _check_gpu_ids_once(groups)
    for g in groups:
        g_call, g_pooled, deps = call, pooled, []
        if check is not None and g.backend == Backend.GPU_KERNELS:
            g_call = dataclasses.replace(call, ids_checked=True)
            g_pooled = dataclasses.replace(pooled, ids_checked=True)
            deps = [check]
        with tf.control_dependencies(deps):
            if concat and g.consecutive:
                blocks[g.members[0]] = run_group(g, g_call)
                continue
            for i, out in zip(g.members,
                              run_group(g, g_pooled if concat else g_call)):
                outputs[i] = out
                blocks[i] = out
    if not concat:
        return outputs
    parts = [blocks[i] for i in sorted(blocks)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, 1)


def _check_gpu_ids_once(groups: Sequence[TableGroup]) -> Any:
    """One `GroupEmbeddingCheckIds` for the call's groups of plain
    variables on the GPU kernels when there are several (issue 35.3: a
    traced step then waits for its stream once, not once per group), or
    None: one group checks its own ids with its one wait, and eager ops
    run one by one anyway."""
    gpu = [g for g in groups if g.kind == TableKind.VARIABLE
           and g.backend == Backend.GPU_KERNELS]
    if len(gpu) < 2 or tf.executing_eagerly():
        return None
    return lookup_kernels.check_ids(
        [t for g in gpu for t in g.tables], [f for g in gpu for f in g.feats],
        [n for g in gpu for n in g.names])


def group_embedding_lookup(params: Sequence[Any], ids: Sequence[Any],
                           partition_strategy: str = "mod",
                           name: Optional[str] = None, *,
                           training: Any = True) -> List[tf.Tensor]:
    """Looks up dense id tensors in many tables, one fused op per group.

    Output i equals `tf.nn.embedding_lookup(params[i], ids[i])`.

    Args:
        params: list of K tables, as in `group_embedding_lookup_sparse`.
        ids: list of K integer tensors of any shape S_i.
        partition_strategy: "mod" or "div", as in
            `group_embedding_lookup_sparse`.
        name: optional name scope.
        training: (keyword only) as in `group_embedding_lookup_sparse`:
            False stops `EmbeddingVariable` params from inserting keys.

    Returns:
        A list of K tensors of shape `S_i + [D_i]`.

    Raises:
        TypeError / ValueError: as in `group_embedding_lookup_sparse`.
    """
    call = LookupCall(mode=Mode.POOLED, training=training,
                      partition_strategy=partition_strategy)
    with tf.name_scope(name or "group_embedding_lookup"):
        inputs = lookup_inputs.prepare_dense(params, ids, partition_strategy)
        flat = lookup_feature_ids(inputs.tables, inputs.feats,
                                  inputs.combiners, inputs.names, call)
        return [tf.reshape(f, tf.concat([tf.shape(x), tf.shape(f)[1:]], 0))
                for f, x in zip(flat, inputs.dense_ids)]
