"""Parity cases of the GPU EV table against a numpy model of the CPU EV.

The model restates the CPU EmbeddingVariable's semantics
(`ops/kernels/ev_storage.h`, `ReadKeys` and `CountStoredKeys` in
`ev_lookup_ops.cc`: initial rows, CounterFilter admission counted per
occurrence and read before the batch counts, versions, GlobalStepEvict,
L2WeightEvict) plus the table's
own capacity rule (`ops/cuda/ev_table.h`: a key lives in bucket
Mix(key) >> 32 of 128 slots; a full bucket gives up its least valuable
key not seen by the current call, LRU or LFU). It knows nothing of slots,
digests or kernels: it keeps a dict per bucket.

The same cases run in two places:

* CPU-only CI, through the host stand-in (`tests/ops/test_ev_table.py`);
* the GPU machine, through the CUDA table with CuPy or torch memory
  (`benchmarks/gpu/check.sh` runs this file as a script).

Usage as a script:
    python tests/ops/ev_table_parity.py --core build/libge_cuda.so \\
        --memory cupy [--quick] [--json results.json]
"""

import argparse
import json
import sys
import time

import numpy as np

import cuda_parity  # beside this file: the core's bindings, loaded by path

cc = cuda_parity.cc
et = cc.load_sibling("ev_table_core.py")
BUCKET = et.BUCKET
MASK64 = (1 << 64) - 1


class Failure(AssertionError):
    """A parity case found a difference."""


def mix(key):
    """The table's hash (ev_table_hash.h Mix) of one int64 key."""
    x = key & MASK64
    x ^= x >> 33
    x = (x * 0xff51afd7ed558ccd) & MASK64
    x ^= x >> 33
    x = (x * 0xc4ceb9fe1a85ec53) & MASK64
    x ^= x >> 33
    return x


class Model:
    """The table's semantics in plain Python: a dict per bucket of
    key -> [value, slots, freq, version, slot]. A new key takes the
    lowest free slot of its bucket, else the slot of the bucket's least
    valuable unpinned key (LRU: oldest version; LFU: smallest freq, then
    oldest version; then the lower slot). Keys with version >= the
    call's step are pinned."""

    def __init__(self, num_buckets, dim, defaults, num_slots=0,
                 slot_inits=(), policy="lru", filter_freq=0,
                 no_permission=0.0):
        self.nb = num_buckets
        self.dim = dim
        self.defaults = np.asarray(defaults, np.float32)
        self.num_slots = num_slots
        self.slot_inits = list(slot_inits)
        self.policy = policy
        self.filter_freq = filter_freq
        self.no_permission = np.float32(no_permission)
        self.buckets = [dict() for _ in range(num_buckets)]
        self.now = 0

    def bucket(self, key):
        return self.buckets[(mix(int(key)) >> 32) & (self.nb - 1)]

    def admitted(self, entry):
        return self.filter_freq <= 0 or entry[2] >= self.filter_freq

    def absent_row(self, key):
        if self.filter_freq > 0:
            return np.full(self.dim, self.no_permission, np.float32)
        return self.defaults[int(key) % len(self.defaults)].copy()

    def new_entry(self, key, version, slot):
        slots = [np.full(self.dim, v, np.float32) for v in self.slot_inits]
        return [self.absent_row_default(key), slots, 0, version, slot]

    def absent_row_default(self, key):
        return self.defaults[int(key) % len(self.defaults)].copy()

    def _victim(self, bucket):
        """The key a full bucket gives up, or None (all pinned)."""
        best = None
        for key, e in bucket.items():
            if e[3] >= self.now:
                continue
            rank = ((e[2] if self.policy == "lfu" else 0), e[3], e[4])
            if best is None or rank < best[0]:
                best = (rank, key)
        return None if best is None else best[1]

    def _place(self, key, evicted):
        """The slot `key` takes in its bucket (evicting), or None."""
        bucket = self.bucket(key)
        base = ((mix(int(key)) >> 32) & (self.nb - 1)) * BUCKET
        if len(bucket) < BUCKET:
            used = {e[4] for e in bucket.values()}
            return next(s for s in range(base, base + BUCKET)
                        if s not in used)
        victim = self._victim(bucket)
        if victim is None:
            return None
        evicted[victim] = bucket.pop(victim)
        return evicted[victim][4]

    def _missing_order(self, keys, missing):
        return sorted(missing, key=lambda j: (
            (mix(int(keys[j])) >> 32) & (self.nb - 1), j))

    def find(self, keys):
        rows = np.empty((len(keys), self.dim), np.float32)
        for j, key in enumerate(keys):
            e = self.bucket(key).get(int(key))
            rows[j] = e[0] if e is not None and self.admitted(e) else \
                self.absent_row(key)
        return rows

    def stamp(self, keys, step):
        """ge_ev_stamp: slots of stored admitted keys (else -1); every
        stored key's version becomes max(step, 0)."""
        out = np.full(len(keys), -1, np.int64)
        for j, key in enumerate(keys):
            e = self.bucket(key).get(int(key))
            if e is None:
                continue
            e[3] = max(int(step), 0)
            if self.admitted(e):
                out[j] = e[4]
        return out

    def swap_versions(self, keys, versions):
        """ge_ev_swap_versions: stored keys trade versions with the
        array's entries."""
        out = np.array(versions, np.int64)
        for j, key in enumerate(keys):
            e = self.bucket(key).get(int(key))
            if e is not None:
                e[3], out[j] = int(out[j]), e[3]
        return out

    def find_or_insert(self, keys, step):
        """(rows, stored per occurrence, evicted dict, full count)."""
        self.now = version = max(int(step), 0)
        rows = np.empty((len(keys), self.dim), np.float32)
        stored = np.zeros(len(keys), bool)
        missing = []
        for j, key in enumerate(keys):
            e = self.bucket(key).get(int(key))
            if e is None:
                missing.append(j)
                continue
            e[3] = max(e[3], version)
            rows[j] = e[0] if self.admitted(e) else self.no_permission
            stored[j] = True
        evicted, full = {}, 0
        for j in self._missing_order(keys, missing):
            key = int(keys[j])
            bucket = self.bucket(key)
            if key not in bucket:
                slot = self._place(key, evicted)
                if slot is None:
                    full += 1
                    rows[j] = self.absent_row(key)
                    continue
                bucket[key] = self.new_entry(key, version, slot)
            stored[j] = True
            rows[j] = (bucket[key][0] if self.filter_freq <= 0 else
                       self.no_permission)
        for j, key in enumerate(keys):
            if stored[j]:
                self.bucket(key)[int(key)][2] += 1
        return rows, stored, evicted, full

    def insert(self, keys, rows, slots, freq, version, step):
        """Import; the call's keys are pinned (version = the step) until
        it ends, then take their own versions."""
        self.now = max(int(step), 0)
        evicted, full = {}, 0
        missing = []

        def state(j, slot):
            return [np.asarray(rows[j], np.float32).copy(),
                    [np.asarray(slots[k][j], np.float32).copy()
                     for k in range(self.num_slots)] if slots is not None
                    else [np.full(self.dim, v, np.float32)
                          for v in self.slot_inits],
                    int(freq[j]) if freq is not None else 0, self.now,
                    slot]

        for j, key in enumerate(keys):
            old = self.bucket(key).get(int(key))
            if old is not None:
                self.bucket(key)[int(key)] = state(j, old[4])
            else:
                missing.append(j)
        for j in self._missing_order(keys, missing):
            key = int(keys[j])
            slot = self._place(key, evicted)
            if slot is None:
                full += 1
                continue
            self.bucket(key)[key] = state(j, slot)
        for j, key in enumerate(keys):
            e = self.bucket(key).get(int(key))
            if e is not None and version is not None:
                e[3] = int(version[j])
        return evicted, full

    def evict(self, step, steps_to_live=0, l2_threshold=-1.0):
        evicted = {}
        for bucket in self.buckets:
            for key in list(bucket):
                e = bucket[key]
                if steps_to_live > 0:
                    doomed = max(step, 0) - e[3] > steps_to_live
                elif l2_threshold >= 0:
                    # The threshold is a float32 attribute, as the CPU's.
                    v = e[0].astype(np.float64)
                    doomed = (0.5 * float(np.dot(v, v)) <
                              float(np.float32(l2_threshold)))
                else:
                    doomed = False
                if doomed:
                    evicted[key] = bucket.pop(key)
        return evicted

    def size(self):
        return sum(len(b) for b in self.buckets)

    def entries(self):
        return {k: e for b in self.buckets for k, e in b.items()}


# -- comparisons -------------------------------------------------------------
def _same(what, got, want, exact=True):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not (
            np.array_equal(got, want) if exact else
            np.allclose(got, want, rtol=1e-6, atol=1e-6)):
        diff = (np.argwhere(got != want)[:3] if got.shape == want.shape
                else f"shapes {got.shape} vs {want.shape}")
        raise Failure(f"{what}: differs at {diff}")


def check_state(table, model, what, placement=True):
    """The table's export equals the model's entries, key by key, no key
    is stored twice and (`placement`) the export's order, slot order, is
    the model's."""
    got = table.export()
    keys = got["keys"]
    if len(np.unique(keys)) != len(keys):
        raise Failure(f"{what}: a key is stored twice")
    want = model.entries()
    if sorted(int(k) for k in keys) != sorted(want):
        extra = set(int(k) for k in keys) ^ set(want)
        raise Failure(f"{what}: key sets differ ({len(extra)} keys, e.g. "
                      f"{sorted(extra)[:3]})")
    if table.size() != model.size():
        raise Failure(f"{what}: size {table.size()} != {model.size()}")
    by_slot = [k for k, _ in sorted(want.items(), key=lambda kv: kv[1][4])]
    if placement and [int(k) for k in keys] != by_slot:
        raise Failure(f"{what}: keys are not where the model put them")
    order = {int(k): i for i, k in enumerate(keys)}
    idx = [order[k] for k in sorted(want)]
    ks = sorted(want)
    _same(what + " values", got["values"][idx],
          np.stack([want[k][0] for k in ks]) if ks else
          np.zeros((0, table.dim), np.float32))
    _same(what + " freq", got["freq"][idx], [want[k][2] for k in ks])
    _same(what + " version", got["version"][idx], [want[k][3] for k in ks])
    for s in range(table.num_slots):
        _same(f"{what} slot {s}", got["slots"][s][idx],
              np.stack([want[k][1][s] for k in ks]) if ks else
              np.zeros((0, table.dim), np.float32))


def check_evicted(got, want, what, num_slots):
    keys = [int(k) for k in got["keys"]]
    if sorted(keys) != sorted(want):
        raise Failure(f"{what}: evicted {sorted(keys)[:5]}..., model "
                      f"{sorted(want)[:5]}... ({len(keys)} vs {len(want)})")
    for i, k in enumerate(keys):
        _same(f"{what} evicted value of {k}", got["values"][i], want[k][0])
        _same(f"{what} evicted freq of {k}", got["freq"][i], want[k][2])
        _same(f"{what} evicted version of {k}", got["version"][i],
              want[k][3])
        for s in range(num_slots):
            _same(f"{what} evicted slot of {k}", got["slots"][s][i],
                  want[k][1][s])


def check_slots(keys, slots, stored, model, what):
    """Each stored occurrence's slot is the one the model placed its key
    in (so one slot per key, in its bucket, distinct keys apart); -1
    exactly where nothing was stored."""
    for key, s, ok in zip(keys, slots, stored):
        want = model.bucket(key)[int(key)][4] if ok else -1
        if s != want:
            raise Failure(f"{what}: key {key} in slot {s}, model {want}")


# -- a context: the core and memory a case runs on ----------------------------
class Context:
    """What every case needs: a loaded core and a memory adapter."""

    def __init__(self, core, memory):
        self.core = core
        self.memory = memory

    def pair(self, num_buckets, dim, num_slots=0, policy="lru",
             filter_freq=0, no_permission=0.0, default_rows=7, seed=0):
        rng = np.random.default_rng(seed)
        defaults = rng.standard_normal((default_rows, dim)).astype(
            np.float32)
        inits = [0.1 * (s + 1) for s in range(num_slots)]
        table = et.EvTable(self.core, self.memory, num_buckets, dim,
                           defaults, num_slots, inits, policy, filter_freq,
                           no_permission)
        model = Model(num_buckets, dim, defaults, num_slots, inits, policy,
                      filter_freq, no_permission)
        return table, model


def train_batch(table, model, keys, step, what, keep_evicted=True):
    """One find_or_insert on both, everything compared."""
    rows, slots, evicted = table.find_or_insert(keys, step, keep_evicted)
    want_rows, stored, want_evicted, full = model.find_or_insert(keys, step)
    _same(what + " rows", rows, want_rows)
    check_slots(keys, slots, stored, model, what)
    if keep_evicted:
        check_evicted(evicted, want_evicted, what, table.num_slots)
    return full


def keys_of(rng, n, space, dup=0.3, negative=True):
    """n keys from [-space, space) (or [0, space)), a share repeated."""
    lo = -space if negative else 0
    keys = rng.integers(lo, space, n)
    if n > 1 and dup:
        rep = rng.random(n) < dup
        keys[rep] = rng.choice(keys, rep.sum())
    return keys.astype(np.int64)


# -- cases ---------------------------------------------------------------------
def case_insert_and_find(ctx, dim, num_slots, seed):
    """New keys take their default rows; duplicates share one slot; find
    reads stored rows and default rows of absent keys."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(8, dim, num_slots, seed=seed)
    for step in range(3):
        train_batch(table, model, keys_of(rng, 300, 400), step, f"step {step}")
    check_state(table, model, "after training")
    probe = keys_of(rng, 200, 600)
    rows, slots = table.find(probe)
    _same("find rows", rows, model.find(probe))
    for key, s in zip(probe, slots):
        if (s >= 0) != (int(key) in model.bucket(key)):
            raise Failure(f"find slot of {key}: {s}")
    if table.counters()["bad_keys"] != 0:
        raise Failure("bad keys counted without any")


def case_counter_filter(ctx, seed):
    """CounterFilter(3): no_permission until 3 occurrences were counted
    before the batch, every occurrence counted, find the same."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(4, 8, 1, filter_freq=3, no_permission=-0.5,
                            seed=seed)
    for step in range(6):
        keys = keys_of(rng, 120, 60, dup=0.5)
        train_batch(table, model, keys, step, f"filter step {step}")
    check_state(table, model, "filter state")
    probe = keys_of(rng, 100, 90)
    rows, _ = table.find(probe)
    _same("filtered find", rows, model.find(probe))


def case_capacity_eviction(ctx, policy, seed):
    """More keys than the capacity: full buckets give up the least
    valuable unpinned key (LRU / LFU), the evicted keys come out whole."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(2, 4, 1, policy=policy, seed=seed)
    hot = rng.integers(0, 10 ** 6, 40)
    for step in range(12):
        keys = np.concatenate([rng.choice(hot, 60),
                               rng.integers(0, 10 ** 6, 90)]).astype(np.int64)
        full = train_batch(table, model, keys, step, f"{policy} step {step}")
        if full:
            raise Failure(f"{policy}: {full} keys refused below the pin "
                          f"limit")
    if table.size() != 2 * BUCKET:
        raise Failure(f"{policy}: size {table.size()} at load factor 1.0")
    check_state(table, model, f"{policy} state")
    if table.counters()["evicted"] == 0:
        raise Failure(f"{policy}: nothing was evicted")


def case_pinned_full(ctx, seed):
    """One call brings 200 distinct keys into one 128-slot table: 128
    stored, 72 counted as full, none stored twice, none half-written."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(1, 4, seed=seed)
    keys = rng.permutation(np.arange(10 ** 6, 10 ** 6 + 200)).astype(np.int64)
    keys = np.concatenate([keys, keys[:50]])
    full = train_batch(table, model, keys, 1, "pinned")
    got = table.counters()["full"]
    # 72 of the 200 find no slot, and so do their repeats among the 50.
    if got != full or full < 72 or table.size() != BUCKET:
        raise Failure(f"full counted {got}, model {full}, size "
                      f"{table.size()}")
    check_state(table, model, "pinned state")


def case_rule_eviction(ctx, seed):
    """GlobalStepEvict and L2WeightEvict remove exactly the model's keys,
    handing each out whole."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(8, 6, 2, seed=seed, default_rows=50)
    for step in range(0, 30, 3):
        train_batch(table, model, keys_of(rng, 150, 300), step, "steps")
    got = table.evict(30, steps_to_live=10, keep_evicted=True)
    check_evicted(got, model.evict(30, steps_to_live=10), "global step", 2)
    check_state(table, model, "after global step evict")
    norms = [0.5 * float(np.dot(e[0].astype(np.float64), e[0]))
             for e in model.entries().values()]
    threshold = float(np.median(norms))
    got = table.evict(31, l2_threshold=threshold, keep_evicted=True)
    check_evicted(got, model.evict(31, l2_threshold=threshold), "l2", 2)
    check_state(table, model, "after l2 evict")


def case_export_import(ctx, seed):
    """An export imported into a fresh table gives the same state; an
    import overwrites present keys and inserts absent ones."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(4, 5, 2, policy="lfu", filter_freq=2, seed=seed)
    for step in range(4):
        train_batch(table, model, keys_of(rng, 200, 300), step, "fill")
    state = table.export()
    other, other_model = ctx.pair(4, 5, 2, policy="lfu", filter_freq=2,
                                  seed=seed)
    other.insert(state["keys"], state["values"], state["slots"],
                 state["freq"], state["version"])
    other_model.insert(state["keys"], state["values"], state["slots"],
                       state["freq"], state["version"], 0)
    # A fresh table packs the keys into the lowest slots: same content,
    # other places.
    check_state(other, model, "round trip", placement=False)
    check_state(other, other_model, "round trip (model)")
    keys = np.unique(keys_of(rng, 120, 400))
    n = len(keys)
    rows = rng.standard_normal((n, 5)).astype(np.float32)
    slots = rng.standard_normal((2, n, 5)).astype(np.float32)
    freq = rng.integers(0, 5, n)
    version = rng.integers(0, 9, n)
    got = other.insert(keys, rows, slots, freq, version, step=10,
                       keep_evicted=True)
    ev, _ = other_model.insert(keys, rows, slots, freq, version, 10)
    check_evicted(got, ev, "import", 2)
    check_state(other, other_model, "after import")


def case_bad_keys(ctx, seed):
    """The reserved key is counted and reads as absent; nothing stored."""
    table, model = ctx.pair(2, 4, seed=seed)
    keys = np.array([5, et.EMPTY_KEY, 5, 7], np.int64)
    rows, slots, _ = table.find_or_insert(keys, 1)
    if table.counters()["bad_keys"] != 1 or slots[1] != -1:
        raise Failure(f"reserved key: counters {table.counters()}, slot "
                      f"{slots[1]}")
    _same("reserved key row", rows[1], model.absent_row(et.EMPTY_KEY))
    if table.size() != 2:
        raise Failure(f"size {table.size()} after 2 distinct keys")


def case_stamp(ctx, seed):
    """ge_ev_stamp (an optimizer step's keys): stored admitted keys give
    their slot, absent and unadmitted ones -1; every stored key, admitted
    or not, takes the step as its version; nothing is inserted; the
    reserved key is counted."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(4, 4, 1, filter_freq=2, seed=seed)
    for step in range(3):
        train_batch(table, model, keys_of(rng, 80, 70, dup=0.5), step,
                    f"stamp train {step}")
        probe = keys_of(rng, 120, 100, dup=0.4)
        probe[0] = et.EMPTY_KEY
        before = table.counters()["bad_keys"]
        _same(f"stamp slots {step}", table.stamp(probe, 10 + step),
              model.stamp(probe, 10 + step))
        if table.counters()["bad_keys"] != before + 1:
            raise Failure("the reserved key was not counted by stamp")
        check_state(table, model, f"after stamp {step}")


def case_swap_versions(ctx, seed):
    """ge_ev_swap_versions pins keys (version INT64_MAX) through an import
    into a full table: the import evicts only unpinned keys; the second
    swap gives every key its version back; absent keys are untouched."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(1, 4, 1, policy="lru", seed=seed)
    stored = rng.permutation(np.arange(1000, 1000 + BUCKET)).astype(np.int64)
    for step in range(4):  # versions 0..3: the oldest would go first
        part = stored[step * 32:(step + 1) * 32]
        train_batch(table, model, part, step, f"swap fill {step}")
    pinned = np.concatenate([stored[:40], [5, 6]]).astype(np.int64)
    rng.shuffle(pinned)
    pin = np.full(pinned.size, np.iinfo(np.int64).max, np.int64)
    # Copies: host memory may hand the array itself to the core.
    got_saved = table.swap_versions(pinned, pin.copy())
    want_saved = model.swap_versions(pinned, pin.copy())
    _same("swap out", got_saved, want_saved)
    check_state(table, model, "pinned")
    fresh = np.arange(5000, 5030, dtype=np.int64)
    rows = rng.standard_normal((30, 4)).astype(np.float32)
    slots = rng.standard_normal((1, 30, 4)).astype(np.float32)
    freq, version = rng.integers(0, 9, 30), rng.integers(0, 9, 30)
    got = table.insert(fresh, rows, slots, freq, version, step=4,
                       keep_evicted=True)
    want, _ = model.insert(fresh, rows, slots, freq, version, 4)
    check_evicted(got, want, "import past pinned keys", 1)
    if len(want) != 30 or set(want) & set(int(k) for k in pinned):
        raise Failure(f"the model evicted {sorted(want)[:5]}...")
    _same("swap back", table.swap_versions(pinned, got_saved.copy()),
          model.swap_versions(pinned, want_saved.copy()))
    check_state(table, model, "restored")


def case_refusals(ctx, seed):
    """Bad host arguments are refused before anything runs."""
    table, _ = ctx.pair(2, 4, seed=seed)
    import ctypes
    bad = et.GeEvTable.from_buffer_copy(table.desc)
    bad.num_buckets = 3
    status = table.lib.ge_ev_find(ctypes.byref(bad), None, 0, None, None,
                                  None, None)
    if status != -1:
        raise Failure(f"3 buckets accepted ({status})")
    keys = ctx.memory.put(np.arange(10, dtype=np.int64))
    scratch = ctx.memory.empty((8,), np.uint8)
    status = table.lib.ge_ev_find_or_insert(
        ctypes.byref(table.desc), ctx.memory.ptr(keys), 10, 0, 1, None, None,
        None, ctx.memory.ptr(scratch), 8, ctx.memory.ptr(
            table._keep["counters"]), ctx.memory.stream)
    if status != -2:
        raise Failure(f"small scratch accepted ({status})")
    # A group naming one table twice (its buckets would be written by two
    # tiles at once), or a batch naming a table the call does not have.
    twice = (et.GeEvTable * 2)(table.desc, table.desc)
    batch = (et.GeEvBatch * 1)()
    batch[0].table, batch[0].keys, batch[0].n = 0, ctx.memory.ptr(keys), 10
    big = ctx.memory.empty((1 << 16,), np.uint8)
    for descs, nt, which, why in ((twice, 2, 0, "the same table twice"),
                                  (twice, 1, 1, "table 1 of 1")):
        batch[0].table = which
        status = table.lib.ge_ev_find_or_insert_group(
            descs, nt, batch, 1, 0, None, ctx.memory.ptr(big), 1 << 16,
            ctx.memory.ptr(table._keep["counters"]), ctx.memory.stream)
        if status != -1:
            raise Failure(f"a group with {why} accepted ({status})")


def case_stress(ctx, batches, n, seed):
    """`batches` training calls of random and duplicated keys on a table
    at load factor 1.0: after every call no key is stored twice, every
    stored key of the call is found, and the state is the model's."""
    rng = np.random.default_rng(seed)
    table, model = ctx.pair(16, 8, 1, policy="lfu" if seed % 2 else "lru",
                            seed=seed)
    for b in range(batches):
        keys = keys_of(rng, n, 6 * 16 * BUCKET, dup=0.4)
        train_batch(table, model, keys, b, f"stress {b}")
        _, slots = table.find(keys)
        stored = np.array([int(k) in model.bucket(k) for k in keys])
        if not np.array_equal(slots >= 0, stored):
            raise Failure(f"stress {b}: a stored key is not found")
        if b % 10 == 9 or b == batches - 1:
            check_state(table, model, f"stress {b}")


def case_group(ctx, seed):
    """Three features over two tables (one shared by two features, one
    filtered, LRU and LFU) in one group call per step: every feature's
    rows and slots, and each table's state, are those of the model fed
    each table's keys in batch order."""
    rng = np.random.default_rng(seed)
    t0, m0 = ctx.pair(2, 4, 1, policy="lru", seed=seed)
    t1, m1 = ctx.pair(2, 8, 0, policy="lfu", filter_freq=2,
                      no_permission=0.25, seed=seed + 1)
    group = et.EvGroup([t0, t1])
    models = [m0, m1]
    for step in range(8):
        keys = [keys_of(rng, 90, 500), keys_of(rng, 60, 300),
                keys_of(rng, 70, 500)]
        owner = [0, 1, 0]
        got = group.find_or_insert(list(zip(owner, keys)), step)
        for t, model in enumerate(models):
            mine = [f for f in range(3) if owner[f] == t]
            cat = np.concatenate([keys[f] for f in mine])
            rows, stored, _, _ = model.find_or_insert(cat, step)
            start = 0
            for f in mine:
                end = start + len(keys[f])
                what = f"group step {step} feature {f}"
                _same(what + " rows", got[f][0], rows[start:end])
                check_slots(keys[f], got[f][1], stored[start:end], model,
                            what)
                start = end
    check_state(t0, m0, "group table 0")
    check_state(t1, m1, "group table 1")
    if group.counters()["evicted"] == 0:
        raise Failure("group: nothing was evicted")


def all_cases(quick=False):
    """(name, callable(ctx)) of every case."""
    cases = []
    for dim in ((1, 4, 33) if quick else (1, 3, 4, 16, 32, 33, 128)):
        for slots in (0, 2):
            cases.append((f"insert_find_d{dim}_s{slots}",
                          lambda c, d=dim, s=slots: case_insert_and_find(
                              c, d, s, d * 10 + s)))
    cases.append(("counter_filter", lambda c: case_counter_filter(c, 3)))
    for policy in ("lru", "lfu"):
        cases.append((f"capacity_{policy}",
                      lambda c, p=policy: case_capacity_eviction(c, p, 5)))
    cases.append(("pinned_full", lambda c: case_pinned_full(c, 7)))
    cases.append(("rule_eviction", lambda c: case_rule_eviction(c, 11)))
    cases.append(("export_import", lambda c: case_export_import(c, 13)))
    cases.append(("bad_keys", lambda c: case_bad_keys(c, 17)))
    cases.append(("stamp", lambda c: case_stamp(c, 29)))
    cases.append(("swap_versions", lambda c: case_swap_versions(c, 31)))
    cases.append(("group", lambda c: case_group(c, 23)))
    cases.append(("refusals", lambda c: case_refusals(c, 19)))
    for seed in (1, 2):
        cases.append((f"stress_{seed}",
                      lambda c, s=seed: case_stress(
                          c, 10 if quick else 100, 1500, s)))
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", required=True)
    parser.add_argument("--memory", choices=("cupy", "torch", "host"),
                        default="cupy")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    core = cc.Core(args.core)
    memory = {"cupy": cc.CupyMemory, "torch": cc.TorchMemory,
              "host": cc.HostMemory}[args.memory]()
    ctx = Context(core, memory)
    results, failed = [], 0
    for name, case in all_cases(args.quick):
        t0 = time.time()
        try:
            case(ctx)
            status, why = "pass", ""
        except Exception as e:  # recorded, the other cases still run
            status, why = "FAIL", f"{type(e).__name__}: {e}"
            failed += 1
        results.append({"case": name, "status": status, "detail": why,
                        "seconds": round(time.time() - t0, 3)})
        print(f"{status} {name} {why}", flush=True)
    summary = {"core": args.core, "backend": core.backend,
               "memory": args.memory, "passed": len(results) - failed,
               "failed": failed, "cases": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print(f"{len(results) - failed}/{len(results)} passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
