"""Reading an EmbeddingVariable the DeepRec way: `tf.nn.embedding_lookup`,
`embedding_lookup_sparse`, `safe_embedding_lookup_sparse`, `tf.gather`.

Oracle: the stock function on a `tf.Variable` whose row k is the EV's row
for key k (built from `ev.export()`), and stock optimizers on that
variable for the gradients.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import embedding_ops

import group_embedding as ge

V1 = tf.compat.v1
VOCAB, DIM = 12, 4
STOCK = {
    "v1_lookup": V1.nn.embedding_lookup,
    "v2_lookup": tf.nn.embedding_lookup,
    "v1_sparse": V1.nn.embedding_lookup_sparse,
    "v2_sparse": tf.nn.embedding_lookup_sparse,
    "v1_safe": V1.nn.safe_embedding_lookup_sparse,
    "v2_safe": tf.nn.safe_embedding_lookup_sparse,
    "v1_gather": V1.gather,
    "v2_gather": tf.gather,
}


def _ev_and_oracle(name):
    """An EV holding keys 0..VOCAB-1 and a tf.Variable with its rows."""
    ev = ge.get_embedding_variable(name, DIM)
    ge.gather(ev, tf.range(VOCAB, dtype=tf.int64))  # inserts every key
    keys, values, _, _ = ev.export()
    rows = np.zeros([VOCAB, DIM], np.float32)
    rows[keys.numpy()] = values.numpy()
    return ev, tf.Variable(rows)


def _ev_rows(ev):
    keys, values, _, _ = ev.export()
    rows = np.zeros([VOCAB, DIM], np.float32)
    rows[keys.numpy()] = values.numpy()
    return rows


def _sparse(rng, rows=5, width=3, low=0):
    indices, values = [], []
    for r in range(rows - 1):  # the last row stays empty
        for c in range(rng.integers(0, width + 1)):
            indices.append([r, c])
            values.append(rng.integers(low, VOCAB))
    indices = np.array(indices, np.int64).reshape(-1, 2)
    ids = tf.SparseTensor(indices, np.array(values, np.int64), [rows, width])
    weights = tf.SparseTensor(
        indices, rng.uniform(-0.5, 2.0, len(values)).astype(np.float32),
        [rows, width])
    return ids, weights


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_eager_ge_reads_match_stock_and_train_like_stock(combiner):
    rng = np.random.default_rng(0)
    ev, var = _ev_and_oracle(f"reads_{combiner}")
    ids = tf.constant(rng.integers(0, VOCAB, [3, 2]), tf.int64)
    sp_ids, sp_w = _sparse(rng)
    with tf.GradientTape() as tape:
        a = ge.embedding_lookup(ev, ids, max_norm=1.0)
        b = ge.embedding_lookup_sparse([ev], sp_ids, sp_w, combiner=combiner)
        c = ge.safe_embedding_lookup_sparse(ev, sp_ids, sp_w,
                                            combiner=combiner)
        d = ge.gather(ev, ids[0])
        loss = sum(tf.reduce_sum(t * t) for t in (a, b, c, d))
    with tf.GradientTape() as stock_tape:
        sa = embedding_ops.embedding_lookup(var, ids, max_norm=1.0)
        sb = embedding_ops.embedding_lookup_sparse(var, sp_ids, sp_w,
                                                   combiner=combiner)
        sc = embedding_ops.safe_embedding_lookup_sparse(var, sp_ids, sp_w,
                                                        combiner=combiner)
        sd = tf.gather(var, ids[0])
        stock_loss = sum(tf.reduce_sum(t * t) for t in (sa, sb, sc, sd))
    for ours, stock in ((a, sa), (b, sb), (c, sc), (d, sd)):
        assert ours.shape == stock.shape
        np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-6)
    grad = tape.gradient(loss, ev)
    assert isinstance(grad, tf.IndexedSlices)
    ge.optimizers.Adagrad(0.1).apply([grad], [ev])
    # Keras's sparse Adagrad squares duplicate rows one by one; the EV
    # (like TF1's optimizers) sums them first, i.e. the dense update.
    keras.optimizers.Adagrad(0.1).apply(
        [tf.convert_to_tensor(stock_tape.gradient(stock_loss, var))], [var])
    np.testing.assert_allclose(_ev_rows(ev), var.numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ragged_ids_read_like_stock(combiner):
    """Ragged ids give what stock gives on the EV's rows: a RaggedTensor
    from `embedding_lookup` / `gather`, `[B, D]` from the safe lookup
    (negative ids and non-positive weights pruned), and the same update."""
    ev, var = _ev_and_oracle(f"ragged_{combiner}")
    ids = tf.ragged.constant([[3, 5, 3], [], [11], [-1, 7]], dtype=tf.int64)
    weights = tf.ragged.constant([[1.0, 0.5, 2.0], [], [0.0], [1.0, 1.5]])
    nested = tf.ragged.constant([[[1, 2], [4]], [[9, 9, 0]]], dtype=tf.int64)
    keep = tf.ragged.boolean_mask(ids, ids >= 0)
    with tf.GradientTape() as tape:
        outs = [ge.embedding_lookup(ev, keep), ge.gather(ev, nested),
                ge.safe_embedding_lookup_sparse(ev, ids, weights,
                                                combiner=combiner),
                ge.safe_embedding_lookup_sparse(ev, ids, combiner=combiner,
                                                default_id=6)]
        loss = sum(tf.reduce_sum(o * o) for o in outs)
    with tf.GradientTape() as stock_tape:
        stock = [tf.nn.embedding_lookup(var, keep), tf.gather(var, nested),
                 tf.nn.safe_embedding_lookup_sparse(var, ids, weights,
                                                    combiner=combiner),
                 tf.nn.safe_embedding_lookup_sparse(var, ids,
                                                    combiner=combiner,
                                                    default_id=6)]
        stock_loss = sum(tf.reduce_sum(o * o) for o in stock)
    for ours, want in zip(outs, stock):
        assert type(ours) is type(want)
        if isinstance(want, tf.RaggedTensor):
            np.testing.assert_array_equal(ours.nested_row_splits[0],
                                          want.nested_row_splits[0])
            ours, want = ours.flat_values, want.flat_values
        assert ours.shape == want.shape
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)
    ge.optimizers.SGD(0.1).apply([tape.gradient(loss, ev)], [ev])
    var.assign_sub(0.1 * tf.convert_to_tensor(
        stock_tape.gradient(stock_loss, var)))
    np.testing.assert_allclose(_ev_rows(ev), var.numpy(), rtol=1e-5,
                               atol=1e-6)


def test_safe_lookup_rank3_negative_ids_and_default_id():
    ev, var = _ev_and_oracle("safe_rank3")
    indices = [[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 1, 0], [1, 1, 1]]
    ids = tf.SparseTensor(indices, tf.constant([3, -1, 5, 7, 2], tf.int64),
                          [2, 3, 2])
    weights = tf.SparseTensor(indices, [1.0, 2.0, 0.0, 0.5, 1.5], [2, 3, 2])
    for combiner in ("sum", "mean"):
        for default_id in (None, 4):
            ours = ge.safe_embedding_lookup_sparse(
                ev, ids, weights, combiner=combiner, default_id=default_id)
            stock = embedding_ops.safe_embedding_lookup_sparse(
                var, ids, weights, combiner=combiner, default_id=default_id)
            assert ours.shape == stock.shape == (2, 3, DIM)
            np.testing.assert_allclose(ours, stock, rtol=1e-5, atol=1e-6)
    # Negative ids are dropped, not inserted, as in stock.
    keys, _, _, _ = ev.export()
    assert -1 not in set(keys.numpy())


def test_compat_graph_mode_reads_train_ev_like_stock_optimizer(compat):
    rng = np.random.default_rng(1)
    graph = tf.Graph()
    with graph.as_default():
        ev = V1.get_embedding_variable("graph_ev", DIM)
        var = V1.get_variable("oracle", [VOCAB, DIM], use_resource=True)
        insert = V1.gather(ev, tf.range(VOCAB, dtype=tf.int64))
        keys, values, _, _ = ev.export()
        copy = var.assign(tf.scatter_nd(tf.reshape(keys, [-1, 1]), values,
                                        [VOCAB, DIM]))
        ids = tf.constant(rng.integers(0, VOCAB, [4, 2]), tf.int64)
        sp_ids, sp_w = _sparse(rng)

        def loss_of(table, lookup, lookup_sparse, safe, gather):
            outs = [lookup(table, ids),
                    lookup_sparse(table, sp_ids, sp_w, combiner="mean"),
                    safe(table, sp_ids, None, combiner="sqrtn"),
                    gather(table, ids[:, 0])]
            return outs, tf.add_n([tf.reduce_sum(t * t) for t in outs])

        ours, loss = loss_of(ev, V1.nn.embedding_lookup,
                             V1.nn.embedding_lookup_sparse,
                             V1.nn.safe_embedding_lookup_sparse, V1.gather)
        stock, stock_loss = loss_of(
            var, STOCK["v1_lookup"], STOCK["v1_sparse"], STOCK["v1_safe"],
            STOCK["v1_gather"])
        # compat's tf.compat.v1.train.AdagradOptimizer is ge.train's.
        step = V1.train.AdagradOptimizer(0.2).minimize(loss, var_list=[ev])
        stock_step = STOCK_ADAGRAD(0.2).minimize(stock_loss, var_list=[var])
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(insert)
            sess.run(copy)
            for o, s in zip(sess.run(ours), sess.run(stock)):
                np.testing.assert_allclose(o, s, rtol=1e-5, atol=1e-6)
            for _ in range(2):
                sess.run([step, stock_step])
            k, v = sess.run([keys, values])
            rows = np.zeros([VOCAB, DIM], np.float32)
            rows[k] = v
            np.testing.assert_allclose(rows, sess.run(var), rtol=1e-5,
                                       atol=1e-6)


STOCK_ADAGRAD = V1.train.AdagradOptimizer


def test_compat_eager_reads_and_ge_optimizer(compat):
    rng = np.random.default_rng(2)
    ev, var = _ev_and_oracle("eager_compat")
    ids = tf.constant(rng.integers(0, VOCAB, [5]), tf.int64)
    sp_ids, _ = _sparse(rng)
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(tf.nn.embedding_lookup(ev, ids) ** 2)
                + tf.reduce_sum(tf.nn.embedding_lookup_sparse(
                    ev, sp_ids, None, combiner="sum"))
                + tf.reduce_sum(tf.nn.safe_embedding_lookup_sparse(
                    [ev], sp_ids))
                + tf.reduce_sum(tf.gather(ev, ids)))
    with tf.GradientTape() as stock_tape:
        stock_loss = (
            tf.reduce_sum(STOCK["v2_lookup"](var, ids) ** 2)
            + tf.reduce_sum(STOCK["v2_sparse"](var, sp_ids, None,
                                               combiner="sum"))
            + tf.reduce_sum(STOCK["v2_safe"](var, sp_ids))
            + tf.reduce_sum(STOCK["v2_gather"](var, ids)))
    np.testing.assert_allclose(loss, stock_loss, rtol=1e-5)
    ge.optimizers.SGD(0.5).apply([tape.gradient(loss, ev)], [ev])
    keras.optimizers.SGD(0.5).apply([stock_tape.gradient(stock_loss, var)],
                                     [var])
    np.testing.assert_allclose(_ev_rows(ev), var.numpy(), rtol=1e-5,
                               atol=1e-6)


def test_compat_non_ev_calls_are_stock(compat):
    rng = np.random.default_rng(3)
    table = tf.constant(rng.normal(size=[VOCAB, DIM]), tf.float32)
    parts = [tf.Variable(table[:6]), tf.Variable(table[6:])]
    ids = tf.constant(rng.integers(0, VOCAB, [3, 2]), tf.int64)
    sp_ids, sp_w = _sparse(rng)
    pairs = [
        (tf.nn.embedding_lookup(table, ids, max_norm=0.5),
         STOCK["v2_lookup"](table, ids, max_norm=0.5)),
        (V1.nn.embedding_lookup(parts, ids, "div"),
         STOCK["v1_lookup"](parts, ids, "div")),
        (V1.nn.embedding_lookup_sparse(parts, sp_ids, sp_w, "mod", None,
                                       "sqrtn"),
         STOCK["v1_sparse"](parts, sp_ids, sp_w, "mod", None, "sqrtn")),
        (tf.nn.safe_embedding_lookup_sparse(table, sp_ids, default_id=2),
         STOCK["v2_safe"](table, sp_ids, default_id=2)),
        # TF1 gather's 4th positional argument is `name`, TF2's is `axis`.
        (V1.gather(table, [1, 3], None, "g", 1),
         STOCK["v1_gather"](table, [1, 3], None, "g", 1)),
        (tf.gather(table, [[0, 1]], axis=1, batch_dims=0),
         STOCK["v2_gather"](table, [[0, 1]], axis=1, batch_dims=0)),
        (tf.gather(tf.ragged.constant([[1, 2], [3]]), [1, 0]).to_tensor(),
         STOCK["v2_gather"](tf.ragged.constant([[1, 2], [3]]),
                            [1, 0]).to_tensor()),
    ]
    for ours, stock in pairs:
        np.testing.assert_array_equal(ours, stock)
    # Stock's own errors come back unchanged.
    with pytest.raises(TypeError, match="sp_ids must be SparseTensor"):
        V1.nn.embedding_lookup_sparse(table, ids, None)
    with pytest.raises(TypeError):
        tf.gather(table)


def test_uninstall_restores_stock_functions(compat):
    assert tf.nn.embedding_lookup is not STOCK["v2_lookup"]
    compat.uninstall()
    assert tf.nn.embedding_lookup is STOCK["v2_lookup"]
    assert V1.nn.embedding_lookup is STOCK["v1_lookup"]
    assert tf.nn.embedding_lookup_sparse is STOCK["v2_sparse"]
    assert V1.nn.embedding_lookup_sparse is STOCK["v1_sparse"]
    assert tf.nn.safe_embedding_lookup_sparse is STOCK["v2_safe"]
    assert V1.nn.safe_embedding_lookup_sparse is STOCK["v1_safe"]
    assert tf.gather is STOCK["v2_gather"] and V1.gather is STOCK["v1_gather"]
    ev = ge.get_embedding_variable("after_uninstall", DIM)
    with pytest.raises((TypeError, ValueError)):
        tf.nn.embedding_lookup(ev, [1])
    compat.install()  # the fixture uninstalls again


def test_ev_read_errors_name_the_variable():
    ev = ge.get_embedding_variable("err_ev", DIM)
    other = ge.get_embedding_variable("err_ev2", DIM)
    with pytest.raises(ValueError, match="err_ev.*err_ev2"):
        ge.embedding_lookup([ev, other], [1])
    with pytest.raises(TypeError, match="mixes"):
        ge.embedding_lookup([ev, tf.Variable(tf.zeros([3, DIM]))], [1])
    with pytest.raises(ValueError, match="err_ev.*axis"):
        ge.gather(ev, [1], axis=1)
    with pytest.raises(TypeError, match="err_ev.*float"):
        ge.embedding_lookup(ev, tf.constant([1.0]))
    with pytest.raises(TypeError, match="err_ev.*SparseTensor"):
        ge.embedding_lookup_sparse(ev, tf.constant([[1]], tf.int64), None)
