"""DeepRec names scripts use: get_embedding_variable's extra arguments, EV
statistics, StorageOption, EV init collections and runtime-feature stubs.

Oracle for the statistics: counts and steps computed here from the ids fed
and the steps run (numpy), and `ev.export()`.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

import group_embedding as ge

V1 = tf.compat.v1


def test_total_count_frequency_and_version_follow_lookups_and_updates():
    rng = np.random.default_rng(0)
    ev = ge.get_embedding_variable("stats", 3)
    opt = ge.optimizers.SGD(0.1)
    counts = collections.Counter()
    last_step = {}
    for step in range(3):
        ids = rng.integers(0, 20, 8)
        counts.update(ids.tolist())
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ge.embedding_lookup(ev, ids))
        opt.apply([tape.gradient(loss, ev)], [ev])
        for k in ids:
            last_step[int(k)] = int(ev.get_version([k])[0])
    np.testing.assert_array_equal(ev.total_count(), [len(counts), 3])
    np.testing.assert_array_equal(ev.get_dynamic_shape(), [len(counts), 3])
    query = np.array([[5, 19], [100, 0]], np.int64)
    freq = ev.get_frequency(query)
    assert freq.dtype == tf.int64 and freq.shape == (2, 2)
    np.testing.assert_array_equal(
        freq, [[counts[int(k)] for k in row] for row in query])
    keys, _, versions, freqs = ev.export()
    by_key = dict(zip(keys.numpy().tolist(), versions.numpy().tolist()))
    np.testing.assert_array_equal(
        ev.get_version(query),
        [[by_key.get(int(k), -1) for k in row] for row in query])
    # Reading statistics inserts nothing.
    assert int(ev.size()) == len(counts)


def test_get_embedding_variable_steps_to_live_and_partitioner():
    ev = ge.get_embedding_variable("stl", 2, steps_to_live=5)
    assert ev.ev_option.evict_option == ge.GlobalStepEvict(5)
    with pytest.raises(ValueError, match="stl2.*steps_to_live"):
        ge.get_embedding_variable(
            "stl2", 2, steps_to_live=5,
            ev_option=ge.EmbeddingVariableOption(
                evict_option=ge.L2WeightEvict(1.0)))
    parts = ge.get_embedding_variable(
        "parted", 2, partitioner=V1.fixed_size_partitioner(4))
    assert isinstance(parts, list) and len(parts) == 1
    ids = tf.constant([3, 9], tf.int64)
    np.testing.assert_array_equal(ge.embedding_lookup(parts, ids),
                                  ge.gather(parts[0], ids))
    with pytest.raises(NotImplementedError, match="regul.*regularizer"):
        ge.get_embedding_variable("regul", 2, regularizer=lambda x: x)


def test_storage_option_dram_only(compat):
    opt = tf.StorageOption(storage_type=config_pb2.StorageType.DRAM)
    ev_opt = tf.EmbeddingVariableOption(storage_option=opt)
    again = ge.EmbeddingVariableOption.from_config(ev_opt.get_config())
    assert again.storage_option.storage_type == ge.StorageType.DRAM
    with pytest.raises(NotImplementedError, match="HBM_DRAM"):
        tf.StorageOption(storage_type=config_pb2.StorageType.HBM_DRAM)
    with pytest.raises(ValueError, match="storage_type"):
        ge.StorageOption(storage_type="fast")


def test_ev_init_collections_in_graph_mode(compat):
    with tf.Graph().as_default():
        ev = V1.get_embedding_variable("coll", 2)
        init_ops = V1.get_collection(V1.GraphKeys.EV_INIT_VAR_OPS)
        assert ev.default_values.initializer in init_ops
        loss = tf.reduce_sum(V1.nn.embedding_lookup(ev, [1, 2]))
        train = V1.train.AdagradOptimizer(0.1).minimize(loss)
        slot_ops = V1.get_collection(V1.GraphKeys.EV_INIT_SLOT_OPS)
        assert slot_ops
        with V1.Session() as sess:
            sess.run(init_ops)
            sess.run(train)
            assert sess.run(ev.size()) == 2


def test_runtime_features_raise_one_clear_error(compat):
    for call, name in ((lambda: V1.staged({}), "staged"),
                       (lambda: V1.make_prefetch_hook(), "make_prefetch_hook"),
                       (lambda: V1.feature_column.
                        categorical_column_with_adaptive_embedding("a"),
                        "adaptive_embedding")):
        with pytest.raises(NotImplementedError, match=name):
            call()
    compat.uninstall()
    assert not hasattr(V1, "staged")
    assert not hasattr(config_pb2, "StorageType")
    assert not hasattr(V1.GraphKeys, "EV_INIT_VAR_OPS")
    compat.install()


def test_embedding_column_accepts_do_fusion(compat):
    from group_embedding.feature_column import columns

    cat = tf.feature_column.categorical_column_with_embedding("f")
    fused = tf.feature_column.embedding_column(cat, 4, do_fusion=True)
    plain = tf.feature_column.embedding_column(cat, 4)
    assert isinstance(fused, columns.EmbeddingColumn)
    assert fused == plain  # documented no-op: always one fused lookup
