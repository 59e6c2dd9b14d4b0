"""Serves exported SavedModels with plain TensorFlow (never importing
group_embedding) and writes their predictions.

    python serve_plain_tf.py REQUESTS.npz OUT.npz EXPORT_DIR:KIND ...

KIND "raw" feeds the request's arrays by name; "parsing" feeds its
`examples` (hex of serialized tf.train.Examples).
"""

import sys

import numpy as np
import tensorflow as tf


def main():
    requests = dict(np.load(sys.argv[1], allow_pickle=False))
    out = {}
    for arg in sys.argv[3:]:
        path, kind = arg.rsplit(":", 1)
        serve = tf.saved_model.load(path).signatures["serving_default"]
        if kind == "raw":
            inputs = {k: tf.constant(v) for k, v in requests.items()
                      if k != "examples"}
        else:
            inputs = {"examples": tf.constant(
                [bytes.fromhex(e) for e in requests["examples"]])}
        out[kind] = serve(**inputs)["probability"].numpy()
    if any(m.startswith("group_embedding") for m in sys.modules):
        sys.exit("group_embedding was imported")
    np.savez(sys.argv[2], **out)


if __name__ == "__main__":
    main()
