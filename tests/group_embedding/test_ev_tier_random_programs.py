"""Random programs over tiered EmbeddingVariables, checked op by op
against an EV of one tier running the same program.

The other tier tests take one feature at a time (training, filters,
eviction, checkpoints); here a seeded program interleaves them on one
pair of EVs: training steps of a group that reads the EV through two
features (combiners and weights drawn per step), `training=False`
lookups, lookups that insert, eviction, frequency and version reads,
and checkpoint writes and rewinds (restoring an older checkpoint after
more training). Two pairs, each of which must be equal BIT FOR BIT
after every op (every output, and every key's row, slots, freq and
version):
- ssd: a DRAM_SSDHASH EV whose DRAM tier holds 4 rows of 60 keys (keys
  move to and from the file at every op) and an all-DRAM EV;
- hbm_dram: an HBM_DRAM EV whose GPU table holds 128 of ~600 keys and an
  HBM EV holding every key (the CUDA core's host stand-in,
  `GROUP_EMBEDDING_HBM_ON_HOST=1`, as test_ev_hbm_dram_storage.py).
Options drawn per program: optimizer, filter, eviction policy, cache
strategy.
"""

import numpy as np
import pytest
import tensorflow as tf
from test_ev_hbm_dram_storage import SPACE
from test_ev_ssd_storage import DIM
from test_ev_ssd_storage import _assert_same
from test_ev_ssd_storage import _option
from test_ev_ssd_storage import _ssd

import group_embedding as ge
from group_embedding.ops import config
from group_embedding.ops import ev_storage

import ev_cases

OPTIMIZERS = [lambda: ge.optimizers.SGD(0.2),
              lambda: ge.optimizers.Adagrad(0.1),
              lambda: ge.optimizers.Adam(0.05),
              lambda: ge.optimizers.Ftrl(0.2, l1_regularization_strength=0.01,
                                         l2_regularization_strength=0.02)]
FILTERS = [None, ge.CounterFilter(filter_freq=2)]
EVICTIONS = [None, ge.GlobalStepEvict(steps_to_live=4),
             ge.L2WeightEvict(l2_weight_threshold=0.5)]
STRATEGIES = [ge.CacheStrategy.LFU, ge.CacheStrategy.LRU]
COMBINERS = ["sum", "mean", "sqrtn"]


def _ssd_pair(tmp_path, name, strategy, options):
    """(oracle, tiered) and the keys their programs draw from."""
    dram = ev_cases.make_ev(f"{name}_dram", DIM, ev_option=_option(**options))
    tier = ev_cases.make_ev(f"{name}_tier", DIM, ev_option=_option(
        _ssd(tmp_path / name, strategy=strategy), **options))
    return dram, tier, np.arange(60, dtype=np.int64) * 7919 - 200000


def _hbm_dram_pair(tmp_path, name, strategy, options):
    def make(suffix, kind, size):
        return ev_cases.make_ev(f"{name}_{suffix}", DIM, ev_option=_option(
            ge.StorageOption(kind, storage_size=[size],
                             cache_strategy=strategy), **options))
    whole = make("hbm", ge.StorageType.HBM, 1 << 22)
    tier = make("tier", ge.StorageType.HBM_DRAM, 1)
    assert tier.storage.capacity == 128
    assert whole.storage.capacity >= 4 * len(SPACE)
    return whole, tier, SPACE


PAIRS = {"ssd": _ssd_pair, "hbm_dram": _hbm_dram_pair}


def _second_tier_keys(ev):
    """Keys on disk (DRAM_SSDHASH) or in host memory (HBM_DRAM)."""
    if ev.ge_table_kind == "hbm_ev":
        return int(ev.storage.tier_sizes(ev.handle).numpy()[1])
    return int(ev_storage.tier_stats(ev.handle)[1])


def _snapshot(ev):
    """Every output of the EV's export, rows sorted by key, as numpy."""
    keys, values, freqs, versions, names, inits, slots, step = (
        x.numpy() for x in ev.storage.export(ev.handle, ev.embedding_dim))
    order = np.argsort(keys)
    return {"keys": keys[order], "values": values[order],
            "freqs": freqs[order], "versions": versions[order],
            "slot_names": names, "slot_inits": inits,
            "slots": slots[order], "step": step}


def _ids(rng, keys, rows=6):
    return tf.ragged.constant(
        [list(rng.choice(keys, size=rng.integers(0, 5))) for _ in range(rows)],
        dtype=tf.int64, row_splits_dtype=tf.int64)


class _Side:
    """One EV, its optimizer and its checkpoints."""

    def __init__(self, ev, optimizer):
        self.ev, self.opt = ev, optimizer
        self.ckpt = tf.train.Checkpoint(ev=ev)

    def train(self, feats, combiners, weights):
        with tf.GradientTape() as tape:
            outs = ge.group_embedding_lookup_sparse(
                [self.ev] * len(feats), feats, combiners,
                sp_weights=weights)
            loss = sum(tf.reduce_sum(tf.square(o - 0.3 * (i + 1)))
                       for i, o in enumerate(outs))
        self.opt.apply_gradients([(tape.gradient(loss, self.ev), self.ev)])
        return [o.numpy() for o in outs]


def _weights(rng, feats):
    if rng.random() < 0.5:
        return None
    return [f.with_values(tf.constant(
        rng.uniform(0.25, 2.0, f.values.shape[0]).astype(np.float32)))
        for f in feats]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_random_program_matches_one_tier_bitwise(tmp_path, monkeypatch,
                                                 kind, seed):
    monkeypatch.setenv(config.HBM_ON_HOST, "1")
    rng = np.random.default_rng(seed)
    make_opt = OPTIMIZERS[seed % len(OPTIMIZERS)]
    options = {"filter_option": FILTERS[rng.integers(len(FILTERS))],
               "evict_option": EVICTIONS[rng.integers(len(EVICTIONS))]}
    strategy = STRATEGIES[rng.integers(len(STRATEGIES))]
    oracle, tiered, keys = PAIRS[kind](tmp_path, f"prog_{kind}{seed}",
                                       strategy, options)
    ref, tier = _Side(oracle, make_opt()), _Side(tiered, make_opt())
    # Every kind of op at least twice, a save before the first rewind.
    program = (["train"] * 24 + ["infer", "insert", "evict", "counts"] * 2
               + ["save", "rewind"] * 3)
    rng.shuffle(program)
    program.insert(0, "save")
    sides = (ref, tier)
    most_moved = 0  # keys in the second tier, at most
    saved = []
    trail = []  # the program so far, for the failure message
    for step, op in enumerate(program):
        trail.append(op)
        if op == "train":
            feats = [_ids(rng, keys) for _ in range(rng.integers(1, 3))]
            combiners = [str(rng.choice(COMBINERS)) for _ in feats]
            weights = _weights(rng, feats)
            got = [s.train(feats, combiners, weights) for s in sides]
        elif op == "infer":
            feats = [_ids(rng, keys)]
            got = [[o.numpy() for o in ge.group_embedding_lookup_sparse(
                [s.ev], feats, "mean", training=False)] for s in sides]
        elif op == "insert":
            some = tf.constant(rng.choice(keys, size=rng.integers(1, 12)))
            got = [[s.ev.lookup_rows(some, training=True).numpy()]
                   for s in sides]
        elif op == "evict":
            got = [[s.ev.evict().numpy()] for s in sides]
        elif op == "counts":
            some = tf.constant(rng.choice(keys, size=10))
            got = [[s.ev.get_frequency(some).numpy(),
                    s.ev.get_version(some).numpy()] for s in sides]
        elif op == "save":
            path = str(tmp_path / f"ckpt_{step}")
            for i, s in enumerate(sides):
                s.ckpt.write(f"{path}_{i}")
            saved.append(path)
            got = [[], []]
        else:  # rewind: restore an older checkpoint after more steps
            path = saved[rng.integers(len(saved))]
            for i, s in enumerate(sides):
                s.ckpt.read(f"{path}_{i}").assert_consumed()
            got = [[], []]
        context = f"seed {seed}, program {trail}"
        for a, b in zip(*got):
            np.testing.assert_array_equal(
                np.asarray(b).view(np.uint8) if b.dtype == np.float32 else b,
                np.asarray(a).view(np.uint8) if a.dtype == np.float32 else a,
                err_msg=context)
        try:
            _assert_same(_snapshot(tier.ev), _snapshot(ref.ev))
        except AssertionError as e:
            raise AssertionError(f"{context}: {e}") from None
        assert int(tier.ev.size()) == int(ref.ev.size()), context
        most_moved = max(most_moved, _second_tier_keys(tier.ev))
    assert most_moved > 0  # the program did move keys between tiers
