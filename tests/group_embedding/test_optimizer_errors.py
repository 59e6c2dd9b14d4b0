"""Optimizer misuse with EmbeddingVariables fails like stock Keras does.

Oracles: stock Keras optimizers on plain `tf.Variable`s (the same error
for all-None gradients, the same update when some gradients are None).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.embedding_variable.keras_variable import (
    KerasEmbeddingVariable,
)

import ev_cases

KEYS = tf.constant([3, -5, 2**40], tf.int64)
GE_OPTIMIZERS = {"sgd": (ge.optimizers.SGD, keras.optimizers.SGD),
                 "adagrad": (ge.optimizers.Adagrad, keras.optimizers.Adagrad),
                 "adam": (ge.optimizers.Adam, keras.optimizers.Adam),
                 "ftrl": (ge.optimizers.Ftrl, keras.optimizers.Ftrl)}


def _ev_gradient(ev):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(ev.lookup_rows(KEYS) - 1.0))
    return tape.gradient(loss, ev)


@pytest.mark.parametrize("name", sorted(GE_OPTIMIZERS))
def test_stock_keras_optimizer_on_ev_fails(name):
    ev = ev_cases.make_ev("stock_opt_ev")
    grad = _ev_gradient(ev)
    before = ev.export()[1].numpy()
    optimizer = GE_OPTIMIZERS[name][1](0.1)
    with pytest.raises(TypeError,
                       match=r"'stock_opt_ev'.*`ge.optimizers`"):
        optimizer.apply_gradients([(grad, ev)])
    np.testing.assert_array_equal(ev.export()[1].numpy(), before)


@pytest.mark.parametrize("name", ["adam", "adagrad", "ftrl"])
def test_stock_keras_optimizer_on_keras_ev_fails(name):
    ev = ev_cases.make_ev("stock_opt_kev")
    wrapper = KerasEmbeddingVariable(ev)
    grad = _ev_gradient(ev)
    optimizer = GE_OPTIMIZERS[name][1](0.1)
    with pytest.raises(TypeError,
                       match=r"'stock_opt_kev'.*`ge.optimizers`"):
        optimizer.apply_gradients([(grad, wrapper)])


class EVTower(keras.Model):
    def build(self, input_shape=None):
        self.ev = ev_cases.make_ev("fit_stock_adam")
        self.ev_weight = KerasEmbeddingVariable(self.ev)

    def call(self, ids):
        return tf.reduce_sum(self.ev.lookup_rows(ids), axis=[1, 2])[:, None]


def test_model_fit_with_stock_adam_fails():
    model = EVTower()
    model.compile(optimizer="adam", loss="mse")
    ids = np.array([[1, 2], [3, 4]], np.int64)
    with pytest.raises(TypeError, match=r"'fit_stock_adam'.*ge.optimizers"):
        model.fit(ids, np.ones((2, 1), "f"), epochs=1, verbose=0)


def _stock_error(stock_class):
    """What stock Keras raises for a tf.Variable with no gradient."""
    variable = tf.Variable(np.ones((3, 2), "f"))
    with pytest.raises(ValueError) as info:
        stock_class(0.1).apply_gradients([(None, variable)])
    return str(info.value)


@pytest.mark.parametrize("name", sorted(GE_OPTIMIZERS))
def test_all_none_gradients_fail_like_stock(name):
    ours, stock = GE_OPTIMIZERS[name]
    ev = ev_cases.make_ev("none_grad_ev")
    ev.lookup_rows(KEYS)
    before = ev.export()[1].numpy()
    optimizer = ours(0.1)
    with pytest.raises(ValueError) as info:
        optimizer.apply_gradients([(None, ev)])
    assert str(info.value) == _stock_error(stock)
    assert int(optimizer.iterations) == 0
    np.testing.assert_array_equal(ev.export()[1].numpy(), before)
    wrapper = KerasEmbeddingVariable(ev)
    with pytest.raises(ValueError, match="No gradients provided"):
        optimizer.apply_gradients([(None, wrapper)])


def test_ev_gradient_with_none_dense_gradient_updates_ev():
    ev = ev_cases.make_ev("partial_none_ev")
    grad = _ev_gradient(ev)
    before = ev.export()[1].numpy()
    dense = tf.Variable(np.ones((3, 2), "f"))
    optimizer = ge.optimizers.Adagrad(0.1)
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        optimizer.apply_gradients([(grad, ev), (None, dense)])
    assert int(optimizer.iterations) == 1
    assert not np.allclose(ev.export()[1].numpy(), before)
    np.testing.assert_array_equal(dense.numpy(), np.ones((3, 2), "f"))


def test_none_ev_gradient_with_dense_gradient_matches_stock():
    ev = ev_cases.make_ev("ev_none_dense_ok")
    ev.lookup_rows(KEYS)
    before = ev.export()[1].numpy()
    grad = tf.constant(np.arange(6, dtype="f").reshape(3, 2))
    ours = tf.Variable(np.ones((3, 2), "f"))
    stock = tf.Variable(np.ones((3, 2), "f"))
    optimizer = ge.optimizers.Adagrad(0.1)
    with pytest.warns(UserWarning, match="ev_none_dense_ok"):
        optimizer.apply_gradients([(None, ev), (grad, ours)])
    keras.optimizers.Adagrad(0.1).apply_gradients([(grad, stock)])
    np.testing.assert_allclose(ours.numpy(), stock.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(ev.export()[1].numpy(), before)
    assert int(optimizer.iterations) == 1
