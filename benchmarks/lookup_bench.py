"""Training-step benchmark of grouped lookups on the criteo-like workload.

One step = lookup of the 26 features, concat, loss = mean of squares,
backward, sparse Adagrad (lr 0.01, initial accumulator 0.1). Variants:

* stock_keras: per-table `tf.nn.embedding_lookup_sparse` +
  `keras.optimizers.Adagrad` (what a TF user writes today);
* ge: `ge.group_embedding_lookup_sparse` + `ge.optimizers.Adagrad`;
* stock_raw_adagrad: per-table `tf.nn.embedding_lookup_sparse` + the raw
  `ResourceSparseApplyAdagradV2` op on each IndexedSlices gradient;
* ge_pure_tf: `ge` with `GROUP_EMBEDDING_KERNELS=tf` (informational).

Every variant owns freshly initialised, identical tables and runs inside
`tf.function` (no XLA). Variants are timed round-robin (a few steps of
each, several rounds) so that load changes on a shared machine hit all of
them alike; the median step time per variant is reported.

Usage::

    python benchmarks/lookup_bench.py --quick        # smoke test
    python benchmarks/lookup_bench.py --dim 64
"""

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable

# criteo_like is the sibling script module: `python
# benchmarks/lookup_bench.py` puts this folder first on sys.path.
import criteo_like
import keras
import numpy as np
import tensorflow as tf

import group_embedding as ge

LEARNING_RATE = 0.01
INITIAL_ACCUMULATOR = 0.1
EPSILON = 1e-7
NUM_BATCHES = 8
LOSS_RTOL = 1e-4
VARIANTS = ("stock_keras", "ge", "stock_raw_adagrad", "ge_pure_tf")
QUICK = {"cap": 20000, "batch": 512, "rounds": 2}
DEFAULTS = {"cap": 200000, "batch": 4096, "rounds": 5}
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "results")


def _stock_lookup(tables, sp_ids):
    return [tf.nn.embedding_lookup_sparse(t, sp, None, combiner="sum")
            for t, sp in zip(tables, sp_ids)]


def _ge_lookup(tables, sp_ids):
    return ge.group_embedding_lookup_sparse(tables, sp_ids, "sum")


def _optimizer_update(optimizer_cls) -> Callable:
    """Update factory applying the gradients with a Keras-3 optimizer."""
    def make(tables):
        opt = optimizer_cls(LEARNING_RATE,
                            initial_accumulator_value=INITIAL_ACCUMULATOR,
                            epsilon=EPSILON)
        # Build eagerly: slot variables must not be created while tracing.
        opt.build(tables)
        return lambda grads: opt.apply_gradients(zip(grads, tables))
    return make


def _raw_adagrad_update(tables):
    """Update factory for the raw sparse Adagrad op, one call per table.

    The tape's gradient of `embedding_lookup_sparse` is IndexedSlices whose
    indices are already unique (SparseSegmentSumGrad sums duplicates), so
    applying it as is matches dense Adagrad; no dedup is needed.
    """
    accums = [tf.Variable(tf.fill(t.shape, INITIAL_ACCUMULATOR))
              for t in tables]

    def update(grads):
        for t, acc, g in zip(tables, accums, grads):
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=t.handle, accum=acc.handle, lr=LEARNING_RATE,
                epsilon=EPSILON, grad=g.values, indices=g.indices)
    return update


# name -> (lookup, update factory, environment while tracing/running).
_SETUPS = {
    "stock_keras": (_stock_lookup,
                    _optimizer_update(keras.optimizers.Adagrad), {}),
    "ge": (_ge_lookup, _optimizer_update(ge.optimizers.Adagrad), {}),
    "stock_raw_adagrad": (_stock_lookup, _raw_adagrad_update, {}),
    "ge_pure_tf": (_ge_lookup, _optimizer_update(ge.optimizers.Adagrad),
                   {"GROUP_EMBEDDING_KERNELS": "tf"}),
}


@contextlib.contextmanager
def _environ(overrides: dict[str, str]):
    """Sets environment variables for the block, then restores them."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Variant:
    """One way to run the training step, on its own copy of the tables."""

    def __init__(self, name: str, initial: list[np.ndarray]):
        lookup, make_update, self.env = _SETUPS[name]
        self.name = name
        self.tables = [tf.Variable(x, name=f"{name}_table{i}")
                       for i, x in enumerate(initial)]
        update = make_update(self.tables)
        self.steps_done = 0
        tables = self.tables

        @tf.function(jit_compile=False)
        def step(sp_ids):
            with tf.GradientTape() as tape:
                emb = tf.concat(lookup(tables, sp_ids), axis=1)
                loss = tf.reduce_mean(tf.square(emb))
            update(tape.gradient(loss, tables))
            return loss

        self.step_fn = step

    def run(self, batches) -> float:
        """Runs one step on the next batch of the cycle; returns the loss.

        Call inside `self.environ()`. Fetching the loss waits for the step.
        """
        batch = batches[self.steps_done % len(batches)]
        self.steps_done += 1
        return float(self.step_fn(batch).numpy())

    def environ(self):
        return _environ(self.env)

    def custom_op_count(self, batch) -> int:
        """Number of group-embedding C++ ops in the traced step graph."""
        with self.environ():
            graph = self.step_fn.get_concrete_function(batch).graph
        return sum(op.type.startswith("Group")
                   for op in graph.get_operations())


def _check_losses(losses: dict[str, list[float]], warmup: int) -> float:
    """Asserts all variants saw the same losses; returns max rel diff.

    Warmup steps cycle the same batches in the same order for every
    variant, so equal losses at every step also check backward + update.
    """
    names = list(losses)
    ref = np.asarray(losses[names[0]])
    worst = 0.0
    for name in names[1:]:
        got = np.asarray(losses[name])
        rel = np.abs(got - ref) / np.abs(ref)
        worst = max(worst, float(rel.max()))
        if not np.allclose(got, ref, rtol=LOSS_RTOL, atol=0):
            raise AssertionError(
                f"Loss mismatch {name} vs {names[0]} (rtol {LOSS_RTOL}): "
                f"{got.tolist()} vs {ref.tolist()}")
    print(f"correctness: losses of {', '.join(names)} agree (rtol "
          f"{LOSS_RTOL}) on the first step and on the step after {warmup} "
          f"warmup steps (max rel diff {worst:.2e})")
    return worst


def _time_rounds(variants: list[Variant], batches, rounds: int,
                 steps: int) -> dict[str, list[list[float]]]:
    """Round-robin timing: `steps` timed steps of each variant per round.

    The starting variant rotates every round so none always runs right
    after the same neighbour (caches, turbo, other tenants).
    """
    times = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            round_times = []
            with v.environ():
                for _ in range(steps):
                    start = time.perf_counter()
                    v.run(batches)
                    round_times.append(time.perf_counter() - start)
            times[v.name].append(round_times)
        summary = "  ".join(
            f"{n}={1e3 * statistics.median(t[-1]):.1f}ms"
            for n, t in times.items())
        print(f"round {r + 1}/{rounds}: {summary}", flush=True)
    return times


def _plot(path: str, samples_per_s: dict[str, float], title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(samples_per_s)
    bars = ax.bar(names, [samples_per_s[n] for n in names],
                  color=["#d62728" if n.startswith("ge") else "#7f7f7f"
                         for n in names])
    ax.bar_label(bars, fmt="%.0f")
    ax.margins(y=0.12)  # Room for the labels above the tallest bar.
    ax.set_ylabel("samples/s (median step)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, help="default 4096 (quick: 512)")
    p.add_argument("--cap", type=int,
                   help="max rows per table, default 200000 (quick: 20000)")
    p.add_argument("--rounds", type=int, help="default 5 (quick: 2)")
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke-test sizes (explicit flags still win)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/"
                                 "lookup_bench_dim{D}[_quick].json)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or not args.variants:
        p.error(f"unknown variants {sorted(unknown)}; use {VARIANTS}")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the loss check needs one step)")
    if args.out is None:
        suffix = "_quick" if args.quick else ""
        args.out = os.path.join(RESULTS_DIR,
                                f"lookup_bench_dim{args.dim}{suffix}.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    config = {k: getattr(args, k) for k in (
        "dim", "batch", "cap", "rounds", "steps_per_round", "warmup",
        "variants", "quick", "seed")}
    print(f"config: {config}")
    batches = criteo_like.make_batches(args.cap, args.batch, NUM_BATCHES,
                                       args.seed)
    initial = criteo_like.initial_tables(args.cap, args.dim, args.seed)
    variants = [Variant(n, initial) for n in args.variants]
    del initial

    # Warmup traces each step function and runs a few untimed steps; one
    # more step then gives every variant's loss on the same batch.
    losses = {}
    for v in variants:
        with v.environ():
            losses[v.name] = [v.run(batches) for _ in range(args.warmup + 1)]
    checked = {n: [ls[0], ls[-1]] for n, ls in losses.items()}
    max_rel_diff = _check_losses(checked, args.warmup)
    custom_ops = {v.name: v.custom_op_count(batches[0]) for v in variants}
    print(f"group-embedding C++ ops per step graph: {custom_ops}")
    if custom_ops.get("ge_pure_tf"):
        raise AssertionError("ge_pure_tf traced C++ kernels; the "
                             "GROUP_EMBEDDING_KERNELS override failed.")

    times = _time_rounds(variants, batches, args.rounds,
                         args.steps_per_round)
    results = {}
    for v in variants:
        flat = [t for r in times[v.name] for t in r]
        median = statistics.median(flat)
        results[v.name] = {
            "step_times_s": times[v.name],
            "median_step_s": median,
            "samples_per_s": args.batch / median,
            "traces": v.step_fn.experimental_get_tracing_count(),
        }
    ratios = {f"ge_over_{base}": results[base]["median_step_s"]
              / results["ge"]["median_step_s"]
              for base in ("stock_keras", "stock_raw_adagrad")
              if "ge" in results and base in results}

    print(f"\nmedian over {args.rounds} rounds x {args.steps_per_round} "
          f"steps (dim {args.dim}, batch {args.batch}, cap {args.cap}):")
    for name, r in results.items():
        print(f"  {name:18s} {1e3 * r['median_step_s']:9.2f} ms/step "
              f"{r['samples_per_s']:12.0f} samples/s")
    for name, ratio in ratios.items():
        print(f"  speedup {name}: {ratio:.2f}x")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    report = {
        "config": config,
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "cpu_count": os.cpu_count(),
        "losses": losses,
        "max_loss_rel_diff": max_rel_diff,
        "custom_ops": custom_ops,
        "results": results,
        "ratios": ratios,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    _plot(png, {n: r["samples_per_s"] for n, r in results.items()},
          f"criteo-like, dim {args.dim}, batch {args.batch}, cap "
          f"{args.cap} (TF {tf.__version__}, {os.cpu_count()} CPUs)")
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
