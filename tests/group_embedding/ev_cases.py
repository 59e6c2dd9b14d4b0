"""Helpers of the EmbeddingVariable tests: an EV and its oracle.

The oracle of an EV holding keys K is a plain `tf.Variable` whose row r is
key K[r]'s initial value (row `K[r] mod default_value_dim` of the EV's
default matrix); batches of keys map to batches of row numbers.
"""

import numpy as np
import tensorflow as tf

import group_embedding as ge

KEYS = np.array([-7, 0, 3, 11, 2**40 + 5, 2**63 - 1, -2**63], np.int64)
DEFAULT_ROWS = 5


def make_ev(name="ev", dim=4, seed=0, ev_option=None, **kwargs):
    """An EV with a small random default matrix."""
    opt = ev_option or ge.EmbeddingVariableOption(
        init_option=ge.InitializerOption(default_value_dim=DEFAULT_ROWS))
    init = tf.keras.initializers.RandomUniform(-1.0, 1.0, seed=seed)
    return ge.get_embedding_variable(name, dim, initializer=init,
                                     ev_option=opt, **kwargs)


def initial_rows(ev, keys):
    """Numpy initial values of `keys` (floor modulo, as the EV)."""
    dv = ev.default_values.numpy()
    return dv[np.mod(keys, dv.shape[0])]


def random_batch(rng, batch=6, keys=KEYS, cover_all=True):
    """Ragged key batch; with `cover_all`, row 0 holds every key once so
    that dense and lazy optimizers agree."""
    rows = [list(rng.choice(keys, size=rng.integers(0, 4)))
            for _ in range(batch)]
    if cover_all:
        rows[0] = list(keys)
    return tf.ragged.constant(rows, dtype=tf.int64, row_splits_dtype=tf.int64)


def to_rows(batch, keys=KEYS):
    """The same batch with keys replaced by oracle row numbers."""
    index = {int(k): i for i, k in enumerate(keys)}
    values = [index[int(k)] for k in batch.values.numpy()]
    return tf.RaggedTensor.from_row_splits(
        tf.constant(values, tf.int64), batch.row_splits)


def stock_pooled(table, rows, combiner):
    """Stock `embedding_lookup_sparse`, padded to the batch size."""
    sp = rows.to_sparse()
    out = tf.nn.embedding_lookup_sparse(table, sp, None, combiner=combiner)
    pad = tf.cast(sp.dense_shape[0], tf.int32) - tf.shape(out)[0]
    return tf.pad(out, [[0, pad], [0, 0]])


def export_sorted(ev):
    """(keys, values, freqs, versions) of `ev` as numpy, sorted by key."""
    keys, values, versions, freqs = (x.numpy() for x in ev.export())
    order = np.argsort(keys)
    return keys[order], values[order], freqs[order], versions[order]


def values_of(ev, keys):
    """Stored values of `keys` (each must be present), numpy."""
    k, v, _, _ = export_sorted(ev)
    index = {int(x): i for i, x in enumerate(k)}
    return v[[index[int(x)] for x in keys]]
