"""The grouped lookup in the execution modes users train in.

* TF1 graph mode (`tf.compat.v1.Session`, `get_variable` tables,
  placeholder-fed SparseTensors, `AdagradOptimizer.minimize`);
* Keras 3 (`keras.Model` owning its tables via `add_weight`, `model.fit`
  on a tf.data pipeline).

Each trains the grouped lookup and, in an identical setup, stock
`tf.nn.embedding_lookup_sparse`; the trained weights must agree.

Keras 3 note: `model.fit` densifies RaggedTensors coming from tf.data, so
the pipeline yields a dict of SparseTensors; the "ragged" variant converts
them with `tf.RaggedTensor.from_sparse` inside `call`.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

from testing import assert_close
from testing import random_feature
from testing import stock_lookup

DIMS = [4, 4, 8]
VOCABS = [7, 11, 5]
COMBINERS = ["mean", "sqrtn", "sum"]


def _initial_tables(dims=DIMS):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(v, d)).astype(np.float32)
            for v, d in zip(VOCABS, dims)]


# ---------------------------------------------------------------------------
# TF1 graph mode.
# ---------------------------------------------------------------------------
_V1_BATCH = 6


def _v1_batches(steps=3):
    """Per step, per feature: a random Feature (feature 0 weighted)."""
    rng = np.random.default_rng(1)
    return [[random_feature(rng, kind="sparse", batch_size=_V1_BATCH,
                            vocab=v, max_len=3, weighted=(i == 0),
                            trailing_empty=1 if step == 1 else 0)
             for i, v in enumerate(VOCABS)]
            for step in range(steps)]


def _v1_train(use_ge, batches, params_num_per_group=None):
    """Trains in a fresh graph and session; returns the final tables."""
    init = _initial_tables()
    targets = [np.random.default_rng(2).normal(size=(_V1_BATCH, d))
               .astype(np.float32) for d in DIMS]
    with tf.Graph().as_default():
        tables = [tf.compat.v1.get_variable(
                      f"table{i}", initializer=v, use_resource=True)
                  for i, v in enumerate(init)]
        ph = [dict(indices=tf.compat.v1.placeholder(tf.int64, [None, 2]),
                   ids=tf.compat.v1.placeholder(tf.int64, [None]),
                   weights=tf.compat.v1.placeholder(tf.float32, [None]),
                   shape=tf.compat.v1.placeholder(tf.int64, [2]))
              for _ in VOCABS]
        sp_ids = [tf.SparseTensor(p["indices"], p["ids"], p["shape"])
                  for p in ph]
        sp_weights = [tf.SparseTensor(ph[0]["indices"], ph[0]["weights"],
                                      ph[0]["shape"]), None, None]
        if use_ge:
            kwargs = {}
            if params_num_per_group:
                kwargs["params_num_per_group"] = params_num_per_group
            outs = ge.group_embedding_lookup_sparse(
                tables, sp_ids, COMBINERS, sp_weights=sp_weights, **kwargs)
        else:
            outs = [stock_lookup(t, i, w, c, i.dense_shape[0])
                    for t, i, w, c in zip(tables, sp_ids, sp_weights,
                                          COMBINERS)]
        loss = tf.add_n([tf.reduce_sum(tf.square(o - y))
                         for o, y in zip(outs, targets)])
        train = tf.compat.v1.train.AdagradOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for features in batches:
                feed = {}
                for p, f in zip(ph, features):
                    feed[p["indices"]] = f.indices()
                    feed[p["ids"]] = f.flat_ids()
                    feed[p["shape"]] = [f.batch_size, f.width]
                    feed[p["weights"]] = (f.flat_weights() if f.weights
                                          is not None
                                          else np.zeros([f.nnz], np.float32))
                sess.run(train, feed)
            return sess.run(tables)


@functools.lru_cache(maxsize=None)
def _v1_stock_tables():
    return _v1_train(False, _v1_batches())


@pytest.mark.parametrize("params_num_per_group", [None, 1],
                         ids=["fused", "one_table_per_op"])
def test_v1_session_adagrad_matches_stock(kernel_mode,
                                          params_num_per_group):
    got = _v1_train(True, _v1_batches(), params_num_per_group)
    want = _v1_stock_tables()
    init = _initial_tables()
    for i, (g, w, t0) in enumerate(zip(got, want, init)):
        assert not np.allclose(w, t0), f"table {i} was not trained"
        assert_close(g, w)



@pytest.mark.parametrize("kernel_mode,loss_kind", [
    ("custom", "square"), ("custom", "linear"), ("tf", "square"),
    ("tf", "linear")],
    indirect=["kernel_mode"])
def test_v1_out_of_range_id_fails_and_keeps_tables(kernel_mode, loss_kind):
    # One group (one dim): its tables fail or update together. (Tables of
    # other groups would still be updated, as with stock per-table ops.)
    init = _initial_tables(dims=[4, 4, 4])
    with tf.Graph().as_default():
        tables = [tf.compat.v1.get_variable(
                      f"table{i}", initializer=v, use_resource=True)
                  for i, v in enumerate(init)]
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        sp_ids = [tf.SparseTensor([[0, 0], [1, 0]], ids, [2, 1])] * 3
        outs = ge.group_embedding_lookup_sparse(tables, sp_ids, "sum")
        if loss_kind == "square":
            outs = [tf.square(o) for o in outs]
        loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        train = tf.compat.v1.train.AdagradOptimizer(0.1).minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            # 6 is in range for params[0] and [1], not for params[2].
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"params\[2\]"):
                sess.run(train, {ids: [1, 6]})
            for got, want in zip(sess.run(tables), init):
                np.testing.assert_array_equal(got, want)
            sess.run(train, {ids: [1, 4]})
            assert not np.array_equal(sess.run(tables[2]), init[2])


# ---------------------------------------------------------------------------
# Keras 3.
# ---------------------------------------------------------------------------
_NUM_SAMPLES = 40
_KERAS_BATCH = 8


class Ranker(keras.Model):
    """Pools one feature per table, concatenates, applies a linear head.

    Tables are created in `build` with `add_weight`, from fixed initial
    values so that two instances start identical.
    """

    def __init__(self, lookup, kind, **kwargs):
        super().__init__(**kwargs)
        self.lookup = lookup
        self.kind = kind

    def build(self, input_shape):
        init = _initial_tables()
        self.tables = [
            self.add_weight(shape=v.shape, name=f"table{i}",
                            initializer=keras.initializers.Constant(v))
            for i, v in enumerate(init)]
        head = np.random.default_rng(3).normal(size=(sum(DIMS), 1))
        self.head = self.add_weight(
            shape=(sum(DIMS), 1), name="head",
            initializer=keras.initializers.Constant(head.astype(np.float32)))

    def call(self, features):
        ids = [features[f"f{i}"] for i in range(len(DIMS))]
        batch_size = ids[0].dense_shape[0]
        if self.kind == "ragged":
            # Batched SparseTensors are row-major but not right-ragged.
            ids = [tf.RaggedTensor.from_value_rowids(
                       x.values, x.indices[:, 0], nrows=batch_size)
                   for x in ids]
        if self.lookup == "ge":
            outs = ge.group_embedding_lookup_sparse(self.tables, ids,
                                                    COMBINERS)
        else:
            outs = [stock_lookup(t, x, None, c, batch_size)
                    for t, x, c in zip(self.tables, ids, COMBINERS)]
        return tf.matmul(tf.concat(outs, 1), self.head)


def _dataset():
    rng = np.random.default_rng(4)
    features = {}
    for i, v in enumerate(VOCABS):
        f = random_feature(rng, kind="sparse", batch_size=_NUM_SAMPLES,
                           vocab=v, max_len=3, empty_prob=0.2)
        features[f"f{i}"] = tf.sparse.reorder(f.ids())
    labels = rng.normal(size=(_NUM_SAMPLES, 1)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices(
        (features, labels)).batch(_KERAS_BATCH)


def _fit(lookup, kind, optimizer):
    model = Ranker(lookup, kind)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    history = model.fit(_dataset(), epochs=2, shuffle=False, verbose=0)
    return ([np.array(w.numpy()) for w in model.weights],
            history.history["loss"])


@functools.lru_cache(maxsize=None)
def _keras_stock_run():
    return _fit("stock", "sparse", keras.optimizers.Adagrad(
        0.1, initial_accumulator_value=0.1, epsilon=1e-7))


def _check_keras(weights, losses):
    want_weights, want_losses = _keras_stock_run()
    assert len(weights) == len(want_weights) == len(DIMS) + 1
    init = _initial_tables()
    for i, (g, w) in enumerate(zip(weights, want_weights)):
        if i < len(init):
            assert not np.allclose(w, init[i]), f"table {i} not trained"
        assert_close(g, w)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)



@pytest.mark.parametrize("kernel_mode,kind", [
    ("custom", "sparse"), ("custom", "ragged"),
    ("tf", "sparse"),
    ("tf", "ragged")],
    indirect=["kernel_mode"])
def test_keras_fit_matches_stock(kernel_mode, kind):
    _check_keras(*_fit("ge", kind, keras.optimizers.Adagrad(
        0.1, initial_accumulator_value=0.1, epsilon=1e-7)))


def test_keras_fit_with_ge_adagrad_matches_stock(kernel_mode):
    _check_keras(*_fit("ge", "sparse", ge.optimizers.Adagrad(
        0.1, initial_accumulator_value=0.1, epsilon=1e-7)))


# ---------------------------------------------------------------------------
# is_sequence=True and max_norm against stock, in a TF1 Session and under
# tf.function: forward values, table and weight gradients, trained tables
# (C++ kernels on "custom", pure TF on "tf").
# ---------------------------------------------------------------------------
VARIANTS = {
    "max_norm": dict(is_sequence=False, max_norm=1.2),
    # Below every row's norm: all rows clip, the gradient is projected.
    "max_norm_all_clipped": dict(is_sequence=False, max_norm=0.05),
    "sequence": dict(is_sequence=True, max_norm=None),
    "sequence_max_norm": dict(is_sequence=True, max_norm=1.2),
}


def _stock_sequence(table, sp_ids, sp_weights, max_norm):
    """Stock unpooled lookup: each id's row (clipped by
    `embedding_lookup(max_norm=)`) times its weight, scattered to its
    [row, column] of a `[B, T, D]` tensor; zeros elsewhere."""
    if isinstance(sp_ids, tf.RaggedTensor):
        sp_ids = sp_ids.to_sparse()
        sp_weights = None if sp_weights is None else sp_weights.to_sparse()
    rows = tf.nn.embedding_lookup(table, sp_ids.values, max_norm=max_norm)
    if sp_weights is not None:
        rows = rows * sp_weights.values[:, None]
    shape = tf.concat([sp_ids.dense_shape,
                       tf.shape(table, out_type=tf.int64)[1:]], 0)
    return tf.scatter_nd(sp_ids.indices, rows, shape)


def _lookup_variant(use_ge, variant, tables, sp_ids, sp_weights,
                    batch_size):
    """The grouped lookup (use_ge) or its stock per-table equivalent."""
    is_sequence = VARIANTS[variant]["is_sequence"]
    max_norm = VARIANTS[variant]["max_norm"]
    if use_ge:
        return ge.group_embedding_lookup_sparse(
            tables, sp_ids, COMBINERS, sp_weights=sp_weights,
            is_sequence=is_sequence, max_norm=max_norm)
    if is_sequence:
        return [_stock_sequence(t, i, w, max_norm)
                for t, i, w in zip(tables, sp_ids, sp_weights)]
    return [stock_lookup(t, i, w, c, batch_size, max_norm)
            for t, i, w, c in zip(tables, sp_ids, sp_weights, COMBINERS)]


def _variant_tables():
    tables = _initial_tables()
    # A zero row: the clip's norm is 0 there (no division by it).
    tables[1][0] = 0.0
    return tables


def _v1_variant_run(use_ge, variant, batches):
    """Adagrad steps in a Session; per step the outputs and the gradient
    of the weights of feature 0, then the final tables."""
    with tf.Graph().as_default():
        tables = [tf.compat.v1.get_variable(
                      f"table{i}", initializer=v, use_resource=True)
                  for i, v in enumerate(_variant_tables())]
        ph = [dict(indices=tf.compat.v1.placeholder(tf.int64, [None, 2]),
                   ids=tf.compat.v1.placeholder(tf.int64, [None]),
                   weights=tf.compat.v1.placeholder(tf.float32, [None]),
                   shape=tf.compat.v1.placeholder(tf.int64, [2]))
              for _ in VOCABS]
        sp_ids = [tf.SparseTensor(p["indices"], p["ids"], p["shape"])
                  for p in ph]
        sp_weights = [tf.SparseTensor(ph[0]["indices"], ph[0]["weights"],
                                      ph[0]["shape"]), None, None]
        outs = _lookup_variant(use_ge, variant, tables, sp_ids, sp_weights,
                               ph[0]["shape"][0])
        loss = tf.add_n([tf.reduce_sum(tf.square(o - 0.5)) for o in outs])
        # Dense: stock's may come as IndexedSlices (its gather of weights).
        w_grad = tf.convert_to_tensor(
            tf.gradients(loss, ph[0]["weights"])[0])
        train = tf.compat.v1.train.AdagradOptimizer(0.1).minimize(loss)
        steps = []
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for features in batches:
                feed = {}
                for p, f in zip(ph, features):
                    feed[p["indices"]] = f.indices()
                    feed[p["ids"]] = f.flat_ids()
                    feed[p["shape"]] = [f.batch_size, f.width]
                    feed[p["weights"]] = (f.flat_weights() if f.weights
                                          is not None
                                          else np.zeros([f.nnz], np.float32))
                # Outputs and gradients are read before the update runs.
                steps.append(sess.run([outs, w_grad], feed))
                sess.run(train, feed)
            return steps, sess.run(tables)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_v1_session_sequence_and_max_norm_match_stock(kernel_mode, variant):
    batches = _v1_batches()
    got_steps, got_tables = _v1_variant_run(True, variant, batches)
    want_steps, want_tables = _v1_variant_run(False, variant, batches)
    for (got_outs, got_wg), (want_outs, want_wg) in zip(got_steps,
                                                       want_steps):
        for g, w in zip(got_outs, want_outs):
            assert g.shape == w.shape
            assert_close(g, w)
        assert_close(got_wg, want_wg)
    for i, (g, w, t0) in enumerate(zip(got_tables, want_tables,
                                       _variant_tables())):
        assert not np.allclose(w, t0), f"table {i} was not trained"
        assert_close(g, w)


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tf_function_sequence_and_max_norm_gradients_match_stock(
        kernel_mode, variant, kind):
    rng = np.random.default_rng(5)
    batch = 7
    feats = [random_feature(rng, kind=kind, batch_size=batch, vocab=v,
                            max_len=4, weighted=True, empty_prob=0.3,
                            trailing_empty=2 if i == 1 else 0)
             for i, v in enumerate(VOCABS)]
    tables = [tf.Variable(t) for t in _variant_tables()]
    weights = [tf.Variable(f.flat_weights()) for f in feats]

    @tf.function
    def grads(use_ge):
        with tf.GradientTape() as tape:
            outs = _lookup_variant(
                use_ge, variant, tables, [f.ids() for f in feats],
                [f.sp_weights(w) for f, w in zip(feats, weights)], batch)
            # Distinct upstream values per output entry.
            loss = tf.add_n([
                tf.reduce_sum(o * tf.reshape(
                    tf.sin(tf.cast(tf.range(tf.size(o)), tf.float32) + i),
                    tf.shape(o)))
                for i, o in enumerate(outs)])
        return outs, tape.gradient(loss, tables + weights)

    got_outs, got_grads = grads(True)
    want_outs, want_grads = grads(False)
    for g, w in zip(got_outs, want_outs):
        assert g.shape == w.shape
        assert_close(g, w)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        if i < len(tables):
            assert isinstance(g, tf.IndexedSlices), f"table {i}"
        assert_close(g, w)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sequence_and_max_norm_out_of_range_id_is_named(kernel_mode,
                                                        variant):
    tables = [tf.Variable(t) for t in _initial_tables(dims=[4, 4, 4])]
    ok = tf.ragged.constant([[1], [0, 2]], tf.int64)
    bad = tf.ragged.constant([[1], [0, 5]], tf.int64)  # table 2 has 5 rows
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"params\[2\].*(out of range|must lie in)"):
        _lookup_variant(True, variant, tables, [ok, ok, bad], [None] * 3,
                        2)
