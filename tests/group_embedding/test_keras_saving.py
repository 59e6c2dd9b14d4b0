"""`model.save()` / `load_model` of a functional model whose
`GroupEmbeddingFeatures` holds EmbeddingVariable columns.

Oracle: the model before saving. The loaded model must predict the same,
hold the same EV keys, values, freqs, versions and optimizer slots, and
then train on exactly like the original (so the optimizer state, EV slots
included, came back). SavedModel exports: tests/serving/.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import feature_column as ge_fc
from group_embedding.ops import ev_storage

OPTIMIZERS = {"adagrad": lambda: ge.optimizers.Adagrad(0.3),
              "adam": lambda: ge.optimizers.Adam(0.05),
              "ftrl": lambda: ge.optimizers.Ftrl(0.2)}


def _model(scope_name, optimizer):
    with ge_fc.group_embedding_column_scope(scope_name):
        cols = [ge_fc.embedding_column(
                    ge_fc.categorical_column_with_embedding(
                        "uid", dtype=tf.int64), 4, "sum"),
                ge_fc.embedding_column(
                    ge_fc.categorical_column_with_embedding("city"), 3)]
    cols.append(tf.feature_column.numeric_column("price",
                                                 dtype=tf.float64))
    inputs = {"uid": keras.Input(shape=(), dtype="int64", name="uid"),
              "city": keras.Input(shape=(), dtype="string", name="city"),
              "price": keras.Input(shape=(), dtype="float64", name="price")}
    x = ge_fc.GroupEmbeddingFeatures(cols, name="features")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    if optimizer is not None:
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse")
    return model


def _data(seed, n=32):
    rng = np.random.default_rng(seed)
    uid = rng.integers(0, 2**40, 12)[rng.integers(0, 12, n)]
    city = rng.choice(["sf", "ny", "la", "berlin"], n)
    features = {"uid": uid, "city": city, "price": rng.random(n)}
    y = ((uid % 2 == 0) ^ (city == "sf")).astype("float32")[:, None]
    return tf.data.Dataset.from_tensor_slices((features, y)).batch(8)


def _ev_state(model):
    """Every EV's snapshot (slots included), sorted by key."""
    out = []
    for ev in model.get_layer("features").embedding_variables:
        keys, values, freqs, versions, names, inits, slots, step = (
            np.asarray(t) for t in ev_storage.export(ev.handle,
                                                     ev.embedding_dim))
        order = np.argsort(keys)
        out.append((keys[order], values[order], freqs[order],
                    versions[order], slots[order], names, inits, step,
                    ev.default_values.numpy()))
    return out


def _assert_states_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_compiled_model_round_trips(tmp_path, optimizer):
    model = _model(f"keras_save_{optimizer}", optimizer)
    model.fit(_data(0), epochs=2, verbose=0)
    batch = next(iter(_data(1)))[0]  # some keys never seen in training
    want = model.predict(batch, verbose=0)
    state = _ev_state(model)
    assert state[0][4].size > 0, "optimizer slots must be stored"
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is type(model.optimizer)
    np.testing.assert_array_equal(loaded.predict(batch, verbose=0), want)
    _assert_states_equal(_ev_state(loaded), state)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations)
    # Training on from the loaded model equals training on the original.
    more = _data(2)
    model.fit(more, epochs=1, verbose=0)
    loaded.fit(more, epochs=1, verbose=0)
    np.testing.assert_allclose(loaded.predict(batch, verbose=0),
                               model.predict(batch, verbose=0),
                               rtol=1e-6, atol=1e-7)
    _assert_states_equal(_ev_state(loaded), _ev_state(model))


def test_save_weights_round_trips_ev_contents(tmp_path):
    model = _model("keras_weights", "adagrad")
    model.fit(_data(0), epochs=1, verbose=0)
    batch = next(iter(_data(1)))[0]
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    other = _model("keras_weights_other", None)
    other(batch)  # builds; its EVs hold other keys and default rows
    assert not np.array_equal(other.predict(batch, verbose=0),
                              model.predict(batch, verbose=0))
    other.load_weights(path)
    np.testing.assert_array_equal(other.predict(batch, verbose=0),
                                  model.predict(batch, verbose=0))


def test_load_without_ev_content_fails(tmp_path):
    model = _model("keras_missing", None)
    batch = next(iter(_data(1)))[0]
    model(batch)
    layer = model.get_layer("features")
    store = {}
    keras.layers.Layer.save_own_variables(layer, store)  # no EV entries
    with pytest.raises(ValueError, match=r"'features'.*no content for "
                                         r"EmbeddingVariable"):
        layer.load_own_variables(store)
