"""DeepRec's AdamAsyncOptimizer and AdagradDecayOptimizer (`ge.train`,
installed as `tf.compat.v1.train.*` by compat).

Oracles: numpy implementations of the documented update rules, and stock
`AdamOptimizer` where AdamAsync's rule coincides (dense gradients).
"""

import importlib

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

V1 = tf.compat.v1
ROWS, DIM = 6, 3
IDS = [np.array([0, 2, 2, 5]), np.array([1, 2]), np.array([5, 0, 3])]


def _run(make_opt, table, ids_per_step, ev=False, global_step=None):
    """Loss sum(lookup * w) per step; returns (table rows, grads fed)."""
    w = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
    graph = tf.Graph()
    with graph.as_default():
        gs = V1.train.get_or_create_global_step()
        ids = V1.placeholder(tf.int64, [None])
        if ev:
            var = ge.get_embedding_variable(
                "ev", DIM, initializer=tf.constant_initializer(table),
                ev_option=ge.EmbeddingVariableOption(
                    init_option=ge.InitializerOption(
                        default_value_dim=ROWS)))
        else:
            var = V1.get_variable("var", initializer=table, use_resource=True)
        loss = tf.reduce_sum(ge.embedding_lookup(var, ids) * w)
        train = make_opt(gs).minimize(loss, global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for step_ids in ids_per_step:
                sess.run(train, {ids: step_ids})
            if ev:
                k, v, _, _ = sess.run(var.export())
                out = table.copy()
                out[k] = v
                return out, w
            return sess.run(var), w


def _grad(ids, w):
    g = np.zeros([ROWS, DIM], np.float64)
    for i in ids:
        g[i] += w
    return g, np.unique(ids)


def _adam_async_ref(table, ids_per_step, w, lr, b1, b2, eps, rmsprop=False):
    var = table.astype(np.float64).copy()
    m, v = np.zeros_like(var), np.zeros_like(var)
    b1p, b2p = b1, b2
    for ids in ids_per_step:
        g, rows = _grad(ids, w)
        for r in rows:
            v[r] = b2 * v[r] + (1 - b2) * g[r] ** 2
            if rmsprop:
                m[r] = b1 * m[r] + lr * g[r] / np.sqrt(v[r] + eps)
                var[r] -= m[r]
            else:
                alpha = lr * np.sqrt(1 - b2p) / (1 - b1p)
                m[r] = b1 * m[r] + (1 - b1) * g[r]
                var[r] -= alpha * m[r] / (np.sqrt(v[r]) + eps)
        if not rmsprop:
            b1p, b2p = b1p * b1, b2p * b2
    return var


@pytest.mark.parametrize("ev,rmsprop", [(False, False), (False, True),
                                        (True, False)])
def test_adam_async_sparse_matches_numpy_rule(ev, rmsprop):
    table = np.random.default_rng(0).normal(size=[ROWS, DIM]).astype(
        np.float32)
    out, w = _run(lambda gs: ge.train.AdamAsyncOptimizer(
        0.05, 0.8, 0.9, 1e-3, apply_sparse_rmsprop=rmsprop), table, IDS,
        ev=ev)
    ref = _adam_async_ref(table, IDS, w, 0.05, 0.8, 0.9, 1e-3, rmsprop)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_adam_async_dense_equals_stock_adam():
    table = np.random.default_rng(1).normal(size=[ROWS, DIM]).astype(
        np.float32)
    results = []
    for make in (lambda: ge.train.AdamAsyncOptimizer(0.05, epsilon=1e-3),
                 lambda: V1.train.AdamOptimizer(0.05, epsilon=1e-3)):
        with tf.Graph().as_default():
            var = V1.get_variable("dense", initializer=table,
                                  use_resource=True)
            loss = tf.reduce_sum(tf.sin(var) * var)
            train = make().minimize(loss)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                for _ in range(3):
                    sess.run(train)
                results.append(sess.run(var))
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5, atol=1e-6)


def test_adam_async_rmsprop_on_ev_is_a_clear_error():
    table = np.zeros([ROWS, DIM], np.float32)
    with pytest.raises(NotImplementedError, match="ev.*rmsprop"):
        _run(lambda gs: ge.train.AdamAsyncOptimizer(
            apply_sparse_rmsprop=True), table, IDS, ev=True)


def _adagrad_decay_ref(table, ids_per_step, w, lr, init, decay_step, rate):
    var = table.astype(np.float64).copy()
    acc = np.full_like(var, init)
    power = np.zeros(ROWS, np.int64)
    for step, ids in enumerate(ids_per_step):
        t = step + 1  # global_step + 1, global_step = steps run before
        g, rows = _grad(ids, w)
        for r in rows:
            if t // decay_step > power[r]:
                acc[r] = np.maximum(acc[r] * rate, init)
                power[r] += 1
            acc[r] += g[r] ** 2
            var[r] -= lr * g[r] / np.sqrt(acc[r])
    return var


# EVs: supported since issue 9 (a per-key decay count slot), same rule.
@pytest.mark.parametrize("ev", [False, True])
def test_adagrad_decay_sparse_matches_numpy_rule(ev):
    table = np.random.default_rng(2).normal(size=[ROWS, DIM]).astype(
        np.float32)
    steps = IDS * 3
    out, w = _run(lambda gs: ge.train.AdagradDecayOptimizer(
        0.1, gs, initial_accumulator_value=0.5, accumulator_decay_step=2,
        accumulator_decay_rate=0.5), table, steps, ev=ev)
    ref = _adagrad_decay_ref(table, steps, w, 0.1, 0.5, 2, 0.5)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    # Not plain Adagrad: the decay changed the result.
    plain = _adagrad_decay_ref(table, steps, w, 0.1, 0.5, 10 ** 6, 0.5)
    assert np.abs(ref - plain).max() > 1e-3


def _adagrad_decay_dense_ref(table, bias, masks, lr, init, decay_step,
                             rate):
    """The rule on dense gradients: every row of every variable takes the
    decay check each step, zero gradient or not."""
    params = [table.astype(np.float64).copy(), bias.astype(np.float64).copy()]
    accs = [np.full_like(p, init) for p in params]
    powers = [np.zeros(len(p), np.int64) for p in params]
    for step, mask in enumerate(masks):
        t = step + 1
        # d/dparams of sum(mask * table^2) + sum(bias^2 * (1 + sum(mask))).
        grads = [2 * mask * params[0], 2 * params[1] * (1 + mask.sum())]
        for p, a, power, g in zip(params, accs, powers, grads):
            decay = t // decay_step > power
            a[decay] = np.maximum(a[decay] * rate, init)
            power[decay] += 1
            a += g * g
            p -= lr * g / np.sqrt(a)
    return params


def test_adagrad_decay_dense_matches_numpy_rule():
    # Dense (not IndexedSlices) gradients, on a matrix and a rank-1
    # variable; rows whose gradient is zero in some steps must still
    # decay on schedule, which a sparse-style update would skip.
    rng = np.random.default_rng(3)
    table = rng.normal(size=[ROWS, DIM]).astype(np.float32)
    bias = rng.normal(size=[DIM]).astype(np.float32)
    masks = (rng.random([7, ROWS, DIM]) < 0.6).astype(np.float32)
    masks[1:4, 0] = 0.0  # row 0 idle through one decay boundary
    with tf.Graph().as_default():
        gs = V1.train.get_or_create_global_step()
        mask = V1.placeholder(tf.float32, [ROWS, DIM])
        var = V1.get_variable("dense", initializer=table, use_resource=True)
        b = V1.get_variable("bias", initializer=bias, use_resource=True)
        loss = tf.reduce_sum(mask * var * var) + tf.reduce_sum(
            b * b) * (1.0 + tf.reduce_sum(mask))
        opt = ge.train.AdagradDecayOptimizer(
            0.1, gs, initial_accumulator_value=0.5, accumulator_decay_step=2,
            accumulator_decay_rate=0.5)
        grads = opt.compute_gradients(loss, [var, b])
        assert all(isinstance(g, tf.Tensor) for g, _ in grads)  # dense
        train = opt.apply_gradients(grads, global_step=gs)
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for m in masks:
                sess.run(train, {mask: m})
            out = sess.run([var, b])
    ref = _adagrad_decay_dense_ref(table, bias, masks, 0.1, 0.5, 2, 0.5)
    for got, want in zip(out, ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The decay mattered: plain Adagrad (no decay) ends elsewhere.
    plain = _adagrad_decay_dense_ref(table, bias, masks, 0.1, 0.5, 10 ** 6,
                                     0.5)
    assert np.abs(ref[0] - plain[0]).max() > 1e-3


def test_adagrad_decay_checks_arguments():
    with pytest.raises(ValueError, match="accumulator_decay_rate"):
        ge.train.AdagradDecayOptimizer(0.1, None, accumulator_decay_rate=1.5)


def test_compat_installs_deeprec_optimizers():
    module = importlib.import_module("group_embedding.compat")
    module.install()
    try:
        assert V1.train.AdamAsyncOptimizer is ge.train.AdamAsyncOptimizer
        assert V1.train.AdagradDecayOptimizer is \
            ge.train.AdagradDecayOptimizer
    finally:
        module.uninstall()
    assert not hasattr(V1.train, "AdamAsyncOptimizer")
