"""The one gradient loop of the pooling kernels (pooling.h: ForEachIdGrad).

The collective kernels (route, owner gather, pool from the exchanged
buffer) with one worker see the same ids and tables as the fused
single-process lookup, and must give the same numbers to the bit: the
forward through the pooling core, the backward through the one gradient
loop (before it was shared, the collective copy rounded `scale * g` before
adding it, a last-bit difference on mean and sqrtn tables).
"""

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.ops import collective_routing
from group_embedding.ops import kernel_library
from group_embedding.ops import lookup_kernels
from group_embedding.ops.ragged_ids import FeatureIds

pytestmark = pytest.mark.skipif(
    collective_routing.library() is None,
    reason="the C++ kernels are not available")

COMBINERS = ("sum", "mean", "sqrtn")


def _feature(rng, batch, vocab, max_len, weighted):
    lens = rng.integers(0, max_len + 1, size=batch)
    lens[0] = 0  # an empty row
    splits = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    nnz = int(splits[-1])
    # Half the ids from a few hot rows: duplicates within and across rows.
    ids = np.where(rng.random(nnz) < 0.5, rng.integers(0, 8, size=nnz),
                   rng.integers(0, vocab, size=nnz)).astype(np.int64)
    weights = (tf.constant(rng.random(nnz).astype(np.float32) * 2 - 0.5)
               if weighted else None)
    return FeatureIds(tf.constant(ids), tf.constant(splits), weights, None,
                      None, "f")


def _by_index(slices):
    order = np.argsort(slices.indices.numpy())
    return slices.indices.numpy()[order], slices.values.numpy()[order]


@pytest.mark.parametrize("dim", [4, 5, 16, 64])
@pytest.mark.parametrize("weighted", [False, True],
                         ids=["unweighted", "weighted"])
@pytest.mark.parametrize("size", ["small", "large"])
def test_one_worker_collective_equals_the_fused_lookup_bitwise(
        dim, weighted, size):
    # "large": more distinct rows than the backward keeps in cache (the
    # fused kernel's counting-sort sums).
    vocab, batch, max_len = ((50, 9, 6) if size == "small"
                             else (20000, 1200, 10))
    rng = np.random.default_rng([dim, weighted, vocab])
    tables = [tf.Variable(rng.standard_normal((vocab, dim))
                          .astype(np.float32)) for _ in COMBINERS]
    feats = [_feature(rng, batch, vocab, max_len, weighted)
             for _ in COMBINERS]
    upstream = [tf.constant(rng.standard_normal((batch, dim))
                            .astype(np.float32)) for _ in COMBINERS]
    weights = [f.weights for f in feats if f.weights is not None]
    dims = [dim] * len(COMBINERS)
    names = ["a", "b", "c"]

    with tf.GradientTape(persistent=True) as tape:
        tape.watch(weights)
        send, splits, offsets = collective_routing.route_ids(
            [f.values for f in feats], [vocab] * 3, dims, ["mod"] * 3, 1,
            names)
        rows, _ = collective_routing.owner_gather(tables, send, splits,
                                                  dims, names)
        got = collective_routing.pool(rows, offsets, feats, COMBINERS, dims)
        loss = tf.add_n([tf.reduce_sum(o * u)
                         for o, u in zip(got, upstream)])
    with tf.GradientTape(persistent=True) as ref_tape:
        ref_tape.watch(weights)
        want = lookup_kernels.pooled_variables(tables, feats, COMBINERS,
                                               names)
        ref_loss = tf.add_n([tf.reduce_sum(o * u)
                             for o, u in zip(want, upstream)])

    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w.numpy())
    for g, w in zip(tape.gradient(loss, tables),
                    ref_tape.gradient(ref_loss, tables)):
        g_idx, g_val = _by_index(g)
        w_idx, w_val = _by_index(w)
        np.testing.assert_array_equal(g_idx, w_idx)
        np.testing.assert_array_equal(g_val, w_val)
    if weights:
        for g, w in zip(tape.gradient(loss, weights),
                        ref_tape.gradient(ref_loss, weights)):
            np.testing.assert_array_equal(g.numpy(), w.numpy())


def test_sequence_backward_sums_in_position_order():
    # A table large enough for the counting-sort sums: each distinct id's
    # gradient is the sum of its occurrences' slots in position order,
    # as a float32 loop adds them.
    lib = kernel_library.library()
    rng = np.random.default_rng(3)
    dim, batch, length, vocab = 64, 1000, 8, 30000
    lens = rng.integers(0, length + 1, size=batch)
    splits = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    ids = rng.integers(0, vocab, size=splits[-1]).astype(np.int64)
    grads = rng.standard_normal((batch, length, dim)).astype(np.float32)
    uniq, sums = lib.group_embedding_sequence_lookup_grad(
        grads=[grads], ids=[ids], row_splits=[splits],
        positions=[positions], weights=[tf.zeros([0], tf.float32)],
        embedding_dim=dim)
    uniq, sums = uniq[0].numpy(), sums[0].numpy()
    assert len(uniq) * dim * 4 > 512 << 10  # past kCachedSumBytes
    want = {u: np.zeros(dim, np.float32) for u in uniq}
    rows = np.repeat(np.arange(batch), lens)
    for j, u in enumerate(ids):
        want[u] += grads[rows[j], positions[j]]
    np.testing.assert_array_equal(sums, np.stack([want[u] for u in uniq]))
