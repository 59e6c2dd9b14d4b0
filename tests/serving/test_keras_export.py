"""One-call export (issue 26.1, 37.4): `model.export()`,
`tf.saved_model.save(model)` and `ge.export_saved_model(model)` of Keras
models whose EV tables come from `GroupEmbeddingFeatures` or from
`ge.get_embedding_variable`, on dense, ragged and sparse inputs.

Oracle: `model.predict` of the trained model. The SavedModel is served by
`serve_plain.py` in a subprocess that cannot import group_embedding, on
requests holding trained keys, keys stored but still under a
CounterFilter (each test checks that its request has some:
`pending_keys`), keys the CBFFilter has not admitted, unseen (also
negative) keys and empty rows.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import feature_column as ge_fc
from group_embedding.embedding_variable.keras_variable import (
    KerasEmbeddingVariable,
)
from group_embedding.export import ev_snapshot

_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "serve_plain.py")


def serve(path, features, endpoint, tmp_path):
    """Predictions of the SavedModel at `path`, from plain TF."""
    arrays = {}
    for name, value in features.items():
        if isinstance(value, tf.RaggedTensor):
            arrays[name + ".values"] = value.values.numpy()
            arrays[name + ".row_splits"] = value.row_splits.numpy()
        elif isinstance(value, tf.SparseTensor):
            arrays[name + ".indices"] = value.indices.numpy()
            arrays[name + ".values"] = value.values.numpy()
            arrays[name + ".dense_shape"] = value.dense_shape.numpy()
        else:
            arrays[name] = np.asarray(value)  # strings: bytes objects
    requests = str(tmp_path / "requests.npz")
    out = str(tmp_path / "served.npy")
    np.savez(requests, **arrays)
    run = subprocess.run(
        [sys.executable, _SERVER, path, requests, out, endpoint],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=""))
    assert run.returncode == 0, run.stderr[-3000:]
    return np.load(out)


def pending_keys(keys, freqs, filter_freq, requested):
    """The keys of `requested` that an EV stores (its exported `keys` and
    `freqs`) but has not admitted: counted fewer than `filter_freq`
    times. A test whose data leave none cannot tell them from admitted or
    unseen keys."""
    count = dict(zip(np.asarray(keys).tolist(), np.asarray(freqs).tolist()))
    return sorted({k for k in np.asarray(requested).ravel().tolist()
                   if 0 < count.get(k, 0) < filter_freq})


def ev_pending_keys(ev, requested):
    """`pending_keys` of an eager EV with a CounterFilter."""
    keys, _, _, freqs = ev.export()
    return pending_keys(keys.numpy(), freqs.numpy(),
                        ev.ev_option.filter_option.filter_freq, requested)


def string_keys(values):
    """The EV keys of string ids (columns.py: a 64-bit fingerprint)."""
    return tf.strings.to_hash_bucket_fast(values, 2**63 - 1).numpy()


def _table(model, feature):
    return next(ev for ev in model.get_layer("features").embedding_variables
                if feature in ev.name)


def _columns(scope):
    with ge_fc.group_embedding_column_scope(scope):
        uid = ge_fc.embedding_column(ge_fc.categorical_column_with_embedding(
            "uid", dtype=tf.int64), 4, "sum")
        city = ge_fc.embedding_column(
            ge_fc.categorical_column_with_embedding(
                "city", ev_option=ge.EmbeddingVariableOption(
                    filter_option=ge.CounterFilter(filter_freq=3),
                    init_option=ge.InitializerOption(
                        default_value_no_permission=0.25))), 4, "mean")
        tag = ge_fc.embedding_column(
            ge_fc.categorical_column_with_embedding(
                "tag", dtype=tf.int64, ev_option=ge.EmbeddingVariableOption(
                    filter_option=ge.CBFFilter(
                        filter_freq=3, max_element_size=1000,
                        false_positive_probability=0.01))), 4, "sqrtn")
    return [uid, city, tag]


def _data(seed, n=64):
    """A batch where city "rare" and tag 40 occur once each: trained for
    up to 2 epochs, they stay under their filters (filter_freq 3)."""
    rng = np.random.default_rng(seed)
    uid = rng.integers(-50, 2**40, 12)[rng.integers(0, 12, n)]
    city = rng.choice(["sf", "ny", "la", "berlin"], n, p=[.3, .3, .2, .2])
    city[n // 2] = "rare"
    tags = rng.integers(0, 30, [n, 3])
    tags[n // 2, 0] = 40
    y = ((uid % 2 == 0) ^ (city == "sf")).astype("float32")[:, None]
    return uid, city, tags, y


def _requests(seed=1):
    uid, city, tags, _ = _data(seed, 16)
    uid[:3] = [-7, 2**62, 0]  # never seen
    city[:2] = ["never", "rare"]
    tags[:2] = [77, 78, 79]
    tags[3] = [40, 78, 5]  # row 3 keeps all 3 in `_ragged`
    return uid, city, tags


def _ragged(tags, cut=True):
    lengths = np.arange(len(tags)) % 4 if cut else np.full(len(tags), 3)
    lengths = np.minimum(lengths, 3)
    values = np.concatenate([t[:k] for t, k in zip(tags, lengths)])
    return tf.RaggedTensor.from_row_lengths(values.astype(np.int64),
                                            lengths)


def _dense_model(scope):
    inputs = {"uid": keras.Input(shape=(), dtype="int64", name="uid"),
              "city": keras.Input(shape=(), dtype="string", name="city"),
              "tag": keras.Input(shape=(3,), dtype="int64", name="tag")}
    x = ge_fc.GroupEmbeddingFeatures(_columns(scope), name="features")(
        inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=ge.optimizers.Adagrad(0.3), loss="mse")
    return model


def _fit(model, features, y):
    model.fit(tf.data.Dataset.from_tensor_slices((features, y)).batch(8),
              epochs=2, verbose=0)


def _trained_dense_model(scope):
    """A trained `_dense_model` and a request batch for it."""
    model = _dense_model(scope)
    uid, city, tags, y = _data(0)
    _fit(model, {"uid": uid, "city": city, "tag": tags}, y)
    uid, city, tags = _requests()
    return model, {"uid": tf.constant(uid), "city": tf.constant(city),
                   "tag": tf.constant(tags)}


def test_export_and_saved_model_of_feature_columns(tmp_path):
    model, request = _trained_dense_model("export_dense")
    want = model.predict(request, verbose=0)
    assert ev_pending_keys(_table(model, "city"),
                           string_keys(request["city"])) == \
        string_keys(["rare"]).tolist()
    sizes = [int(ev.size()) for ev in
             model.get_layer("features").embedding_variables]
    assert all(s > 0 for s in sizes)

    model.export(str(tmp_path / "exported"), verbose=False)
    got = serve(str(tmp_path / "exported"), request, "serve", tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    tf.saved_model.save(model, str(tmp_path / "saved"))
    got = serve(str(tmp_path / "saved"), request, "serving_default",
                tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Dense inputs through `ge.export_saved_model`: signature by name.
    path = ge.export_saved_model(model, str(tmp_path / "ge"))
    for endpoint in ("serve", "serving_default"):
        got = serve(path, request, endpoint, tmp_path)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    signature = tf.saved_model.load(path).signatures["serving_default"]
    assert sorted(signature.structured_input_signature[1]) == sorted(
        request)
    # The snapshots were freed once written.
    assert not ev_snapshot._taken
    # Exporting inserted nothing and counted nothing.
    assert sizes == [int(ev.size()) for ev in
                     model.get_layer("features").embedding_variables]
    # The SavedModel holds the snapshots, not copies of the EV tables.
    names = [n for n, _ in tf.train.list_variables(
        str(tmp_path / "exported" / "variables" / "variables"))]
    assert any("sorted_keys" in n for n in names)
    assert not any(n.endswith(("/slots", "/freqs", "/versions"))
                   for n in names), names


def test_export_after_more_training_freezes_the_new_rows(tmp_path):
    model, request = _trained_dense_model("export_twice")
    city = string_keys(request["city"])
    assert ev_pending_keys(_table(model, "city"), city)
    model.export(str(tmp_path / "first"), verbose=False)
    first = model.predict(request, verbose=0)
    uid2, city2, tags2, y2 = _data(5)
    _fit(model, {"uid": uid2, "city": city2, "tag": tags2}, y2)
    # "rare" was admitted since: the second export reads its row.
    assert not ev_pending_keys(_table(model, "city"), city)
    model.export(str(tmp_path / "second"), verbose=False)
    second = model.predict(request, verbose=0)
    assert not np.allclose(first, second)
    np.testing.assert_allclose(
        serve(str(tmp_path / "second"), request, "serve", tmp_path), second,
        rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        serve(str(tmp_path / "first"), request, "serve", tmp_path), first,
        rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_export_saved_model_of_ragged_and_sparse_inputs(tmp_path, kind):
    """`ge.export_saved_model(model, dir)` types the multi-hot input as
    it is: `serve` takes the RaggedTensor (SparseTensor) under the
    input's name, `serving_default` its parts (`tag_values`,
    `tag_row_splits`; `tag_indices`, `tag_values`, `tag_dense_shape`)."""
    sparse = kind == "sparse"
    inputs = {
        "uid": keras.Input(shape=(), dtype="int64", name="uid"),
        "city": keras.Input(shape=(), dtype="string", name="city"),
        "tag": keras.Input(shape=(None,), dtype="int64", name="tag",
                           sparse=sparse, ragged=not sparse)}
    x = ge_fc.GroupEmbeddingFeatures(_columns(f"export_{kind}"),
                                     name="features")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=ge.optimizers.Adagrad(0.3), loss="mse")

    def convert(tags, cut=True):
        ragged = _ragged(tags, cut)
        return ragged.to_sparse() if sparse else ragged

    uid, city, tags, y = _data(0)
    for start in range(0, len(uid), 8):
        part = slice(start, start + 8)
        model.train_on_batch({"uid": uid[part], "city": city[part],
                              "tag": convert(tags[part], cut=False)},
                             y[part])
    uid, city, tags = _requests()
    request = {"uid": tf.constant(uid), "city": tf.constant(city),
               "tag": convert(tags)}
    assert ev_pending_keys(_table(model, "city"), string_keys(city))
    want = model.predict(request, verbose=0)
    path = str(tmp_path / "exported")
    assert ge.export_saved_model(model, path) == path
    for endpoint in ("serve", "serving_default"):
        got = serve(path, request, endpoint, tmp_path)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    parts = ["tag_indices", "tag_values", "tag_dense_shape"] if sparse \
        else ["tag_values", "tag_row_splits"]
    signature = tf.saved_model.load(path).signatures["serving_default"]
    assert sorted(signature.structured_input_signature[1]) == sorted(
        ["uid", "city"] + parts)


def test_keras_export_types_ragged_inputs_dense():
    """Why `ge.export_saved_model` builds its own endpoints: Keras'
    export spec of a ragged input is a dense TensorSpec (if Keras starts
    typing it, `model.export` may serve such models too)."""
    from keras.src.export import export_utils

    tag = keras.Input(shape=(None,), dtype="int64", name="tag", ragged=True)
    spec = export_utils.make_tf_tensor_spec(tag)
    assert type(spec) is tf.TensorSpec, spec


def test_export_saved_model_refuses_colliding_input_names(tmp_path):
    inputs = {"tag": keras.Input(shape=(None,), dtype="int64", ragged=True,
                                 name="tag"),
              "tag_values": keras.Input(shape=(), dtype="int64",
                                        name="tag_values")}
    out = keras.layers.Concatenate()(
        [keras.ops.cast(keras.ops.expand_dims(inputs["tag_values"], 1),
                        "float32")] * 2)
    model = keras.Model(inputs, out)
    with pytest.raises(ValueError, match="inputs 'tag' and 'tag_values' "
                       "both need the serving tensor name 'tag_values'"):
        ge.export_saved_model(model, str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()


class TagsLayer(keras.layers.Layer):
    """A custom layer on an EV of `ge.get_embedding_variable`."""

    def __init__(self, name, key_dtype, **kwargs):
        super().__init__(**kwargs)
        self.ev_name = name
        self.key_dtype = key_dtype

    def build(self, input_shape):
        self.ev = ge.get_embedding_variable(
            self.ev_name, 3, key_dtype=self.key_dtype,
            ev_option=ge.EmbeddingVariableOption(
                init_option=ge.InitializerOption(default_value_dim=7)))
        self.ev_weight = KerasEmbeddingVariable(self.ev)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 3)

    def call(self, ids, training=False):
        return ge.group_embedding_lookup_sparse(
            [self.ev], [ids], ["mean"], training=training)[0]


@pytest.mark.parametrize("key_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("trained", [True, False])
def test_export_of_get_embedding_variable(tmp_path, key_dtype, trained):
    name = f"custom_{key_dtype.name}_{trained}"
    ids = keras.Input(shape=(None,), dtype=key_dtype.name, ragged=True,
                      name="ids")
    model = keras.Model(ids, keras.layers.Dense(1)(
        TagsLayer(name, key_dtype)(ids)))
    model.compile(optimizer=ge.optimizers.Adagrad(0.3), loss="mse")
    rng = np.random.default_rng(3)
    batch = tf.RaggedTensor.from_row_lengths(
        rng.integers(-20, 20, 24).astype(key_dtype.as_numpy_dtype),
        [3] * 8)
    if trained:
        for _ in range(3):
            model.train_on_batch(batch, np.ones([8, 1], np.float32))
    assert (int(model.layers[1].ev.size()) > 0) == trained
    request = tf.RaggedTensor.from_row_lengths(
        np.arange(-40, 40, 3).astype(key_dtype.as_numpy_dtype),
        [5, 0, 10, 12])
    want = model.predict(request, verbose=0)
    path = ge.export_saved_model(model, str(tmp_path / "exported"))
    for endpoint in ("serve", "serving_default"):
        got = serve(path, {"ids": request}, endpoint, tmp_path)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Unseen keys read their default rows: the rows differ by key mod 7.
    assert len(np.unique(np.round(want, 6))) > 2


class RowsLayer(keras.layers.Layer):
    """Sum of an EV's rows for dense ids `[B, T]` (`lookup_rows`)."""

    def build(self, input_shape):
        self.ev = ge.get_embedding_variable(
            "dense_rows", 3, ev_option=ge.EmbeddingVariableOption(
                filter_option=ge.CounterFilter(filter_freq=2)))
        self.ev_weight = KerasEmbeddingVariable(self.ev)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 3)

    def call(self, ids, training=False):
        return tf.reduce_sum(self.ev.lookup_rows(ids, training=training), 1)


def test_model_export_of_get_embedding_variable(tmp_path):
    ids = keras.Input(shape=(4,), dtype="int64", name="ids")
    model = keras.Model(ids, keras.layers.Dense(1)(RowsLayer()(ids)))
    model.compile(optimizer=ge.optimizers.Adagrad(0.3), loss="mse")
    rng = np.random.default_rng(4)
    for step in range(3):
        batch = rng.integers(0, 12, [8, 4])
        if step == 0:
            batch[0, 0] = 20  # seen once: stored, not admitted
        model.train_on_batch(batch, np.ones([8, 1], np.float32))
    request = rng.integers(-3, 15, [16, 4])
    request[1, 2] = 20
    assert ev_pending_keys(model.layers[1].ev, request) == [20]
    request = tf.constant(request)
    want = model.predict(request, verbose=0)
    model.export(str(tmp_path / "exported"), verbose=False)
    np.testing.assert_allclose(
        serve(str(tmp_path / "exported"), {"ids": request}, "serve",
              tmp_path), want, rtol=1e-6, atol=1e-6)
    tf.saved_model.save(model, str(tmp_path / "saved"))
    np.testing.assert_allclose(
        serve(str(tmp_path / "saved"), {"ids": request}, "serving_default",
              tmp_path), want, rtol=1e-6, atol=1e-6)


def test_export_of_vocabulary_and_hashed_string_columns(tmp_path):
    """String keys through stock vocabulary and hash-bucket columns (plain
    tables in the scope) next to a string EV column."""
    with ge_fc.group_embedding_column_scope("export_vocab"):
        cols = [
            ge_fc.embedding_column(
                tf.feature_column.categorical_column_with_vocabulary_list(
                    "city", ["sf", "ny", "la"], num_oov_buckets=1), 4),
            ge_fc.embedding_column(
                tf.feature_column.categorical_column_with_hash_bucket(
                    "shop", 50), 4),
            ge_fc.embedding_column(
                ge_fc.categorical_column_with_embedding("brand"), 4)]
    inputs = {k: keras.Input(shape=(), dtype="string", name=k)
              for k in ("city", "shop", "brand")}
    x = ge_fc.GroupEmbeddingFeatures(cols, name="features")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=ge.optimizers.Adagrad(0.3), loss="mse")
    rng = np.random.default_rng(6)
    words = np.array(["sf", "ny", "la", "berlin", "x", "y"])
    train = {k: words[rng.integers(0, 6, 64)] for k in inputs}
    _fit(model, train, rng.random([64, 1]).astype(np.float32))
    request = {k: tf.constant(np.append(words, ["never", ""]))
               for k in inputs}
    want = model.predict(request, verbose=0)
    model.export(str(tmp_path / "exported"), verbose=False)
    got = serve(str(tmp_path / "exported"), request, "serve", tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
