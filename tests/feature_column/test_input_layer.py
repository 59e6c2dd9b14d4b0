"""`input_layer` vs stock `tf.compat.v1.feature_column.input_layer`.

Each test builds both in one TF1 graph over the same features, copies our
tables into stock's variables, and compares outputs and table gradients;
op counts check one fused lookup per scope and no duplicate on a second
call.
"""

import numpy as np
import pytest
import tensorflow as tf

from group_embedding import feature_column as ge_fc

import fc_cases
from testing import COMBINERS
from testing import assert_close
from testing import op_counts

FUSED_OP = "GroupEmbeddingPooledLookup"


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    return fc_cases.write_vocab_file(tmp_path_factory.mktemp("vocab"))


def _parity(make_ours, make_stock, kind="sparse", keys=None):
    """Builds ours and stock in one graph; returns numpy results.

    Args:
        make_ours: () -> list of our columns.
        make_stock: () -> list of stock columns (same names).
        kind: input kind of the features.
        keys: feature keys to feed (default all).

    Returns:
        (ours, stock, our table grads, stock table grads), numpy; grads
        keyed by column name.
    """
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        features = fc_cases.make_features(kind, keys)
        ours_cols, stock_cols = make_ours(), make_stock()
        ours_vars, stock_vars = {}, {}
        ours = ge_fc.input_layer(features, ours_cols, cols_to_vars=ours_vars,
                                 scope="ge")
        # Stock columns do not read RaggedTensors.
        stock = tf.compat.v1.feature_column.input_layer(
            {k: v.to_sparse() if isinstance(v, tf.RaggedTensor) else v
             for k, v in features.items()},
            stock_cols, cols_to_vars=stock_vars)
        pairs = _pair_tables(ours_vars, stock_vars)
        copy = [s.assign(o) for o, s in pairs.values()]
        up = tf.constant(fc_cases.random_weights(
            [fc_cases.BATCH, ours.shape[1]]))
        g_ours = tf.gradients(tf.reduce_sum(ours * up),
                              [o for o, _ in pairs.values()])
        g_stock = tf.gradients(tf.reduce_sum(stock * up),
                               [s for _, s in pairs.values()])
        fetch = [ours, stock,
                 [tf.convert_to_tensor(g) for g in g_ours],
                 [tf.convert_to_tensor(g) for g in g_stock]]
        o, s, go, gs = fc_cases.run_graph(graph, fetch, before=copy)
    names = list(pairs)
    return o, s, dict(zip(names, go)), dict(zip(names, gs))


def _pair_tables(ours_vars, stock_vars):
    """Column name -> (our table, stock table), shared tables once."""
    stock_by_name = {c.name: v[0] for c, v in stock_vars.items() if v}
    shared = [v for v in tf.compat.v1.global_variables()
              if "shared_embedding" in v.name and v.name.startswith(
                  "input_layer/")]
    pairs = {}
    for c, (table,) in ours_vars.items():
        if any(table is t for t, _ in pairs.values()):
            continue
        stock = stock_by_name.get(c.name)
        if stock is None:
            stock = shared[0]
        pairs[c.name] = (table, stock)
    return pairs


def _assert_parity(result):
    ours, stock, g_ours, g_stock = result
    assert ours.shape == stock.shape
    assert_close(ours, stock)
    for name in g_stock:
        assert_close(g_ours[name], g_stock[name])



# Every combiner on every input kind would be 9 graphs per kernel path;
# each combiner and each input kind appears at least once.
@pytest.mark.parametrize("combiner,kind", [("sum", "dense"),
                                           ("mean", "sparse"),
                                           ("sqrtn", "ragged"),
                                           ("mean", "dense")])
def test_every_stock_kind_in_one_scope(kernel_mode, vocab_file, combiner,
                                       kind):
    cats = fc_cases.stock_categorical_columns(vocab_file)

    def ours():
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("all")):
            return [ge_fc.embedding_column(c, fc_cases.DIM, combiner)
                    for c in cats]

    def stock():
        return [tf.feature_column.embedding_column(c, fc_cases.DIM, combiner)
                for c in cats]

    _assert_parity(_parity(ours, stock, kind))


@pytest.mark.parametrize("combiner", COMBINERS)
def test_max_norm_and_unscoped_columns(vocab_file, combiner):
    # max_norm always takes the pure-TF path: no kernel_mode variants.
    cats = fc_cases.stock_categorical_columns(vocab_file)

    def ours():
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("mn")):
            scoped = [ge_fc.embedding_column(c, fc_cases.DIM, combiner,
                                             max_norm=0.3) for c in cats[:3]]
        # Outside any scope: looked up alone, as stock does.
        return scoped + [ge_fc.embedding_column(c, fc_cases.DIM, combiner,
                                                max_norm=0.3)
                         for c in cats[3:]]

    def stock():
        return [tf.feature_column.embedding_column(c, fc_cases.DIM, combiner,
                                                   max_norm=0.3)
                for c in cats]

    _assert_parity(_parity(ours, stock, "sparse"))


@pytest.mark.parametrize("combiner", COMBINERS)
def test_shared_embedding_columns(kernel_mode, combiner):
    fc = tf.feature_column
    uid = fc.categorical_column_with_identity("uid", 10)
    uid2 = fc.categorical_column_with_identity("uid2", 10)

    def ours():
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("sh")):
            return ge_fc.shared_embedding_columns([uid, uid2], fc_cases.DIM,
                                                  combiner)

    def stock():
        return tf.compat.v1.feature_column.shared_embedding_columns(
            [uid, uid2], fc_cases.DIM, combiner)

    result = _parity(ours, stock, "ragged", ["uid", "uid2"])
    assert len(result[2]) == 1  # one table, gradients of both summed
    _assert_parity(result)


def test_rank1_dense_and_numeric_columns(kernel_mode):
    fc = tf.feature_column
    cats = [fc.categorical_column_with_identity("uid", 10),
            fc.categorical_column_with_vocabulary_list("city", ["sf", "la"])]
    graph = tf.Graph()
    with graph.as_default():
        features = {"uid": tf.constant([3, -1, 0, 9], tf.int64),
                    "city": tf.constant(["la", "", "nope", "sf"]),
                    "price": tf.constant([[1.0], [2.0], [3.0], [4.0]])}
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("r1")):
            ours_cols = [ge_fc.embedding_column(c, 3, "sum") for c in cats]
        ours_vars, stock_vars = {}, {}
        price = fc.numeric_column("price")
        ours = ge_fc.input_layer(features, ours_cols + [price],
                                 cols_to_vars=ours_vars, scope="ge")
        stock = tf.compat.v1.feature_column.input_layer(
            features, [fc.embedding_column(c, 3, "sum") for c in cats]
            + [price], cols_to_vars=stock_vars)
        by_name = {c.name: v[0] for c, v in stock_vars.items() if v}
        copy = [by_name[c.name].assign(v[0]) for c, v in ours_vars.items()
                if v]
        o, s = fc_cases.run_graph(graph, [ours, stock], before=copy)
    assert o.shape == (4, 7)
    np.testing.assert_allclose(o, s, rtol=1e-6)
    # Sorted by name: city (3), price (1), uid (3); row 1 misses both ids.
    np.testing.assert_array_equal(o[1, [0, 1, 2, 4, 5, 6]], 0.0)
    assert o[1, 3] == 2.0


def _scoped_graph(second_call=False, second_scope=False):
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features("sparse", ["uid", "uid2", "tag"])
        fc = tf.feature_column
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("a")):
            cols = [ge_fc.embedding_column(
                fc.categorical_column_with_identity(k, 10), fc_cases.DIM)
                for k in ("uid", "uid2")]
        tag = fc.categorical_column_with_hash_bucket("tag", 20)
        if second_scope:
            with ge_fc.group_embedding_column_scope(
                    fc_cases.unique_name("b")):
                cols.append(ge_fc.embedding_column(tag, fc_cases.DIM))
        else:
            cols.append(ge_fc.embedding_column(tag, 8))  # another dim
        first = ge_fc.input_layer(features, cols)
        n_vars = len(tf.compat.v1.global_variables())
        counts = op_counts(graph)
        again = None
        if second_call:
            again = ge_fc.input_layer(features, cols)
            assert len(tf.compat.v1.global_variables()) == n_vars
            assert op_counts(graph)[FUSED_OP] == counts[FUSED_OP]
    return graph, first, again, counts


def test_one_fused_lookup_per_scope():
    _, _, _, counts = _scoped_graph(second_scope=True)
    assert counts[FUSED_OP] == 2


def test_unscoped_column_is_a_stock_lookup():
    _, _, _, counts = _scoped_graph()
    assert counts[FUSED_OP] == 1
    assert counts["SparseSegmentMean"] == 1


def test_second_call_reuses_lookup_and_variables():
    graph, first, again, _ = _scoped_graph(second_call=True,
                                           second_scope=True)
    a, b = fc_cases.run_graph(graph, [first, again])
    np.testing.assert_array_equal(a, b)


def test_tf_path_one_range_check_per_scope(monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "tf")
    graph, _, _, counts = _scoped_graph(second_scope=True)
    assert counts[FUSED_OP] == 0
    # Per-table lookups (stock's ops), but ONE fused id check per scope.
    checks = sum(op.type in ("If", "StatelessIf")
                 and "group_range_check" in op.name
                 for op in graph.get_operations())
    assert checks == 2


def _pool(rows: np.ndarray, lengths, combiner: str) -> np.ndarray:
    """numpy oracle: pools consecutive `rows`, `lengths[b]` per row."""
    out, start = [], 0
    for n in lengths:
        part = rows[start:start + n].sum(0) if n else np.zeros(rows.shape[1])
        out.append(part / {"sum": 1, "mean": max(n, 1),
                           "sqrtn": max(n, 1) ** 0.5}[combiner])
        start += n
    return np.stack(out)


@pytest.mark.parametrize("kind", ["dense", "ragged"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_ev_columns_pool_the_rows_of_their_keys(combiner, kind):
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features(kind, ["tag", "uid"])
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("ev")):
            cols = [ge_fc.embedding_column(
                        ge_fc.categorical_column_with_embedding("tag"),
                        fc_cases.DIM, combiner),
                    ge_fc.embedding_column(
                        ge_fc.categorical_column_with_embedding(
                            "uid", tf.int64), fc_cases.DIM, combiner)]
        cols_to_vars = {}
        out = ge_fc.input_layer(features, cols, cols_to_vars=cols_to_vars)
        tag_ev, uid_ev = (cols_to_vars[c][0] for c in cols)
        tags = [t for row in fc_cases.ROWS["tag"] for t in row]
        uids = [u for row in fc_cases.ROWS["uid"] for u in row]
        # Read after the training lookup inserted the keys.
        with tf.control_dependencies([out]):
            tag_rows = tag_ev.lookup_rows(tf.strings.to_hash_bucket_fast(
                tags, 2 ** 63 - 1), training=False)
            uid_rows = uid_ev.lookup_rows(tf.constant(uids, tf.int64),
                                          training=False)
            n_tags = tag_ev.size()
        o, tr, ur, n_tags = fc_cases.run_graph(
            graph, [out, tag_rows, uid_rows, n_tags])
    assert n_tags == len(set(tags))
    lengths = {k: [len(r) for r in fc_cases.ROWS[k]] for k in ("tag", "uid")}
    d = fc_cases.DIM
    np.testing.assert_allclose(o[:, :d], _pool(tr, lengths["tag"], combiner),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(o[:, d:], _pool(ur, lengths["uid"], combiner),
                               rtol=1e-5, atol=1e-6)
