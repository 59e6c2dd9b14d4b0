"""A worker that raises or dies mid-training must not hang the others.

Worker 1 fails at step 3 (`--mode raise`: a Python exception; `--mode
kill`: SIGKILL, no clean-up at all) while the others are inside an
all-to-all; horovodrun must stop them and exit non-zero.

`--mode none` fails nobody: the workers train until the test injects a
fault from outside (test_two_hosts.py: SIGKILL, SIGSTOP, a link taken
down, delayed packets). Each step prints `worker R on HOST step S`;
`--checkpoint-dir D` saves the table every `--save-every` steps (up to
step `--save-until`) with `ge.save_tables`; the workers then look up
every row of the table and worker 0 writes them to `D.lookups/S.npy` and
prints `saved step S` (for the test to check a restore against, row by
row).
"""

import argparse
import os
import signal
import socket
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402

VOCAB, DIM = 1000, 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["raise", "kill", "none"])
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--save-every", type=int, default=4)
    # A save runs Horovod collectives (its barriers), which fail without
    # naming the dead worker: the fault test injects after the last one.
    parser.add_argument("--save-until", type=int, default=None)
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy("collective")
    rank = hvd.rank()
    host = os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())
    table = ge.get_embedding_table("t", VOCAB, DIM, replicate=False)
    opt = ge.optimizers.Adagrad(0.1)
    rng = np.random.default_rng(rank)
    # Start together: the first steps' set-up may take longer than a low
    # collective timeout on busy cores (`hvd` is not watched).
    hvd.allreduce(tf.constant(0), name="warmed_up")
    for step in range(1000):
        if args.mode != "none" and rank == 1 and step == 3:
            print(f"worker 1 fails at step {step} ({args.mode})", flush=True)
            if args.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("simulated failure on worker 1")
        if args.checkpoint_dir and step and step % args.save_every == 0 \
                and (args.save_until is None or step <= args.save_until):
            ge.save_tables(args.checkpoint_dir, {"t": table}, step)
            # What the workers look up now is what a restore must hold.
            every_row = tf.RaggedTensor.from_row_lengths(
                np.arange(VOCAB), np.ones(VOCAB, np.int64))
            rows = ge.group_embedding_lookup_sparse(
                [table], [every_row], "sum")[0]
            if rank == 0:
                lookups = args.checkpoint_dir + ".lookups"
                os.makedirs(lookups, exist_ok=True)
                np.save(os.path.join(lookups, f"{step}.npy"), rows.numpy())
                print(f"saved step {step} ", flush=True)
        if args.mode == "none":
            print(f"worker {rank} on {host} step {step}", flush=True)
        ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, VOCAB, 16),
                                               np.full(8, 2))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ge.group_embedding_lookup_sparse(
                [table], [ids], "sum")[0])
        grads = ge.DistributedGradientTape(tape).gradient(
            loss, [table.shard])
        opt.apply_gradients(zip(grads, [table.shard]))
        time.sleep(0.05)
    raise AssertionError("worker survived its peer's failure for 1000 "
                         "steps")


if __name__ == "__main__":
    main()
