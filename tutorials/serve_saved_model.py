"""Serves the SavedModel written by serving.py with nothing but TensorFlow.

This is all a server needs: `tf.saved_model.load` and raw feature columns
(the CSV cells: I1..I13 floats, C1..C26 "|"-joined tokens). It does not
import group_embedding and loads no custom op library: the export holds
plain TF ops and variables only.

    python tutorials/serve_saved_model.py EXPORT_DIR REQUEST.csv OUT.npy
"""

import argparse
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (CSV reading only; imports no group_embedding)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export_dir")
    parser.add_argument("request_csv")
    parser.add_argument("out_npy")
    args = parser.parse_args(argv)
    loaded = tf.saved_model.load(args.export_dir)
    raw = data.raw_columns(data.read_csv(args.request_csv))
    serve = loaded.signatures["serving_default"]
    probs = serve(**{k: tf.constant(v) for k, v in raw.items()})["probability"]
    np.save(args.out_npy, probs.numpy())
    if "group_embedding" in sys.modules:
        sys.exit("serving imported group_embedding; the export must not "
                 "need it")
    print(f"served {len(probs)} rows from {args.export_dir} with plain "
          f"tf.saved_model.load; mean click probability "
          f"{float(np.mean(probs)):.4f}")


if __name__ == "__main__":
    main()
