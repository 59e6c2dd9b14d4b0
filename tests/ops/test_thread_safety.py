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
of two, so float sums are exact in any order). The same run with a
disk tier (DRAM_SSDHASH, ~10% of the rows in DRAM) moves millions of
rows between the tiers while the threads run (promotions and spills
under the EV's exclusive lock, with pool work), and must end as exact;
so must HBM EVs (the CUDA core's host stand-in) without the raw updates.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = """
import os, sys, tempfile, threading, time
inter_op, mode, duration = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
# "dram", "hbm" or a folder (a disk tier under it).
storage_kind = sys.argv[4] if len(sys.argv) > 4 else "dram"
tier = None if storage_kind in ("dram", "hbm") else storage_kind
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["GROUP_EMBEDDING_KERNELS"] = mode
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(inter_op)
import group_embedding as ge
from group_embedding.ops import ev_storage

DIM, KEYS, LR = 8, 20000, 2.0 ** -6


def option(i):
    # With `tier`: a DRAM tier of ~2000 of the 20000 rows, so that most
    # ops spill and promote (pool work under the EV's exclusive lock).
    storage = ge.StorageOption()
    if tier is not None:
        storage = ge.StorageOption(
            ge.StorageType.DRAM_SSDHASH,
            storage_path=os.path.join(tier, str(i)), storage_size=[600_000])
    elif storage_kind == "hbm":
        storage = ge.StorageOption(ge.StorageType.HBM)
    return ge.EmbeddingVariableOption(
        evict_option=ge.GlobalStepEvict(steps_to_live=10 ** 12),
        storage_option=storage)


evs = [ge.get_embedding_variable(f"stress_{i}", DIM,
                                 initializer=tf.keras.initializers.Zeros(),
                                 ev_option=option(i)) for i in range(3)]
assert all(ev.ge_table_kind == ("hbm_ev" if storage_kind == "hbm" else "ev")
           for ev in evs)


def batch(seed):
    # Big batches: every kernel shards its work over the intra-op pool.
    r = np.random.default_rng(seed)
    rows = [list(r.integers(0, KEYS, size=r.integers(0, 12)))
            for _ in range(1024)]
    return tf.ragged.constant(rows, dtype=tf.int64)


# A few fixed batches, built once, so that the threads spend their time
# in the ops rather than in Python.
batches = [[batch(10 * s + i) for i in range(len(evs))] for s in range(3)]
all_keys = tf.range(KEYS, dtype=tf.int64)
freq = [np.zeros(KEYS, np.int64) for _ in evs]
moved = [np.zeros(KEYS, np.int64) for _ in evs]
count_lock = threading.Lock()


def count(ids, trained):
    with count_lock:
        for i, b in enumerate(ids):
            np.add.at(freq[i], b.values.numpy(), 1)
            if trained:
                np.add.at(moved[i], b.values.numpy(), 1)


# Every key exists before the threads start (applies skip absent keys).
ge.group_embedding_lookup([evs[0], evs[1], evs[2]], [all_keys] * 3)
for i in range(len(evs)):
    freq[i] += 1
stop = time.time() + duration


def loop(body):
    s = 0
    while time.time() < stop:
        body(s)
        s += 1


def trainer(seed):
    opt = ge.optimizers.SGD(LR)

    def step(s):
        ids = batches[(seed + s) % len(batches)]
        with tf.GradientTape() as tape:
            outs = ge.group_embedding_lookup_sparse(evs, ids, "sum")
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, evs), evs))
        count(ids, trained=True)

    loop(step)


def reader(seed, **kwargs):
    def step(s):
        ids = batches[(seed + s) % len(batches)]
        ge.group_embedding_lookup_sparse(evs, ids, "mean", **kwargs)
        count(ids, trained=False)

    loop(step)


def hammer(i):
    # Raw sparse SGD on every key of one EV: the longest lock holder.
    grad = tf.ones([KEYS, DIM])

    def step(s):
        ev_storage.apply_sgd(evs[i].handle, all_keys, grad, s, LR)
        with count_lock:
            moved[i] += 1

    loop(step)


def housekeeper():
    ckpt = tf.train.Checkpoint(**{f"ev{i}": ev for i, ev in enumerate(evs)})
    path = os.path.join(tempfile.mkdtemp(), "ckpt")

    def step(s):
        for ev in evs:
            assert int(ev.evict()) == 0
            _, values, _, _ = ev.export()
            # A snapshot is consistent: values are whole SGD steps.
            v = values.numpy() / LR
            assert np.array_equal(v, np.round(v)), "torn export"
            ev.size()
        if s % 3 == 0:
            ckpt.write(path)

    loop(step)


errors = []


def guarded(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except BaseException as e:  # reported by the main thread
        errors.append(repr(e))


jobs = [(trainer, (1,), {}), (reader, (2,), {"is_sequence": True}),
        (reader, (3,), {"max_norm": 0.5}),
        (reader, (4,), {"is_sequence": True, "max_norm": 0.5}),
        (housekeeper, (), {})]
if storage_kind != "hbm":  # raw CPU-EV ops
    jobs += [(hammer, (0,), {}), (hammer, (2,), {})]
if mode == "tf":
    # Pure TF: 4 trainers, all through GroupEmbeddingEVGather.
    jobs += [(trainer, (5,), {}), (trainer, (6,), {}), (trainer, (7,), {})]
threads = [threading.Thread(target=guarded, args=(f,) + a, kwargs=k)
           for f, a, k in jobs]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
for i, ev in enumerate(evs):
    keys, values, _, freqs = (x.numpy() for x in ev.export())
    assert len(keys) == KEYS
    np.testing.assert_array_equal(freqs, freq[i][keys])
    want = -LR * moved[i][keys].astype(np.float32)[:, None]
    np.testing.assert_array_equal(values, np.broadcast_to(want, values.shape))
if tier is not None:
    for ev in evs:  # rows moved both ways while the threads ran
        moves = ev_storage.tier_stats(ev.handle).numpy()[2:4]
        assert moves.min() > 0, moves
        print("promotions, spills", moves, flush=True)
print("STRESS OK", flush=True)
"""


# ssd: the EVs have a disk tier holding most rows (DRAM_SSDHASH); hbm:
# their tables are the CUDA core's (its host stand-in), without the raw
# CPU-EV updates.
@pytest.mark.parametrize("inter_op,mode,storage", [
    (3, "custom", "dram"), (4, "tf", "dram"), (3, "custom", "ssd"),
    (3, "custom", "hbm")])
def test_concurrent_training_lookups_and_export(inter_op, mode, storage,
                                                tmp_path):
    script = tmp_path / "stress.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               GROUP_EMBEDDING_HBM_ON_HOST="1")
    args = [str(inter_op), mode, "6",
            str(tmp_path / "tiers") if storage == "ssd" else storage]
    try:
        result = subprocess.run(
            [sys.executable, str(script), *args], env=env,
            capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock: concurrent EV ops (inter_op={inter_op}, "
                    f"kernels={mode}) did not finish in 240 s")
    assert result.returncode == 0 and "STRESS OK" in result.stdout, (
        f"returncode {result.returncode}\n{result.stdout[-2000:]}\n"
        f"{result.stderr[-4000:]}")
