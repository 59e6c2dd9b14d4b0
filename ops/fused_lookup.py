"""One fused lookup for a group of same-dim tables.

Two interchangeable paths compute the same numbers:

* the C++ kernel `GroupEmbeddingVariableLookup`: ONE op pools all tables of
  the group straight into `[B, D]` outputs (no `[nnz, D]` intermediate);
  its gradient op returns, per table, the unique ids and their summed
  gradients as IndexedSlices. CPU, float32 resource variables, no max_norm.
* pure TF (GPU, other dtypes, `max_norm`, or when the kernels are not
  built): one gather per table, then ONE `unsorted_segment_sum` for the
  whole group. Stock TF has no op that gathers from several variables, so
  this path cannot fuse the gathers without copying the tables.
"""

from typing import List
from typing import Optional

import tensorflow as tf
from tensorflow.python.eager import tape as tape_lib

from group_embedding.ops import kernel_library
from group_embedding.ops.ragged_ids import FeatureIds


def _row_ids(splits):
    return tf.ragged.row_splits_to_segment_ids(splits, out_type=tf.int64)


def _row_scale(feat: FeatureIds, combiner: str, dtype) -> Optional[tf.Tensor]:
    """Per-id factor w_j / norm(row) so that pooling is a plain sum.

    Row sums use a float64 cumulative sum over the ids grouped by row, so
    the normaliser costs no segment op and stays exact to float32.
    """
    splits = feat.row_splits
    if feat.weights is None:
        if combiner == "sum":
            return None
        norm = tf.cast(splits[1:] - splits[:-1], tf.float64)
    else:
        w = tf.cast(feat.weights, tf.float64)
        if combiner == "sum":
            return tf.cast(feat.weights, dtype)
        if combiner == "sqrtn":
            w = w * w
        cum = tf.concat([tf.zeros([1], tf.float64), tf.cumsum(w)], 0)
        norm = tf.gather(cum, splits[1:]) - tf.gather(cum, splits[:-1])
    if combiner == "sqrtn":
        norm = tf.sqrt(norm)
    inv = tf.math.divide_no_nan(tf.ones_like(norm), norm)
    scale = tf.gather(inv, _row_ids(splits))
    if feat.weights is not None:
        scale = scale * tf.cast(feat.weights, tf.float64)
    return tf.cast(scale, dtype)


def _clip_rows(rows, max_norm):
    # Same rule as stock embedding_lookup(max_norm=...): rescale each
    # looked-up row whose L2 norm exceeds max_norm, before pooling.
    return tf.clip_by_norm(rows, max_norm, axes=[1])


def _range_check(table, feat: FeatureIds, table_name: str):
    """Asserts 0 <= id < vocab; GPU gathers would silently give zeros."""
    vocab = tf.shape(table, out_type=tf.int64)[0]
    return [tf.debugging.assert_non_negative(
                feat.values, message=f"{table_name}: negative id."),
            tf.debugging.assert_less(
                feat.values, vocab,
                message=f"{table_name}: id >= vocabulary size.")]


def _gather_rows(tables, feats, table_names, max_norm):
    rows = []
    for t, f, n in zip(tables, feats, table_names):
        with tf.control_dependencies(_range_check(t, f, n)):
            rows.append(tf.gather(t, f.values))
    rows = rows[0] if len(rows) == 1 else tf.concat(rows, 0)
    if max_norm is not None:
        rows = _clip_rows(rows, max_norm)
    return rows


def _pooled_tf(tables, feats, combiners, table_names, max_norm):
    k = len(tables)
    rows = _gather_rows(tables, feats, table_names, max_norm)
    scales = [_row_scale(f, c, rows.dtype) for f, c in zip(feats, combiners)]
    if any(s is not None for s in scales):
        scales = [tf.ones(tf.shape(f.values), rows.dtype) if s is None else s
                  for s, f in zip(scales, feats)]
        rows = rows * tf.concat(scales, 0)[:, None]
    # Segment of id j of table t: its row, offset by the rows of the
    # tables before t (batch sizes may differ for dense lookups).
    sizes = [tf.shape(f.row_splits, out_type=tf.int64)[0] - 1 for f in feats]
    offsets = tf.cumsum(tf.stack(sizes), exclusive=True)
    segments = tf.concat([_row_ids(f.row_splits) + offsets[i]
                          for i, f in enumerate(feats)], 0)
    pooled = tf.math.unsorted_segment_sum(rows, segments,
                                          tf.reduce_sum(sizes))
    return tf.split(pooled, tf.stack(sizes), num=k)


def _can_use_kernel(tables, max_norm):
    if max_norm is not None:
        return False
    if tf.config.list_logical_devices("GPU"):
        return False
    return all(isinstance(t, tf.Variable) and t.dtype == tf.float32
               for t in tables)


def pooled_lookup(tables: List[tf.Variable], feats: List[FeatureIds],
                  combiners: List[str], table_names: List[str],
                  max_norm: Optional[float] = None) -> List[tf.Tensor]:
    """Pooled `[B, D]` lookups of one group of same-dim tables.

    Args:
        tables: `[vocab_i, D]` variables of one dtype.
        feats: one `FeatureIds` per table, all with the same batch size B.
        combiners: "sum" | "mean" | "sqrtn" per table.
        table_names: names used in error messages.
        max_norm: if set, rows with a larger L2 norm are rescaled to it
            before pooling.

    Returns:
        One `[B, D]` tensor per table.
    """
    lib = kernel_library.load()
    if lib is None or not _can_use_kernel(tables, max_norm):
        return _pooled_tf(tables, feats, combiners, table_names, max_norm)
    for t in tables:
        if t.trainable:
            tape_lib.variable_accessed(t)
    empty = tf.zeros([0], tf.float32)
    return lib.group_embedding_variable_lookup(
        tables=[t.handle for t in tables],
        ids=[f.values for f in feats],
        row_splits=[f.row_splits for f in feats],
        weights=[empty if f.weights is None else f.weights for f in feats],
        combiners=combiners, table_names=table_names,
        embedding_dim=int(tables[0].shape[1]))


def sequence_lookup(tables, feats: List[FeatureIds], table_names,
                    max_norm=None) -> List[tf.Tensor]:
    """Unpooled `[B, T, D]` lookups (zeros at padding) of one group.

    Each id lands at its position inside its row, multiplied by its weight
    when weights are given. One gather per table, one segment sum in all.
    """
    rows = _gather_rows(tables, feats, table_names, max_norm)
    weights = [tf.ones(tf.shape(f.values), rows.dtype) if f.weights is None
               else tf.cast(f.weights, rows.dtype) for f in feats]
    if any(f.weights is not None for f in feats):
        rows = rows * tf.concat(weights, 0)[:, None]
    segments, sizes, offset = [], [], tf.constant(0, tf.int64)
    for f in feats:
        batch = tf.shape(f.row_splits, out_type=tf.int64)[0] - 1
        t = tf.cast(f.max_len, tf.int64)
        segments.append(offset + _row_ids(f.row_splits) * t + f.positions)
        sizes.append(batch * t)
        offset += batch * t
    flat = tf.math.unsorted_segment_sum(rows, tf.concat(segments, 0), offset)
    dim = tables[0].shape[1]
    outs = tf.split(flat, tf.stack(sizes), num=len(feats))
    return [tf.reshape(o, [-1, tf.cast(f.max_len, tf.int64), dim])
            for o, f in zip(outs, feats)]


def _register_gradient():
    @tf.RegisterGradient("GroupEmbeddingVariableLookup")
    def _lookup_grad(op, *grads):
        k = op.get_attr("num_tables")
        combiners = [c.decode() if isinstance(c, bytes) else c
                     for c in op.get_attr("combiners")]
        handles = op.inputs[:k]
        ids = op.inputs[k:2 * k]
        splits = op.inputs[2 * k:3 * k]
        weights = op.inputs[3 * k:]
        lib = kernel_library.load()
        uniq, sums = lib.group_embedding_variable_lookup_grad(
            grads=list(grads), ids=list(ids), row_splits=list(splits),
            weights=list(weights), combiners=combiners,
            embedding_dim=op.get_attr("embedding_dim"))
        table_grads = [
            tf.IndexedSlices(s, u, tf.raw_ops.VariableShape(
                input=h, out_type=tf.int64))
            for s, u, h in zip(sums, uniq, handles)]
        weight_grads = [
            _weight_grad(h, i, sp, w, g, out, c)
            for h, i, sp, w, g, out, c in zip(handles, ids, splits, weights,
                                              grads, op.outputs, combiners)]
        return (table_grads + [None] * (2 * k) + weight_grads)


def _weight_grad(handle, ids, splits, weights, grad, pooled, combiner):
    """d loss / d w_j, for users who train the weights themselves.

    pooled_b = sum_j w_j e_j / n_b with n_b = 1, sum_j w_j or
    sqrt(sum_j w_j^2); differentiate both the numerator and n_b.
    """
    if weights.shape.rank == 1 and weights.shape[0] == 0:
        return None
    rows = tf.raw_ops.ResourceGather(resource=handle, indices=ids,
                                     dtype=tf.float32)
    row_ids = _row_ids(splits)
    g = tf.gather(grad, row_ids)
    eg = tf.reduce_sum(rows * g, 1)
    if combiner == "sum":
        return eg
    pg = tf.gather(tf.reduce_sum(pooled * grad, 1), row_ids)
    w = weights
    if combiner == "mean":
        cum = tf.concat([[0.0], tf.cumsum(w)], 0)
        n = tf.gather(cum, splits[1:]) - tf.gather(cum, splits[:-1])
        n = tf.gather(n, row_ids)
        return tf.math.divide_no_nan(eg - pg, n)
    cum = tf.concat([[0.0], tf.cumsum(w * w)], 0)
    n = tf.sqrt(tf.gather(cum, splits[1:]) - tf.gather(cum, splits[:-1]))
    n = tf.gather(n, row_ids)
    return tf.math.divide_no_nan(eg - pg * w / n, n)


_register_gradient()
