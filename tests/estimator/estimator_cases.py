"""A small DeepRec-style model_fn and data shared by the estimator tests.

Two EmbeddingVariable columns (int64 "user" with a CounterFilter, string
"item") in one group_embedding_column_scope, a stock hash-bucket column
and a numeric column, through `ge.feature_column.input_layer`, a logistic
head from `tf.compat.v1.get_variable`, trained by `ge.train`'s Adagrad.
"""

import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.estimator import EstimatorSpec
from group_embedding.estimator import ModeKeys

V1 = tf.compat.v1
ROWS = 192
BATCH = 32
DIM = 4


def make_data(rows=ROWS, seed=0):
    """(features dict of numpy arrays, labels [N] float32)."""
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 40, (rows, 1)).astype(np.int64)
    item = np.char.add("i", rng.integers(0, 30, (rows, 2)).astype(str))
    item[rng.random((rows, 2)) < 0.2] = ""  # missing
    cat = rng.integers(0, 10, (rows, 1)).astype(np.int64)
    x = rng.normal(size=(rows, 2)).astype(np.float32)
    logit = (user[:, 0] % 3 - 1.0) + x[:, 0]
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(
        np.float32)
    return {"user": user, "item": item, "cat": cat, "x": x}, labels


def input_fn(features, labels, batch=BATCH, epochs=1):
    """An input_fn over numpy data (a Dataset of (features, labels))."""
    def fn():
        ds = tf.data.Dataset.from_tensor_slices((features, labels))
        return ds.repeat(epochs).batch(batch)
    return fn


def _init(seed):
    # Op-level seeds: the initial values do not depend on how many ops
    # the Estimator and a reference loop create before the model.
    return V1.truncated_normal_initializer(stddev=0.1, seed=seed)


def make_columns():
    """EV columns (one with a CounterFilter), a hash-bucket and a numeric
    column; the three embeddings share ONE grouped lookup."""
    option = ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=2))
    fc = ge.feature_column
    with fc.group_embedding_column_scope("ctr"):
        columns = [
            fc.embedding_column(fc.categorical_column_with_embedding(
                "user", tf.int64, ev_option=option), DIM,
                initializer=_init(1)),
            fc.embedding_column(fc.categorical_column_with_embedding(
                "item", tf.string), DIM, combiner="sum",
                initializer=_init(2)),
            fc.embedding_column(
                tf.feature_column.categorical_column_with_hash_bucket(
                    "cat", 20, dtype=tf.int64), DIM, initializer=_init(3))]
    return columns + [tf.feature_column.numeric_column("x", shape=(2,))]


def logits_of(features, mode):
    """[B] logits; a second call in one graph reuses the variables."""
    with V1.variable_scope(V1.get_variable_scope(), reuse=V1.AUTO_REUSE):
        net = ge.feature_column.input_layer(
            features, make_columns(), training=mode == ModeKeys.TRAIN)
        w = V1.get_variable("w", [net.shape[1], 1],
                            initializer=V1.glorot_uniform_initializer(
                                seed=4))
        b = V1.get_variable("b", [1], initializer=V1.zeros_initializer())
    return (tf.matmul(net, w) + b)[:, 0]


def optimizer(params):
    opt = ge.train.AdagradOptimizer(params.get("lr", 0.2))
    return ge.DistributedOptimizer(opt) if params.get("collective") else opt


def model_fn(features, labels, mode, params):
    """The Estimator model_fn."""
    logits = logits_of(features, mode)
    probs = tf.sigmoid(logits)
    if mode == ModeKeys.PREDICT:
        return EstimatorSpec(mode, predictions={"probability": probs,
                                                "logit": logits})
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=labels, logits=logits))
    if mode == ModeKeys.EVAL:
        return EstimatorSpec(mode, loss=loss, eval_metric_ops={
            "auc": V1.metrics.auc(labels, probs, num_thresholds=200),
            "accuracy": V1.metrics.accuracy(labels, tf.round(probs))})
    step = V1.train.get_global_step()
    return EstimatorSpec(mode, loss=loss, train_op=optimizer(
        params).minimize(loss, global_step=step))


EV_NAMES = ("input_layer/user_embedding/embedding_weights",
            "input_layer/item_embedding/embedding_weights")
DENSE_NAMES = ("w", "b", "input_layer/cat_embedding/embedding_weights")


def sorted_ev(keys, values):
    order = np.argsort(keys)
    return keys[order], values[order]


def checkpoint_state(path):
    """name -> value of the dense variables and (keys, values) of the EVs
    in a checkpoint."""
    reader = tf.train.load_checkpoint(path)
    out = {n: reader.get_tensor(n) for n in DENSE_NAMES}
    for n in EV_NAMES:
        out[n] = sorted_ev(reader.get_tensor(f"{n}-keys"),
                           reader.get_tensor(f"{n}-values"))
    return out


def reference_run(features, labels, eval_features, params, epochs=1,
                  steps=None):
    """The oracle: a hand-written MonitoredTrainingSession loop over the
    same model_fn and batches (no checkpoints), then training=False
    predictions of `eval_features` in the same session.

    Args:
        steps: train steps; default every batch of `epochs` epochs.

    Returns:
        (state as `checkpoint_state` gives it, eval probabilities, steps).
    """
    with tf.Graph().as_default():
        V1.train.get_or_create_global_step()
        batch = V1.data.make_one_shot_iterator(
            input_fn(features, labels, epochs=epochs)()).get_next()
        spec = model_fn(batch[0], batch[1], ModeKeys.TRAIN, params)
        probs = tf.sigmoid(logits_of(
            {k: tf.constant(v) for k, v in eval_features.items()},
            ModeKeys.PREDICT))
        graph = V1.get_default_graph()
        exports = {ev.name: ev.export()[:2] for ev in graph.get_collection(
            V1.GraphKeys.SAVEABLE_OBJECTS)}
        variables = {v.op.name: v for v in V1.global_variables()}
        if steps is None:
            steps = -(-len(labels) // BATCH) * epochs
        with V1.train.MonitoredTrainingSession(
                save_summaries_steps=None, save_checkpoint_secs=None,
                log_step_count_steps=None) as session:
            for _ in range(steps):  # every batch once, no OutOfRange
                session.run(spec.train_op)
            state = session.run({n: variables[n] for n in DENSE_NAMES})
            for n in EV_NAMES:
                state[n] = sorted_ev(*session.run(exports[n]))
            eval_probs = session.run(probs)
    return state, eval_probs, steps
