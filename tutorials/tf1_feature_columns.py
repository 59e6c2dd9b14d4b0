"""TF1 style: feature columns + `input_layer` in a `model_fn`, trained by
`tf.compat.v1.train.MonitoredTrainingSession` on a generated Criteo-like
log, with checkpoints.

The 26 categorical columns C1..C26 are built inside one
`group_embedding_column_scope`, so `ge.feature_column.input_layer` looks
them all up with ONE grouped op: C1-C13 as stock hash-bucket columns
(tf.Variable tables), C14-C26 as `categorical_column_with_embedding`
(EmbeddingVariable tables, no vocabulary size). `ge.train.AdagradOptimizer`
updates both. Run it twice with the same `--model_dir`: the second run
resumes from the checkpoint.

Note for TF 2.21: `tf.compat.v1.layers.dense` is gone with Keras 3, so the
MLP below is made of `tf.compat.v1.get_variable` weights.

    python tutorials/tf1_feature_columns.py --rows 20000 --steps 300
"""

import argparse
import os
import sys
import tempfile

import tensorflow as tf

import group_embedding as ge

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402  (the tutorials' data generator, beside this file)

V1 = tf.compat.v1


def make_columns(dim: int):
    """26 embedding columns in one scope, plus the 13 dense features."""
    with ge.feature_column.group_embedding_column_scope("criteo"):
        columns = []
        for i, key in enumerate(data.SPARSE_COLUMNS):
            if i < 13:
                cat = tf.feature_column.categorical_column_with_hash_bucket(
                    key, 10_000)
            else:
                cat = ge.feature_column.categorical_column_with_embedding(
                    key)
            columns.append(ge.feature_column.embedding_column(cat, dim,
                                                              "sum"))
    columns.append(tf.feature_column.numeric_column(
        "dense", shape=(data.NUM_DENSE,)))
    return columns


def dense(x, units, name, activation=None):
    """A dense layer from plain variables (reused on a second trace)."""
    with V1.variable_scope(name, reuse=V1.AUTO_REUSE):
        w = V1.get_variable("kernel", [x.shape[1], units],
                            initializer=V1.glorot_uniform_initializer())
        b = V1.get_variable("bias", [units],
                            initializer=V1.zeros_initializer())
    y = tf.matmul(x, w) + b
    return y if activation is None else activation(y)


def model_fn(features, labels, mode, columns, learning_rate):
    """Estimator-style model_fn: returns (loss, train_op, probabilities)."""
    training = mode == "train"
    x = ge.feature_column.input_layer(features, columns, training=training)
    h = dense(x, 64, "hidden", tf.nn.relu)
    logits = dense(h, 1, "logits")[:, 0]
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=labels, logits=logits))
    step = V1.train.get_or_create_global_step()
    train_op = ge.train.AdagradOptimizer(learning_rate).minimize(
        loss, global_step=step)
    return loss, train_op, tf.sigmoid(logits)


def train(frame, model_dir, steps, batch_size=256, dim=8,
          learning_rate=0.05):
    """Trains until the global step reaches `steps`; returns the losses."""
    graph = tf.Graph()
    with graph.as_default():
        ds = data.to_dataset(frame, batch_size, shuffle=True).repeat()
        features, labels = V1.data.make_one_shot_iterator(ds).get_next()
        loss, train_op, _ = model_fn(features, labels, "train",
                                     make_columns(dim), learning_rate)
        losses = []
        with V1.train.MonitoredTrainingSession(
                checkpoint_dir=model_dir,
                hooks=[V1.train.StopAtStepHook(last_step=steps)],
                save_checkpoint_steps=max(1, steps // 2),
                save_summaries_steps=None, log_step_count_steps=None
        ) as sess:
            while not sess.should_stop():
                losses.append(sess.run([loss, train_op])[0])
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model_dir", default=None)
    args = parser.parse_args()
    frame, bayes_auc = data.generate(rows=args.rows)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="ge_tf1_")
    losses = train(frame, model_dir, args.steps)
    if not losses:
        print(f"{model_dir} is already at step {args.steps}.")
        return
    head, tail = losses[:20], losses[-20:]
    print(f"trained {len(losses)} steps: loss {sum(head) / len(head):.4f} "
          f"-> {sum(tail) / len(tail):.4f} (bayes AUC {bayes_auc:.3f}); "
          f"checkpoints in {model_dir}")


if __name__ == "__main__":
    main()
