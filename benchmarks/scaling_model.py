"""Cost model of one collective-mode step, fitted on scaling_bench runs.

Per worker, with a fixed per-worker batch B (weak scaling), K tables of
dim D, N workers on `cores` cores:

    I        ids per worker per step (B x mean ids per sample)
    U        distinct ids per worker per step (per table, summed)
    U_own(N) rows an owner updates: its share of the union of all
             workers' distinct ids, |U_1 + ... + U_N| / N (Zipf: < U)
    bytes(N) sent per worker: ids 8 (U (N-1)/N + K (N-1)), rows and
             gradients 4 D U (N-1)/N each (the own share stays local),
             dense gradients of P floats: 4 P (N-1) when averaged in one
             exchange (N=2, or 4 P <= 64 KiB), else 2 x 4 P (N-1)/N
             (reduce-scatter + all-gather)
    n_coll   exchanges on a step's critical path, counted in the N=2 run:
             3 alltoalls (ids, rows, gradients) + the dense allreduce
             (peer sockets: 1 exchange at N=2 or for small buffers, else
             2; Horovod: 1), so 4 here; one less with
             `ge.distributed.exchange_ids` pipelining (the ids of the next
             batch travel in the step)

    C(N) = dense + conversion + gaps + r I + o U + a U_own(N)  (N >= 2)
    C(1) = measured single-process compute (fused lookup)
    L(N) = n_coll (lambda0 + lambda1 (N - 1)) + bytes(N) / beta
    T(N) = ceil(N / cores) C(N) + L(N)

(the step is the slowest worker's: with N > cores, ranks placed round-
robin, some core runs ceil(N / cores) of them, each at that fraction of
the core)

r (routing: router + pooling + its gradient, per id), o (owner lookup and
gradient merge, per received distinct id), a (optimizer and gradient
scaling, per updated row) and `dense` come from the N=2 profile; `gaps`
is the time between ops on the worker's one thread (executor and Python
dispatch), measured at N=1 where nothing waits for a peer; lambda0,
lambda1 (latency of one exchange) and beta (bytes per ms): with the peer
sockets (default), from a tiny and a rows-sized exchange probed in the
N=2 and N=3 launches; with Horovod's collectives (cycle, negotiation,
Gloo), from the Horovod timeline of those runs. For a cluster the measured
loopback latency is replaced by a network one (assumptions below, not
measured here: one machine); Horovod adds its cycle and negotiation.
"""

import math
import os
from typing import Dict
from typing import List

import numpy as np

# Network assumptions for the predictions (not measurable on one host).
NET_GBIT = 25.0
ALPHA_NET_MS = 0.05      # one small TCP message through a 25 GbE switch
PER_PEER_MS = 0.005      # per-peer cost inside one alltoallv / gather
# HOROVOD_CYCLE_TIME of the run (collective mode's default unless set).
CYCLE_MS = float(os.environ.get("HOROVOD_CYCLE_TIME", "2"))
PREDICT_N = (8, 16, 64, 256, 1024)


def workload_stats(cap: int, batch: int, workers: List[int],
                   seed0: int = 100) -> Dict:
    """I, U and U_own(N) of the criteo-like batches the workers train on.

    Worker w draws its batch with seed `seed0 + w`, as scaling_bench does.
    """
    import criteo_like
    n_max = max(workers)
    union = [set() for _ in range(26)]
    ids_total = distinct_total = 0
    u_own = {}
    for w in range(n_max):
        batch_w = criteo_like.make_batches(cap, batch, 1, seed=seed0 + w)[0]
        for t, sp in enumerate(batch_w):
            values = np.asarray(sp.values)
            d = np.unique(values)
            union[t].update(d.tolist())
            if w == 0:
                ids_total += len(values)
                distinct_total += len(d)
        if w + 1 in workers:
            u_own[w + 1] = sum(len(u) for u in union) / (w + 1)
    return {"ids": ids_total, "distinct": distinct_total, "u_own": u_own,
            "batch": batch}


def exchange_bytes(n: int, distinct: float, k: int, dim: int,
                   dense_params: int = 0) -> float:
    """Bytes one worker sends per step (ids, rows back, gradients, and the
    average of `dense_params` float32 dense gradients, as
    `transport.allreduce_mean` sends them)."""
    if n == 1:
        return 0.0
    remote = distinct * (n - 1) / n
    one_round = n == 2 or 4 * dense_params <= 64 * 1024
    dense = (4 * dense_params * (n - 1) if one_round
             else 2 * 4 * dense_params * (n - 1) / n)
    return 8 * (remote + k * (n - 1)) + 2 * 4 * dim * remote + dense


def _mean_phases(summary_n) -> Dict[str, float]:
    workers = summary_n["breakdown_per_worker"]
    keys = workers[0]["phases_ms"].keys()
    return {k: float(np.mean([w["phases_ms"][k] for w in workers]))
            for k in keys}


def _comm_ms(summary_n) -> float:
    return sum(c["negotiate_ms"] + c["transfer_ms"]
               for c in summary_n["collectives_per_step"].values())


def _coll_count(summary_n) -> float:
    return sum(c["count"] for c in summary_n["collectives_per_step"].values())


def fit(summary: Dict, stats: Dict, k: int, dim: int, cores: int,
        summary_pipelined: Dict = None, dense_params: int = 0) -> Dict:
    """Fits the model on N=1, 2 (and 3 if present) and predicts.

    `summary_pipelined` (runs with `exchange_ids` pipelining) is only
    checked against the prediction, not fitted on.
    """
    def nbytes(n):
        return exchange_bytes(n, u, k, dim, dense_params)

    s1, s2 = summary[1], summary[2]
    p1, p2 = _mean_phases(s1), _mean_phases(s2)
    i, u = stats["ids"], stats["distinct"]
    u_own2 = stats["u_own"][2]
    dense = (p2["dense model + framework"]
             + p2["id conversion (sparse->ragged)"])
    # Time between ops, not spent in any op: at N=1 nothing waits for a
    # peer, so it is the framework's own per-step cost.
    gaps = p1["idle / wait (negotiation, imbalance)"]
    r = (p2["id routing (dedup + bucketing)"] + p2["local pooling"]
         + p2["backward routing"]) / i
    o = p2["owner-side lookup + gradient merge"] / u
    a = (p2["optimizer (Adagrad)"] + p2["shard gradient dedup/scale"]) / u_own2
    c1 = sum(v for key, v in p1.items()
             if key not in ("collective transfer",
                            "idle / wait (negotiation, imbalance)"))
    t1 = s1["median_step_ms"]
    # Communication: one latency per collective plus bytes / beta.
    n_coll = _coll_count(s2)
    bytes2 = nbytes(2)
    peer = "peer_alltoall" in s2["collectives_per_step"]
    if peer:
        # Peer sockets: latency and bandwidth probed in the same launch
        # (a tiny exchange, one of the rows' size); nothing is negotiated.
        c2 = s2["collectives_per_step"]["peer_alltoall"]
        beta = c2["bytes_per_ms"]
        lat2 = lat3 = c2["latency_ms"]
        if 3 in summary:
            lat3 = summary[3]["collectives_per_step"]["peer_alltoall"][
                "latency_ms"]
    else:
        transfer2 = sum(c["transfer_ms"]
                        for c in s2["collectives_per_step"].values())
        beta = bytes2 / max(transfer2, 1e-6)  # loopback bytes per ms
        lat2 = (_comm_ms(s2) - bytes2 / beta) / n_coll
        lat3 = lat2
        if 3 in summary:
            bytes3 = nbytes(3)
            lat3 = (_comm_ms(summary[3]) - bytes3 / beta) / _coll_count(
                summary[3])
    lambda1 = lat3 - lat2
    lambda0 = lat2 - lambda1

    def compute(n):
        return dense + gaps + r * i + o * u + a * stats["u_own"].get(
            n, stats["u_own"][max(stats["u_own"])])

    checks = {}
    runs = [(n, str(n), summary[n], n_coll) for n in sorted(summary)]
    runs += [(n, f"{n}p", s, n_coll - 1)
             for n, s in sorted((summary_pipelined or {}).items())]
    for n, label, s, on_path in runs:
        if n == 1:
            continue
        over = math.ceil(n / cores)  # ranks on the busiest core
        comm = on_path * (lambda0 + lambda1 * (n - 1)) + nbytes(n) / beta
        pred = over * compute(n) + comm
        meas = s["median_step_ms"]
        checks[label] = {"predicted_ms": pred, "measured_ms": meas,
                         "error": pred / meas - 1,
                         "compute_ms": over * compute(n),
                         "communication_ms": comm,
                         "collectives_on_path": on_path}
    beta_net = NET_GBIT * 1e9 / 8 / 1e3  # bytes per ms
    predictions = {}
    for n in PREDICT_N:
        u_own = _u_own_extrapolated(stats, n)
        comp = dense + gaps + r * i + o * u + a * u_own
        # One exchange: a message per peer; Horovod adds its cycle and
        # the negotiation through rank 0.
        per_coll = ALPHA_NET_MS + PER_PEER_MS * (n - 1)
        if not peer:
            per_coll += (CYCLE_MS / 2 + PER_PEER_MS * n
                         + 2 * ALPHA_NET_MS * math.ceil(math.log2(n)))
        wire = nbytes(n) / beta_net
        step = comp + n_coll * per_coll + wire
        step_pipe = comp + (n_coll - 1) * per_coll + wire
        predictions[n] = {"step_ms": step, "compute_ms": comp,
                          "latency_ms": n_coll * per_coll, "wire_ms": wire,
                          "bytes_per_worker": nbytes(n),
                          "collectives_per_step": n_coll,
                          "samples_per_s": n * stats["batch"] / step * 1e3,
                          "efficiency_vs_n1": t1 / step,
                          "step_ms_pipelined": step_pipe,
                          "efficiency_vs_n1_pipelined": t1 / step_pipe}
    return {
        "params": {"dense_ms": dense, "gaps_ms": gaps,
                   "route_ns_per_id": 1e6 * r,
                   "owner_ns_per_distinct_id": 1e6 * o,
                   "optimizer_ns_per_row": 1e6 * a,
                   "single_process_compute_ms": c1,
                   "collectives_per_step": n_coll,
                   "lambda0_ms": lambda0, "lambda1_ms": lambda1,
                   "loopback_bytes_per_ms": beta,
                   "transport": "peer sockets" if peer else "horovod"},
        "stats": stats,
        "checks": checks,
        "network": {"gbit": NET_GBIT, "alpha_ms": ALPHA_NET_MS,
                    "per_peer_ms": PER_PEER_MS, "cycle_ms": CYCLE_MS},
        "predictions": predictions,
    }


def _u_own_extrapolated(stats, n):
    """U_own(n): measured up to the largest N sampled, then the union
    grows like its last measured doubling (Zipf: sublinearly)."""
    known = stats["u_own"]
    if n in known:
        return known[n]
    top = max(known)
    half = max(m for m in known if m <= top // 2)
    # How much the union grows per doubling of N, at the largest N known.
    growth = ((known[top] * top) / (known[half] * half)) ** (
        1 / math.log2(top / half))
    union = known[top] * top * growth ** math.log2(n / top)
    return union / n
