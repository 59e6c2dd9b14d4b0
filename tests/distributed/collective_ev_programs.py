"""Random EV programs: collective workers against one process.

    python collective_ev_programs.py --mode single --seeds 0,1 --out D
    horovodrun -np N python collective_ev_programs.py --mode collective \
        --seeds 0,1 --out D [--storage dram|ssd|hbm]

Each seed draws a program of about 24 ops on two EmbeddingVariables, each
with its own drawn CounterFilter and GlobalStepEvict (or none), and one
drawn optimizer (SGD, Adagrad, Adam, FTRL). The draws do not depend on
the rank or the mode, so every worker and the single process run the
same program:
- training steps of a group of one to three features over the two EVs
  (an EV read by up to three of them; drawn combiners, weights,
  `max_norm`, eager or traced), on a global batch of 8 rows that the
  workers split (uneven, an empty slice at N = 3);
- `training=False` lookups of a global batch;
- `evict()`;
- `ge.save_tables` (incremental, `full_every=3`) and `ge.restore_tables`
  of the last save (a rewind when steps ran since); with
  `--restore-from`, of the single process's save at that op instead (a
  checkpoint of one process resharded over the workers).

The single process (`--mode single`) keeps both EVs in DRAM; the
collective workers (model parallel: a key's owner is key mod N) keep
them in `--storage`: DRAM, DRAM_SSDHASH with a DRAM tier of a few rows
(every worker on the same storage_path, as one host's workers are),
HBM or HBM_DRAM with a GPU table of 128 keys (the CUDA core's host
stand-in, GROUP_EMBEDDING_HBM_ON_HOST=1; `--keys` more than it holds).

Each process writes D/<mode>-<rank>.npz: per seed and op, the op's
global outputs (the loss summed over the batch, the lookup rows) and
this process's part of each EV (keys, values, slots, frequencies,
versions). test_collective_ev_programs.py merges the workers' parts and
compares them with the single process after every op.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402

# tests/testing.py, the tests' shared helpers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))
from testing import second_tier_keys  # noqa: E402

DIM = 4
GLOBAL_BATCH = 8
OPS = 24
COMBINERS = ["sum", "mean", "sqrtn"]
# One DRAM row with up to two optimizer slots (Adam), its bookkeeping
# (ev_storage.h), and the disk index of up to 64 keys: a DRAM tier of
# about 4 rows.
SSD_BUDGET = 64 * 12 + 4 * (24 + 29 + 3 * 4 * DIM)


def key_space(n):
    """`n` keys of both signs, spread over the owners (key mod N)."""
    return np.arange(n, dtype=np.int64) * 1_000_003 - 25_000_000


def make_optimizer(index):
    return [lambda: ge.optimizers.SGD(0.2),
            lambda: ge.optimizers.Adagrad(0.1),
            # Workers sum a key's gradient parts in another order than
            # one process: a larger epsilon than Adam's 1e-7 keeps that
            # rounding from turning a nearly cancelled gradient into a
            # full step (as collective_train.py).
            lambda: ge.optimizers.Adam(0.05, epsilon=1e-3),
            lambda: ge.optimizers.Ftrl(0.2, l1_regularization_strength=0.01,
                                       l2_regularization_strength=0.02),
            ][index]()


def draw_program(seed, num_keys):
    """(EV options, optimizer index, ops) of `seed` over `num_keys` keys."""
    keys = key_space(num_keys)
    rng = np.random.default_rng(seed)
    options = []
    for _ in range(2):
        options.append({
            "filter": bool(rng.integers(2)),
            "evict": bool(rng.integers(2)),
        })
    optimizer = int(rng.integers(4))
    ops, saved = [], False
    for _ in range(OPS):
        kind = rng.choice(["train"] * 10 + ["infer"] * 3 + ["evict"] * 2 +
                          ["save"] * 2 + ["restore"])
        if kind == "restore" and not saved:
            kind = "save"
        saved |= kind == "save"
        op = {"kind": str(kind)}
        if kind in ("train", "infer"):
            n = int(rng.integers(1, 4))
            op["evs"] = [int(rng.integers(2)) for _ in range(n)]
            op["combiners"] = [str(rng.choice(COMBINERS)) for _ in range(n)]
            op["weighted"] = bool(rng.integers(2))
            op["traced"] = bool(rng.integers(2))
            op["max_norm"] = [None, 0.9][int(rng.integers(2))]
            op["feats"] = []
            for _ in range(n):
                lengths = rng.integers(0, 5, GLOBAL_BATCH)
                ids = rng.choice(keys, lengths.sum())
                weights = rng.uniform(0.5, 2.0, lengths.sum()).astype("f")
                op["feats"].append((lengths, ids, weights))
        ops.append(op)
    return options, optimizer, ops


def slice_rows(feat, lo, hi):
    """Ragged ids and weights of global rows [lo, hi)."""
    lengths, ids, weights = feat
    splits = np.concatenate([[0], np.cumsum(lengths)])
    part = slice(splits[lo], splits[hi])
    row_splits = splits[lo:hi + 1] - splits[lo]
    return (tf.RaggedTensor.from_row_splits(ids[part], row_splits),
            tf.RaggedTensor.from_row_splits(weights[part], row_splits))


def make_ev(name, seed, opts, storage):
    option = ge.EmbeddingVariableOption(
        init_option=ge.InitializerOption(default_value_dim=7),
        filter_option=(ge.CounterFilter(filter_freq=2)
                       if opts["filter"] else None),
        evict_option=(ge.GlobalStepEvict(steps_to_live=3)
                      if opts["evict"] else None),
        storage_option=storage)
    return ge.get_embedding_variable(
        name, DIM, initializer=tf.keras.initializers.RandomUniform(
            -1.0, 1.0, seed=seed), ev_option=option)


def storage_of(kind, folder):
    if kind == "ssd":
        return ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                                storage_path=folder,
                                storage_size=[SSD_BUDGET])
    if kind == "hbm":
        return ge.StorageOption(ge.StorageType.HBM)
    if kind == "hbm_dram":  # a GPU table of 128 keys over host memory
        return ge.StorageOption(ge.StorageType.HBM_DRAM, storage_size=[1])
    return ge.StorageOption()


def state(ev):
    """This process's part of `ev`: keys, values, slots, freqs, versions."""
    keys, values, freqs, versions, _, _, slots, _ = [
        np.asarray(x) for x in ev.storage.export(ev.handle, DIM)]
    return {"keys": keys, "values": values, "slots": slots,
            "freqs": freqs, "versions": versions}


def run_program(seed, args, hvd, out):
    """Runs the program of `seed` (on this worker's slices when `hvd`,
    the collective module, is given) and records every op's outputs and
    EV states into `out`."""
    rank, size = (hvd.rank(), hvd.size()) if hvd else (0, 1)
    options, optimizer, ops = draw_program(seed, args.keys)
    storage = args.storage if hvd else "dram"
    evs = [make_ev(f"s{seed}_ev{i}", seed * 10 + i, opts, storage_of(
        storage, os.path.join(args.out, f"tier-s{seed}-ev{i}")))
        for i, opts in enumerate(options)]
    if hvd:
        ge.broadcast_variables(evs)
    opt = make_optimizer(optimizer)
    cuts = np.linspace(0, GLOBAL_BATCH, size + 1).astype(int)
    if size == 3:
        cuts[1] = 0  # worker 0 gets an empty slice
    lo, hi = cuts[rank], cuts[rank + 1]
    ckpt_dir = os.path.join(args.out, f"ckpt-{args.mode}-s{seed}")
    traced = {}

    def lookup(op, ids, weights, training):
        return ge.group_embedding_lookup_sparse(
            [evs[e] for e in op["evs"]], ids, op["combiners"],
            sp_weights=weights if op["weighted"] else None,
            max_norm=op["max_norm"], training=training)

    def train(op, ids, weights):
        used = [evs[e] for e in sorted(set(op["evs"]))]
        with tf.GradientTape() as tape:
            outs = lookup(op, ids, weights, True)
            loss = tf.add_n([tf.reduce_sum(tf.square(o - 0.25))
                             for o in outs])
            # Horovod averages gradients over the workers: scale this
            # slice's sum so that the average is the global batch's.
            scaled = loss * size
        if hvd:
            tape = ge.DistributedGradientTape(tape)
        opt.apply_gradients(zip(tape.gradient(scaled, used), used))
        return loss

    last_save = None
    foreign = (dict(np.load(os.path.join(args.restore_from, "single-0.npz")))
               if args.restore_from else None)
    for i, op in enumerate(ops):
        prefix = f"s{seed}/op{i}"
        kind = op["kind"]
        if kind in ("train", "infer"):
            parts = [slice_rows(f, lo, hi) for f in op["feats"]]
            ids = [p[0] for p in parts]
            weights = [p[1] for p in parts]
            if kind == "train":
                if op["traced"]:
                    key = (tuple(op["evs"]), tuple(op["combiners"]),
                           op["weighted"], op["max_norm"])
                    if key not in traced:
                        traced[key] = tf.function(
                            lambda a, b, op=op: train(op, a, b),
                            reduce_retracing=True)
                    loss = traced[key](ids, weights)
                else:
                    loss = train(op, ids, weights)
                if hvd:
                    loss = hvd.allreduce(loss, op=hvd.Sum)
                out[f"{prefix}/loss"] = loss.numpy()
            else:
                outs = lookup(op, ids, weights, False)
                for f, o in enumerate(outs):
                    out[f"{prefix}/rows{f}"] = (
                        hvd.allgather(o) if hvd else o).numpy()
        elif kind == "evict":
            for ev in evs:
                if ev.ev_option.evict_option is not None:
                    ev.evict()
        elif kind == "save":
            path = ge.save_tables(
                ckpt_dir, {"a": evs[0], "b": evs[1]}, i, full_every=3)
            last_save = (path, i)
            out[f"{prefix}/saved"] = np.asarray(path)
        elif kind == "restore":
            path, at = last_save
            if foreign is not None:
                # The single process's save of that op, resharded.
                path = str(foreign[f"s{seed}/op{at}/saved"])
            ge.restore_tables(path, {"a": evs[0], "b": evs[1]})
        for e, ev in enumerate(evs):
            for field, value in state(ev).items():
                out[f"{prefix}/ev{e}/{field}"] = value
    out[f"s{seed}/ops"] = np.asarray([op["kind"] for op in ops])
    # Keys in the second tier (disk, host memory) at the end: the
    # programs moved keys between the tiers.
    out[f"s{seed}/second_tier"] = np.asarray(
        [second_tier_keys(ev) for ev in evs])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["single", "collective"])
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--out")
    parser.add_argument("--storage", default="dram",
                        choices=["dram", "ssd", "hbm", "hbm_dram"])
    # The key space (hbm_dram: more keys than a worker's GPU table).
    parser.add_argument("--keys", type=int, default=50)
    # A folder of a --mode single run of the same seeds: restores read
    # its checkpoints (written by one process) instead of this run's.
    parser.add_argument("--restore-from")
    args = parser.parse_args()
    hvd = (ge.enable_distributed_strategy("collective")
           if args.mode == "collective" else None)
    rank = hvd.rank() if hvd else 0
    out = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        run_program(seed, args, hvd, out)
    np.savez(os.path.join(args.out, f"{args.mode}-{rank}.npz"), **out)
    print(f"{args.mode} {rank}: programs {args.seeds} done", flush=True)


if __name__ == "__main__":
    main()
