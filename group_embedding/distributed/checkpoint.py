"""Checkpoints of embedding tables that restore at another worker count.

Each worker writes only what it owns: the rows of its shards (with their
global ids), its EmbeddingVariables' keys with values, frequencies,
versions and optimizer slots, and (worker 0 only) replicated tables. A
restore at M workers reads every shard file and keeps what it owns under
the new layout, so N -> M works for any N and M (1 included), and for
any placement: a table-wise table (`table:R`) is written whole by its
owner and restored onto whichever worker owns it at M (or replicated).

A save is all-or-nothing and never touches the checkpoint `latest` names:

1. every save starts from an empty folder with a fresh name,
   `ckpt-STEP-TOKEN.partial/` (TOKEN is random, agreed by all workers), so
   the shard files of an earlier failed save are never adopted;
2. each worker writes `shard-RANK-of-SIZE.npz` there;
3. once every worker has written its file, worker 0 writes
   `manifest.json` (shard count, size and SHA-256 of every shard) LAST,
   renames the folder to `ckpt-STEP-TOKEN`, repoints `latest` (atomic
   renames, each followed by an fsync of the directory so that it
   survives a power loss), and only then deletes older checkpoints of the
   same step.

A crash at any point leaves `latest` naming a complete checkpoint (the
previous one, or the new one). `restore_tables` refuses a folder without
a manifest, a manifest whose shard count is not a positive integer or
differs from the shards it lists (checked before anything is built per
shard), a missing, extra-sized or corrupted shard file, a shard written
at another worker count than the manifest says, and saved row ids
outside the table (naming the table and the file). The
folder must be visible to all workers (a shared filesystem when they run
on several hosts).

Incremental mode (`full_every=K`): a full save, then up to K - 1 deltas
holding, per worker and EV, only the keys written (inserted, counted,
updated) or evicted since the previous save, each written and finished
exactly as a full save (the same folders, manifest, renames and fsyncs);
its manifest names the checkpoint it extends (`parent`, with the SHA-256
of its manifest). `restore_tables` of a delta replays its full save and
every delta in order, checking each link; a checkpoint that a delta
extends is never deleted by a save. Dense tables are saved in full in
every delta. See `incremental_checkpoint`.

Dense variables and the optimizer slots of `tf.Variable` shards are not
resharded: save them with `tf.train.Checkpoint` on worker 0 (dense values
are identical on every worker).
"""

import hashlib
import json
import os
import secrets
import shutil
from typing import Any
from typing import Dict

import numpy as np
import tensorflow as tf

from group_embedding import model_parallel
from group_embedding.distributed import incremental_checkpoint as incremental
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.distributed.sharded_variable import shard_rows
from group_embedding.embedding_variable.variable import is_embedding_variable

LATEST = "latest"
MANIFEST = "manifest.json"
_PARTIAL = ".partial"
_FORMAT = 1
_DELTA_FORMAT = 2  # older readers would restore a delta as a full save


def _barrier_all_ok(ok: bool) -> bool:
    """True on every worker iff `ok` on every worker (also a barrier)."""
    if not distributed_strategy.is_collective():
        return ok
    hvd = distributed_strategy.horovod()
    failed = hvd.allreduce(tf.constant(0 if ok else 1, tf.int32),
                           op=hvd.Sum, name="ge_ckpt_barrier")
    return int(failed) == 0


def _save_token() -> str:
    """A random folder suffix, the same on every worker."""
    token = secrets.randbits(62)
    if distributed_strategy.is_collective():
        hvd = distributed_strategy.horovod()
        token = int(hvd.broadcast(tf.constant(token, tf.int64), root_rank=0,
                                  name="ge_ckpt_token"))
    return f"{token:016x}"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _shard_name(rank: int, size: int) -> str:
    return f"shard-{rank}-of-{size}.npz"


def _fsync_dir(path: str):
    """Makes the renames inside folder `path` durable: a file's fsync
    does not cover its directory entry, so after a power loss `latest`
    could name a folder whose rename was lost."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(folder: str, step: int, size: int, chain: Dict):
    """Worker 0, after every shard is written: sizes and checksums, and
    (incremental mode) `chain`: kind, depth and the parent of a delta."""
    shards = {}
    for rank in range(size):
        path = os.path.join(folder, _shard_name(rank, size))
        shards[_shard_name(rank, size)] = {
            "bytes": os.path.getsize(path), "sha256": _sha256(path)}
    manifest = {"format": _FORMAT, "step": int(step), "num_shards": size,
                "shards": shards, **chain}
    if chain.get("kind") == "delta":
        manifest["format"] = _DELTA_FORMAT
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    _fsync_dir(folder)


def _remove_stale(directory: str, step: int, keep: str):
    """Deletes other checkpoints and unfinished saves of `step`; they are
    unreachable once `latest` names `keep`, unless `keep` extends them
    (incremental mode)."""
    prefix = f"ckpt-{step}-"
    try:
        needed = {os.path.basename(p)
                  for p, _ in _chain(os.path.join(directory, keep))}
    except (OSError, ValueError):
        return  # the chain cannot be read: delete nothing
    for name in os.listdir(directory):
        if name.startswith(prefix) and name not in needed:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    legacy = os.path.join(directory, f"ckpt-{step}")  # pre-manifest layout
    for path in (legacy, legacy + _PARTIAL):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def _to_numpy(tensor) -> np.ndarray:
    # String tensors come out as object arrays of bytes, which np.load
    # refuses without pickle; store them as fixed-width unicode.
    value = np.asarray(tensor)
    if value.dtype == object:
        value = np.asarray([v.decode() for v in value.ravel()],
                           dtype=str).reshape(value.shape)
    return value


def _table_arrays(name, table, rank) -> Dict[str, np.ndarray]:
    """What this worker stores for one table (prefix `name/`)."""
    if is_embedding_variable(table):
        # The EV's own checkpoint tensors: keys, values, freqs, versions,
        # slots (per key) and slot_names, slot_inits, step (per variable).
        arrays = {f"{name}/{f}": _to_numpy(t)
                  for f, t in table._serialize_to_tensors().items()}
        # New keys start from these rows: restore them too, so keys first
        # seen after a restore get the values they would have had.
        arrays[f"{name}/default_values"] = table.default_values.numpy()
        return arrays
    if isinstance(table, ShardedVariable):
        return {f"{name}/rows": table.global_rows(),
                f"{name}/values": table.shard.numpy()}
    if rank != 0:  # replicated: identical everywhere, written once
        return {}
    return {f"{name}/rows": np.arange(table.shape[0], dtype=np.int64),
            f"{name}/values": table.numpy()}


def _latest_name(directory: str):
    """(folder name `latest` names, SHA-256 of its manifest), or Nones."""
    path = latest_checkpoint(directory)
    manifest = path and os.path.join(path, MANIFEST)
    if not manifest or not os.path.exists(manifest):
        return None, None
    return os.path.basename(path), _sha256(manifest)


def _plan(directory, evs, size, full_every):
    """The base the save extends with a delta (None: full), the same on
    every worker."""
    if full_every is None:
        return None
    if isinstance(full_every, bool) or not isinstance(full_every, int) \
            or full_every < 1:
        raise ValueError(f"full_every must be None or an integer >= 1, "
                         f"got {full_every!r}.")
    base = incremental.usable_base(directory, evs, size, full_every,
                                   *_latest_name(directory))
    return base if _barrier_all_ok(base is not None) else None


def save_tables(directory: str, tables: Dict[str, object], step: int, *,
                full_every=None) -> str:
    """Writes this worker's part of `tables`; call on every worker.

    Args:
        directory: checkpoint folder (shared by all workers).
        tables: name -> `ShardedVariable`, `tf.Variable` or
            `EmbeddingVariable`; names must be the same on every worker.
        step: number used in the checkpoint folder's name
            (`ckpt-STEP-TOKEN`, a fresh TOKEN per save). Saving a step
            again writes a new folder; older folders of that step are
            deleted only after `latest` names the new one (never one
            that the new one extends).
        full_every: None (default): a full save. An integer K turns on
            incremental saves: a save of the same EVs (same objects)
            into a directory whose `latest` this process saved or
            restored is a delta of it, holding per EV only the keys
            inserted, updated or evicted since (values, every slot,
            freq, version, removals; dense tables in full), until K - 1
            deltas follow a full save; then a full save again. A save
            is full when there is no such base (a new process, another
            worker count, other tables, a restore or a new optimizer
            slot since), on every worker alike.

    Returns:
        The path of the finished checkpoint (what `latest` now names).

    Raises:
        RuntimeError: any worker failed to write, or worker 0 failed to
            finish (manifest, renames); `latest` still names a complete
            checkpoint. The error names the failure on this worker.
    """
    rank, size = model_parallel.world()
    evs = {n: t for n, t in tables.items() if is_embedding_variable(t)}
    base = _plan(directory, evs, size, full_every)
    covered = {}
    # A fresh name per save: never reuse (or delete first) a folder that a
    # failed save or the current `latest` may be using.
    final = os.path.join(directory, f"ckpt-{step}-{_save_token()}")
    partial = final + _PARTIAL
    error = None
    try:
        os.makedirs(partial, exist_ok=True)
        arrays = {"num_shards": np.asarray(size)}
        for name, table in tables.items():
            if full_every is None or name not in evs:
                arrays.update(_table_arrays(name, table, rank))
                continue
            part, covered[name] = incremental.export_ev(
                name, table, base.covered[name][1] if base else 0)
            arrays.update(part)
        path = os.path.join(partial, _shard_name(rank, size))
        with open(path + ".tmp", "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        _fsync_dir(partial)
    except Exception as e:  # noqa: BLE001 - reported to all workers below
        error = e
    if not _barrier_all_ok(error is None):
        raise RuntimeError(
            f"Saving checkpoint {final} failed on "
            f"{'this worker: ' + repr(error) if error else 'another worker'}"
            f"; '{LATEST}' still names the previous checkpoint.")
    error = None
    chain: Dict[str, Any] = {}
    if full_every is not None:
        chain = {"kind": "full", "depth": 0} if base is None else {
            "kind": "delta", "depth": base.depth + 1,
            "parent": base.checkpoint,
            "parent_manifest_sha256": base.manifest_sha256}
    if rank == 0:
        try:
            _write_manifest(partial, step, size, chain)
            os.replace(partial, final)
            # The folder's new name must be on disk before `latest` can
            # name it, and `latest` itself before the save returns.
            _fsync_dir(directory)
            pointer = os.path.join(directory, LATEST)
            with open(pointer + ".tmp", "w") as f:
                f.write(os.path.basename(final))
                f.flush()
                os.fsync(f.fileno())
            os.replace(pointer + ".tmp", pointer)
            _fsync_dir(directory)
        except Exception as e:  # noqa: BLE001 - reported to all workers
            error = e
    # Nobody reads `latest` before it moved, and all workers fail alike.
    if not _barrier_all_ok(error is None):
        raise RuntimeError(
            f"Finishing checkpoint {final} failed on worker 0"
            f"{': ' + repr(error) if error else ''}; '{LATEST}' names the "
            "previous checkpoint or this one, both complete.")
    if full_every is not None:
        # Durable on every worker: later deltas extend this save.
        incremental.record(directory, os.path.basename(final),
                           _sha256(os.path.join(final, MANIFEST)),
                           chain["depth"], size, evs, covered)
    if rank == 0:
        _remove_stale(directory, step, os.path.basename(final))
    return final


def latest_checkpoint(directory: str):
    """Path of the newest finished checkpoint in `directory`, or None."""
    pointer = os.path.join(directory, LATEST)
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(directory, f.read().strip())


def _check_manifest(path, manifest) -> int:
    """The shard count of a manifest, checked before anything is built
    per shard: a count of 10**9 must not cost 10**9 names."""
    def invalid(what):
        return ValueError(f"Checkpoint {path}: {MANIFEST} is invalid: "
                          f"{what}.")

    if not isinstance(manifest, dict):
        raise invalid(f"expected an object, got {type(manifest).__name__}")
    size = manifest.get("num_shards")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise invalid(f"num_shards must be a positive integer, got "
                      f"{size!r}")
    listed = manifest.get("shards")
    if not isinstance(listed, dict):
        raise invalid(f"shards must map file names to sizes and checksums,"
                      f" got {type(listed).__name__}")
    if len(listed) != size:
        names = ", ".join(sorted(listed)[:4])
        more = ", ..." if len(listed) > 4 else ""
        raise invalid(f"num_shards is {size} but it lists {len(listed)} "
                      f"shard{'s' if len(listed) != 1 else ''} "
                      f"({names}{more})")
    return size


def _read_manifest(path):
    """The manifest of finished checkpoint `path`, its shard count
    checked."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise ValueError(f"Checkpoint {path} does not exist.")
    if not os.path.exists(manifest_path):
        raise ValueError(
            f"Checkpoint {path} has no {MANIFEST}: the save did not finish "
            "(or it predates manifests); restore a checkpoint named by "
            f"'{LATEST}'.")
    with open(manifest_path) as f:
        try:
            manifest = json.load(f)
        except ValueError as e:
            raise ValueError(f"Checkpoint {path}: {MANIFEST} is not valid "
                             f"JSON ({e}).") from None
    _check_manifest(path, manifest)
    return manifest


def _chain(path):
    """Checkpoint `path` and, for a delta, every checkpoint it extends
    down to its full save, each link checked: (path, manifest), newest
    first."""
    chain = []
    while True:
        manifest = _read_manifest(path)
        kind = manifest.get("kind", "full")
        chain.append((path, manifest))
        if kind == "full":
            return chain
        where = f"Checkpoint {path}: {MANIFEST}"
        parent = manifest.get("parent")
        depth = manifest.get("depth")
        digest = manifest.get("parent_manifest_sha256")
        if kind != "delta":
            raise ValueError(f"{where} has kind {kind!r}, expected 'full' "
                             "or 'delta'.")
        if not isinstance(parent, str) or parent in ("", ".", "..") or \
                os.path.basename(parent) != parent or "\\" in parent:
            raise ValueError(f"{where} names parent {parent!r}, not a "
                             "checkpoint folder of the same directory.")
        if isinstance(depth, bool) or not isinstance(depth, int) or \
                depth < 1 or not isinstance(digest, str):
            raise ValueError(f"{where} is a delta without a valid depth "
                             f"({depth!r}) or parent checksum.")
        parent_path = os.path.join(os.path.dirname(path), parent)
        parent_manifest = os.path.join(parent_path, MANIFEST)
        if not os.path.exists(parent_manifest):
            raise ValueError(
                f"Checkpoint {path} is a delta of {parent}, which is "
                f"missing from {os.path.dirname(path)} (or unfinished): a "
                "delta restores only with its full save and every delta "
                "in between.")
        if _sha256(parent_manifest) != digest:
            raise ValueError(
                f"Checkpoint {path} is a delta of {parent}, but "
                f"{parent}/{MANIFEST} is not the one it extended "
                "(SHA-256 differs).")
        up = _read_manifest(parent_path)
        if up.get("depth", 0) != depth - 1 or \
                up["num_shards"] != manifest["num_shards"]:
            raise ValueError(
                f"Checkpoint {path} (delta {depth}, "
                f"{manifest['num_shards']} shards) does not follow "
                f"{parent} (depth {up.get('depth', 0)}, "
                f"{up['num_shards']} shards).")
        path = parent_path


def _replay(chain):
    """The shards a full save at the chain's last delta would hold:
    the full save's, with every delta's EV rows merged in order (dense
    tables and per-variable fields from the newest)."""
    shards = _load_shards(chain[-1][0], chain[-1][1])
    if len(chain) == 1:
        return shards
    # [rank][delta, oldest first] = (file, arrays)
    deltas = list(zip(*[_load_shards(p, m) for p, m in reversed(chain[:-1])]))
    merged = []
    for (_, base), files in zip(shards, deltas):
        newest = dict(files[-1][1])
        named = [(arrays, f"delta file {os.path.basename(file)} of "
                  f"checkpoint {os.path.dirname(file)}")
                 for file, arrays in files]
        for name in incremental.delta_evs(newest):
            newest.update(incremental.apply_deltas(name, base, named))
        merged.append((files[-1][0], newest))
    return merged


def _load_shards(path, manifest):
    """Reads every shard of a finished checkpoint, verified against its
    manifest (count, presence, size, SHA-256, worker count).

    Returns:
        (file path, arrays) per shard, in rank order.
    """
    size = manifest["num_shards"]
    expected = {_shard_name(r, size) for r in range(size)}
    listed = set(manifest["shards"])
    if listed != expected:
        raise ValueError(
            f"Checkpoint {path}: {MANIFEST} lists shards "
            f"{sorted(listed)} but num_shards is {size}.")
    shards = []
    for rank in range(size):
        name = _shard_name(rank, size)
        file = os.path.join(path, name)
        entry = manifest["shards"][name]
        if not os.path.exists(file):
            raise ValueError(f"Checkpoint {path}: shard file {name} is "
                             f"missing ({size} shards were saved).")
        got = os.path.getsize(file)
        if got != entry["bytes"]:
            raise ValueError(f"Checkpoint {path}: shard file {name} has "
                             f"{got} bytes, {entry['bytes']} were saved.")
        if _sha256(file) != entry["sha256"]:
            raise ValueError(f"Checkpoint {path}: shard file {name} is "
                             "corrupted (SHA-256 differs from the "
                             "manifest).")
        shard = dict(np.load(file))
        if int(shard["num_shards"]) != size:
            raise ValueError(
                f"Checkpoint {path}: shard file {name} was written by "
                f"{int(shard['num_shards'])} workers, the manifest says "
                f"{size}.")
        shards.append((file, shard))
    return shards


def _restore_rows(name, table, shards, rank, size):
    """Dense tables: copy the saved rows this worker now holds."""
    if isinstance(table, ShardedVariable):
        wanted = shard_rows(table.vocab_size, table.partition_strategy,
                            size, rank)
        target, vocab = table.shard, table.vocab_size
    else:
        wanted = np.arange(table.shape[0], dtype=np.int64)
        target, vocab = table, table.shape[0]
    value = np.zeros(target.shape, target.dtype.as_numpy_dtype)
    found = np.zeros(len(wanted), bool)
    position = np.full(vocab, -1, np.int64)
    position[wanted] = np.arange(len(wanted))
    for file, shard in shards:
        if f"{name}/rows" not in shard:
            continue
        rows, values = shard[f"{name}/rows"], shard[f"{name}/values"]
        where = (f"Table '{name}': shard file {os.path.basename(file)} of "
                 f"checkpoint {os.path.dirname(file)}")
        if values.shape[1:] != tuple(target.shape[1:]):
            raise ValueError(
                f"{where} holds rows of shape {values.shape[1:]}, the "
                f"table's are {tuple(target.shape[1:])}.")
        if rows.shape != values.shape[:1]:
            raise ValueError(
                f"{where} holds {rows.size} row ids for {len(values)} rows "
                "of values.")
        # Checked before indexing: numpy would map row -1 to the last.
        outside = (rows < 0) | (rows >= vocab)
        if outside.any():
            raise ValueError(
                f"{where} holds row {int(rows[outside][0])}, outside the "
                f"table's [0, {vocab}).")
        at = position[rows]
        keep = at >= 0
        value[at[keep]] = values[keep]
        found[at[keep]] = True
    if not found.all():
        raise ValueError(f"Table '{name}': checkpoint lacks "
                         f"{int((~found).sum())} of this worker's rows.")
    target.assign(value)


_EV_PER_KEY = ("keys", "values", "freqs", "versions", "slots")
_EV_PER_VARIABLE = ("slot_names", "slot_inits", "step")


def _restore_ev(name, table, shards, rank, size):
    """EVs: merge every worker's keys, keep those this worker owns.
    Returns the checkpoint's slot names of the EV."""
    fields = _EV_PER_KEY
    parts = {f: [] for f in fields}
    meta = None
    for _, shard in shards:
        if f"{name}/keys" not in shard:
            continue
        keys = shard[f"{name}/keys"]
        mine = model_parallel.key_owner(keys, size) == rank
        for f in fields:
            parts[f].append(shard[f"{name}/{f}"][mine])
        meta = shard
    if meta is None:
        raise ValueError(f"EmbeddingVariable '{name}' is not in the "
                         "checkpoint.")
    restored = {f: tf.convert_to_tensor(np.concatenate(parts[f]))
                for f in fields}
    for f in _EV_PER_VARIABLE:
        restored[f] = tf.convert_to_tensor(meta[f"{name}/{f}"])
    table._restore_from_tensors(restored)
    table.default_values.assign(meta[f"{name}/default_values"])
    return meta[f"{name}/slot_names"]


def restore_tables(path: str, tables: Dict[str, object]):
    """Loads `tables` from a checkpoint written at any worker count.

    Args:
        path: a checkpoint folder, or a directory holding `latest`.
        tables: name -> table, as given to `save_tables` (the layout, i.e.
            the number of workers, may differ).

    Raises:
        ValueError: no checkpoint; an unfinished one (no manifest); an
            invalid manifest (shard count); a shard file missing, of the
            wrong size or corrupted; a table missing from it; rows that do
            not fit the table (negative or >= its rows, another dim, ids
            and values of different lengths); EV keys out of the
            variable's key_dtype range. For a delta (`full_every`):
            a checkpoint it extends is missing, was replaced (its
            manifest's SHA-256 differs) or does not precede it (depth,
            worker count); a delta file whose arrays do not fit the
            variable (lengths, dims, slots, a key listed twice). Every
            error names the checkpoint and file.

    In incremental mode, the next `save_tables(..., full_every=K)` of the
    same EVs into the same directory may then be a delta of `path`.
    """
    if os.path.exists(os.path.join(path, LATEST)):
        path = latest_checkpoint(path)
    rank, size = model_parallel.world()
    chain = _chain(path)
    shards = _replay(chain)
    slot_names = {}
    for name, table in tables.items():
        if is_embedding_variable(table):
            owner_size = size if distributed_strategy.is_collective() else 1
            slot_names[name] = _restore_ev(name, table, shards,
                                           rank % owner_size, owner_size)
        else:
            _restore_rows(name, table, shards, rank, size)
    manifest = chain[0][1]
    if "kind" in manifest:  # incremental mode: deltas may extend it
        incremental.record_restore(
            path, _sha256(os.path.join(path, MANIFEST)), manifest["depth"],
            manifest["num_shards"], size,
            {n: t for n, t in tables.items() if is_embedding_variable(t)},
            slot_names)
