"""Tutorial (d): collective training that resumes after a failure.

A wide model (mean-pooled EmbeddingVariables of five categorical columns
and the dense features -> one logistic unit) trained on N workers, with a
checkpoint every `--save-every` steps. The training command is also the
resume command: if `--checkpoint-dir` holds a checkpoint, the run restores
it and goes on from its step, at the same or another worker count:

    horovodrun -np 2 python tutorials/distributed_resume.py \
        --checkpoint-dir /tmp/ckpt
    # ... a worker dies at step 7; the job ends (the collective timeout
    # ends it if the worker hangs instead). Relaunch, on 3 workers:
    horovodrun -np 3 python tutorials/distributed_resume.py \
        --checkpoint-dir /tmp/ckpt

What makes the resumed run equal an uninterrupted one:

- the input order is deterministic and independent of the worker count:
  global step s trains on rows [s * B, (s + 1) * B) of the data (B: the
  global batch), and worker r of N takes its contiguous part of them; so
  the data position is the step, which the checkpoint records;
- `ge.save_tables` writes every table at once (EmbeddingVariables with
  their Adagrad slots, each on the worker that owns the key; the dense
  weights, replicated, once) and `latest` moves only when all is written;
  `ge.restore_tables` reads it at any worker count;
- the dense weights train with plain SGD, which keeps no state beyond them.

`DEMO_CRASH_AT_STEP=S` (environment, so that the command stays the same)
makes the last worker SIGKILL itself after step S, to try it out.
"""

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402

COLUMNS = ["C1", "C2", "C3", "C14", "C15"]  # one-hot and multi-hot
DIM = 8


def column_ids(frame, col):
    """`(lengths, int64 keys)` of a categorical column (hex strings and
    decimal ids both become integer keys)."""
    base = 16 if col in data.STRING_COLUMNS else 10
    cells = [c.split("|") if c else [] for c in frame[col]]
    lengths = np.array([len(c) for c in cells], np.int64)
    keys = np.array([int(t, base) for c in cells for t in c], np.int64)
    return lengths, keys


def load(rows):
    """Features of every row, in file order: ids per column, dense, label."""
    frame, _ = data.generate(rows, vocab_cap=2_000, seed=0)
    dense = np.log1p(np.nan_to_num(
        frame[data.DENSE_COLUMNS].to_numpy(np.float64))).astype(np.float32)
    return ({c: column_ids(frame, c) for c in COLUMNS}, dense,
            frame["label"].to_numpy(np.float32)[:, None])


def rows_of(features, lo, hi):
    """Ragged ids, dense features and labels of rows [lo, hi)."""
    ids, dense, label = features
    out = []
    for col in COLUMNS:
        lengths, keys = ids[col]
        splits = np.concatenate([[0], np.cumsum(lengths)])
        out.append(tf.RaggedTensor.from_row_splits(
            keys[splits[lo]:splits[hi]], splits[lo:hi + 1] - splits[lo]))
    return out, dense[lo:hi], label[lo:hi]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=256,
                        help="global batch, split over the workers")
    args = parser.parse_args(argv)

    hvd = ge.enable_distributed_strategy("collective")
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(0)  # the same initial values every run
    features = load(args.steps * args.batch)
    tables = {c: ge.get_embedding_variable(c, DIM) for c in COLUMNS}
    dense_w = tf.Variable(tf.random.normal(
        [len(COLUMNS) * DIM + len(data.DENSE_COLUMNS), 1], stddev=0.05,
        seed=1))
    dense_b = tf.Variable(tf.zeros([1, 1]))
    ge.broadcast_variables(list(tables.values()) + [dense_w, dense_b])
    saved = {**tables, "dense_w": dense_w, "dense_b": dense_b}

    start = 0
    latest = (ge.latest_checkpoint(args.checkpoint_dir)
              if os.path.isdir(args.checkpoint_dir) else None)
    if latest is not None:
        ge.restore_tables(latest, saved)  # checks every shard's checksum
        with open(os.path.join(latest, "manifest.json")) as f:
            start = json.load(f)["step"]  # the data position
        if rank == 0:
            print(f"resumed from {latest} at step {start} on {size} "
                  f"workers", flush=True)

    table_opt = ge.optimizers.Adagrad(0.1)
    dense_opt = keras.optimizers.SGD(0.05)
    evs = list(tables.values())

    @tf.function(reduce_retracing=True)
    def step(ids, dense, label):
        with tf.GradientTape() as tape:
            pooled = ge.group_embedding_lookup_sparse(evs, ids, "mean")
            logits = tf.matmul(tf.concat(pooled + [dense], 1),
                               dense_w) + dense_b
            losses = tf.nn.sigmoid_cross_entropy_with_logits(label, logits)
            # The global batch's mean: gradients are averaged over the
            # workers, so weigh this worker's sum by N / B.
            local_sum = tf.reduce_sum(losses)
            scaled = local_sum * size / args.batch
        variables = evs + [dense_w, dense_b]
        grads = ge.DistributedGradientTape(tape).gradient(scaled, variables)
        table_opt.apply_gradients(zip(grads[:len(evs)], evs))
        dense_opt.apply_gradients(zip(grads[len(evs):], [dense_w, dense_b]))
        return local_sum

    cuts = np.linspace(0, args.batch, size + 1).astype(int)
    crash_at = int(os.environ.get("DEMO_CRASH_AT_STEP", -1))
    loss = None
    for s in range(start, args.steps):
        lo = s * args.batch
        local_sum = step(*rows_of(features, lo + cuts[rank],
                                  lo + cuts[rank + 1]))
        loss = float(hvd.allreduce(local_sum, op=hvd.Sum)) / args.batch
        if rank == 0:
            print(f"step {s} loss {loss!r}", flush=True)
        if (s + 1) % args.save_every == 0 or s + 1 == args.steps:
            ge.save_tables(args.checkpoint_dir, saved, s + 1)
        if s == crash_at and rank == size - 1:
            print(f"worker {rank} crashes after step {s}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        print(f"done: {args.steps} steps, last loss {loss!r}", flush=True)


if __name__ == "__main__":
    main()
