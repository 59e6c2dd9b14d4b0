"""DeepRec's `group_embedding_lookup_ops_test.py`, ported to
group_embedding.

DeepRec runs these cases on GPU only (its localized fused kernel); the
grouped lookup exists on CPU here, so they run on CPU, with DeepRec's
inputs and expected numbers, through `tf.nn.group_embedding_lookup_sparse`
and `tf.feature_column.group_embedding_column_scope` as installed by
`group_embedding.compat`. Where DeepRec only printed results, the oracle is
stock TF (embedding columns over identity columns).
"""

import numpy as np
import pytest
import tensorflow as tf

# `config_pb2.StorageType` is DeepRec's; compat adds it (conftest.py).
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.feature_column import feature_column_v2 as fc_v2

from ported_util import V1
from ported_util import VOCAB
from ported_util import double_sum
from ported_util import ev_rows_initializer
from ported_util import initialize
from ported_util import ones
from ported_util import random_rows
from ported_util import run_steps
from ported_util import stock_names
from ported_util import train_op


def _ids():
    """DeepRec's batch: 4 rows; row 0 = [1], row 1 = [1], row 2 = [3, 4],
    row 3 = [5]."""
    return tf.SparseTensor(
        indices=tf.constant([[0, 0], [1, 1], [2, 0], [2, 1], [3, 2]],
                            tf.int64),
        values=tf.constant([1, 1, 3, 4, 5], tf.int64), dense_shape=[4, 3])


def _group_lookup_and_train(tables, combiners, steps):
    """DeepRec's `runTestAdagrad`: grouped lookup of the same ids in every
    table, loss sum(2 * concat), Adagrad(0.1); the outputs of the last of
    `steps` runs."""
    ids = _ids()
    emb = V1.nn.group_embedding_lookup_sparse(
        tables, [ids] * len(tables), combiners)
    loss = double_sum(tf.concat(emb, axis=-1))
    V1.train.get_or_create_global_step()
    train = train_op(loss, V1.train.AdagradOptimizer(0.1))
    with V1.Session() as sess:
        initialize(sess)
        return run_steps(sess, [emb, train, loss], steps)[0]


def _first_step_expectation(result):
    """Ones everywhere (mean over ones, or sum of one id) but the sum of
    row 2 (two ids) of the dim-16 table, which is 2."""
    np.testing.assert_array_equal(result[0], np.ones([4, 8]))
    want = np.ones([4, 16])
    want[2] = 2.0
    np.testing.assert_array_equal(result[1], want)


def test_multi_kv_resource_gather():
    """testMultiKvResourceGather: two EVs (dims 8, 16), mean and sum."""
    with tf.Graph().as_default():
        tables = [V1.get_embedding_variable(
            f"emb_var_{i}", embedding_dim=dim, initializer=ones())
            for i, dim in enumerate((8, 16))]
        _first_step_expectation(
            _group_lookup_and_train(tables, ["mean", "sum"], 1))


def test_multi_embedding_sparse_lookup():
    """testMultiEmbeddingSparseLookUp: two plain variables (1000 x 8,
    1000 x 16), mean and sum."""
    with tf.Graph().as_default():
        tables = [V1.get_variable(f"var_{i}", shape=(1000, dim),
                                  initializer=ones())
                  for i, dim in enumerate((8, 16))]
        _first_step_expectation(
            _group_lookup_and_train(tables, ["mean", "sum"], 1))


def _shuffled_ids():
    """5 rows over keys 0..7 with ids repeated within and across rows,
    indices out of row-major order (the last row is not empty, so stock
    returns all 5 rows)."""
    rows = [[5, 0, 5], [7], [2, 0, 6, 5], [], [1, 7, 7]]
    entries = [(b, c, k) for b, row in enumerate(rows)
               for c, k in enumerate(row)]
    order = np.random.default_rng(3).permutation(len(entries))
    entries = [entries[i] for i in order]
    return tf.SparseTensor([e[:2] for e in entries],
                           tf.constant([e[2] for e in entries], tf.int64),
                           [len(rows), 4])


@pytest.mark.parametrize("kinds", ["ev", "plain", "mixed"])
@pytest.mark.parametrize("combiners", [("mean", "sum"), ("sqrtn", "mean")])
def test_multi_kv_resource_gather_equals_multi_embedding_sparse_lookup(
        combiners, kinds, compat):
    """testMultiKvResourceGatherEqualMultiEmbeddingSparseLookUp: four
    dim-16 tables in one group (EVs, plain variables or two of each),
    five Adagrad steps. (`("mean", "sum")` is DeepRec's; `("sqrtn",
    "mean")` adds the combiner DeepRec could not reach.)

    DeepRec compared EVs with plain variables through the same library,
    on all-ones tables where every key reads the same row. Here rows start
    distinct (an EV's key k from row k), ids repeat and come shuffled,
    every output column gets its own gradient, and the oracle is stock:
    `tf.compat.v1.nn.embedding_lookup_sparse` per table and stock
    `AdagradOptimizer` on plain variables, compat uninstalled. Every
    step's outputs and the final rows must agree."""
    dim, steps = 16, 5
    combiners = list(combiners) * 2
    tables = [random_rows(i, dim) for i in range(4)]
    coefficients = np.random.default_rng(9).normal(
        size=(5, 4 * dim)).astype(np.float32)
    ev_flags = {"ev": [True] * 4, "plain": [False] * 4,
                "mixed": [True, False, False, True]}[kinds]

    def run(use_library):
        if use_library:
            params = [V1.get_embedding_variable(
                f"emb_var_{i}", embedding_dim=dim,
                ev_option=ev_rows_initializer(t)) if ev else
                V1.get_variable(f"var_{i}", initializer=t)
                for i, (t, ev) in enumerate(zip(tables, ev_flags))]
            emb = V1.nn.group_embedding_lookup_sparse(
                params, [_shuffled_ids()] * 4, combiners)
        else:
            params = [V1.get_variable(f"var_{i}", initializer=t)
                      for i, t in enumerate(tables)]
            ids = tf.sparse.reorder(_shuffled_ids())
            emb = [V1.nn.embedding_lookup_sparse(p, ids, None, combiner=c)
                   for p, c in zip(params, combiners)]
        loss = tf.reduce_sum(tf.concat(emb, axis=-1) * coefficients)
        train = V1.train.AdagradOptimizer(0.1).minimize(loss)
        keys = tf.range(VOCAB, dtype=tf.int64)
        rows = [V1.nn.embedding_lookup(p, keys) for p in params]
        with V1.Session() as sess:
            if use_library:
                initialize(sess)
            else:
                sess.run(V1.global_variables_initializer())
            history = [sess.run([emb, train])[0] for _ in range(steps)]
            return history, sess.run(rows)

    with tf.Graph().as_default():
        got, got_rows = run(True)
    with stock_names(compat), tf.Graph().as_default():
        want, want_rows = run(False)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_rows, want_rows, rtol=1e-5, atol=1e-6)
    # Training moved the touched rows; keys 3 and 4 never appear.
    assert not np.allclose(want_rows[0][[0, 5]], tables[0][[0, 5]])
    np.testing.assert_array_equal(want_rows[0][[3, 4]], tables[0][[3, 4]])


def test_group_lookup_with_weights_equals_stock():
    """Not a DeepRec case (its tests pass no weights): the same batch with
    `sp_weights`, each combiner, against stock `embedding_lookup_sparse`
    on the plain variables holding the EV's rows."""
    combiners = ["sum", "mean", "sqrtn"]

    def weights():
        return tf.SparseTensor(_ids().indices,
                               tf.constant([0.5, 2.0, 1.5, -1.0, 3.0]),
                               [4, 3])

    with tf.Graph().as_default():
        evs = [V1.get_embedding_variable(
            f"emb_var_{c}", embedding_dim=4,
            initializer=V1.random_uniform_initializer(seed=i))
            for i, c in enumerate(combiners)]
        ids = _ids()
        got = V1.nn.group_embedding_lookup_sparse(
            evs, [ids] * 3, combiners, sp_weights=[weights()] * 3)
        keys = tf.range(6, dtype=tf.int64)
        rows = [V1.nn.embedding_lookup(ev, keys) for ev in evs]
        with V1.Session() as sess:
            initialize(sess)
            got = sess.run(got)
            rows = sess.run(rows)
    with tf.Graph().as_default():
        want = [tf.compat.v1.nn.embedding_lookup_sparse(
            tf.constant(r), _ids(), weights(), combiner=c)
            for r, c in zip(rows, combiners)]
        with V1.Session() as sess:
            want = sess.run(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_group_embedding_column_scope_with_ev_columns():
    """testMultiKvResourceGatherForSparseColumnEmbeddingCol: two EV columns
    (dims 8, 16) in one group_embedding_column_scope, input_layer, three
    Adagrad steps (DeepRec printed them). DeepRec's HBM storage option
    needs a GPU (test_ev_hbm_storage.py runs it on the host stand-in), so
    the case runs with DRAM.
    Oracle: stock embedding columns over identity columns of the same
    ids."""
    assert V1.StorageOption(storage_type=config_pb2.StorageType.HBM
                            ).storage_type == config_pb2.StorageType.HBM
    dram = V1.EmbeddingVariableOption(storage_option=V1.StorageOption(
        storage_type=config_pb2.StorageType.DRAM))
    ad = dict(indices=[[0, 0], [1, 1], [2, 2], [3, 3], [4, 3]],
              values=[1, 2, 3, 4, 5], dense_shape=[5, 4])
    user = dict(indices=[[0, 0], [1, 1], [2, 2], [2, 3], [4, 3]],
                values=[1, 2, 3, 4, 5], dense_shape=[5, 4])
    results = []
    for ev in (True, False):
        with tf.Graph().as_default():
            if ev:
                with tf.feature_column.group_embedding_column_scope(
                        name="test"):
                    columns = [V1.feature_column.embedding_column(
                        tf.feature_column.categorical_column_with_embedding(
                            key, dtype=tf.int64, ev_option=dram),
                        dimension=dim,
                        initializer=ones())
                        for key, dim in (("ad_emb", 8), ("user_emb", 16))]
            else:
                columns = [fc_v2.embedding_column(
                    fc_v2.categorical_column_with_identity(key, 6), dim,
                    initializer=ones())
                    for key, dim in (("ad_emb", 8), ("user_emb", 16))]
            features = {key: tf.SparseTensor(
                spec["indices"], tf.cast(spec["values"], tf.int64),
                spec["dense_shape"])
                for key, spec in (("ad_emb", ad), ("user_emb", user))}
            emb = V1.feature_column.input_layer(features, columns)
            train = train_op(double_sum(emb), V1.train.AdagradOptimizer(0.1))
            with V1.Session() as sess:
                initialize(sess)
                results.append([sess.run([emb, train])[0]
                                for _ in range(3)])
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    # Row 3 of user_emb is empty: zeros, not NaN.
    assert np.all(results[0][0][3, 8:] == 0.0)
