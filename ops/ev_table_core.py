"""ctypes bindings of the GPU EV table (`ops/cuda/ev_table.h`).

Like `cuda_core.py`, it imports only ctypes and numpy, so that the GPU
machine (no TensorFlow) loads it by path and drives the CUDA table with
CuPy or torch memory, and CPU-only CI drives the host stand-in
(`ops/cuda/ev_table_host.cc`) with numpy arrays through the same code.

* `EvTable(core, memory, ...)`: one table's arrays, allocated through a
  memory adapter of `cuda_core` (`HostMemory`, `CupyMemory`,
  `TorchMemory`), and every call of the C interface on it.
* `EvGroup(tables)`: the find-or-insert of several features over several
  tables in one call (one probe, one sort, one insert launch).
"""

import ctypes
from typing import Dict
from typing import Optional

import numpy as np

BUCKET = 128
EMPTY_KEY = -(2 ** 63)
POLICIES = {"lru": 0, "lfu": 1}
COUNTERS = ("bad_keys", "full", "inserted", "evicted")
_STATUS = {-1: "bad argument", -2: "scratch too small",
           -3: "too large"}


class GeEvTable(ctypes.Structure):
    """`GeEvTable` of the C header, field for field."""
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("digests", ctypes.c_void_p),
        ("meta", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("num_buckets", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("num_slots", ctypes.c_int32),
        ("policy", ctypes.c_int32),
        ("filter_freq", ctypes.c_int64),
        ("no_permission", ctypes.c_float),
        ("reserved", ctypes.c_float),
        ("defaults", ctypes.c_void_p),
        ("default_rows", ctypes.c_int64),
        ("slot_inits", ctypes.c_void_p),
    ]


class GeEvEvicted(ctypes.Structure):
    """`GeEvEvicted` of the C header."""
    _fields_ = [
        ("keys", ctypes.c_void_p),
        ("values", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("freq", ctypes.c_void_p),
        ("version", ctypes.c_void_p),
        ("capacity", ctypes.c_int64),
        ("count", ctypes.c_void_p),
    ]


class GeEvBatch(ctypes.Structure):
    """`GeEvBatch` of the C header."""
    _fields_ = [
        ("table", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("keys", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("out_slots", ctypes.c_void_p),
    ]


class TableError(RuntimeError):
    """A table call refused its arguments or failed to launch."""


def _typed(lib):
    """Declares the table functions of a loaded core library (once)."""
    if getattr(lib, "_ev_typed", False):
        return lib
    t = ctypes.POINTER(GeEvTable)
    e = ctypes.POINTER(GeEvEvicted)
    b = ctypes.POINTER(GeEvBatch)
    vp, i64, f32, c_int = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                           ctypes.c_int)
    size = ctypes.c_size_t
    sigs = {
        "ge_ev_table_bytes": (size, [i64, i64, c_int]),
        "ge_ev_init": (c_int, [t, vp]),
        "ge_ev_scratch_bytes": (size, [t, i64]),
        "ge_ev_find": (c_int, [t, vp, i64, vp, vp, vp, vp]),
        "ge_ev_stamp": (c_int, [t, vp, i64, i64, vp, vp, vp]),
        "ge_ev_swap_versions": (c_int, [t, vp, i64, vp, vp, vp]),
        "ge_ev_find_or_insert": (c_int, [t, vp, i64, i64, vp, vp, e, vp,
                                         size, vp, vp]),
        "ge_ev_insert": (c_int, [t, vp, i64, vp, vp, vp, vp, i64, e, vp,
                                 size, vp, vp]),
        "ge_ev_evict": (c_int, [t, i64, i64, f32, e, vp, vp]),
        "ge_ev_size": (c_int, [t, vp, vp]),
        "ge_ev_export_scratch_bytes": (size, [t]),
        "ge_ev_group_scratch_bytes": (size, [t, c_int, b, c_int]),
        "ge_ev_find_or_insert_group": (c_int, [t, c_int, b, c_int, i64, e,
                                               vp, size, vp, vp]),
        "ge_ev_export": (c_int, [t, vp, vp, vp, vp, vp, i64, vp, vp, size,
                                 vp]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    lib._ev_typed = True
    return lib


class EvTable:
    """One table in `memory`, and the calls of the C interface on it.

    Args:
        core: a loaded `cuda_core.Core` (the CUDA core or the host
            stand-in; both export the table functions).
        memory: a `cuda_core` memory adapter.
        num_buckets: a power of two; capacity = num_buckets * 128 keys.
        dim: row width.
        defaults: [default_rows, dim] float32 initial rows (a new key takes
            row key mod default_rows).
        num_slots: optimizer slot arrays per key; `slot_inits` their
            initial values.
        policy: "lru" or "lfu" (which key a full bucket gives up).
        filter_freq: CounterFilter threshold (0: none); `no_permission`
            what keys not admitted read.
    """

    def __init__(self, core, memory, num_buckets, dim, defaults,
                 num_slots=0, slot_inits=None, policy="lru", filter_freq=0,
                 no_permission=0.0):
        self.core = core
        self.lib = _typed(core.lib)
        self.m = memory
        self.dim = int(dim)
        self.num_slots = int(num_slots)
        self.capacity = int(num_buckets) * BUCKET
        cap = self.capacity
        m = memory
        self._keep = {
            "keys": m.empty((cap,), np.int64),
            # 16-byte aligned words of the probe: allocated as int64.
            "digests": m.zeros(((cap + 7) // 8,), np.int64),
            "meta": m.zeros((cap, 2), np.int64),  # freq, version
            "values": m.zeros((cap, self.dim), np.float32),
            "slots": (m.zeros((self.num_slots, cap, self.dim), np.float32)
                      if self.num_slots else None),
            "defaults": m.put(np.asarray(defaults, np.float32)),
            "slot_inits": (m.put(np.asarray(slot_inits, np.float32))
                           if self.num_slots else None),
            "counters": m.zeros((len(COUNTERS),), np.uint64),
        }
        k = self._keep
        self.desc = GeEvTable(
            keys=m.ptr(k["keys"]), digests=m.ptr(k["digests"]),
            meta=m.ptr(k["meta"]), values=m.ptr(k["values"]),
            slots=m.ptr(k["slots"]), num_buckets=int(num_buckets),
            dim=self.dim, num_slots=self.num_slots,
            policy=POLICIES[policy], filter_freq=int(filter_freq),
            no_permission=float(no_permission), reserved=0.0,
            defaults=m.ptr(k["defaults"]),
            default_rows=int(np.asarray(defaults).shape[0]),
            slot_inits=m.ptr(k["slot_inits"]))
        self._scratch = None
        self.check("ge_ev_init", self.lib.ge_ev_init(
            ctypes.byref(self.desc), m.stream))

    # -- plumbing ------------------------------------------------------------
    def check(self, name, status):
        """Raises TableError for a non-zero status of call `name`."""
        if status != 0:
            why = _STATUS.get(status, f"CUDA error {status}")
            raise TableError(f"{name} failed: {why} ({status}).")

    def scratch(self, nbytes):
        """A scratch buffer of at least `nbytes` (kept between calls)."""
        if self._scratch is None or self.m.count(self._scratch) < nbytes:
            self._scratch = self.m.empty((max(int(nbytes), 1),), np.uint8)
        return self._scratch

    def counters(self) -> Dict[str, int]:
        """The table's device counters (added to by every call)."""
        values = self.m.get(self._keep["counters"]).astype(np.uint64)
        return dict(zip(COUNTERS, (int(v) for v in values)))

    def _evicted(self, capacity):
        m = self.m
        keep = {
            "keys": m.empty((capacity,), np.int64),
            "values": m.empty((capacity, self.dim), np.float32),
            "slots": (m.empty((self.num_slots, capacity, self.dim),
                              np.float32) if self.num_slots else None),
            "freq": m.empty((capacity,), np.int64),
            "version": m.empty((capacity,), np.int64),
            "count": m.zeros((1,), np.uint64),
        }
        desc = GeEvEvicted(
            keys=m.ptr(keep["keys"]), values=m.ptr(keep["values"]),
            slots=m.ptr(keep["slots"]), freq=m.ptr(keep["freq"]),
            version=m.ptr(keep["version"]), capacity=int(capacity),
            count=m.ptr(keep["count"]))
        return desc, keep

    def _evicted_result(self, keep):
        n = int(self.m.get(keep["count"]).astype(np.uint64)[0])
        n = min(n, self.m.count(keep["keys"]))
        out = {k: self.m.get(keep[k])[:n] for k in
               ("keys", "values", "freq", "version")}
        if keep["slots"] is not None:
            out["slots"] = self.m.get(keep["slots"])[:, :n]
        return out

    # -- calls on device arrays (not synchronised) ----------------------
    def launch_find(self, keys, out, out_slots):
        """ge_ev_find on device arrays (no synchronisation)."""
        m = self.m
        self.check("ge_ev_find", self.lib.ge_ev_find(
            ctypes.byref(self.desc), m.ptr(keys), m.count(keys),
            m.ptr(out), m.ptr(out_slots), m.ptr(self._keep["counters"]),
            m.stream))

    def launch_find_or_insert(self, keys, out, out_slots, step=0,
                              evicted=None):
        """ge_ev_find_or_insert on device arrays (no synchronisation).
        Keys seen at `step` are pinned: steps must advance for keys to
        be evicted."""
        m = self.m
        n = m.count(keys)
        need = self.lib.ge_ev_scratch_bytes(ctypes.byref(self.desc), n)
        scratch = self.scratch(need)
        self.check("ge_ev_find_or_insert", self.lib.ge_ev_find_or_insert(
            ctypes.byref(self.desc), m.ptr(keys), n, int(step),
            m.ptr(out), m.ptr(out_slots),
            ctypes.byref(evicted) if evicted is not None else None,
            m.ptr(scratch), m.count(scratch), m.ptr(self._keep["counters"]),
            m.stream))

    # -- calls on numpy arrays (synchronised) ------------------------------
    def find(self, keys):
        """Inference read: (rows [n, dim], slots [n]) as numpy."""
        m = self.m
        keys = np.asarray(keys, np.int64)
        d_keys = m.put(keys)
        out = m.empty((keys.size, self.dim), np.float32)
        slots = m.empty((keys.size,), np.int64)
        self.launch_find(d_keys, out, slots)
        m.sync()
        return m.get(out), m.get(slots)

    def stamp(self, keys, step):
        """The keys of an optimizer step: each key's slot if stored and
        admitted, else -1 (numpy); every stored key's version becomes
        max(step, 0)."""
        m = self.m
        keys = np.asarray(keys, np.int64)
        d_keys = m.put(keys)
        slots = m.empty((max(keys.size, 1),), np.int64)
        self.check("ge_ev_stamp", self.lib.ge_ev_stamp(
            ctypes.byref(self.desc), m.ptr(d_keys), keys.size, int(step),
            m.ptr(slots), m.ptr(self._keep["counters"]), m.stream))
        m.sync()
        return m.get(slots)[:keys.size]

    def swap_versions(self, keys, versions):
        """ge_ev_swap_versions on distinct keys: each stored key's version
        and its entry of `versions` trade places; returns the array after
        the swap (numpy: absent keys keep their entry)."""
        m = self.m
        keys = np.asarray(keys, np.int64)
        d_keys = m.put(keys)
        d_versions = m.put(np.asarray(versions, np.int64).reshape(-1))
        self.check("ge_ev_swap_versions", self.lib.ge_ev_swap_versions(
            ctypes.byref(self.desc), m.ptr(d_keys), keys.size,
            m.ptr(d_versions), m.ptr(self._keep["counters"]), m.stream))
        m.sync()
        return m.get(d_versions)[:keys.size]

    def find_or_insert(self, keys, step=0, keep_evicted=False):
        """Training read: (rows, slots, evicted) as numpy; `evicted` is a
        dict of the keys that left (or None when not kept)."""
        m = self.m
        keys = np.asarray(keys, np.int64)
        d_keys = m.put(keys)
        out = m.empty((keys.size, self.dim), np.float32)
        slots = m.empty((keys.size,), np.int64)
        ev_desc, ev_keep = (self._evicted(max(keys.size, 1))
                            if keep_evicted else (None, None))
        self.launch_find_or_insert(d_keys, out, slots, step, ev_desc)
        m.sync()
        evicted = self._evicted_result(ev_keep) if keep_evicted else None
        return m.get(out), m.get(slots), evicted

    def launch_insert(self, keys, rows, slots=None, freq=None,
                      version=None, step=0, evicted=None):
        """ge_ev_insert on device arrays (no synchronisation)."""
        m = self.m
        n = m.count(keys)
        need = self.lib.ge_ev_scratch_bytes(ctypes.byref(self.desc), n)
        scratch = self.scratch(need)
        self.check("ge_ev_insert", self.lib.ge_ev_insert(
            ctypes.byref(self.desc), m.ptr(keys), n, m.ptr(rows),
            m.ptr(slots), m.ptr(freq), m.ptr(version), int(step),
            ctypes.byref(evicted) if evicted is not None else None,
            m.ptr(scratch), m.count(scratch), m.ptr(self._keep["counters"]),
            m.stream))

    def insert(self, keys, rows, slots=None, freq=None, version=None,
               step=0, keep_evicted=False):
        """Import of distinct keys with their state; the evicted keys (a
        dict) or None."""
        m = self.m
        keys = np.asarray(keys, np.int64)
        n = keys.size

        def put(a, dtype):
            return None if a is None else m.put(np.asarray(a, dtype))

        ev_desc, ev_keep = (self._evicted(max(n, 1))
                            if keep_evicted else (None, None))
        self.launch_insert(
            m.put(keys), m.put(np.asarray(rows, np.float32).reshape(
                n, self.dim)), put(slots, np.float32), put(freq, np.int64),
            put(version, np.int64), step, ev_desc)
        m.sync()
        return self._evicted_result(ev_keep) if keep_evicted else None

    def evict(self, step, steps_to_live=0, l2_threshold=-1.0,
              keep_evicted=False, capacity: Optional[int] = None):
        """Evicts by rule (GlobalStepEvict / L2WeightEvict); the evicted
        keys (a dict) or None."""
        m = self.m
        ev_desc, ev_keep = (self._evicted(capacity or self.capacity)
                            if keep_evicted else (None, None))
        self.check("ge_ev_evict", self.lib.ge_ev_evict(
            ctypes.byref(self.desc), int(step), int(steps_to_live),
            float(l2_threshold),
            ctypes.byref(ev_desc) if ev_desc is not None else None,
            m.ptr(self._keep["counters"]), m.stream))
        m.sync()
        return self._evicted_result(ev_keep) if keep_evicted else None

    def size(self) -> int:
        """Stored keys."""
        m = self.m
        count = m.zeros((1,), np.uint64)
        self.check("ge_ev_size", self.lib.ge_ev_size(
            ctypes.byref(self.desc), m.ptr(count), m.stream))
        m.sync()
        return int(m.get(count).astype(np.uint64)[0])

    def export(self):
        """Every stored key with its state, in slot order (numpy dict:
        keys, values, slots [num_slots, n, dim], freq, version)."""
        m = self.m
        n = self.size()
        cap = max(n, 1)
        out = {
            "keys": m.empty((cap,), np.int64),
            "values": m.empty((cap, self.dim), np.float32),
            "slots": (m.empty((self.num_slots, cap, self.dim), np.float32)
                      if self.num_slots else None),
            "freq": m.empty((cap,), np.int64),
            "version": m.empty((cap,), np.int64),
        }
        count = m.zeros((1,), np.uint64)
        need = self.lib.ge_ev_export_scratch_bytes(ctypes.byref(self.desc))
        scratch = self.scratch(need)
        self.check("ge_ev_export", self.lib.ge_ev_export(
            ctypes.byref(self.desc), m.ptr(out["keys"]),
            m.ptr(out["values"]), m.ptr(out["slots"]), m.ptr(out["freq"]),
            m.ptr(out["version"]), cap, m.ptr(count), m.ptr(scratch),
            m.count(scratch), m.stream))
        m.sync()
        got = int(m.get(count).astype(np.uint64)[0])
        if got != n:
            raise TableError(f"export counted {got} keys, size said {n}")
        result = {k: m.get(v)[:n] for k, v in out.items()
                  if k != "slots" and v is not None}
        if out["slots"] is not None:
            result["slots"] = m.get(out["slots"])[:, :n]
        return result


class EvGroup:
    """Several `EvTable`s of one memory, looked up together.

    Args:
        tables: distinct `EvTable`s (features that share a table name its
            index more than once in the batches).
    """

    def __init__(self, tables):
        self.tables = list(tables)
        self.m = self.tables[0].m
        self.lib = self.tables[0].lib
        self.descs = (GeEvTable * len(self.tables))(
            *[t.desc for t in self.tables])
        self.counters_array = self.m.zeros((len(COUNTERS),), np.uint64)
        self._scratch = None

    def counters(self) -> Dict[str, int]:
        """The group calls' device counters."""
        values = self.m.get(self.counters_array).astype(np.uint64)
        return dict(zip(COUNTERS, (int(v) for v in values)))

    def launch_find_or_insert(self, batches, step):
        """ge_ev_find_or_insert_group on device arrays (no
        synchronisation). `batches`: (table index, keys, out or None,
        out_slots or None) per feature."""
        m = self.m
        descs = (GeEvBatch * len(batches))()
        for d, (table, keys, out, out_slots) in zip(descs, batches):
            d.table = table
            d.keys = m.ptr(keys)
            d.n = m.count(keys)
            d.out = m.ptr(out)
            d.out_slots = m.ptr(out_slots)
        nt, nb = len(self.tables), len(batches)
        need = self.lib.ge_ev_group_scratch_bytes(self.descs, nt, descs, nb)
        if self._scratch is None or m.count(self._scratch) < need:
            self._scratch = m.empty((max(int(need), 1),), np.uint8)
        status = self.lib.ge_ev_find_or_insert_group(
            self.descs, nt, descs, nb, int(step), None,
            m.ptr(self._scratch), m.count(self._scratch),
            m.ptr(self.counters_array), m.stream)
        self.tables[0].check("ge_ev_find_or_insert_group", status)

    def find_or_insert(self, batches, step):
        """The same on numpy keys: `batches` is (table index, keys) per
        feature; returns (rows, slots) per feature as numpy."""
        m = self.m
        calls, outs = [], []
        for table, keys in batches:
            keys = np.asarray(keys, np.int64)
            out = m.empty((keys.size, self.tables[table].dim), np.float32)
            slots = m.empty((keys.size,), np.int64)
            calls.append((table, m.put(keys), out, slots))
            outs.append((out, slots))
        self.launch_find_or_insert(calls, step)
        m.sync()
        return [(m.get(o), m.get(s)) for o, s in outs]
