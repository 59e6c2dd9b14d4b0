"""EmbeddingVariable with an SSD tier (StorageType.DRAM_SSDHASH) vs all-DRAM.

Default mode (issue 36 point 4, second half): one EV of `--keys` keys
(20M) x dim 16 trained with `ge.optimizers.Adagrad` on Zipf(1.05) ids,
batches of `--batch` samples x `--ids-per-sample` ids (4096 x 26, the
criteo-like step's id count, sum-pooled), twice in one process: an
all-DRAM EV (the anchor) and an EV whose DRAM tier holds `--dram-fraction`
(20%) of the keys, on the same ids, timed in alternating rounds. Both
first insert every key (one training step per `--fill-batch` new keys:
the tier's insert rate), then warm up on Zipf batches (the LFU counts
learn the hot keys), then are timed. Reports the step time ratio
tier/DRAM (target <= 1.3), the tier's hit rate (distinct keys of a step
found in DRAM, from `ev_storage.tier_stats`' promotions), and checks
that both EVs hold bitwise equal rows for a sample of keys. Then the
bound: the oracle (a DRAM tier of the same size holding the truly
hottest keys, the lowest ranks) and its misses a step, whose bare file
I/O `tier_io_floor.cc` measures on the tier file itself (record reads
by pread and io_uring, appends; built with the C++ compiler where there
is one): the ratio the I/O alone would give.

`--scale` (issue 36 point 4, first half): only the tier EV, `--keys`
200M x dim 16, Adagrad, a 4 GiB DRAM tier under `--storage-path`
(deleted at the end; about 26 GB on disk): inserts every key, then
trains on Zipf ids; reports new keys/s (target >= 0.5M), peak RSS
(target <= the DRAM budget + 2 GiB) and the step time. The fill stops
after `--max-fill-minutes`, reporting the keys inserted and the rate.

Zipf ids: ranks drawn from the continuous power law x^-1.05 on [1, N+1)
(inverse CDF, no N-sized table), floored; rank r is key r * an odd
64-bit constant (a bijection of int64), so hot keys are spread over
the hash space as real ids are.

Usage: python benchmarks/ev_tier_bench.py [--quick] [--scale] [--out F]
"""

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import tempfile
import time

import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import ev_storage

ZIPF_S = 1.05
DIM = 16
# DRAM bytes of a key with an Adagrad slot (see ev_storage.h): key, freq
# and version (24), bucket, marks and the spill's candidate (29), value
# and slot (2 * 4 * D).
_ROW_BYTES = 24 + 29 + 2 * 4 * DIM
# The disk tier's index (ev_ssd_tier.h's TierIndex): 12 bytes a slot at a
# load between 0.64 and 0.8; budgeted at the lower load.
_INDEX_BYTES_PER_KEY = 12 / 0.64
_MULT = np.uint64(0x9E3779B97F4A7C15)


def zipf_ranks(rng, num_keys, n):
    """`n` ranks in [0, num_keys) of the bounded power law x^-ZIPF_S."""
    u = rng.random(n)
    a = 1.0 - ZIPF_S
    hi = (num_keys + 1.0) ** a
    x = (1.0 + u * (hi - 1.0)) ** (1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, num_keys - 1)


def keys_of(ranks):
    """Rank -> key, a bijection of int64 (multiplication by an odd
    constant modulo 2^64)."""
    with np.errstate(over="ignore"):
        return (ranks.astype(np.uint64) * _MULT).view(np.int64)


def make_batches(rng, num_keys, batch, per_sample, count, keep=()):
    """`count` ragged [batch, per_sample] Zipf id batches, the number of
    distinct keys of each, and the distinct ranks of the batches whose
    numbers are in `keep` (None for the others)."""
    out, distinct, kept = [], [], []
    for i in range(count):
        ranks = zipf_ranks(rng, num_keys, batch * per_sample)
        unique = np.unique(ranks)  # keys_of is a bijection
        distinct.append(len(unique))
        kept.append(unique if i in keep else None)
        out.append(tf.RaggedTensor.from_uniform_row_length(
            tf.constant(keys_of(ranks)), per_sample))
    return out, distinct, kept


def fill_batch(begin, end):
    """Keys of ranks [begin, end), one per sample."""
    ids = keys_of(np.arange(begin, end, dtype=np.int64))
    return tf.RaggedTensor.from_uniform_row_length(tf.constant(ids), 1)


def make_ev(name, storage):
    init = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    option = ge.EmbeddingVariableOption(
        storage_option=storage or ge.StorageOption())
    return ge.get_embedding_variable(name, DIM, initializer=init,
                                     ev_option=option)


def make_step(ev):
    opt = ge.optimizers.Adagrad(0.01, 0.1)

    # One trace for the fill's and the Zipf batches' shapes.
    @tf.function(reduce_retracing=True)
    def step(ids):
        with tf.GradientTape() as tape:
            (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
            loss = tf.reduce_mean(tf.square(emb - 0.1))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])
        return loss
    return step


def tier_stats(ev):
    """dict of the tier's counters (ev_storage.tier_stats)."""
    v = ev_storage.tier_stats(ev.handle).numpy()
    return {"dram_keys": int(v[0]), "disk_keys": int(v[1]),
            "promotions": int(v[2]), "spills": int(v[3]),
            "index_bytes": int(v[4]), "promote_s": v[5] / 1e9,
            "spill_s": v[6] / 1e9, "compactions": int(v[7])}


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def fill(step, num_keys, chunk, deadline=None, log=None):
    """Inserts ranks [0, num_keys) by training steps of `chunk` new keys;
    returns (keys inserted, seconds). Stops at `deadline` (perf_counter)."""
    start = time.perf_counter()
    done = 0
    while done < num_keys:
        end = min(num_keys, done + chunk)
        step(fill_batch(done, end)).numpy()
        done = end
        if log is not None:
            log(done, time.perf_counter() - start)
        if deadline is not None and time.perf_counter() > deadline:
            break
    return done, time.perf_counter() - start


def timed(step, batches, steps, offset):
    """(wall seconds, process CPU seconds) per step. The CPU time of all
    the process's threads is the steadier measure on a shared machine:
    other processes' load stretches wall time, not this one's CPU."""
    start, cpu = time.perf_counter(), time.process_time()
    loss = None
    for i in range(steps):
        loss = step(batches[(offset + i) % len(batches)])
    loss.numpy()
    return ((time.perf_counter() - start) / steps,
            (time.process_time() - cpu) / steps)


def rows_of(ev, keys):
    """The EV's rows of `keys` (training=False: no insert)."""
    ids = tf.RaggedTensor.from_uniform_row_length(tf.constant(keys), 1)
    (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum",
                                              training=False)
    return emb.numpy()


def sample_keys(rng, num_keys, n):
    """Hot (Zipf) and uniformly drawn keys, inserted ones only."""
    ranks = np.concatenate([zipf_ranks(rng, num_keys, n // 2),
                            rng.integers(0, num_keys, n - n // 2)])
    return keys_of(np.unique(ranks))


_FLOOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "tier_io_floor.cc")


def io_floor(path, reads, dram_ms):
    """The bare file I/O of `reads` misses a step (tier_io_floor.cc, run
    on the tier file under `path`): a dict with its measures and the
    step ratio tier/DRAM that the I/O alone would give, or why it was not
    measured (no C++ compiler)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return {"not_measured": "no C++ compiler (g++, c++ or $CXX)"}
    files = sorted(f for f in os.listdir(path) if f.endswith(".tier"))
    if len(files) != 1:
        raise AssertionError(f"expected one tier file in {path}: {files}")
    tier_file = os.path.join(path, files[0])
    with open(tier_file, "rb") as f:
        magic, dim, slot_floats = struct.unpack("<8sII", f.read(16))
    if magic != b"GESSDT01" or dim != DIM:
        raise AssertionError(f"{tier_file}: unexpected header {magic!r} "
                             f"dim {dim}")
    record = 24 + 4 * (dim + slot_floats) + 4  # ev_ssd_tier.h's layout
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "tier_io_floor")
        subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", "-o", exe,
                        _FLOOR_SOURCE], check=True)
        out = subprocess.run(
            [exe, tier_file, "16", str(record), str(max(1, int(reads))),
             str(os.cpu_count() or 1), "20"],
            check=True, capture_output=True, text=True).stdout
    floor = json.loads(out)
    floor["record_bytes"] = record
    # Every miss is a record read (on all threads; pread or io_uring,
    # the faster) and a row spilled (a record appended): what the step
    # pays at least, over the DRAM step.
    reads = floor["pread_ms"]
    if floor["uring_ms"] >= 0:
        reads = min(reads, floor["uring_ms"])
    floor["io_ms_per_step"] = reads + floor["append_ms"]
    floor["ratio_if_io_were_all_extra"] = (
        (dram_ms + floor["io_ms_per_step"]) / dram_ms)
    # The mapping's reads were timed on one thread; as if they split
    # evenly over the threads.
    floor["ratio_with_warm_mmap_reads"] = (
        (dram_ms + floor["mmap_warm_ms"] / floor["threads"] +
         floor["append_ms"]) / dram_ms)
    return floor


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", action="store_true",
                   help="200M keys, 4 GiB DRAM tier, tier EV only")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--keys", type=int,
                   help="keys inserted (default 20M; --scale 200M)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--ids-per-sample", type=int, default=26)
    p.add_argument("--dram-fraction", type=float, default=0.2,
                   help="share of the keys the DRAM tier holds")
    p.add_argument("--dram-gib", type=float, default=4.0,
                   help="--scale: the DRAM tier's budget")
    p.add_argument("--fill-batch", type=int, default=1 << 20,
                   help="new keys per fill step")
    p.add_argument("--num-batches", type=int,
                   help="distinct Zipf batches (default: one per step, "
                        "warmup and timed, so that no step repeats ids)")
    p.add_argument("--warmup", type=int, default=200,
                   help="Zipf steps before timing")
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache-strategy", default="LFU", choices=("LFU", "LRU"))
    p.add_argument("--max-fill-minutes", type=float, default=20.0)
    p.add_argument("--storage-path",
                   help="tier folder (default: a new temp folder; --scale: "
                        "/tmp/ev_tier_scale), deleted at the end")
    p.add_argument("--note", default="",
                   help="free text stored in the JSON (machine load...)")
    p.add_argument("--out", help="JSON path (default "
                   "benchmarks/results/ev_tier_bench[_scale].json)")
    args = p.parse_args(argv)
    if args.keys is None:
        args.keys = 200_000_000 if args.scale else 20_000_000
    if args.quick:
        args.keys = min(args.keys, 20000)
        args.batch = min(args.batch, 64)
        args.fill_batch = min(args.fill_batch, 4096)
        args.warmup, args.steps, args.rounds = 3, 2, 2
        args.num_batches = 4
    if args.num_batches is None:
        args.num_batches = args.warmup + args.rounds * args.steps
    if args.out is None:
        args.out = os.path.join(
            "benchmarks", "results",
            "ev_tier_bench_scale.json" if args.scale else "ev_tier_bench.json")
    return args


def _storage(path, dram_bytes, strategy):
    return ge.StorageOption(
        ge.StorageType.DRAM_SSDHASH, storage_path=path,
        storage_size=[int(dram_bytes)],
        cache_strategy=getattr(ge.CacheStrategy, strategy))


def run_compare(args, path):
    """Default mode: the tier EV vs the all-DRAM EV on the same ids."""
    rng = np.random.default_rng(0)
    n = args.keys
    in_dram = int(args.dram_fraction * n)
    budget = in_dram * _ROW_BYTES + (n - in_dram) * _INDEX_BYTES_PER_KEY
    dram_ev = make_ev("bench_dram", None)
    tier_ev = make_ev("bench_tier", _storage(path, budget,
                                              args.cache_strategy))
    dram_step, tier_step = make_step(dram_ev), make_step(tier_ev)

    _, dram_fill_s = fill(dram_step, n, args.fill_batch)
    _, tier_fill_s = fill(tier_step, n, args.fill_batch)
    # The timed batches' distinct ranks are kept: the oracle below.
    timed_batches = [(args.warmup + i) % args.num_batches
                     for i in range(args.rounds * args.steps)]
    batches, distinct, ranks = make_batches(
        rng, n, args.batch, args.ids_per_sample, args.num_batches,
        keep=set(timed_batches))
    for i in range(args.warmup):
        b = batches[i % len(batches)]
        dram_step(b).numpy()
        tier_step(b).numpy()
    offset = args.warmup
    before = tier_stats(tier_ev)
    dram_t, tier_t, dram_cpu, tier_cpu = [], [], [], []
    for r in range(args.rounds):  # alternating order shares machine noise
        pair = [(dram_step, dram_t, dram_cpu), (tier_step, tier_t, tier_cpu)]
        for step, times, cpus in (pair if r % 2 == 0 else pair[::-1]):
            wall, cpu = timed(step, batches, args.steps, offset)
            times.append(wall)
            cpus.append(cpu)
        offset += args.steps
    after = tier_stats(tier_ev)
    spills = after["spills"] - before["spills"]
    looked_up = sum(distinct[(args.warmup + i) % len(batches)]
                    for i in range(args.rounds * args.steps))
    promoted = after["promotions"] - before["promotions"]

    probe = sample_keys(rng, n, 20000)
    equal = bool(np.array_equal(rows_of(dram_ev, probe),
                                rows_of(tier_ev, probe)))
    if not equal:
        raise AssertionError("the tier EV's rows differ from the DRAM EV's")
    if int(dram_ev.size()) != int(tier_ev.size()):
        raise AssertionError("sizes differ: %d vs %d" % (
            int(dram_ev.size()), int(tier_ev.size())))
    stats = tier_stats(tier_ev)
    dram_ms = 1e3 * float(np.median(dram_t))
    tier_ms = 1e3 * float(np.median(tier_t))
    # The oracle: a DRAM tier of the same size holding the truly hottest
    # keys (ranks below its size), which no counting policy can beat.
    timed_ranks = [ranks[b] for b in timed_batches]
    held = stats["dram_keys"]
    oracle_misses = float(np.mean([np.count_nonzero(r >= held)
                                   for r in timed_ranks]))
    oracle_hit = 1.0 - oracle_misses * len(timed_ranks) / looked_up
    floor = io_floor(path, oracle_misses, dram_ms)
    return {
        "mode": "compare",
        "keys": n, "dim": DIM, "optimizer": "Adagrad(0.01, 0.1)",
        "ids": "Zipf(%.2f) over the keys" % ZIPF_S,
        "batch": args.batch, "ids_per_sample": args.ids_per_sample,
        "ids_per_step": args.batch * args.ids_per_sample,
        "distinct_keys_per_step": float(np.mean(distinct)),
        "cache_strategy": args.cache_strategy,
        "dram_budget_bytes": int(budget),
        "dram_fraction_target": args.dram_fraction,
        "dram_fraction_held": stats["dram_keys"] / n,
        "dram_step_ms": dram_ms, "tier_step_ms": tier_ms,
        "dram_step_ms_rounds": [1e3 * t for t in dram_t],
        "tier_step_ms_rounds": [1e3 * t for t in tier_t],
        "ratio_tier_over_dram": tier_ms / dram_ms,
        # The median round misses the spills (one of ~500K rows every ~50
        # steps at 20M keys): over all rounds, each step's share of them.
        "dram_step_ms_mean": 1e3 * float(np.mean(dram_t)),
        "tier_step_ms_mean": 1e3 * float(np.mean(tier_t)),
        "ratio_tier_over_dram_mean": float(np.mean(tier_t) /
                                           np.mean(dram_t)),
        "dram_step_cpu_ms": 1e3 * float(np.median(dram_cpu)),
        "tier_step_cpu_ms": 1e3 * float(np.median(tier_cpu)),
        "ratio_tier_over_dram_cpu": float(np.median(tier_cpu) /
                                          np.median(dram_cpu)),
        "ratio_tier_over_dram_per_round": [
            t / d for t, d in zip(tier_t, dram_t)],
        "target_ratio": 1.3,
        "hit_rate_distinct_keys": 1.0 - promoted / looked_up,
        "oracle_hit_rate_distinct_keys": oracle_hit,
        "oracle_misses_per_step": oracle_misses,
        "io_floor_of_oracle_misses": floor,
        "promotions_per_step": promoted / (args.rounds * args.steps),
        "spilled_rows_per_step": spills / (args.rounds * args.steps),
        "promote_ms_per_step": 1e3 * (after["promote_s"] - before[
            "promote_s"]) / (args.rounds * args.steps),
        "spill_ms_per_step": 1e3 * (after["spill_s"] - before["spill_s"]) / (
            args.rounds * args.steps),
        "compactions_timed": after["compactions"] - before["compactions"],
        "fill_keys_per_s_dram": n / dram_fill_s,
        "fill_keys_per_s_tier": n / tier_fill_s,
        "rows_bitwise_equal_sample": equal,
        "tier_stats": stats,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def run_scale(args, path):
    """--scale: the tier EV alone at a size beyond RAM."""
    rng = np.random.default_rng(0)
    budget = int(args.dram_gib * (1 << 30))
    ev = make_ev("bench_scale", _storage(path, budget, args.cache_strategy))
    step = make_step(ev)
    base_rss = current_rss_bytes()
    progress = []

    def log(done, seconds):
        if len(progress) == 0 or done - progress[-1]["keys"] >= 10_000_000 \
                or done == args.keys:
            progress.append({"keys": done, "seconds": round(seconds, 1),
                             "rss_bytes": current_rss_bytes()})
            print("filled %d keys in %.0f s (%.2fM/s), rss %.2f GiB" % (
                done, seconds, done / seconds / 1e6,
                progress[-1]["rss_bytes"] / 2**30), flush=True)

    deadline = time.perf_counter() + 60 * args.max_fill_minutes
    inserted, fill_s = fill(step, args.keys, args.fill_batch, deadline, log)
    rate = inserted / fill_s
    batches, distinct, _ = make_batches(rng, inserted, args.batch,
                                     args.ids_per_sample, args.num_batches)
    for i in range(args.warmup):
        step(batches[i % len(batches)]).numpy()
    before = tier_stats(ev)
    times = [timed(step, batches, args.steps, args.warmup + r * args.steps)[0]
             for r in range(args.rounds)]
    after = tier_stats(ev)
    looked_up = sum(distinct[(args.warmup + i) % len(batches)]
                    for i in range(args.rounds * args.steps))
    promoted = after["promotions"] - before["promotions"]
    size = int(ev.size())
    if size != inserted:
        raise AssertionError("size %d != %d keys inserted" % (size, inserted))
    disk = sum(os.path.getsize(os.path.join(path, f))
               for f in os.listdir(path))
    peak = peak_rss_bytes()
    return {
        "mode": "scale",
        "keys_target": args.keys, "keys_inserted": inserted,
        "fill_completed": inserted == args.keys,
        "dim": DIM, "optimizer": "Adagrad(0.01, 0.1)",
        "ids": "Zipf(%.2f) over the inserted keys" % ZIPF_S,
        "fill_batch": args.fill_batch,
        "fill_seconds": fill_s,
        "new_keys_per_s": rate, "target_new_keys_per_s": 500_000,
        "fill_seconds_extrapolated_to_target":
            args.keys / rate,
        "fill_progress": progress,
        "batch": args.batch, "ids_per_sample": args.ids_per_sample,
        "train_step_ms": 1e3 * float(np.median(times)),
        "train_step_ms_rounds": [1e3 * t for t in times],
        "hit_rate_distinct_keys": 1.0 - promoted / looked_up,
        "dram_budget_bytes": budget,
        "peak_rss_bytes": peak,
        "rss_before_fill_bytes": base_rss,
        "peak_rss_limit_bytes": budget + (2 << 30),
        "peak_rss_within_limit": peak <= budget + (2 << 30),
        "tier_file_bytes": disk,
        "tier_stats": tier_stats(ev),
    }


def main(argv=None):
    args = parse_args(argv)
    default = "/tmp/ev_tier_scale" if args.scale else None
    path = args.storage_path or default
    if path is None:
        path = tempfile.mkdtemp(prefix="ev_tier_bench_")
    else:
        os.makedirs(path, exist_ok=False)
    try:
        result = run_scale(args, path) if args.scale else run_compare(
            args, path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    result["machine"] = ("%d CPU cores%s" % (os.cpu_count(), (
        "; " + args.note) if args.note else ""))
    result["quick"] = args.quick
    for k, v in result.items():
        if not isinstance(v, (list, dict)):
            print(f"{k:36s} {v:.4g}" if isinstance(v, float) else
                  f"{k:36s} {v}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
