"""DeepFM in Keras 3 on EmbeddingVariable feature columns.

The 26 categorical features C1..C26 become `categorical_column_with_embedding`
columns (EmbeddingVariable tables: no vocabulary size, ids hashed, new ids
admitted by a `ge.CounterFilter` after `--filter-freq` occurrences) built in
ONE `ge.feature_column.group_embedding_column_scope`, so the Keras layer
`ge.feature_column.GroupEmbeddingFeatures` looks all of them up with one
grouped op. On top sits DeepFM: first-order weights + FM pairwise
interactions + an MLP.

Steps: generate Criteo-like CSVs -> read them back through tf.data -> train
with a progress bar -> validation AUC per epoch -> checkpoint -> reload
into a fresh model and check it predicts the same -> loss/AUC curves as PNG.

Training is plain `model.fit` with `ge.optimizers.Adagrad`: the layer
shows each EV table to Keras as a weight, and the optimizer updates only
the ids a batch touched.

    python tutorials/deepfm_keras.py --rows 150000 --epochs 2
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf

import group_embedding as ge

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (the tutorials' data generator, beside this file)

SCOPE = "deepfm"
CONFIG_FILE = "model_config.json"


def make_columns(dim, filter_freq):
    """26 EV embedding columns of dim `dim + 1`, in one scope.

    Each table row holds the feature's first-order weight (component 0)
    and its FM vector (components 1..dim): one table, hence one lookup,
    serves both DeepFM terms.

    Args:
        dim: FM / embedding dimension D.
        filter_freq: `ge.CounterFilter` threshold; 0 admits every id.

    Returns:
        The embedding columns (C1..C26).
    """
    option = ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=filter_freq)
        if filter_freq > 0 else None)
    fc = ge.feature_column
    with fc.group_embedding_column_scope(SCOPE):
        return [fc.embedding_column(
                    fc.categorical_column_with_embedding(
                        key, tf.string, ev_option=option),
                    dim + 1, "mean",
                    initializer=keras.initializers.TruncatedNormal(
                        stddev=0.01))
                for key in data.SPARSE_COLUMNS]


@keras.saving.register_keras_serializable(package="tutorials")
class DeepFMHead(keras.layers.Layer):
    """Everything of DeepFM after the embedding lookup.

    Kept apart from the lookup so that serving can feed it embeddings
    computed with plain TF ops (see serving.py).

    Args:
        hidden: widths of the MLP's hidden layers.
    """

    def __init__(self, hidden=(128, 64), **kwargs):
        super().__init__(**kwargs)
        self.hidden = tuple(hidden)
        self.linear = keras.layers.Dense(1, name="dense_linear")
        self.mlp = keras.Sequential(
            [keras.layers.Dense(h, activation="relu") for h in hidden]
            + [keras.layers.Dense(1)], name="mlp")

    def call(self, embeddings, dense):
        """Logits `[B]` from embeddings `[B, F, 1 + D]` and dense `[B, 13]`.
        """
        first = tf.reduce_sum(embeddings[:, :, 0], 1) + \
            self.linear(dense)[:, 0]
        v = embeddings[:, :, 1:]
        # FM: sum over field pairs of <v_i, v_j>, in O(F * D).
        fm = 0.5 * tf.reduce_sum(
            tf.square(tf.reduce_sum(v, 1)) - tf.reduce_sum(tf.square(v), 1),
            1)
        flat = tf.reshape(v, [-1, v.shape[1] * v.shape[2]])
        deep = self.mlp(tf.concat([flat, dense], 1))[:, 0]
        return first + fm + deep

    def get_config(self):
        return {**super().get_config(), "hidden": list(self.hidden)}


class DeepFM(keras.Model):
    """Features dict -> click logit `[B]`.

    Args:
        columns: the embedding columns from `make_columns` (equal dims).
        hidden: widths of the MLP's hidden layers.
    """

    def __init__(self, columns, hidden=(128, 64), **kwargs):
        super().__init__(**kwargs)
        self.embedding = ge.feature_column.GroupEmbeddingFeatures(columns)
        self.head = DeepFMHead(hidden)
        self.num_fields = len(columns)
        self.width = columns[0].dimension

    def call(self, features, training=False):
        flat = self.embedding(features, training=training)
        embeddings = tf.reshape(flat, [-1, self.num_fields, self.width])
        return self.head(embeddings, features["dense"])

    def embedding_variables(self):
        """The EV tables, in the order of the layer's tables."""
        return self.embedding.embedding_variables


def build_model(config, example_features):
    """A DeepFM from a config dict, built (tables created) on a batch.

    The build call uses `training=False`, so it inserts no ids.
    """
    model = DeepFM(make_columns(config["dim"], config["filter_freq"]),
                   config["hidden"])
    model(example_features, training=False)
    return model


def checkpoint_of(model, optimizer=None):
    """A `tf.train.Checkpoint` of the model, its EV tables and optimizer.

    EVs are listed explicitly: the model's own checkpoint dependencies do
    not include their storage (keys, values, frequencies and slots).
    """
    objects = {"model": model,
               "embedding_variables": model.embedding_variables()}
    if optimizer is not None:
        objects["optimizer"] = optimizer
    return tf.train.Checkpoint(**objects)


def predict(model, dataset):
    """Returns (labels, probabilities) over the whole dataset."""
    # Traced once per model: a new tf.function per call would retrace.
    predict_step = getattr(model, "_predict_step", None)
    if predict_step is None:
        predict_step = model._predict_step = tf.function(
            lambda x: tf.sigmoid(model(x, training=False)),
            input_signature=[dataset.element_spec[0]])
    labels, probs = [], []
    for x, y in dataset:
        labels.append(y.numpy())
        probs.append(predict_step(x).numpy())
    return np.concatenate(labels), np.concatenate(probs)


def log_loss(labels, probs):
    """Mean binary cross-entropy of probabilities."""
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


class EpochEnd(keras.callbacks.Callback):
    """Records per-step losses, exact validation loss / AUC after each
    epoch, and checkpoints.

    Keras' AUC metric bins scores into thresholds; the AUC reported here is
    the exact rank statistic over all validation predictions.

    Args:
        valid_ds: validation dataset from `data.to_dataset`.
        steps_per_epoch: batches per epoch (x axis of the curves).
        ckpt_manager: None, or a `tf.train.CheckpointManager` saved after
            every epoch.
    """

    def __init__(self, valid_ds, steps_per_epoch, ckpt_manager=None):
        super().__init__()
        self.valid_ds = valid_ds
        self.ckpt_manager = ckpt_manager
        self.history = {"loss": [], "val_loss": [], "val_auc": [],
                        "steps_per_epoch": steps_per_epoch}
        self._epoch_sum = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_sum = 0.0

    def on_train_batch_end(self, batch, logs=None):
        # Keras 3 logs the running mean of the epoch; recover the batch's.
        mean = float(logs["loss"])
        self.history["loss"].append(mean * (batch + 1) - self._epoch_sum)
        self._epoch_sum = mean * (batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        labels, probs = predict(self.model, self.valid_ds)
        self.history["val_loss"].append(log_loss(labels, probs))
        self.history["val_auc"].append(data.roc_auc(labels, probs))
        if logs is not None:
            logs["val_exact_auc"] = self.history["val_auc"][-1]
        if self.ckpt_manager is not None:
            self.ckpt_manager.save(checkpoint_number=epoch + 1)


def train(model, train_ds, valid_ds, epochs, steps_per_epoch, lr,
          ckpt_manager=None, optimizer=None, verbose=1):
    """Trains `model` with `model.fit`; evaluates after every epoch.

    `GroupEmbeddingFeatures` shows each EV table to Keras as a weight, so
    `fit` trains the EV tables with `ge.optimizers.Adagrad` together with
    the dense layers.

    Args:
        model: a built `DeepFM`.
        train_ds, valid_ds: datasets from `data.to_dataset`.
        epochs: passes over `train_ds`.
        steps_per_epoch: batches per epoch (for the curves).
        lr: Adagrad learning rate (EV tables and dense layers alike).
        ckpt_manager: None, or a `tf.train.CheckpointManager` saved after
            every epoch.
        optimizer: the optimizer to use (default: a new Adagrad).
        verbose: 1 shows a progress bar, 2 one line per epoch, 0 nothing.

    Returns:
        A history dict: per-step `loss`, per-epoch `val_loss`, `val_auc`.
    """
    model.compile(
        optimizer=optimizer or ge.optimizers.Adagrad(
            lr, initial_accumulator_value=1e-3),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
    recorder = EpochEnd(valid_ds, steps_per_epoch, ckpt_manager)
    # shuffle=False: the dataset shuffles itself (Keras ignores it anyway).
    model.fit(train_ds, epochs=epochs, callbacks=[recorder],
              verbose=verbose, shuffle=False)
    return recorder.history


def plot_history(history, bayes_auc, path):
    """Saves training loss and validation loss / AUC curves as a PNG."""
    import matplotlib
    matplotlib.use("Agg")  # no display on servers and in tests
    import matplotlib.pyplot as plt

    per_epoch = history["steps_per_epoch"]
    epochs = np.arange(1, len(history["val_auc"]) + 1)
    loss = np.asarray(history["loss"])
    window = max(1, min(50, len(loss) // 10))
    smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot((np.arange(len(smooth)) + window) / per_epoch, smooth,
              label=f"train (mean of {window} steps)")
    left.plot(epochs, history["val_loss"], "o-", label="validation")
    left.set(xlabel="epoch", ylabel="log loss", title="loss")
    left.legend()
    right.plot(epochs, history["val_auc"], "o-", label="validation")
    right.axhline(bayes_auc, color="gray", ls="--", label="hidden truth")
    right.axhline(0.5, color="lightgray", ls=":", label="chance")
    right.set(xlabel="epoch", ylabel="AUC", title="validation AUC")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=150_000)
    parser.add_argument("--vocab-cap", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--filter-freq", type=int, default=2,
                        help="CounterFilter: occurrences before an id "
                             "gets its own embedding (0: no filter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None,
                        help="data, checkpoints and the PNG (default: a "
                             "new temporary directory)")
    parser.add_argument("--verbose", type=int, default=1)
    parser.add_argument("--min-auc", type=float, default=0.0,
                        help="exit non-zero if validation AUC is lower")
    return parser.parse_args(argv)


def main(argv=None):
    """Runs the tutorial; returns a dict of results (used by the tests).

    Args:
        argv: command-line arguments (default: `sys.argv[1:]`).

    Returns:
        Dict with `val_auc`, `bayes_auc`, `history`, `out_dir`,
        `checkpoint`, `plot`, `model` and the validation `labels` /
        `probs`.
    """
    args = parse_args(argv)
    start = time.time()
    keras.utils.set_random_seed(args.seed)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="ge_deepfm_")
    os.makedirs(out_dir, exist_ok=True)

    frame, bayes_auc = data.generate(args.rows, args.vocab_cap, args.seed)
    split = int(0.8 * len(frame))
    train_csv = os.path.join(out_dir, "train.csv")
    valid_csv = os.path.join(out_dir, "valid.csv")
    data.write_csv(frame[:split], train_csv)
    data.write_csv(frame[split:], valid_csv)
    print(f"wrote {split} training and {len(frame) - split} validation "
          f"rows to {out_dir} in {time.time() - start:.0f}s "
          f"(AUC of the hidden truth: {bayes_auc:.3f})")

    train_ds = data.to_dataset(train_csv, args.batch, shuffle=True,
                               seed=args.seed)
    valid_ds = data.to_dataset(valid_csv, args.batch)
    config = {"dim": args.dim, "filter_freq": args.filter_freq,
              "hidden": args.hidden}
    model = build_model(config, next(iter(valid_ds))[0])
    optimizer = ge.optimizers.Adagrad(args.lr,
                                      initial_accumulator_value=1e-3)
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    manager = tf.train.CheckpointManager(checkpoint_of(model, optimizer),
                                         ckpt_dir, max_to_keep=2)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f)
    history = train(model, train_ds, valid_ds, args.epochs,
                    math.ceil(split / args.batch), args.lr, manager,
                    optimizer, args.verbose)
    val_auc = history["val_auc"][-1]
    sizes = [int(ev.size()) for ev in model.embedding_variables()]
    print(f"validation AUC {val_auc:.4f} (hidden truth {bayes_auc:.4f}); "
          f"{sum(sizes)} ids stored in the 26 EV tables; "
          f"checkpoint {manager.latest_checkpoint}")

    # Reload into a fresh model, as a new process would.
    labels, probs = predict(model, valid_ds)
    restored = build_model(config, next(iter(valid_ds))[0])
    # expect_partial: the optimizer's state is in the checkpoint but not
    # needed to predict.
    checkpoint_of(restored).read(manager.latest_checkpoint) \
        .assert_existing_objects_matched().expect_partial()
    _, restored_probs = predict(restored, valid_ds)
    np.testing.assert_allclose(restored_probs, probs, rtol=1e-5, atol=1e-6)
    print(f"reloaded {manager.latest_checkpoint}: same validation "
          f"predictions (AUC {data.roc_auc(labels, restored_probs):.4f})")

    plot = os.path.join(out_dir, "deepfm_curves.png")
    plot_history(history, bayes_auc, plot)
    print(f"curves in {plot}; total {time.time() - start:.0f}s")
    if val_auc < args.min_auc:
        sys.exit(f"validation AUC {val_auc:.4f} below --min-auc "
                 f"{args.min_auc}")
    return {"val_auc": val_auc, "bayes_auc": bayes_auc, "history": history,
            "out_dir": out_dir, "checkpoint": manager.latest_checkpoint,
            "plot": plot, "model": model, "config": config,
            "labels": labels, "probs": probs}


if __name__ == "__main__":
    main()
