"""Runs inside the fresh venv the wheel was installed into, from outside
the repository: one EmbeddingVariable + plain-table lookup and one Adagrad
step on the packaged kernels, against the same step on stock TF ops.

Usage: python wheel_check.py SITE_PACKAGES; prints a JSON report last.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import config
from group_embedding.ops import kernel_library

DIM = 4
KEYS = np.array([-7, 3, 11, 2**40 + 5], np.int64)


def stock_pooled(table, rows):
    sp = rows.to_sparse()
    out = tf.nn.embedding_lookup_sparse(table, sp, None, combiner="mean")
    pad = tf.cast(sp.dense_shape[0], tf.int32) - tf.shape(out)[0]
    return tf.pad(out, [[0, pad], [0, 0]])


def main(site):
    assert os.path.realpath(ge.__file__).startswith(os.path.realpath(site)), \
        ge.__file__
    assert config.kernel_mode() == "custom"  # no silent fallback
    ev = ge.get_embedding_variable(
        "user", DIM, initializer=keras.initializers.RandomUniform(
            -1.0, 1.0, seed=0),
        ev_option=ge.EmbeddingVariableOption(
            init_option=ge.InitializerOption(default_value_dim=5)))
    defaults = ev.default_values.numpy()
    oracle = tf.Variable(defaults[np.mod(KEYS, defaults.shape[0])])
    table0 = np.random.default_rng(1).normal(size=(6, DIM)).astype("f")
    table, table_ref = tf.Variable(table0), tf.Variable(table0)
    # Every key in row 0, so that sparse and dense Adagrad agree.
    keys = tf.ragged.constant([list(KEYS), [3, 3], [], [2**40 + 5]],
                              tf.int64, row_splits_dtype=tf.int64)
    index = {int(k): i for i, k in enumerate(KEYS)}
    rows = tf.RaggedTensor.from_row_splits(
        tf.constant([index[int(k)] for k in keys.values.numpy()], tf.int64),
        keys.row_splits)
    plain = tf.ragged.constant([[0, 5], [1], [2, 2, 4], [3]], tf.int64,
                               row_splits_dtype=tf.int64)

    def loss_of(a, b):
        return tf.reduce_mean(tf.square(tf.reduce_sum(a * b, 1) - 1.0))

    opt = ge.optimizers.Adagrad(0.1)
    with tf.GradientTape() as tape:
        emb_ev, emb_plain = ge.group_embedding_lookup_sparse(
            [ev, table], [keys, plain], "mean")
        loss = loss_of(emb_ev, emb_plain)
    opt.apply_gradients(zip(tape.gradient(loss, [ev, table]), [ev, table]))

    ref_opt = keras.optimizers.Adagrad(0.1)
    with tf.GradientTape() as tape:
        ref_loss = loss_of(stock_pooled(oracle, rows),
                           stock_pooled(table_ref, plain))
    grads = [tf.convert_to_tensor(g)
             for g in tape.gradient(ref_loss, [oracle, table_ref])]
    ref_opt.apply_gradients(zip(grads, [oracle, table_ref]))

    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5)
    got_keys, got_values = (x.numpy() for x in ev.export()[:2])
    order = [list(got_keys).index(k) for k in KEYS]
    np.testing.assert_allclose(got_values[order], oracle.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(table.numpy(), table_ref.numpy(),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(table.numpy(), table0)  # the step did something
    print(json.dumps({"status": kernel_library.status(),
                      "loss": float(loss.numpy()),
                      "group_embedding": ge.__file__}))


if __name__ == "__main__":
    main(sys.argv[1])
