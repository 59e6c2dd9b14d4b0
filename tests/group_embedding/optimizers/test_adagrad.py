"""`ge.optimizers.Adagrad` against `keras.optimizers.Adagrad`.

The reference gets the densified gradient on a plain tf.Variable; ours gets
IndexedSlices with duplicate indices (summed before the update, so both
must agree) or the same dense gradient.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

from testing import assert_close

SHAPE = (6, 3)
# (learning_rate, initial_accumulator_value, epsilon)
HYPER = {"defaults": (0.1, 0.1, 1e-7), "other": (0.5, 0.3, 1e-7),
         "large_epsilon": (0.1, 0.1, 1e-2)}
_HYPER_PARAMS = ["defaults", "other", "large_epsilon"]


def _variable(kind, value):
    if kind == "keras":
        return keras.Variable(value)
    return tf.Variable(value)


def _sparse_grads(steps, index_dtype=tf.int64, seed=0):
    """Per step an IndexedSlices with duplicate and missing rows."""
    rng = np.random.default_rng(seed)
    grads = []
    for _ in range(steps):
        indices = np.array([1, 4, 1, 0, 4, 1])
        values = rng.normal(size=(len(indices), SHAPE[1]))
        grads.append(tf.IndexedSlices(
            tf.constant(values, tf.float32),
            tf.constant(indices, index_dtype),
            tf.constant(SHAPE, tf.int64)))
    return grads


def _reference(init, grads, hyper):
    lr, acc, eps = hyper
    var = tf.Variable(init)
    opt = keras.optimizers.Adagrad(lr, initial_accumulator_value=acc,
                                   epsilon=eps)
    for g in grads:
        opt.apply_gradients([(tf.convert_to_tensor(g), var)])
    return var.numpy()


def _init():
    return np.random.default_rng(42).normal(size=SHAPE).astype(np.float32)


@pytest.mark.parametrize("steps", [1, 3], ids=lambda s: f"{s}steps")
@pytest.mark.parametrize("hyper", _HYPER_PARAMS)
@pytest.mark.parametrize("var_kind", ["tf", "keras"])
def test_sparse_gradients_match_keras(kernel_mode, var_kind, hyper,
                                      steps):
    grads = _sparse_grads(steps)
    var = _variable(var_kind, _init())
    lr, acc, eps = HYPER[hyper]
    opt = ge.optimizers.Adagrad(lr, initial_accumulator_value=acc,
                                epsilon=eps)
    for g in grads:
        opt.apply_gradients([(g, var)])
    want = _reference(_init(), grads, HYPER[hyper])
    assert_close(var, want)
    # Rows without gradient (2, 3, 5) never move.
    np.testing.assert_array_equal(var.numpy()[[2, 3, 5]],
                                  _init()[[2, 3, 5]])


def test_int32_indices_match_keras(kernel_mode):
    grads = _sparse_grads(2, tf.int32)
    var = tf.Variable(_init())
    opt = ge.optimizers.Adagrad(0.1)
    for g in grads:
        opt.apply_gradients([(g, var)])
    assert_close(var, _reference(_init(), grads, HYPER["defaults"]))


@pytest.mark.parametrize("hyper", _HYPER_PARAMS)
@pytest.mark.parametrize("var_kind", ["tf", "keras"])
def test_dense_gradients_match_keras(kernel_mode, var_kind, hyper):
    rng = np.random.default_rng(1)
    grads = [tf.constant(rng.normal(size=SHAPE), tf.float32)
             for _ in range(3)]
    var = _variable(var_kind, _init())
    lr, acc, eps = HYPER[hyper]
    opt = ge.optimizers.Adagrad(lr, initial_accumulator_value=acc,
                                epsilon=eps)
    for g in grads:
        opt.apply_gradients([(g, var)])
    assert_close(var, _reference(_init(), grads, HYPER[hyper]))


def test_sparse_and_dense_in_one_call_in_tf_function(kernel_mode):
    sparse = _sparse_grads(3)
    rng = np.random.default_rng(2)
    dense = [tf.constant(rng.normal(size=SHAPE), tf.float32)
             for _ in range(3)]
    table, kernel = tf.Variable(_init()), tf.Variable(_init() * 2)
    opt = ge.optimizers.Adagrad(0.1)

    @tf.function
    def step(values, indices, dense_grad):
        sparse_grad = tf.IndexedSlices(values, indices, SHAPE)
        opt.apply_gradients([(sparse_grad, table), (dense_grad, kernel)])

    for s, d in zip(sparse, dense):
        step(s.values, s.indices, d)
    assert_close(table, _reference(_init(), sparse, HYPER["defaults"]))
    assert_close(kernel, _reference(_init() * 2, dense, HYPER["defaults"]))


def test_empty_sparse_gradient_changes_nothing(kernel_mode):
    var = tf.Variable(_init())
    opt = ge.optimizers.Adagrad(0.1)
    empty = tf.IndexedSlices(tf.zeros([0, SHAPE[1]]),
                             tf.zeros([0], tf.int64), SHAPE)
    opt.apply_gradients([(empty, var)])
    np.testing.assert_array_equal(var.numpy(), _init())
    accumulators = [v for v in opt.variables if "accumulator" in v.path]
    np.testing.assert_array_equal(accumulators[0].numpy(),
                                  np.full(SHAPE, 0.1, np.float32))


def test_earlier_reads_keep_their_values(kernel_mode):
    # The in-place kernel must not overwrite a buffer a tensor still uses.
    var = tf.Variable(_init())
    opt = ge.optimizers.Adagrad(0.1)
    opt.build([var])
    read = var.read_value()
    snapshot = read.numpy().copy()
    opt.apply_gradients([(_sparse_grads(1)[0], var)])
    np.testing.assert_array_equal(read.numpy(), snapshot)
    assert not np.array_equal(var.numpy(), snapshot)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("opt_cls", [ge.optimizers.Adagrad,
                                     ge.optimizers.Adam, ge.optimizers.Ftrl],
                         ids=["adagrad", "adam", "ftrl"])
@pytest.mark.parametrize("kernel_mode", [
    "custom", "tf"], indirect=True)
def test_out_of_range_index_fails_and_changes_nothing(kernel_mode, opt_cls,
                                                      graph):
    var = tf.Variable(_init())
    opt = opt_cls(0.1)
    opt.build([var])
    # Keras's step counter is left out: in a tf.function nothing orders
    # its increment after the failing check (so with stock optimizers too).
    slot_vars = [v for v in opt.variables if v is not opt.iterations]
    slots = [v.numpy().copy() for v in slot_vars]
    bad = tf.IndexedSlices(tf.ones([3, SHAPE[1]]),
                           tf.constant([1, 2, 9], tf.int64), SHAPE)

    def apply():
        opt.apply_gradients([(bad, var)])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"out of range") as failure:
        (tf.function(apply) if graph else apply)()
    assert "9" in str(failure.value)  # the bad index
    np.testing.assert_array_equal(var.numpy(), _init())
    assert slot_vars
    for before, v in zip(slots, slot_vars):
        np.testing.assert_array_equal(v.numpy(), before)


def test_negative_initial_accumulator_fails():
    with pytest.raises(ValueError, match=r"`initial_accumulator_value` "
                                         r"must be >= 0, got -0.1"):
        ge.optimizers.Adagrad(0.1, initial_accumulator_value=-0.1)


def test_config_round_trip():
    opt = ge.optimizers.Adagrad(0.25, initial_accumulator_value=0.5,
                                epsilon=1e-4, name="sparse_adagrad")
    config = opt.get_config()
    assert config["initial_accumulator_value"] == 0.5
    assert config["epsilon"] == 1e-4
    assert config["name"] == "sparse_adagrad"
    clone = ge.optimizers.Adagrad.from_config(config)
    assert clone.get_config() == config


@pytest.mark.parametrize("rows", [70, 300_000],
                         ids=["bitmap_check", "hash_check"])
@pytest.mark.parametrize("duplicates", [False, True],
                         ids=["unique", "duplicates"])
def test_unique_and_duplicate_indices_on_small_and_large_tables(
        kernel_mode, rows, duplicates):
    # The C++ update proves indices unique with a bitmap over the rows of
    # a table that is small next to the indices, else with its hash map;
    # either way duplicates are summed first (dense Keras as oracle).
    rng = np.random.default_rng(rows)
    init = rng.normal(size=(rows, 2)).astype(np.float32)
    indices = np.array([69, 3, 0, 64, 63] + ([3, 69] if duplicates else []))
    grads = [tf.IndexedSlices(
        tf.constant(rng.normal(size=(len(indices), 2)), tf.float32),
        tf.constant(indices, tf.int64), tf.constant([rows, 2], tf.int64))
        for _ in range(2)]
    var = tf.Variable(init)
    opt = ge.optimizers.Adagrad(0.1)
    for g in grads:
        opt.apply_gradients([(g, var)])
    want = _reference(init, grads, HYPER["defaults"])
    touched = np.unique(indices)
    assert_close(var.numpy()[touched], want[touched])
    np.testing.assert_array_equal(var.numpy(), np.where(
        np.isin(np.arange(rows), touched)[:, None], var.numpy(), init))
