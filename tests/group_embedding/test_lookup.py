"""`ge.group_embedding_lookup_sparse` / `ge.group_embedding_lookup` against
stock TF: forward, gradients, empty rows, sequences, dense ids.

Every test runs on both kernel paths (`kernel_mode` fixture).
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

from testing import assert_close
from testing import random_case
from testing import random_feature
from testing import random_table
from testing import sequence_oracle
from testing import stock_lookup
from testing import to_dense

SEEDS = (0, 1, 2)

# Two groups (dims 4 and 8) with mixed combiners inside the dim-4 group.
_MIXED = dict(dims=[4, 4, 8, 4], combiners=["sum", "mean", "sqrtn", "mean"])

# name -> random_case arguments (shapes not given here are drawn per seed).
CASES = {
    "one_table_sum": dict(dims=[4], kinds=["sparse"], combiners=["sum"]),
    "one_table_mean_ragged": dict(dims=[3], kinds=["ragged"],
                                  combiners=["mean"]),
    "mixed_dims_sparse": dict(_MIXED, kinds=["sparse"] * 4),
    "mixed_dims_ragged": dict(_MIXED, kinds=["ragged"] * 4),
    "mixed_kinds": dict(_MIXED, kinds=["sparse", "ragged", "ragged",
                                       "sparse"]),
    "weighted_sparse": dict(_MIXED, kinds=["sparse"] * 4, weighted=True),
    "weighted_ragged": dict(_MIXED, kinds=["ragged"] * 4, weighted=True),
    "some_weighted": dict(_MIXED, kinds=["sparse", "ragged", "sparse",
                                         "ragged"],
                          weighted=[True, False, False, True]),
    "int32_ids": dict(_MIXED, kinds=["sparse", "ragged", "sparse",
                                     "ragged"], id_dtype=tf.int32),
    "int32_ids_weighted": dict(_MIXED, kinds=["sparse", "ragged",
                                              "ragged", "sparse"],
                               id_dtype=tf.int32, weighted=True),
    "duplicate_ids": dict(_MIXED, kinds=["sparse", "ragged", "sparse",
                                         "sparse"], vocab=3, max_len=7,
                          weighted=[False, True, True, False]),
    "trailing_empty_rows": dict(_MIXED, kinds=["sparse", "ragged",
                                               "sparse", "ragged"],
                                batch_size=6, trailing_empty=3,
                                weighted=[True, False, True, False]),
    "all_rows_empty": dict(_MIXED, kinds=["sparse", "ragged", "sparse",
                                          "ragged"], batch_size=4,
                           empty_prob=1.0, weighted=True),
    "single_row": dict(_MIXED, kinds=["sparse", "ragged", "sparse",
                                      "ragged"], batch_size=1,
                       empty_prob=0.0),
    "many_tables_one_group": dict(dims=[2] * 7, kinds=["sparse"] * 7,
                                  combiners=["sum", "mean", "sqrtn"] * 2
                                  + ["mean"]),
    # Rows wider than 16: the pure-TF path pools unweighted ones with a
    # sparse segment sum rather than a sparse-dense product.
    "wide_rows": dict(dims=[32, 32, 17, 17], kinds=["sparse", "ragged",
                                                    "sparse", "ragged"],
                      combiners=["sum", "mean", "sqrtn", "mean"],
                      weighted=[False, False, False, True]),
    # Enough distinct ids that the C++ backward builds each id's gradient
    # sum in turn (a table's sums over 512 KiB) for the dim-64 and dim-72
    # tables, and adds into them in place for the dim-16 one.
    "many_distinct_ids": dict(dims=[64, 64, 72, 16],
                              kinds=["sparse", "ragged", "sparse", "ragged"],
                              combiners=["sum", "mean", "sqrtn", "mean"],
                              weighted=[False, True, True, False],
                              vocab=6000, batch_size=2000, max_len=5),
}

MAX_NORM_CASES = {
    "max_norm_unweighted": dict(_MIXED, kinds=["sparse", "ragged",
                                               "sparse", "ragged"]),
    "max_norm_weighted": dict(_MIXED, kinds=["sparse", "ragged", "sparse",
                                             "ragged"], weighted=True),
    "max_norm_wide": dict(dims=[32, 32], kinds=["sparse", "ragged"],
                          combiners=["mean", "sqrtn"]),
}

_case_params = pytest.mark.parametrize(
    "name,seed", [(n, s) for n in CASES for s in SEEDS],
    ids=[f"{n}-seed{s}" for n in CASES for s in SEEDS])


def _lookup(case, sp_weights=None, **kwargs):
    return ge.group_embedding_lookup_sparse(
        case.tables, case.sp_ids(), case.combiners, sp_weights=sp_weights,
        **kwargs)


def _check_outputs(case, got, want):
    assert isinstance(got, list) and len(got) == len(case.tables)
    for i, (g, w, t) in enumerate(zip(got, want, case.tables)):
        assert g.shape == (case.batch_size, t.shape[1]), f"output {i}"
        assert_close(g, w)


@_case_params
def test_forward_matches_stock(kernel_mode, name, seed):
    case = random_case(seed, **CASES[name])
    got = _lookup(case, case.sp_weights())
    _check_outputs(case, got, case.stock(case.sp_weights()))


@pytest.mark.parametrize("max_norm", [0.5, 2.0])
@pytest.mark.parametrize("name", list(MAX_NORM_CASES))
def test_max_norm_matches_stock(kernel_mode, name, max_norm):
    case = random_case(3, **MAX_NORM_CASES[name], batch_size=6, vocab=6)
    weights = case.sp_weights()
    with tf.GradientTape(persistent=True) as tape:
        got = _lookup(case, weights, max_norm=max_norm)
        want = case.stock(weights, max_norm=max_norm)
        got_loss = _random_loss(got, seed=1)
        want_loss = _random_loss(want, seed=1)
    _check_outputs(case, got, want)
    for i, t in enumerate(case.tables):
        assert_close(tape.gradient(got_loss, t),
                     to_dense(tape.gradient(want_loss, t), t.shape))


def _random_loss(outputs, seed):
    """sum_i <outputs[i], R_i> with fixed random R_i: every gradient entry
    gets a distinct upstream value."""
    rng = np.random.default_rng(seed)
    return tf.add_n([tf.reduce_sum(o * rng.normal(size=o.shape)
                                   .astype(np.float32)) for o in outputs])


@_case_params
def test_table_gradients_match_stock(kernel_mode, name, seed):
    case = random_case(seed, **CASES[name])
    weights = case.sp_weights()
    with tf.GradientTape(persistent=True) as tape:
        got_loss = _random_loss(_lookup(case, weights), seed)
        want_loss = _random_loss(case.stock(weights), seed)
    for i, t in enumerate(case.tables):
        got = tape.gradient(got_loss, t)
        assert isinstance(got, tf.IndexedSlices), f"table {i}"
        assert_close(got, to_dense(tape.gradient(want_loss, t), t.shape))


@pytest.mark.parametrize("kernel_mode", [
    "custom", "tf"], indirect=True)
def test_table_gradient_indices_are_unique(kernel_mode):
    case = random_case(0, **CASES["duplicate_ids"])
    with tf.GradientTape() as tape:
        loss = _random_loss(_lookup(case, case.sp_weights()), 0)
    for i, g in enumerate(tape.gradient(loss, case.tables)):
        indices = g.indices.numpy()
        assert len(np.unique(indices)) == len(indices), f"table {i}"



@pytest.mark.parametrize("kernel_mode", [
    "custom", "tf"],
    indirect=True)
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_weight_gradients_match_stock_sparse(kernel_mode, seed):
    _check_weight_gradients(seed, "sparse")


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_weight_gradients_match_stock_ragged(kernel_mode, seed):
    _check_weight_gradients(seed, "ragged")


def _check_weight_gradients(seed, kind):
    """Gradients w.r.t. tables and weight values (read from variables
    watched by the tape) equal stock's, for every combiner."""
    case = random_case(seed, dims=[4, 4, 4, 8], kinds=[kind] * 4,
                       combiners=["sum", "mean", "sqrtn", "sqrtn"],
                       weighted=True, batch_size=6, max_len=4)
    w_vars = [tf.Variable(f.flat_weights()) for f in case.features]
    with tf.GradientTape(persistent=True) as tape:
        # Each path gets its own read, so the two graphs share nothing.
        got = _lookup(case, case.sp_weights([v * 1.0 for v in w_vars]))
        want = case.stock(case.sp_weights([v * 1.0 for v in w_vars]))
        got_loss = _random_loss(got, seed)
        want_loss = _random_loss(want, seed)
    for i, (t, v) in enumerate(zip(case.tables, w_vars)):
        assert_close(tape.gradient(got_loss, t),
                     to_dense(tape.gradient(want_loss, t), t.shape))
        assert_close(tape.gradient(got_loss, v),
                     to_dense(tape.gradient(want_loss, v), v.shape))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("weighted", [False, True],
                         ids=["unweighted", "weighted"])
def test_empty_rows_are_zero(kernel_mode, combiner, kind, weighted):
    rng = np.random.default_rng(7)
    table = random_table(rng, 9, 4)
    feature = random_feature(rng, kind=kind, batch_size=7, vocab=9,
                             weighted=weighted, empty_prob=0.5,
                             trailing_empty=2)
    empty = [b for b, r in enumerate(feature.rows) if len(r) == 0]
    full = [b for b, r in enumerate(feature.rows) if len(r)]
    assert len(empty) >= 2 and full, "the draw needs both kinds of row"
    weights = [feature.sp_weights()] if weighted else None
    out = ge.group_embedding_lookup_sparse([table], [feature.ids()],
                                           combiner, sp_weights=weights)[0]
    out = out.numpy()
    assert out.shape == (7, 4)
    np.testing.assert_array_equal(out[empty], np.zeros([len(empty), 4]))
    want = stock_lookup(table, feature.ids(), feature.sp_weights(),
                        combiner, 7)
    assert_close(out, want)


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_entirely_empty_batch(kernel_mode, kind):
    rng = np.random.default_rng(8)
    tables = [random_table(rng, 5, 4), random_table(rng, 5, 8)]
    feats = [random_feature(rng, kind=kind, batch_size=3, vocab=5,
                            empty_prob=1.0, weighted=True) for _ in tables]
    assert all(f.nnz == 0 for f in feats)
    with tf.GradientTape() as tape:
        outs = ge.group_embedding_lookup_sparse(
            tables, [f.ids() for f in feats], ["mean", "sqrtn"],
            sp_weights=[f.sp_weights() for f in feats])
        loss = tf.add_n([tf.reduce_sum(o) for o in outs])
    for o, t in zip(outs, tables):
        np.testing.assert_array_equal(o.numpy(),
                                      np.zeros([3, t.shape[1]]))
    for g, t in zip(tape.gradient(loss, tables), tables):
        np.testing.assert_array_equal(to_dense(g, t.shape),
                                      np.zeros(t.shape))


def test_shared_table_matches_stock(kernel_mode):
    """One variable used by several features, in one group."""
    rng = np.random.default_rng(9)
    table = random_table(rng, 6, 4)
    feats = [random_feature(rng, kind=k, batch_size=5, vocab=6,
                            weighted=w)
             for k, w in (("sparse", True), ("ragged", False),
                          ("sparse", False))]
    combiners = ["sum", "mean", "sqrtn"]
    weights = [f.sp_weights() for f in feats]
    with tf.GradientTape(persistent=True) as tape:
        got = ge.group_embedding_lookup_sparse(
            [table] * 3, [f.ids() for f in feats], combiners,
            sp_weights=weights)
        want = [stock_lookup(table, f.ids(), w, c, 5)
                for f, w, c in zip(feats, weights, combiners)]
        got_loss = _random_loss(got, 0)
        want_loss = _random_loss(want, 0)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert_close(tape.gradient(got_loss, table),
                 tape.gradient(want_loss, table))


def test_float64_tables_match_stock(kernel_mode):
    case = random_case(4, dims=[4, 4, 4], kinds=["sparse", "ragged",
                                                 "sparse"],
                       combiners=["sum", "mean", "sqrtn"],
                       weighted=[True, False, True],
                       table_dtype=np.float64)
    got = _lookup(case, case.sp_weights())
    assert all(g.dtype == tf.float64 for g in got)
    _check_outputs(case, got, case.stock(case.sp_weights()))


def test_partition_strategy_div_gives_same_result(kernel_mode):
    case = random_case(5, **CASES["mixed_kinds"])
    mod = _lookup(case, partition_strategy="mod")
    div = _lookup(case, partition_strategy="div")
    for a, b in zip(mod, div):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    _check_outputs(case, div, case.stock())


_ROW_MAJOR_SPEC = tf.SparseTensorSpec([None, None], tf.int64)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True],
                         ids=["unweighted", "weighted"])
def test_row_major_sparse_in_tf_function_matches_stock(kernel_mode,
                                                       combiner, weighted):
    # Row-major SparseTensors (as tf.data emits them) with unknown shapes
    # and trailing empty rows: the pure-TF path pools them in place (no
    # sort) and pads the rows after the last id.
    case = random_case(4, dims=[4, 4, 4], kinds=["sparse"] * 3,
                       combiners=[combiner] * 3, weighted=weighted,
                       batch_size=7, vocab=5, max_len=4, trailing_empty=2)
    ids = [tf.sparse.reorder(x) for x in case.sp_ids()]
    w_values = ([tf.sparse.reorder(w).values for w in case.sp_weights()]
                if weighted else [tf.ones_like(x.values, tf.float32)
                                  for x in ids])
    upstream = [np.random.default_rng(i).normal(size=(7, 4))
                .astype(np.float32) for i in range(3)]

    def run(lookup):
        @tf.function(input_signature=[
            [_ROW_MAJOR_SPEC] * 3, [tf.TensorSpec([None], tf.float32)] * 3])
        def fn(ids, w_values):
            with tf.GradientTape() as tape:
                tape.watch(w_values)
                weights = [tf.SparseTensor(x.indices, v, x.dense_shape)
                           if weighted else None
                           for x, v in zip(ids, w_values)]
                outs = lookup(ids, weights)
                loss = tf.add_n([tf.reduce_sum(o * u)
                                 for o, u in zip(outs, upstream)])
            sources = case.tables + (w_values if weighted else [])
            return outs, tape.gradient(loss, sources)
        return fn(ids, w_values)

    got, got_grads = run(
        lambda ids, w: ge.group_embedding_lookup_sparse(
            case.tables, ids, combiner, sp_weights=w))
    want, want_grads = run(
        lambda ids, w: [stock_lookup(t, x, v, combiner, 7)
                        for t, x, v in zip(case.tables, ids, w)])
    for g, w in zip(got, want):
        assert_close(g, w)
    for g, w, t in zip(got_grads, want_grads, case.tables):
        assert isinstance(g, tf.IndexedSlices)
        assert_close(g, to_dense(w, t.shape))
    # Weighted: the gradients of the weights follow the tables'.
    for g, w in zip(got_grads[3:], want_grads[3:]):
        assert_close(g, w)
    assert len(got_grads) == (6 if weighted else 3)


@pytest.mark.parametrize("dims", [[4, 4, 8], [32, 64, 17]],
                         ids=["narrow", "wide"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_lookup_traced_without_tape_matches_stock(kernel_mode, dims,
                                                  combiner):
    # Traced with no tape (inference), the pure-TF path pools straight
    # from the tables. Called under a tape afterwards, both paths still
    # give stock's gradient as IndexedSlices (the C++ path gave None: the
    # traced function had not been told that its op read the tables).
    case = random_case(5, dims=dims, kinds=["sparse", "ragged", "sparse"],
                       combiners=[combiner] * 3, batch_size=9, vocab=40,
                       max_len=5, trailing_empty=2)
    upstream = [np.random.default_rng(i).normal(size=(9, d))
                .astype(np.float32) for i, d in enumerate(dims)]

    @tf.function
    def lookup():
        return ge.group_embedding_lookup_sparse(case.tables, case.sp_ids(),
                                                combiner)

    want_outs = [stock_lookup(t, x, None, combiner, 9)
                 for t, x in zip(case.tables, case.sp_ids())]
    for g, w in zip(lookup(), want_outs):
        assert_close(g, w)
    with tf.GradientTape() as tape:
        got = tf.add_n([tf.reduce_sum(o * u)
                        for o, u in zip(lookup(), upstream)])
    got_grads = tape.gradient(got, case.tables)
    with tf.GradientTape() as tape:
        want = tf.add_n([tf.reduce_sum(o * u) for o, u in zip(
            [stock_lookup(t, x, None, combiner, 9)
             for t, x in zip(case.tables, case.sp_ids())], upstream)])
    want_grads = tape.gradient(want, case.tables)
    for g, w, t in zip(got_grads, want_grads, case.tables):
        assert isinstance(g, tf.IndexedSlices)
        assert_close(g, to_dense(w, t.shape))


def test_unsorted_columns_within_rows(kernel_mode):
    """Row-major rows with columns out of order inside a row."""
    indices = [[1, 2], [1, 0], [0, 1], [0, 0], [3, 1], [3, 0]]
    ids = tf.SparseTensor(indices, tf.constant([4, 1, 2, 2, 0, 3],
                                               tf.int64), [5, 3])
    weights = tf.SparseTensor(indices, [1.0, 2.0, 0.5, 1.5, 1.0, 3.0],
                              [5, 3])
    table = random_table(np.random.default_rng(10), 5, 4)
    for combiner in ("sum", "mean", "sqrtn"):
        got = ge.group_embedding_lookup_sparse([table], [ids], combiner,
                                               sp_weights=[weights])[0]
        assert_close(got, stock_lookup(table, ids, weights, combiner, 5))


def _mixed_order_features():
    """Four [5, 3] SparseTensors: row-major; rows out of order; empty;
    row-major again (its rows restart at 0 after the previous feature's)."""
    def sp(indices, ids):
        return tf.SparseTensor(np.array(indices, np.int64).reshape(-1, 2),
                               tf.constant(ids, tf.int64), [5, 3])
    return [sp([[0, 0], [2, 1], [4, 0]], [1, 2, 3]),
            sp([[3, 0], [0, 1], [3, 1], [1, 0]], [4, 0, 2, 2]),
            sp([], []),
            sp([[0, 2], [1, 0], [1, 1]], [3, 3, 1])]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_mixed_row_orders_and_empty_features(kernel_mode, graph):
    # One fused check covers all features: it must accept a decrease only
    # where a feature starts, sort the feature out of order, and keep the
    # empty one. Pooled against stock, sequences against to_dense.
    rng = np.random.default_rng(7)
    tables = [random_table(rng, 5, 4, f"mixed{i}") for i in range(4)]
    feats = _mixed_order_features()

    def lookup(sp_ids):
        return (ge.group_embedding_lookup_sparse(tables, sp_ids, "mean"),
                ge.group_embedding_lookup_sparse(tables, sp_ids, "sum",
                                                 is_sequence=True))
    if graph:
        lookup = tf.function(lookup, input_signature=[[_ROW_MAJOR_SPEC] * 4])
    pooled, seqs = lookup(feats)
    for t, x, got, seq in zip(tables, feats, pooled, seqs):
        x = tf.sparse.reorder(x)
        assert_close(got, stock_lookup(t, x, None, "mean", 5))
        dense_ids = tf.sparse.to_dense(x, default_value=-1)
        mask = tf.cast(dense_ids >= 0, tf.float32)[..., None]
        want = tf.gather(t, tf.maximum(dense_ids, 0)) * mask
        assert_close(seq, want)


@pytest.mark.parametrize("row", [5, -1])
@pytest.mark.parametrize("is_sequence", [False, True])
def test_row_outside_batch_in_a_later_feature(kernel_mode, row, is_sequence):
    # After an empty feature and a feature out of order, the bad row of
    # the last feature is reported under its own name.
    rng = np.random.default_rng(8)
    tables = [random_table(rng, 5, 4, f"late{i}") for i in range(4)]
    feats = _mixed_order_features()
    feats[3] = tf.SparseTensor([[0, 0], [row, 1]],
                               tf.constant([1, 2], tf.int64), [5, 3])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_ids\[3\]`: row index"):
        ge.group_embedding_lookup_sparse(tables, feats, "sum",
                                         is_sequence=is_sequence)


# ---------------------------------------------------------------------------
# is_sequence=True: unpooled [B, T, D].
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64],
                         ids=["int32", "int64"])
@pytest.mark.parametrize("weighted", [False, True],
                         ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("dims", [[4, 8, 4], [32, 17, 32]],
                         ids=["narrow", "wide"])
def test_sequence_matches_numpy(kernel_mode, kind, weighted, id_dtype, dims):
    rng = np.random.default_rng(11)
    tables = [random_table(rng, 7, d) for d in dims]
    feats = [random_feature(rng, kind=kind, batch_size=6, vocab=7,
                            max_len=4, weighted=weighted,
                            id_dtype=id_dtype, trailing_empty=1,
                            extra_width=2)
             for _ in dims]
    weights = [f.sp_weights() for f in feats] if weighted else None
    targets = [rng.normal(size=(6, f.width, d)).astype(np.float32)
               for f, d in zip(feats, dims)]
    with tf.GradientTape() as tape:
        outs = ge.group_embedding_lookup_sparse(
            tables, [f.ids() for f in feats], ["mean", "sum", "sqrtn"],
            sp_weights=weights, is_sequence=True)
        loss = tf.add_n([tf.reduce_sum(o * r)
                         for o, r in zip(outs, targets)])
    grads = tape.gradient(loss, tables)
    for i, (o, t, f, r) in enumerate(zip(outs, tables, feats, targets)):
        want = sequence_oracle(t.numpy(), f)
        assert o.shape == (6, f.width, t.shape[1]), f"output {i}"
        assert_close(o, want)
        # d loss / d table[id] = sum over the id's slots of w * R[b, col].
        want_grad = np.zeros(t.shape, np.float32)
        for b, (row, cols) in enumerate(zip(f.rows, f.cols)):
            for j, (k, c) in enumerate(zip(row, cols)):
                w = f.weights[b][j] if weighted else 1.0
                want_grad[k] += w * r[b, c]
        assert_close(grads[i], want_grad)


@pytest.mark.parametrize("dim", [4, 32])
def test_sequence_columns_out_of_order(kernel_mode, dim):
    # Columns out of order inside rows, in two of three tables: each id
    # still lands at its column (wide unweighted tables sort the slots
    # first); the gradient is the gather's, as for a dense lookup.
    rng = np.random.default_rng(12)
    tables = [random_table(rng, 6, dim, f"cols{i}") for i in range(3)]
    sps = [tf.SparseTensor([[0, 2], [0, 0], [1, 1], [2, 0], [2, 1]],
                           tf.constant([1, 4, 2, 2, 5], tf.int64), [3, 3]),
           tf.SparseTensor([[0, 0], [1, 0], [1, 1]],
                           tf.constant([3, 0, 3], tf.int64), [3, 2]),
           tf.SparseTensor([[1, 1], [1, 0], [2, 2], [2, 1]],
                           tf.constant([0, 1, 5, 5], tf.int64), [3, 3])]
    upstream = [rng.normal(size=(3, int(sp.dense_shape[1]), dim))
                .astype(np.float32) for sp in sps]

    def dense_lookup(table, sp):
        dense_ids = tf.sparse.to_dense(tf.sparse.reorder(sp),
                                       default_value=-1)
        mask = tf.cast(dense_ids >= 0, tf.float32)[..., None]
        return tf.gather(table, tf.maximum(dense_ids, 0)) * mask

    with tf.GradientTape(persistent=True) as tape:
        got = ge.group_embedding_lookup_sparse(tables, sps, "sum",
                                               is_sequence=True)
        want = [dense_lookup(t, sp) for t, sp in zip(tables, sps)]
        got_loss = tf.add_n([tf.reduce_sum(o * u)
                             for o, u in zip(got, upstream)])
        want_loss = tf.add_n([tf.reduce_sum(o * u)
                              for o, u in zip(want, upstream)])
    for g, w, t in zip(got, want, tables):
        assert_close(g, w)
        assert_close(tape.gradient(got_loss, t),
                     to_dense(tape.gradient(want_loss, t), t.shape))


@pytest.mark.parametrize("kind", [
    "sparse",
    "ragged"])
def test_sequence_all_rows_empty(kernel_mode, kind):
    """T is dense_shape[1] for SparseTensor ids, 0 for an empty ragged
    batch; every slot is zero and the batch size is kept."""
    rng = np.random.default_rng(12)
    table = random_table(rng, 5, 3)
    feature = random_feature(rng, kind=kind, batch_size=3, empty_prob=1.0,
                             max_len=2, extra_width=0)
    out = ge.group_embedding_lookup_sparse(
        [table], [feature.ids()], "sum", is_sequence=True)[0]
    width = 2 if kind == "sparse" else 0
    np.testing.assert_array_equal(out.numpy(), np.zeros([3, width, 3]))


# ---------------------------------------------------------------------------
# group_embedding_lookup: dense ids of any shape.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64],
                         ids=["int32", "int64"])
def test_dense_lookup_matches_stock(kernel_mode, id_dtype):
    rng = np.random.default_rng(13)
    shapes = [(5,), (3, 4), (2, 3, 2), (1,), (2, 0)]
    dims = [4, 8, 4, 4, 8]
    tables = [random_table(rng, 9, d) for d in dims]
    ids = [tf.constant(rng.integers(0, 9, s), id_dtype) for s in shapes]
    targets = [rng.normal(size=s + (d,)).astype(np.float32)
               for s, d in zip(shapes, dims)]
    with tf.GradientTape(persistent=True) as tape:
        got = ge.group_embedding_lookup(tables, ids)
        want = [tf.nn.embedding_lookup(t, i) for t, i in zip(tables, ids)]
        got_loss = tf.add_n([tf.reduce_sum(g * r)
                             for g, r in zip(got, targets)])
        want_loss = tf.add_n([tf.reduce_sum(w * r)
                              for w, r in zip(want, targets)])
    assert isinstance(got, list) and len(got) == len(tables)
    for g, w, s, d in zip(got, want, shapes, dims):
        assert g.shape == s + (d,)
        assert_close(g, w)
    for t in tables:
        assert_close(tape.gradient(got_loss, t),
                     to_dense(tape.gradient(want_loss, t), t.shape))


def test_dense_lookup_static_shape_in_tf_function(kernel_mode):
    rng = np.random.default_rng(14)
    tables = [random_table(rng, 9, 4), random_table(rng, 9, 8)]

    @tf.function
    def lookup(a, b):
        return ge.group_embedding_lookup(tables, [a, b])

    a = tf.constant(rng.integers(0, 9, (2, 3)), tf.int64)
    b = tf.constant(rng.integers(0, 9, (4,)), tf.int64)
    graph = lookup.get_concrete_function(a, b).graph
    assert [o.shape.as_list() for o in graph.structured_outputs] == [
        [2, 3, 4], [4, 8]]
    for g, t, i in zip(lookup(a, b), tables, (a, b)):
        assert_close(g, tf.nn.embedding_lookup(t, i))


@pytest.mark.parametrize("ev", [False, True], ids=["variable", "ev"])
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_graph_outputs_keep_the_row_width(kernel_mode, ev, max_norm):
    # Models size their next layer from `shape[-1]` (DeepRec's DCNv2 does)
    # in TF1 graphs, where the pooled outputs' batch is unknown: every
    # path (the TF pooling pads its segment sums) must keep the width.
    with tf.Graph().as_default():
        if ev:
            tables = [ge.get_embedding_variable(f"w{d}", d) for d in (4, 8)]
        else:
            tables = [tf.compat.v1.get_variable(f"w{d}", [10, d])
                      for d in (4, 8)]
        ids = [tf.compat.v1.sparse_placeholder(tf.int64) for _ in tables]
        outs = ge.group_embedding_lookup_sparse(tables, ids, "sum",
                                                max_norm=max_norm)
        assert [o.shape.as_list() for o in outs] == [[None, 4], [None, 8]]
        seq = ge.group_embedding_lookup_sparse(tables, ids, "sum",
                                               is_sequence=True)
        assert [o.shape.as_list()[-1] for o in seq] == [4, 8]
