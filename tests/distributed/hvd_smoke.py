"""Horovod (TF, Gloo, CPU) smoke test: checks exact numbers from every
collective we rely on.

Run (any -np >= 1):
    PATH=$PWD/.venv/bin:$PATH horovodrun -np 2 --gloo \
        python tests/distributed/hvd_smoke.py
Any wrong value raises AssertionError -> non-zero exit of horovodrun.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

hvd.init()
rank, size = hvd.rank(), hvd.size()


def split(src, dst):
    """Rows rank `src` sends to rank `dst`; uneven and includes zeros."""
    return (src + 2 * dst) % 3


def payload(src):
    """Rank src's alltoall input: rows grouped by destination,
    row = [code, -code]."""
    rows = [[1000 * src + 100 * dst + k, -(1000 * src + 100 * dst + k)]
            for dst in range(size) for k in range(split(src, dst))]
    return np.asarray(rows, dtype=np.float32).reshape(-1, 2)


def expected_received(me):
    rows = [[1000 * src + 100 * me + k, -(1000 * src + 100 * me + k)]
            for src in range(size) for k in range(split(src, me))]
    return np.asarray(rows, dtype=np.float32).reshape(-1, 2)


splits = tf.constant([split(rank, d) for d in range(size)], dtype=tf.int32)
x = tf.constant(payload(rank))

# 1) alltoall with uneven splits: data and received splits.
out, rsplits = hvd.alltoall(x, splits=splits, name="a2a")
np.testing.assert_array_equal(out.numpy(), expected_received(rank))
np.testing.assert_array_equal(rsplits.numpy(),
                              [split(s, rank) for s in range(size)])

# 2) allreduce: sum and (default) average.
v = tf.constant([rank + 1.0, 10.0 * rank])
np.testing.assert_allclose(
    hvd.allreduce(v, op=hvd.Sum, name="ar_sum").numpy(),
    [size * (size + 1) / 2, 10.0 * size * (size - 1) / 2])
np.testing.assert_allclose(hvd.allreduce(v, name="ar_avg").numpy(),
                           [(size + 1) / 2, 10.0 * (size - 1) / 2], rtol=1e-6)

# 3) allgather with uneven first dimension (rank r contributes r+1 rows of
#    value r).
g = hvd.allgather(tf.fill([rank + 1, 3], float(rank)), name="ag")
np.testing.assert_array_equal(
    g.numpy(), np.concatenate([np.full([r + 1, 3], r, np.float32)
                               for r in range(size)]))


# 4) gradient through alltoall: loss = sum(out * w), w row i on receiver
#    `me` = (me+1)*(i+1). d loss / d x[row sent by me to dst, k] =
#    (dst+1) * (offset of that row on dst + 1).
def loss_fn(inp, name):
    y, _ = hvd.alltoall(inp, splits=splits, name=name)
    w = tf.cast((rank + 1) * (tf.range(tf.shape(y)[0]) + 1),
                tf.float32)[:, None]
    return tf.reduce_sum(y * w)


expected_grad = []
for dst in range(size):
    # Rows from lower ranks precede ours on dst.
    base = sum(split(s, dst) for s in range(rank))
    expected_grad += [[(dst + 1) * (base + k + 1)] * 2
                      for k in range(split(rank, dst))]
expected_grad = np.asarray(expected_grad, np.float32).reshape(-1, 2)

with tf.GradientTape() as tape:
    tape.watch(x)
    loss = loss_fn(x, "a2a_eager")
np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), expected_grad)


@tf.function
def graph_grad(inp):
    with tf.GradientTape() as t:
        t.watch(inp)
        loss_ = loss_fn(inp, "a2a_graph")
    return t.gradient(loss_, inp)


np.testing.assert_array_equal(graph_grad(x).numpy(), expected_grad)

print(f"hvd_smoke OK rank {rank}/{size}: alltoall(uneven)+allreduce+"
      f"allgather+alltoall grad (eager & tf.function); sent splits "
      f"{splits.numpy().tolist()} recv {rsplits.numpy().tolist()}",
      flush=True)
