"""`GroupEmbeddingFeatures` (Keras 3) vs stock `input_layer` on the same
weights; training with `model.fit` on a pandas/CSV `tf.data` pipeline;
save/load and config round trips."""

import os
import warnings

import keras
import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

from group_embedding import feature_column as ge_fc

import fc_cases
from testing import assert_close
from testing import op_counts

FC = tf.feature_column


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    return fc_cases.write_vocab_file(tmp_path_factory.mktemp("vocab"))


def _stock_oracle(kind, stock_cols, tables, upstream):
    """Stock input_layer in a TF1 graph with `tables` (name -> array).

    Returns:
        (output, {column name: dense table gradient of sum(out * up)}).
    """
    graph = tf.Graph()
    with graph.as_default():
        features = {k: v.to_sparse() if isinstance(v, tf.RaggedTensor)
                    else v for k, v in fc_cases.make_features(kind).items()}
        cols_to_vars = {}
        out = tf.compat.v1.feature_column.input_layer(
            features, stock_cols, cols_to_vars=cols_to_vars)
        by_name = {c.name: v[0] for c, v in cols_to_vars.items() if v}
        copy = [by_name[n].assign(t) for n, t in tables.items()]
        grads = tf.gradients(tf.reduce_sum(out * upstream),
                             [by_name[n] for n in tables])
        o, g = fc_cases.run_graph(
            graph, [out, [tf.convert_to_tensor(x) for x in grads]], copy)
    return o, dict(zip(tables, g))


def _all_kinds(vocab_file, combiner, scope_name):
    cats = fc_cases.stock_categorical_columns(vocab_file)
    with ge_fc.group_embedding_column_scope(scope_name):
        ours = [ge_fc.embedding_column(c, fc_cases.DIM, combiner)
                for c in cats]
    stock = [FC.embedding_column(c, fc_cases.DIM, combiner) for c in cats]
    return ours, stock



@pytest.mark.parametrize("combiner,kind", [("sum", "ragged"),
                                           ("mean", "dense"),
                                           ("sqrtn", "sparse")])
def test_output_and_gradients_match_stock(kernel_mode, vocab_file, combiner,
                                          kind):
    ours, stock = _all_kinds(vocab_file, combiner,
                             fc_cases.unique_name("keras"))
    layer = ge_fc.GroupEmbeddingFeatures(ours)
    features = fc_cases.make_features(kind)
    layer(features)
    tables = {n: t.numpy() for n, t in layer.tables.items()}
    upstream = fc_cases.random_weights([fc_cases.BATCH, 5 * fc_cases.DIM])
    with tf.GradientTape() as tape:
        out = layer(features)
        loss = tf.reduce_sum(out * upstream)
    names = list(tables)
    grads = tape.gradient(loss, [layer.tables[n] for n in names])
    want, want_grads = _stock_oracle(kind, stock, tables, upstream)
    assert_close(out, want)
    for n, g in zip(names, grads):
        assert_close(g, want_grads[n])


def test_one_fused_lookup_per_scope_when_traced(vocab_file):
    ours, _ = _all_kinds(vocab_file, "mean", fc_cases.unique_name("traced"))
    layer = ge_fc.GroupEmbeddingFeatures(ours)
    features = fc_cases.make_features("sparse")
    layer(features)
    n_weights = len(layer.weights)
    graph = tf.function(layer).get_concrete_function(features).graph
    assert op_counts(graph)["GroupEmbeddingPooledLookup"] == 1
    assert len(layer.weights) == n_weights  # call() created no state


def test_shared_table_is_one_variable():
    cats = [FC.categorical_column_with_identity(k, 10)
            for k in ("uid", "uid2")]
    with ge_fc.group_embedding_column_scope(fc_cases.unique_name("ks")):
        cols = ge_fc.shared_embedding_columns(cats, 3, "sum")
    layer = ge_fc.GroupEmbeddingFeatures(cols)
    out = layer(fc_cases.make_features("ragged", ["uid", "uid2"]))
    assert len(layer.weights) == 1 and out.shape == (fc_cases.BATCH, 6)
    table = layer.weights[0].numpy()
    # Row 0: uid [1, 3, 3] (first 3 dims, sorted name order), uid2 [2].
    np.testing.assert_allclose(out[0, :3], table[[2]].sum(0), rtol=1e-6)
    np.testing.assert_allclose(out[0, 3:], table[[1, 3, 3]].sum(0),
                               rtol=1e-6)


def test_tables_before_build_fails():
    col = ge_fc.embedding_column(FC.categorical_column_with_identity("a", 3),
                                 2)
    with pytest.raises(RuntimeError, match="build it first"):
        ge_fc.GroupEmbeddingFeatures([col]).tables


def test_config_round_trip(vocab_file):
    ours, _ = _all_kinds(vocab_file, "sqrtn", fc_cases.unique_name("cfg"))
    ours.append(FC.numeric_column("price"))
    layer = ge_fc.GroupEmbeddingFeatures(ours, name="feats")
    config = layer.get_config()
    clone = ge_fc.GroupEmbeddingFeatures.from_config(config)
    assert clone.feature_columns == layer.feature_columns
    assert clone.get_config() == config


def _frame(n=64, seed=0):
    rng = np.random.default_rng(seed)
    uid = rng.integers(-1, 10, n)  # -1: missing
    city = rng.choice(["sf", "ny", "la", "", "mars"], n)  # "": missing
    y = ((uid % 2 == 0) ^ (city == "sf")).astype("float32")
    return pd.DataFrame({"uid": uid, "city": city, "price": rng.random(n),
                         "y": y})


def _model(scope_name):
    with ge_fc.group_embedding_column_scope(scope_name):
        cols = [ge_fc.embedding_column(
                    FC.categorical_column_with_identity("uid", 10), 4),
                ge_fc.embedding_column(
                    FC.categorical_column_with_vocabulary_list(
                        "city", ["sf", "ny", "la"]), 4, "sum")]
    cols.append(FC.numeric_column("price", dtype=tf.float64))
    inputs = {"uid": keras.Input(shape=(), dtype="int64", name="uid"),
              "city": keras.Input(shape=(), dtype="string", name="city"),
              "price": keras.Input(shape=(), dtype="float64", name="price")}
    x = ge_fc.GroupEmbeddingFeatures(cols, name="features")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adagrad(0.3), loss="mse")
    return model


def test_fit_on_csv_then_save_and_load(tmp_path):
    path = str(tmp_path / "train.csv")
    _frame().to_csv(path, index=False)
    frame = pd.read_csv(path, keep_default_na=False)
    ds = tf.data.Dataset.from_tensor_slices(
        ({k: frame[k].values for k in ("uid", "city", "price")},
         frame["y"].values)).batch(16)
    model = _model(fc_cases.unique_name("fit"))
    history = model.fit(ds, epochs=6, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    batch = next(iter(ds))[0]
    saved = str(tmp_path / "model.keras")
    model.save(saved)
    loaded = keras.models.load_model(saved)
    np.testing.assert_allclose(loaded.predict(batch, verbose=0),
                               model.predict(batch, verbose=0), rtol=1e-6)
    ckpt = tf.train.Checkpoint(model=model)
    prefix = ckpt.save(os.path.join(str(tmp_path), "ckpt"))
    before = model.predict(batch, verbose=0)
    model.fit(ds, epochs=1, verbose=0)
    ckpt.restore(prefix)
    np.testing.assert_allclose(model.predict(batch, verbose=0), before,
                               rtol=1e-6)


class TowerModel(keras.Model):
    def __init__(self, columns):
        super().__init__()
        self.features = ge_fc.GroupEmbeddingFeatures(columns)
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.features(inputs))


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_fit_on_sparse_and_ragged_inputs(kind):
    cats = fc_cases.stock_categorical_columns("unused")[:3]
    with ge_fc.group_embedding_column_scope(fc_cases.unique_name("sr")):
        cols = [ge_fc.embedding_column(c, 4) for c in cats]
    model = TowerModel(cols)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    features = fc_cases.make_features(kind, ["uid", "tag", "city"])
    labels = tf.constant([[1.0], [0.0], [1.0], [0.0], [1.0], [0.0]])
    ds = tf.data.Dataset.from_tensors((features, labels)).repeat(8)
    losses = model.fit(ds, epochs=1, verbose=0).history["loss"]
    before = model.evaluate(ds.take(1), verbose=0)
    model.fit(ds, epochs=2, verbose=0)
    assert model.evaluate(ds.take(1), verbose=0) < before
    assert np.isfinite(losses).all()


def test_subclassed_model_builds_without_warnings():
    """Keras traces a subclassed model's call() symbolically to build it;
    that must not fail inside the lookup (it warned "`params[0]` must be
    a tf.Variable, ..., got SymbolicTensor" and "unbuilt state")."""
    cats = fc_cases.stock_categorical_columns("unused")[:3]
    with ge_fc.group_embedding_column_scope(fc_cases.unique_name("sw")):
        cols = [ge_fc.embedding_column(c, 4) for c in cats]
    model = TowerModel(cols)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    features = fc_cases.make_features("ragged", ["uid", "tag", "city"])
    labels = tf.constant([[1.0], [0.0], [1.0], [0.0], [1.0], [0.0]])
    ds = tf.data.Dataset.from_tensors((features, labels)).repeat(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(ds, epochs=1, verbose=0)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages
                if "SymbolicTensor" in m or "unbuilt state" in m], messages
    assert model.predict(features, verbose=0).shape == (6, 1)


def test_ev_tables_train_with_ge_optimizer_in_a_custom_loop():
    import group_embedding as ge

    with ge_fc.group_embedding_column_scope(fc_cases.unique_name("kev")):
        col = ge_fc.embedding_column(
            ge_fc.categorical_column_with_embedding("tag"), 4, "sum")
    layer = ge_fc.GroupEmbeddingFeatures([col])
    head = keras.layers.Dense(1)
    features = fc_cases.make_features("ragged", ["tag"])
    labels = tf.constant([[1.0], [0.0], [1.0], [0.0], [1.0], [0.0]])
    opt = ge.optimizers.Adagrad(0.3)
    losses = []
    for _ in range(5):
        with tf.GradientTape() as tape:
            pred = head(layer(features, training=True))
            loss = tf.reduce_mean(tf.square(pred - labels))
        variables = layer.embedding_variables + head.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    (ev,) = layer.embedding_variables
    assert int(ev.size()) == 7  # distinct tags
    n = int(ev.size())
    layer(fc_cases.make_features("dense", ["tag"]), training=False)
    assert int(ev.size()) == n  # inference inserts no keys
