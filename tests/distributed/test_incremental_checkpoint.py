"""Incremental checkpoints (`ge.save_tables(..., full_every=K)`, issue 26.2).

Oracles: a full save (`ge.save_tables` without `full_every`) of the same
state at the same step, restored into a fresh EV, and the live EV's own
export; both compared bitwise (keys, values, every slot, freq, version,
step, default matrix). A delta's keys are compared with the keys the
test itself touched or saw evicted.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from collective_incremental import state

import group_embedding as ge
from group_embedding.distributed import checkpoint as checkpoint_lib
from group_embedding.ops import config
from group_embedding.ops import ev_storage

DIM = 4
SLOT = "adagrad/accumulator"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _make(name, option=None):
    ev = ge.get_embedding_variable(name, DIM, ev_option=option)
    ev.ensure_slot(SLOT, 0.1)
    return ev


def _state(ev):
    """The EV's content sorted by key, and its per-variable fields."""
    return {**state(ev), "default_values": ev.default_values.numpy()}


def _assert_same(got, want):
    assert set(got) == set(want)
    for field in want:
        np.testing.assert_array_equal(got[field], want[field], err_msg=field)


def _restored(path, option=None, name="fresh"):
    ev = _make(name, option)
    ev.lookup_rows(tf.constant([-5, 123456], tf.int64))  # to be replaced
    ge.restore_tables(path, {"t": ev})
    return _state(ev)


def _manifest(path):
    with open(os.path.join(path, checkpoint_lib.MANIFEST)) as f:
        return json.load(f)


def _shard(path):
    return dict(np.load(os.path.join(path, "shard-0-of-1.npz")))


def _train(ev, rng, step, lookups, updates):
    """Looks up `lookups` (inserting, counting) and applies an Adagrad
    step to `updates` at global step `step`."""
    ev.lookup_rows(tf.constant(lookups, tf.int64))
    grad = rng.standard_normal((len(updates), DIM)).astype("f")
    ev_storage.apply_adagrad(ev.handle, tf.constant(updates, tf.int64),
                             grad, step, 0.3, 1e-7, SLOT)


CASES = {
    "plain": None,
    "global_step_evict": ge.EmbeddingVariableOption(
        evict_option=ge.GlobalStepEvict(steps_to_live=2)),
    "l2_evict": ge.EmbeddingVariableOption(
        evict_option=ge.L2WeightEvict(l2_weight_threshold=0.35)),
    "counter_filter": ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_delta_restores_what_a_full_save_restores(tmp_path, case):
    option = CASES[case]
    rng = np.random.default_rng(1)
    ev = _make(f"ev_{case}", option)
    incremental, full = str(tmp_path / "inc"), str(tmp_path / "full")
    pool = np.concatenate([rng.integers(-2**62, 2**62, 300), [0, -1]])
    kinds, removed_seen = [], 0
    for step in range(1, 9):
        before = set(_state(ev)["keys"].tolist())
        lookups = rng.choice(pool, 40 if step > 1 else 250)
        # Updates of keys not looked up since the last save too: the
        # optimizer's writes must reach the delta on their own.
        updates = np.unique(np.concatenate([rng.choice(lookups, 10),
                                            rng.choice(pool, 10)]))
        _train(ev, rng, step, lookups, updates)
        path = ge.save_tables(incremental, {"t": ev}, step, full_every=4)
        want_path = ge.save_tables(full, {"t": ev}, step)
        live = _state(ev)
        manifest = _manifest(path)
        kinds.append(manifest["kind"])
        if manifest["kind"] == "delta":
            saved = _shard(path)
            touched = (set(lookups.tolist()) | set(updates.tolist())) & \
                set(live["keys"].tolist())
            # Exactly the keys written since the previous save...
            assert set(saved["t/keys"].tolist()) == touched
            # ...and the keys gone since, evicted or never re-admitted.
            gone = (before | set(lookups.tolist())) - set(
                live["keys"].tolist())
            if case == "plain":
                assert set(updates.tolist()) - set(lookups.tolist()) & \
                    set(saved["t/keys"].tolist()), "no update-only key"
            assert set(saved["t/removed"].tolist()) == gone
            removed_seen += len(gone)
        got = _restored(path, option, f"inc_{case}_{step}")
        _assert_same(got, _restored(want_path, option,
                                    f"full_{case}_{step}"))
        _assert_same(got, live)
    assert kinds == ["full", "delta", "delta", "delta"] * 2
    if "evict" in case:
        assert removed_seen > 0, "no eviction reached a delta"


def test_delta_holds_only_the_changed_keys(tmp_path):
    ev = _make("small_delta")
    ev.lookup_rows(tf.constant(np.arange(10000), tf.int64))
    first = ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=10)
    ev.lookup_rows(tf.constant([5, 10**15], tf.int64))
    ev_storage.apply_adagrad(ev.handle, tf.constant([7], tf.int64),
                             tf.ones([1, DIM]), 2, 0.1, 1e-7, SLOT)
    second = ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=10)
    saved = _shard(second)
    assert sorted(saved["t/keys"].tolist()) == [5, 7, 10**15]
    assert saved["t/slots"].shape == (3, DIM)
    assert _manifest(second)["parent"] == os.path.basename(first)
    # Nothing changed: an empty delta, restoring the same state.
    third = ge.save_tables(str(tmp_path), {"t": ev}, 3, full_every=10)
    assert _shard(third)["t/keys"].size == 0
    _assert_same(_restored(third), _state(ev))


def test_failed_delta_loses_no_changes(tmp_path, monkeypatch):
    ev = _make("failing")
    ev.lookup_rows(tf.constant(np.arange(50), tf.int64))
    first = ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    ev.lookup_rows(tf.constant([1, 2, 500], tf.int64))
    real = np.savez

    def full_disk(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(RuntimeError, match="disk full"):
        ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    monkeypatch.setattr(np, "savez", real)
    assert checkpoint_lib.latest_checkpoint(str(tmp_path)) == first
    ev.lookup_rows(tf.constant([3], tf.int64))
    second = ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    assert _manifest(second)["kind"] == "delta"
    # The failed save's keys are in the next delta.
    assert sorted(_shard(second)["t/keys"].tolist()) == [1, 2, 3, 500]
    _assert_same(_restored(second), _state(ev))


def test_restore_then_continue_with_deltas(tmp_path):
    ev = _make("before_restart")
    ev.lookup_rows(tf.constant(np.arange(100), tf.int64))
    ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    ev.lookup_rows(tf.constant([7, 1000], tf.int64))
    delta = ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    # A new EV (a restarted process) restores the chain and goes on.
    again = _make("after_restart")
    ge.restore_tables(str(tmp_path), {"t": again})
    again.lookup_rows(tf.constant([8, 2000], tf.int64))
    third = ge.save_tables(str(tmp_path), {"t": again}, 3, full_every=5)
    manifest = _manifest(third)
    assert manifest["kind"] == "delta" and manifest["depth"] == 2
    assert manifest["parent"] == os.path.basename(delta)
    assert sorted(_shard(third)["t/keys"].tolist()) == [8, 2000]
    _assert_same(_restored(third), _state(again))


def test_new_slot_or_other_tables_save_in_full(tmp_path):
    ev = _make("slots")
    ev.lookup_rows(tf.constant(np.arange(20), tf.int64))
    ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    ev.ensure_slot("adam/m", 0.0)
    second = ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    assert _manifest(second)["kind"] == "full"
    other = _make("other")
    third = ge.save_tables(str(tmp_path), {"t": ev, "u": other}, 3,
                           full_every=5)
    assert _manifest(third)["kind"] == "full"


@pytest.mark.parametrize("storage", ["dram", "hbm"])
def test_a_restore_that_keeps_a_newer_slot_saves_in_full_next(
        tmp_path, monkeypatch, storage):
    """A restore into an EV holding a slot the checkpoint lacks (built
    after that save) keeps the slot, so the EV no longer holds the
    checkpoint's content: the next save is full, and it restores what was
    saved. Before, it was a delta adding a slot column its base lacks,
    which `restore_tables` refused: that checkpoint was lost."""
    monkeypatch.setenv(config.HBM_ON_HOST, "1")
    option = None if storage == "dram" else ge.EmbeddingVariableOption(
        storage_option=ge.StorageOption(ge.StorageType.HBM,
                                        storage_size=[1 << 20]))
    ev = _make(f"kept_slot_{storage}", option)
    ev.lookup_rows(tf.constant(np.arange(20), tf.int64))
    ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    ev.ensure_slot("adam/m", 0.0)
    ge.restore_tables(str(tmp_path), {"t": ev})
    ev.lookup_rows(tf.constant([3, 500], tf.int64))
    second = ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    assert _manifest(second)["kind"] == "full"
    _assert_same(_restored(second, option, name=f"kept_{storage}_into"),
                 _state(ev))
    # Its slots match now: the save after it is a delta again.
    ev.lookup_rows(tf.constant([4], tf.int64))
    third = ge.save_tables(str(tmp_path), {"t": ev}, 3, full_every=5)
    assert _manifest(third)["kind"] == "delta"
    _assert_same(_restored(third, option, name=f"kept_{storage}_again"),
                 _state(ev))


def test_same_step_again_keeps_the_checkpoint_it_extends(tmp_path):
    ev = _make("same_step")
    ev.lookup_rows(tf.constant(np.arange(20), tf.int64))
    first = ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    ev.lookup_rows(tf.constant([99], tf.int64))
    second = ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    # A save of a step deletes older folders of that step, not its parent.
    assert os.path.isdir(first)
    _assert_same(_restored(second), _state(ev))


def test_dense_tables_in_every_delta(tmp_path):
    ev = _make("with_dense")
    dense = tf.Variable(np.arange(12, dtype="f").reshape(4, 3))
    ev.lookup_rows(tf.constant([1, 2], tf.int64))
    ge.save_tables(str(tmp_path), {"t": ev, "d": dense}, 1, full_every=3)
    dense.assign_add(tf.ones([4, 3]))
    path = ge.save_tables(str(tmp_path), {"t": ev, "d": dense}, 2,
                          full_every=3)
    assert _manifest(path)["kind"] == "delta"
    fresh, ev2 = tf.Variable(tf.zeros([4, 3])), _make("with_dense2")
    ge.restore_tables(path, {"t": ev2, "d": fresh})
    np.testing.assert_array_equal(fresh.numpy(), dense.numpy())


@pytest.mark.parametrize("bad", ["bad_full_every", "zero"])
def test_full_every_must_be_a_positive_integer(tmp_path, bad):
    ev = _make(f"fe_{bad}")
    value = {"bad_full_every": 2.5, "zero": 0}[bad]
    with pytest.raises(ValueError, match="full_every"):
        ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=value)


def _chain(tmp_path, name):
    """A full save and two deltas; returns their paths."""
    ev = _make(name)
    ev.lookup_rows(tf.constant(np.arange(30), tf.int64))
    paths = [ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)]
    for step in (2, 3):
        ev.lookup_rows(tf.constant([step, 100 + step], tf.int64))
        paths.append(ge.save_tables(str(tmp_path), {"t": ev}, step,
                                    full_every=5))
    return paths


def _rewrite(path, edit):
    file = os.path.join(path, "shard-0-of-1.npz")
    arrays = dict(np.load(file))
    edit(arrays)
    with open(file, "wb") as f:
        np.savez(f, **arrays)
    manifest = _manifest(path)
    manifest["shards"]["shard-0-of-1.npz"].update(
        bytes=os.path.getsize(file), sha256=checkpoint_lib._sha256(file))
    with open(os.path.join(path, checkpoint_lib.MANIFEST), "w") as f:
        json.dump(manifest, f)


def test_missing_full_save_is_named(tmp_path):
    full, _, last = _chain(tmp_path, "no_full")
    shutil.rmtree(full)
    with pytest.raises(ValueError, match=(
            f"delta of {os.path.basename(full)}, which is missing")):
        _restored(last)


def test_missing_delta_shard_is_named(tmp_path):
    _, middle, last = _chain(tmp_path, "no_shard")
    os.remove(os.path.join(middle, "shard-0-of-1.npz"))
    with pytest.raises(ValueError, match=(
            f"{middle}: shard file shard-0-of-1.npz is missing")):
        _restored(last)


def test_corrupted_delta_is_named(tmp_path):
    _, middle, last = _chain(tmp_path, "corrupt")
    file = os.path.join(middle, "shard-0-of-1.npz")
    with open(file, "r+b") as f:
        f.seek(200)
        f.write(b"\xff\xfe")
    with pytest.raises(ValueError, match=(
            f"{middle}: shard file shard-0-of-1.npz is corrupted")):
        _restored(last)


def test_replaced_parent_is_refused(tmp_path):
    _, middle, last = _chain(tmp_path, "replaced")
    _rewrite(middle, lambda a: None)  # same arrays, another manifest
    with pytest.raises(ValueError, match=(
            f"delta of {os.path.basename(middle)}, but .* is not the one "
            "it extended")):
        _restored(last)


@pytest.mark.parametrize("edit,message", [
    (lambda a: a.update({"t/values": a["t/values"][:1]}),
     "'values' holds 1 rows for 2 keys"),
    (lambda a: a.update({"t/slots": np.zeros((2, 3 * DIM), "f")}),
     "'slots' rows have shape"),
    (lambda a: a.update({"t/removed": a["t/keys"][:1]}),
     "a key is listed twice"),
    (lambda a: a.pop("t/removed"), "the delta lacks 't/removed'"),
    (lambda a: a.update({"t/slot_names": np.asarray(["other"])}),
     "optimizer slots"),
])
def test_inconsistent_delta_file_is_named(tmp_path, edit, message):
    _, _, last = _chain(tmp_path, "inconsistent")
    _rewrite(last, edit)
    with pytest.raises(ValueError, match=(
            f"EmbeddingVariable 't': delta file shard-0-of-1.npz of "
            f"checkpoint {last}: .*{message}")):
        _restored(last)


@pytest.mark.parametrize("where", ["shard", "latest"])
def test_killed_writer_leaves_the_last_good_state(tmp_path, where):
    script = os.path.join(_HERE, "incremental_kill.py")
    result = subprocess.run(
        [sys.executable, script, "--dir", str(tmp_path), "--kill", where],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == -9, result.stdout + result.stderr[-3000:]
    assert "saved the last good delta" in result.stdout
    good = np.load(str(tmp_path / "good.npz"))
    latest = checkpoint_lib.latest_checkpoint(str(tmp_path))
    assert os.path.basename(latest) == str(good["checkpoint"])
    assert _manifest(latest)["kind"] == "delta"
    # The killed save left its unfinished folder behind.
    assert any(n.endswith(".partial") for n in os.listdir(tmp_path)) or \
        where == "latest"
    ev = ge.get_embedding_variable("tags", DIM)
    ev.ensure_slot(SLOT, 0.1)
    ge.restore_tables(str(tmp_path), {"t": ev})
    state = _state(ev)
    for field in ("keys", "values", "freqs", "versions", "slots"):
        np.testing.assert_array_equal(state[field], good[field],
                                      err_msg=field)
    # And the chain goes on from there.
    ev.lookup_rows(tf.constant([424242], tf.int64))
    path = ge.save_tables(str(tmp_path), {"t": ev}, 9, full_every=10)
    assert _manifest(path)["kind"] == "delta"
    _assert_same(_restored(path, name="after_kill"), _state(ev))


@pytest.mark.parametrize("field,value,message", [
    ("parent", "../elsewhere", "not a checkpoint folder of the same"),
    ("parent", None, "not a checkpoint folder of the same"),
    ("depth", 0, "without a valid depth"),
    ("depth", 7, "does not follow"),
    ("kind", "partial", "expected 'full' or 'delta'"),
])
def test_invalid_delta_manifest_is_named(tmp_path, field, value, message):
    _, _, last = _chain(tmp_path, f"manifest_{field}_{value}")
    manifest = _manifest(last)
    manifest[field] = value
    with open(os.path.join(last, checkpoint_lib.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match=f"Checkpoint {last}.*{message}"):
        _restored(last)
