"""Trains while a stranger posts records to horovodrun's key-value store.

Run by test_collective_timeout.py (test_stranger_records_in_a_real_job)
under `horovodrun -np 2` with a collective timeout of 3 s. Every worker
trains a sharded table step after step:

- rank 0 first writes the store's address to `$FUZZ_DIR/store` (what a
  stranger finds by probing ports);
- the phase is what `$FUZZ_DIR/phase` says: `control` (the test posts
  records under a scope nobody reads) or `attack` (the same records under
  the watchdog's scope), alternating, then `stop`;
- per phase it prints the steps, their median time and the process's
  CPU time per step (all threads), the watchdog's rounds
  and their CPU time (`time.thread_time` of the watchdog thread), and the
  peak RSS growth during the attack;
- then worker 1 gets stuck (waits forever; its watchdog runs): the
  watchdogs must still stop every worker naming it, so the records have
  not blinded them.
"""

import os
import statistics
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.distributed import watchdog  # noqa: E402

from process_memory import status_bytes  # noqa: E402

PHASES = ("control", "attack")


def _time_watchdog_rounds(phase, rounds):
    """Records each round's CPU and wall time under the current phase."""
    check = watchdog.Watchdog.check

    def timed(self):
        cpu, wall = time.thread_time(), time.monotonic()
        try:
            return check(self)
        finally:
            rounds[phase[0]].append((time.thread_time() - cpu,
                                     time.monotonic() - wall, self.interval))

    watchdog.Watchdog.check = timed


def main():
    folder = os.environ["FUZZ_DIR"]
    phase = ["warmup"]
    rounds = {"warmup": [], "control": [], "attack": [], "done": []}
    _time_watchdog_rounds(phase, rounds)
    hvd = ge.enable_distributed_strategy("collective")
    rank = hvd.rank()
    table = ge.get_embedding_table("t", 10000, 16, replicate=False)
    opt = ge.optimizers.Adagrad(0.1)

    @tf.function(input_signature=(
        tf.RaggedTensorSpec([64, None], tf.int64, 1, tf.int64),))
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ge.group_embedding_lookup_sparse(
                [table], [ids], "sum")[0] ** 2)
        grads = ge.DistributedGradientTape(tape).gradient(
            loss, [table.shard])
        opt.apply_gradients(zip(grads, [table.shard]))
        return loss

    rng = np.random.default_rng(rank)

    def batch():
        return tf.RaggedTensor.from_row_lengths(
            rng.integers(0, 10000, 64 * 4), np.full(64, 4))

    step(batch())  # traced on both before anything is timed
    hvd.allreduce(tf.constant(0), name="warmed_up")
    if rank == 0:
        with open(os.path.join(folder, "store.tmp"), "w") as f:
            f.write(f"{os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
                    f"{os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}")
        os.rename(os.path.join(folder, "store.tmp"),
                  os.path.join(folder, "store"))
    steps = {p: [] for p in PHASES}
    step_cpu = {p: 0.0 for p in PHASES}
    growth, before = 0, status_bytes("VmRSS")
    for i in range(10**9):
        try:
            with open(os.path.join(folder, "phase")) as f:
                now = f.read().strip() or phase[0]
        except FileNotFoundError:
            now = "control"
        if now == "attack" and phase[0] != "attack":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            before = status_bytes("VmRSS")
        if phase[0] == "attack" and now != "attack":
            growth = max(growth, status_bytes("VmHWM") - before)
        if now in PHASES:
            phase[0] = now
        # Every 10 steps the workers agree whether to stop (one Horovod
        # collective, not timed), so that they stop at the same step.
        if i % 10 == 9:
            if hvd.allreduce(tf.constant(int(now == "stop")), op=hvd.Sum,
                             name=f"stop_{i}").numpy() > 0:
                break
        start, cpu = time.monotonic(), time.process_time()
        step(batch())
        steps[phase[0]].append(time.monotonic() - start)
        # The process's CPU (every thread: TF's, the watchdog's) per step:
        # what the records cost this worker, unlike wall time not swayed
        # by what else runs on the host.
        step_cpu[phase[0]] += time.process_time() - cpu
    phase[0] = "done"
    for p in PHASES:
        cpu = [r[0] for r in rounds[p]] or [0.0]
        wall = [r[1] for r in rounds[p]] or [0.0]
        interval = rounds[p][0][2] if rounds[p] else 0.0
        print(f"worker {rank} {p}: steps {len(steps[p])} median "
              f"{statistics.median(steps[p] or [0.0]):.6f} s cpu "
              f"{step_cpu[p] / max(len(steps[p]), 1):.6f} s; watchdog "
              f"rounds {len(rounds[p])} cpu mean {statistics.mean(cpu):.6f}"
              f" max {max(cpu):.6f} wall max {max(wall):.6f} interval "
              f"{interval:.3f}", flush=True)
    print(f"worker {rank} attack rss growth {growth}", flush=True)
    # Every worker past its last step before one gets stuck (Horovod's
    # own collective: not watched).
    hvd.allreduce(tf.constant(0), name="measured")
    if rank == 1:
        print(f"worker 1 stuck at {time.time():.3f}", flush=True)
        threading.Event().wait()
    step(batch())  # blocks: worker 1 never comes
    print(f"worker {rank} finished", flush=True)


if __name__ == "__main__":
    main()
