"""What `ge.restore_tables` refuses, and what `ge.save_tables` makes durable.

A checkpoint is saved, then one field of a shard file or of the manifest
is rewritten (the manifest's size and checksum kept consistent, so only
the check under test can catch it). The oracle is the error message: it
must name the table, the file and what is wrong (issue 25.7).
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.distributed import checkpoint as checkpoint_lib

VOCAB = 4
DIM = 3


def _saved(directory):
    """A one-worker checkpoint of a dense table `dense`; its folder."""
    table = tf.Variable(np.arange(VOCAB * DIM, dtype="f").reshape(VOCAB, DIM))
    return ge.save_tables(directory, {"dense": table}, step=1)


def _restore(path):
    ge.restore_tables(path, {"dense": tf.Variable(np.zeros((VOCAB, DIM),
                                                           "f"))})


def _rewrite_shard(path, name, key, value):
    """Replaces array `key` of shard file `name`, manifest updated."""
    file = os.path.join(path, name)
    arrays = dict(np.load(file))
    arrays[key] = value
    with open(file, "wb") as f:
        np.savez(f, **arrays)
    _edit_manifest(path, lambda m: m["shards"][name].update(
        bytes=os.path.getsize(file), sha256=checkpoint_lib._sha256(file)))


def _edit_manifest(path, edit):
    file = os.path.join(path, checkpoint_lib.MANIFEST)
    with open(file) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(file, "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize("bad", [-1, VOCAB, 2**63 - 1])
def test_saved_row_outside_the_table_fails(tmp_path, bad):
    # -1 was restored silently into the last row (numpy wraps).
    path = _saved(str(tmp_path))
    _rewrite_shard(path, "shard-0-of-1.npz", "dense/rows",
                   np.array([0, 1, 2, bad], np.int64))
    with pytest.raises(ValueError, match=(
            rf"Table 'dense': shard file shard-0-of-1.npz of checkpoint "
            rf".* holds row {bad}, outside the table's \[0, {VOCAB}\)")):
        _restore(path)


def test_saved_rows_and_values_of_different_lengths_fail(tmp_path):
    path = _saved(str(tmp_path))
    _rewrite_shard(path, "shard-0-of-1.npz", "dense/rows",
                   np.array([0, 1, 2], np.int64))
    with pytest.raises(ValueError, match=(
            r"Table 'dense': shard file shard-0-of-1.npz of checkpoint .* "
            r"holds 3 row ids for 4 rows of values")):
        _restore(path)


def _count_shard_names(monkeypatch, limit):
    """Fails the test once more than `limit` shard names are built: a
    restore must refuse a bad shard count before anything per shard."""
    calls = [0]
    real = checkpoint_lib._shard_name

    def counted(rank, size):
        calls[0] += 1
        if calls[0] > limit:
            raise AssertionError(f"built {calls[0]} shard names for "
                                 f"num_shards={size}")
        return real(rank, size)

    monkeypatch.setattr(checkpoint_lib, "_shard_name", counted)


@pytest.mark.parametrize("num_shards, message", [
    (10**9, r"num_shards is 1000000000 but it lists 1 shard"),
    (2, r"num_shards is 2 but it lists 1 shard"),
    (0, r"num_shards must be a positive integer, got 0"),
    (-3, r"num_shards must be a positive integer, got -3"),
    ("1", r"num_shards must be a positive integer, got '1'"),
    (True, r"num_shards must be a positive integer, got True"),
])
def test_manifest_shard_count_mismatch_fails_first(tmp_path, monkeypatch,
                                                   num_shards, message):
    # 10**9 once built 10**9 shard names (memory) before any check.
    path = _saved(str(tmp_path))
    _edit_manifest(path, lambda m: m.update(num_shards=num_shards))
    _count_shard_names(monkeypatch, limit=10)
    with pytest.raises(ValueError, match=(
            rf"Checkpoint .*: {checkpoint_lib.MANIFEST} is invalid: "
            rf"{message}")):
        _restore(path)


def test_checkpoint_directory_is_fsynced_after_the_renames(tmp_path,
                                                            monkeypatch):
    # Without it a power loss after the save can lose the renames that
    # `latest` depends on.
    events = []
    opened = {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def recording_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = os.path.abspath(path)
        return fd

    def recording_fsync(fd):
        events.append(("fsync", opened.get(fd)))
        return real_fsync(fd)

    def recording_replace(src, dst, *args, **kwargs):
        events.append(("replace", os.path.abspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    directory = os.path.abspath(str(tmp_path))
    final = _saved(directory)
    latest = os.path.join(directory, checkpoint_lib.LATEST)
    for renamed in (os.path.abspath(final), latest):
        at = events.index(("replace", renamed))
        assert ("fsync", directory) in events[at + 1:], (renamed, events)
    # The manifest's rename inside the checkpoint folder is durable too.
    manifest = os.path.join(final + checkpoint_lib._PARTIAL,
                            checkpoint_lib.MANIFEST)
    at = events.index(("replace", os.path.abspath(manifest)))
    assert ("fsync", os.path.abspath(final + checkpoint_lib._PARTIAL)) in \
        events[at + 1:events.index(("replace", os.path.abspath(final)))]
