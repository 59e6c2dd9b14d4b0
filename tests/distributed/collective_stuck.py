"""A worker that stays alive but stuck must not hang the others forever.

Every worker trains a sharded table for 6 steps. At step 3 worker 1 gets
stuck, per `--stuck`:
- `input`: waits forever on an event (like a reader that never delivers),
  with the GIL released, so its own watchdog keeps running;
- `frozen`: sleeps inside a C call that holds the GIL, so not even its
  watchdog thread runs;
- `none`: nobody is stuck, but every worker idles outside collectives for
  twice the timeout and worker 1 lags half the timeout at step 4: the run
  must finish.
`--where before` gets stuck before the step's lookup; `--where inside`
between the lookup and the gradient, so the others wait in the backward
all-to-all. `--function` runs the step as a `tf.function` (the stuck part
then blocks inside a `tf.py_function`).

The timeout is `--timeout` seconds (as `collective_timeout`), or else the
GROUP_EMBEDDING_COLLECTIVE_TIMEOUT environment variable.

`--hostile-record malformed|unsigned`: right after startup, worker 1 plays
anyone who can reach horovodrun's key-value store (plain HTTP, no
secret) and puts an `abort` record there: valid JSON missing its fields,
or a well-formed verdict without the job's signature.
"""

import argparse
import ctypes
import json
import os
import threading
import time
import urllib.request

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402

STUCK_STEP = 3


def get_stuck(mode):
    print(f"worker 1 stuck at step {STUCK_STEP} ({mode}) at "
          f"{time.time():.3f}", flush=True)
    if mode == "input":
        threading.Event().wait()
    # PyDLL keeps the GIL during the call.
    ctypes.PyDLL(None).sleep(3600)


def post_hostile_abort(kind):
    record = ({"exit_at": 0} if kind == "malformed" else
              {"message": "forged stop from a stranger", "exit_at": 0})
    url = (f"http://{os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
           f"{os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}/"
           f"group_embedding_watchdog/abort")
    request = urllib.request.Request(url, data=json.dumps(record).encode(),
                                     method="PUT")
    urllib.request.urlopen(request, timeout=5).close()
    print(f"posted a {kind} abort record", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stuck", choices=["input", "frozen", "none"])
    parser.add_argument("--where", choices=["before", "inside"],
                        default="before")
    parser.add_argument("--function", action="store_true")
    parser.add_argument("--timeout", type=float)
    parser.add_argument("--hostile-record", choices=["malformed", "unsigned"])
    args = parser.parse_args()
    kwargs = ({} if args.timeout is None
              else {"collective_timeout": args.timeout})
    hvd = ge.enable_distributed_strategy("collective", **kwargs)
    timeout = args.timeout or float(
        os.environ["GROUP_EMBEDDING_COLLECTIVE_TIMEOUT"])
    if args.hostile_record and hvd.rank() == 1:
        post_hostile_abort(args.hostile_record)
    table = ge.get_embedding_table("t", 1000, 8, replicate=False)
    opt = ge.optimizers.Adagrad(0.1)

    def block(stall):
        if bool(stall):
            get_stuck(args.stuck)
        return tf.constant(0.0)

    def step(ids, stall):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ge.group_embedding_lookup_sparse(
                [table], [ids], "sum")[0])
            if args.function:
                loss += tf.py_function(block, [stall], tf.float32)
            elif stall:
                block(stall)
        grads = ge.DistributedGradientTape(tape).gradient(
            loss, [table.shard])
        opt.apply_gradients(zip(grads, [table.shard]))
        return loss

    if args.function:
        step = tf.function(step, input_signature=(
            tf.RaggedTensorSpec([8, None], tf.int64, 1, tf.int64),
            tf.TensorSpec([], tf.bool)))
        step.get_concrete_function()
    # Start together: tracing takes seconds on busy cores, more than the
    # timeout. `hvd` is Horovod itself, not watched by the timeout.
    hvd.allreduce(tf.constant(0), name="warmed_up")
    if args.stuck == "frozen" and hvd.rank() == 1:
        # Once frozen, its watchdog posts nothing: let it post a heartbeat
        # first (3 of its intervals), or on a loaded machine the steps
        # before the freeze may outrun the first post and the verdict can
        # only say "never reported" instead of how long it was silent.
        time.sleep(max(1.0, 3 * timeout / 10))
    rng = np.random.default_rng(hvd.rank())
    for i in range(6):
        stuck_now = (args.stuck != "none" and hvd.rank() == 1
                     and i == STUCK_STEP)
        if stuck_now and args.where == "before":
            get_stuck(args.stuck)
        if args.stuck == "none" and i == 2:
            # Idle outside collectives: not a stall.
            time.sleep(2 * timeout)
        if args.stuck == "none" and i == 4 and hvd.rank() == 1:
            time.sleep(timeout / 2)  # a laggard below the timeout
        ids = tf.RaggedTensor.from_row_lengths(rng.integers(0, 1000, 16),
                                               np.full(8, 2))
        step(ids, tf.constant(stuck_now and args.where == "inside"))
    print(f"worker {hvd.rank()} finished", flush=True)


if __name__ == "__main__":
    main()
