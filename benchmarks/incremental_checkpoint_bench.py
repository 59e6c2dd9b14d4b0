"""Incremental vs full checkpoints of a large EmbeddingVariable (issue 26.2).

One EV of `--keys` keys (default 10M), dim 16, with an Adagrad slot.
Anchor: full saves (`ge.save_tables`, every row and slot), measured in
this run. Then `--rounds` times: `--touched` of the keys (default 1%)
are looked up and updated by an Adagrad step, and a delta is saved
(`full_every` large). Reports the median delta/full ratios of bytes
written and of wall time (targets: <= 3% and <= 5%), and the restore
times of the full save and of the full save + its deltas. The chain's
restore is checked bitwise against the live EV (a wrong delta fails the
benchmark, whatever its speed).

Usage: python benchmarks/incremental_checkpoint_bench.py [--keys N]
    [--out benchmarks/results/incremental_checkpoint_bench.json]
"""

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import ev_storage

DIM = 16
SLOT = "adagrad/accumulator"


def _folder_bytes(path):
    return sum(os.path.getsize(os.path.join(path, name))
               for name in os.listdir(path))


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _sorted_state(ev):
    keys, values, freqs, versions, _, _, slots, _ = [
        np.asarray(x) for x in ev_storage.export(ev.handle, DIM)]
    order = np.argsort(keys)
    return [keys[order], values[order], freqs[order], versions[order],
            slots[order]]


def _update(ev, keys, step, rng):
    ev.lookup_rows(tf.constant(keys, tf.int64))
    ev_storage.apply_adagrad(
        ev.handle, tf.constant(keys, tf.int64),
        rng.standard_normal((len(keys), DIM)).astype("f"), step, 0.05,
        1e-7, SLOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--touched", type=float, default=0.01,
                   help="fraction of the keys changed between saves")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", help="scratch folder (default: a temp dir)")
    p.add_argument("--out")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    scratch = args.dir or tempfile.mkdtemp(prefix="ge_incr_bench_")
    inc, plain = os.path.join(scratch, "inc"), os.path.join(scratch, "full")
    ev = ge.get_embedding_variable("big", DIM)
    ev.ensure_slot(SLOT, 0.1)
    keys = np.unique(rng.integers(-2**62, 2**62, args.keys))
    for chunk in np.array_split(keys, max(1, args.keys // 1_000_000)):
        ev.lookup_rows(tf.constant(chunk, tf.int64))
    tables = {"big": ev}

    path, first_full_s = _timed(lambda: ge.save_tables(
        inc, tables, 0, full_every=args.rounds + 1))
    full_bytes = _folder_bytes(path)
    full_s = [first_full_s]
    delta_s, delta_bytes = [], []
    n_touched = max(1, int(args.keys * args.touched))
    for step in range(1, args.rounds + 1):
        _update(ev, rng.choice(keys, n_touched, replace=False), step, rng)
        path, seconds = _timed(lambda: ge.save_tables(
            inc, tables, step, full_every=args.rounds + 1))
        with open(os.path.join(path, "manifest.json")) as f:
            assert json.load(f)["kind"] == "delta"
        delta_s.append(seconds)
        delta_bytes.append(_folder_bytes(path))
        # The anchor again, between deltas (same machine state).
        full_path, seconds = _timed(
            lambda: ge.save_tables(plain, tables, step))
        full_s.append(seconds)
        shutil.rmtree(plain, ignore_errors=True)
    want = _sorted_state(ev)

    fresh = ge.get_embedding_variable("restored", DIM)
    fresh.ensure_slot(SLOT, 0.1)
    first = sorted(n for n in os.listdir(inc) if n.startswith("ckpt-0-"))
    _, restore_full_s = _timed(lambda: ge.restore_tables(
        os.path.join(inc, first[0]), {"big": fresh}))
    _, restore_chain_s = _timed(lambda: ge.restore_tables(
        inc, {"big": fresh}))
    for got, expected in zip(_sorted_state(fresh), want):
        np.testing.assert_array_equal(got, expected)
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)

    full_t, delta_t = float(np.median(full_s)), float(np.median(delta_s))
    delta_b = float(np.median(delta_bytes))
    result = {
        "keys": args.keys, "dim": DIM, "slots": 1,
        "touched_fraction": args.touched, "rounds": args.rounds,
        "full_save_s": full_t, "full_save_all_s": full_s,
        "full_bytes": full_bytes,
        "delta_save_s": delta_t, "delta_save_all_s": delta_s,
        "delta_bytes": delta_b,
        "delta_over_full_bytes": delta_b / full_bytes,
        "delta_over_full_time": delta_t / full_t,
        "target_bytes": 0.03, "target_time": 0.05,
        "restore_full_s": restore_full_s,
        "restore_full_plus_deltas_s": restore_chain_s,
        "chain_restore_bitwise_equal": True,
        # Live EV, the restored one and the arrays read back, at once.
        "peak_rss_gib": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "cpu_count": os.cpu_count(),
    }
    for k, v in result.items():
        print(f"{k:30s} {v:.4g}" if isinstance(v, float) else
              f"{k:30s} {v}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)),
                    exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
