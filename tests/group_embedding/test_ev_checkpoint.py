"""EmbeddingVariable checkpoints: tf.train.Checkpoint and v1 Saver save
keys, values, freqs, versions and every slot; training resumes
bit-for-bit; an interrupted save leaves the previous checkpoint readable.
"""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.embedding_variable.variable import EV_INIT_VAR_OPS
from group_embedding.ops import ev_storage

import ev_cases

DIM = 4


def _model(seed=0):
    """An EV with a CounterFilter, a plain table, a kernel, ge Adam."""
    option = ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=2),
        init_option=ge.InitializerOption(default_value_dim=5))
    ev = ev_cases.make_ev("ckpt_ev", DIM, seed=seed, ev_option=option)
    rng = np.random.default_rng(seed)
    table = tf.Variable(rng.normal(size=(6, DIM)).astype("f"))
    kernel = tf.Variable(rng.normal(size=(2 * DIM, 1)).astype("f"))
    return ev, table, kernel, ge.optimizers.Adam(0.05)


def _train(model, batches):
    ev, table, kernel, opt = model
    losses = []
    for batch, plain in batches:
        with tf.GradientTape() as tape:
            embs = ge.group_embedding_lookup_sparse([ev, table],
                                                    [batch, plain], "mean")
            loss = tf.reduce_mean(tf.square(
                tf.matmul(tf.concat(embs, 1), kernel) - 1.0))
        variables = [ev, table, kernel]
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(loss.numpy())
    return losses


def _batches(seed, n):
    rng = np.random.default_rng(seed)
    keys = np.arange(-20, 20) * 7919
    return [(ev_cases.random_batch(rng, keys=keys, cover_all=False),
             ev_cases.random_batch(rng, keys=np.arange(6), cover_all=False))
            for _ in range(n)]


def _state(model):
    ev, table, kernel, opt = model
    out = [x.numpy() for x in ev_storage.export(ev.handle, DIM)]
    order = np.argsort(out[0])
    snapshot = [out[0][order], out[1][order], out[2][order], out[3][order],
                out[6][order], out[4], out[5], out[7]]
    return snapshot + [table.numpy(), kernel.numpy(),
                       opt.iterations.numpy()]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_resume_is_bit_exact(tmp_path):
    model = _model()
    _train(model, _batches(0, 10))
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(ev=model[0], table=model[1], kernel=model[2],
                            opt=model[3]), str(tmp_path), max_to_keep=2)
    manager.save()
    saved = _state(model)
    more = _batches(1, 10)
    losses = _train(model, more)
    final = _state(model)

    fresh = _model(seed=7)  # other initial values: all must be restored
    ckpt = tf.train.Checkpoint(ev=fresh[0], table=fresh[1], kernel=fresh[2],
                               opt=fresh[3])
    ckpt.restore(manager.latest_checkpoint)
    restored = _state(fresh)
    _assert_same(restored[:8], saved[:8])
    assert len(saved[5]) == 2  # Adam's m and v stored with the keys
    assert fresh[0].size().numpy() == len(saved[0])
    np.testing.assert_array_equal(_train(fresh, more), losses)
    _assert_same(_state(fresh), final)


def test_restore_into_other_dim_fails(tmp_path):
    ev = ev_cases.make_ev("dims", DIM)
    ev.lookup_rows(tf.constant([1, 2], tf.int64))
    path = tf.train.Checkpoint(ev=ev).write(str(tmp_path / "c"))
    other = ev_cases.make_ev("dims", 2 * DIM)
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError),
                       match="dims"):
        tf.train.Checkpoint(ev=other).read(path).assert_consumed()


def test_eviction_runs_at_save(tmp_path):
    option = ge.EmbeddingVariableOption(
        evict_option=ge.L2WeightEvict(l2_weight_threshold=1e9))
    ev = ev_cases.make_ev("evict_save", DIM, ev_option=option)
    ev.lookup_rows(tf.constant([1, 2, 3], tf.int64))
    path = tf.train.Checkpoint(ev=ev).write(str(tmp_path / "c"))
    reader = tf.train.load_checkpoint(path)
    assert reader.get_tensor("ev/.ATTRIBUTES/keys").size == 0
    assert int(ev.size()) == 0


_KILLED_SAVE = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import group_embedding as ge
    ev = ge.get_embedding_variable("killed", 64)
    ev.lookup_rows(tf.range(400000, dtype=tf.int64))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(ev=ev),
                                         sys.argv[1], max_to_keep=100)
    manager.save()
    print("saved", flush=True)
    while True:
        manager.save()
""")


def test_killed_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE,
                             str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ,
                                                TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        assert proc.stdout.readline().strip() == "saved"
        proc.send_signal(signal.SIGKILL)  # in the middle of a later save
    finally:
        proc.wait()
    ev = ge.get_embedding_variable("killed", 64)
    latest = tf.train.latest_checkpoint(str(tmp_path))
    tf.train.Checkpoint(ev=ev).restore(latest).assert_consumed()
    assert int(ev.size()) == 400000


def _run_steps(sess, train, loss, ids, batches):
    return [sess.run([train, loss], dict(zip(ids, b)))[1] for b in batches]


def _sorted(export):
    keys, values, freqs, versions, names, inits, slots, step = export
    order = np.argsort(keys)
    return [keys[order], values[order], freqs[order], versions[order],
            names, inits, slots[order], step]


def test_saver_round_trip_in_graph_mode(tmp_path):
    # Two EVs of different dims: each must get its own checkpoint keys
    # (the Saver names tensors by local name only, so bare `keys` of the
    # second EV would overwrite the first's).
    v1 = tf.compat.v1
    rng = np.random.default_rng(0)
    batches = [(rng.integers(-50, 50, size=(8, 3)),
                rng.integers(1000, 1020, size=(8, 2))) for _ in range(6)]

    def build():
        evs = [ev_cases.make_ev("saver_user", DIM),
               ev_cases.make_ev("saver_item", DIM + 2, seed=1)]
        ids = [v1.placeholder(tf.int64, [None, 3]),
               v1.placeholder(tf.int64, [None, 2])]
        embs = ge.group_embedding_lookup(evs, ids)
        loss = tf.add_n([tf.reduce_sum(tf.square(e - 0.5)) for e in embs])
        step = v1.train.create_global_step()
        train = ge.train.AdagradOptimizer(0.1).minimize(loss,
                                                        global_step=step)
        return evs, ids, loss, train

    def exports(sess, evs):
        return [_sorted(sess.run(ev_storage.export(ev.handle,
                                                   ev.embedding_dim)))
                for ev in evs]

    with tf.Graph().as_default():
        evs, ids, loss, train = build()
        saver = v1.train.Saver()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            _run_steps(sess, train, loss, ids, batches[:3])
            path = saver.save(sess, str(tmp_path / "model"))
            want = _run_steps(sess, train, loss, ids, batches[3:])
            final = exports(sess, evs)
    names = dict(tf.train.list_variables(path))
    for name, dim in (("saver_user", DIM), ("saver_item", DIM + 2)):
        for part in ("keys", "values", "freqs", "versions", "slots"):
            assert f"{name}-{part}" in names
        assert names[f"{name}-values"][1] == dim
    assert "keys" not in names
    with tf.Graph().as_default():
        evs, ids, loss, train = build()
        saver = v1.train.Saver()
        with v1.Session() as sess:
            saver.restore(sess, path)
            got = _run_steps(sess, train, loss, ids, batches[3:])
            again = exports(sess, evs)
    np.testing.assert_array_equal(got, want)
    for ev_final, ev_again in zip(final, again):
        for a, b in zip(ev_final, ev_again):
            np.testing.assert_array_equal(a, b)


def test_checkpoint_keeps_two_evs_apart(tmp_path):
    evs = [ev_cases.make_ev("ckpt_user", DIM),
           ev_cases.make_ev("ckpt_item", DIM, seed=1)]
    for ev, keys in zip(evs, ([[1, 2], [3]], [[-5], [2**62]])):
        ge.group_embedding_lookup_sparse(
            [ev], [tf.ragged.constant(keys, tf.int64)], "sum")
    want = [_sorted([x.numpy() for x in ev_storage.export(ev.handle, DIM)])
            for ev in evs]
    path = tf.train.Checkpoint(user=evs[0], item=evs[1]).save(
        str(tmp_path / "ckpt"))
    fresh = [ev_cases.make_ev("ckpt_user", DIM),
             ev_cases.make_ev("ckpt_item", DIM, seed=1)]
    tf.train.Checkpoint(user=fresh[0], item=fresh[1]).restore(
        path).assert_existing_objects_matched()
    for ev, ev_want in zip(fresh, want):
        got = _sorted([x.numpy() for x in ev_storage.export(ev.handle, DIM)])
        for a, b in zip(got, ev_want):
            np.testing.assert_array_equal(a, b)


# --- issue 9 bugs: double draw, Saver(var_list), MetaGraph ---------------


def _seeded_ev_and_variable():
    """An EV and a plain [8, 3] variable with the same seeded glorot
    initializer (DeepRec's testEVInitializer setup)."""
    v1 = tf.compat.v1
    var = v1.get_variable("plain", shape=[8, 3],
                          initializer=v1.glorot_uniform_initializer(seed=1))
    ev = ge.get_embedding_variable(
        "seeded_ev", 3, initializer=v1.glorot_uniform_initializer(seed=1),
        ev_option=ge.EmbeddingVariableOption(
            init_option=ge.InitializerOption(default_value_dim=8)))
    return ev, var


def test_default_values_drawn_once_by_both_init_ops():
    """Running the EV init collection, then the global initializer (and
    it again), leaves the default matrix equal to a stock variable whose
    initializer ran once with the same seed, and never redraws it."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        ev, var = _seeded_ev_and_variable()
        with v1.Session() as sess:
            sess.run(v1.get_collection(EV_INIT_VAR_OPS))
            first = sess.run(ev.default_values)
            sess.run(v1.global_variables_initializer())
            # The plain variable has been drawn once, by this run.
            np.testing.assert_array_equal(first, sess.run(var))
            sess.run(v1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(ev.default_values), first)


def _saved_graph(tmp_path, var_list):
    """Trains nothing: initialises an EV, looks up 3 keys, saves with a
    Saver given `var_list` "list" ([ev]), "dict" ({key: ev}) or None;
    returns (path, rows, default matrix)."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        ev, _ = _seeded_ev_and_variable()
        rows = ev.lookup_rows(tf.constant([1, 2, 9], tf.int64))
        saver = v1.train.Saver(
            {"list": [ev], "dict": {"any_key": ev}, None: None}[var_list])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            want = sess.run(rows)
            defaults = sess.run(ev.default_values)
            path = saver.save(sess, str(tmp_path / "model.ckpt"))
    return path, want, defaults


@pytest.mark.parametrize("save_var_list", ["list", "dict", None])
def test_saver_var_list_restores_default_values(tmp_path, save_var_list):
    """`Saver(var_list=[ev])` saves and restores the default matrix
    under the key the default Saver uses (`<name>/default_values`), so a
    restored EV reads its saved rows and its saved defaults; each Saver
    reads the other's checkpoint, and the dict form writes the same
    keys."""
    v1 = tf.compat.v1
    path, want, defaults = _saved_graph(tmp_path, save_var_list)
    names = dict(tf.train.list_variables(path))
    assert names["seeded_ev/default_values"] == [8, 3]
    with tf.Graph().as_default():
        ev = ge.get_embedding_variable("seeded_ev", 3)
        rows = ev.lookup_rows(tf.constant([1, 2, 9, 12], tf.int64))
        with v1.Session() as sess:
            v1.train.Saver(var_list=[ev]).restore(sess, path)
            got = sess.run(rows)
            np.testing.assert_array_equal(sess.run(ev.default_values),
                                          defaults)
    np.testing.assert_array_equal(got[:3], want)
    # A new key starts from its default row (12 mod 8).
    np.testing.assert_array_equal(got[3], defaults[4])


def test_saver_default_saves_default_values_once(tmp_path):
    """The default Saver writes one `<name>/default_values` tensor and
    nothing else named after the default matrix."""
    path, _, _ = _saved_graph(tmp_path, var_list=None)
    names = [n for n, _ in tf.train.list_variables(path)
             if "default_values" in n]
    assert names == ["seeded_ev/default_values"]


def test_meta_graph_round_trip_restores_saved_values(tmp_path):
    """export_meta_graph + import_meta_graph of a graph holding an EV:
    the imported Saver restores the saved rows, the imported
    SAVEABLE_OBJECTS hold an EV again, and a new default Saver built on
    the imported graph restores as well (oracle: the rows fetched before
    saving)."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        ev, _ = _seeded_ev_and_variable()
        rows = tf.identity(ev.lookup_rows(tf.constant([1, 2, 9], tf.int64)),
                           name="rows")
        saver = v1.train.Saver()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            want = sess.run(rows)
            path = saver.save(sess, str(tmp_path / "model.ckpt"))
        meta = v1.train.export_meta_graph(saver_def=saver.as_saver_def())
    with tf.Graph().as_default():
        imported = v1.train.import_meta_graph(meta)
        (restored_ev,) = v1.get_collection(v1.GraphKeys.SAVEABLE_OBJECTS)
        assert isinstance(restored_ev, ge.EmbeddingVariable)
        assert restored_ev.name == "seeded_ev"
        fresh = v1.train.Saver()
        with v1.Session() as sess:
            imported.restore(sess, path)
            np.testing.assert_array_equal(sess.run("rows:0"), want)
        with v1.Session() as sess:
            fresh.restore(sess, path)
            np.testing.assert_array_equal(sess.run("rows:0"), want)
            keys, _, _, _ = sess.run(restored_ev.export())
    assert sorted(keys) == [1, 2, 9]


def test_table_only_checkpoint_restores_with_fallback(tmp_path):
    """A checkpoint without `<name>/default_values` (what
    `Saver(var_list=[ev])` wrote before it saved them): `Saver([ev])`
    fails naming the missing key, `Saver([ev.table_only()])` restores the
    table and keeps the current default matrix."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        ev, _ = _seeded_ev_and_variable()
        rows = ev.lookup_rows(tf.constant([1, 2, 9], tf.int64))
        saver = v1.train.Saver([ev.table_only()])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            want = sess.run(rows)
            path = saver.save(sess, str(tmp_path / "model.ckpt"))
    assert "seeded_ev/default_values" not in dict(
        tf.train.list_variables(path))
    with tf.Graph().as_default():
        ev, _ = _seeded_ev_and_variable()
        rows = ev.lookup_rows(tf.constant([1, 2, 9, 12], tf.int64))
        with v1.Session() as sess:
            with pytest.raises(tf.errors.NotFoundError,
                               match="seeded_ev/default_values"):
                v1.train.Saver([ev]).restore(sess, path)
        with v1.Session() as sess:
            sess.run(ev.default_values.initializer)
            current = sess.run(ev.default_values)
            v1.train.Saver([ev.table_only()]).restore(sess, path)
            got = sess.run(rows)
            np.testing.assert_array_equal(sess.run(ev.default_values),
                                          current)
    np.testing.assert_array_equal(got[:3], want)
    np.testing.assert_array_equal(got[3], current[4])
