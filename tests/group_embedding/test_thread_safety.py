"""Concurrent training, lookups, export and eviction of shared EVs.

Several Python threads drive the same EmbeddingVariables at once through
every op kind: pooled lookups + SGD, sequence lookups, max_norm lookups,
export, checkpoint writes, size and eviction. Ops that wait on the
intra-op pool while holding a variable's lock used to deadlock with ops
whose pool work items take that lock; each run is a subprocess with a
timeout, so a hang fails the test instead of hanging the suite.

No update may be lost: every training lookup counts each key occurrence
once (final frequencies) and SGD on `loss = sum(pooled)` with "sum"
moves a zero-initialised row by exactly `-lr * occurrences` (lr a power
of two, so float sums are exact in any order).
"""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = """
import os, sys, tempfile, threading
inter_op, mode = int(sys.argv[1]), sys.argv[2]
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["GROUP_EMBEDDING_KERNELS"] = mode
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(inter_op)
import group_embedding as ge

DIM, KEYS, STEPS, LR = 8, 400, 12, 2.0 ** -6
option = ge.EmbeddingVariableOption(
    evict_option=ge.GlobalStepEvict(steps_to_live=10 ** 12))
evs = [ge.get_embedding_variable(f"stress_{i}", DIM,
                                 initializer=tf.keras.initializers.Zeros(),
                                 ev_option=option) for i in range(3)]
rng = np.random.default_rng(0)


def batch(seed):
    # Many keys per batch, so that every kernel shards over the pool.
    r = np.random.default_rng(seed)
    rows = [list(r.integers(0, KEYS, size=r.integers(0, 12)))
            for _ in range(64)]
    return tf.ragged.constant(rows, dtype=tf.int64)


freq = [np.zeros(KEYS, np.int64) for _ in evs]
moved = [np.zeros(KEYS, np.int64) for _ in evs]
count_lock = threading.Lock()


def count(batches, trained):
    with count_lock:
        for i, b in enumerate(batches):
            np.add.at(freq[i], b.values.numpy(), 1)
            if trained:
                np.add.at(moved[i], b.values.numpy(), 1)


def trainer(seed):
    opt = ge.optimizers.SGD(LR)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            outs = ge.group_embedding_lookup_sparse(evs, ids, "sum")
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, evs), evs))

    for s in range(STEPS):
        ids = [batch(seed * 1000 + s * 10 + i) for i in range(len(evs))]
        step(ids)
        count(ids, trained=True)


def sequence_reader(seed):
    @tf.function
    def look(ids):
        return ge.group_embedding_lookup_sparse(evs, ids, "sum",
                                                is_sequence=True)

    for s in range(STEPS):
        ids = [batch(seed * 1000 + s * 10 + i) for i in range(len(evs))]
        look(ids)
        count(ids, trained=False)


def max_norm_reader(seed):
    @tf.function
    def look(ids):
        return ge.group_embedding_lookup_sparse(evs, ids, "mean",
                                                max_norm=0.5)

    for s in range(STEPS):
        ids = [batch(seed * 1000 + s * 10 + i) for i in range(len(evs))]
        look(ids)
        count(ids, trained=False)


def housekeeper():
    ckpt = tf.train.Checkpoint(**{f"ev{i}": ev for i, ev in enumerate(evs)})
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    for s in range(STEPS):
        for ev in evs:
            assert int(ev.evict()) == 0
            keys, values, freqs, _ = ev.export()
            # A snapshot is consistent: values are whole SGD steps.
            v = values.numpy() / LR
            assert np.array_equal(v, np.round(v)), "torn export"
            ev.size()
        if s % 4 == 0:
            ckpt.write(path)


errors = []


def guarded(fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # reported by the main thread
        errors.append(repr(e))


threads = [threading.Thread(target=guarded, args=a) for a in (
    (trainer, 1), (trainer, 2), (sequence_reader, 3), (max_norm_reader, 4),
    (housekeeper,))]
if mode == "tf":
    threads.append(threading.Thread(target=guarded, args=(trainer, 5)))
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for i, ev in enumerate(evs):
    keys, values, freqs, _ = (x.numpy() for x in ev.export())
    want_freq = freq[i][keys]
    assert np.array_equal(freqs, want_freq), ("lost counts", i)
    assert set(keys.tolist()) == set(np.nonzero(freq[i])[0].tolist())
    want = -LR * moved[i][keys].astype(np.float32)[:, None]
    np.testing.assert_array_equal(values, np.broadcast_to(want, values.shape))
print("STRESS OK", flush=True)
"""


@pytest.mark.parametrize("inter_op,mode", [(3, "custom"), (4, "tf")])
def test_concurrent_training_lookups_and_export(inter_op, mode, tmp_path):
    script = tmp_path / "stress.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    try:
        result = subprocess.run(
            [sys.executable, str(script), str(inter_op), mode], env=env,
            capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock: concurrent EV ops (inter_op={inter_op}, "
                    f"kernels={mode}) did not finish in 150 s")
    assert result.returncode == 0 and "STRESS OK" in result.stdout, (
        f"returncode {result.returncode}\n{result.stdout[-2000:]}\n"
        f"{result.stderr[-4000:]}")
