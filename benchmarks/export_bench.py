"""One-call export of a large EmbeddingVariable: time and peak memory.

A `[--keys, --dim]` EV (10M keys of dim 16 by default, filled by
training-mode lookups) is exported with `ge.export_saved_model` as a
`tf.Module` serving pooled lookups; the SavedModel is then loaded and
served with plain TF and checked against the EV's own `training=False`
lookup on keys known and unknown. Anchors, measured in the same run on
the same machine: the EV's plain `ev.export()` to numpy, and a SavedModel
of a dense `tf.Variable` of the same `[keys, dim]` size. Each phase runs
in its own process; its peak memory is the largest resident size sampled
every 5 ms during the phase minus the size before it.

Usage: python benchmarks/export_bench.py [--keys N] [--dim D]
           [--out benchmarks/results/export_bench.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples the resident size of this process in a thread."""

    def __init__(self):
        self.before = self._rss()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())
        return self.peak - self.before


def _filled_ev(keys, dim):
    import tensorflow as tf

    import group_embedding as ge
    ev = ge.get_embedding_variable("bench_ev", dim)
    chunk = 1 << 20
    for start in range(0, keys, chunk):
        ids = tf.range(start, min(start + chunk, keys), dtype=tf.int64)
        ev.lookup_rows(ids * 7 + 3, training=True)  # scattered keys
    return ev


def phase(name, keys, dim, workdir):
    """Runs one phase in this process; returns its measurements."""
    import tensorflow as tf

    import group_embedding as ge
    out = {}
    if name == "dense_saved_model":
        table = tf.Variable(tf.random.uniform([keys, dim]))
        module = tf.Module()
        module.table = table
        module.serve = tf.function(
            lambda ids: tf.gather(table, ids),
            input_signature=[tf.TensorSpec([None], tf.int64)],
            autograph=False)
        path = os.path.join(workdir, "dense")
        peak = PeakRss()
        start = time.perf_counter()
        tf.saved_model.save(module, path)
        out["seconds"] = time.perf_counter() - start
        out["peak_extra_bytes"] = peak.stop()
        return out
    ev = _filled_ev(keys, dim)
    assert int(ev.size()) == keys
    if name == "ev_export":
        peak = PeakRss()
        start = time.perf_counter()
        exported = [t.numpy() for t in ev.export()]
        out["seconds"] = time.perf_counter() - start
        out["peak_extra_bytes"] = peak.stop()
        del exported
        return out
    module = tf.Module()
    module.ev = ev
    module.serve = tf.function(
        lambda ids: ge.group_embedding_lookup_sparse(
            [ev], [ids], ["mean"], training=False)[0],
        input_signature=[tf.RaggedTensorSpec([None, None], tf.int64, 1,
                                             tf.int64)],
        autograph=False)
    path = os.path.join(workdir, "ev")
    peak = PeakRss()
    start = time.perf_counter()
    ge.export_saved_model(module, path)
    out["seconds"] = time.perf_counter() - start
    out["peak_extra_bytes"] = peak.stop()
    out["saved_model_bytes"] = sum(
        os.path.getsize(os.path.join(d, f))
        for d, _, files in os.walk(path) for f in files)
    # Served by plain TF (here in-process: the served rows are checked,
    # not the absence of the library, which tests/serving checks).
    rng = np.random.default_rng(0)
    request = tf.RaggedTensor.from_row_lengths(
        np.concatenate([rng.integers(0, keys, 5000) * 7 + 3,
                        rng.integers(-10**9, 10**9, 1000)]).astype(np.int64),
        [6] * 1000)
    want = module.serve(request).numpy()
    start = time.perf_counter()
    loaded = tf.saved_model.load(path)
    out["load_seconds"] = time.perf_counter() - start
    got = loaded.serve(request).numpy()
    out["served_max_abs_diff"] = float(np.max(np.abs(got - want)))
    if out["served_max_abs_diff"] > 1e-5:
        raise AssertionError(f"served rows differ from the EV's: {out}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--out", default=os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        "export_bench.json"))
    p.add_argument("--phase", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.phase:
        print(json.dumps(phase(args.phase, args.keys, args.dim,
                               args.workdir)))
        return None
    results = {"keys": args.keys, "dim": args.dim,
               "table_bytes": args.keys * args.dim * 4,
               "cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory() as workdir:
        for name in ("ev_export", "dense_saved_model", "ge_export"):
            run = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--phase", name,
                 "--keys", str(args.keys), "--dim", str(args.dim),
                 "--workdir", workdir],
                capture_output=True, text=True, check=False)
            if run.returncode != 0:
                sys.exit(f"phase {name} failed:\n{run.stderr[-3000:]}")
            results[name] = json.loads(run.stdout.strip().splitlines()[-1])
            print(name, results[name], flush=True)
    ours = results["ge_export"]
    results["ratio_time_vs_ev_export"] = (
        ours["seconds"] / results["ev_export"]["seconds"])
    results["ratio_time_vs_dense_saved_model"] = (
        ours["seconds"] / results["dense_saved_model"]["seconds"])
    results["ratio_peak_vs_table_bytes"] = (
        ours["peak_extra_bytes"] / results["table_bytes"])
    # The dense anchor's table exists before its save, so its peak says
    # little; ev.export() also starts from the filled table.
    results["ratio_peak_vs_ev_export"] = (
        ours["peak_extra_bytes"] / results["ev_export"]["peak_extra_bytes"])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items()
                      if k.startswith("ratio")}, indent=2))
    return results


if __name__ == "__main__":
    main()
