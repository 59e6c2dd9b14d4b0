"""A stock `tf.compat.v1.train` optimizer's `minimize(loss)` in a TF1
graph refuses, naming the EV, a loss that reads a trainable
EmbeddingVariable instead of training the dense weights and silently
leaving the EV untrained (embedding_variable/stock_optimizer_guard.py).

Oracles: the same graph without the EV (the dense weight `w` after a
stock step must be what it is there), the EV's own export (untouched or
trained), and a MetaGraph round trip.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

v1 = tf.compat.v1
STOCK = {"sgd": v1.train.GradientDescentOptimizer,
         "adagrad": v1.train.AdagradOptimizer,
         "adam": v1.train.AdamOptimizer,
         "ftrl": v1.train.FtrlOptimizer}
W0 = np.array([[0.5], [-0.25], [1.0], [0.75]], np.float32)
IDS = [[1, 2], [3, 4]]
GUARD_ERROR = r"EmbeddingVariable 'ev' is read by the loss, but a stock"


def _graph(with_ev=True, ev_trainable=True):
    """`w` [4, 1] and, with the EV, a loss over its rows times `w`;
    `dense_loss` reads `w` alone."""
    w = v1.get_variable("w", initializer=W0, use_resource=True)
    dense_loss = tf.reduce_sum(tf.square(w - 1.0))
    ev = loss = None
    if with_ev:
        ev = ge.get_embedding_variable(
            "ev", 4, initializer=tf.constant_initializer(0.1),
            trainable=ev_trainable)
        emb = tf.reduce_sum(
            ge.embedding_lookup(ev, tf.constant(IDS, tf.int64)), 1)
        loss = tf.reduce_mean(tf.square(tf.matmul(emb, w) - 1.0))
    return w, ev, loss, dense_loss


def _rows(sess, ev):
    keys, values = sess.run(ev.export()[:2])
    return dict(zip(keys.tolist(), values.tolist()))


@pytest.mark.parametrize("name", sorted(STOCK))
def test_minimize_of_a_loss_reading_an_ev_is_refused(name):
    with tf.Graph().as_default():
        _, _, loss, _ = _graph()
        with pytest.raises(TypeError, match=GUARD_ERROR + r".*ge\.train"):
            STOCK[name](0.1).minimize(loss)
        with pytest.raises(TypeError, match=GUARD_ERROR):
            STOCK[name](0.1).compute_gradients(loss)


@pytest.mark.parametrize("name", sorted(STOCK))
def test_a_loss_without_the_ev_trains_as_without_it(name):
    """The guard changes nothing for a loss that does not read the EV,
    nor for an explicit `var_list`: `w` equals the EV-free graph's."""
    def train(with_ev):
        with tf.Graph().as_default():
            w, ev, loss, dense_loss = _graph(with_ev)
            op = STOCK[name](0.1).minimize(dense_loss)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                if ev is not None:
                    sess.run(loss)  # stores the batch's keys
                    before = _rows(sess, ev)
                for _ in range(3):
                    sess.run(op)
                if ev is not None:
                    assert _rows(sess, ev) == before  # not trained
                return sess.run(w)

    want = train(with_ev=False)
    np.testing.assert_array_equal(train(with_ev=True), want)
    assert not np.array_equal(want, W0)
    # var_list=[w] on the EV's loss: its own oracle, w alone trained.
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=W0, use_resource=True)
        emb = tf.constant(np.full([2, 4], 0.2, np.float32))
        plain_loss = tf.reduce_mean(tf.square(tf.matmul(emb, w) - 1.0))
        op = STOCK[name](0.1).minimize(plain_loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(op)
            want_w = sess.run(w)
    with tf.Graph().as_default():
        w, ev, loss, _ = _graph()
        op = STOCK[name](0.1).minimize(loss, var_list=[w])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(op)
            np.testing.assert_allclose(sess.run(w), want_w, rtol=1e-6)


def _one_step(loss, ev, op, w=None):
    """Runs `op` once after a lookup stored the keys: the EV's rows
    before and after, and `w` after."""
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        sess.run(loss)
        before = _rows(sess, ev)
        sess.run(op)
        return before, _rows(sess, ev), None if w is None else sess.run(w)


def test_ge_train_and_a_frozen_ev_are_not_refused():
    """A ge.train optimizer trains the EV; a non-trainable EV under a
    stock optimizer stays as it is (the user froze it)."""
    with tf.Graph().as_default():
        _, ev, loss, _ = _graph()
        before, after, _ = _one_step(
            loss, ev, ge.train.AdagradOptimizer(0.1).minimize(loss))
        assert after.keys() == before.keys() == {1, 2, 3, 4}
        assert all(after[k] != before[k] for k in before)
    with tf.Graph().as_default():
        w, ev, loss, _ = _graph(ev_trainable=False)
        before, after, w_after = _one_step(
            loss, ev, v1.train.AdagradOptimizer(0.1).minimize(loss), w)
        assert after == before
        assert not np.array_equal(w_after, W0)


def test_the_guard_survives_a_meta_graph_round_trip(caplog):
    """Exported and imported, the graph still refuses the stock
    optimizer; a resource variable of the same collection comes back as a
    variable, and the import logs no error about the collection."""
    with tf.Graph().as_default():
        _, _, loss, _ = _graph()
        extra = tf.Variable(1.0, name="extra")
        v1.add_to_collection(v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES,
                             extra)
        meta = v1.train.export_meta_graph()
        loss_name = loss.name
    with tf.Graph().as_default() as g, caplog.at_level(logging.WARNING):
        v1.train.import_meta_graph(meta)
        entries = v1.get_collection(
            v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES)
        with pytest.raises(TypeError, match=GUARD_ERROR):
            v1.train.AdagradOptimizer(0.1).minimize(
                g.get_tensor_by_name(loss_name))
    assert [type(e).__name__ for e in entries] == [
        "StockOptimizerGuard", "ResourceVariable"]
    assert entries[1].name == "extra:0"
    assert not [r for r in caplog.records
                if "trainable_resource_variables" in r.getMessage()]
