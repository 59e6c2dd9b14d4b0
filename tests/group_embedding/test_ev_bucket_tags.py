"""EV hash buckets keep a hint byte per key (ev_storage.h's Bucket).

The hint holds the bucket's distance from the key's home bucket (capped
at 15) and 4 bits of the key's hash: a probe reads a row's key only where
both match, and a deletion takes a bucket's home from its distance. The
keys here are made by inverting the hash, so that 27 share one home
bucket (distances past the cap) and 12 of them also the 4 hash bits (only
their rows' keys tell them apart): every lookup, update, eviction, spill
to the disk tier and promotion must still reach each key's own row.
Oracles: the imported rows themselves, and a dense tf.Variable (one row
per key) trained by Keras' SGD on the same batches.
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import ev_storage

DIM = 4
_M64 = (1 << 64) - 1
_C1 = 0xff51afd7ed558ccd
_C2 = 0xc4ceb9fe1a85ec53


def _mix(x):
    """ops/kernels/hash_mix.h's Mix (the 64-bit murmur finaliser)."""
    x ^= x >> 33
    x = (x * _C1) & _M64
    x ^= x >> 33
    x = (x * _C2) & _M64
    x ^= x >> 33
    return x


def _unmix(h):
    """The key whose Mix is `h` (each step of Mix is invertible)."""
    h ^= h >> 33
    h = (h * pow(_C2, -1, 1 << 64)) & _M64
    h ^= h >> 33
    h = (h * pow(_C1, -1, 1 << 64)) & _M64
    h ^= h >> 33
    return h


def _signed(u):
    return u - (1 << 64) if u >= 1 << 63 else u


def _colliding_keys():
    """12 keys with one home (the low 32 bits of the hash) and one hint
    nibble (its top 4 bits), 15 more with that home and the other
    nibbles, 48 keys elsewhere (75: past the first table's 51, so that
    the import rehashes); shuffled, negative keys included."""
    low = 0x9ABCDEF1
    same_tag = [_unmix((hi << 32) | low) for hi in range(1, 13)]
    same_home = [_unmix((j << 60) | (j << 32) | low) for j in range(1, 16)]
    rng = np.random.default_rng(5)
    others = [int(x) for x in rng.integers(0, 1 << 63, 48, dtype=np.uint64)]
    keys = [_signed(k) for k in same_tag + same_home + others]
    for k in same_tag:
        assert _mix(k) & 0xFFFFFFFF == low
    assert len(set(keys)) == len(keys)
    return np.array(rng.permutation(keys), np.int64)


def _ev(name, storage=None, steps_to_live=None):
    option = ge.EmbeddingVariableOption(
        storage_option=storage or ge.StorageOption(),
        evict_option=(None if steps_to_live is None
                      else ge.GlobalStepEvict(steps_to_live=steps_to_live)))
    return ge.get_embedding_variable(
        name, DIM, initializer=tf.keras.initializers.Zeros(),
        ev_option=option)


def _import(ev, keys, values, versions, step):
    n = len(keys)
    ev_storage.import_(ev.handle, tf.constant(keys, tf.int64),
                       tf.constant(values, tf.float32),
                       np.ones(n, np.int64), np.asarray(versions, np.int64),
                       tf.constant([], tf.string), tf.zeros([0]),
                       tf.zeros([n, 0]), step)


def _state(ev):
    keys, values = (x.numpy() for x in ev.export()[:2])
    order = np.argsort(keys)
    return keys[order], values[order]


def _tier(tmp_path, rows):
    # A DRAM tier of `rows` rows (see test_ev_ssd_storage.py's budget).
    return ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                            storage_path=str(tmp_path),
                            storage_size=[64 * 12 + rows * (24 + 29 + 4 * DIM)])


@pytest.mark.parametrize("tiered", [False, True])
def test_colliding_keys_keep_their_rows(tiered, tmp_path):
    keys = _colliding_keys()
    values = np.random.default_rng(1).normal(size=[len(keys), DIM])
    storage = _tier(tmp_path, rows=6) if tiered else None
    ev = _ev(f"tags_rows_{int(tiered)}", storage)
    _import(ev, keys, values, np.zeros(len(keys)), 0)
    rng = np.random.default_rng(2)
    for _ in range(20):
        pick = rng.choice(len(keys), size=7)
        got = ev.lookup_rows(tf.constant(keys[pick]), training=False)
        np.testing.assert_array_equal(got.numpy(), values[pick].astype(
            np.float32))
    got_keys, got_values = _state(ev)
    order = np.argsort(keys)
    np.testing.assert_array_equal(got_keys, keys[order])
    np.testing.assert_array_equal(got_values,
                                  values[order].astype(np.float32))


@pytest.mark.parametrize("tiered", [False, True])
def test_colliding_keys_train_as_dense_rows(tiered, tmp_path):
    keys = _colliding_keys()
    init = np.random.default_rng(3).normal(size=[len(keys), DIM]).astype(
        np.float32)
    storage = _tier(tmp_path, rows=8) if tiered else None
    ev = _ev(f"tags_train_{int(tiered)}", storage)
    _import(ev, keys, init, np.zeros(len(keys)), 0)
    dense = tf.Variable(init)
    opt_ev, opt_dense = ge.optimizers.SGD(0.1), tf.keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(4)
    for _ in range(12):
        rows = [list(rng.choice(len(keys), size=rng.integers(0, 4)))
                for _ in range(5)]
        idx = tf.ragged.constant(rows, dtype=tf.int64,
                                 row_splits_dtype=tf.int64)
        ids = tf.RaggedTensor.from_row_splits(
            tf.gather(tf.constant(keys), idx.values), idx.row_splits)
        with tf.GradientTape() as tape:
            (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
            loss = tf.reduce_sum(tf.square(emb - 0.5))
        opt_ev.apply_gradients([(tape.gradient(loss, ev), ev)])
        with tf.GradientTape() as tape:
            emb = tf.math.segment_sum(tf.gather(dense, idx.values),
                                      idx.value_rowids())
            emb = tf.concat(
                [emb, tf.zeros([5 - tf.shape(emb)[0], DIM])], 0)
            loss = tf.reduce_sum(tf.square(emb - 0.5))
        opt_dense.apply_gradients([(tape.gradient(loss, dense), dense)])
    got_keys, got_values = _state(ev)
    order = np.argsort(keys)
    np.testing.assert_array_equal(got_keys, keys[order])
    np.testing.assert_allclose(got_values, dense.numpy()[order], rtol=1e-5,
                               atol=1e-6)


def test_eviction_among_colliding_keys():
    keys = _colliding_keys()
    values = np.random.default_rng(6).normal(size=[len(keys), DIM]).astype(
        np.float32)
    # Every other key is stale (version 0 at step 100, 10 steps to live):
    # the deletions cut holes in the shared probe chains.
    stale = np.arange(len(keys)) % 2 == 0
    versions = np.where(stale, 0, 100)
    ev = _ev("tags_evict", steps_to_live=10)
    _import(ev, keys, values, versions, 100)
    assert int(ev.evict()) == int(stale.sum())
    got_keys, got_values = _state(ev)
    order = np.argsort(keys[~stale])
    np.testing.assert_array_equal(got_keys, keys[~stale][order])
    np.testing.assert_array_equal(got_values, values[~stale][order])
    got = ev.lookup_rows(tf.constant(keys), training=False).numpy()
    np.testing.assert_array_equal(got[~stale], values[~stale])
    np.testing.assert_array_equal(got[stale], 0.0)
