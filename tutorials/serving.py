"""Exports the DeepFM of deepfm_keras.py as a SavedModel that plain
TensorFlow serves, then serves it in a fresh process.

EmbeddingVariables live in a C++ resource of this library, which a model
server does not have. The export therefore snapshots each EV table into
things stock TF can serve:

* a `tf.lookup.StaticHashTable` from id key to row, and a `[n, 1 + D]`
  variable with the rows of the admitted keys (a `CounterFilter` keeps
  not-yet-admitted keys out, as in training);
* for unknown keys, exactly what `training=False` lookups read: the
  filter's `default_value_no_permission` under a `CounterFilter`, else row
  `key mod default_value_dim` of the EV's default matrix.

The serving function takes the raw columns (what a request carries: I1..I13
floats with NaN for missing, C1..C26 "|"-joined tokens), parses them with
the same `data.parse_raw` used in training, hashes string ids as the
feature column does, pools with each column's combiner, and runs the
trained DeepFM head. The graph has no op of this library, so the export
loads with `tf.saved_model.load` in a process that never imports it
(serve_saved_model.py), and predicts what the trained model predicts.

    python tutorials/deepfm_keras.py --out-dir /tmp/deepfm
    python tutorials/serving.py --model-dir /tmp/deepfm
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pandas as pd
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (the tutorials' data generator, beside this file)
import deepfm_keras  # noqa: E402

# `categorical_column_with_embedding` hashes string ids into int64 keys
# with this many buckets (a 64-bit fingerprint).
STRING_KEY_BUCKETS = 2 ** 63 - 1
UNKNOWN_TOKEN = "never-seen-id"


class EmbeddingSnapshot(tf.Module):
    """A frozen, plain-TF copy of one EV column's table.

    Args:
        column: the `EmbeddingColumn` (an EV column).
        ev: its `EmbeddingVariable`.

    Raises:
        TypeError: `column` is not backed by an EmbeddingVariable.
    """

    def __init__(self, column, ev):
        super().__init__(name=column.categorical_column.key)
        if not column.is_ev:
            raise TypeError(f"Column '{column.name}' is not an "
                            "EmbeddingVariable column.")
        self.key = column.categorical_column.key
        self.is_string = column.categorical_column.dtype == tf.string
        self.combiner = column.combiner
        keys, values, _, freqs = ev.export()
        option = column.categorical_column.ev_option
        filter_freq = (option.filter_option.filter_freq
                       if option.filter_option else 0)
        # Keys still under the CounterFilter read the no-permission value
        # in training and inference: leave them out, they serve as unknown.
        admitted = freqs.numpy() >= filter_freq
        keys = keys.numpy()[admitted]
        values = values.numpy()[admitted]
        dim = values.shape[1]
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(keys, tf.int64),
                tf.range(len(keys), dtype=tf.int64)),
            default_value=-1)
        # One extra row at the end, so that unknown keys gather a valid
        # row even when no key was admitted; `tf.where` then replaces it.
        self.values = tf.Variable(
            np.concatenate([values, np.zeros([1, dim], np.float32)]),
            trainable=False, name="values")
        if filter_freq > 0:
            no_permission = option.init_option.default_value_no_permission
            self.defaults = tf.Variable(
                np.full([1, dim], no_permission, np.float32),
                trainable=False, name="defaults")
            self.default_by_key = False
        else:
            self.defaults = tf.Variable(ev.default_values.numpy(),
                                        trainable=False, name="defaults")
            self.default_by_key = True

    def __call__(self, ids):
        """Pooled `[B, 1 + D]` rows for ragged ids `[B, None]`."""
        if self.is_string:
            keys = tf.strings.to_hash_bucket_fast(ids.values,
                                                  STRING_KEY_BUCKETS)
        else:
            keys = tf.cast(ids.values, tf.int64)
        index = self.table.lookup(keys)
        found = index >= 0
        n = tf.shape(self.values, out_type=tf.int64)[0] - 1
        rows = tf.gather(self.values, tf.where(found, index, n))
        if self.default_by_key:
            size = tf.shape(self.defaults, out_type=tf.int64)[0]
            default = tf.gather(self.defaults, tf.math.floormod(keys, size))
        else:
            default = tf.broadcast_to(self.defaults, tf.shape(rows))
        rows = tf.where(found[:, None], rows, default)
        pooled = tf.math.unsorted_segment_sum(
            rows, ids.value_rowids(), ids.nrows())
        count = tf.cast(ids.row_lengths(), tf.float32)[:, None]
        # Empty rows give zeros, as the grouped lookup does.
        if self.combiner == "mean":
            pooled /= tf.maximum(count, 1.0)
        elif self.combiner == "sqrtn":
            pooled /= tf.sqrt(tf.maximum(count, 1.0))
        return pooled


class ServingModel(tf.Module):
    """Raw feature columns -> click probability, in plain TF.

    Args:
        model: a trained `deepfm_keras.DeepFM`.
    """

    def __init__(self, model):
        super().__init__()
        layer = model.embedding
        tables = layer.tables
        # The layer's output order (columns sorted by name) is the field
        # order the head was trained on.
        self.fields = [EmbeddingSnapshot(c, tables[c.table_name])
                       for c in layer.feature_columns]
        self.head = model.head

    @tf.function(input_signature=[data.raw_signature()])
    def predict(self, raw):
        """`{"probability": [B]}` for a batch of raw columns."""
        features = data.parse_raw(raw)
        embeddings = tf.stack([f(features[f.key]) for f in self.fields], 1)
        logits = self.head(embeddings, features["dense"])
        return {"probability": tf.sigmoid(logits)}


def export(model, export_dir):
    """Writes `model` as a SavedModel served by plain TF.

    The `serving_default` signature takes the raw columns as keyword
    arguments and returns `{"probability": [B]}`.
    """
    module = ServingModel(model)
    tf.saved_model.save(module, export_dir, signatures={
        "serving_default": module.predict.get_concrete_function()})


def restore_model(model_dir):
    """The trained DeepFM from a deepfm_keras.py output directory."""
    with open(os.path.join(model_dir, deepfm_keras.CONFIG_FILE)) as f:
        config = json.load(f)
    valid = data.to_dataset(os.path.join(model_dir, "valid.csv"), 64)
    model = deepfm_keras.build_model(config, next(iter(valid))[0])
    latest = tf.train.latest_checkpoint(os.path.join(model_dir,
                                                     "checkpoints"))
    if latest is None:
        raise FileNotFoundError(f"No checkpoint in {model_dir}/checkpoints; "
                                "run tutorials/deepfm_keras.py first.")
    deepfm_keras.checkpoint_of(model).read(latest) \
        .assert_existing_objects_matched().expect_partial()
    return model


def request_frame(model_dir, rows):
    """Validation rows plus rows whose ids were never seen in training."""
    frame = data.read_csv(os.path.join(model_dir, "valid.csv"))[:rows]
    unseen = frame[:4].copy()
    for i, col in enumerate(data.SPARSE_COLUMNS):
        # All unknown, or unknown mixed with known ids (multi-hot).
        unseen.loc[unseen.index[0], col] = UNKNOWN_TOKEN
        unseen.loc[unseen.index[1], col] = f"{UNKNOWN_TOKEN}-{i}|" + \
            unseen.loc[unseen.index[1], col]
        unseen.loc[unseen.index[2], col] = ""
    return pd.concat([frame, unseen], ignore_index=True)


def main(argv=None):
    """Restores, exports, serves in a subprocess; returns the results.

    Returns:
        Dict with `expected` (the trained model's probabilities),
        `served` (the SavedModel's, from the fresh process) and
        `export_dir`.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True,
                        help="output directory of deepfm_keras.py")
    parser.add_argument("--export-dir", default=None,
                        help="default: <model-dir>/saved_model")
    parser.add_argument("--rows", type=int, default=1000,
                        help="validation rows in the test request")
    args = parser.parse_args(argv)
    export_dir = args.export_dir or os.path.join(args.model_dir,
                                                 "saved_model")
    model = restore_model(args.model_dir)
    frame = request_frame(args.model_dir, args.rows)
    sizes = [int(ev.size()) for ev in model.embedding_variables()]
    features = data.parse_raw({k: tf.constant(v) for k, v in
                               data.raw_columns(frame).items()})
    expected = tf.sigmoid(model(features, training=False)).numpy()
    # Inference inserts no ids: the snapshot is the trained state.
    if sizes != [int(ev.size()) for ev in model.embedding_variables()]:
        raise RuntimeError("a training=False lookup inserted ids")
    export(model, export_dir)
    print(f"exported to {export_dir}")

    with tempfile.TemporaryDirectory() as tmp:
        request = os.path.join(tmp, "request.csv")
        out = os.path.join(tmp, "probs.npy")
        data.write_csv(frame, request)
        server = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "serve_saved_model.py")
        subprocess.run([sys.executable, server, export_dir, request, out],
                       check=True)
        served = np.load(out)
    diff = float(np.max(np.abs(served - expected)))
    print(f"served == trained model on {len(frame)} rows (4 with unseen "
          f"ids): max |difference| {diff:.2e}")
    if diff > 1e-5:
        sys.exit(f"served predictions differ from the model's by {diff}")
    return {"expected": expected, "served": served,
            "export_dir": export_dir}


if __name__ == "__main__":
    main()
