"""Checkpoint at N workers, restore at M: identical lookups afterwards.

    horovodrun -np 2 python collective_checkpoint.py --phase save --dir D
    horovodrun -np 3 python collective_checkpoint.py --phase restore --dir D

`save` trains two steps (so values differ from their initial ones and the
EV holds keys), saves with `ge.save_tables`, and records the lookups of a
probe batch; it also round-trips the shards and the optimizer through
`tf.train.Checkpoint` at the same worker count. `restore` builds the
tables with other seeds, restores, and checks the probe lookups are equal,
and that each EV key sits on its owner.
`--fail-save` makes worker 0 fail while writing a second checkpoint: the
save must raise on every worker and `latest` must still be the first.
`--tier` gives the EV a disk tier (DRAM_SSDHASH) whose DRAM holds 3 rows:
at the save some of each worker's keys are on disk (checked), and the
restore at M workers goes into tiered EVs too.
`--hbm` gives the EV of this phase its table in GPU memory
(StorageType.HBM, on the CUDA core's host stand-in: the test sets
GROUP_EMBEDDING_HBM_ON_HOST=1); a save of HBM EVs restores into DRAM EVs
and the other way round, as a single process's does.
"""

import argparse
import glob
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding import model_parallel  # noqa: E402
from group_embedding.distributed import checkpoint as sharded_checkpoint  # noqa: E402
from group_embedding.ops import ev_storage  # noqa: E402

# (vocab, dim, partition); the tiny one stays replicated; "table": whole
# on the last worker (at 2 workers rank 1, at 3 rank 2, at 1 rank 0), so
# a restore at another count moves it to another worker.
DENSE_TABLES = {"users": (97, 8, "mod"), "items": (300, 8, "div"),
                "tiny": (5, 4, "mod"), "genres": (70, 8, "table")}


def placement_args(name, partition, size):
    """`get_embedding_table` keywords of one of DENSE_TABLES."""
    if partition == "table":
        return {"placement": f"table:{size - 1}"}
    if name == "tiny":
        return {}
    return {"partition_strategy": partition, "replicate": False}


# The disk tier's index (64 slots of 12 bytes while it holds <= 51 keys)
# plus 3 rows of dim 8 with one Adagrad slot (24 + 12 + 2 * 4 * 8 bytes).
TIER_DRAM_BYTES = 64 * 12 + 3 * (24 + 12 + 2 * 4 * 8)


def build(seed_offset, tier=None, hbm=False):
    """The tables; `tier`: the EV's disk tier folder (None: all DRAM);
    `hbm`: the EV's table in GPU memory."""
    size = model_parallel.world()[1]
    tables = {name: ge.get_embedding_table(
                  name, v, d, seed=seed_offset + i,
                  **placement_args(name, p, size))
              for i, (name, (v, d, p)) in enumerate(DENSE_TABLES.items())}
    genres = tables["genres"]
    if size > 1:
        assert genres.owner_rank == size - 1, genres.partition_strategy
        assert genres.shard.shape[0] == (70 if genres.shard_index
                                         == size - 1 else 0)
    option = None
    if tier:
        option = ge.EmbeddingVariableOption(storage_option=ge.StorageOption(
            ge.StorageType.DRAM_SSDHASH, storage_path=tier,
            storage_size=[TIER_DRAM_BYTES]))
    elif hbm:
        option = ge.EmbeddingVariableOption(
            storage_option=ge.StorageOption(ge.StorageType.HBM))
    tables["tags"] = ge.get_embedding_variable("tags", 8, ev_option=option)
    assert tables["tags"].ge_table_kind == ("hbm_ev" if hbm else "ev")
    ge.broadcast_variables([tables["tags"]])
    return tables


def batch(seed, rows=16):
    rng = np.random.default_rng(seed)
    ids = {}
    for name, (v, _, _) in DENSE_TABLES.items():
        lengths = rng.integers(0, 3, rows)
        ids[name] = tf.RaggedTensor.from_row_lengths(
            rng.integers(0, v, lengths.sum()), lengths)
    lengths = rng.integers(0, 4, rows)
    pool = np.random.default_rng(0).integers(-10 ** 12, 10 ** 12, 40)
    keys = pool[rng.integers(0, 40, lengths.sum())]
    ids["tags"] = tf.RaggedTensor.from_row_lengths(keys, lengths)
    return ids


def lookup(tables, ids, training):
    out = []
    # Table-wise tables ignore the lookup's partition_strategy.
    for partition in ("mod", "div"):
        names = [n for n in tables if partition == (
            "div" if DENSE_TABLES.get(n, (0, 0, ""))[2] == "div" else "mod")]
        out += ge.group_embedding_lookup_sparse(
            [tables[n] for n in names], [ids[n] for n in names], "mean",
            partition_strategy=partition, training=training)
    return tf.concat(out, 1)


def variables_of(tables):
    """The dense tables' variables (shards, replicated), no EVs."""
    return [t.shard if isinstance(t, ge.ShardedVariable) else t
            for t in tables.values() if not hasattr(t, "lookup_rows")]


def train(tables, steps):
    """`steps` Adagrad steps; returns the optimizer."""
    opt = ge.optimizers.Adagrad(0.5)
    variables = [t.shard if isinstance(t, ge.ShardedVariable) else t
                 for t in tables.values()]
    for s in range(steps):
        ids = batch(100 + s)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(lookup(tables, ids, True) - 1.0))
        grads = ge.DistributedGradientTape(tape).gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
    return opt


def check_tf_checkpoint(tables, opt, folder, rank):
    """tf.train.Checkpoint of this worker's shards (zero-row ones too)
    and Adagrad slots restores them at the same worker count."""
    variables = variables_of(tables)
    state = [v.numpy() for v in variables + list(opt.variables)]
    ckpt = tf.train.Checkpoint(tables=variables, optimizer=opt)
    path = ckpt.write(os.path.join(folder, f"tf-{rank}", "ckpt"))
    for v in variables + list(opt.variables):
        v.assign(tf.zeros_like(v) + 3)
    ckpt.read(path).assert_consumed()
    for v, want in zip(variables + list(opt.variables), state):
        np.testing.assert_array_equal(v.numpy(), want)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "restore"])
    parser.add_argument("--dir")
    parser.add_argument("--fail-save", action="store_true")
    parser.add_argument("--tier", action="store_true")
    parser.add_argument("--hbm", action="store_true")
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy("collective")
    rank, size = hvd.rank(), hvd.size()
    expected_path = os.path.join(args.dir, "expected.npy")
    tier = (os.path.join(args.dir, f"tier-{args.phase}-{rank}")
            if args.tier else None)

    if args.phase == "save":
        tables = build(0, tier, args.hbm)
        opt = train(tables, 2)
        if tier:
            in_dram, on_disk = ev_storage.tier_stats(
                tables["tags"].handle).numpy()[:2]
            # The last step's keys were promoted into DRAM (it may exceed
            # its budget by one op's keys); the others are on disk.
            assert on_disk > 0 and in_dram > 0, (in_dram, on_disk)
        check_tf_checkpoint(tables, opt, args.dir, rank)
        first = ge.save_tables(args.dir, tables, step=1)
        keys, values = (x.numpy() for x in tables["tags"].export()[:2])
        if tier:
            assert len(keys) == in_dram + on_disk, (len(keys), on_disk)
        np.savez(os.path.join(args.dir, f"ev-{rank}.npz"), keys=keys,
                 values=values)
        probe = lookup(tables, batch(7), training=False).numpy()
        if rank == 0:
            np.save(expected_path, probe)
        if args.fail_save:
            original = sharded_checkpoint._table_arrays

            def broken(name, table, r):
                if r == 0 and name == "tags":
                    raise OSError("disk full (simulated)")
                return original(name, table, r)

            sharded_checkpoint._table_arrays = broken
            try:
                ge.save_tables(args.dir, tables, step=2)
            except RuntimeError as e:
                print(f"worker {rank}: failed save raised: {e}", flush=True)
            else:
                raise AssertionError("a failed save did not raise")
            assert sharded_checkpoint.latest_checkpoint(args.dir) == first
        print(f"worker {rank}/{size}: saved", flush=True)
        return

    # Other initial values than the saved ones.
    tables = build(1000, tier, args.hbm)
    before = lookup(tables, batch(7), training=False).numpy()
    expected = np.load(expected_path)
    assert not np.allclose(before, expected), "restore would prove nothing"
    ge.restore_tables(args.dir, tables)
    got = lookup(tables, batch(7), training=False).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    keys, values = (x.numpy() for x in tables["tags"].export()[:2])
    assert len(keys) > 0 and np.all(np.mod(keys, size) == rank)
    # Every saved key this worker owns now, whichever tier held it, with
    # its row (the oracle: what each saving worker exported).
    saved = [np.load(f) for f in sorted(glob.glob(
        os.path.join(args.dir, "ev-*.npz")))]
    want_keys = np.concatenate([z["keys"] for z in saved])
    want_values = np.concatenate([z["values"] for z in saved])
    mine = np.mod(want_keys, size) == rank
    order, want_order = np.argsort(keys), np.argsort(want_keys[mine])
    np.testing.assert_array_equal(keys[order], want_keys[mine][want_order])
    np.testing.assert_array_equal(values[order],
                                  want_values[mine][want_order])
    print(f"worker {rank}/{size}: restored, probe lookups equal"
          f"{' (HBM EV)' if args.hbm else ''}", flush=True)


if __name__ == "__main__":
    main()
