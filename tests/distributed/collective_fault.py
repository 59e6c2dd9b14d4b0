"""A worker that raises or dies mid-training must not hang the others.

Worker 1 fails at step 3 (`--mode raise`: a Python exception; `--mode
kill`: SIGKILL, no clean-up at all) while the others are inside an
all-to-all; horovodrun must stop them and exit non-zero.
"""

import argparse
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["raise", "kill"])
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy("collective")
    table = ge.get_embedding_table("t", 1000, 8, replicate=False)
    opt = ge.optimizers.Adagrad(0.1)
    rng = np.random.default_rng(hvd.rank())
    for step in range(1000):
        if hvd.rank() == 1 and step == 3:
            print(f"worker 1 fails at step {step} ({args.mode})", flush=True)
            if args.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("simulated failure on worker 1")
        ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, 1000, 16),
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
