"""Public grouped lookups: `group_embedding_lookup_sparse` and
`group_embedding_lookup`.

Tables are grouped by (dim, dtype, storage kind); each group runs ONE fused
lookup, whatever its number of tables: `lookup_plan` decides once per
call which backend serves each group, and `_DISPATCH` below maps its
(kind, backend, mode) to the one function that runs it. Results come back
in the order of `params`.
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
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import TableGroup
from group_embedding.ops import lookup_kernels
from group_embedding.ops import lookup_tf
from group_embedding.ops import ragged_ids
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
    if concat_outputs and is_sequence:
        raise ValueError("`concat_outputs=True` concatenates pooled [B, D] "
                         "outputs; it cannot be used with "
                         "`is_sequence=True`.")
    packed = None
    if isinstance(sp_ids, PackedIds):
        packed = _check_packed(params, sp_ids, sp_weights)
        sp_ids, sp_weights = [packed.values] * len(params), None
    params, sp_ids, combiners, sp_weights = lookup_inputs.check_lists(
        params, sp_ids, combiners, sp_weights, partition_strategy,
        params_num_per_group)
    _check_ev_keys(params, sp_ids, "sp_ids")
    with tf.name_scope(name or "group_embedding_lookup_sparse"):
        if packed is not None:
            sp_ids = ragged_ids.from_packed(
                packed.values, packed.row_splits, packed.offsets,
                packed.batch,
                packed.weights if packed.weighted else None, len(params),
                is_sequence)
        mode = (lookup_plan.SEQUENCE if is_sequence
                else lookup_plan.CONCAT if concat_outputs
                else lookup_plan.POOLED)
        call = LookupCall(mode=mode, max_norm=max_norm, training=training,
                          partition_strategy=partition_strategy)
        return _grouped_lookup(params, sp_ids, combiners, sp_weights, call,
                               params_num_per_group, same_batch=True)


def _check_packed(params: Sequence[Any], packed: PackedIds,
                  sp_weights: Any) -> PackedIds:
    """Static checks of `PackedIds` ids against the tables."""
    if sp_weights is not None:
        raise ValueError("Packed `sp_ids` carry their weights: pass them to "
                         "`ge.pack_ids` and leave `sp_weights` None.")
    k = packed.num_features
    if k is not None and k != len(params):
        raise ValueError(f"Packed `sp_ids` hold {k} features but `params` "
                         f"has {len(params)} tables.")
    return packed


def _check_ev_keys(params: Sequence[Any], ids: Sequence[Any],
                   argument: str) -> None:
    # EmbeddingVariables check their own key dtype, so that the error
    # names the variable (int64 keys into an int32 EV, float keys).
    for i, (p, x) in enumerate(zip(params, ids)):
        if is_embedding_variable(p):
            p.check_keys(x, f"{argument}[{i}]")


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


def _variable_entries(backend: str) -> Dict[Tuple[str, str, str], _Run]:
    key = (lookup_plan.VARIABLE, backend)
    return {
        key + (lookup_plan.POOLED,): _variables_kernel_pooled,
        key + (lookup_plan.CONCAT,): lambda g, c:
            lookup_kernels.concat_variables(g.tables, g.feats, g.combiners,
                                            g.names, c.max_norm,
                                            c.ids_checked),
        key + (lookup_plan.SEQUENCE,): lambda g, c:
            lookup_kernels.sequence_variables(g.tables, g.feats, g.names,
                                              c.max_norm, c.ids_checked),
    }


# (kind, backend, mode) -> run(group, call): the only place a lookup's
# path is chosen. The CPU and GPU kernels are the same TF ops (TF runs
# the kernel of the device the tables live on).
_DISPATCH: Dict[Tuple[str, str, str], _Run] = {
    **_variable_entries(lookup_plan.CPU_KERNELS),
    **_variable_entries(lookup_plan.GPU_KERNELS),
    (lookup_plan.VARIABLE, lookup_plan.TF_OPS, lookup_plan.POOLED):
        _variables_tf_pooled,
    (lookup_plan.VARIABLE, lookup_plan.TF_OPS, lookup_plan.CONCAT):
        _concat_of(_variables_tf_pooled),
    (lookup_plan.VARIABLE, lookup_plan.TF_OPS, lookup_plan.SEQUENCE):
        lambda g, c: lookup_tf.sequence_variables(g.tables, g.feats,
                                                  g.names, c.max_norm),
    (lookup_plan.EV, lookup_plan.CPU_KERNELS, lookup_plan.POOLED):
        _ev_kernel_pooled,
    (lookup_plan.EV, lookup_plan.CPU_KERNELS, lookup_plan.CONCAT):
        _concat_of(_ev_kernel_pooled),
    (lookup_plan.EV, lookup_plan.CPU_KERNELS, lookup_plan.SEQUENCE):
        lambda g, c: lookup_kernels.sequence_ev(g.tables, g.feats,
                                                c.training),
    (lookup_plan.EV, lookup_plan.TF_OPS, lookup_plan.POOLED): _ev_tf_pooled,
    (lookup_plan.EV, lookup_plan.TF_OPS, lookup_plan.CONCAT):
        _concat_of(_ev_tf_pooled),
    (lookup_plan.EV, lookup_plan.TF_OPS, lookup_plan.SEQUENCE):
        lambda g, c: lookup_tf.sequence_ev(g.tables, g.feats, c.max_norm,
                                           c.training),
}
for _kind in (lookup_plan.SHARDED, lookup_plan.EV):
    _DISPATCH[(_kind, lookup_plan.COLLECTIVE, lookup_plan.POOLED)] = (
        _collective("pooled_lookup"))
    _DISPATCH[(_kind, lookup_plan.COLLECTIVE, lookup_plan.CONCAT)] = (
        _concat_of(_collective("pooled_lookup")))
    _DISPATCH[(_kind, lookup_plan.COLLECTIVE, lookup_plan.SEQUENCE)] = (
        _collective("sequence_lookup"))


def run_group(group: TableGroup, call: LookupCall) -> Any:
    """Runs one planned group: a list of per-table outputs, or for
    `call.mode == CONCAT` one `[B, sum D]` tensor."""
    return _DISPATCH[(group.kind, group.backend, call.mode)](group, call)


def lookup_feature_ids(tables: Sequence[Any], feats: Sequence[FeatureIds],
                       combiners: Sequence[str], names: Sequence[str],
                       call: LookupCall,
                       params_num_per_group: int = sys.maxsize) -> Any:
    """Plans and runs a lookup of checked tables and converted ids.

    With `call.mode == CONCAT`, returns one tensor: the pooled outputs
    concatenated in the order of `tables`; a group whose tables are
    consecutive there gives its columns with one concatenated lookup.
    Else the per-table outputs, in order. (The collective layer's owners
    look their received ids up through this too.)
    """
    concat = call.mode == lookup_plan.CONCAT
    # A group whose members are not adjacent cannot give one block.
    pooled = dataclasses.replace(call, mode=lookup_plan.POOLED)
    groups = lookup_plan.group_tables(tables, feats, names, combiners,
                                      call, params_num_per_group)
    outputs: List[Optional[tf.Tensor]] = [None] * len(tables)
    # With `concat`: first table index -> columns of consecutive tables.
    blocks: Dict[int, tf.Tensor] = {}
    check = _check_gpu_ids_once(groups)
    for g in groups:
        g_call, g_pooled, deps = call, pooled, []
        if check is not None and g.backend == lookup_plan.GPU_KERNELS:
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
    gpu = [g for g in groups if g.kind == lookup_plan.VARIABLE
           and g.backend == lookup_plan.GPU_KERNELS]
    if len(gpu) < 2 or tf.executing_eagerly():
        return None
    return lookup_kernels.check_ids(
        [t for g in gpu for t in g.tables], [f for g in gpu for f in g.feats],
        [n for g in gpu for n in g.names])


def _grouped_lookup(params: Sequence[Any], sp_ids: Sequence[Any],
                    combiners: Sequence[str], sp_weights: Any,
                    call: LookupCall, params_num_per_group: int,
                    same_batch: bool) -> Any:
    """Converts and checks the ids, then `lookup_feature_ids`."""
    tables = [lookup_inputs.unwrap_table(p, i) for i, p in enumerate(params)]
    names = [lookup_inputs.table_name(t, i) for i, t in enumerate(tables)]
    feats = lookup_inputs.to_feature_ids(
        sp_ids, sp_weights,
        need_positions=call.mode == lookup_plan.SEQUENCE,
        same_batch=same_batch)
    return lookup_feature_ids(tables, feats, combiners, names, call,
                              params_num_per_group)


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
    if not isinstance(ids, (list, tuple)):
        raise TypeError("`ids` must be a list (one entry per table), got "
                        f"{type(ids).__name__}.")
    dense = []
    for i, x in enumerate(ids):
        if isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(f"`ids[{i}]` must be a dense tensor; use "
                            "group_embedding_lookup_sparse for "
                            f"{type(x).__name__} ids.")
        x = tf.convert_to_tensor(x)
        if isinstance(params, (list, tuple)) and i < len(params) \
                and is_embedding_variable(params[i]):
            params[i].check_keys(x, f"ids[{i}]")
        if not x.dtype.is_integer:
            raise TypeError(f"`ids[{i}]` must hold int32 or int64 ids, got "
                            f"{x.dtype.name}.")
        dense.append(x)
    params, ragged, combiners, weights = lookup_inputs.check_lists(
        params, [ragged_ids.one_id_rows(x) for x in dense], "sum", None,
        partition_strategy, sys.maxsize, ids_argument="ids")
    with tf.name_scope(name or "group_embedding_lookup"):
        call = LookupCall(mode=lookup_plan.POOLED, training=training,
                          partition_strategy=partition_strategy)
        flat = _grouped_lookup(params, ragged, combiners, weights, call,
                               sys.maxsize, same_batch=False)
        return [tf.reshape(f, tf.concat([tf.shape(x), tf.shape(f)[1:]], 0))
                for f, x in zip(flat, dense)]
