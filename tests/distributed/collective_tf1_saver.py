"""TF1 `Saver` / `MonitoredTrainingSession` checkpoints in collective mode,
every worker given the SAME checkpoint directory (as DeepRec's model zoo
scripts do under horovodrun).

    horovodrun -np 2 python collective_tf1_saver.py --phase train --dir D
    horovodrun -np 2 python collective_tf1_saver.py --phase restore --dir D
    horovodrun -np 2 python collective_tf1_saver.py --phase foreign --dir D
    horovodrun -np 2 python collective_tf1_saver.py --phase torn --dir D

`train`: each worker trains an EV and a row-sharded table for a few steps
on its own ids (so every worker holds other rows), the session saves into
D, and the worker records its rows (`D/expected-R.npz`).
`restore`: a fresh graph restores from D; every worker must get back
exactly its own rows (the oracle: what it recorded before the save).
`foreign`: worker R restores the other worker's files, copied to a plain
directory (`D-copy-of-...`): the EV must refuse the keys it does not own.
`torn` (after the test removed `D/worker-1/checkpoint`, as if worker 1's
last save had not completed): the restore must refuse on every worker,
naming the workers' latest checkpoints.
Each worker prints one line starting with "ok:" when its checks pass.
"""

import argparse
import glob
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.distributed import worker_checkpoints  # noqa: E402

V1 = tf.compat.v1
STEPS = 3


def build():
    """The model: an EV and a row-sharded table looked up together."""
    ev = ge.get_embedding_variable("clicks", 4)
    table = ge.get_embedding_table("items", 64, 4, replicate=False)
    ids = V1.placeholder(tf.int64, [None])
    sp = tf.sparse.from_dense(tf.reshape(ids, [-1, 1]) + 1)
    sp = tf.SparseTensor(sp.indices, sp.values - 1, sp.dense_shape)
    emb = ge.group_embedding_lookup_sparse([ev, table], [sp, sp],
                                           ["sum", "sum"])
    loss = tf.reduce_sum(tf.square(tf.concat(emb, 1) - 1.0))
    step = V1.train.get_or_create_global_step()
    train = ge.train.AdagradOptimizer(0.3).minimize(loss, global_step=step)
    return ev, table, ids, train


def row_ops(ev, table):
    """Ops reading a worker's rows (built before the session finalizes
    the graph)."""
    keys, values, _, _ = ev.export()
    return keys, values, table.shard_variable.read_value()


def rows(session, ops):
    keys, values, shard = session.run(ops)
    order = np.argsort(keys)
    return {"keys": keys[order], "values": values[order], "shard": shard}


def train(args, rank):
    ev, table, ids, train_op = build()
    ops = row_ops(ev, table)
    # Worker R sees its own ids: keys of both owners, rows of both shards.
    batch = np.arange(rank * 7, rank * 7 + 12, dtype=np.int64)
    with V1.train.MonitoredTrainingSession(
            checkpoint_dir=args.dir, save_checkpoint_steps=STEPS,
            log_step_count_steps=None, save_summaries_steps=None) as sess:
        for _ in range(STEPS):
            sess.run(train_op, {ids: batch})
        expected = rows(sess, ops)
    np.savez(os.path.join(args.dir, f"expected-{rank}.npz"), **expected)
    state = os.path.join(worker_checkpoints.worker_dir(args.dir, rank),
                         "checkpoint")
    assert os.path.exists(state), state
    print(f"ok: worker {rank} trained and saved")


def restore(args, rank):
    ops = row_ops(*build()[:2])
    creator = V1.train.ChiefSessionCreator(checkpoint_dir=args.dir)
    with V1.train.MonitoredSession(session_creator=creator) as sess:
        got = rows(sess, ops)
    want = np.load(os.path.join(args.dir, f"expected-{rank}.npz"))
    assert len(want["keys"]) > 0
    for name in ("keys", "values", "shard"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    print(f"ok: worker {rank} restored its own {len(want['keys'])} keys "
          "and shard")


def foreign(args, rank, size):
    other = (rank + 1) % size
    source = worker_checkpoints.worker_dir(args.dir, other)
    # Outside D: nothing marks the copy as a collective layout.
    plain = f"{args.dir}-copy-of-{other}-for-{rank}"
    shutil.copytree(source, plain,
                    ignore=shutil.ignore_patterns("worker-*", "*.npz"))
    # The newest index by name (the state file holds absolute paths).
    path = sorted(glob.glob(os.path.join(plain, "model.ckpt-*.index")),
                  key=lambda p: int(p.split("-")[-1].split(".")[0]))[-1]
    path = path[:-len(".index")]
    build()
    with V1.Session() as sess:
        try:
            V1.train.Saver().restore(sess, path)
        except tf.errors.InvalidArgumentError as e:
            assert "EmbeddingVariable" in e.message and "clicks" in \
                e.message and \
                f"worker {rank} of {size}" in e.message, e.message
            print(f"ok: worker {rank} refused worker {other}'s keys")
            return
    raise AssertionError(f"worker {rank} restored worker {other}'s EV")


def torn(args, rank):
    build()
    creator = V1.train.ChiefSessionCreator(checkpoint_dir=args.dir)
    try:
        V1.train.MonitoredSession(session_creator=creator)
    except ValueError as e:
        assert "latest checkpoints" in str(e) and "worker 1: none" in \
            str(e), e
        print(f"ok: worker {rank} refused a torn checkpoint")
        return
    raise AssertionError(f"worker {rank} restored a torn checkpoint")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", required=True,
                        choices=["train", "restore", "foreign", "torn"])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    with tf.Graph().as_default():
        hvd = ge.enable_distributed_strategy("collective")
        rank, size = hvd.rank(), hvd.size()
        if args.phase == "train":
            train(args, rank)
        elif args.phase == "restore":
            restore(args, rank)
        elif args.phase == "foreign":
            foreign(args, rank, size)
        else:
            torn(args, rank)


if __name__ == "__main__":
    main()
