"""DeepFM, TF1 style: `model_fn(features, labels, mode, params)` with
`ge.feature_column.input_layer`, trained by
`tf.compat.v1.train.MonitoredTrainingSession` (the shape of DeepRec's
modelzoo), then evaluated from the checkpoint in a fresh graph.

Same model as deepfm_keras.py: the same 26 EV columns with a
`CounterFilter` in one `group_embedding_column_scope` (ONE grouped lookup),
first-order weights + FM + MLP. The dense layers are built from
`tf.compat.v1.get_variable`, because `tf.compat.v1.layers` is gone with
Keras 3, and `ge.train.AdagradOptimizer` (a stock TF1 optimizer that also
updates EmbeddingVariables) trains everything.

    python tutorials/deepfm_tf1.py --rows 100000 --epochs 2
"""

import argparse
import collections
import os
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

import group_embedding as ge

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (the tutorials' data generator, beside this file)
from deepfm_keras import make_columns  # noqa: E402
from tf1_feature_columns import dense  # noqa: E402

V1 = tf.compat.v1


class ModeKeys:
    """The modes of a model_fn (the values of tf.estimator.ModeKeys)."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


# What a model_fn returns (tf.estimator.EstimatorSpec is gone in TF 2.16+).
ModelSpec = collections.namedtuple(
    "ModelSpec", ["mode", "predictions", "loss", "train_op",
                  "eval_metric_ops"])


def model_fn(features, labels, mode, params):
    """DeepFM on raw-parsed features (see `data.parse_raw`).

    Args:
        features: dict with `dense` `[B, 13]` and C1..C26 ragged ids.
        labels: `[B]` float clicks (None in PREDICT mode).
        mode: a `ModeKeys` value.
        params: dict with `dim`, `filter_freq`, `hidden`, `lr`.

    Returns:
        A `ModelSpec`.
    """
    columns = make_columns(params["dim"], params["filter_freq"])
    training = mode == ModeKeys.TRAIN
    # training=False: evaluation and serving insert no new ids.
    flat = ge.feature_column.input_layer(features, columns,
                                         training=training)
    width = params["dim"] + 1
    emb = tf.reshape(flat, [-1, len(columns), width])
    first = tf.reduce_sum(emb[:, :, 0], 1) + \
        dense(features["dense"], 1, "linear")[:, 0]
    v = emb[:, :, 1:]
    fm = 0.5 * tf.reduce_sum(
        tf.square(tf.reduce_sum(v, 1)) - tf.reduce_sum(tf.square(v), 1), 1)
    h = tf.concat([tf.reshape(v, [-1, len(columns) * params["dim"]]),
                   features["dense"]], 1)
    for i, units in enumerate(params["hidden"]):
        h = dense(h, units, f"mlp_{i}", tf.nn.relu)
    logits = first + fm + dense(h, 1, "mlp_out")[:, 0]
    probs = tf.sigmoid(logits)
    if mode == ModeKeys.PREDICT:
        return ModelSpec(mode, {"probability": probs}, None, None, None)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=labels, logits=logits))
    if mode == ModeKeys.EVAL:
        return ModelSpec(mode, {"probability": probs}, loss, None,
                         {"auc": V1.metrics.auc(labels, probs,
                                                num_thresholds=1000)})
    step = V1.train.get_or_create_global_step()
    optimizer = ge.train.AdagradOptimizer(params["lr"],
                                          initial_accumulator_value=1e-3)
    return ModelSpec(mode, {"probability": probs}, loss,
                     optimizer.minimize(loss, global_step=step), None)


def train(train_csv, model_dir, params, epochs, batch_size, log_every=50,
          seed=0):
    """Trains for `epochs` passes with MonitoredTrainingSession.

    Returns:
        The loss of every step.
    """
    graph = tf.Graph()
    with graph.as_default():
        V1.set_random_seed(seed)  # initial weights and shuffling
        ds = data.to_dataset(train_csv, batch_size, shuffle=True, seed=seed)
        features, labels = V1.data.make_one_shot_iterator(
            ds.repeat(epochs)).get_next()
        spec = model_fn(features, labels, ModeKeys.TRAIN, params)
        step = V1.train.get_global_step()
        losses = []
        start = time.time()
        # The session stops when the dataset is exhausted (OutOfRange).
        with V1.train.MonitoredTrainingSession(
                checkpoint_dir=model_dir, save_checkpoint_steps=500,
                save_summaries_steps=None, log_step_count_steps=None
        ) as sess:
            while not sess.should_stop():
                loss, _, n = sess.run([spec.loss, spec.train_op, step])
                losses.append(loss)
                if log_every and n % log_every == 0:
                    print(f"step {n}: loss {np.mean(losses[-50:]):.4f} "
                          f"({time.time() - start:.0f}s)")
    return losses


def evaluate(valid_csv, model_dir, params, batch_size):
    """Restores the latest checkpoint in a fresh graph and evaluates.

    Returns:
        Dict with `auc` (exact, from all predictions), `metric_auc`
        (tf.compat.v1.metrics.auc) and `loss`.
    """
    graph = tf.Graph()
    with graph.as_default():
        ds = data.to_dataset(valid_csv, batch_size)
        features, labels = V1.data.make_one_shot_iterator(ds).get_next()
        spec = model_fn(features, labels, ModeKeys.EVAL, params)
        _, auc_update = spec.eval_metric_ops["auc"]
        all_labels, all_probs = [], []
        creator = V1.train.ChiefSessionCreator(checkpoint_dir=model_dir)
        with V1.train.MonitoredSession(session_creator=creator) as sess:
            while not sess.should_stop():
                # The update op returns the AUC over all batches so far.
                y, p, metric_auc = sess.run(
                    [labels, spec.predictions["probability"], auc_update])
                all_labels.append(y)
                all_probs.append(p)
    y = np.concatenate(all_labels)
    p = np.concatenate(all_probs)
    return {"auc": data.roc_auc(y, p), "metric_auc": float(metric_auc),
            "loss": float(np.mean(-y * np.log(np.clip(p, 1e-7, 1))
                                  - (1 - y) * np.log(np.clip(1 - p, 1e-7,
                                                             1))))}


def main(argv=None):
    """Runs the tutorial; returns a dict of results (used by the tests)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--filter-freq", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model_dir", default=None)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="ge_deepfm_tf1_")
    os.makedirs(model_dir, exist_ok=True)
    frame, bayes_auc = data.generate(args.rows, seed=args.seed)
    split = int(0.8 * len(frame))
    train_csv = os.path.join(model_dir, "train.csv")
    valid_csv = os.path.join(model_dir, "valid.csv")
    data.write_csv(frame[:split], train_csv)
    data.write_csv(frame[split:], valid_csv)
    params = {"dim": args.dim, "filter_freq": args.filter_freq,
              "hidden": args.hidden, "lr": args.lr}
    losses = train(train_csv, model_dir, params, args.epochs, args.batch,
                   args.log_every, args.seed)
    result = evaluate(valid_csv, model_dir, params, args.batch)
    print(f"trained {len(losses)} steps; validation AUC "
          f"{result['auc']:.4f} (tf.metrics.auc {result['metric_auc']:.4f},"
          f" hidden truth {bayes_auc:.4f}); checkpoints in {model_dir}")
    return {**result, "losses": losses, "bayes_auc": bayes_auc,
            "model_dir": model_dir}


if __name__ == "__main__":
    main()
