"""EV-aware optimizers vs stock Keras optimizers on plain tf.Variables.

One model = an EmbeddingVariable + a plain table (sparse gradient) + a
dense kernel; the oracle is the same model with the EV replaced by a
tf.Variable, trained by the stock Keras optimizer on dense gradients.
Every batch touches every key, so lazy and dense updates agree.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

import ev_cases

OPTIMIZERS = {
    "sgd": (lambda: ge.optimizers.SGD(0.1),
            lambda: keras.optimizers.SGD(0.1)),
    "adagrad": (lambda: ge.optimizers.Adagrad(0.1),
                lambda: keras.optimizers.Adagrad(0.1)),
    "adam": (lambda: ge.optimizers.Adam(0.05),
             lambda: keras.optimizers.Adam(0.05)),
    "ftrl": (lambda: ge.optimizers.Ftrl(0.2, l1_regularization_strength=0.01,
                                        l2_regularization_strength=0.02,
                                        beta=0.1),
             lambda: keras.optimizers.Ftrl(0.2,
                                           l1_regularization_strength=0.01,
                                           l2_regularization_strength=0.02,
                                           beta=0.1)),
}
DIM = 4


def _loss(embs, kernel):
    x = tf.concat(embs, 1)
    return tf.reduce_mean(tf.square(tf.matmul(x, kernel) - 1.0))


def _train(name, use_function, steps=4):
    rng = np.random.default_rng(0)
    ev = ev_cases.make_ev("ev_" + name, DIM)
    keys = ev_cases.KEYS
    oracle = tf.Variable(ev_cases.initial_rows(ev, keys))
    table0 = np.random.default_rng(1).normal(size=(6, DIM)).astype("f")
    table, table_ref = tf.Variable(table0), tf.Variable(table0)
    kernel0 = np.random.default_rng(2).normal(size=(2 * DIM, 1)).astype("f")
    kernel, kernel_ref = tf.Variable(kernel0), tf.Variable(kernel0)
    make_ge, make_stock = OPTIMIZERS[name]
    opt, ref_opt = make_ge(), make_stock()

    def step(batch, rows, plain):
        with tf.GradientTape() as tape:
            embs = ge.group_embedding_lookup_sparse([ev, table],
                                                    [batch, plain], "mean")
            loss = _loss(embs, kernel)
        grads = tape.gradient(loss, [ev, table, kernel])
        opt.apply_gradients(zip(grads, [ev, table, kernel]))
        with tf.GradientTape() as tape:
            embs = [ev_cases.stock_pooled(oracle, rows, "mean"),
                    ev_cases.stock_pooled(table_ref, plain, "mean")]
            ref_loss = _loss(embs, kernel_ref)
        ref_vars = [oracle, table_ref, kernel_ref]
        ref_grads = [tf.convert_to_tensor(g)
                     for g in tape.gradient(ref_loss, ref_vars)]
        ref_opt.apply_gradients(zip(ref_grads, ref_vars))
        return loss, ref_loss

    if use_function:
        step = tf.function(step)
    for _ in range(steps):
        batch = ev_cases.random_batch(rng)
        plain = ev_cases.random_batch(rng, keys=np.arange(6))
        loss, ref_loss = step(batch, ev_cases.to_rows(batch), plain)
        np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(),
                                   rtol=1e-5)
    return ev, oracle, (table, table_ref), (kernel, kernel_ref)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("use_function", [False, True],
                         ids=["eager", "function"])
def test_matches_stock_optimizer(name, use_function):
    ev, oracle, tables, kernels = _train(name, use_function)
    np.testing.assert_allclose(ev_cases.values_of(ev, ev_cases.KEYS),
                               oracle.numpy(), rtol=2e-5, atol=2e-6)
    for got, want in (tables, kernels):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-5,
                                   atol=2e-6)


def test_versions_record_the_update_step():
    ev = ev_cases.make_ev("ev_versions", DIM)
    opt = ge.optimizers.SGD(0.1)
    for keys in ([[1, 2]], [[2]], [[2, 3]]):
        with tf.GradientTape() as tape:
            (emb,) = ge.group_embedding_lookup_sparse(
                [ev], [tf.ragged.constant(keys, tf.int64)], "sum")
            loss = tf.reduce_sum(emb)
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    keys, _, freqs, versions = ev_cases.export_sorted(ev)
    np.testing.assert_array_equal(keys, [1, 2, 3])
    np.testing.assert_array_equal(freqs, [1, 3, 1])
    np.testing.assert_array_equal(versions, [0, 2, 2])


def test_momentum_with_ev_fails():
    ev = ev_cases.make_ev("ev_momentum", DIM)
    opt = ge.optimizers.SGD(0.1, momentum=0.9)
    with tf.GradientTape() as tape:
        (emb,) = ge.group_embedding_lookup_sparse(
            [ev], [tf.ragged.constant([[1]], tf.int64)], "sum")
    grad = tape.gradient(emb, ev)
    with pytest.raises(NotImplementedError, match="ev_momentum"):
        opt.apply_gradients([(grad, ev)])


TF1_OPTIMIZERS = {
    "sgd": (lambda: ge.train.GradientDescentOptimizer(0.1),
            lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)),
    "adagrad": (lambda: ge.train.AdagradOptimizer(0.1),
                lambda: tf.compat.v1.train.AdagradOptimizer(0.1)),
    "adam": (lambda: ge.train.AdamOptimizer(0.05),
             lambda: tf.compat.v1.train.AdamOptimizer(0.05)),
    "ftrl": (lambda: ge.train.FtrlOptimizer(
                 0.2, l1_regularization_strength=0.01,
                 l2_regularization_strength=0.02, beta=0.1),
             lambda: tf.compat.v1.train.FtrlOptimizer(
                 0.2, l1_regularization_strength=0.01,
                 l2_regularization_strength=0.02, beta=0.1)),
}


@pytest.mark.parametrize("name", sorted(TF1_OPTIMIZERS))
@pytest.mark.parametrize("with_dense", [True, False],
                         ids=["with_dense", "ev_only"])
def test_tf1_optimizer_matches_stock_in_graph_mode(name, with_dense):
    rng = np.random.default_rng(0)
    v1 = tf.compat.v1

    def value(r):
        return v1.ragged.RaggedTensorValue(r.values.numpy(),
                                           r.row_splits.numpy())

    batches = [ev_cases.random_batch(rng) for _ in range(4)]
    feeds = [(value(b), value(ev_cases.to_rows(b))) for b in batches]
    with tf.Graph().as_default():
        ev = ev_cases.make_ev("ev_tf1_" + name, DIM)
        oracle = tf.Variable(tf.zeros([len(ev_cases.KEYS), DIM]))
        kernel0 = np.random.default_rng(2).normal(size=(DIM, 1)).astype("f")
        kernel = tf.Variable(kernel0)
        kernel_ref = tf.Variable(kernel0)
        step = v1.train.create_global_step()
        ids = v1.ragged.placeholder(tf.int64, 1, [])
        rows = v1.ragged.placeholder(tf.int64, 1, [])
        (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "mean")
        ref = ev_cases.stock_pooled(oracle, rows, "mean")
        if with_dense:
            loss, ref_loss = _loss([emb], kernel), _loss([ref], kernel_ref)
        else:
            loss = tf.reduce_mean(tf.square(emb - 1.0))
            ref_loss = tf.reduce_mean(tf.square(ref - 1.0))
        make_ge, make_stock = TF1_OPTIMIZERS[name]
        train = make_ge().minimize(loss, global_step=step)
        ref_train = make_stock().minimize(ref_loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            dv = sess.run(ev.default_values)
            sess.run(oracle.assign(
                dv[np.mod(ev_cases.KEYS, ev_cases.DEFAULT_ROWS)]))
            for batch, batch_rows in feeds:
                feed = {ids: batch, rows: batch_rows}
                got, want = sess.run([loss, ref_loss], feed)
                sess.run([train, ref_train], feed)
                np.testing.assert_allclose(got, want, rtol=1e-5)
            keys, values, _, _ = sess.run(ev.export())
            np.testing.assert_allclose(
                values[np.argsort(keys)],
                sess.run(oracle)[np.argsort(ev_cases.KEYS)],
                rtol=2e-5, atol=2e-6)
            assert sess.run(step) == len(batches)
            if with_dense:
                np.testing.assert_allclose(*sess.run([kernel, kernel_ref]),
                                           rtol=2e-5, atol=2e-6)
