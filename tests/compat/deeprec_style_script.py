"""A DeepRec-modelzoo-style TF1 training script, written against DeepRec's
names. The only line added for stock TF is `import group_embedding.compat`.

Reads a Criteo-like CSV (tutorials/data.py format) with TextLineDataset /
decode_csv / string_split, builds EV columns with a CounterFilter inside a
group_embedding_column_scope, trains with tf.train.AdagradOptimizer under
MonitoredTrainingSession, evaluates AUC on held-out data from the
checkpoint, and prints one JSON line with the results.

    python deeprec_style_script.py --train train.csv --eval eval.csv \
        --checkpoint_dir /tmp/ckpt --steps 200
"""

import argparse
import json

import tensorflow.compat.v1 as tf

import group_embedding.compat  # noqa: F401  (the one added line)

DENSE = ["I%d" % i for i in range(1, 14)]
SPARSE = ["C%d" % i for i in range(1, 27)]
DEFAULTS = [[0.0]] + [[0.0]] * len(DENSE) + [[""]] * len(SPARSE)


def input_fn(path, batch_size, epochs, shuffle):
    def parse(lines):
        cols = tf.io.decode_csv(lines, record_defaults=DEFAULTS,
                                na_value="")
        label = cols[0]
        features = dict(zip(DENSE + SPARSE, cols[1:]))
        for key in SPARSE:
            features[key] = tf.string_split(features[key], "|")
        return features, label

    dataset = tf.data.TextLineDataset(path).skip(1)
    if shuffle:
        dataset = dataset.shuffle(10000, seed=1)
    dataset = dataset.repeat(epochs).batch(batch_size).map(parse)
    return tf.data.make_one_shot_iterator(dataset).get_next()


def build_feature_columns():
    ev_opt = tf.EmbeddingVariableOption(
        filter_option=tf.CounterFilter(filter_freq=2))
    with tf.feature_column.group_embedding_column_scope(name="categorical"):
        sparse_columns = [
            tf.feature_column.embedding_column(
                tf.feature_column.categorical_column_with_embedding(
                    key, dtype=tf.string, ev_option=ev_opt),
                dimension=8, combiner="mean")
            for key in SPARSE[1:]]
    # A stock hash-bucket column outside any scope still works.
    sparse_columns.append(tf.feature_column.embedding_column(
        tf.feature_column.categorical_column_with_hash_bucket(
            SPARSE[0], 1000), dimension=8))
    dense_columns = [tf.feature_column.numeric_column(
        key, normalizer_fn=lambda x: tf.log1p(tf.maximum(x, 0.0)))
        for key in DENSE]
    return sparse_columns + dense_columns


def dense_layer(x, units, name, activation=None):
    with tf.variable_scope(name, reuse=tf.AUTO_REUSE):
        w = tf.get_variable("kernel", [x.shape[1], units],
                            initializer=tf.glorot_uniform_initializer())
        b = tf.get_variable("bias", [units],
                            initializer=tf.zeros_initializer())
    y = tf.matmul(x, w) + b
    return activation(y) if activation else y


def model_fn(features, columns):
    # Train and eval towers share tables the TF1 way: re-entering a named
    # scope restarts its default names, so both calls use
    # "model/input_layer" (two bare calls would make two sets, as stock).
    with tf.variable_scope("model", reuse=tf.AUTO_REUSE):
        net = tf.feature_column.input_layer(features, columns)
    for i, units in enumerate([64, 32]):
        net = dense_layer(net, units, "dnn_%d" % i, tf.nn.relu)
    return tf.squeeze(dense_layer(net, 1, "logits"), 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=256)
    args = parser.parse_args()

    with tf.Graph().as_default():
        tf.set_random_seed(1)
        columns = build_feature_columns()
        features, labels = input_fn(args.train, args.batch_size, None, True)
        logits = model_fn(features, columns)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
            labels=labels, logits=logits))
        global_step = tf.train.get_or_create_global_step()
        optimizer = tf.train.AdagradOptimizer(
            0.05, initial_accumulator_value=1e-3)
        train_op = optimizer.minimize(loss, global_step=global_step)

        eval_features, eval_labels = input_fn(args.eval, 1024, 1, False)
        eval_probs = tf.sigmoid(model_fn(eval_features, columns))
        auc, auc_update = tf.metrics.auc(eval_labels, eval_probs,
                                         num_thresholds=1000)

        losses = []
        hooks = [tf.train.StopAtStepHook(last_step=args.steps)]
        with tf.train.MonitoredTrainingSession(
                checkpoint_dir=args.checkpoint_dir, hooks=hooks,
                save_checkpoint_steps=args.steps,
                save_summaries_steps=None,
                log_step_count_steps=None) as sess:
            while not sess.should_stop():
                losses.append(float(sess.run([loss, train_op])[0]))

        creator = tf.train.ChiefSessionCreator(
            checkpoint_dir=args.checkpoint_dir)
        with tf.train.MonitoredSession(session_creator=creator) as sess:
            while not sess.should_stop():
                value = sess.run(auc_update)
    head, tail = losses[:20], losses[-20:]
    print(json.dumps({"steps": len(losses),
                      "first_loss": sum(head) / len(head),
                      "last_loss": sum(tail) / len(tail),
                      "auc": float(value)}))


if __name__ == "__main__":
    main()
