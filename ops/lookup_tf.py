"""The stock-TF backend of the grouped lookup (any device, any dtype).

Plain variables: per table a `unique`, a gather of the distinct rows and a
sparse `[B, n_distinct]` matrix (the ids' weights) times those rows, whose
gradient is the transposed product (no `[nnz, D]` tensor either way, no
sort), behind ONE fused range check for the group; the gradients are
per-table IndexedSlices with unique indices. Stock TF has no op that
gathers from several variables, so this path cannot fuse the gathers
without copying the tables; fusing only the reduction (concat of the rows,
split of the outputs) measured slower on CPU.

EmbeddingVariables (with `max_norm`, weighted sequences, or
`GROUP_EMBEDDING_KERNELS=tf`): ONE `GroupEmbeddingEVGather` fetches the
`[nnz, D]` rows of the group, pooled (`pool_rows`) or placed
(`sequence_rows`) in TF; the collective layer pools exchanged rows with
the same two functions.
"""

from typing import Any
from typing import List
from typing import Optional
from typing import Sequence

import tensorflow as tf
from tensorflow.python.eager import record

from group_embedding.ops import ev_storage
from group_embedding.ops import ragged_ids
from group_embedding.ops.ragged_ids import FeatureIds


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
    scale = tf.gather(inv, ragged_ids.row_ids(feat))
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


def _group_range_check(tables, feats, table_names):
    """ONE check that every id of the group addresses a row of its table.

    On the ids themselves, so that it runs from the start, beside what
    reads them; the per-table asserts that name the bad table are built
    only in the branch taken when it fails. Returns the check's op.
    """
    vocabs = [tf.shape(t, out_type=tf.int64)[0] for t in tables]
    with tf.name_scope("group_range_check"):
        lows = tf.stack([tf.reduce_min(f.values) for f in feats])
        highs = tf.stack([tf.reduce_max(f.values) for f in feats])
        ok = tf.reduce_all((lows >= 0) & (highs < tf.stack(vocabs)))

        def _fail():
            with tf.control_dependencies(_range_asserts(
                    [f.values for f in feats], vocabs, table_names)):
                return tf.constant(False)

        return tf.cond(ok, lambda: tf.constant(True), _fail)


def _checked_unique(tables, feats, table_names):
    """Per table the distinct ids and each id's slot among them.

    Every distinct-id tensor waits for the group's range check, so a bad
    table stops the whole group's gathers, gradients and optimizer
    updates.
    """
    valid = _group_range_check(tables, feats, table_names)
    uniq, slots = [], []
    for f in feats:
        u, slot = tf.unique(f.values, out_idx=tf.int64)
        uniq.append(u)
        slots.append(slot)
    with tf.control_dependencies([valid]):
        return [tf.identity(u) for u in uniq], slots


def _distinct_rows(tables, feats, table_names, max_norm):
    """Per table the rows of its distinct ids `[n_unique, D]` and each
    id's slot among them.

    Clipping distinct rows equals clipping every looked-up row (stock
    `embedding_lookup_sparse` clips after its own `unique` too).
    """
    uniq, slots = _checked_unique(tables, feats, table_names)
    rows = [tf.gather(t, u) for t, u in zip(tables, uniq)]
    if max_norm is not None:
        rows = [clip_rows(r, max_norm) for r in rows]
    return rows, slots


# Widest rows that TF's CPU sparse-dense product multiplies faster than
# a sparse segment sum adds them: measured on the criteo-like step,
# forward 1.3x faster at D = 16, 1.4-1.6x slower at D = 32 and 64 (its
# transposed product, the gradient, is faster or equal at all three).
_MATMUL_MAX_DIM = 16


def _narrow(rows) -> bool:
    dim = tf.compat.dimension_value(rows.shape[-1])
    return dim is not None and dim <= _MATMUL_MAX_DIM


def _scatter_rows(targets, slot, values, size, rows, weighted,
                  sorted_targets=False):
    """`out[targets[j]] += values[j] * rows[slot[j]]`, `out` `[size, D]`.

    A `[size, n_rows]` sparse matrix times the rows: any target order,
    duplicates summed. Its gradient is the transposed product (no sort,
    no `[nnz, D]` tensor); measured 1.3x faster forward + backward than
    stock's sparse segment sum and its gradient on the criteo-like
    step (2 CPU cores, D = 16). Wider unweighted rows with
    `sorted_targets` go forward through a sparse segment sum instead (see
    `_MATMUL_MAX_DIM`). The values' gradient (the weights', only when
    `weighted`) is `rows[slot[j]] . grad[targets[j]]`.
    """
    indices = tf.stack([targets, slot], 1)
    shape = tf.stack([size, tf.shape(rows, out_type=tf.int64)[0]])
    # Unweighted values are all ones: the segment sum adds the same.
    by_segments = sorted_targets and not weighted and not _narrow(rows)

    @tf.custom_gradient
    def product(values, rows):
        matrix = tf.SparseTensor(indices, values, shape)

        def grad(g):
            d_rows = tf.sparse.sparse_dense_matmul(matrix, g, adjoint_a=True)
            d_values = None
            if weighted:
                d_values = tf.reduce_sum(
                    tf.gather(rows, slot) * tf.gather(g, targets), 1)
            return d_values, d_rows

        if by_segments:
            return tf.sparse.segment_sum(rows, slot, targets,
                                         num_segments=size), grad
        return tf.sparse.sparse_dense_matmul(matrix, rows), grad

    return product(values, rows)


def _pool_table(rows, slot, feat: FeatureIds, combiner: str) -> tf.Tensor:
    """`[B, D]` pooling of one table's ids from its distinct rows.

    The (weighted) sum of the ids' rows (`_scatter_rows`), then
    `_combine`d.
    """
    segments, batch, w, weighted = _id_weights(feat, rows.dtype)
    # Ids come grouped by row (`FeatureIds`): the row targets are sorted.
    pooled = _scatter_rows(segments, slot, w, batch, rows, weighted,
                           sorted_targets=True)
    return _combine(pooled, w, segments, batch, combiner, weighted)


def _id_weights(feat: FeatureIds, dtype):
    """(row of each id, batch size, each id's weight (ones when
    unweighted), whether weighted)."""
    segments = ragged_ids.row_ids(feat)
    weighted = feat.weights is not None
    w = (tf.cast(feat.weights, dtype) if weighted
         else tf.ones(tf.shape(segments), dtype))
    return segments, ragged_ids.batch_size(feat), w, weighted


def _combine(pooled, w, segments, batch, combiner, weighted):
    """The weighted sums `pooled` `[B, D]`, divided as stock divides them:
    by the row's id count or weight sum `w` for "mean", by the root of the
    count or of the sum of squared weights for "sqrtn"."""
    if combiner == "sum":
        return pooled
    norm = tf.math.unsorted_segment_sum(
        w * w if weighted and combiner == "sqrtn" else w, segments, batch)
    if combiner == "sqrtn":
        norm = tf.sqrt(norm)
    return tf.math.divide_no_nan(pooled, norm[:, None])


def _sorted_segment_sum(data, segments, batch):
    """`unsorted_segment_sum(data, segments, batch)` for sorted segments.

    `segment_sum` (as stock uses) has a plain gather as gradient, where
    `unsorted_segment_sum`'s also masks negative segments over the whole
    `[nnz, D]` gradient; its output stops at the last non-empty row, so
    the empty rows after it are padded back.
    """
    summed = tf.math.segment_sum(data, segments)
    missing = batch - tf.shape(summed, out_type=tf.int64)[0]
    pad = tf.concat([[[0, missing]], tf.zeros([tf.rank(data) - 1, 2],
                                               tf.int64)], 0)
    padded = tf.pad(summed, pad)
    # The paddings are computed, so a graph would lose every static dim:
    # the row width is the data's (models read it, e.g. `shape[-1]`).
    padded.set_shape(tf.TensorShape([None]).concatenate(data.shape[1:]))
    return padded


def pooled_variables(tables: Sequence[Any], feats: Sequence[FeatureIds],
                     combiners: Sequence[str], table_names: Sequence[str],
                     max_norm: Any) -> List[tf.Tensor]:
    """Pure-TF pooled lookup of a group of plain variables.

    Per table a unique, a gather and `_pool_table`, behind one fused
    check for the group. Measured on 2 CPU cores (26 tables), per-table
    reductions beat concatenating the tables' rows into one: the concat
    and the split of the outputs copy more than the extra ops cost, and
    per-table ops run concurrently. When no gradient can be recorded
    (inference), tables are pooled in place instead (`_pool_in_place`),
    unless some table is wide and weighted.
    """
    if (max_norm is None and not record.could_possibly_record()
            and all(_narrow(t) or f.weights is None
                    for t, f in zip(tables, feats))):
        valid = _group_range_check(tables, feats, table_names)
        with tf.control_dependencies([valid]):
            ids = [tf.identity(f.values) for f in feats]
        return [_pool_in_place(t, i, f, c)
                for t, i, f, c in zip(tables, ids, feats, combiners)]
    rows, slots = _distinct_rows(tables, feats, table_names, max_norm)
    return [_pool_table(r, s, f, c)
            for r, s, f, c in zip(rows, slots, feats, combiners)]


def _pool_in_place(table, ids, feat: FeatureIds, combiner: str):
    """`_pool_table` straight from the table, without `unique` nor gather:
    narrow rows (see `_MATMUL_MAX_DIM`) as a sparse `[B, vocab]` matrix
    times the table (on the criteo-like step 1.1x stock's inference at
    D = 16, 0.6x at D = 64); wider unweighted rows by one sparse segment
    sum over the table, as stock pools them (a unique and a gather first
    made inference 0.86x stock at D = 64).

    Meant for inference; should a function traced without a tape be
    differentiated after all (called under an outer tape), the gradient
    is still per distinct id, as IndexedSlices.
    """
    read = getattr(table, "read_value_no_copy", None)
    # A plain read would copy a table in copy-on-read mode (left so by
    # sparse updates); stock's lookup reads the same way.
    dense = read() if read is not None else tf.convert_to_tensor(table)
    segments, batch, w, weighted = _id_weights(feat, dense.dtype)
    vocab = tf.shape(dense, out_type=tf.int64)[0]
    indices = tf.stack([segments, ids], 1)

    @tf.custom_gradient
    def product(values, dense):
        matrix = tf.SparseTensor(indices, values, tf.stack([batch, vocab]))

        def grad(g):
            uniq, slot = tf.unique(ids, out_idx=tf.int64)
            compact = tf.SparseTensor(
                tf.stack([segments, slot], 1), values,
                tf.stack([batch, tf.size(uniq, out_type=tf.int64)]))
            d_rows = tf.sparse.sparse_dense_matmul(compact, g, adjoint_a=True)
            d_values = None
            if weighted:
                d_values = tf.reduce_sum(
                    tf.gather(dense, ids) * tf.gather(g, segments), 1)
            shape = tf.shape(dense, out_type=tf.int64)
            return d_values, tf.IndexedSlices(d_rows, uniq, shape)

        if weighted or _narrow(dense):
            return tf.sparse.sparse_dense_matmul(matrix, dense), grad
        # Ids come grouped by row (`FeatureIds`): sorted segments.
        return tf.sparse.segment_sum(dense, ids, segments,
                                     num_segments=batch), grad

    return _combine(product(w, dense), w, segments, batch, combiner,
                    weighted)


def sequence_variables(tables: Sequence[Any], feats: Sequence[FeatureIds],
                       table_names: Sequence[str],
                       max_norm: Any) -> List[tf.Tensor]:
    """Pure-TF `[B, T, D]` lookup of a group of plain variables.

    Per table, each id's (weighted) distinct row is summed into its slot
    `row * T + position` of the flattened output (`_scatter_rows`), in
    any slot order. For the unweighted wide tables, which add by segments,
    the slots are sorted first when some are out of order (columns out of
    order inside a row; one check for the group).
    """
    rows, slots = _distinct_rows(tables, feats, table_names, max_norm)
    # (row of each id, batch, weights, weighted) per table, read once.
    ids_of = [_id_weights(f, r.dtype) for f, r in zip(feats, rows)]
    keys = [segments * tf.cast(f.max_len, tf.int64) + f.positions
            for (segments, _, _, _), f in zip(ids_of, feats)]
    by_segments = [f.weights is None and not _narrow(r)
                   for f, r in zip(feats, rows)]
    to_sort = [i for i, b in enumerate(by_segments) if b]
    if to_sort:
        def _sort():
            # Sort the (small) index vectors, never the rows.
            orders = [tf.argsort(keys[i], stable=True) for i in to_sort]
            return ([tf.gather(slots[i], o) for i, o in zip(to_sort, orders)],
                    [tf.gather(keys[i], o) for i, o in zip(to_sort, orders)])

        picked = ([slots[i] for i in to_sort], [keys[i] for i in to_sort])
        sorted_slots, sorted_keys = tf.cond(
            ragged_ids.all_sorted(picked[1]), lambda: picked, _sort)
        for i, s_, k in zip(to_sort, sorted_slots, sorted_keys):
            slots[i], keys[i] = s_, k
    flats = []
    # Sorting only reorders unweighted tables, whose weights are all ones.
    for r, s, k, f, seg, (_, batch, w, weighted) in zip(
            rows, slots, keys, feats, by_segments, ids_of):
        size = batch * tf.cast(f.max_len, tf.int64)
        flats.append(_scatter_rows(k, s, w, size, r, weighted,
                                   sorted_targets=seg))
    return [tf.reshape(flat, tf.stack([ragged_ids.batch_size(f),
                                       tf.cast(f.max_len, tf.int64),
                                       flat.shape[1]]))
            for flat, f in zip(flats, feats)]


def gather_ev_rows(tables, feats, max_norm, training=True):
    """EmbeddingVariable group: ONE storage gather `[sum nnz, D]` for all
    its tables (features in order), clipped to `max_norm` if given."""
    rows = ev_storage.group_gather(tables, [f.values for f in feats],
                                   training)
    return rows if max_norm is None else clip_rows(rows, max_norm)


def pooled_ev(tables: Sequence[Any], feats: Sequence[FeatureIds],
              combiners: Sequence[str], max_norm: Any,
              training: Any = True) -> List[tf.Tensor]:
    """Pooled `[B, D]` lookups of an EmbeddingVariable group: one gather,
    pooled in TF."""
    return pool_rows(gather_ev_rows(tables, feats, max_norm, training),
                     feats, combiners)


def sequence_ev(tables: Sequence[Any], feats: Sequence[FeatureIds],
                max_norm: Any, training: Any = True) -> List[tf.Tensor]:
    """`[B, T, D]` lookups of an EmbeddingVariable group: one gather,
    placed in TF."""
    return sequence_rows(gather_ev_rows(tables, feats, max_norm, training),
                         feats)


def pool_rows(rows: tf.Tensor, feats: Sequence[FeatureIds],
              combiners: Sequence[str]) -> List[tf.Tensor]:
    """Pools gathered rows `[sum nnz, D]` (features in order) to `[B, D]`s.

    ONE segment sum for all features (ids come grouped by row, features
    in order, so segments are sorted); combiners and weights are folded
    into a per-id scale first.
    """
    k = len(feats)
    scales = [_row_scale(f, c, rows.dtype) for f, c in zip(feats, combiners)]
    if any(s is not None for s in scales):
        scales = [tf.ones(tf.shape(f.values), rows.dtype) if s is None else s
                  for s, f in zip(scales, feats)]
        rows = rows * tf.concat(scales, 0)[:, None]
    # Segment of id j of table t: its row, offset by the rows of the
    # tables before t (batch sizes may differ for dense lookups).
    sizes = [ragged_ids.batch_size(f) for f in feats]
    offsets = tf.cumsum(tf.stack(sizes), exclusive=True)
    segments = tf.concat([ragged_ids.row_ids(f) + offsets[i]
                          for i, f in enumerate(feats)], 0)
    pooled = _sorted_segment_sum(rows, segments, tf.reduce_sum(sizes))
    return tf.split(pooled, tf.stack(sizes), num=k)


def sequence_rows(rows: tf.Tensor,
                  feats: Sequence[FeatureIds]) -> List[tf.Tensor]:
    """Places gathered rows `[sum nnz, D]` into `[B, T, D]` per feature.

    Each id's row is summed into its slot `row * T + position` of its
    feature's flattened output: a `segment_sum` when the slots are in
    order (ids in row-major order, checked once for all features), whose
    gradient is a plain gather, else an `unsorted_segment_sum`. The rows
    are split per feature (`[nnz, D]` in all) rather than the outputs
    (`[B, T, D]` each, larger).
    """
    if any(f.weights is not None for f in feats):
        weights = [tf.ones(tf.shape(f.values), rows.dtype)
                   if f.weights is None else tf.cast(f.weights, rows.dtype)
                   for f in feats]
        rows = rows * tf.concat(weights, 0)[:, None]
    keys, sizes = [], []
    for f in feats:
        t = tf.cast(f.max_len, tf.int64)
        keys.append(ragged_ids.row_ids(f) * t + f.positions)
        sizes.append(ragged_ids.batch_size(f) * t)
    if len(feats) == 1:
        parts = [rows]
    else:
        parts = tf.split(rows, tf.stack(
            [tf.size(f.values, out_type=tf.int64) for f in feats]),
            num=len(feats))
    ordered = ragged_ids.all_sorted(keys)
    dim = rows.shape[1]
    outs = []
    for r, k, n, f in zip(parts, keys, sizes, feats):
        flat = tf.cond(
            ordered,
            lambda r=r, k=k, n=n: _sorted_segment_sum(r, k, n),
            lambda r=r, k=k, n=n: tf.math.unsorted_segment_sum(r, k, n))
        outs.append(tf.reshape(flat, tf.stack(
            [ragged_ids.batch_size(f), tf.cast(f.max_len, tf.int64), dim])))
    return outs
