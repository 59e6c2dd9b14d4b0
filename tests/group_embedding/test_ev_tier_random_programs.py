"""Random programs over tiered EmbeddingVariables, checked op by op
against an EV of one tier running the same program.

The other tier tests take one feature at a time (training, filters,
eviction, checkpoints); here a seeded program interleaves them on two
EVs a side (each with its own drawn filter and eviction policy):
training steps of a group of one to three features over them, an EV
read by up to two (combiners, weights, `max_norm`, and eager or traced
(the fused backward-apply) drawn per step), pooled or sequence
`training=False`
lookups, lookups that insert, eviction, frequency and version reads,
checkpoint writes and rewinds (restoring an older checkpoint after more
training), and incremental `ge.save_tables` (full saves and deltas)
with `ge.restore_tables`, which must bring back bitwise what the EV held
at the last save; at the end, a SavedModel of each side
(`ge.export_saved_model`) serves what its lookups read. Two
pairs, each of which must be equal BIT FOR BIT
after every op (every output, and every key's row, slots, freq and
version):
- ssd: a DRAM_SSDHASH EV whose DRAM tier holds 4 rows of 60 keys (keys
  move to and from the file at every op) and an all-DRAM EV;
- hbm_dram: an HBM_DRAM EV whose GPU table holds 128 of ~600 keys and an
  HBM EV holding every key (the CUDA core's host stand-in,
  `GROUP_EMBEDDING_HBM_ON_HOST=1`, as test_ev_hbm_dram_storage.py).
Options drawn per program: optimizer, filter (CounterFilter, and
CBFFilter for the disk tier), eviction policy, cache strategy. The same
programs also run on an HBM EV against a DRAM EV (the CPU EV's
semantics: keys, frequencies, versions exactly, floats to rounding).

Found so far: an HBM restore dropped the optimizer's slots that the
checkpoint lacked (the next step failed); after a restore that kept such
slots, the next incremental save was a delta with slot columns its base
lacked, which no restore could read; an HBM lookup of one filtered EV by
several features read every occurrence as before the call, where the
CPU EV lets a feature see the counts of the features before it (and the
first fix of that, a call per feature, let an earlier feature's inserts
give up a later feature's keys: caught by the HBM_DRAM pair); the HBM
fused update under `max_norm` clipped the gradient of a key admitted by
its own lookup at its stored row, not at the no_permission row it read.
"""

import numpy as np
import pytest
import tensorflow as tf
from test_ev_hbm_dram_storage import SPACE
from test_ev_ssd_storage import DIM
from test_ev_ssd_storage import _assert_same
from test_ev_ssd_storage import _option
from test_ev_ssd_storage import _snapshot
from test_ev_ssd_storage import _ssd

import group_embedding as ge
from group_embedding.ops import config

import ev_cases
from testing import second_tier_keys

OPTIMIZERS = [lambda: ge.optimizers.SGD(0.2),
              lambda: ge.optimizers.Adagrad(0.1),
              lambda: ge.optimizers.Adam(0.05),
              lambda: ge.optimizers.Ftrl(0.2, l1_regularization_strength=0.01,
                                         l2_regularization_strength=0.02)]
FILTERS = [None, ge.CounterFilter(filter_freq=2)]
# CPU EVs only (not on HBM tables yet).
CBF = ge.CBFFilter(filter_freq=2, max_element_size=1000,
                   false_positive_probability=0.01)
EVICTIONS = [None, ge.GlobalStepEvict(steps_to_live=4),
             ge.L2WeightEvict(l2_weight_threshold=0.5)]
STRATEGIES = [ge.CacheStrategy.LFU, ge.CacheStrategy.LRU]
COMBINERS = ["sum", "mean", "sqrtn"]


def _ssd_pair(tmp_path, name, strategy, options):
    """(oracles, tiered EVs): one pair per entry of `options`; the keys
    their programs draw from and the rows of a feature."""
    refs, tiered = [], []
    for i, opts in enumerate(options):
        refs.append(ev_cases.make_ev(f"{name}_dram{i}", DIM, seed=i,
                                     ev_option=_option(**opts)))
        tiered.append(ev_cases.make_ev(
            f"{name}_tier{i}", DIM, seed=i, ev_option=_option(
                _ssd(tmp_path / f"{name}{i}", strategy=strategy), **opts)))
    return refs, tiered, np.arange(60, dtype=np.int64) * 7919 - 200000, 6


def _hbm_dram_pair(tmp_path, name, strategy, options):
    def make(suffix, kind, size, opts, seed):
        return ev_cases.make_ev(f"{name}_{suffix}", DIM, seed=seed,
                                ev_option=_option(ge.StorageOption(
                                    kind, storage_size=[size],
                                    cache_strategy=strategy), **opts))
    whole = [make(f"hbm{i}", ge.StorageType.HBM, 1 << 22, opts, i)
             for i, opts in enumerate(options)]
    tiered = [make(f"tier{i}", ge.StorageType.HBM_DRAM, 1, opts, i)
              for i, opts in enumerate(options)]
    assert all(ev.storage.capacity == 128 for ev in tiered)
    assert all(ev.storage.capacity >= 4 * len(SPACE) for ev in whole)
    # Up to 96 ids of an EV a step (two features of 12 rows): more keys
    # than the GPU table's 128 within a few steps, yet a step's fit.
    return whole, tiered, SPACE, 12


PAIRS = {"ssd": _ssd_pair, "hbm_dram": _hbm_dram_pair}


def _assert_restored(now, saved):
    """`now` is `saved` restored into an EV that may have built optimizer
    slots since: those stay (as an import keeps them), every key's entry
    their initial value; all else bitwise."""
    names = list(now["slot_names"])
    dim = now["values"].shape[1]
    kept = [names.index(n) for n in saved["slot_names"]]
    expect = dict(saved, slot_names=now["slot_names"],
                  slot_inits=now["slot_inits"],
                  slots=np.empty_like(now["slots"]))
    for j, init in enumerate(now["slot_inits"]):
        expect["slots"][:, j * dim:(j + 1) * dim] = init
    for c, j in enumerate(kept):
        expect["slots"][:, j * dim:(j + 1) * dim] = \
            saved["slots"][:, c * dim:(c + 1) * dim]
        assert now["slot_inits"][j] == saved["slot_inits"][c]
    _assert_same(now, expect)


def _ids(rng, keys, rows):
    return tf.ragged.constant(
        [list(rng.choice(keys, size=rng.integers(0, 5))) for _ in range(rows)],
        dtype=tf.int64, row_splits_dtype=tf.int64)


class _Side:
    """A side's EVs, its optimizer and its checkpoints."""

    def __init__(self, evs, optimizer):
        self.evs, self.opt = evs, optimizer
        self.tables = {f"ev{i}": ev for i, ev in enumerate(evs)}
        self.ckpt = tf.train.Checkpoint(**self.tables)
        self._traced = {}

    def train(self, feats, which, combiners, weights, traced, max_norm):
        """One step of a group lookup: feature f reads EV which[f];
        `traced`: in a `tf.function` (the fused backward-apply), else
        eagerly (an update per EV)."""
        key = (tuple(which), tuple(combiners), weights is None, max_norm)
        if not traced:
            return [o.numpy() for o in self._step(key, feats, weights)]
        if key not in self._traced:
            self._traced[key] = tf.function(
                lambda f, w: self._step(key, f, w), reduce_retracing=True)
        return [o.numpy() for o in self._traced[key](feats, weights)]

    def _step(self, key, feats, weights):
        which, combiners, _, max_norm = key
        read = [self.evs[i] for i in sorted(set(which))]
        with tf.GradientTape() as tape:
            outs = ge.group_embedding_lookup_sparse(
                [self.evs[i] for i in which], list(feats), list(combiners),
                sp_weights=weights, max_norm=max_norm)
            loss = sum(tf.reduce_sum(tf.square(o - 0.3 * (i + 1)))
                       for i, o in enumerate(outs))
        self.opt.apply_gradients(zip(tape.gradient(loss, read), read))
        return outs


def _weights(rng, feats):
    if rng.random() < 0.5:
        return None
    return [f.with_values(tf.constant(
        rng.uniform(0.25, 2.0, f.values.shape[0]).astype(np.float32)))
        for f in feats]


def _bitwise(got, want, context):
    np.testing.assert_array_equal(
        got.view(np.uint8) if got.dtype == np.float32 else got,
        want.view(np.uint8) if want.dtype == np.float32 else want,
        err_msg=context)


def _close(got, want, context):
    """HBM against the CPU EV: floats to rounding (the kernels sum in
    another order), all else exactly. The absolute tolerance follows the
    array's scale: FTRL's linear term is a difference of near terms of
    the accumulators' size, and keeps their rounding (seed 31: 2e-5 on
    0.0076 beside accumulators of 28)."""
    if got.dtype == np.float32:
        scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=context)
    else:
        np.testing.assert_array_equal(got, want, err_msg=context)


def _run(tmp_path, seed, sides, keys, rows, same):
    """Runs seed's program on both sides, comparing every output and the
    whole state after each op with `same`; returns the most keys the
    second side's second tiers held."""
    rng = np.random.default_rng(seed)
    n_evs = len(sides[0].evs)
    # Every kind of op at least twice, saves before the first rewinds.
    program = (["train"] * 24 + ["infer", "insert", "evict", "counts"] * 2
               + ["save", "rewind"] * 3 + ["save_tables"] * 5
               + ["restore_tables"] * 2)
    rng.shuffle(program)
    program[:0] = ["save", "save_tables"]
    # What each side held at its last save_tables: what restore_tables
    # must bring back, bitwise (full saves and deltas alike).
    at_save_tables = [None, None]
    most_moved = 0
    saved = []
    trail = []  # the program so far, for the failure message
    for step, op in enumerate(program):
        trail.append(op)
        context = f"seed {seed}, program {trail}"
        i = int(rng.integers(n_evs))  # the EV of a one-EV op
        try:
            if op == "train":
                # One to three features, at most two reading an EV.
                which = list(rng.permutation(
                    [e for e in range(n_evs) for _ in range(2)]))[
                        :rng.integers(1, 4)]
                feats = [_ids(rng, keys, rows) for _ in which]
                combiners = [str(rng.choice(COMBINERS)) for _ in feats]
                weights = _weights(rng, feats)
                traced = bool(rng.random() < 0.5)
                max_norm = [None, 0.9][rng.integers(2)]
                got = [s.train(feats, which, combiners, weights, traced,
                               max_norm) for s in sides]
            elif op == "infer":
                feats = [_ids(rng, keys, rows)]
                sequence = bool(rng.random() < 0.5)
                got = [[o.numpy() for o in ge.group_embedding_lookup_sparse(
                    [s.evs[i]], feats, "mean", is_sequence=sequence,
                    training=False)] for s in sides]
            elif op == "insert":
                some = tf.constant(rng.choice(keys, size=rng.integers(1, 12)))
                got = [[s.evs[i].lookup_rows(some, training=True).numpy()]
                       for s in sides]
            elif op == "evict":
                got = [[s.evs[i].evict().numpy()] for s in sides]
            elif op == "counts":
                some = tf.constant(rng.choice(keys, size=10))
                got = [[s.evs[i].get_frequency(some).numpy(),
                        s.evs[i].get_version(some).numpy()] for s in sides]
            elif op == "save":
                path = str(tmp_path / f"ckpt_{step}")
                for k, s in enumerate(sides):
                    s.ckpt.write(f"{path}_{k}")
                saved.append(path)
                got = [[], []]
            elif op == "save_tables":
                # Incremental: a full save, then deltas, every 3rd full.
                for k, s in enumerate(sides):
                    ge.save_tables(str(tmp_path / f"tables_{k}"), s.tables,
                                   step, full_every=3)
                    at_save_tables[k] = [_snapshot(ev) for ev in s.evs]
                got = [[], []]
            elif op == "restore_tables":
                for k, s in enumerate(sides):
                    ge.restore_tables(str(tmp_path / f"tables_{k}"),
                                      s.tables)
                    for ev, want in zip(s.evs, at_save_tables[k]):
                        _assert_restored(_snapshot(ev), want)
                got = [[], []]
            else:  # rewind: restore an older checkpoint after more steps
                path = saved[rng.integers(len(saved))]
                for k, s in enumerate(sides):
                    s.ckpt.read(f"{path}_{k}").assert_consumed()
                got = [[], []]
            for a, b in zip(*got):
                same(np.asarray(b), np.asarray(a), context)
            for ref, ev in zip(sides[0].evs, sides[1].evs):
                want, now = _snapshot(ref), _snapshot(ev)
                assert now.keys() == want.keys()
                for field in want:
                    same(np.asarray(now[field]), np.asarray(want[field]),
                         f"{context}: {ev.name} {field}")
                assert int(ev.size()) == int(ref.size())
        except Exception as e:
            raise AssertionError(f"{context}: {e}") from e
        most_moved = max(most_moved,
                         sum(second_tier_keys(ev) for ev in sides[1].evs))
    for k, s in enumerate(sides):
        _assert_export_serves_as_lookups(tmp_path / f"export_{k}", s.evs,
                                         [_ids(rng, keys, rows) for _ in
                                          s.evs])
    return most_moved


def _assert_export_serves_as_lookups(path, evs, request):
    """The SavedModel of a lookup of `evs` (`ge.export_saved_model`, every
    EV frozen into stock ops) serves what `training=False` lookups read
    now: rows, filtered and default rows alike (to rounding: stock ops
    pool in their own order)."""
    module = tf.Module()
    module.evs = evs
    spec = tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)

    @tf.function(input_signature=[[spec] * len(evs)])
    def serve(ids):
        return ge.group_embedding_lookup_sparse(evs, ids, "sqrtn",
                                                training=False)

    module.serve = serve
    want = [o.numpy() for o in serve(request)]
    ge.export_saved_model(module, str(path))
    loaded = tf.saved_model.load(str(path))  # held: it owns the tables
    got = loaded.serve(request)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-6, atol=1e-6,
                                   err_msg="served")


def _options(rng, exclude_l2=False, cbf=False):
    """Two EVs' options (filter, eviction) and a cache strategy."""
    evictions = EVICTIONS[:-1] if exclude_l2 else EVICTIONS
    filters = FILTERS + [CBF] if cbf else FILTERS
    return ([{"filter_option": filters[rng.integers(len(filters))],
              "evict_option": evictions[rng.integers(len(evictions))]}
             for _ in range(2)],
            STRATEGIES[rng.integers(len(STRATEGIES))])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_random_program_matches_one_tier_bitwise(tmp_path, monkeypatch,
                                                 kind, seed):
    monkeypatch.setenv(config.HBM_ON_HOST, "1")
    options, strategy = _options(np.random.default_rng(1000 + seed),
                                 cbf=kind == "ssd")
    oracles, tiered, keys, rows = PAIRS[kind](
        tmp_path, f"prog_{kind}{seed}", strategy, options)
    make_opt = OPTIMIZERS[seed % len(OPTIMIZERS)]
    sides = (_Side(oracles, make_opt()), _Side(tiered, make_opt()))
    # The program did move keys between tiers.
    assert _run(tmp_path, seed, sides, keys, rows, _bitwise) > 0


@pytest.mark.parametrize("seed", range(8))
def test_random_program_on_hbm_matches_the_cpu_ev(tmp_path, monkeypatch,
                                                  seed):
    """The same programs on HBM EVs (the CUDA core's kernels, on the
    host stand-in) and DRAM EVs: keys, frequencies, versions and counts
    exactly, floats to rounding. No L2WeightEvict: a row's norm within
    rounding of the threshold may go either way."""
    monkeypatch.setenv(config.HBM_ON_HOST, "1")
    options, strategy = _options(np.random.default_rng(2000 + seed),
                                 exclude_l2=True)
    name = f"prog_cpu{seed}"
    dram, hbm = [], []
    for i, opts in enumerate(options):
        dram.append(ev_cases.make_ev(f"{name}_dram{i}", DIM, seed=i,
                                     ev_option=_option(**opts)))
        hbm.append(ev_cases.make_ev(f"{name}_hbm{i}", DIM, seed=i,
                                    ev_option=_option(ge.StorageOption(
                                        ge.StorageType.HBM,
                                        storage_size=[1 << 22],
                                        cache_strategy=strategy), **opts)))
    make_opt = OPTIMIZERS[seed % len(OPTIMIZERS)]
    sides = (_Side(dram, make_opt()), _Side(hbm, make_opt()))
    _run(tmp_path, seed, sides, SPACE, 12, _close)
