"""Python side of the collective lookup kernels (`kernels/collective_ops.cc`).

The model-parallel lookup of `group_embedding.distributed.collective_lookup`
runs, per step and worker:

1. `route_ids`: ONE op dedups the ids of all tables and buckets the distinct
   ids by owner worker into one int64 send buffer (per owner: K counts,
   then the local rows table by table), plus, per id, the float offset of
   its row in the rows buffer that will come back;
2. an `alltoall` of that buffer;
3. `owner_gather`: the owner copies the asked rows of its shards into one
   flat float buffer, source by source (its gradient gives each shard its
   distinct rows with summed gradients: IndexedSlices);
4. an `alltoall` of the rows back;
5. `pool`: each feature's rows are pooled from that buffer into `[B, D]`
   (its gradient sums the pooled gradients into one row per distinct id,
   reusing the router's offsets: no second dedup, no `[nnz, D]` tensor).

Every function here needs the C++ kernels (`library()` is not None).
"""

import weakref
from typing import Any
from typing import Dict
from typing import List
from typing import Sequence
from typing import Tuple

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from group_embedding.ops import capabilities
from group_embedding.ops import kernel_library
from group_embedding.ops import op_names
from group_embedding.ops.ragged_ids import FeatureIds


def library():
    """The kernel module when it holds the collective ops, else None.

    None under `GROUP_EMBEDDING_KERNELS=tf`, when the kernels cannot be
    built, or with a kernel library built before these ops existed.
    """
    found = capabilities.current()
    return found.kernels if found.collective_routing else None


def _kernels():
    # Gradients run with whatever library served the forward op.
    if capabilities.ROUTING_OP not in capabilities.library_ops():
        raise RuntimeError("The collective lookup kernels are not loaded; "
                           f"run `{kernel_library.DIAGNOSE_COMMAND}`.")
    return kernel_library.library()


def route_ids(ids: Sequence[tf.Tensor], vocab_sizes: Sequence[int],
              dims: Sequence[int], partitions: Sequence[str],
              num_workers: int, table_names: Sequence[str]):
    """Dedups and buckets the ids of K tables by owner worker.

    Args:
        ids: K int64 vectors `[nnz_t]` of global row ids.
        vocab_sizes: rows V_t of each whole table (ids must be in [0, V_t)).
        dims: row width D_t of each table (tables may differ).
        partitions: "mod" (row r on worker r % N, local row r // N),
            "div" (blocks of ceil(V / N) rows) or "table:R" (every row on
            worker R, local row r; 0 <= R < N) per table.
        num_workers: N.
        table_names: for error messages.

    Returns:
        (send_ids int64 `[N * K + distinct ids]`, send_splits int32 `[N]`,
        row_offsets: K int64 `[nnz_t]`, the float offset of each id's row
        in the buffer `owner_gather` returns through the alltoall).

    Raises:
        tf.errors.InvalidArgumentError: an invalid partition or a
            table-wise rank outside [0, N) (when the op is built); (at run
            time) an id outside `[0, V_t)`. Both name the table.
    """
    send, splits, offsets = _kernels().group_embedding_collective_route_ids(
        ids=list(ids), num_workers=int(num_workers),
        vocab_sizes=[int(v) for v in vocab_sizes],
        dims=[int(d) for d in dims], partitions=list(partitions),
        table_names=list(table_names))
    return send, splits, list(offsets)


def owner_gather(shards: Sequence[tf.Variable], received_ids: tf.Tensor,
                 received_splits: tf.Tensor, dims: Sequence[int],
                 table_names: Sequence[str]):
    """The rows asked by every source worker, from this worker's shards.

    Args:
        shards: K float32 `[rows_t, D_t]` resource variables (this worker's
            shard of each table, in `route_ids` order).
        received_ids: int64, what the alltoall of `route_ids`' send buffer
            delivered here.
        received_splits: int32 `[N]`, its segment per source.
        dims: D_t per table.
        table_names: for error messages.

    Returns:
        (rows float32 `[E]`: per source, per table, the asked rows
        flattened; row_splits int32 `[N]`: floats per source, the splits to
        send them back with).
    """
    for s in shards:
        # The kernel reads the shards through their handles: tell the
        # tapes and the function being traced that they were read.
        resource_variable_ops.variable_accessed(s)
    # Static row counts spare the gradient a shape read and a slice per
    # shard every step (the kernel checks them).
    rows = [s.shape[0] for s in shards]
    shard_rows = ([] if any(r is None for r in rows)
                  else [int(r) for r in rows])
    return _kernels().group_embedding_collective_owner_gather(
        shards=[s.handle for s in shards], received_ids=received_ids,
        received_splits=received_splits, dims=[int(d) for d in dims],
        table_names=list(table_names), shard_rows=shard_rows)


def pool(rows: tf.Tensor, row_offsets: Sequence[tf.Tensor],
         feats: Sequence[FeatureIds], combiners: Sequence[str],
         dims: Sequence[int]) -> List[tf.Tensor]:
    """Pools each feature's rows from the returned rows buffer.

    Row b of output t equals the pooling (combiner, weights) of the rows at
    `row_offsets[t][j]` for the ids j of row b, exactly as the fused
    single-process lookup pools them from the table.

    Args:
        rows: float32 `[E]`, the rows buffer back from the owners.
        row_offsets: K int64 `[nnz_t]` from `route_ids`.
        feats: K `FeatureIds` (row splits and weights are used).
        combiners: "sum" | "mean" | "sqrtn" per table.
        dims: D_t per table.

    Returns:
        K float32 tensors `[B_t, D_t]`.
    """
    empty = tf.zeros([0], tf.float32)
    return _kernels().group_embedding_collective_pool(
        rows=rows, row_offsets=list(row_offsets),
        row_splits=[f.row_splits for f in feats],
        weights=[empty if f.weights is None else f.weights for f in feats],
        combiners=list(combiners), dims=[int(d) for d in dims])


# The owner gradient merge's op names (its alias too).
OWNER_GRAD_OPS = op_names.with_alias(
    "GroupEmbeddingCollectiveOwnerGatherGrad")
# Per graph, the owner gradient merges built again with a scale:
# {(merge op name, scale): the scaled op}.
_ScaledMerges = Dict[Tuple[str, float], Any]
_scaled_merges: "weakref.WeakKeyDictionary[Any, _ScaledMerges]" = (
    weakref.WeakKeyDictionary())


def scaled_shard_gradient(grad, scale: float):
    """`grad` times `scale`, from the owner gradient merge itself.

    When `grad` is one shard's output of the owner gradient merge
    (`GroupEmbeddingCollectiveOwnerGatherGrad`) in the graph being built,
    the merge is built again with `scale` folded in: one op scales every
    shard (the unscaled merge is left unused and pruned), instead of a
    multiply op per shard.

    Args:
        grad: a gradient (`tf.IndexedSlices`, a tensor or None).
        scale: the factor, e.g. 1 / number of workers.

    Returns:
        The scaled `tf.IndexedSlices`, or None where `grad` is not such an
        output (eager, another op, another graph): scale it yourself.
    """
    if not isinstance(grad, tf.IndexedSlices) or tf.executing_eagerly():
        return None
    op = getattr(grad.values, "op", None)
    if (op is None or op.type not in OWNER_GRAD_OPS
            or grad.indices.op is not op
            or op.graph is not tf.compat.v1.get_default_graph()):
        return None
    k = op.get_attr("num_tables")
    t = grad.values.value_index - k
    if t < 0 or grad.indices.value_index != t:
        return None
    merged = op.get_attr("scale") * scale
    built = _scaled_merges.setdefault(op.graph, {})
    key = (op.name, merged)
    if key not in built:
        merge = _kernels().group_embedding_collective_owner_gather_grad
        with tf.name_scope("scaled_owner_gradient"):
            built[key] = merge(
                grad=op.inputs[0], received_ids=op.inputs[1],
                received_splits=op.inputs[2], shard_rows=op.inputs[3],
                num_tables=k, dims=op.get_attr("dims"),
                table_names=op.get_attr("table_names"), scale=merged)
    indices, values = built[key]
    return tf.IndexedSlices(values[t], indices[t], grad.dense_shape)


def _register_gradients():
    @op_names.register_gradient("GroupEmbeddingCollectiveOwnerGather")
    def _owner_gather_grad(op, grad_rows, grad_splits):
        del grad_splits  # integer output
        k = op.get_attr("num_tables")
        dims = op.get_attr("dims")
        try:
            rows = list(op.get_attr("shard_rows"))
        except ValueError:  # a graph built before the attr existed
            rows = []
        if len(rows) == k:
            shapes = [tf.constant([r, d], tf.int64)
                      for r, d in zip(rows, dims)]
            shard_rows = tf.constant(rows, tf.int64)
        else:
            shapes = [tf.raw_ops.VariableShape(input=h, out_type=tf.int64)
                      for h in op.inputs[:k]]
            shard_rows = tf.stack([s[0] for s in shapes])
        names = op_names.string_list_attr(op, "table_names")
        lib = _kernels()
        indices, values = lib.group_embedding_collective_owner_gather_grad(
            grad=grad_rows, received_ids=op.inputs[k],
            received_splits=op.inputs[k + 1], shard_rows=shard_rows,
            num_tables=k, dims=dims, table_names=names)
        slices = [tf.IndexedSlices(v, i, s)
                  for i, v, s in zip(indices, values, shapes)]
        return slices + [None, None]

    @op_names.register_gradient("GroupEmbeddingCollectivePool")
    def _pool_grad(op, *grads):
        k = op.get_attr("num_tables")
        combiners = op_names.string_list_attr(op, "combiners")
        dims = op.get_attr("dims")
        rows = op.inputs[0]
        offsets = list(op.inputs[1:1 + k])
        splits = list(op.inputs[1 + k:1 + 2 * k])
        weights = list(op.inputs[1 + 2 * k:1 + 3 * k])
        grads = op_names.output_grads(op, grads)
        lib = _kernels()
        rows_grad = lib.group_embedding_collective_pool_grad(
            grads=grads, row_offsets=offsets, row_splits=splits,
            weights=weights, num_elements=tf.size(rows, out_type=tf.int64),
            combiners=combiners, dims=dims)
        weight_grads = lib.group_embedding_collective_pool_weight_grad(
            rows=rows, row_offsets=offsets, row_splits=splits,
            weights=weights, grads=grads, pooled=list(op.outputs),
            combiners=combiners, dims=dims)
        return [rows_grad] + [None] * (2 * k) + list(weight_grads)


_register_gradients()
