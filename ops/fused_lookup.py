"""One fused lookup for a group of same-dim tables.

Two interchangeable paths compute the same numbers:

* the C++ kernel `GroupEmbeddingVariableLookup`: ONE op pools all tables of
  the group straight into `[B, D]` outputs (no `[nnz, D]` intermediate);
  its gradient op returns, per table, the unique ids and their summed
  gradients as IndexedSlices. CPU, float32 resource variables. `max_norm`
  (a number >= 0) clips each row as it is read, and
  `GroupEmbeddingSequenceLookup` writes each row into its `[B, T, D]` slot
  for sequences; the backward of both stays per unique id.
* pure TF (GPU, other dtypes, a tensor or negative `max_norm`, EV
  sequences, or when the kernels are not built): per table a `unique` and a gather of the distinct rows
  (as stock does), ONE fused range check for the group, then ONE
  `sparse_segment_sum` over the concatenated distinct rows: no `[nnz, D]`
  tensor unless weights scale single ids. Its gradient is ONE
  `SparseSegmentSumGrad` for the group, split into per-table IndexedSlices
  with unique indices. Stock TF has no op that gathers from several
  variables, so this path cannot fuse the gathers without copying the
  tables.

EmbeddingVariable groups follow the same split: the C++ kernel
`EVGroupLookup` resolves keys (inserting new ones in training, counting
them, honouring the CounterFilter) and pools into `[B, D]` in one op; with `max_norm`, for sequences or with `GROUP_EMBEDDING_KERNELS=tf`
ONE `EVGroupGather` fetches the `[nnz, D]` rows, pooled in TF as above.
"""

import math
import numbers
from typing import List
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import tape as tape_lib

from group_embedding.ops import ev_storage
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


def clip_rows(rows, max_norm):
    """Rescales rows whose L2 norm exceeds `max_norm` down to it."""
    # Same rule as stock embedding_lookup(max_norm=...): rescale each
    # looked-up row whose L2 norm exceeds max_norm, before pooling.
    return tf.clip_by_norm(rows, max_norm, axes=[1])


def checked_ids(ids_list: List[tf.Tensor], vocabs, table_names
                ) -> List[tf.Tensor]:
    """The int64 ids of several tables, behind asserts 0 <= id < vocab.

    GPU gathers silently return zeros for bad ids, so the check cannot be
    left to the kernel. Every returned id tensor waits for ALL the checks,
    so one bad table stops the gradients (and so the optimizer updates) of
    every table of the group, not only its own forward gather.
    """
    checks = _range_asserts(ids_list, vocabs, table_names)
    with tf.control_dependencies(checks):
        return [tf.identity(ids) for ids in ids_list]


def _range_asserts(ids_list, vocabs, table_names):
    checks = []
    for ids, vocab, name in zip(ids_list, vocabs, table_names):
        vocab = tf.cast(vocab, tf.int64)
        checks.append(tf.debugging.Assert(
            tf.reduce_all((ids >= 0) & (ids < vocab)),
            [f"{name}: ids must lie in [0, vocabulary size); min id, max "
             "id, vocabulary size:",
             tf.reduce_min(ids), tf.reduce_max(ids), vocab]))
    return checks


def _checked_unique(tables, feats, table_names):
    """Per table the distinct ids and each id's slot among them.

    ONE fused range check covers the whole group (on the distinct ids,
    fewer than the ids); the per-table asserts that name the bad table are
    built only in the branch taken when it fails. Every distinct-id tensor
    waits for the check, so a bad table stops the whole group's gathers,
    gradients and optimizer updates.
    """
    uniq, slots = [], []
    for f in feats:
        u, slot = tf.unique(f.values, out_idx=tf.int64)
        uniq.append(u)
        slots.append(slot)
    vocabs = [tf.shape(t, out_type=tf.int64)[0] for t in tables]
    if len(uniq) == 1:
        ok = tf.reduce_all((uniq[0] >= 0) & (uniq[0] < vocabs[0]))
    else:
        limit = tf.repeat(tf.stack(vocabs), tf.stack(
            [tf.size(u, out_type=tf.int64) for u in uniq]))
        every = tf.concat(uniq, 0)
        ok = tf.reduce_all((every >= 0) & (every < limit))

    def _fail():
        with tf.control_dependencies(_range_asserts(uniq, vocabs,
                                                    table_names)):
            return tf.constant(False)

    valid = tf.cond(ok, lambda: tf.constant(True), _fail)
    with tf.control_dependencies([valid]):
        return [tf.identity(u) for u in uniq], slots


def _distinct_rows(tables, feats, table_names, max_norm):
    """Distinct rows of the group `[sum n_unique, D]` and each id's index.

    Clipping distinct rows equals clipping every looked-up row (stock
    `embedding_lookup_sparse` clips after its own `unique` too).
    """
    uniq, slots = _checked_unique(tables, feats, table_names)
    rows = [tf.gather(t, u) for t, u in zip(tables, uniq)]
    if len(rows) == 1:
        rows, idx = rows[0], slots[0]
    else:
        starts = tf.cumsum(tf.stack(
            [tf.size(u, out_type=tf.int64) for u in uniq]), exclusive=True)
        rows = tf.concat(rows, 0)
        idx = tf.concat([s + starts[i] for i, s in enumerate(slots)], 0)
    if max_norm is not None:
        rows = clip_rows(rows, max_norm)
    return rows, idx


@tf.custom_gradient
def _dense_gradient(rows):
    """Identity whose gradient is densified right here, in one scatter.

    The gradient of `tf.gather(rows, idx)` is IndexedSlices over all ids;
    left sparse, the concat of the tables' rows would split it with one
    mask and gather per table over all ids.
    """
    return tf.identity(rows), tf.convert_to_tensor


def _feature_rows(feat: FeatureIds) -> tf.Tensor:
    return (feat.row_ids if feat.row_ids is not None
            else _row_ids(feat.row_splits))


def _batch_size(feat: FeatureIds) -> tf.Tensor:
    return tf.shape(feat.row_splits, out_type=tf.int64)[0] - 1


def _pooled_variables_tf(tables, feats, combiners, table_names, max_norm):
    """Pure-TF pooled lookup of a group of plain variables."""
    rows, idx = _distinct_rows(tables, feats, table_names, max_norm)
    if any(f.weights is not None for f in feats):
        # Per-id weights scale single ids before the sum, so the ids' rows
        # are materialised, as in stock `embedding_lookup_sparse`.
        return pool_rows(tf.gather(_dense_gradient(rows), idx), feats,
                         combiners)
    k = len(feats)
    sizes = [_batch_size(f) for f in feats]
    if k == 1:
        segments, total = _feature_rows(feats[0]), sizes[0]
    else:
        offsets = tf.cumsum(tf.stack(sizes), exclusive=True)
        segments = tf.concat([_feature_rows(f) + offsets[i]
                              for i, f in enumerate(feats)], 0)
        total = tf.reduce_sum(tf.stack(sizes))
    # Segments are sorted: ids come grouped by row, features in order.
    pooled = tf.sparse.segment_sum(rows, idx, segments, num_segments=total)
    if any(c != "sum" for c in combiners):
        norms = []
        for f, c in zip(feats, combiners):
            n = tf.cast(f.row_splits[1:] - f.row_splits[:-1], rows.dtype)
            norms.append(tf.ones_like(n) if c == "sum"
                         else n if c == "mean" else tf.sqrt(n))
        # Dividing the sum (not scaling ids) matches stock's mean/sqrtn.
        pooled = tf.math.divide_no_nan(pooled, tf.concat(norms, 0)[:, None])
    if k == 1:
        return [pooled]
    return tf.split(pooled, tf.stack(sizes), num=k)


def _sequence_variables_tf(tables, feats, table_names, max_norm):
    """Pure-TF `[B, T, D]` lookup of a group of plain variables."""
    rows, idx = _distinct_rows(tables, feats, table_names, max_norm)
    if any(f.weights is not None for f in feats):
        return sequence_rows(tf.gather(_dense_gradient(rows), idx), feats)
    keys, sizes, offset = [], [], tf.constant(0, tf.int64)
    for f in feats:
        t = tf.cast(f.max_len, tf.int64)
        keys.append(offset + _feature_rows(f) * t + f.positions)
        sizes.append(_batch_size(f) * t)
        offset += sizes[-1]
    keys = keys[0] if len(keys) == 1 else tf.concat(keys, 0)
    ordered = tf.reduce_all(keys[1:] >= keys[:-1])

    def _sort():
        # Columns out of order inside a row: sort the (small) index
        # vectors, never the rows.
        order = tf.argsort(keys, stable=True)
        return tf.gather(idx, order), tf.gather(keys, order)

    idx, keys = tf.cond(ordered, lambda: (idx, keys), _sort)
    flat = tf.sparse.segment_sum(rows, idx, keys, num_segments=offset)
    outs = [flat] if len(feats) == 1 else tf.split(
        flat, tf.stack(sizes), num=len(feats))
    dim = rows.shape[1]
    return [tf.reshape(o, tf.stack([_batch_size(f),
                                    tf.cast(f.max_len, tf.int64), dim]))
            for o, f in zip(outs, feats)]


def _gather_rows(tables, feats, table_names, max_norm, training=True):
    if hasattr(tables[0], "lookup_rows"):
        # EmbeddingVariable group: ONE storage gather for all its tables.
        rows = ev_storage.group_gather(tables, [f.values for f in feats],
                                       training)
        return rows if max_norm is None else clip_rows(rows, max_norm)
    rows = []
    checked = checked_ids([f.values for f in feats],
                          [tf.shape(t, out_type=tf.int64)[0] for t in tables],
                          table_names)
    for t, ids in zip(tables, checked):
        # Gather each distinct id once (as stock does): the table gradient
        # then has unique indices, which Keras optimizers need to match
        # the dense update.
        unique, slot = tf.unique(ids, out_idx=tf.int64)
        rows.append(tf.gather(tf.gather(t, unique), slot))
    rows = rows[0] if len(rows) == 1 else tf.concat(rows, 0)
    if max_norm is not None:
        rows = clip_rows(rows, max_norm)
    return rows


def _pooled_tf(tables, feats, combiners, table_names, max_norm,
               training=True):
    if not hasattr(tables[0], "lookup_rows"):
        return _pooled_variables_tf(tables, feats, combiners, table_names,
                                    max_norm)
    rows = _gather_rows(tables, feats, table_names, max_norm, training)
    return pool_rows(rows, feats, combiners)


def pool_rows(rows: tf.Tensor, feats: List[FeatureIds],
              combiners: List[str]) -> List[tf.Tensor]:
    """Pools gathered rows `[sum nnz, D]` (features in order) to `[B, D]`s.

    ONE `unsorted_segment_sum` for all features; combiners and weights
    are folded into a per-id scale first.
    """
    k = len(feats)
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


def _kernel_max_norm(max_norm) -> Optional[float]:
    """`max_norm` as the kernels' attr (-1: off), or None when only the TF
    path can apply it (a tensor, or a negative bound, which stock applies
    as a sign flip)."""
    if max_norm is None:
        return -1.0
    # numbers.Real also admits numpy scalars.
    if (isinstance(max_norm, numbers.Real)
            and not isinstance(max_norm, (bool, np.bool_)) and max_norm >= 0
            and math.isfinite(max_norm)):
        return float(max_norm)
    return None


def _can_use_kernel(tables, max_norm):
    if _kernel_max_norm(max_norm) is None:
        return False
    if tf.config.list_logical_devices("GPU"):
        return False
    return all(isinstance(t, tf.Variable) and t.dtype == tf.float32
               for t in tables)


def pooled_lookup(tables: List[tf.Variable], feats: List[FeatureIds],
                  combiners: List[str], table_names: List[str],
                  max_norm: Optional[float] = None,
                  training=True) -> List[tf.Tensor]:
    """Pooled `[B, D]` lookups of one group of same-dim tables.

    Args:
        tables: `[vocab_i, D]` variables of one dtype, or
            `EmbeddingVariable`s of one dim.
        feats: one `FeatureIds` per table, all with the same batch size B.
        combiners: "sum" | "mean" | "sqrtn" per table.
        table_names: names used in error messages.
        max_norm: if set, rows with a larger L2 norm are rescaled to it
            before pooling.
        training: for EmbeddingVariable tables, whether new keys are
            inserted (see `group_embedding_lookup_sparse`).

    Returns:
        One `[B, D]` tensor per table.
    """
    lib = kernel_library.load()
    if (lib is not None and max_norm is None
            and hasattr(tables[0], "lookup_rows")):
        # EmbeddingVariable group: resolve and pool in one C++ op.
        return _pooled_ev(lib, tables, feats, combiners, training)
    if lib is None or not _can_use_kernel(tables, max_norm):
        return _pooled_tf(tables, feats, combiners, table_names, max_norm,
                          training)
    _watch(tables)
    return lib.group_embedding_variable_lookup(
        tables=[t.handle for t in tables],
        ids=[f.values for f in feats],
        row_splits=[f.row_splits for f in feats],
        weights=_kernel_weights(feats),
        combiners=combiners, table_names=table_names,
        embedding_dim=int(tables[0].shape[1]),
        max_norm=_kernel_max_norm(max_norm))


def _watch(tables):
    # The kernels read the tables through their handles: tell the tape
    # (GradientTape, tf.function) that the trainable ones were read.
    for t in tables:
        if t.trainable:
            tape_lib.variable_accessed(t)


def _kernel_weights(feats: List[FeatureIds]) -> List[tf.Tensor]:
    """Per-feature weights for the kernels; an empty tensor means none."""
    empty = tf.zeros([0], tf.float32)
    return [empty if f.weights is None else f.weights for f in feats]


def _pooled_ev(lib, variables, feats: List[FeatureIds],
               combiners: List[str], training) -> List[tf.Tensor]:
    """`EVGroupLookup`: pooled `[B_i, D]` lookups of same-dim EVs.

    Row b of output i pools (with `combiners[i]` and the weights of
    `feats[i]`) the rows `EVGroupGather` would return for the keys of row
    b, so both EV paths agree exactly; one variable may appear several
    times (shared columns). Its gradient gives each variable its unique
    keys with their summed gradients (see `_register_gradient`).
    """
    _watch(variables)
    return lib.ev_group_lookup(
        handles=[v.handle for v in variables],
        keys=[f.values for f in feats],
        row_splits=[f.row_splits for f in feats],
        weights=_kernel_weights(feats),
        default_values=[v.default_values for v in variables],
        training=tf.convert_to_tensor(training, tf.bool),
        combiners=list(combiners),
        embedding_dim=int(variables[0].embedding_dim))


def sequence_lookup(tables, feats: List[FeatureIds], table_names,
                    max_norm=None, training=True) -> List[tf.Tensor]:
    """Unpooled `[B, T, D]` lookups (zeros at padding) of one group.

    Each id lands at its position inside its row, multiplied by its weight
    when weights are given. One gather per table, one segment sum in all.
    """
    if not hasattr(tables[0], "lookup_rows"):
        lib = kernel_library.load()
        if lib is not None and _can_use_kernel(tables, max_norm):
            return _sequence_kernel(lib, tables, feats, table_names,
                                    max_norm)
        return _sequence_variables_tf(tables, feats, table_names, max_norm)
    rows = _gather_rows(tables, feats, table_names, max_norm, training)
    return sequence_rows(rows, feats)


def _sequence_kernel(lib, tables, feats, table_names, max_norm):
    """`GroupEmbeddingSequenceLookup`: each id's (clipped, weighted) row
    written straight into its `[B, T, D]` slot; its gradient sums per
    unique id, so no `[nnz, D]` tensor exists either way."""
    _watch(tables)
    return lib.group_embedding_sequence_lookup(
        tables=[t.handle for t in tables],
        ids=[f.values for f in feats],
        row_splits=[f.row_splits for f in feats],
        positions=[f.positions for f in feats],
        max_lens=[tf.cast(f.max_len, tf.int64) for f in feats],
        weights=_kernel_weights(feats),
        table_names=table_names,
        embedding_dim=int(tables[0].shape[1]),
        max_norm=_kernel_max_norm(max_norm))


def sequence_rows(rows: tf.Tensor,
                  feats: List[FeatureIds]) -> List[tf.Tensor]:
    """Places gathered rows `[sum nnz, D]` into `[B, T, D]` per feature."""
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
    dim = rows.shape[1]
    outs = tf.split(flat, tf.stack(sizes), num=len(feats))
    return [tf.reshape(o, tf.stack([tf.size(f.row_splits, tf.int64) - 1,
                                    tf.cast(f.max_len, tf.int64), dim]))
            for o, f in zip(outs, feats)]


def _table_slices(lib, handles, uniq, sums, max_norm):
    """Per-table IndexedSlices of the kernels' per-unique-id gradients,
    taken through the max_norm clip when there is one."""
    if max_norm >= 0:
        sums = lib.group_embedding_clip_grad(
            tables=list(handles), unique_ids=list(uniq), id_grads=list(sums),
            max_norm=max_norm)
    return [tf.IndexedSlices(s, u, tf.raw_ops.VariableShape(
                input=h, out_type=tf.int64))
            for s, u, h in zip(sums, uniq, handles)]


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
        lib = kernel_library.library()
        uniq, sums = lib.group_embedding_variable_lookup_grad(
            grads=list(grads), ids=list(ids), row_splits=list(splits),
            weights=list(weights), combiners=combiners,
            embedding_dim=op.get_attr("embedding_dim"))
        max_norm = op.get_attr("max_norm")
        table_grads = _table_slices(lib, handles, uniq, sums, max_norm)
        weight_grads = lib.group_embedding_weight_grad(
            tables=list(handles), ids=list(ids), row_splits=list(splits),
            weights=list(weights), grads=list(grads),
            pooled=list(op.outputs), combiners=combiners, max_norm=max_norm)
        return table_grads + [None] * (2 * k) + list(weight_grads)

    @tf.RegisterGradient("GroupEmbeddingSequenceLookup")
    def _sequence_grad(op, *grads):
        k = op.get_attr("num_tables")
        handles, ids, splits, positions, _, weights = (
            list(op.inputs[i * k:(i + 1) * k]) for i in range(6))
        grads = [tf.zeros_like(o) if g is None else tf.convert_to_tensor(g)
                 for g, o in zip(grads, op.outputs)]
        lib = kernel_library.library()
        uniq, sums = lib.group_embedding_sequence_lookup_grad(
            grads=grads, ids=ids, row_splits=splits, positions=positions,
            weights=weights, embedding_dim=op.get_attr("embedding_dim"))
        max_norm = op.get_attr("max_norm")
        table_grads = _table_slices(lib, handles, uniq, sums, max_norm)
        weight_grads = lib.group_embedding_sequence_weight_grad(
            tables=handles, ids=ids, row_splits=splits, positions=positions,
            weights=weights, grads=grads, max_norm=max_norm)
        return table_grads + [None] * (4 * k) + list(weight_grads)

    @tf.RegisterGradient("EVGroupLookup")
    def _ev_lookup_grad(op, *grads):
        k = op.get_attr("num_tables")
        combiners = [c.decode() if isinstance(c, bytes) else c
                     for c in op.get_attr("combiners")]
        dim = op.get_attr("embedding_dim")
        handles, keys, splits, weights, defaults = (
            list(op.inputs[i * k:(i + 1) * k]) for i in range(5))
        # An unused output has no gradient; the kernels want them all.
        grads = [tf.zeros_like(o) if g is None else tf.convert_to_tensor(g)
                 for g, o in zip(grads, op.outputs)]
        lib = kernel_library.library()
        # Keys play the role of ids: per variable, unique keys (first
        # occurrence order) and their summed gradients. Keys are not row
        # numbers, so the slices have no dense shape (as EVGroupGather's).
        uniq, sums = lib.group_embedding_variable_lookup_grad(
            grads=grads, ids=keys, row_splits=splits, weights=weights,
            combiners=combiners, embedding_dim=dim)
        weight_grads = lib.ev_group_weight_grad(
            handles=handles, keys=keys, row_splits=splits, weights=weights,
            default_values=defaults, grads=grads, pooled=list(op.outputs),
            combiners=combiners, embedding_dim=dim)
        return ([tf.IndexedSlices(s, u) for s, u in zip(sums, uniq)]
                + [None] * (2 * k) + list(weight_grads) + [None] * (k + 1))


_register_gradient()
