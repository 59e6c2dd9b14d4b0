"""Weak scaling of collective mode on the criteo-like workload.

Every worker is pinned to its own core (rank r -> core r mod cores, as
`taskset -c r` would) and runs ONE TF thread (intra and inter op), with a
fixed per-worker batch (default 4096) of the 26 criteo-like features
(all 26 tables sharded, Zipf ids, dim 16). One step = grouped lookup +
backward + gradient reduction (`ge.allreduce_gradients`: shard gradients
rescaled, dense gradients allreduced) + `ge.optimizers.Adagrad`.

N=1 is what a user runs on one machine: the single-process library path
(plain `tf.Variable` tables, the fused C++ lookup, `ge.optimizers.Adagrad`,
no Horovod), pinned to core 0 with one TF thread. N=2 runs
`enable_distributed_strategy("collective")` under horovodrun; N=3 is
oversubscribed on a 2-core machine (two ranks share core 0) and is shown
for information only.

    python benchmarks/scaling_bench.py        # N=1,2,1x2,2p,2h,3; ~4 min
    python benchmarks/scaling_bench.py --quick        # smoke run
    python benchmarks/scaling_bench.py --sizes 1,2,2h # skip N=3

The exchanges go over the peer sockets of `group_embedding/distributed/
transport.py` (the default). `2p` is N=2 with `ge.distributed.exchange_ids`
pipelining (the next batch's ids are routed and sent during the step);
`2h` is N=2 with GROUP_EMBEDDING_TRANSPORT=horovod (Horovod's alltoall
and allreduce, the transport before the peer sockets). `1x2` runs two
independent N=1 processes at once, one per core, with no exchange: how
much slower a step gets only because both cores (and the memory and host
behind them) are busy, the part of step(2) no transport can remove.
Horovod variables in the environment (e.g. HOROVOD_CYCLE_TIME) reach the
workers and are recorded.

Launches alternate N=1 and N=2 `--launches` (5) times, then run 1x2, 2p,
2h and N=3 once each (information, after the pair the efficiency comes
from); each launch times `--rounds` (3) rounds of `--steps` back-to-back
steps after a barrier (a round's step time is its slowest worker's).
Many short launches rather than a few long ones: this VM's cores are
shared with other machines, and a slow spell that lasts a whole launch
(N=2 launches at 2x their usual step were seen) then weighs on few
rounds. Efficiency = median step(N=1) / median step(N=2) over all their
rounds, both from this run; each pair's own ratio is printed and kept
too. Then, in every launch, a few extra steps run under the TF profiler
(per-op time, classified below) and, in `2h` only, the Horovod timeline
(per-collective negotiation and transfer time; with the peer sockets,
each exchange op's time, split into latency + bytes / bandwidth probed
in the same launch), which gives the step breakdown per worker; the
breakdown of the typical launch (median step) is reported and fitted.
Bytes per collective are counted from the router's buffers on the same
batches and cross-checked against the loopback interface counters
(`/proc/net/dev`) over the timed rounds: with Horovod's transport (`2h`;
the peer sockets of one host bypass the loopback device).

Output: benchmarks/results/scaling_bench.json and .png (stacked bars).
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# Step phases, in the order of the stacked bars.
PHASES = (
    "id conversion (sparse->ragged)",
    "id routing (dedup + bucketing)",
    "owner-side lookup + gradient merge",
    "local pooling",
    "fused lookup (N=1)",
    "backward routing",
    "fused lookup backward (N=1)",
    "shard gradient dedup/scale",
    "optimizer (Adagrad)",
    "dense model + framework",
    "collective transfer",
    "idle / wait (negotiation, imbalance)",
)
SINGLE_PROCESS = ("single-process library path: ge.group_embedding_lookup_"
                  "sparse on 26 plain tf.Variables (fused C++ lookup) + "
                  "ge.optimizers.Adagrad, no Horovod, core 0, 1 TF thread")


def _pin_and_limit_threads():
    """Pins this process to its rank's core and TF to one thread.

    Runs before TensorFlow is imported, so that every thread it starts
    (and Horovod's) inherits the affinity.
    """
    rank = int(os.environ.get("HOROVOD_RANK",
                              os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    os.environ["TF_NUM_INTRAOP_THREADS"] = "1"
    os.environ["TF_NUM_INTEROP_THREADS"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return rank, cores[rank % len(cores)]


def _loopback_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmitted bytes
    return 0


def classify(name, op_type):
    """Step phase of one TF op (profiler event `name:type`)."""
    by_type = {
        "GroupEmbeddingSparseToRagged": PHASES[0],
        "GroupEmbeddingCollectiveRouteIds": PHASES[1],
        "GroupEmbeddingCollectiveOwnerGather": PHASES[2],
        "GroupEmbeddingCollectivePool": PHASES[3],
        "GroupEmbeddingPooledLookup": PHASES[4],
        "GroupEmbeddingCollectivePoolGrad": PHASES[5],
        "GroupEmbeddingCollectiveOwnerGatherGrad": PHASES[2],
        "GroupEmbeddingCollectivePoolWeightGrad": PHASES[5],
        "GroupEmbeddingPooledLookupGrad": PHASES[6],
    }
    if op_type in by_type:
        return by_type[op_type]
    if op_type.startswith("Horovod"):
        return "collective enqueue"
    if op_type == "GroupEmbeddingPeerAllToAll":
        return "peer exchange"
    if "optimizer/" in name:
        return PHASES[8]
    if "gradient_reduction/" in name:
        return PHASES[7]
    return PHASES[9]


def profile_phases(logdir):
    """ms per phase and per op type summed over the profiled steps, and
    the steps' wall."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"),
                             recursive=True))
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    phases, ops, wall = {}, {}, 0.0
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        meta = plane.event_metadata
        for line in plane.lines:
            for e in line.events:
                label = meta[e.metadata_id].name
                ms = e.duration_ps / 1e9
                if line.name == "python":
                    if label == "ge_step":
                        wall += ms
                    continue
                if ":" not in label or label.startswith(
                        ("ExecutorState", "Threadpool")):
                    continue
                name, _, op_type = label.rpartition(":")
                phase = classify(name, op_type)
                phases[phase] = phases.get(phase, 0.0) + ms
                if op_type == "GroupEmbeddingPeerAllToAll":
                    phases["peer exchange count"] = phases.get(
                        "peer exchange count", 0.0) + 1
                key = f"{phase} | {op_type}"
                ops[key] = ops.get(key, 0.0) + ms
    return phases, ops, wall


def timeline_collectives(path, steps):
    """Per collective kind: count, negotiation and transfer ms per step.

    Horovod's timeline (rank 0's view) holds, per tensor, NEGOTIATE_* (from
    this rank's request until every rank asked) and the operation with its
    transfer activity (MPI_ALLTOALL / GLOO_ALLREDUCE ...).
    """
    with open(path) as f:
        text = f.read().strip()
    if not text:
        return {}  # no Horovod collective ran (peer-socket transport)
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    names, stacks, out = {}, {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e["pid"]] = e["args"].get("name", "")
        elif e.get("ph") == "B":
            stacks.setdefault(e["pid"], []).append((e["name"], e["ts"]))
        elif e.get("ph") == "E" and stacks.get(e["pid"]):
            what, start = stacks[e["pid"]].pop()
            tensor = names.get(e["pid"], "")
            kind = ("alltoall" if "Alltoall" in tensor else
                    "allreduce" if "Allreduce" in tensor else "other")
            rec = out.setdefault(kind, {"count": 0, "negotiate_ms": 0.0,
                                        "transfer_ms": 0.0,
                                        "allreduce_bytes": 0})
            ms = (e["ts"] - start) / 1e3
            if what.startswith("NEGOTIATE"):
                rec["count"] += 1
                rec["negotiate_ms"] += ms
            elif what in ("MPI_ALLTOALL", "GLOO_ALLREDUCE", "GLOO_ALLGATHER",
                          "MPI_ALLREDUCE"):
                rec["transfer_ms"] += ms
            shape = e.get("args", {}).get("shape")
            if shape and kind == "allreduce":
                dims = [int(x) for x in shape.strip("[]").split(",") if x]
                n = 1
                for d in dims:
                    n *= d
                rec["allreduce_bytes"] += 4 * n
    for rec in out.values():
        for key in ("count", "negotiate_ms", "transfer_ms",
                    "allreduce_bytes"):
            rec[key] = rec[key] / steps
    return out


def exchange_bytes(batch, vocabs, dim, rank, size):
    """Bytes this worker sends per step, per collective, from its batch.

    The router sends, to each owner, K counts + its distinct local rows
    (int64); the owner returns one D-float row per id; the backward sends
    one D-float gradient row per id. Only other workers' pieces cross the
    network. Also returns the distinct-id count and the id count.
    """
    import numpy as np
    k = len(batch)
    to_owner = np.zeros(size, np.int64)
    distinct = total = 0
    for sp in batch:
        ids = np.asarray(sp.values)
        u = np.unique(ids)
        distinct += len(u)
        total += len(ids)
        to_owner += np.bincount(u % size, minlength=size)
    remote = [o for o in range(size) if o != rank]
    ids_b = int(sum(8 * (k + to_owner[o]) for o in remote))
    rows_b = int(sum(4 * dim * to_owner[o] for o in remote))
    return {"ids_alltoall": ids_b, "rows_alltoall": rows_b,
            "grads_alltoall": rows_b, "distinct_ids": int(distinct),
            "ids": int(total), "distinct_to_remote": int(
                sum(to_owner[o] for o in remote))}


def probe_peer_exchange(row_bytes, reps=30):
    """Latency (tiny exchange) and bandwidth (an exchange of `row_bytes`
    per peer) of the peer-socket transport, on the benchmark's cores."""
    import tensorflow as tf

    from group_embedding.distributed import transport
    size = transport.world_size()
    tiny = tf.zeros([size, 1])
    rows = max(1, int(row_bytes // 64 // max(size - 1, 1)))
    big = tf.zeros([size * rows, 16])

    @tf.function
    def exchange(x, n):
        got, _ = transport.alltoall(x, tf.fill([size], n), "probe")
        return tf.reduce_sum(got)

    def timed(x, n):
        exchange(x, n).numpy()
        start = time.perf_counter()
        for _ in range(reps):
            exchange(x, n).numpy()
        return (time.perf_counter() - start) / reps * 1e3

    latency = timed(tiny, 1)
    big_ms = timed(big, rows)
    sent = 64 * rows * (size - 1)
    return {"latency_ms": latency,
            "bytes_per_ms": sent / max(big_ms - latency, 1e-6),
            "exchange_ms": big_ms, "exchange_bytes": sent}


def worker(args):
    """One worker: time the rounds, profile a few steps, print a record."""
    rank, core = _pin_and_limit_threads()
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.path.insert(0, HERE)
    import group_embedding as ge
    from group_embedding.distributed import transport

    import criteo_like

    size = args.workers
    hvd = None
    if size > 1 or args.collective:
        hvd = ge.enable_distributed_strategy("collective")
        assert hvd.size() == size and hvd.rank() == rank
    vocabs = criteo_like.vocab_sizes(args.cap)
    tables = [ge.get_embedding_table(f"c{i}", v, args.dim, replicate=False)
              for i, v in enumerate(vocabs)]
    variables = [t.shard if isinstance(t, ge.ShardedVariable) else t
                 for t in tables]
    dense = tf.Variable(tf.fill([26 * args.dim, 1], 0.01))
    opt = ge.optimizers.Adagrad(0.01, initial_accumulator_value=0.1)
    # Weak scaling: every worker has its own full batch.
    batches = criteo_like.make_batches(args.cap, args.batch,
                                       args.num_batches, seed=100 + rank)

    def train(sp_ids, exchanged, next_ids=None):
        vs = variables + [dense]
        with tf.GradientTape() as tape:
            with tf.name_scope("forward"), \
                    ge.distributed.use_exchanged_ids(exchanged):
                emb = tf.concat(ge.group_embedding_lookup_sparse(
                    tables, sp_ids, "sum"), 1)
                loss = tf.reduce_mean(tf.square(tf.matmul(emb, dense)))
        nxt = {}
        if next_ids is not None:
            with tf.name_scope("next_batch"):
                nxt = ge.distributed.exchange_ids(tables, next_ids)
        with tf.name_scope("backward"):
            grads = tape.gradient(loss, vs)
        # What ge.DistributedGradientTape does after tape.gradient.
        with tf.name_scope("gradient_reduction"):
            grads = ge.allreduce_gradients(grads, vs)
        with tf.name_scope("optimizer"):
            opt.apply_gradients(zip(grads, vs))
        return loss, nxt

    if args.pipeline:
        # The next batch's ids are routed and sent during this step.
        @tf.function(reduce_retracing=True)
        def pipelined(sp_ids, exchanged, next_ids):
            return train(sp_ids, exchanged, next_ids)

        state = {"i": 0, "exchanged": ge.distributed.exchange_ids(
            tables, batches[0])}

        def step(sp_ids):
            del sp_ids  # the loop below feeds batches in order
            i = state["i"]
            loss, state["exchanged"] = pipelined(
                batches[i % len(batches)], state["exchanged"],
                batches[(i + 1) % len(batches)])
            state["i"] = i + 1
            return loss
    else:
        @tf.function(reduce_retracing=True)
        def plain(sp_ids):
            return train(sp_ids, {})[0]

        step = plain

    def barrier():
        if hvd is not None:
            hvd.allreduce(tf.constant(0.0), name="scaling_barrier").numpy()

    for i in range(args.warmup):
        step(batches[i % len(batches)]).numpy()
    rounds = []
    lo_before = _loopback_bytes()
    for _ in range(args.rounds):
        barrier()
        start = time.perf_counter()
        for i in range(args.steps):
            loss = step(batches[i % len(batches)])
        loss.numpy()
        rounds.append((time.perf_counter() - start) / args.steps)
    barrier()
    lo_bytes = _loopback_bytes() - lo_before

    # Breakdown: a few steps under the TF profiler and Horovod timeline.
    logdir = tempfile.mkdtemp(prefix=f"ge_scaling_{size}_{rank}_")
    timeline = os.path.join(logdir, "horovod_timeline.json")
    barrier()
    tf.profiler.experimental.start(logdir, options=(
        tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, python_tracer_level=0,
            device_tracer_level=0)))
    timeline_on = hvd is not None and "HOROVOD_TIMELINE" in os.environ
    if timeline_on and rank == 0:
        hvd.start_timeline(timeline)
    for i in range(args.profile_steps):
        with tf.profiler.experimental.Trace("ge_step", step_num=i):
            step(batches[i % len(batches)]).numpy()
    if timeline_on and rank == 0:
        hvd.stop_timeline()
    tf.profiler.experimental.stop()
    barrier()
    phases, ops, wall = profile_phases(logdir)
    n = args.profile_steps
    phases = {k: v / n for k, v in phases.items()}
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:25]
    record = {
        "workers": size, "rank": rank, "core": core,
        "round_step_s": rounds,
        "profiled_step_ms": wall / n,
        "phases_ms": phases,
        "top_ops_ms": {k: v / n for k, v in top},
        "exchange_bytes": exchange_bytes(batches[0], vocabs, args.dim, rank,
                                         size),
        "loopback_bytes_per_step": lo_bytes / (args.rounds * args.steps),
    }
    if timeline_on and rank == 0:
        time.sleep(0.2)  # the timeline writer thread flushes
        record["collectives"] = timeline_collectives(timeline, n)
    if hvd is not None and transport.active():
        record["peer_probe"] = probe_peer_exchange(
            record["exchange_bytes"]["rows_alltoall"])
    if hvd is not None:
        records = hvd.allgather_object(record)
    else:
        records = [record]
    if rank == 0 or size == 1:  # 1x2: each process its own record
        with open(args.record, "w") as f:
            json.dump(records, f)


def _worker_command(n, args, record):
    """The command line of one benchmark worker of an N=`n` launch."""
    me = [sys.executable, os.path.abspath(__file__), "--worker",
          "--workers", str(n), "--record", record]
    for key in ("batch", "dim", "cap", "steps", "rounds", "warmup",
                "num_batches", "profile_steps"):
        me += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return me


def launch_independent(args, record, copies=2):
    """Runs `copies` single-process (N=1) workers at once, worker r on
    core r, with no exchange between them: what sharing the machine alone
    (memory bandwidth, caches, the host) costs a step. Returns their
    records."""
    procs = []
    for r in range(copies):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   HOROVOD_RANK=str(r))  # picks core r
        procs.append(subprocess.Popen(
            _worker_command(1, args, f"{record}.{r}"), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    records = []
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"1x{copies} worker {r} failed:\n"
                               + out[-4000:])
        with open(f"{record}.{r}") as f:
            records += json.load(f)
    return records


def launch(n, args, record, pipeline=False, horovod_transport=False,
           collective=False):
    """Runs `n` workers (N=1 without Horovod); returns their records.

    `horovod_transport`: exchanges over Horovod's alltoall instead of the
    peer sockets (GROUP_EMBEDDING_TRANSPORT=horovod), for comparison.
    `collective`: N=1 in collective mode under horovodrun (`1c`)."""
    me = _worker_command(n, args, record)
    if pipeline:
        me.append("--pipeline")
    if collective:
        me.append("--collective")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("HOROVOD_TIMELINE", None)
    if horovod_transport:
        env["GROUP_EMBEDDING_TRANSPORT"] = "horovod"
        # Only here do the step's collectives go through Horovod, so only
        # here is its timeline worth its cost: with HOROVOD_TIMELINE set,
        # rank 0 runs Horovod's timeline writer from init to exit, a loop
        # that calls sched_yield() without sleeping. It took 12% of rank
        # 0's core through the timed rounds (perf, this VM), and the
        # slowest worker sets every round.
        env["HOROVOD_TIMELINE"] = "DYNAMIC"
    if n == 1 and not collective:
        cmd = me
    else:
        horovodrun = os.path.join(os.path.dirname(sys.executable),
                                  "horovodrun")
        cmd = [horovodrun, "-np", str(n), "--gloo"] + me
    for _ in range(2):
        result = subprocess.run(cmd, env=env, capture_output=True,
                                text=True, timeout=900)
        # One retry: horovodrun's launcher fails now and then to bind
        # its rendezvous port while other jobs start theirs.
        if result.returncode == 0 or cmd is me:
            break
    if result.returncode != 0:
        raise RuntimeError(f"N={n} failed:\n" + (result.stdout
                                                  + result.stderr)[-4000:])
    with open(record) as f:
        return json.load(f)


def breakdown(records):
    """Per worker: phases (ms) completed with transfer and idle/wait."""
    coll = next((r["collectives"] for r in records if "collectives" in r),
                {})
    transfer = sum(c["transfer_ms"] for c in coll.values())
    peer = [r for r in records if r["phases_ms"].get("peer exchange count")]
    if peer:
        # Peer-socket transport: no negotiation; each exchange op's time
        # is its transfer plus the wait for the slower worker. Split it
        # with the latency and bandwidth probed in the same run.
        probe = next(r["peer_probe"] for r in peer if "peer_probe" in r)
        count = statistics.mean(r["phases_ms"]["peer exchange count"]
                                for r in peer)
        op_ms = statistics.mean(r["phases_ms"]["peer exchange"]
                                for r in peer)
        ex = records[0]["exchange_bytes"]
        nbytes = ex["ids_alltoall"] + ex["rows_alltoall"] + ex["grads_alltoall"]
        wire = count * probe["latency_ms"] + nbytes / probe["bytes_per_ms"]
        coll = {"peer_alltoall": {
            "count": count, "negotiate_ms": 0.0,
            "transfer_ms": min(wire, op_ms), "allreduce_bytes": 0,
            "op_ms": op_ms, "latency_ms": probe["latency_ms"],
            "bytes_per_ms": probe["bytes_per_ms"]}}
        transfer = coll["peer_alltoall"]["transfer_ms"]
    out = []
    for r in sorted(records, key=lambda r: r["rank"]):
        phases = {p: r["phases_ms"].get(p, 0.0) for p in PHASES[:-2]}
        phases[PHASES[9]] += r["phases_ms"].get("collective enqueue", 0.0)
        busy = sum(phases.values())
        phases[PHASES[10]] = transfer
        phases[PHASES[11]] = max(0.0, r["profiled_step_ms"] - busy
                                 - transfer)
        out.append({"rank": r["rank"], "step_ms": r["profiled_step_ms"],
                    "phases_ms": phases,
                    "top_ops_ms": r.get("top_ops_ms", {})})
    return out, coll


def summarize(runs, args):
    """Medians, efficiency, breakdowns; prints and returns the summary."""
    by_n = {}
    for n, records in runs:
        slowest = [max(r["round_step_s"][i] for r in records)
                   for i in range(len(records[0]["round_step_s"]))]
        by_n.setdefault(n, {"rounds_s": [], "launches": []})
        by_n[n]["rounds_s"] += slowest
        by_n[n]["launches"].append(records)
    summary = {}
    for n, d in sorted(by_n.items()):
        med = statistics.median(d["rounds_s"])
        per_launch = [
            1e3 * statistics.median(
                [max(r["round_step_s"][i] for r in records)
                 for i in range(len(records[0]["round_step_s"]))])
            for records in d["launches"]]
        # The breakdown (and so the cost model) comes from the typical
        # launch, the one with the median step, not from one that fell
        # in a slow spell of the machine.
        ranked = sorted(range(len(per_launch)), key=per_launch.__getitem__)
        typical = ranked[(len(per_launch) - 1) // 2]
        last = d["launches"][typical]
        per_worker, coll = breakdown(last)
        ex = [r["exchange_bytes"] for r in last]
        summary[n] = {
            "median_step_ms": 1e3 * med,
            "round_step_ms": [1e3 * x for x in d["rounds_s"]],
            "launch_median_step_ms": per_launch,
            "breakdown_launch": typical,
            "samples_per_s_global": n * args.batch / med,
            "breakdown_per_worker": per_worker,
            "collectives_per_step": coll,
            "exchange_bytes_per_worker": ex,
            "loopback_bytes_per_step_all_workers": max(
                r["loopback_bytes_per_step"] for r in last),
        }
    return summary


def plot(summary, summary_pipelined, summary_hvd, path):
    """Stacked bars of the step breakdown, one bar per (N, worker)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG (pip install -e .[demo])")
        return
    labels, stacks = [], []
    shown = [(n, "", s) for n, s in sorted(summary.items())] + [
        (n, " pipe", s) for n, s in sorted(summary_pipelined.items())] + [
        (n, " hvd", s) for n, s in sorted(summary_hvd.items())]
    for n, label, s in shown:
        for w in s["breakdown_per_worker"]:
            labels.append(f"N={n}{label}\nworker {w['rank']}")
            stacks.append([w["phases_ms"][p] for p in PHASES])
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 4, 5))
    bottom = [0.0] * len(labels)
    colors = plt.get_cmap("tab20").colors
    for i, phase in enumerate(PHASES):
        values = [s[i] for s in stacks]
        if not any(values):
            continue
        ax.bar(labels, values, bottom=bottom, label=phase, color=colors[i])
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step (profiled steps)")
    ax.set_title("criteo-like, per-worker batch fixed, 1 core + 1 TF thread "
                 "per worker")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_model(model):
    """Prints the fitted cost model, its check and its predictions."""
    p = model["params"]
    print(f"cost model: dense {p['dense_ms']:.2f} ms + gaps between ops "
          f"{p['gaps_ms']:.2f} ms + routing "
          f"{p['route_ns_per_id']:.1f} ns/id + owner "
          f"{p['owner_ns_per_distinct_id']:.1f} ns/distinct id + optimizer "
          f"{p['optimizer_ns_per_row']:.1f} ns/row; "
          f"{p['collectives_per_step']:.0f} collectives/step at "
          f"{p['lambda0_ms']:.2f} + {p['lambda1_ms']:.2f} (N-1) ms; "
          f"loopback {p['loopback_bytes_per_ms'] / 1e6:.2f} GB/s")
    for n, c in model["checks"].items():
        print(f"  N={n}: predicted {c['predicted_ms']:.1f} ms, measured "
              f"{c['measured_ms']:.1f} ms ({100 * c['error']:+.0f}%)")
    for n, c in model["predictions"].items():
        print(f"  N={n} on {model['network']['gbit']:.0f} Gbit/s: step "
              f"{c['step_ms']:.1f} ms (compute {c['compute_ms']:.1f}, "
              f"latency {c['latency_ms']:.1f}, wire {c['wire_ms']:.1f}), "
              f"{c['samples_per_s'] / 1e6:.2f} M samples/s, efficiency "
              f"{c['efficiency_vs_n1']:.2f} (pipelined "
              f"{c['efficiency_vs_n1_pipelined']:.2f}), "
              f"{c['bytes_per_worker'] / 2**20:.2f} MiB sent per worker")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0,
                        help="(internal, with --worker) this run's N")
    parser.add_argument("--worker", action="store_true",
                        help="(internal) run as one worker")
    parser.add_argument("--record", help="(internal) where rank 0 writes")
    parser.add_argument("--sizes", default="1,2,1x2,2p,2h,3",
                        help="runs, in launch order: N, Nh for N workers "
                             "over Horovod's collectives, Np for N "
                             "workers with ge.distributed.exchange_ids "
                             "pipelining, 1x2 for two independent "
                             "single-process runs at once (one per core), "
                             "or 1c for one worker in collective mode "
                             "under horovodrun")
    parser.add_argument("--collective", action="store_true",
                        help="(internal, with --worker) collective mode "
                             "even at N=1")
    parser.add_argument("--pipeline", action="store_true",
                        help="(internal, with --worker) pipelined loop")
    parser.add_argument("--launches", type=int, default=5,
                        help="times N=1 and N=2 are launched, alternating "
                             "(the other runs: once)")
    parser.add_argument("--batch", type=int, default=4096,
                        help="per-worker batch")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cap", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-batches", type=int, default=4)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.path.join(
        HERE, "results", "scaling_bench.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.steps, args.rounds, args.warmup, args.launches = 3, 2, 2, 1
        args.profile_steps = 2
    specs = [x.strip() for x in args.sizes.split(",") if x.strip()]
    load_before = os.getloadavg()
    started = time.time()
    runs, runs_pipelined, runs_hvd, runs_indep = [], [], [], []
    runs_c1 = []
    with tempfile.TemporaryDirectory() as tmp:
        # The efficiency pair (plain N <= cores) alternates --launches
        # times; the informational runs (pipelined, Horovod transport,
        # oversubscribed) come once, after it, so that their extra load
        # never falls between the launches the ratio is taken from.
        cores = len(os.sched_getaffinity(0))
        core = [s for s in specs
                if s == "1c" or (s.isdigit() and int(s) <= cores)]
        order = [(i, s) for i in range(args.launches) for s in core] + [
            (0, s) for s in specs if s not in core]
        for launch_i, spec in order:
            if spec == "1x2":
                records = launch_independent(
                    args, os.path.join(tmp, "1x2.json"))
                runs_indep.append((1, records))
                med = 1e3 * statistics.median(
                    max(r["round_step_s"][i] for r in records)
                    for i in range(args.rounds))
                print(f"launch {launch_i}: N=1 x2 independent step "
                      f"{med:.1f} ms", flush=True)
                continue
            if spec == "1c":
                records = launch(1, args, os.path.join(tmp, "1c.json"),
                                 collective=True)
                runs_c1.append((1, records))
                med = 1e3 * statistics.median(records[0]["round_step_s"])
                print(f"launch {launch_i}: N=1 collective mode step "
                      f"{med:.1f} ms", flush=True)
                continue
            n = int(spec.rstrip("ph"))
            pipe, hvd_t = spec.endswith("p"), spec.endswith("h")
            if (pipe or hvd_t) and n == 1:
                continue  # nothing is exchanged at N=1
            records = launch(n, args, os.path.join(tmp, f"{spec}.json"),
                             pipeline=pipe, horovod_transport=hvd_t)
            (runs_pipelined if pipe else runs_hvd if hvd_t
             else runs).append((n, records))
            med = 1e3 * statistics.median(
                max(r["round_step_s"][i] for r in records)
                for i in range(args.rounds))
            label = (" pipelined" if pipe else
                     " Horovod alltoall" if hvd_t else "")
            print(f"launch {launch_i}: N={n}{label} step {med:.1f} ms",
                  flush=True)
    load_after = os.getloadavg()
    summary = summarize(runs, args)
    summary_pipelined = summarize(runs_pipelined, args)
    summary_hvd = summarize(runs_hvd, args)
    summary_indep = summarize(runs_indep, args)
    summary_c1 = summarize(runs_c1, args)
    model = None
    if 1 in summary and 2 in summary:
        import scaling_model
        stats = scaling_model.workload_stats(
            args.cap, args.batch, [1, 2, 3, 8, 16, 64])
        model = scaling_model.fit(summary, stats, 26, args.dim,
                                  len(os.sched_getaffinity(0)),
                                  summary_pipelined, 26 * args.dim)
    eff = eff_pipelined = eff_hvd = None
    if 1 in summary and 2 in summary_hvd:
        eff_hvd = (summary[1]["median_step_ms"]
                   / summary_hvd[2]["median_step_ms"])
    if 1 in summary and 2 in summary:
        eff = summary[1]["median_step_ms"] / summary[2]["median_step_ms"]
    if 1 in summary and 2 in summary_pipelined:
        eff_pipelined = (summary[1]["median_step_ms"]
                         / summary_pipelined[2]["median_step_ms"])
    result = {
        "config": {k: getattr(args, k) for k in (
            "batch", "dim", "cap", "steps", "rounds", "warmup", "launches",
            "profile_steps")},
        "n1_runs": SINGLE_PROCESS,
        "cores": len(os.sched_getaffinity(0)),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "wall_s": time.time() - started,
        "horovod_env": {k: v for k, v in os.environ.items()
                        if k.startswith("HOROVOD_")},
        "weak_scaling_efficiency_n2": eff,
        "weak_scaling_efficiency_n2_pipelined": eff_pipelined,
        "weak_scaling_efficiency_n2_horovod_transport": eff_hvd,
        "results": summary,
        "results_pipelined": summary_pipelined,
        "results_horovod_transport": summary_hvd,
        # Two single-process runs at once, no exchange: the machine's own
        # cost of running both cores.
        "results_1x2_independent": summary_indep,
        "results_1_collective": summary_c1,
        "cost_model": model,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, summary_pipelined, summary_hvd,
         args.out[:-len(".json")] + ".png")
    print(f"N=1 runs the {SINGLE_PROCESS}.")
    print(f"load average before {load_before[0]:.2f}, after "
          f"{load_after[0]:.2f} (1 min)")
    shown = [(n, "", s) for n, s in sorted(summary.items())] + [
        (n, " pipelined", s) for n, s in sorted(summary_pipelined.items())] + [
        (n, " Horovod alltoall", s) for n, s in sorted(summary_hvd.items())]
    for n, label, s in shown:
        note = (" (oversubscribed: ranks share cores)"
                if n > len(os.sched_getaffinity(0)) else "")
        print(f"N={n}{label}: median step {s['median_step_ms']:.1f} ms, "
              f"{s['samples_per_s_global']:.0f} samples/s global{note}")
        for w in s["breakdown_per_worker"]:
            parts = ", ".join(f"{p} {ms:.2f}" for p, ms in
                              w["phases_ms"].items() if ms >= 0.05)
            print(f"  worker {w['rank']} (profiled {w['step_ms']:.1f} ms): "
                  f"{parts}")
        for kind, c in s["collectives_per_step"].items():
            print(f"  {kind}: {c['count']:.1f}/step, negotiation "
                  f"{c['negotiate_ms']:.2f} ms, transfer "
                  f"{c['transfer_ms']:.2f} ms")
        if n > 1:
            ex = s["exchange_bytes_per_worker"][0]
            print(f"  bytes sent by worker 0 per step: ids "
                  f"{ex['ids_alltoall']}, rows {ex['rows_alltoall']}, grads "
                  f"{ex['grads_alltoall']}; loopback (all workers, incl. "
                  f"TCP/Gloo overhead) "
                  f"{s['loopback_bytes_per_step_all_workers']:.0f}")
    if model is not None:
        print_model(model)
    if eff is not None:
        print(f"weak-scaling efficiency step(1)/step(2) = {eff:.2f}")
        pairs = [a / b for a, b in zip(summary[1]["launch_median_step_ms"],
                                       summary[2]["launch_median_step_ms"])]
        print("  per launch pair: " + ", ".join(f"{x:.2f}" for x in pairs))
        if 1 in summary_indep:
            both = summary_indep[1]["median_step_ms"]
            print(f"two independent N=1 runs at once (no exchange): "
                  f"{both:.1f} ms; sharing the machine alone costs "
                  f"step(1x2)/step(1) = "
                  f"{both / summary[1]['median_step_ms']:.2f}; collective "
                  f"mode against that: step(1x2)/step(2) = "
                  f"{both / summary[2]['median_step_ms']:.2f}")
    if 1 in summary and 1 in summary_c1:
        ratio = (summary_c1[1]["median_step_ms"]
                 / summary[1]["median_step_ms"])
        print(f"collective mode with one worker: step(1c)/step(1) = "
              f"{ratio:.2f}")
    if eff_pipelined is not None:
        print(f"weak-scaling efficiency step(1)/step(2 pipelined) = "
              f"{eff_pipelined:.2f}")
    if eff_hvd is not None:
        print(f"weak-scaling efficiency step(1)/step(2 Horovod alltoall) = "
              f"{eff_hvd:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
