"""Collective (model-parallel) training on the criteo-like workload.

Run under horovodrun at several worker counts; each run appends one JSON
record, and `--report` compares them:

    horovodrun -np 1 python benchmarks/collective_bench.py --out R.jsonl
    horovodrun -np 2 python benchmarks/collective_bench.py --out R.jsonl
    python benchmarks/collective_bench.py --report R.jsonl

Per worker count it measures global samples/s (the global batch is split
over the workers; one step = grouped lookup + backward + sparse Adagrad on
the shards + allreduce of dense gradients), the bytes the all-to-all
exchange moves per step (ids out, rows back) against the volume without
deduplication (every id occurrence sent) and the unique-id bound, the
embedding memory each worker holds (table shard + Adagrad accumulator)
and its peak RSS. All workers run on this one machine, so samples/s shows
the overhead of the exchange, not a multi-host speed-up.
"""

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import group_embedding as ge  # noqa: E402

import criteo_like  # noqa: E402


def local_slice(batch, rank, size):
    """This worker's rows of a global batch of SparseTensors."""
    out = []
    for sp in batch:
        b = int(sp.dense_shape[0])
        lo, hi = b * rank // size, b * (rank + 1) // size
        sliced = tf.sparse.slice(sp, [lo, 0], [hi - lo, sp.dense_shape[1]])
        out.append(sliced)
    return out


def exchange_bytes(batch, dim):
    """(deduplicated, not deduplicated) bytes of one exchange.

    Each id sent is one int64 (its local row; the router adds K counts
    per owner) and comes back as a D-float row; collective_lookup sends
    each distinct id of a table once.
    """
    per_id = 8 + 4 * dim
    unique = sum(len(np.unique(sp.values.numpy())) for sp in batch)
    total = sum(int(sp.values.shape[0]) for sp in batch)
    return unique * per_id, total * per_id


def run(args):
    hvd = ge.enable_distributed_strategy("collective")
    rank, size = hvd.rank(), hvd.size()
    vocabs = criteo_like.vocab_sizes(args.cap)
    tables = [ge.get_embedding_table(f"c{i}", v, args.dim, replicate=False)
              for i, v in enumerate(vocabs)]
    variables = [t.shard if isinstance(t, ge.ShardedVariable) else t
                 for t in tables]
    dense = tf.Variable(tf.fill([26 * args.dim, 1], 0.01))
    opt = ge.optimizers.Adagrad(0.01, initial_accumulator_value=0.1)
    batches = [local_slice(b, rank, size) for b in criteo_like.make_batches(
        args.cap, args.batch, args.num_batches)]

    @tf.function(reduce_retracing=True)
    def step(sp_ids):
        with tf.GradientTape() as tape:
            emb = tf.concat(ge.group_embedding_lookup_sparse(
                tables, sp_ids, "sum"), 1)
            loss = tf.reduce_mean(tf.square(tf.matmul(emb, dense)))
        vs = variables + [dense]
        grads = ge.DistributedGradientTape(tape).gradient(loss, vs)
        opt.apply_gradients(zip(grads, vs))
        return loss

    for b in batches[:args.warmup]:
        step(b).numpy()
    times = []
    for i in range(args.steps):
        hvd.allreduce(tf.constant(0.0), name="bench_sync")  # align start
        start = time.perf_counter()
        step(batches[i % len(batches)]).numpy()
        times.append(time.perf_counter() - start)
    # A step ends when the slowest worker ends.
    step_s = float(hvd.allreduce(tf.constant(np.median(times)),
                                 op=hvd.Max))
    sent, undedup = exchange_bytes(batches[0], args.dim)
    shard_bytes = sum(int(np.prod(v.shape)) * 4 for v in variables)
    record = {
        "workers": size, "rank": rank, "dim": args.dim, "cap": args.cap,
        "global_batch": args.batch, "median_step_s": step_s,
        "samples_per_s": args.batch / step_s,
        "exchange_bytes_per_step": sent,
        "exchange_bytes_no_dedup": undedup,
        # Table shard + Adagrad accumulator of the same shape.
        "embedding_bytes": 2 * shard_bytes,
        "peak_rss_bytes": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    records = hvd.allgather_object(record)
    if rank == 0:
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        print(f"N={size}: {record['samples_per_s']:.0f} samples/s, "
              f"step {1e3 * step_s:.1f} ms", flush=True)


def report(path):
    """Prints ratios of the recorded runs and writes `<path>.summary.json`."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    by_n = {}
    for r in records:
        by_n.setdefault(r["workers"], []).append(r)
    single = by_n[1][0]
    summary = {}
    for n, rs in sorted(by_n.items()):
        mem = max(r["embedding_bytes"] for r in rs)
        sent = max(r["exchange_bytes_per_step"] for r in rs)
        undedup = max(r["exchange_bytes_no_dedup"] for r in rs)
        summary[n] = {
            "samples_per_s": rs[0]["samples_per_s"],
            "embedding_memory_ratio": mem / single["embedding_bytes"],
            "peak_rss_ratio": max(r["peak_rss_bytes"] for r in rs)
            / single["peak_rss_bytes"],
            "exchange_vs_no_dedup": sent / undedup,
        }
        s = summary[n]
        print(f"N={n}: {s['samples_per_s']:.0f} samples/s; per-worker "
              f"embedding memory {s['embedding_memory_ratio']:.2f}x of one "
              f"process (peak RSS {s['peak_rss_ratio']:.2f}x); exchange "
              f"{sent / 2**20:.1f} MiB/step = "
              f"{s['exchange_vs_no_dedup']:.2f}x the no-dedup volume")
    with open(path + ".summary.json", "w") as f:
        json.dump(summary, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cap", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=4096,
                        help="global batch, split over the workers")
    parser.add_argument("--num-batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/"
                        "collective_bench.jsonl")
    parser.add_argument("--report", metavar="JSONL")
    args = parser.parse_args()
    if args.report:
        report(args.report)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
