"""Deepray's side of `ev_step_vs_deepray.py`, run in Deepray's own venv.

Deepray 0.21.89 (DeepRec's EmbeddingVariable ported to TF 2.15) needs
Python 3.11 + TF 2.15, so it cannot share a process with this library
(TF 2.21): the benchmark starts this script with the venv that
`../shared/peers/deepray/setup.sh` makes and drives it over stdin/stdout,
so that its rounds alternate with ours in the same run.

The step is the one a competent Deepray user writes on CPU: one
`tf.nn.embedding_lookup_sparse(ev, ids, None, combiner="sum")` per table
(Deepray's `group_embedding_lookup_sparse` gives wrong gradients on CPU,
see the peer's README), concat, loss = mean of squares, backward,
`deepray.optimizers.Adagrad` (lr 0.01, initial accumulator 0.1), in a
`tf.function`. The ids come from the benchmark as an .npz of
`criteo_like.make_id_batches` arrays (`b{i}_f{f}_ids`, `_lengths`,
`_width`), so both sides train on the same ids.

Protocol (one line each way): after the fill-up pass it prints
`ready <live keys>`; then `time <steps>` -> `time <seconds per step>`;
`dense <steps>` -> `dense <seconds per step>` (the step without its
embeddings, `dense_only_step.py`); `quit`.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402


def _load_batches(tf, path):
    """The .npz batches as lists of int64 SparseTensors."""
    data = np.load(path)
    num_batches = int(data["num_batches"])
    num_features = int(data["num_features"])
    batches = []
    for b in range(num_batches):
        feats = []
        for f in range(num_features):
            ids = data[f"b{b}_f{f}_ids"]
            lengths = data[f"b{b}_f{f}_lengths"]
            width = int(data[f"b{b}_f{f}_width"])
            rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
            starts = np.cumsum(lengths) - lengths
            cols = (np.arange(len(ids), dtype=np.int64)
                    - np.repeat(starts, lengths))
            feats.append(tf.SparseTensor(np.stack([rows, cols], axis=1), ids,
                                         [len(lengths), width]))
        batches.append(feats)
    return batches


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ids", required=True, help=".npz written by the bench")
    p.add_argument("--dim", type=int, default=16)
    args = p.parse_args()

    import deepray  # noqa: F401
    import tensorflow as tf
    from deepray.custom_ops.embedding_variable import gen_kv_variable_ops
    from deepray.custom_ops.embedding_variable.variable_scope import (
        get_embedding_variable,
    )
    from deepray.optimizers.adagrad import Adagrad

    batches = _load_batches(tf, args.ids)
    num_features = len(batches[0])
    # The optimizer first: it sets the slot count the EVs are created with.
    opt = Adagrad(0.01, initial_accumulator_value=0.1)
    opt.global_step = opt.iterations
    init = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=0)
    # Names must not end in '0': Deepray strips ':0' as characters, so
    # "ev_10:0" would become "ev_1" and share ev_1's storage.
    evs = [get_embedding_variable(f"ev_{i}_t", embedding_dim=args.dim,
                                  key_dtype=tf.int64, initializer=init)
           for i in range(num_features)]

    def loss_of(sp_ids):
        embs = [tf.nn.embedding_lookup_sparse(ev, sp, None, combiner="sum")
                for ev, sp in zip(evs, sp_ids)]
        return tf.reduce_mean(tf.square(tf.concat(embs, 1)))

    @tf.function
    def step(sp_ids):
        with tf.GradientTape() as tape:
            loss = loss_of(sp_ids)
        opt.apply_gradients(zip(tape.gradient(loss, evs), evs))
        return loss

    # The step without its embeddings, as the benchmark's.
    from dense_only_step import make_dense_only_step
    dense_step = make_dense_only_step(int(batches[0][0].dense_shape[0]),
                                      args.dim, num_features)

    def per_step(fn, steps):
        start = time.perf_counter()
        for i in range(steps):
            loss = fn(batches[i % len(batches)])
        loss.numpy()
        return (time.perf_counter() - start) / steps

    # Fill-up pass: the first pass over the batches inserts most keys.
    for b in batches:
        step(b).numpy()
        dense_step(b).numpy()
    live = sum(int(gen_kv_variable_ops.kv_variable_shape(
        ev.handle, Tkeys=tf.int64, dtype=tf.float32)[0]) for ev in evs)
    print(f"ready {live}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "time":
            print(f"time {per_step(step, int(cmd[1]))!r}", flush=True)
        elif cmd[0] == "dense":
            print(f"dense {per_step(dense_step, int(cmd[1]))!r}",
                  flush=True)
        else:
            print(f"error unknown command {cmd[0]!r}", flush=True)


if __name__ == "__main__":
    main()
