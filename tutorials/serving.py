"""Exports the DeepFM of deepfm_keras.py as a SavedModel that plain
TensorFlow serves, then serves it in a fresh process.

`tf.saved_model.save` (and `model.export`) freezes every EmbeddingVariable
into stock TF ops as it writes: the admitted keys' rows, the filter's
no-permission value, the default rows of unknown keys, exactly what a
`training=False` lookup reads. The serving function below only adds the
parsing of raw request columns (I1..I13 floats with NaN for missing,
C1..C26 "|"-joined tokens, read by the same `data.parse_raw` as in
training); the graph has no op of this library, so the export loads with
`tf.saved_model.load` in a process that never imports it
(serve_saved_model.py) and predicts what the trained model predicts.

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

UNKNOWN_TOKEN = "never-seen-id"


class ServingModel(tf.Module):
    """Raw columns -> click probability (the trained model, unchanged).

    Args:
        model: a trained `deepfm_keras.DeepFM`.
    """

    def __init__(self, model):
        super().__init__()
        # The layers hold the tables the export saves. The model itself is
        # not an attribute: Keras would add its own serving signature,
        # which takes parsed features, not raw columns.
        self.layers = list(model.layers)

        @tf.function(input_signature=[data.raw_signature()])
        def predict(raw):
            """`{"probability": [B]}` for a batch of raw columns."""
            logits = model(data.parse_raw(raw), training=False)
            return {"probability": tf.sigmoid(logits)}

        self.predict = predict


def export(model, export_dir):
    """Writes `model` as a SavedModel served by plain TF.

    The `serving_default` signature takes the raw columns as keyword
    arguments and returns `{"probability": [B]}`. (Pass the tf.function,
    not a concrete function traced before: the save traces it with the
    frozen tables.)
    """
    module = ServingModel(model)
    tf.saved_model.save(module, export_dir,
                        signatures={"serving_default": module.predict})


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
