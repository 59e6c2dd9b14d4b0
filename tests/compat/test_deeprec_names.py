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
    with pytest.raises(NotImplementedError, match="LEVELDB"):
        tf.StorageOption(storage_type=config_pb2.StorageType.LEVELDB)
    # DeepRec's GPU tiers are options here (creating such an EV needs a
    # GPU; tests/group_embedding/test_ev_hbm_storage.py).
    hbm = tf.StorageOption(storage_type=config_pb2.StorageType.HBM_DRAM,
                           storage_size=[1 << 20])
    assert hbm.storage_type == ge.StorageType.HBM_DRAM
    with pytest.raises(ValueError, match="storage_type"):
        ge.StorageOption(storage_type="fast")


def test_storage_option_dram_ssdhash(compat, tmp_path):
    opt = tf.StorageOption(
        storage_type=config_pb2.StorageType.DRAM_SSDHASH,
        storage_path=str(tmp_path), storage_size=[1 << 20],
        cache_strategy=config_pb2.CacheStrategy.LRU)
    assert opt.cache_strategy == tf.CacheStrategy.LRU
    ev_opt = tf.EmbeddingVariableOption(storage_option=opt)
    again = ge.EmbeddingVariableOption.from_config(ev_opt.get_config())
    assert again.storage_option == opt


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


def _optimizer_options():
    return V1.ConfigProto().graph_options.optimizer_options


def test_do_op_fusion_is_a_logged_no_op_and_the_session_runs(
        compat, caplog, monkeypatch):
    from group_embedding.deeprec import runtime_features

    monkeypatch.setitem(runtime_features._state, "op_fusion_warned", False)
    config = V1.ConfigProto()
    config.inter_op_parallelism_threads = 1
    with caplog.at_level("WARNING", logger=runtime_features.__name__):
        config.graph_options.optimizer_options.do_op_fusion = True
        config.graph_options.optimizer_options.do_op_fusion = True
    assert [r.getMessage() for r in caplog.records].count(
        "optimizer_options.do_op_fusion is ignored: stock TensorFlow's "
        "grappler already fuses ops (remapper).") == 1
    # Off values of the refused knobs are stock behaviour: accepted.
    config.graph_options.optimizer_options.do_smart_stage = False
    config.graph_options.optimizer_options.micro_batch_num = 1
    # Stock fields still go to protobuf.
    config.graph_options.optimizer_options.opt_level = V1.OptimizerOptions.L0
    assert config.graph_options.optimizer_options.opt_level == -1
    assert config.inter_op_parallelism_threads == 1
    with tf.Graph().as_default():
        total = tf.constant([1.0, 2.0]) * 3.0
        with V1.Session(config=config) as sess:
            np.testing.assert_array_equal(sess.run(total), [3.0, 6.0])
    with pytest.raises(TypeError, match="do_op_fusion takes a bool"):
        config.graph_options.optimizer_options.do_op_fusion = "yes"
    with pytest.raises(AttributeError, match="no \"do_op_fusionn\" field"):
        config.graph_options.optimizer_options.do_op_fusionn = True


@pytest.mark.parametrize("name, value, feature", [
    ("do_smart_stage", True, "SmartStage"),
    ("do_smart_stage_gpu", True, "SmartStage"),
    ("stage_multi_stream", True, "SmartStage"),
    ("micro_batch_num", 4, "Auto Micro Batch"),
    ("do_async_embedding", True, "async embedding"),
])
def test_deeprec_runtime_knobs_raise_naming_the_feature(compat, name, value,
                                                        feature):
    options = _optimizer_options()
    with pytest.raises(NotImplementedError,
                       match=f"{feature} .*{name}.* DeepRec runtime"):
        setattr(options, name, value)
    assert options == V1.OptimizerOptions()  # nothing written


def test_config_knobs_back_to_stock_after_uninstall(compat):
    with pytest.raises(NotImplementedError, match="async embedding"):
        _optimizer_options().async_embedding_options.threads_num = 4
    with pytest.raises(TypeError, match="micro_batch_num takes an int"):
        _optimizer_options().micro_batch_num = 2.5
    compat.uninstall()
    assert "__setattr__" not in vars(config_pb2.OptimizerOptions)
    with pytest.raises(AttributeError, match="do_op_fusion"):
        _optimizer_options().do_op_fusion = True
    compat.install()


def test_deeprec_only_modules_import_and_refuse_use(compat):
    import importlib
    import sys

    from tensorflow.python.data.experimental.ops import parquet_dataset_ops
    from tensorflow.python.ops.work_queue import WorkQueue
    with pytest.raises(NotImplementedError,
                       match="ParquetDataset .*pandas.read_parquet"):
        parquet_dataset_ops.ParquetDataset(["a.parquet"], batch_size=8)
    with pytest.raises(NotImplementedError, match="ParquetDataset"):
        parquet_dataset_ops.DataFrame.Field("a", tf.int64)
    with pytest.raises(NotImplementedError, match="WorkQueue.*shard"):
        WorkQueue(["f.csv"])
    from tensorflow.python.training import weight_decay_optimizers
    with pytest.raises(NotImplementedError, match="AdamWOptimizer"):
        weight_decay_optimizers.AdamWOptimizer(0.01)
    adagrad_v2 = importlib.import_module(
        "tensorflow.python.training.adagrad_decay_v2")
    with pytest.raises(NotImplementedError,
                       match="AdagradDecayOptimizerV2.*AdagradDecayOptim"):
        adagrad_v2.AdagradDecayOptimizerV2(0.1, None)
    assert not hasattr(parquet_dataset_ops, "__path__")  # probes still work
    compat.uninstall()
    assert "tensorflow.python.ops.work_queue" not in sys.modules
    assert not hasattr(sys.modules["tensorflow.python.ops"], "work_queue")
    with pytest.raises(ImportError):
        importlib.import_module(
            "tensorflow.python.data.experimental.ops.parquet_dataset_ops")
    compat.install()


def test_deeprec_names_without_a_port_raise_one_clear_error(compat):
    calls = (
        (lambda: V1.train.AdagradDecayOptimizerV2(0.1, None),
         "AdagradDecayOptimizerV2"),
        (lambda: V1.contrib.opt.AdamWOptimizer(0.01), "AdamWOptimizer"),
        (lambda: V1.feature_column.categorical_column_with_multihash(
            "c", dims=(5, 3)), "categorical_column_with_multihash"),
        (lambda: tf.feature_column.categorical_column_with_multihash("c"),
         "Multi-Hash"),
        (lambda: V1.get_multihash_variable("v", [[2, 2], [2, 2]]),
         "get_multihash_variable"),
        (lambda: V1.get_dynamic_dimension_embedding_variable("v", 4, 2),
         "dynamic-dimension"),
        (lambda: V1.contrib.layers.sparse_column_with_embedding("c"),
         "sparse_column_with_embedding.*categorical_column_with_emb"),
        (lambda: V1.contrib.layers.input_from_feature_columns({}, []),
         "input_from_feature_columns"),
        (lambda: V1.contrib.layers.weighted_sum_from_feature_columns(
            {}, [], 1), "weighted_sum_from_feature_columns"),
    )
    for call, name in calls:
        with pytest.raises(NotImplementedError, match=name):
            call()
    # The stand-in is not a half-working object either.
    with pytest.raises(NotImplementedError, match="AdamWOptimizer"):
        V1.contrib.opt.AdamWOptimizer.minimize
    compat.uninstall()
    assert not hasattr(V1.train, "AdagradDecayOptimizerV2")
    assert not hasattr(V1.feature_column,
                       "categorical_column_with_multihash")
    compat.install()


def test_enable_group_embedding_localized_no_op_collective_points_on(
        compat):
    from tensorflow.python.framework import config as framework_config

    for enable in (V1.config.experimental.enable_group_embedding,
                   tf.config.enable_group_embedding,
                   framework_config.enable_group_embedding):
        assert enable(fusion_type="localized") is None
        with pytest.raises(NotImplementedError,
                           match="enable_distributed_strategy"):
            enable(fusion_type="collective")
        with pytest.raises(ValueError, match="fusion_type.*'local'"):
            enable(fusion_type="local")
    # "localized" changes nothing: a grouped lookup still runs locally.
    table = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
    ids = tf.SparseTensor([[0, 0], [0, 1]], tf.constant([1, 0], tf.int64),
                          [1, 2])
    out = tf.nn.group_embedding_lookup_sparse([table], [ids], ["sum"])[0]
    np.testing.assert_allclose(out, [[4.0, 6.0]])
    compat.uninstall()
    assert not hasattr(framework_config, "enable_group_embedding")
    compat.install()
