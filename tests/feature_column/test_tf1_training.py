"""TF1 style: a `model_fn` using `input_layer` trains under
`MonitoredTrainingSession`, checkpoints, and restores into a new graph."""

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import feature_column as ge_fc

import fc_cases

FC = tf.feature_column
V1 = tf.compat.v1


def _frame(n=96, seed=0):
    rng = np.random.default_rng(seed)
    uid = rng.integers(-1, 10, n)
    city = rng.choice(["sf", "ny", "la", "", "mars"], n)
    y = ((uid % 3 == 0) ^ (city == "sf")).astype("float32")
    return pd.DataFrame({"uid": uid, "city": city, "y": y})


def _columns(kind: str, scope_name: str):
    with ge_fc.group_embedding_column_scope(scope_name):
        if kind == "ev":
            # Two EV tables (int and string keys) in one Saver checkpoint.
            cats = [ge_fc.categorical_column_with_embedding("uid",
                                                            dtype=tf.int64),
                    ge_fc.categorical_column_with_embedding("city")]
        else:
            return _stock_columns(ge_fc.embedding_column)
        return [ge_fc.embedding_column(c, 4, "sum") for c in cats]


def _stock_columns(embedding_column):
    # Seeded initializers, so that this library's graph and the stock
    # reference graph (different op counts) start from the same tables.
    cats = [FC.categorical_column_with_identity("uid", 10),
            FC.categorical_column_with_vocabulary_list(
                "city", ["sf", "ny", "la"])]
    return [embedding_column(c, 4, "sum",
                             initializer=V1.truncated_normal_initializer(
                                 stddev=0.5, seed=i))
            for i, c in enumerate(cats)]


def _dense(x, units, name):
    # tf.compat.v1.layers.dense is gone with Keras 3: plain variables,
    # seeded (see `_stock_columns`).
    with V1.variable_scope(name):
        w = V1.get_variable("kernel", [x.shape[1], units],
                            initializer=V1.glorot_uniform_initializer(
                                seed=len(name)))
        b = V1.get_variable("bias", [units],
                            initializer=V1.zeros_initializer())
    return tf.matmul(x, w) + b


def _model_fn(features, labels, mode, columns, make_optimizer,
              input_layer=None):
    if input_layer is None:
        x = ge_fc.input_layer(features, columns, training=mode == "train")
    else:
        x = input_layer(features, columns)
    logits = _dense(tf.nn.relu(_dense(x, 8, "hidden")), 1, "logits")
    loss = tf.reduce_mean(tf.square(logits[:, 0] - labels))
    step = V1.train.get_or_create_global_step()
    train_op = make_optimizer().minimize(loss, global_step=step)
    return loss, train_op


def _input_fn(frame, batch=16):
    ds = tf.data.Dataset.from_tensor_slices(
        ({"uid": frame["uid"].values, "city": frame["city"].values},
         frame["y"].values)).repeat().batch(batch)
    return V1.data.make_one_shot_iterator(ds).get_next()


OPTIMIZERS = {
    "stock": lambda: V1.train.AdagradOptimizer(0.3),
    "ev": lambda: ge.train.AdagradOptimizer(0.3),
}


def _train(kind, ckpt_dir, scope_name, steps):
    graph = tf.Graph()
    with graph.as_default():
        V1.set_random_seed(0)
        features, labels = _input_fn(_frame())
        if kind == "reference":
            # Stock columns, input_layer and Adagrad: no part of this
            # library.
            loss, train_op = _model_fn(
                features, labels, "train", _stock_columns(FC.embedding_column),
                OPTIMIZERS["stock"], V1.feature_column.input_layer)
        else:
            loss, train_op = _model_fn(features, labels, "train",
                                       _columns(kind, scope_name),
                                       OPTIMIZERS[kind])
        hooks = [V1.train.StopAtStepHook(last_step=steps)]
        losses = []
        with V1.train.MonitoredTrainingSession(
                checkpoint_dir=ckpt_dir, hooks=hooks,
                save_checkpoint_steps=steps, save_summaries_steps=None,
                log_step_count_steps=None) as sess:
            while not sess.should_stop():
                losses.append(sess.run([loss, train_op])[0])
        return losses


def _state(sess):
    """Table, dense and EV values of the current graph (EVs by key)."""
    out = {v.op.name: v for v in V1.global_variables()
           if "Adagrad" not in v.op.name}
    evs = [v for v in V1.get_collection(V1.GraphKeys.SAVEABLE_OBJECTS)
           if isinstance(v, ge.EmbeddingVariable)]
    for ev in evs:
        out[ev.name] = ev.export()[:2]
    values = sess.run(out)
    for ev in evs:
        keys, rows = values[ev.name]
        order = np.argsort(keys)
        values[ev.name] = (keys[order], rows[order])
    return values


@pytest.mark.parametrize("kind", ["stock", "ev"])
def test_monitored_training_session_trains_saves_and_restores(kind,
                                                              tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    name = fc_cases.unique_name("tf1_" + kind)
    losses = _train(kind, ckpt_dir, name, steps=30)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    # Restore the final checkpoint into a fresh graph built by the same
    # model_fn; then train on: the global step resumes.
    graph = tf.Graph()
    with graph.as_default():
        features, labels = _input_fn(_frame())
        _model_fn(features, labels, "train", _columns(kind, name),
                  OPTIMIZERS[kind])
        saver = V1.train.Saver()
        with V1.Session() as sess:
            sess.run(V1.tables_initializer())
            saver.restore(sess, tf.train.latest_checkpoint(ckpt_dir))
            restored = _state(sess)
            step = sess.run(V1.train.get_global_step())
    assert step == 30
    more = _train(kind, ckpt_dir, name, steps=35)
    assert len(more) == 5
    names = [n for n in restored if "embedding" in n]
    assert names, restored.keys()
    for n in names:
        if isinstance(restored[n], tuple):  # EV: (keys, rows)
            # city: sf, ny, la, mars ("" means missing and is never a
            # key); uid: 0..9 (-1 means missing).
            want = 4 if "city" in n else len(set(_frame()["uid"]) - {-1})
            assert len(restored[n][0]) == want, n
    if kind == "stock":
        # The restored tables and layers are those of the same 30 steps
        # run entirely on stock TF (stock columns, input_layer, Adagrad).
        ref_dir = str(tmp_path / "reference")
        _train("reference", ref_dir, None, steps=30)
        ref = tf.train.latest_checkpoint(ref_dir)
        compared = [n for n in restored
                    if "embedding_weights" in n or "/kernel" in n]
        assert len(compared) == 4, restored.keys()
        for n in compared:
            want = tf.train.load_variable(ref, n)
            np.testing.assert_allclose(restored[n], want, rtol=1e-4,
                                       atol=1e-5, err_msg=n)
            if "embedding_weights" in n:
                init = _stock_initial_table(n)
                assert not np.allclose(want, init), n  # it trained


def _stock_initial_table(name):
    """The initial value of the stock table `name` (its seeded
    initializer, evaluated in a graph of its own)."""
    index = 0 if "uid" in name else 1
    shape = [10, 4] if index == 0 else [3, 4]
    with tf.Graph().as_default():
        V1.set_random_seed(0)  # as `_train`
        init = V1.truncated_normal_initializer(stddev=0.5, seed=index)
        with V1.Session() as sess:
            return sess.run(init(shape))


def test_restored_values_equal_trained_values(tmp_path):
    name = fc_cases.unique_name("tf1_eq")
    graph = tf.Graph()
    with graph.as_default():
        features, labels = _input_fn(_frame())
        loss, train_op = _model_fn(features, labels, "train",
                                   _columns("ev", name), OPTIMIZERS["ev"])
        saver = V1.train.Saver()
        with V1.Session() as sess:
            sess.run([V1.global_variables_initializer(),
                      V1.tables_initializer()])
            for _ in range(5):
                sess.run(train_op)
            trained = _state(sess)
            path = saver.save(sess, str(tmp_path / "model"))
    graph = tf.Graph()
    with graph.as_default():
        features, labels = _input_fn(_frame())
        _model_fn(features, labels, "train", _columns("ev", name),
                  OPTIMIZERS["ev"])
        with V1.Session() as sess:
            V1.train.Saver().restore(sess, path)
            restored = _state(sess)
    assert trained.keys() == restored.keys()
    for n in trained:
        want, got = trained[n], restored[n]
        pairs = zip(want, got) if isinstance(want, tuple) else [(want, got)]
        for a, b in pairs:
            np.testing.assert_array_equal(a, b)

