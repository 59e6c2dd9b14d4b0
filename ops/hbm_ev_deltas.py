"""Incremental-checkpoint deltas of HBM EmbeddingVariables
(`HbmStorage.export_changes`): which keys changed since the last save
confirmed durable, found by comparing exports.

The CPU EV marks every row written (ops/kernels/ev_storage.h, "Change
tracking"); the GPU table (ops/cuda/ev_table.h) keeps no such marks, and
keeping them would add a device write to every lookup and update of
every step for what only a save reads. Instead the storage keeps, on the
host, the content of the export the last confirmed save wrote (the
base); a delta lists every key whose state (row, every slot, freq and
version, compared bit for bit) differs from the base's or that the base
lacks, and as removed the base's keys no longer stored.

Why this is safe: what is compared is the content itself, so no writer
(lookups, updates, capacity or policy evictions, imports) can slip a
change past a delta. A save that fails before its confirmation leaves
the base as it was: the next delta covers the failed save's changes too.
Removed keys are also those the eviction policy took since the base
(the adaptor records them once incremental saves began,
GroupEmbeddingHbmEVTakeEvicted) and still absent, so a key inserted and
evicted between two saves is listed as removed as on the CPU EV. One
difference from the CPU EV's delta, invisible once a chain is replayed:
a key written with its state unchanged bit for bit (say a zero gradient
on a key not looked up) is not listed.

Cost: a host copy of the table's content at the base (what a full save
writes) and the whole table exported at each save; nothing per step.
"""

from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import numpy as np
import tensorflow as tf


class _Snapshot:
    """One export's keys (sorted) and each key's state as raw 32-bit
    words: value, slots, freq and version side by side."""

    def __init__(self, export: Sequence[np.ndarray]):
        keys, values, freqs, versions, names, _, slots, _ = export
        n = keys.shape[0]
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.slot_names = _names(names)
        # Bitwise words: -0.0 vs 0.0 and NaN payloads count as changes.
        # Widths from the shapes: an empty table has rows of them too.
        words = [np.ascontiguousarray(a).reshape(
                     n, int(np.prod(a.shape[1:], dtype=np.int64))).view(
                     np.int32)
                 for a in (values.astype(np.float32, copy=False),
                           slots.astype(np.float32, copy=False),
                           freqs.astype(np.int64, copy=False),
                           versions.astype(np.int64, copy=False))]
        self.order = order
        self.state = np.concatenate(words, axis=1)[order]


def _names(names: np.ndarray) -> List[str]:
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


class DeltaTracker:
    """The base of one HBM EV's next delta and the export awaiting its
    confirmation (the CPU EV's export numbers: 64-bit, from 1)."""

    def __init__(self, name: str):
        self.name = name
        self._exports = 0
        self._base: Optional[_Snapshot] = None
        self._base_id = 0
        self._pending: Optional[Tuple[int, _Snapshot]] = None
        # Keys the policy evicted, each with the export it goes to first
        # (dropped once an export at least as new is confirmed).
        self._evicted: List[Tuple[np.ndarray, int]] = []

    def record_evicted(self, keys: np.ndarray, lost: bool) -> None:
        """Keys the policy removed since the last call (for the next
        export); `lost`: some could not be read, so no delta can be
        trusted to list them (the next save is full)."""
        if lost:
            self._base, self._base_id = None, 0
        if keys.size:
            self._evicted.append((keys.astype(np.int64), self._exports + 1))

    def delta_base(self, slot_names: np.ndarray) -> int:
        """The `since` the next delta may use: the confirmed export, or
        0 (save in full) when there is none or the optimizer slots
        changed since (a delta cannot add a slot to the keys it omits)."""
        if self._base is None or _names(slot_names) != \
                self._base.slot_names:
            return 0
        return self._base_id

    def restored(self, export: Sequence[np.ndarray],
                 checkpoint_slots: Sequence) -> int:
        """The content `export` was just restored from a checkpoint with
        slots `checkpoint_slots`: it is the base of the next delta (its
        number returned), or, when the table's slots are others (it kept
        some the checkpoint lacks), there is none (0)."""
        self._exports += 1
        self._base, self._base_id = _Snapshot(export), self._exports
        if self._base.slot_names != _names(np.asarray(checkpoint_slots)):
            self._base, self._base_id = None, 0
        self._pending = None
        self._evicted = []
        return self._base_id

    def changes(self, export: Sequence[np.ndarray], since: int) -> tuple:
        """`export` (the storage's full export, numpy) as the CPU EV's
        `export_changes` result: every key (`since` == 0) or the keys
        changed since the confirmed export `since`, then the removed keys
        and this export's number.

        Raises:
            FailedPreconditionError: `since` is neither 0 nor the base
                `delta_base` names, naming the EV.
        """
        keys, values, freqs, versions, names, inits, slots, step = export
        if since != 0 and since != self.delta_base(names):
            raise tf.errors.FailedPreconditionError(
                None, None,
                f"EmbeddingVariable '{self.name}': no delta can extend "
                f"export {since} (the base is {self.delta_base(names)}: a "
                "restore, a new optimizer slot or another confirmed save "
                "came since); export with since=0.")
        now = _Snapshot(export)
        self._exports += 1
        self._pending = (self._exports, now)
        base = self._base
        if since == 0 or base is None:
            pick = np.arange(keys.shape[0])
            removed = np.zeros([0], np.int64)
        else:
            at = np.searchsorted(base.keys, now.keys)
            inside = np.minimum(at, max(base.keys.shape[0] - 1, 0))
            known = at < base.keys.shape[0]
            if base.keys.shape[0]:
                known &= base.keys[inside] == now.keys
                same = known & np.all(base.state[inside] == now.state,
                                      axis=1)
            else:
                same = known
            pick = now.order[~same]
            gone = [base.keys] + [k for k, _ in self._evicted]
            removed = np.setdiff1d(np.concatenate(gone), now.keys)
        return (keys[pick], values[pick], freqs[pick], versions[pick],
                names, inits, slots[pick], step, removed.astype(np.int64),
                np.int64(self._exports))

    def confirm(self, covered: int) -> None:
        """Export `covered` is durable: the next delta extends it. Any
        other number (an export came since) leaves no base, as on the
        CPU EV."""
        if self._pending is None or self._pending[0] != covered:
            self._base, self._base_id = None, 0
            return
        self._base_id, self._base = self._pending
        self._pending = None
        self._evicted = [(k, e) for k, e in self._evicted if e > covered]
