"""EmbeddingVariable vs pre-sized tf.Variable tables, criteo-like step.

Both variants run the same training step on the criteo-like workload
(SPEC.md section 6, `criteo_like.py`): `ge.group_embedding_lookup_sparse`
over the 26 tables, concat, loss = mean of squares, backward,
`ge.optimizers.Adagrad` (lr 0.01, initial accumulator 0.1). The "fixed"
variant holds 26 `tf.Variable`s sized to the capped vocabularies; the "ev"
variant 26 `EmbeddingVariable`s that start empty and insert keys as they
come. Reports step times and their ratio (target: ev <= 2x fixed), keys
inserted per second while the EVs fill up, and bytes per key.

Usage: python benchmarks/ev_bench.py [--quick] [--out results.json]
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import group_embedding as ge  # noqa: E402

import criteo_like  # noqa: E402


def make_step(tables, optimizer):
    """The criteo-like training step on `tables` (a `tf.function` of the
    26 SparseTensors): grouped lookup, concat, mean of squares, update."""
    @tf.function
    def step(sp_ids):
        with tf.GradientTape() as tape:
            embs = ge.group_embedding_lookup_sparse(tables, sp_ids, "sum")
            loss = tf.reduce_mean(tf.square(tf.concat(embs, 1)))
        grads = tape.gradient(loss, tables)
        optimizer.apply_gradients(zip(grads, tables))
        return loss
    return step


def _evs(dim, seed):
    init = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=seed)
    return [ge.get_embedding_variable(f"ev_{i}", dim, initializer=init)
            for i in range(len(criteo_like.CARDINALITIES))]


def timed(step, batches, steps):
    """Seconds per step over `steps` steps cycling through `batches`."""
    start = time.perf_counter()
    for i in range(steps):
        loss = step(batches[i % len(batches)])
    loss.numpy()
    return (time.perf_counter() - start) / steps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, help="default 4096 (quick: 512)")
    p.add_argument("--cap", type=int,
                   help="rows per table, default 200000 (quick: 20000)")
    p.add_argument("--steps", type=int, default=10,
                   help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--quick", action="store_true",
                   help="small batch and tables (smoke run)")
    p.add_argument("--out", default="benchmarks/results/ev_bench.json",
                   help="write the results as JSON here")
    args = p.parse_args(argv)
    args.batch = args.batch or (512 if args.quick else 4096)
    args.cap = args.cap or (20000 if args.quick else 200000)
    return args


def main(argv=None):
    args = parse_args(argv)
    batches = criteo_like.make_batches(args.cap, args.batch,
                                       args.num_batches)
    fixed = [tf.Variable(t) for t in
             criteo_like.initial_tables(args.cap, args.dim)]
    evs = _evs(args.dim, seed=0)
    fixed_step = make_step(fixed, ge.optimizers.Adagrad(0.01, 0.1))
    ev_step = make_step(evs, ge.optimizers.Adagrad(0.01, 0.1))

    # Fill-up phase: the first pass over the batches inserts most keys.
    ev_step(batches[0]).numpy()  # trace
    fixed_step(batches[0]).numpy()
    before = sum(int(ev.size()) for ev in evs)
    start = time.perf_counter()
    for b in batches[1:]:
        ev_step(b).numpy()
    fill_s = time.perf_counter() - start
    inserted = sum(int(ev.size()) for ev in evs) - before

    fixed_t, ev_t = [], []
    for _ in range(args.rounds):  # interleaved rounds share machine noise
        fixed_t.append(timed(fixed_step, batches, args.steps))
        ev_t.append(timed(ev_step, batches, args.steps))
    keys = sum(int(ev.size()) for ev in evs)
    total_bytes = sum(float(ev.bytes_per_key()) * int(ev.size())
                      for ev in evs)
    big = max(evs, key=lambda ev: int(ev.size()))
    result = {
        "batch": args.batch, "cap": args.cap, "dim": args.dim,
        "fixed_step_ms": 1e3 * float(np.median(fixed_t)),
        "ev_step_ms": 1e3 * float(np.median(ev_t)),
        "ratio_ev_over_fixed": float(np.median(ev_t) / np.median(fixed_t)),
        "keys_inserted_per_s": inserted / fill_s,
        "live_keys": keys,
        "bytes_per_key_all_tables": total_bytes / keys,
        "bytes_per_key_largest_table": float(big.bytes_per_key()),
        "bytes_per_key_budget": 1.5 * 4 * args.dim + 4 * args.dim,
    }
    for k, v in result.items():
        print(f"{k:30s} {v:.4g}" if isinstance(v, float) else
              f"{k:30s} {v}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
