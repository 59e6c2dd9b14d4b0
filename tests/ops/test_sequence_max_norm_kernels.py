"""Input validation of the sequence and max_norm kernels, called raw.

Every malformed input must give an InvalidArgumentError naming the
argument, never a crash; each case runs in a subprocess so that a crash
fails the test instead of taking the suite down.
"""

import subprocess
import sys
import textwrap

import pytest

from group_embedding.ops import kernel_library

_SCRIPT = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
from group_embedding.ops import kernel_library

lib = kernel_library.library()
table = tf.Variable(np.ones([5, 3], np.float32))
ids = tf.constant([0, 4, 2], tf.int64)
splits = tf.constant([0, 2, 3], tf.int64)
pos = tf.constant([0, 1, 0], tf.int64)
no_w = tf.zeros([0])

def seq(ids=ids, splits=splits, pos=pos, max_len=2, weights=no_w,
        max_norm=-1.0):
    return lib.group_embedding_sequence_lookup(
        tables=[table.handle], ids=[ids], row_splits=[splits],
        positions=[pos], max_lens=[tf.constant(max_len, tf.int64)],
        weights=[weights], table_names=["t0"], embedding_dim=3,
        max_norm=max_norm)

def seq_grad(grads, pos=pos):
    return lib.group_embedding_sequence_lookup_grad(
        grads=[grads], ids=[ids], row_splits=[splits], positions=[pos],
        weights=[no_w], embedding_dim=3)

def clip_grad(uniq, grads):
    return lib.group_embedding_clip_grad(
        tables=[table.handle], unique_ids=[uniq], id_grads=[grads],
        max_norm=1.0)

def expect(what, fn, *needles):
    print("case:", what, flush=True)
    try:
        fn()
    except (tf.errors.InvalidArgumentError, ValueError) as e:
        for n in needles:
            assert n in str(e), (what, n, str(e))
        return
    raise AssertionError(f"{what}: no error")

# Well-formed calls work.
out = seq(max_norm=0.5).__getitem__(0).numpy()
assert out.shape == (2, 2, 3), out.shape
np.testing.assert_allclose(np.linalg.norm(out[0, 0]), 0.5, rtol=1e-6)
np.testing.assert_array_equal(out[1, 1], 0.0)
uniq, sums = seq_grad(tf.ones([2, 2, 3]))
assert uniq[0].numpy().tolist() == [0, 4, 2]

expect("id out of range", lambda: seq(ids=tf.constant([0, 5, 2], tf.int64)),
       "t0", "id 5 is out of range [0, 5)")
expect("negative id", lambda: seq(ids=tf.constant([0, -1, 2], tf.int64)),
       "t0", "out of range")
expect("position past max_len",
       lambda: seq(pos=tf.constant([0, 2, 0], tf.int64)),
       "t0", "position 2", "[0, 2)")
expect("negative position",
       lambda: seq(pos=tf.constant([0, -1, 0], tf.int64)), "position -1")
expect("positions count", lambda: seq(pos=tf.constant([0, 1], tf.int64)),
       "positions must be a vector of 3")
expect("negative max_len", lambda: seq(max_len=-1), "max_lens")
expect("huge max_len", lambda: seq(max_len=2 ** 62), "overflow")
expect("splits end", lambda: seq(splits=tf.constant([0, 2, 2], tf.int64)),
       "row_splits must start at 0 and end at 3")
expect("weights count", lambda: seq(weights=tf.ones([2])),
       "has 3 ids but 2 weights")
expect("ids rank", lambda: seq(ids=tf.constant([[0, 4, 2]], tf.int64)),
       "t0: ids must be a vector")
expect("max_norm nan", lambda: seq(max_norm=float("nan")),
       "max_norm must be finite")
expect("grads rank", lambda: seq_grad(tf.ones([2, 6])),
       "grads must have shape [2, max_len, 3]")
expect("grads batch", lambda: seq_grad(tf.ones([3, 2, 3])),
       "grads must have shape [2, max_len, 3]")
expect("grads position", lambda: seq_grad(tf.ones([2, 1, 3])),
       "position 1", "[0, 1)")
expect("clip ids out of range",
       lambda: clip_grad(tf.constant([7], tf.int64), tf.ones([1, 3])),
       "unique_ids 7 is out of range")
expect("clip grads shape",
       lambda: clip_grad(tf.constant([1], tf.int64), tf.ones([2, 3])),
       "id_grads must have shape [1, 3]")
# Graph mode: the shape functions refuse wrong ranks before any kernel.
with tf.Graph().as_default():
    def graph_lookup(ids_ph, max_len):
        vec = tf.constant([0, 1, 0], tf.int64)
        return lib.group_embedding_sequence_lookup(
            tables=[tf.compat.v1.placeholder(tf.resource, [])],
            ids=[ids_ph], row_splits=[tf.constant([0, 2, 3], tf.int64)],
            positions=[vec], max_lens=[tf.constant(max_len, tf.int64)],
            weights=[tf.zeros([0])], table_names=["t0"], embedding_dim=3)
    expect("graph ids rank", lambda: graph_lookup(
        tf.compat.v1.placeholder(tf.int64, [None, 2]), 2), "rank")
    expect("graph max_lens rank", lambda: graph_lookup(
        tf.constant([0, 4, 2], tf.int64), [2]), "rank")
    # A constant max_len gives the output a static T.
    assert graph_lookup(tf.constant([0, 4, 2], tf.int64), 2)[0].shape \
        .as_list() == [2, 2, 3]
print("ok")
"""


def test_sequence_and_clip_kernels_reject_malformed_inputs():
    if kernel_library.library() is None:
        pytest.fail(f"kernels unavailable: {kernel_library.status()}")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-3000:] + proc.stderr[-3000:])
