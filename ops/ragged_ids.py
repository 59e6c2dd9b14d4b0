"""SparseTensor / RaggedTensor ids -> the ragged form the fused lookup eats.

SparseTensor ids may come in any index order with duplicates; they are
grouped by row with a stable O(nnz) counting sort (one C++ op for all
features), or with a stable argsort on the pure-TF path.
"""

import dataclasses
from typing import List
from typing import Optional

import tensorflow as tf

from group_embedding.ops import kernel_library


@dataclasses.dataclass(frozen=True)
class FeatureIds:
    """One feature's ids in ragged form.

    Attributes:
        values: int64 `[nnz]` ids, grouped by row (row-major).
        row_splits: int64 `[B + 1]`; row b holds
            `values[row_splits[b]:row_splits[b + 1]]`.
        weights: float32 `[nnz]` aligned with `values`, or None (all ones).
        positions: int64 `[nnz]` slot of each id inside its row (used by
            `is_sequence=True`), or None when not asked for.
        max_len: scalar int64, the padded row length T for sequences, or
            None when not asked for.
        name: how errors refer to this feature, e.g. "sp_ids[3]".
    """

    values: tf.Tensor
    row_splits: tf.Tensor
    weights: Optional[tf.Tensor]
    positions: Optional[tf.Tensor]
    max_len: Optional[tf.Tensor]
    name: str


def _float_weights(weights):
    return None if weights is None else tf.cast(weights, tf.float32)


def from_ragged(ids: tf.RaggedTensor, weights: Optional[tf.RaggedTensor],
                name: str, need_positions: bool = False) -> FeatureIds:
    """Wraps a 2-D RaggedTensor (and aligned ragged weights)."""
    values = tf.cast(ids.values, tf.int64)
    splits = tf.cast(ids.row_splits, tf.int64)
    w = None
    if weights is not None:
        same = tf.debugging.assert_equal(
            tf.cast(weights.row_splits, tf.int64), splits,
            message=f"`{name}`: weights must have the same row lengths "
                    "as the ids.")
        # The lookup consumes the weights, so it waits for the check.
        with tf.control_dependencies([same]):
            w = tf.identity(_float_weights(weights.values))
    positions = max_len = None
    if need_positions:
        row_ids = tf.ragged.row_splits_to_segment_ids(splits)
        positions = tf.range(tf.size(values, out_type=tf.int64),
                             dtype=tf.int64) - tf.gather(splits, row_ids)
        max_len = tf.reduce_max(tf.concat(
            [splits[1:] - splits[:-1], tf.zeros([1], tf.int64)], 0))
    return FeatureIds(values, splits, w, positions, max_len, name)


def from_sparse(sp_ids: List[tf.SparseTensor], sp_weights: List,
                names: List[str],
                need_positions: bool = False) -> List[FeatureIds]:
    """Converts rank-2 SparseTensors to `FeatureIds`, once per feature."""
    lib = kernel_library.load()
    if lib is None or need_positions:
        return [_from_sparse_tf(s, w, n, need_positions)
                for s, w, n in zip(sp_ids, sp_weights, names)]
    weights = [tf.zeros([0], tf.float32) if w is None
               else _float_weights(w.values) for w in sp_weights]
    values, splits, row_w, _ = lib.group_sparse_to_ragged(
        indices=[s.indices for s in sp_ids],
        ids=[tf.cast(s.values, tf.int64) for s in sp_ids],
        dense_shapes=[s.dense_shape for s in sp_ids],
        weights=weights, feature_names=[f"`{n}`" for n in names])
    return [FeatureIds(v, s, None if w is None else rw, None, None, n)
            for v, s, rw, w, n in zip(values, splits, row_w, sp_weights,
                                      names)]


def _register_gradient():
    @tf.RegisterGradient("GroupSparseToRagged")
    def _to_ragged_grad(op, *grads):
        # Only the weights are differentiable: route each weight's
        # gradient back from where the sort put it.
        n = op.get_attr("num_features")
        w_grads = grads[2 * n:3 * n]
        positions = op.outputs[3 * n:]
        out = []
        for g, pos, w in zip(w_grads, positions, op.inputs[3 * n:]):
            if g is None:
                out.append(None)
                continue
            g = tf.convert_to_tensor(g)
            out.append(tf.cond(tf.size(pos) > 0,
                               lambda g=g, pos=pos: tf.gather(g, pos),
                               lambda g=g: g))
        return [None] * (3 * n) + out


_register_gradient()


# Largest batch (dense_shape[0]) accepted, as in the GroupSparseToRagged
# kernel: outputs are [batch, D], and batch + 1 must not overflow.
MAX_BATCH = 2 ** 48


def _from_sparse_tf(ids, weights, name, need_positions):
    shape_ok = tf.debugging.Assert(
        tf.equal(tf.size(ids.dense_shape), 2)
        & tf.equal(tf.shape(ids.indices, out_type=tf.int64)[-1], 2),
        [f"`{name}` must be a SparseTensor of rank 2 ([batch, ids per "
         "row]) with [nnz, 2] indices; dense_shape, indices shape:",
         ids.dense_shape, tf.shape(ids.indices)])
    # Slicing waits for the rank check, so a bad rank is reported as such.
    with tf.control_dependencies([shape_ok]):
        indices = tf.identity(ids.indices)
        dense_shape = tf.identity(ids.dense_shape)
    rows = indices[:, 0]
    batch = dense_shape[0]
    checks = [tf.debugging.Assert(
                  (batch >= 0) & (batch <= MAX_BATCH),
                  [f"`{name}`: dense_shape[0] (the batch size) must lie in "
                   f"[0, {MAX_BATCH}]; got", batch]),
              tf.debugging.Assert(
                  tf.reduce_all((rows >= 0) & (rows < batch)),
                  [f"`{name}`: row index outside the batch [0, batch)."])]
    if need_positions:
        # Each id lands at [row, column] of a [batch, dense_shape[1]]
        # output; a column outside it would land in another row.
        cols = indices[:, 1]
        checks.append(tf.debugging.Assert(
            tf.reduce_all((cols >= 0) & (cols < dense_shape[1])),
            [f"`{name}`: column index outside [0, dense_shape[1]); min "
             "column, max column, dense_shape[1]:",
             tf.reduce_min(cols), tf.reduce_max(cols), dense_shape[1]]))
    if weights is not None:
        checks.append(tf.debugging.Assert(
            tf.equal(tf.size(weights.values), tf.size(ids.values)),
            [f"`{name}`: weights and ids differ in count:",
             tf.size(weights.values), tf.size(ids.values)]))
    with tf.control_dependencies(checks):
        rows = tf.identity(rows)
        batch = tf.identity(batch)
        order = tf.argsort(rows, stable=True)
    sorted_rows = tf.gather(rows, order)
    splits = tf.searchsorted(sorted_rows,
                             tf.range(batch + 1, dtype=tf.int64),
                             side="left", out_type=tf.int64)
    values = tf.gather(tf.cast(ids.values, tf.int64), order)
    w = (None if weights is None
         else tf.gather(_float_weights(weights.values), order))
    positions = max_len = None
    if need_positions:
        positions = tf.gather(indices[:, 1], order)
        max_len = dense_shape[1]
    return FeatureIds(values, splits, w, positions, max_len, name)
