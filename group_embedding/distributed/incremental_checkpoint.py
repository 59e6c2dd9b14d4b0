"""Incremental checkpoints of EmbeddingVariables (`save_tables(...,
full_every=K)`): what a delta holds, when one may be written, and how a
chain of them is replayed.

The storage stamps every write to a key with a 64-bit epoch that only an
export advances (ops/kernels/ev_storage.h, "Change tracking"; an HBM
EV's storage compares exports instead, ops/hbm_ev_deltas.py). A save
records, per EV, the epoch its export closed (`covered`); the next save
exports only the keys stamped later, plus the keys evicted since, and
names the checkpoint it extends (`parent`). This module keeps, per
checkpoint directory and per process, what the next delta extends (the
`_Base`), and merges a delta's rows into its parent's.

A save that fails advances nothing here: the next delta starts again
from the last durable save, so no change is lost. The base is dropped
(the next save is full) when the directory's `latest` moved, the worker
count or the set of EVs changed, or the storage cannot express the
changes as a delta (a restore, a new optimizer slot). Bases are kept per
directory and per set of EV objects: restoring a checkpoint into other
EVs (to inspect or evaluate it) leaves the trainer's base alone.
"""

import dataclasses
import os
import weakref
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import numpy as np

# Per-key arrays of an EV in a shard file, and what only a delta holds.
PER_KEY = ("keys", "values", "freqs", "versions", "slots")
REMOVED = "removed"


@dataclasses.dataclass
class _Base:
    """The checkpoint the next delta of a directory extends."""
    checkpoint: str        # folder name inside the directory
    manifest_sha256: str   # of its manifest, recorded in the delta
    depth: int             # deltas since its full save (0: it is full)
    size: int              # worker count it was written at
    covered: Dict[str, Tuple[weakref.ref, int]]  # EV -> (EV, export)


_bases: Dict[Tuple, _Base] = {}


def _key(directory: str, evs: Dict[str, Any]) -> Tuple:
    return (os.path.realpath(directory),
            frozenset((n, id(t)) for n, t in evs.items()))


def usable_base(directory: str, evs: Dict[str, Any], size: int,
                full_every: int, latest: Optional[str],
                latest_manifest_sha256: Optional[str]) -> Optional[_Base]:
    """The base the next save of `evs` may extend with a delta, or None
    (save in full).

    Args:
        directory: checkpoint directory.
        evs: name -> EmbeddingVariable of this save.
        size: worker count now.
        full_every: K of `save_tables`: a full save, then K - 1 deltas.
        latest: folder name `latest` names now (None: none).
        latest_manifest_sha256: SHA-256 of its manifest (None: none).
    """
    base = _bases.get(_key(directory, evs))
    if base is None or base.size != size or base.depth + 1 >= full_every:
        return None
    if latest != base.checkpoint or set(base.covered) != set(evs):
        return None
    if latest_manifest_sha256 != base.manifest_sha256:
        return None
    for name, table in evs.items():
        ref, covered = base.covered[name]
        if ref() is not table:
            return None
        if int(table.storage.delta_base(table.handle)) != covered:
            return None
    return base


def export_ev(name: str, table, since: int) -> Tuple[Dict, int]:
    """This worker's arrays of EV `table` (prefix `name/`): every key
    (`since` == 0) or the keys written since the confirmed save `since`
    and the keys evicted since (`name/removed`). Runs the eviction policy
    first, as a full save does.

    Returns:
        (arrays, this export's number, to confirm once durable).
    """
    if table.ev_option.evict_option is not None:
        table.evict()
    out = table.storage.export_changes(table.handle, table.embedding_dim,
                                       since)
    fields = ("keys", "values", "freqs", "versions", "slot_names",
              "slot_inits", "slots", "step", REMOVED)
    arrays = {}
    for field, tensor in zip(fields, out[:-1]):
        value = np.asarray(tensor)
        if value.dtype == object:  # slot names: bytes -> unicode
            value = np.asarray([v.decode() for v in value], dtype=str)
        arrays[f"{name}/{field}"] = value
    if since == 0:
        del arrays[f"{name}/{REMOVED}"]
    arrays[f"{name}/default_values"] = table.default_values.numpy()
    return arrays, int(out[-1])


def record(directory: str, checkpoint: str, manifest_sha256: str,
           depth: int, size: int, evs: Dict[str, Any],
           covered: Dict[str, int]):
    """After a save of `evs` became durable: the next delta extends
    `checkpoint` (each EV's export `covered[name]` is confirmed)."""
    for name, table in evs.items():
        table.storage.confirm_save(table.handle, covered[name])
    _remember(directory, checkpoint, manifest_sha256, depth, size, evs,
              covered)


def _remember(directory, checkpoint, manifest_sha256, depth, size, evs,
              covered):
    for key in [k for k, b in _bases.items()
                if any(r() is None for r, _ in b.covered.values())]:
        del _bases[key]  # EVs gone (their ids may be reused)
    _bases[_key(directory, evs)] = _Base(
        checkpoint, manifest_sha256, depth, size,
        {n: (weakref.ref(t), covered[n]) for n, t in evs.items()})


def record_restore(path: str, manifest_sha256: str, depth: int,
                   size: int, now: int, evs: Dict[str, Any],
                   slot_names: Dict[str, Any]):
    """After `evs` were restored from checkpoint `path` (saved at `size`
    workers, `now` workers running; `slot_names`: each EV's slots there):
    the next save in its directory may be a delta of it when the worker
    count is the same and every EV has the checkpoint's slots (one that
    kept others, built since that save, needs a full save)."""
    directory, checkpoint = os.path.split(os.path.normpath(path))
    if size != now:
        _bases.pop(_key(directory, evs), None)
        return
    covered = {n: int(t.storage.delta_base(
                   t.handle, restored=True, restored_slot_names=slot_names[n]))
               for n, t in evs.items()}
    if not all(covered.values()):
        _bases.pop(_key(directory, evs), None)
        return
    _remember(directory, checkpoint, manifest_sha256, depth, size, evs,
              covered)


def _check_delta(name: str, base: Dict, delta: Dict, where: str):
    """Refuses a delta of EV `name` that its parent's arrays cannot take,
    naming the file (`where`)."""
    def bad(what):
        return ValueError(f"EmbeddingVariable '{name}': {where}: {what}.")

    for field in PER_KEY + (REMOVED, "slot_names"):
        if f"{name}/{field}" not in delta:
            raise bad(f"the delta lacks '{name}/{field}'")
    if f"{name}/keys" not in base:
        raise bad("the variable is not in the checkpoint this delta "
                  "extends")
    keys, removed = delta[f"{name}/keys"], delta[f"{name}/{REMOVED}"]
    if keys.ndim != 1 or removed.ndim != 1 or \
            not np.issubdtype(keys.dtype, np.integer) or \
            not np.issubdtype(removed.dtype, np.integer):
        raise bad(f"keys and removed keys must be integer vectors, got "
                  f"{keys.dtype}{list(keys.shape)} and "
                  f"{removed.dtype}{list(removed.shape)}")
    n = keys.shape[0]
    for field in PER_KEY[1:]:
        got = delta[f"{name}/{field}"]
        if got.ndim < 1 or got.shape[0] != n:
            raise bad(f"'{field}' holds {got.shape[0] if got.ndim else 0}"
                      f" rows for {n} keys")
        want = base[f"{name}/{field}"].shape[1:]
        if got.shape[1:] != want:
            raise bad(f"'{field}' rows have shape {list(got.shape[1:])}, "
                      f"the checkpoint it extends has {list(want)}")
    if list(delta[f"{name}/slot_names"]) != list(base[f"{name}/slot_names"]):
        raise bad(f"its optimizer slots {list(delta[f'{name}/slot_names'])}"
                  f" differ from those of the checkpoint it extends "
                  f"{list(base[f'{name}/slot_names'])}")
    both = np.concatenate([keys.astype(np.int64), removed.astype(np.int64)])
    unique = np.unique(both)
    if unique.size != both.size:
        raise bad("a key is listed twice (as changed or removed)")


def apply_deltas(name: str, base: Dict, deltas: List[Tuple[Dict, str]]
                 ) -> Dict:
    """EV `name`'s per-key arrays after `deltas` (oldest first; each the
    arrays of one shard file and its name for errors) on top of `base`.

    One pass over the base whatever the number of deltas: a key's newest
    event wins (its row from the newest delta holding it, or its removal),
    base keys no delta mentions are kept.

    Returns:
        name/field -> array, for the fields in PER_KEY.
    """
    for delta, where in deltas:
        _check_delta(name, base, delta, where)
    old = base[f"{name}/keys"]
    # Events in order: every delta's changed keys, then its removals.
    key_parts: List[np.ndarray] = []
    row_parts: List[np.ndarray] = []
    count = 0
    for delta, _ in deltas:
        changed = delta[f"{name}/keys"].astype(np.int64)
        removed = delta[f"{name}/{REMOVED}"].astype(np.int64)
        key_parts += [changed, removed]
        row_parts += [np.arange(count, count + changed.size),
                      np.full(removed.size, -1)]
        count += changed.size
    keys, rows = np.concatenate(key_parts), np.concatenate(row_parts)
    # Stable sort by key keeps event order: a key's last event is newest.
    order = np.argsort(keys, kind="stable")
    keys, rows = keys[order], rows[order]
    last = np.ones(keys.size, bool)
    last[:-1] = keys[1:] != keys[:-1]
    final = rows[last & (rows >= 0)]
    keep = ~np.isin(old, keys[last])
    out = {}
    for f in PER_KEY:
        dtype = base[f"{name}/{f}"].dtype
        changed = np.concatenate([d[f"{name}/{f}"].astype(dtype)
                                  for d, _ in deltas])
        out[f"{name}/{f}"] = np.concatenate([base[f"{name}/{f}"][keep],
                                             changed[final]])
    return out


def delta_evs(shard: Dict) -> List[str]:
    """Names of the EVs a delta shard holds changes of (all its EVs: a
    delta is never a full copy of one, and `apply_delta` refuses an EV
    whose removals are missing)."""
    suffix = "/keys"
    return sorted(k[:-len(suffix)] for k in shard if k.endswith(suffix))
