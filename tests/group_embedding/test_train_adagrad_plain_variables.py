"""`ge.train.AdagradOptimizer` on plain resource variables: the C++ update
replaces stock's `ResourceSparseApplyAdagrad` and must give stock
`tf.compat.v1.train.AdagradOptimizer`'s rows and accumulators, for
gradients with unique indices (grouped lookup, stock
`embedding_lookup_sparse`) and with duplicates (`tf.gather`)."""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import capabilities

V1 = tf.compat.v1
VOCAB, DIM = 40, 4


def _ids(rng):
    return tf.SparseTensor(
        indices=[[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]],
        values=rng.integers(0, VOCAB, 6).astype(np.int64),
        dense_shape=[3, 3])


LOSSES = {
    "grouped_lookup": lambda t, sp: ge.group_embedding_lookup_sparse(
        [t], [sp], "sum")[0],
    "stock_lookup_sparse": lambda t, sp: tf.nn.embedding_lookup_sparse(
        t, sp, None, combiner="mean"),
    "gather_with_duplicates": lambda t, sp: tf.gather(
        t, tf.concat([sp.values, sp.values[:3]], 0)),
}


def _train(optimizer_cls, loss_name, steps=3):
    """Rows, accumulator and the graph's op types after `steps` steps."""
    rng = np.random.default_rng(7)
    init = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
    with tf.Graph().as_default():
        table = V1.get_variable("table", initializer=init,
                                use_resource=True)
        sp = _ids(rng)
        out = LOSSES[loss_name](table, sp)
        loss = tf.reduce_sum(tf.square(out) * np.arange(
            1, DIM + 1, dtype=np.float32))
        opt = optimizer_cls(0.3, initial_accumulator_value=0.2)
        train = opt.minimize(loss)
        accum = opt.get_slot(table, "accumulator")
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            for _ in range(steps):
                sess.run(train)
            rows, acc = sess.run([table, accum])
        types = {op.type for op in tf.compat.v1.get_default_graph()
                 .get_operations()}
    return rows, acc, types


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
def test_matches_stock_v1_adagrad(loss_name):
    rows, acc, types = _train(ge.train.AdagradOptimizer, loss_name)
    want_rows, want_acc, stock_types = _train(V1.train.AdagradOptimizer,
                                              loss_name)
    np.testing.assert_allclose(acc, want_acc, rtol=1e-6)
    np.testing.assert_allclose(rows, want_rows, rtol=1e-5, atol=1e-6)
    assert "ResourceSparseApplyAdagrad" in stock_types
    if capabilities.current().kernels is not None:
        # The fused update ran, not stock's.
        assert "GroupEmbeddingSparseApplyAdagrad" in types
        assert "ResourceSparseApplyAdagrad" not in types
