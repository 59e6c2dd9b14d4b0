"""The EmbeddingVariable training step against Deepray's, and the EV's
`training=False` lookup against a stock `tf.gather` (issue 36.5).

Step: the criteo-like workload (`criteo_like.py`, 26 tables, Zipf ids) on
26 EmbeddingVariables on both sides, the same ids:
- ours: `ge.group_embedding_lookup_sparse(evs, sp_ids, "sum")` with the
  plain list of EVs, concat, loss = mean of squares, backward,
  `ge.optimizers.Adagrad(0.01, 0.1)`, in a `tf.function`;
- the anchor: Deepray 0.21.89's EVs (DeepRec's EV code on TF 2.15), one
  `tf.nn.embedding_lookup_sparse` per table and `deepray.optimizers.Adagrad`
  (`deepray_ev_step.py`, run as a subprocess in Deepray's venv, driven
  round by round so that the two sides alternate in the same run).
Both sides first pass once over the batches (inserting most keys), then
time `--rounds` alternated rounds of `--steps` steps; the ratio is
Deepray's median step over ours (target >= 2.5). Our same step on
pre-sized plain `tf.Variable` tables (the same fused lookup and
optimizer) runs in the same rounds: the EV's own share of our step. So
does, on each side, the step without its embeddings ("dense only"): the
same function of the same 26 SparseTensors, whose pooled outputs are 26
`[batch, dim]` variables instead, with the same concat, loss, gradient
and an SGD assign - TF's call overhead and the model's dense work, which
every step pays. The rest of a step is its embedding part; the JSON
gives both parts' ratios and what our embedding part would have to take
for the step to reach 2.5x Deepray.

Lookup: one EV holding `--lookup-keys` keys (default 10M) x dim; a batch
of `--lookup-rows` known keys read with `ev.lookup_rows(keys,
training=False)` against `tf.gather` of as many rows from a dense
`[lookup-keys, dim]` `tf.Variable`, alternated; the ratio is gather's
time over ours (target >= 0.33).

Without Deepray's venv (`--deepray-python`, else $DEEPRAY_PYTHON) the step
runs our side only and says so.

Usage: python benchmarks/ev_step_vs_deepray.py [--quick] [--out results.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import group_embedding as ge  # noqa: E402

import criteo_like  # noqa: E402
from dense_only_step import make_dense_only_step  # noqa: E402
from ev_bench import make_step  # noqa: E402
from ev_bench import timed  # noqa: E402

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "deepray_ev_step.py")


def _write_ids(id_batches, path):
    """The numpy batches as one .npz that the Deepray worker reads."""
    arrays = {"num_batches": len(id_batches),
              "num_features": len(id_batches[0])}
    for b, feats in enumerate(id_batches):
        for f, (ids, lengths, width) in enumerate(feats):
            arrays[f"b{b}_f{f}_ids"] = ids
            arrays[f"b{b}_f{f}_lengths"] = lengths
            arrays[f"b{b}_f{f}_width"] = width
    np.savez(path, **arrays)


class DeeprayWorker:
    """`deepray_ev_step.py` in Deepray's venv, one command at a time."""

    def __init__(self, python, ids_path, dim):
        self._proc = subprocess.Popen(
            [python, _WORKER, "--ids", ids_path, "--dim", str(dim)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=""))
        self.live_keys = int(self._reply("ready"))

    def _reply(self, tag):
        for line in self._proc.stdout:
            # Deepray logs to stdout too ("[EV INFO] ..."): skip it.
            if line.startswith(tag + " "):
                return line.split()[1]
            if line.startswith("error "):
                raise RuntimeError(f"Deepray worker: {line.strip()}")
        raise RuntimeError(
            f"Deepray worker exited with {self._proc.wait()} before "
            f"'{tag}' (its stderr is above).")

    def time(self, steps):
        """Seconds per step over `steps` steps."""
        self._proc.stdin.write(f"time {steps}\n")
        self._proc.stdin.flush()
        return float(self._reply("time"))

    def time_dense(self, steps):
        """Seconds per step of the dense-only step over `steps` steps."""
        self._proc.stdin.write(f"dense {steps}\n")
        self._proc.stdin.flush()
        return float(self._reply("dense"))

    def close(self):
        if self._proc.poll() is None:
            self._proc.stdin.write("quit\n")
            self._proc.stdin.flush()
            self._proc.wait(timeout=60)


def find_deepray_python(arg):
    """The Deepray venv's python: `arg`, $DEEPRAY_PYTHON, or None."""
    path = arg or os.environ.get("DEEPRAY_PYTHON")
    if path and not os.path.exists(path):
        raise FileNotFoundError(f"--deepray-python {path} does not exist; "
                                "make the venv with "
                                "../shared/peers/deepray/setup.sh DIR.")
    return path


def step_vs_deepray(args):
    """Alternated rounds of our EV step and Deepray's on the same ids."""
    id_batches = criteo_like.make_id_batches(args.cap, args.batch,
                                             args.num_batches)
    # The same seed: the same ids as SparseTensors.
    batches = criteo_like.make_batches(args.cap, args.batch,
                                       args.num_batches)
    init = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=0)
    evs = [ge.get_embedding_variable(f"ev_{i}", args.dim, initializer=init)
           for i in range(len(criteo_like.CARDINALITIES))]
    step = make_step(evs, ge.optimizers.Adagrad(0.01, 0.1))
    for b in batches:  # fill-up pass, as the worker's
        step(b).numpy()
    ours_keys = sum(int(ev.size()) for ev in evs)
    plain = [tf.Variable(init([v, args.dim]))
             for v in criteo_like.vocab_sizes(args.cap)]
    plain_step = make_step(plain, ge.optimizers.Adagrad(0.01, 0.1))
    for b in batches:
        plain_step(b).numpy()
    dense_step = make_dense_only_step(args.batch, args.dim, len(evs))
    for b in batches:
        dense_step(b).numpy()

    deepray = None
    python = find_deepray_python(args.deepray_python)
    tmp = tempfile.mkdtemp(prefix="ev_vs_deepray_")
    if python:
        ids_path = os.path.join(tmp, "ids.npz")
        _write_ids(id_batches, ids_path)
        deepray = DeeprayWorker(python, ids_path, args.dim)
    ours_t, deepray_t, plain_t, dense_t, deepray_dense_t = [], [], [], [], []
    try:
        for r in range(args.rounds):
            # Alternate which side goes first: neither always runs just
            # after the other's burst.
            if deepray and r % 2:
                deepray_t.append(deepray.time(args.steps))
            ours_t.append(timed(step, batches, args.steps))
            plain_t.append(timed(plain_step, batches, args.steps))
            dense_t.append(timed(dense_step, batches, args.steps))
            if deepray and r % 2 == 0:
                deepray_t.append(deepray.time(args.steps))
            if deepray:
                deepray_dense_t.append(deepray.time_dense(args.steps))
    finally:
        if deepray:
            deepray.close()
    result = {
        "batch": args.batch, "cap": args.cap, "dim": args.dim,
        "rounds": args.rounds, "steps_per_round": args.steps,
        "ours_step_ms": 1e3 * float(np.median(ours_t)),
        "ours_rounds_ms": [1e3 * t for t in ours_t],
        "ours_live_keys": ours_keys,
        "ours_plain_variables_step_ms": 1e3 * float(np.median(plain_t)),
        "ev_step_over_plain_step": float(np.median(ours_t) /
                                         np.median(plain_t)),
        "ours_dense_only_ms": 1e3 * float(np.median(dense_t)),
    }
    dense = result["ours_dense_only_ms"]
    result["ours_embedding_part_ms"] = result["ours_step_ms"] - dense
    result["ours_plain_variables_embedding_part_ms"] = (
        result["ours_plain_variables_step_ms"] - dense)
    if deepray:
        if deepray.live_keys != ours_keys:
            raise AssertionError(
                f"the two sides stored different keys after the same "
                f"batches: ours {ours_keys}, Deepray {deepray.live_keys}")
        result.update({
            "deepray_step_ms": 1e3 * float(np.median(deepray_t)),
            "deepray_rounds_ms": [1e3 * t for t in deepray_t],
            "deepray_live_keys": deepray.live_keys,
            "speedup_over_deepray": float(np.median(deepray_t) /
                                          np.median(ours_t)),
            "plain_variables_speedup_over_deepray": float(
                np.median(deepray_t) / np.median(plain_t)),
            "deepray_dense_only_ms": 1e3 * float(np.median(deepray_dense_t)),
        })
        deepray_ms = result["deepray_step_ms"]
        result["deepray_embedding_part_ms"] = (
            deepray_ms - result["deepray_dense_only_ms"])
        result["embedding_part_speedup_over_deepray"] = (
            result["deepray_embedding_part_ms"] /
            result["ours_embedding_part_ms"])
        # 2.5x Deepray: our whole step within deepray_ms / 2.5, of which
        # the dense-only part is fixed; what is left for the embeddings.
        result["embedding_part_budget_at_2_5x_ms"] = deepray_ms / 2.5 - dense
    else:
        result["deepray"] = ("not run: no Deepray venv (--deepray-python or "
                             "$DEEPRAY_PYTHON)")
    return result


def lookup_vs_gather(args):
    """`training=False` lookups of known keys against `tf.gather`."""
    n, dim, rows = args.lookup_keys, args.dim, args.lookup_rows
    rng = np.random.default_rng(1)
    # Distinct keys spread over the int64 range (hashed ids, the usual
    # input), inserted in chunks by training lookups.
    keys = rng.permutation(np.unique(rng.integers(0, 1 << 62, size=n)))
    n = len(keys)
    ev = ge.get_embedding_variable("lookup_ev", dim)
    chunk = 1 << 20
    for i in range(0, n, chunk):
        ev.lookup_rows(tf.constant(keys[i:i + chunk]), training=True)
    dense = tf.Variable(tf.zeros([n, dim]))
    pick = rng.integers(0, n, size=rows)
    query_keys = tf.constant(keys[pick])
    query_ids = tf.constant(pick.astype(np.int64))

    @tf.function
    def ours(k):
        return ev.lookup_rows(k, training=False)

    @tf.function
    def gather(i):
        return tf.gather(dense, i)

    def timed(fn, x):
        fn(x).numpy()  # trace, warm
        start = time.perf_counter()
        for _ in range(args.lookup_reps):
            out = fn(x)
        out.numpy()
        return (time.perf_counter() - start) / args.lookup_reps

    ours_t, gather_t = [], []
    for r in range(args.rounds):
        if r % 2:
            gather_t.append(timed(gather, query_ids))
        ours_t.append(timed(ours, query_keys))
        if r % 2 == 0:
            gather_t.append(timed(gather, query_ids))
    got = ours(query_keys[:8]).numpy()
    want = ev.lookup_rows(query_keys[:8], training=False).numpy()
    np.testing.assert_array_equal(got, want)
    return {
        "lookup_keys": n, "lookup_rows": rows,
        "ev_lookup_ms": 1e3 * float(np.median(ours_t)),
        "gather_ms": 1e3 * float(np.median(gather_t)),
        "lookup_over_gather_speed": float(np.median(gather_t) /
                                          np.median(ours_t)),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, help="default 4096 (quick: 256)")
    p.add_argument("--cap", type=int,
                   help="rows per table, default 200000 (quick: 5000)")
    p.add_argument("--steps", type=int, default=10,
                   help="timed steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--lookup-keys", type=int,
                   help="keys in the lookup EV, default 10M (quick: 20000)")
    p.add_argument("--lookup-rows", type=int,
                   help="rows per lookup, default 1M (quick: 4096)")
    p.add_argument("--lookup-reps", type=int, default=5)
    p.add_argument("--deepray-python",
                   help="python of Deepray's venv (default $DEEPRAY_PYTHON)")
    p.add_argument("--skip-lookup", action="store_true")
    p.add_argument("--note", default="",
                   help="recorded in the JSON (e.g. how loaded the "
                        "machine was)")
    p.add_argument("--quick", action="store_true",
                   help="small batch and tables (smoke run)")
    p.add_argument("--out",
                   default="benchmarks/results/ev_step_vs_deepray.json",
                   help="write the results as JSON here")
    args = p.parse_args(argv)
    args.batch = args.batch or (256 if args.quick else 4096)
    args.cap = args.cap or (5000 if args.quick else 200000)
    args.lookup_keys = args.lookup_keys or (20000 if args.quick
                                            else 10_000_000)
    args.lookup_rows = args.lookup_rows or (4096 if args.quick
                                            else 1 << 20)
    return args


def main(argv=None):
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    result = {"step": step_vs_deepray(args)}
    if not args.skip_lookup:
        result["lookup"] = lookup_vs_gather(args)
    result["machine"] = {
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_1min_before_after": [load_before,
                                           os.getloadavg()[0]],
        "note": args.note,
        "timing": "medians of rounds alternated between the two sides"}
    print(json.dumps(result, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
