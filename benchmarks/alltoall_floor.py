"""The latency floor of collective mode: bare Horovod collectives, no model.

Runs, under the same conditions as `scaling_bench.py` (each worker pinned
to one core, one TF thread), the collective chain of one criteo-like step
with buffers of the same sizes and nothing else:

- `chain`: ids alltoall -> rows alltoall -> grads alltoall -> dense
  allreduce, each waiting for the previous one (what a step does today);
- `a2a`: one alltoall of the ids buffer (one link of the chain);
- `compute`: a fixed amount of TF compute without any collective, to see
  what Horovod's background thread (cycling on the same core) costs a
  worker that does not communicate; compare with `--no-horovod`.

    python benchmarks/alltoall_floor.py            # N=2, all modes
    HOROVOD_CYCLE_TIME=1 python benchmarks/alltoall_floor.py

Prints ms per iteration (median over rounds, slowest worker).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args):
    """Times each mode on this rank; rank 0 prints the medians."""
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd = None
    size = 1
    if not args.no_horovod:
        sys.path.insert(0, os.path.dirname(HERE))
        from group_embedding.distributed import horovod_settings
        horovod_settings.apply_defaults()
        import horovod.tensorflow as hvd
        hvd.init()
        size = hvd.size()
    n_ids = args.distinct // size  # per destination
    ids = tf.zeros([size * (n_ids + args.tables)], tf.int64)
    id_splits = tf.fill([size], n_ids + args.tables)
    rows = tf.zeros([size * n_ids * args.dim], tf.float32)
    row_splits = tf.fill([size], n_ids * args.dim)
    dense = tf.zeros([args.tables * args.dim, 1], tf.float32)
    a = tf.random.uniform([256, 256])

    @tf.function
    def chain():
        got, _ = hvd.alltoall(ids, splits=id_splits, name="floor_ids")
        r = rows + tf.cast(got[0], tf.float32)
        back, _ = hvd.alltoall(r, splits=row_splits, name="floor_rows")
        g = back * 2.0
        grads, _ = hvd.alltoall(g, splits=row_splits, name="floor_grads")
        d = hvd.allreduce(dense + grads[0], name="floor_dense")
        return d[0, 0]

    @tf.function
    def a2a():
        got, _ = hvd.alltoall(ids, splits=id_splits, name="floor_one")
        return got[0]

    @tf.function
    def compute():
        x = a
        for _ in range(args.matmuls):
            x = tf.matmul(x, a) * 1e-3
        return x[0, 0]

    modes = {"compute": compute}
    if hvd is not None:
        modes.update({"chain": chain, "a2a": a2a})

    def barrier():
        if hvd is not None:
            hvd.allreduce(tf.constant(0.0), name="floor_barrier").numpy()

    out = {}
    for name, fn in modes.items():
        for _ in range(3):
            fn().numpy()
        times = []
        for _ in range(args.rounds):
            barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                v = fn()
            v.numpy()
            times.append(1e3 * (time.perf_counter() - start) / args.iters)
        if hvd is not None:
            times = [max(x) for x in zip(*hvd.allgather_object(times))]
        out[name] = statistics.median(times)
    if rank == 0:
        env = {k: v for k, v in os.environ.items()
               if k.startswith("HOROVOD_") and "RENDEZVOUS" not in k
               and k not in ("HOROVOD_RANK", "HOROVOD_SIZE",
                             "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
                             "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER",
                             "HOROVOD_CPU_OPERATIONS",
                             "HOROVOD_GLOO_IFACE")}
        print(f"N={size} {env}: " + ", ".join(
            f"{k} {v:.2f} ms" for k, v in out.items()), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--no-horovod", action="store_true",
                        help="compute mode only, no hvd.init()")
    parser.add_argument("-np", type=int, default=2)
    # Defaults: one criteo-like worker step at batch 4096 (26 tables, dim
    # 16, ~100k distinct ids per worker per step).
    parser.add_argument("--distinct", type=int, default=100_000)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--matmuls", type=int, default=60)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.worker or args.no_horovod:
        worker(args)
        return
    me = [sys.executable, os.path.abspath(__file__), "--worker"]
    for key in ("distinct", "tables", "dim", "matmuls", "iters", "rounds"):
        me += [f"--{key}", str(getattr(args, key))]
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    subprocess.run([horovodrun, "-np", str(args.np), "--gloo"] + me,
                   check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


if __name__ == "__main__":
    main()
