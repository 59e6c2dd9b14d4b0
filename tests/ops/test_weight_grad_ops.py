"""The weight-gradient kernels that read resource variables directly
(GroupEmbeddingWeightGrad, GroupEmbeddingSequenceWeightGrad).

The library's gradient functions build the snapshot forms instead; these
stay registered because training graphs saved before name them
(ops/kernels/weight_grad_ops.cc). Oracle: the derivative written out in
numpy, and the snapshot forms on the same inputs.
"""

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.ops import capabilities
from group_embedding.ops import kernel_library


@pytest.fixture(name="lib")
def _lib(monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    lib = capabilities.current().kernels
    assert lib is not None, kernel_library.unavailable_reason()
    return lib


def _case(seed):
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(7, 5)).astype(np.float32)
    splits = np.array([0, 2, 2, 5, 6], np.int64)  # an empty example
    ids = rng.integers(0, 7, size=6).astype(np.int64)
    weights = rng.uniform(0.5, 2.0, size=6).astype(np.float32)
    return rng, table, ids, splits, weights


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_pooled_weight_grad_reading_the_variable(lib, combiner):
    rng, table, ids, splits, weights = _case(1)
    batch = len(splits) - 1
    grads = rng.normal(size=(batch, 5)).astype(np.float32)
    want = np.zeros_like(weights)
    pooled = np.zeros((batch, 5), np.float32)
    for b in range(batch):
        j = slice(splits[b], splits[b + 1])
        w, e = weights[j].astype(np.float64), table[ids[j]].astype(np.float64)
        n = {"sum": 1.0, "mean": w.sum(),
             "sqrtn": np.sqrt((w * w).sum())}[combiner] if len(w) else 1.0
        pooled[b] = (w[:, None] * e).sum(0) / n
        eg, pg = e @ grads[b], pooled[b] @ grads[b]
        dn = {"sum": 0.0 * w, "mean": 1.0 + 0.0 * w, "sqrtn": w / n}[combiner]
        want[j] = (eg - pg * dn) / n
    var = tf.Variable(table)
    args = dict(ids=[ids], row_splits=[splits], weights=[weights],
                grads=[grads], pooled=[pooled], combiners=[combiner])
    (got,) = lib.group_embedding_weight_grad(tables=[var.handle], **args)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    rows, by_position = lib.group_embedding_table_snapshot(
        table=var.handle, ids=ids, table_name="t")
    (snap,) = lib.group_embedding_weight_grad_from_snapshots(
        tables=[rows], by_position=[by_position], **args)
    np.testing.assert_array_equal(got.numpy(), snap.numpy())


@pytest.mark.parametrize("max_norm", [-1.0, 1.5])
def test_sequence_weight_grad_reading_the_variable(lib, max_norm):
    rng, table, ids, splits, weights = _case(2)
    positions = np.array([0, 1, 0, 1, 2, 0], np.int64)
    grads = rng.normal(size=(len(splits) - 1, 3, 5)).astype(np.float32)
    want = np.zeros_like(weights)
    for b in range(len(splits) - 1):
        for j in range(splits[b], splits[b + 1]):
            e = table[ids[j]].astype(np.float64)
            if max_norm >= 0:
                e = e * max_norm / max(np.linalg.norm(e), max_norm)
            want[j] = e @ grads[b, positions[j]]
    var = tf.Variable(table)
    args = dict(ids=[ids], row_splits=[splits], positions=[positions],
                weights=[weights], grads=[grads], max_norm=max_norm)
    (got,) = lib.group_embedding_sequence_weight_grad(tables=[var.handle],
                                                      **args)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    rows, by_position = lib.group_embedding_table_snapshot(
        table=var.handle, ids=ids, table_name="t")
    (snap,) = lib.group_embedding_sequence_weight_grad_from_snapshots(
        tables=[rows], by_position=[by_position], **args)
    np.testing.assert_array_equal(got.numpy(), snap.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"id 9 is out of range \[0, 7\)"):
        lib.group_embedding_sequence_weight_grad(
            tables=[var.handle], **dict(args, ids=[np.where(
                ids == ids[0], 9, ids).astype(np.int64)]))
