"""`ge.export_saved_model` (issue 26.1): TF2 objects and TF1 graphs; the
SavedModel is served by plain TF in a process that cannot import
group_embedding (serve_plain.py) and predicts what the library's model
predicts, on admitted keys, keys stored but still under the CounterFilter
and unseen keys. Keras models: test_keras_export.py."""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.export import ev_snapshot
from group_embedding.ops import ev_storage

from test_keras_export import ev_pending_keys
from test_keras_export import pending_keys
from test_keras_export import serve

_v1 = tf.compat.v1


def _ev_option(storage=None):
    return ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=2),
        init_option=ge.InitializerOption(default_value_no_permission=-0.5),
        storage_option=storage or ge.StorageOption())


@pytest.mark.parametrize("kind", ["dram", "ssd", "hbm", "hbm_dram"])
def test_tf2_module(tmp_path, kind, monkeypatch):
    # ssd: DRAM_SSDHASH with room for the disk index (768 bytes) and two
    # rows, so that most keys are exported from disk; hbm: the GPU table
    # (StorageType.HBM) on the CUDA core's host stand-in; hbm_dram: the
    # same over a host-memory tier, every key moved there before the
    # export.
    monkeypatch.setenv("GROUP_EMBEDDING_HBM_ON_HOST", "1")
    tiered = kind == "ssd"
    storage = ge.StorageOption(
        ge.StorageType.DRAM_SSDHASH, storage_path=str(tmp_path / "tier"),
        storage_size=[768 + 2 * (36 + 4 * 4 * 2)]) if tiered else None
    if kind in ("hbm", "hbm_dram"):
        storage = ge.StorageOption(
            ge.StorageType.HBM if kind == "hbm" else ge.StorageType.HBM_DRAM,
            storage_size=[1])
    ev = ge.get_embedding_variable("module_ev", 4,
                                   ev_option=_ev_option(storage))
    dense = tf.Variable(tf.random.normal([4, 1], seed=1))
    opt = ge.optimizers.Adagrad(0.2)
    for step in range(3):
        # Key 6 only at the first step: stored, not admitted.
        ids = tf.ragged.constant([[1, 2, 3], [3, 4], [5, 1, 6][:3 - step]],
                                 tf.int64)
        with tf.GradientTape() as tape:
            out = ge.group_embedding_lookup_sparse([ev], [ids], ["sum"])[0]
            loss = tf.reduce_sum(tf.matmul(out, dense) ** 2)
        grads = tape.gradient(loss, [ev, dense])
        opt.apply_gradients(zip(grads, [ev, dense]))

    module = tf.Module()
    module.ev, module.dense = ev, dense
    spec = tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)

    @tf.function(input_signature=[spec])
    def serve_fn(ids):
        pooled = ge.group_embedding_lookup_sparse([ev], [ids], ["mean"],
                                                  training=False)[0]
        return tf.matmul(pooled, dense)

    module.serve = serve_fn
    request = tf.ragged.constant([[1, 2], [], [9, 3, -4], [5], [6, 2]],
                                 tf.int64)
    assert ev_pending_keys(ev, request.values) == [6]
    want = serve_fn(request).numpy()
    if tiered:
        # A lookup spills the DRAM tier to its two rows: the export reads
        # the other keys from disk.
        serve_fn(tf.ragged.constant([[1]], tf.int64))
        assert int(ev_storage.tier_stats(ev.handle)[1]) >= 4
    if kind == "hbm_dram":
        # Re-importing its own export (what a restore does) leaves every
        # key in host memory: the export must read them there.
        size = int(ev.size())
        ev.storage.import_(ev.handle, *ev.storage.export(ev.handle, 4))
        assert int(ev.size()) == size >= 6
    path = str(tmp_path / "module")
    assert ge.export_saved_model(module, path) == path
    got = serve(path, {"ids": request}, "serve", tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not ev_snapshot._taken  # released after the export


def test_traced_concrete_function_is_refused(tmp_path):
    ev = ge.get_embedding_variable("traced_ev", 2)
    module = tf.Module()
    module.ev = ev

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def rows(keys):
        return ev.lookup_rows(keys, training=False)

    module.rows = rows
    concrete = rows.get_concrete_function()  # traced outside the save
    with pytest.raises(NotImplementedError, match="traced before"):
        ge.export_saved_model(module, str(tmp_path / "m"),
                              signatures={"serving_default": concrete})
    assert not (tmp_path / "m").exists()


def test_tf1_graph(tmp_path, monkeypatch):
    # EV reads as GroupEmbeddingEVGather ops, which the export replaces.
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "tf")
    rng = np.random.default_rng(0)
    with tf.Graph().as_default():
        ev = ge.get_embedding_variable("tf1_ev", 3, ev_option=_ev_option())
        w = _v1.get_variable("w", [3, 1])
        ids = _v1.sparse_placeholder(tf.int64, [None, None], name="ids")
        dense_ids = _v1.placeholder(tf.int64, [None, 2], name="dense_ids")
        train_out = ge.group_embedding_lookup_sparse([ev], [ids],
                                                     ["sum"])[0]
        loss = tf.reduce_sum(tf.matmul(train_out, w) ** 2)
        step = ge.train.AdagradOptimizer(0.2).minimize(loss)
        present = tf.where(tf.not_equal(dense_ids, -1))
        request_ids = tf.SparseTensor(
            present, tf.gather_nd(dense_ids, present),
            tf.shape(dense_ids, out_type=tf.int64))
        served = tf.matmul(ge.group_embedding_lookup_sparse(
            [ev], [request_ids], ["mean"], training=False)[0], w,
            name="score")
        request = rng.integers(-1, 12, [16, 2])
        with _v1.Session() as sess:
            sess.run(_v1.global_variables_initializer())
            for i in range(4):
                batch = rng.integers(0, 8, [8, 3])
                if i == 0:
                    batch[0, 0] = 9  # seen once: stored, not admitted
                sess.run(step, {ids: tf.compat.v1.SparseTensorValue(
                    np.stack(np.nonzero(batch >= 0), 1), batch.ravel(),
                    batch.shape)})
            request[2, 1] = 9
            keys, _, _, freqs = sess.run(ev.export())
            assert pending_keys(keys, freqs, 2, request) == [9]
            want = sess.run(served, {dense_ids: request})
            path = str(tmp_path / "tf1")
            ge.export_saved_model(None, path, session=sess,
                                  inputs={"dense_ids": dense_ids},
                                  outputs={"score": served})
    got = serve(path, {"dense_ids": request}, "serving_default", tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(np.unique(np.round(want, 6))) > 8
