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


# --- stock references ----------------------------------------------------

# Ids of the stock-referenced cases: repeated (5 three times, 0 and 7
# twice) and out of order, so that a key read from or written to the
# wrong row, or an occurrence whose gradient is lost, changes the result.
REPEATED_IDS = [5, 0, 7, 5, 2, 0, 6, 5, 1, 7]
VOCAB = 8


def random_rows(seed, dim, vocab=VOCAB):
    """A `[vocab, dim]` float32 table of distinct random rows."""
    rng = np.random.default_rng(seed)
    return rng.uniform(-1.0, 1.0, (vocab, dim)).astype(np.float32)


def ev_rows_initializer(rows):
    """EV option whose key k starts from `rows[k]` (k < len(rows)): the
    default matrix is `rows` itself."""
    return V1.EmbeddingVariableOption(init_option=V1.InitializerOption(
        initializer=V1.constant_initializer(rows),
        default_value_dim=rows.shape[0]))


def stock_optimizer(name, learning_rate=0.1):
    """The stock `tf.compat.v1.train` optimizer (compat NOT installed)
    whose numbers DeepRec's optimizer `name` must give on the stock
    cases' inputs (the same ids every step, 5 steps):

    * AdagradDecay: stock Adagrad (initial accumulator 0.1, as
      AdagradDecay's floor); the decay period (100000 steps) never ends.
    * AdamAsync: stock Adam; its per-variable beta powers advance once per
      step as stock's shared ones do, and stock's sparse Adam moves only
      rows whose m is non-zero, i.e. the touched ones.
    """
    train = tf.compat.v1.train
    if name == "GradientDescent":
        return train.GradientDescentOptimizer(learning_rate)
    if name in ("Adagrad", "AdagradDecay"):
        return train.AdagradOptimizer(learning_rate,
                                      initial_accumulator_value=0.1)
    if name in ("Adam", "AdamAsync"):
        return train.AdamOptimizer(learning_rate)
    if name == "FTRL":
        return train.FtrlOptimizer(learning_rate,
                                   l1_regularization_strength=2.0,
                                   l2_regularization_strength=0.00001)
    raise ValueError(f"unknown optimizer {name!r}")


def train_rows(var, ids, coefficients, optimizer, steps, keys=None):
    """Lookup of `ids`, loss `sum(emb * coefficients + emb^2)` (a
    distinct gradient per occurrence, changing from step to step: with a
    constant gradient Adam moves every row by lr * sign(g), blind to a
    lost occurrence), `steps` training runs; returns the lookups of every
    run and, with `keys`, their rows after training."""
    emb = V1.nn.embedding_lookup(var, tf.constant(ids, tf.int64))
    loss = tf.reduce_sum(emb * coefficients + tf.square(emb))
    train = train_op(loss, optimizer)
    rows = None if keys is None else V1.nn.embedding_lookup(
        var, tf.constant(keys, tf.int64))
    with V1.Session() as sess:
        if hasattr(V1.GraphKeys, "EV_INIT_VAR_OPS"):
            initialize(sess)
        else:  # stock names: no EVs to initialise
            sess.run(V1.global_variables_initializer())
        history = [sess.run([emb, train])[0] for _ in range(steps)]
        return history, None if rows is None else sess.run(rows)


class stock_names:
    """Context that uninstalls `group_embedding.compat` (so `tf.*` is
    stock) and reinstalls it on exit."""

    def __init__(self, compat):
        self._compat = compat

    def __enter__(self):
        self._compat.uninstall()

    def __exit__(self, *exc):
        self._compat.install()
