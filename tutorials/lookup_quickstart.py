"""Quickstart: a Criteo-like CTR model on `ge.group_embedding_lookup_sparse`.

26 categorical features (strings and ints, one-hot and multi-hot, missing
values) are hashed into 26 tables and looked up with ONE fused call, then a
small MLP predicts the click. Trains with Keras `model.fit` and
`ge.optimizers.Adagrad` (sparse row updates for the tables, dense updates
for the MLP) and prints the validation AUC next to the AUC of the hidden
truth.

    python tutorials/lookup_quickstart.py --rows 200000 --epochs 3
"""

import argparse
import os
import sys
import time

import keras
import tensorflow as tf

import group_embedding as ge

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (the tutorials' data generator, beside this file)


class CtrModel(keras.Model):
    """Hashed string ids -> 26 tables -> one grouped lookup -> MLP.

    Args:
        buckets: hash buckets (table rows) per categorical feature.
        dim: embedding dimension of every table.
        hidden: widths of the MLP's hidden layers.
    """

    def __init__(self, buckets=20_000, dim=16, hidden=(128, 64), **kwargs):
        super().__init__(**kwargs)
        self.buckets = buckets
        self.dim = dim
        self.tables = [
            self.add_weight(shape=(buckets, dim), name=f"table_{c}",
                            initializer=keras.initializers.RandomNormal(
                                stddev=0.05))
            for c in data.SPARSE_COLUMNS]
        self.mlp = keras.Sequential(
            [keras.layers.Dense(h, activation="relu") for h in hidden]
            + [keras.layers.Dense(1)])

    def call(self, features):
        ids = [tf.strings.to_hash_bucket_fast(features[c], self.buckets)
               for c in data.SPARSE_COLUMNS]
        embedded = ge.group_embedding_lookup_sparse(self.tables, ids,
                                                    "mean")
        x = tf.concat(embedded + [features["dense"]], axis=1)
        return self.mlp(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--min-auc", type=float, default=0.0,
                        help="exit non-zero if validation AUC is lower")
    args = parser.parse_args()

    start = time.time()
    frame, bayes_auc = data.generate(args.rows, vocab_cap=20_000)
    split = int(0.8 * len(frame))
    train = data.to_dataset(frame[:split], args.batch, shuffle=True)
    valid = data.to_dataset(frame[split:], args.batch)
    print(f"generated {len(frame)} rows in {time.time() - start:.0f}s "
          f"(AUC of the hidden truth: {bayes_auc:.3f})")

    model = CtrModel(dim=args.dim)
    model.compile(optimizer=ge.optimizers.Adagrad(
                      args.lr, initial_accumulator_value=1e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    model.fit(train, validation_data=valid, epochs=args.epochs, verbose=2,
              shuffle=False)
    auc = model.evaluate(valid, verbose=0, return_dict=True)["auc"]
    print(f"validation AUC {auc:.4f} (hidden truth {bayes_auc:.4f}); "
          f"total {time.time() - start:.0f}s")
    if auc < args.min_auc:
        sys.exit(f"validation AUC {auc:.4f} below --min-auc {args.min_auc}")


if __name__ == "__main__":
    main()
