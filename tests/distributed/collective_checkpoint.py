"""Checkpoint at N workers, restore at M: identical lookups afterwards.

    horovodrun -np 2 python collective_checkpoint.py --phase save --dir D
    horovodrun -np 3 python collective_checkpoint.py --phase restore --dir D

`save` trains two steps (so values differ from their initial ones and the
EV holds keys), saves with `ge.save_tables`, and records the lookups of a
probe batch. `restore` builds the tables with other seeds, restores, and
checks the probe lookups are equal, and that each EV key sits on its owner.
`--fail-save` makes worker 0 fail while writing a second checkpoint: the
save must raise on every worker and `latest` must still be the first.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.distributed import checkpoint as sharded_checkpoint  # noqa: E402

# (vocab, dim, partition); the last, tiny one stays replicated.
DENSE_TABLES = {"users": (97, 8, "mod"), "items": (300, 8, "div"),
                "tiny": (5, 4, "mod")}


def build(seed_offset):
    tables = {name: ge.get_embedding_table(
                  name, v, d, partition_strategy=p, seed=seed_offset + i,
                  replicate=None if name == "tiny" else False)
              for i, (name, (v, d, p)) in enumerate(DENSE_TABLES.items())}
    tables["tags"] = ge.get_embedding_variable("tags", 8)
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
    for partition in ("mod", "div"):
        names = [n for n in tables
                 if DENSE_TABLES.get(n, (0, 0, "mod"))[2] == partition]
        out += ge.group_embedding_lookup_sparse(
            [tables[n] for n in names], [ids[n] for n in names], "mean",
            partition_strategy=partition, training=training)
    return tf.concat(out, 1)


def train(tables, steps):
    opt = ge.optimizers.Adagrad(0.5)
    variables = [t.shard if isinstance(t, ge.ShardedVariable) else t
                 for t in tables.values()]
    for s in range(steps):
        ids = batch(100 + s)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(lookup(tables, ids, True) - 1.0))
        grads = ge.DistributedGradientTape(tape).gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "restore"])
    parser.add_argument("--dir")
    parser.add_argument("--fail-save", action="store_true")
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy("collective")
    rank, size = hvd.rank(), hvd.size()
    expected_path = os.path.join(args.dir, "expected.npy")

    if args.phase == "save":
        tables = build(0)
        train(tables, 2)
        first = ge.save_tables(args.dir, tables, step=1)
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

    tables = build(1000)  # other initial values than the saved ones
    before = lookup(tables, batch(7), training=False).numpy()
    expected = np.load(expected_path)
    assert not np.allclose(before, expected), "restore would prove nothing"
    ge.restore_tables(args.dir, tables)
    got = lookup(tables, batch(7), training=False).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    keys = tables["tags"].export()[0].numpy()
    assert len(keys) > 0 and np.all(np.mod(keys, size) == rank)
    print(f"worker {rank}/{size}: restored, probe lookups equal", flush=True)


if __name__ == "__main__":
    main()
