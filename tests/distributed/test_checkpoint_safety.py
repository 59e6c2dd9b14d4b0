"""Safety of `ge.save_tables` / `ge.restore_tables` and EV restores.

A crash at any point of a save keeps `latest` restorable; a restore checks
the manifest (shard count, presence, size, checksum); a failed save's
leftovers are never adopted; an int32 EV refuses keys it cannot address.
The oracle is the tables' own content before the save.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import model_parallel
from group_embedding.distributed import checkpoint as checkpoint_lib

from tests.group_embedding import ev_cases

DIM = 3
KEYS = np.array([-9, -4, 0, 1, 6, 2**40 + 3, 2**40 + 8], np.int64)


def _ev(keys=KEYS, name="t_ev", seed=0, **kwargs):
    """An EV holding `keys` (initial values)."""
    ev = ev_cases.make_ev(name, DIM, seed=seed, **kwargs)
    if len(keys):
        ev.lookup_rows(tf.constant(keys, dtype=ev.key_dtype))
    return ev


def _content(ev):
    """(keys, values, freqs) sorted by key: what a restore must give."""
    keys, values, _, freqs = (x.numpy() for x in ev.export())
    order = np.argsort(keys)
    return keys[order], values[order], freqs[order]


def _assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _restored(path, name="t_ev", seed=9):
    """A fresh EV (other default values) restored from `path`."""
    ev = _ev(keys=[], name=name, seed=seed)
    table = tf.Variable(np.zeros((4, DIM), "f"))
    ge.restore_tables(path, {name: ev, "dense": table})
    return _content(ev), table.numpy()


def _train(ev, table):
    """One SGD step: changes every stored value."""
    with tf.GradientTape() as tape:
        rows = ev.lookup_rows(tf.constant(KEYS), training=False)
        loss = tf.reduce_sum(tf.square(rows - 3.0)) + tf.reduce_sum(table)
    ge.optimizers.SGD(0.1).apply_gradients(
        zip(tape.gradient(loss, [ev, table]), [ev, table]))


class _Crash(Exception):
    pass


def _crash_on_call(monkeypatch, n):
    """Makes the n-th filesystem mutation (rename, replace, remove, also
    inside shutil.rmtree) raise, as if the process died there."""
    count = [0]

    def wrap(function):
        def crashing(*args, **kwargs):
            count[0] += 1
            if count[0] == n:
                raise _Crash(f"simulated crash in {function.__name__}")
            return function(*args, **kwargs)
        return crashing

    for module, name in [(os, "replace"), (os, "rename"), (os, "remove"),
                         (os, "unlink"), (os, "rmdir"),
                         (shutil, "rmtree"), (shutil, "move")]:
        monkeypatch.setattr(module, name, wrap(getattr(module, name)))


def _save_as(monkeypatch, rank, size, directory, tables, step, token):
    """Runs `save_tables` as worker `rank` of `size` (same token)."""
    with monkeypatch.context() as m:
        m.setattr(model_parallel, "world", lambda: (rank, size))
        m.setattr(checkpoint_lib, "_save_token", lambda: token,
                  raising=False)
        return ge.save_tables(directory, tables, step)


def _two_worker_checkpoint(monkeypatch, directory):
    """A checkpoint written by two (simulated) workers: each holds the
    keys it owns (key mod 2), worker 0 the replicated table."""
    evs = [_ev(KEYS[np.mod(KEYS, 2) == r], seed=r) for r in range(2)]
    table = tf.Variable(np.arange(4 * DIM, dtype="f").reshape(4, DIM))
    for rank in (1, 0):  # worker 0 finishes the checkpoint
        path = _save_as(monkeypatch, rank, 2, directory,
                        {"t_ev": evs[rank], "dense": table}, 1, "abc")
    contents = [_content(ev) for ev in evs]
    want = tuple(np.concatenate([c[i] for c in contents]) for i in range(3))
    order = np.argsort(want[0])
    return path, tuple(w[order] for w in want), table.numpy()


def test_crash_while_resaving_a_step_keeps_latest_restorable(
        tmp_path, monkeypatch):
    ev = _ev()
    table = tf.Variable(np.ones((4, DIM), "f"))
    tables = {"t_ev": ev, "dense": table}
    ge.save_tables(str(tmp_path), tables, step=1)
    old = (_content(ev), table.numpy())
    _train(ev, table)
    new = (_content(ev), table.numpy())
    assert not np.allclose(old[0][1], new[0][1])
    crashes = 0
    for n in range(1, 100):
        try:
            with monkeypatch.context() as m:
                _crash_on_call(m, n)
                ge.save_tables(str(tmp_path), tables, step=1)
        except (_Crash, RuntimeError):
            crashes += 1
        else:
            break
        # Whatever the crash point, `latest` names a whole checkpoint:
        # the previous save or the new one.
        got = _restored(str(tmp_path))
        matches_old = np.array_equal(got[1], old[1])
        _assert_same(got[0], old[0] if matches_old else new[0])
        np.testing.assert_array_equal(got[1], (old if matches_old
                                               else new)[1])
    assert crashes >= 3, crashes
    got = _restored(str(tmp_path))
    _assert_same(got[0], new[0])
    np.testing.assert_array_equal(got[1], new[1])


def test_failed_save_keeps_previous_latest(tmp_path, monkeypatch):
    ev = _ev()
    table = tf.Variable(np.ones((4, DIM), "f"))
    first = ge.save_tables(str(tmp_path), {"t_ev": ev, "dense": table}, 1)
    with monkeypatch.context() as m:
        m.setattr(np, "savez", lambda *a, **k: (_ for _ in ()).throw(
            OSError("disk full (simulated)")))
        with pytest.raises(RuntimeError, match="disk full"):
            ge.save_tables(str(tmp_path), {"t_ev": ev, "dense": table}, 2)
    assert ge.latest_checkpoint(str(tmp_path)) == first


def test_restore_after_two_worker_save(tmp_path, monkeypatch):
    path, want, table = _two_worker_checkpoint(monkeypatch, str(tmp_path))
    got = _restored(str(tmp_path))
    _assert_same(got[0], want)
    np.testing.assert_array_equal(got[1], table)
    assert ge.latest_checkpoint(str(tmp_path)) == path


def test_missing_shard_fails(tmp_path, monkeypatch):
    path, _, _ = _two_worker_checkpoint(monkeypatch, str(tmp_path))
    os.remove(os.path.join(path, "shard-1-of-2.npz"))
    with pytest.raises(ValueError, match=r"shard-1-of-2.npz is missing"):
        _restored(str(tmp_path))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_fails(tmp_path, monkeypatch, damage):
    path, _, _ = _two_worker_checkpoint(monkeypatch, str(tmp_path))
    shard = os.path.join(path, "shard-0-of-2.npz")
    with open(shard, "rb") as f:
        data = bytearray(f.read())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        message = r"shard-0-of-2.npz is corrupted"
    else:
        data = data[:-10]
        message = r"shard-0-of-2.npz has \d+ bytes"
    with open(shard, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(ValueError, match=message):
        _restored(str(tmp_path))


def test_unfinished_checkpoint_fails(tmp_path, monkeypatch):
    ev = _ev()
    table = tf.Variable(np.ones((4, DIM), "f"))
    # Worker 1 of 2 finished its shard; worker 0 never did.
    path = _save_as(monkeypatch, 1, 2, str(tmp_path),
                    {"t_ev": ev, "dense": table}, 1, "def")
    with pytest.raises(ValueError, match=r"(no manifest|does not exist)"):
        _restored(path)


def test_failed_save_leftovers_are_not_adopted(tmp_path, monkeypatch):
    stale = _ev(np.array([2**41 + 1, 2**41 + 3], np.int64), seed=5)
    ev = _ev(KEYS[np.mod(KEYS, 2) == 0])
    table = tf.Variable(np.ones((4, DIM), "f"))
    # A two-worker save of step 1: worker 1 writes its shard, worker 0
    # fails, so the save fails.
    _save_as(monkeypatch, 1, 2, str(tmp_path),
             {"t_ev": stale, "dense": table}, 1, "0123")
    with monkeypatch.context() as m:
        m.setattr(np, "savez", lambda *a, **k: (_ for _ in ()).throw(
            OSError("disk full (simulated)")))
        with pytest.raises(RuntimeError):
            _save_as(m, 0, 2, str(tmp_path),
                     {"t_ev": ev, "dense": table}, 1, "0123")
    # Step 1 saved again by one worker: only its keys come back.
    ge.save_tables(str(tmp_path), {"t_ev": ev, "dense": table}, 1)
    got = _restored(str(tmp_path))
    _assert_same(got[0], _content(ev))
    np.testing.assert_array_equal(got[1], table.numpy())


def _int64_ev_with_wide_keys():
    return _ev(np.array([5, 2**40 + 3, -2**35], np.int64), name="wide")


def test_restore_tables_int64_keys_into_int32_ev_fails(tmp_path):
    ge.save_tables(str(tmp_path), {"wide": _int64_ev_with_wide_keys()}, 1)
    narrow = _ev(keys=[], name="wide", key_dtype=tf.int32)
    with pytest.raises(ValueError, match=r"'wide'.*outside the int32 range"
                                         r".*2 such keys"):
        ge.restore_tables(str(tmp_path), {"wide": narrow})


def test_restore_tables_int32_range_keys_into_int32_ev(tmp_path):
    wide = _ev(np.array([5, -7, 2**31 - 1], np.int64), name="wide")
    ge.save_tables(str(tmp_path), {"wide": wide}, 1)
    narrow = _ev(keys=[], name="wide", seed=3, key_dtype=tf.int32)
    ge.restore_tables(str(tmp_path), {"wide": narrow})
    _assert_same(_content(narrow), _content(wide))


def test_checkpoint_int64_keys_into_int32_ev_fails(tmp_path):
    path = tf.train.Checkpoint(ev=_int64_ev_with_wide_keys()).write(
        str(tmp_path / "ckpt"))
    narrow = _ev(keys=[], name="wide", key_dtype=tf.int32)
    with pytest.raises(ValueError, match=r"'wide'.*outside the int32 range"):
        tf.train.Checkpoint(ev=narrow).read(path).assert_consumed()


def test_saver_int64_keys_into_int32_ev_fails(tmp_path):
    prefix = str(tmp_path / "model")
    with tf.Graph().as_default():
        _int64_ev_with_wide_keys_graph(tf.int64, 2**40 + 3)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(tf.compat.v1.get_collection("insert"))
            saver.save(sess, prefix)
    with tf.Graph().as_default():
        _int64_ev_with_wide_keys_graph(tf.int32, None)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"wide.*outside the int32 range"):
                saver.restore(sess, prefix)


def _int64_ev_with_wide_keys_graph(key_dtype, key):
    ev = ev_cases.make_ev("wide", DIM, key_dtype=key_dtype)
    if key is not None:
        tf.compat.v1.add_to_collection(
            "insert", ev.lookup_rows(tf.constant([5, key], key_dtype)))
    return ev
