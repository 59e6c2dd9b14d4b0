"""Helpers shared by the ports of DeepRec's EV and group-embedding tests.

DeepRec's tests build a TF1 graph, run `EV_INIT_VAR_OPS`,
`EV_INIT_SLOT_OPS` and the global initializer, then fetch
`[emb, train_op, loss]` a few times. These helpers do the same with the
names `group_embedding.compat` installs into `tf.compat.v1`.
"""

import numpy as np
import tensorflow as tf

V1 = tf.compat.v1

# The six optimizers DeepRec's `_CreateOptimizer` builds that issue 9 asks
# for on EVs (AdagradDecayV2 and AdamW are not provided here).
OPTIMIZERS = ("GradientDescent", "Adagrad", "AdagradDecay", "Adam",
              "AdamAsync", "FTRL")

def ones():
    return V1.ones_initializer()


def make_optimizer(name, learning_rate=0.1):
    """DeepRec's `_CreateOptimizer(name)` with the compat `tf.train`."""
    train = V1.train
    if name == "GradientDescent":
        return train.GradientDescentOptimizer(learning_rate)
    if name == "Adagrad":
        return train.AdagradOptimizer(learning_rate)
    if name == "AdagradDecay":
        return train.AdagradDecayOptimizer(
            learning_rate, train.get_or_create_global_step())
    if name == "Adam":
        return train.AdamOptimizer(learning_rate)
    if name == "AdamAsync":
        return train.AdamAsyncOptimizer(learning_rate)
    if name == "FTRL":
        return train.FtrlOptimizer(learning_rate,
                                   l1_regularization_strength=2.0,
                                   l2_regularization_strength=0.00001)
    raise ValueError(f"unknown optimizer {name!r}")


def optimizer_params(names=OPTIMIZERS):
    """The optimizer names to parametrize over (all run on EVs)."""
    return list(names)


def double_sum(emb):
    """DeepRec's loss: reduce_sum(emb * 2)."""
    return tf.reduce_sum(tf.multiply(emb, 2.0))


def train_op(loss, optimizer, global_step=None):
    """compute_gradients + apply_gradients, as DeepRec's tests do."""
    grads = optimizer.compute_gradients(loss)
    return optimizer.apply_gradients(grads, global_step=global_step)


def initialize(sess):
    """DeepRec's three initialisation runs.

    The global step, if any, is initialised first: DeepRec's
    `AdamOptimizer(0.1, gs)` cases make `beta1_power` start from the
    global step, and stock TF 2.21 runs the initializers in parallel, so
    `global_variables_initializer()` alone sometimes reads the step before
    it exists (FailedPreconditionError, reproduced with stock Adam on a
    plain tf.Variable).
    """
    step = V1.train.get_global_step()
    if step is not None:
        sess.run(step.initializer)
    sess.run(V1.get_collection(V1.GraphKeys.EV_INIT_VAR_OPS))
    sess.run(V1.get_collection(V1.GraphKeys.EV_INIT_SLOT_OPS))
    sess.run(V1.global_variables_initializer())


def run_steps(sess, fetches, steps, feed_dict=None):
    """Runs `fetches` `steps` times; returns the last result."""
    out = None
    for _ in range(steps):
        out = sess.run(fetches, feed_dict)
    return out


def checkpoint_table(path, name):
    """{key: (freq, version)} of EV `name` in the checkpoint at `path`
    (DeepRec's `<name>-keys` / `-freqs` / `-versions` tensors)."""
    keys = tf.train.load_variable(path, f"{name}-keys")
    freqs = tf.train.load_variable(path, f"{name}-freqs")
    versions = tf.train.load_variable(path, f"{name}-versions")
    return {int(k): (int(f), int(v))
            for k, f, v in zip(keys, freqs, versions)}


def checkpoint_rows(path, name):
    """{key: value row} of EV `name` in the checkpoint at `path`."""
    keys = tf.train.load_variable(path, f"{name}-keys")
    values = tf.train.load_variable(path, f"{name}-values")
    return {int(k): np.asarray(v) for k, v in zip(keys, values)}


def sorted_export(keys, *columns):
    """Export columns reordered by key (a hash table has no order)."""
    order = np.argsort(keys)
    return (np.asarray(keys)[order],) + tuple(
        np.asarray(c)[order] for c in columns)
