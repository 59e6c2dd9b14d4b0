"""SparseTensor / RaggedTensor ids -> the ragged form the fused lookup eats.

`to_feature_ids` checks and converts a lookup's id batches (errors name
`sp_ids[i]`); `from_packed` unpacks `ge.pack_ids`'s packed ids.

SparseTensor ids may come in any index order with duplicates; they are
grouped by row with a stable O(nnz) counting sort (one C++ op for all
features). The pure-TF path keeps each feature's tensors apart (no
concat, no split) behind one fused validity check for all features, and
sorts only when some feature's indices are out of row order (tf.data and
`tf.sparse` ops emit them ordered).
"""

import dataclasses
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence

import tensorflow as tf

from group_embedding.ops import capabilities
from group_embedding.ops import op_names


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
    # int64 `[nnz]` row of each id, when the conversion had it for free
    # (pure-TF SparseTensor path); else derived from `row_splits`.
    row_ids: Optional[tf.Tensor] = None
    # int64 scalar B, when known without `row_splits` (same path).
    batch: Optional[tf.Tensor] = None


def batch_size(feat: FeatureIds) -> tf.Tensor:
    """The int64 batch size B of `feat`, from `row_splits` if need be."""
    if feat.batch is not None:
        return feat.batch
    return tf.shape(feat.row_splits, out_type=tf.int64)[0] - 1


def row_ids(feat: FeatureIds) -> tf.Tensor:
    """The int64 `[nnz]` row of each id of `feat` (sorted)."""
    if feat.row_ids is not None:
        return feat.row_ids
    return tf.ragged.row_splits_to_segment_ids(feat.row_splits,
                                               out_type=tf.int64)


def one_id_rows(ids: tf.Tensor) -> tf.RaggedTensor:
    """`ids` of any shape as a ragged batch of one-id rows (row-major).

    Pooled with "sum", each row is then its one id's table row: this is
    how the fused pooled lookup serves dense lookups (a plain gather,
    `max_norm` honoured by the same kernel).

    Args:
        ids: integer tensor of any shape S.

    Returns:
        A `[prod(S), (1)]` RaggedTensor with int64 row splits.
    """
    flat = tf.reshape(ids, [-1])
    return tf.RaggedTensor.from_row_splits(
        flat, tf.range(tf.size(flat, out_type=tf.int64) + 1),
        validate=False)


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
        positions, max_len = _positions(values, splits)
    return FeatureIds(values, splits, w, positions, max_len, name)


def _positions(values, splits):
    """Each id's slot in its row, and the longest row (the padded T)."""
    row_ids = tf.ragged.row_splits_to_segment_ids(splits)
    positions = tf.range(tf.size(values, out_type=tf.int64),
                         dtype=tf.int64) - tf.gather(splits, row_ids)
    max_len = tf.reduce_max(tf.concat(
        [splits[1:] - splits[:-1], tf.zeros([1], tf.int64)], 0))
    return positions, max_len


def from_packed(values, row_splits, offsets, batch, weights,
                num_features: int, need_positions: bool = False
                ) -> List[FeatureIds]:
    """The features of ids packed by `ge.pack_ids` (see `PackedIds`).

    With the kernels, ONE op hands out views of the packed buffers; the
    pure-TF path slices them (copies) and checks the layout in one assert.
    """
    lib = capabilities.current().kernels
    if lib is not None:
        ids, splits, ws = lib.group_embedding_unpack_ids(
            values=values, row_splits=row_splits, offsets=offsets,
            batch=batch,
            weights=tf.zeros([0]) if weights is None else weights,
            num_features=num_features)
        ws = [None] * num_features if weights is None else ws
    else:
        ids, splits, ws = _unpack_tf(values, row_splits, offsets, batch,
                                     weights, num_features)
    feats = []
    for i, (v, s, fw) in enumerate(zip(ids, splits, ws)):
        positions = max_len = None
        if need_positions:
            positions, max_len = _positions(v, s)
        feats.append(FeatureIds(v, s, fw, positions, max_len,
                                f"packed ids[{i}]", batch=batch))
    return feats


def _unpack_tf(values, row_splits, offsets, batch, weights, num_features):
    """`GroupEmbeddingUnpackIds` in TF ops: the same checks in one assert,
    and one split of the values (features and the gaps between them)."""
    width = tf.shape(row_splits, out_type=tf.int64)[1]
    fits_width = (batch >= 0) & (batch < width)
    # Clamped, so that a batch past the splits fails the check below
    # instead of a slice.
    b = tf.clip_by_value(batch, 0, tf.maximum(width - 1, 0))
    counts = tf.gather(row_splits, b, axis=1)
    n = tf.size(values, out_type=tf.int64)
    ends = offsets + counts
    # Pieces: gap before feature 0, then each feature and the gap after it.
    gaps = tf.concat([offsets[:1], offsets[1:] - ends[:-1],
                      n[None] - ends[-1:]], 0)
    ok = (tf.equal(tf.shape(offsets, out_type=tf.int64)[0], num_features)
          & fits_width & tf.reduce_all(tf.equal(row_splits[:, 0], 0))
          & tf.reduce_all(row_splits[:, 1:b + 1] >= row_splits[:, :b])
          & tf.reduce_all(counts >= 0) & tf.reduce_all(gaps >= 0))
    if weights is not None:
        ok = ok & tf.equal(tf.size(weights, out_type=tf.int64), n)

    def _fail():
        check = tf.debugging.Assert(False, [
            f"packed ids: expected {num_features} features in order whose "
            "B + 1 row_splits fit the splits' width, start at 0 and never "
            "decrease, and whose ids fit the packed values without "
            "overlapping (as many weights as values); offsets, counts, "
            "values, batch B:", offsets, counts, n, batch])
        with tf.control_dependencies([check]):
            return tf.constant(False)

    valid = tf.cond(ok, lambda: tf.constant(True), _fail)
    with tf.control_dependencies([valid]):
        sizes = tf.reshape(tf.stack([gaps[:-1], counts], 1), [-1])
        sizes = tf.concat([sizes, gaps[-1:]], 0)

    def features_of(flat):
        return tf.split(flat, sizes, num=2 * num_features + 1)[1::2]

    splits = tf.unstack(row_splits[:, :b + 1], num=num_features)
    ws = ([None] * num_features if weights is None
          else features_of(weights))
    return features_of(values), splits, ws


def from_sparse(sp_ids: List[tf.SparseTensor], sp_weights: List,
                names: List[str], need_positions: bool = False,
                same_batch: bool = False):
    """Converts rank-2 SparseTensors to `FeatureIds`, once per feature.

    Returns:
        (features, batch_checked): `batch_checked` is True when the
        conversion itself verified that all features share one batch
        size (asked by `same_batch`).
    """
    lib = capabilities.current().kernels
    if lib is None:
        return _from_sparse_tf(sp_ids, sp_weights, names, need_positions,
                               same_batch)
    weights = [tf.zeros([0], tf.float32) if w is None
               else _float_weights(w.values) for w in sp_weights]
    values, splits, row_w, _, positions = lib.group_embedding_sparse_to_ragged(
        indices=[s.indices for s in sp_ids],
        ids=[tf.cast(s.values, tf.int64) for s in sp_ids],
        dense_shapes=[s.dense_shape for s in sp_ids],
        weights=weights, feature_names=[f"`{n}`" for n in names],
        same_batch=same_batch, with_positions=need_positions)
    feats = []
    for v, s, rw, w, pos, sp, n in zip(values, splits, row_w, sp_weights,
                                       positions, sp_ids, names):
        max_len = None
        if need_positions:
            # Read once the op has checked that dense_shape has 2 entries.
            with tf.control_dependencies([pos]):
                max_len = tf.identity(sp.dense_shape)[1]
        feats.append(FeatureIds(v, s, None if w is None else rw,
                                pos if need_positions else None, max_len, n))
    return feats, same_batch


def _check_ids_dtype(ids_dtype: tf.DType, name: str) -> None:
    if not ids_dtype.is_integer:
        raise TypeError(f"`{name}` must hold int32 or int64 ids, got "
                        f"{ids_dtype.name}.")


def _check_weights(weights: Any, ids: Any, name: str) -> None:
    """Checks the kind and dtype of one weight tensor against its ids."""
    if weights is None:
        return
    kind = type(ids).__name__
    if type(weights) is not type(ids):
        raise TypeError(f"`{name}` must be a {kind} like its ids, got "
                        f"{type(weights).__name__}.")
    if not weights.dtype.is_floating:
        raise TypeError(f"`{name}` must hold float weights, got "
                        f"{weights.dtype.name}.")


def to_feature_ids(sp_ids: Sequence[Any], sp_weights: Sequence[Any],
                   need_positions: bool = False,
                   same_batch: bool = True) -> List[FeatureIds]:
    """Converts every id feature to `FeatureIds`, checking it on the way.

    SparseTensors (indices in any order, duplicates allowed) are converted
    together, once per feature; RaggedTensors are used as they are.

    Args:
        sp_ids: SparseTensor or RaggedTensor ids, one per feature.
        sp_weights: None or matching float weights, one per feature.
        need_positions: also compute each id's slot in its row.
        same_batch: require one batch size for all features (checked
            statically, else at run time).

    Raises:
        TypeError: ids not integer, weights not float, unsupported kind.
        ValueError: SparseTensor of rank != 2, RaggedTensor not 2-D, or
            batch sizes that differ between features (when static).
    """
    feats: List[Optional[FeatureIds]] = [None] * len(sp_ids)
    sparse_at = []
    for i, (ids, w) in enumerate(zip(sp_ids, sp_weights)):
        name = f"sp_ids[{i}]"
        _check_weights(w, ids, f"sp_weights[{i}]")
        if isinstance(ids, tf.SparseTensor):
            _check_ids_dtype(ids.dtype, name)
            rank = ids.shape.rank
            if rank is None:
                rank = tf.compat.dimension_value(ids.indices.shape[1])
            if rank is not None and rank != 2:
                raise ValueError(f"`{name}` must be a rank-2 SparseTensor "
                                 f"[batch, ids per row], got rank {rank}.")
            sparse_at.append(i)
        elif isinstance(ids, tf.RaggedTensor):
            _check_ids_dtype(ids.dtype, name)
            if ids.ragged_rank != 1 or ids.shape.rank != 2:
                raise ValueError(f"`{name}` must be a 2-D RaggedTensor "
                                 f"[batch, None], got shape {ids.shape}.")
            feats[i] = from_ragged(ids, w, name, need_positions)
        else:
            raise TypeError(f"`{name}` must be a SparseTensor or "
                            f"RaggedTensor, got {type(ids).__name__}.")
    batch_checked = False
    if sparse_at:
        # All SparseTensors: the conversion op can check the batch sizes
        # (one check instead of a few graph ops per feature).
        converted, batch_checked = from_sparse(
            [sp_ids[i] for i in sparse_at],
            [sp_weights[i] for i in sparse_at],
            [f"sp_ids[{i}]" for i in sparse_at], need_positions,
            same_batch=same_batch and len(sparse_at) == len(sp_ids))
        for i, f in zip(sparse_at, converted):
            feats[i] = f
    # Every entry is set: ragged ones above, sparse ones here.
    converted_all = [f for f in feats if f is not None]
    if (same_batch and not _check_batch_sizes(sp_ids)
            and not batch_checked):
        return _assert_same_batch(converted_all)
    return converted_all


def _static_batch(ids: Any) -> Optional[int]:
    if isinstance(ids, tf.SparseTensor):
        value = tf.get_static_value(ids.dense_shape[0])
    else:
        value = tf.compat.dimension_value(ids.shape[0])
    return None if value is None else int(value)


def _check_batch_sizes(sp_ids: Sequence[Any]) -> bool:
    """Rejects statically known batch sizes that differ between features.

    Returns:
        True if every batch size was known statically (nothing left to
        check at run time).
    """
    first = None
    all_static = True
    for i, ids in enumerate(sp_ids):
        b = _static_batch(ids)
        if b is None:
            all_static = False
            continue
        if first is None:
            first = (i, int(b))
        elif int(b) != first[1]:
            raise ValueError(
                f"`sp_ids[{i}]` has batch size {int(b)} but "
                f"`sp_ids[{first[0]}]` has {first[1]}; all features of one "
                "lookup must share the batch.")
    return all_static


def _assert_same_batch(feats: List[FeatureIds]) -> List[FeatureIds]:
    """Makes every feature's ids depend on ONE batch-size check.

    The per-feature asserts that name the feature are built only in the
    branch taken when the check fails. Every lookup path consumes the ids,
    so none runs on mismatched batches.
    """
    if len(feats) < 2:
        return feats
    sizes = [batch_size(f) for f in feats]
    same = tf.reduce_all(tf.equal(tf.stack(sizes[1:]), sizes[0]))

    def _fail() -> tf.Tensor:
        checks = [tf.debugging.assert_equal(
            size, sizes[0],
            message=f"`{f.name}` has a different batch size than "
                    f"`{feats[0].name}`.")
            for f, size in zip(feats[1:], sizes[1:])]
        with tf.control_dependencies(checks):
            return tf.constant(False)

    valid = tf.cond(same, lambda: tf.constant(True), _fail)
    with tf.control_dependencies([valid]):
        return [dataclasses.replace(f, values=tf.identity(f.values))
                for f in feats]


def _register_gradient():
    @op_names.register_gradient("GroupEmbeddingSparseToRagged")
    def _to_ragged_grad(op, *grads):
        # Only the weights are differentiable: route each weight's
        # gradient back from where the sort put it.
        n = op.get_attr("num_features")
        w_grads = grads[2 * n:3 * n]
        positions = op.outputs[3 * n:4 * n]
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


# Largest batch (dense_shape[0]) accepted, as in the
# GroupEmbeddingSparseToRagged kernel: outputs are [batch, D], and batch + 1
# must not overflow.
MAX_BATCH = 2 ** 48


def _rank_checked(ids, name):
    """(indices, dense_shape), behind a rank check unless shapes prove it."""
    if (ids.indices.shape.rank == 2
            and tf.compat.dimension_value(ids.indices.shape[1]) == 2
            and ids.dense_shape.shape.as_list() == [2]):
        return ids.indices, ids.dense_shape
    shape_ok = tf.debugging.Assert(
        tf.equal(tf.size(ids.dense_shape), 2)
        & tf.equal(tf.shape(ids.indices, out_type=tf.int64)[-1], 2),
        [f"`{name}` must be a SparseTensor of rank 2 ([batch, ids per "
         "row]) with [nnz, 2] indices; dense_shape, indices shape:",
         ids.dense_shape, tf.shape(ids.indices)])
    # Slicing waits for the rank check, so a bad rank is reported as such.
    with tf.control_dependencies([shape_ok]):
        return tf.identity(ids.indices), tf.identity(ids.dense_shape)


def _failing_checks(parts, need_positions, same_batch):
    """Per-feature asserts, built only in the branch taken on bad input.

    They name the offending feature; the hot path runs one fused check.
    """
    checks = []
    for p in parts:
        name, rows, batch = p["name"], p["rows"], p["batch"]
        checks.append(tf.debugging.Assert(
            (batch >= 0) & (batch <= MAX_BATCH),
            [f"`{name}`: dense_shape[0] (the batch size) must lie in "
             f"[0, {MAX_BATCH}]; got", batch]))
        if same_batch:
            first = parts[0]
            checks.append(tf.debugging.Assert(
                tf.equal(batch, first["batch"]),
                [f"`{name}` has a different batch size than "
                 f"`{first['name']}`:", batch, first["batch"]]))
        checks.append(tf.debugging.Assert(
            tf.reduce_all((rows >= 0) & (rows < batch)),
            [f"`{name}`: row index outside the batch [0, batch)."]))
        if need_positions:
            # Each id lands at [row, column] of a [batch, dense_shape[1]]
            # output; a column outside it would land in another row.
            cols = p["cols"]
            checks.append(tf.debugging.Assert(
                tf.reduce_all((cols >= 0) & (cols < p["width"])),
                [f"`{name}`: column index outside [0, dense_shape[1]); min "
                 "column, max column, dense_shape[1]:",
                 tf.reduce_min(cols), tf.reduce_max(cols), p["width"]]))
        if p["weights"] is not None:
            checks.append(tf.debugging.Assert(
                tf.equal(tf.size(p["weights"]), tf.size(rows)),
                [f"`{name}`: weights and ids differ in count:",
                 tf.size(p["weights"]), tf.size(rows)]))
    with tf.control_dependencies(checks):
        return tf.constant(False)


def _concat_rows(rows):
    """Every feature's rows in one vector, and a 0 after them, so that
    the first and last rows of features can be gathered even when no
    feature has any."""
    return tf.concat([tf.reshape(r, [-1]) for r in rows]
                     + [tf.zeros([1], tf.int64)], 0)


def _rows_in_order(every, starts, sizes):
    """True if each feature's rows, concatenated in `every` (see
    `_concat_rows`), are sorted.

    A decrease between neighbours is allowed only where a feature starts:
    one pass over all ids, whatever the number of features.
    """
    every = every[:-1]
    falls = tf.cast(every[1:] < every[:-1], tf.int64)
    # Positions of the falls allowed: just before each non-empty feature
    # but the first (its rows may well restart at 0).
    allowed = tf.boolean_mask(starts - 1, (starts > 0) & (sizes > 0))
    return tf.equal(tf.reduce_sum(falls),
                    tf.reduce_sum(tf.gather(falls, allowed)))


def all_sorted(vectors: List[tf.Tensor]) -> tf.Tensor:
    """Scalar bool: True if each int64 vector of `vectors` is
    non-decreasing. One pass over their concatenation, in a fixed number
    of ops whatever the number of vectors."""
    sizes = tf.stack([tf.size(v, out_type=tf.int64) for v in vectors])
    return _rows_in_order(_concat_rows(vectors),
                          tf.cumsum(sizes, exclusive=True), sizes)


def _first_last_in_batch(every, starts, sizes, batches):
    """Rows sorted per feature: all lie in [0, batch) iff the first and
    the last of each non-empty feature do. `every` as `_concat_rows`
    makes it: an empty feature reads a valid position, then is ignored."""
    nonempty = sizes > 0
    firsts = tf.gather(every, starts)
    lasts = tf.gather(every, tf.maximum(starts + sizes - 1, 0))
    return tf.reduce_all(~nonempty | ((firsts >= 0) & (lasts < batches)))


def _from_sparse_tf(sp_ids, sp_weights, names, need_positions,
                    same_batch=False):
    """All SparseTensor features at once, in pure TF, feature by feature.

    Nothing is concatenated but the row indices: each feature keeps its
    own tensors and its row indices serve as the pooling's segment ids
    (`row_ids`). ONE fused check over the concatenated rows covers every
    feature, in a fixed number of ops: each one's rows in order (else
    every feature is stably sorted by row, the only argsort), then, rows
    being in order, their range is that of the first and the last; batch
    sizes (the same for all when `same_batch`), column ranges and weight
    counts join the same check. `row_splits` come from a `searchsorted`
    that graphs prune when the lookup does not use them (the pure-TF
    pooled path does not).

    Returns:
        (features, batch_checked): `batch_checked` is `same_batch`, which
        the fused check covers.
    """
    parts = []
    for ids, weights, name in zip(sp_ids, sp_weights, names):
        indices, dense_shape = _rank_checked(ids, name)
        parts.append({
            "name": name, "rows": indices[:, 0], "batch": dense_shape[0],
            "values": tf.cast(ids.values, tf.int64),
            "weights": (None if weights is None
                        else _float_weights(weights.values)),
            "cols": indices[:, 1] if need_positions else None,
            "width": dense_shape[1] if need_positions else None})
    # Everything that must follow the ids when they are sorted by row.
    names_carried = ["values", "rows"] + (["cols"] if need_positions
                                          else [])
    carried = [{n: p[n] for n in names_carried} for p in parts]
    for c, p in zip(carried, parts):
        if p["weights"] is not None:
            c["weights"] = p["weights"]
    sizes = tf.stack([tf.size(p["rows"], out_type=tf.int64) for p in parts])
    starts = tf.cumsum(sizes, exclusive=True)
    every = _concat_rows([p["rows"] for p in parts])

    def _sort():
        out = []
        for c in carried:
            order = tf.argsort(c["rows"], stable=True)
            out.append({n: _gather_same_count(t, order, c["rows"])
                        for n, t in c.items()})
        return out, _concat_rows([c["rows"] for c in out])

    carried, every = tf.cond(_rows_in_order(every, starts, sizes),
                             lambda: (carried, every), _sort)
    batches = tf.stack([p["batch"] for p in parts])
    ok = [tf.reduce_all((batches >= 0) & (batches <= MAX_BATCH)),
          _first_last_in_batch(every, starts, sizes, batches)]
    if same_batch:
        ok.append(tf.reduce_all(tf.equal(batches, batches[0])))
    if need_positions:
        # Each id's column against its own feature's width.
        cols = tf.concat([c["cols"] for c in carried], 0)
        feature = tf.searchsorted(starts + sizes,
                                  tf.range(tf.size(cols, out_type=tf.int64)),
                                  side="right")
        widths = tf.gather(tf.stack([p["width"] for p in parts]), feature)
        ok.append(tf.reduce_all((cols >= 0) & (cols < widths)))
    weighted = [i for i, p in enumerate(parts) if p["weights"] is not None]
    if weighted:
        ok.append(tf.reduce_all(tf.equal(
            tf.stack([tf.size(parts[i]["weights"], out_type=tf.int64)
                      for i in weighted]),
            tf.gather(sizes, weighted))))
    valid = tf.cond(tf.reduce_all(tf.stack(ok)), lambda: tf.constant(True),
                    lambda: _failing_checks(parts, need_positions,
                                            same_batch))
    feats = []
    with tf.control_dependencies([valid]):
        for c, p in zip(carried, parts):
            rows = tf.identity(c["rows"])
            # The splits allocate `batch + 1` entries: only once checked.
            batch = tf.identity(p["batch"])
            splits = tf.searchsorted(
                rows, tf.range(batch + 1, dtype=tf.int64), side="left",
                out_type=tf.int64)
            feats.append(FeatureIds(
                values=c["values"], row_splits=splits,
                weights=c.get("weights"),
                positions=c["cols"] if need_positions else None,
                max_len=p["width"], name=p["name"], row_ids=rows,
                batch=batch))
    return feats, same_batch


def _gather_same_count(t, order, rows):
    """`t` reordered by `order`, or as is if its count differs from the
    rows' (mismatched weights, reported by the count check)."""
    return tf.cond(tf.equal(tf.size(t), tf.size(rows)),
                   lambda: tf.gather(t, order), lambda: t)
