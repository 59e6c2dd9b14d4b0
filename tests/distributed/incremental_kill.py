"""A writer killed (SIGKILL) in the middle of an incremental save.

    python incremental_kill.py --dir D --kill shard|latest

Saves a full checkpoint and a delta of EV `t` (`ge.save_tables(...,
full_every=10)`), writes the state that delta holds to D/good.npz (the
oracle of test_incremental_checkpoint.py), changes keys again and starts
another delta, killing itself (SIGKILL: no cleanup, no exception
handler) halfway through writing its shard file (`shard`) or right
before `latest` is repointed at the finished folder (`latest`).
"""

import argparse
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from collective_incremental import state  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.distributed import checkpoint as checkpoint_lib  # noqa: E402
from group_embedding.ops import ev_storage  # noqa: E402

DIM = 4
SLOT = "adagrad/accumulator"


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir")
    parser.add_argument("--kill", choices=["shard", "latest"])
    args = parser.parse_args()
    ev = ge.get_embedding_variable("tags", DIM)
    ev.ensure_slot(SLOT, 0.1)
    rng = np.random.default_rng(3)
    keys = rng.integers(-2**62, 2**62, 500)
    for step in (1, 2):
        ev.lookup_rows(tf.constant(keys[:100 * step], tf.int64))
        ev_storage.apply_adagrad(
            ev.handle, tf.constant(keys[:20 * step], tf.int64),
            rng.standard_normal((20 * step, DIM)).astype("f"), step, 0.3,
            1e-7, SLOT)
        path = ge.save_tables(args.dir, {"t": ev}, step, full_every=10)
    np.savez(os.path.join(args.dir, "good.npz"), **state(ev),
             checkpoint=os.path.basename(path))
    print("saved the last good delta", flush=True)

    ev.lookup_rows(tf.constant(keys[300:], tf.int64))
    ev_storage.apply_adagrad(
        ev.handle, tf.constant(keys[:50], tf.int64),
        rng.standard_normal((50, DIM)).astype("f"), 3, 0.3, 1e-7, SLOT)
    if args.kill == "shard":
        def savez(file, **arrays):
            file.write(b"PK\x03\x04 half a shard file")
            file.flush()
            os.fsync(file.fileno())
            _die()

        np.savez = savez
    else:
        replace = os.replace

        def replace_then_die(src, dst):
            if os.path.basename(dst) == checkpoint_lib.LATEST:
                _die()
            return replace(src, dst)

        os.replace = replace_then_die
    ge.save_tables(args.dir, {"t": ev}, 3, full_every=10)
    raise AssertionError("the writer was not killed")


if __name__ == "__main__":
    main()
