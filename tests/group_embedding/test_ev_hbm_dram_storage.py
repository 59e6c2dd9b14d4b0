"""EmbeddingVariables in GPU memory over a host-memory tier
(StorageType.HBM_DRAM), on the CUDA core's host stand-in
(`GROUP_EMBEDDING_HBM_ON_HOST=1`, as test_ev_hbm_storage.py).

The GPU table here is ONE bucket (128 keys) and the ids span several
hundred keys, so most keys live in the host tier at any time and every
step moves keys both ways. Two oracles get the same default matrix and
batches: an HBM EV whose table holds every key (the same kernels, no
tier), which the tiered EV must equal BIT FOR BIT (outputs, keys, rows,
slots, frequencies, versions: moving a key between tiers changes
nothing), and a DRAM EV (the C++ CPU storage), which it must equal in
keys, frequencies and versions exactly and in rows and slots to float
tolerance (test_ev_hbm_storage.py says why not bitwise). Covered: LFU
and LRU, every optimizer, CounterFilter, the eviction policies, groups,
inference reads, per-key updates of keys not looked up, checkpoints
both ways, and a step too large for the GPU table.
"""


import numpy as np
import pytest
import tensorflow as tf

# Every key's state, sorted by key (the HBM tests' helper; same DIM).
from test_ev_hbm_storage import _state

import group_embedding as ge
from group_embedding.ops import config
from group_embedding.ops import gpu_kernel_library

DIM = 4
DEFAULT_ROWS = 5
# Keys a step draws from: several times the GPU table's 128.
SPACE = np.concatenate([np.arange(-300, 300, dtype=np.int64) * 7919,
                        [2**62, -2**62, 2**63 - 1]]).astype(np.int64)


@pytest.fixture(autouse=True)
def hbm(monkeypatch):
    monkeypatch.setenv(config.HBM_ON_HOST, "1")


def _option(storage, filter_freq=0, evict=None):
    return ge.EmbeddingVariableOption(
        init_option=ge.InitializerOption(
            default_value_dim=DEFAULT_ROWS, default_value_no_permission=0.25),
        filter_option=(ge.CounterFilter(filter_freq) if filter_freq
                       else None),
        evict_option=evict, storage_option=storage)


def _tiered(name, strategy=None, filter_freq=0, evict=None):
    storage = ge.StorageOption(ge.StorageType.HBM_DRAM, storage_size=[1],
                               cache_strategy=strategy)
    return ge.get_embedding_variable(
        name, DIM, initializer=tf.keras.initializers.RandomUniform(
            -1.0, 1.0, seed=7),
        ev_option=_option(storage, filter_freq, evict))


def _evs(name, strategy=None, filter_freq=0, evict=None):
    """(HBM_DRAM EV with a 128-key GPU table, HBM EV holding every key,
    DRAM EV), same default matrix."""
    tiered = _tiered(f"{name}_tiered", strategy, filter_freq, evict)
    whole = ge.get_embedding_variable(
        f"{name}_hbm", DIM, ev_option=_option(
            ge.StorageOption(ge.StorageType.HBM, storage_size=[1 << 22],
                             cache_strategy=strategy), filter_freq, evict))
    dram = ge.get_embedding_variable(
        f"{name}_dram", DIM, ev_option=_option(ge.StorageOption(),
                                               filter_freq, evict))
    for ev in (whole, dram):
        ev.default_values.assign(tiered.default_values)
    assert tiered.storage.capacity == 128
    assert whole.storage.capacity >= 4 * len(SPACE)
    return tiered, whole, dram


def _batches(seed, steps, rows=12, per_row=8, space=SPACE):
    """Ragged batches of at most rows * per_row ids (< 128 distinct, so a
    step's keys always fit the GPU table) drawn from `space`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        hot = rng.choice(space, size=rng.integers(20, 60), replace=False)
        ids = [list(rng.choice(hot, size=rng.integers(0, per_row)))
               for _ in range(rows)]
        out.append(tf.ragged.constant(ids, tf.int64,
                                      row_splits_dtype=tf.int64))
    return out


def _assert_same_state(got_ev, want_ev, exact=True):
    got, want = _state(got_ev), _state(want_ev)
    assert len(np.unique(got[0])) == len(got[0]), "a key is stored twice"
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[3], want[3])
    assert got[4] == want[4] and got[6] == want[6]
    for g, w in ((got[1], want[1]), (got[5], want[5])):
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=3e-5, atol=2e-6)
    assert int(got_ev.size()) == int(want_ev.size()) == len(want[0])


def _check(evs):
    """The tiered EV equals the whole-table HBM EV bitwise and the DRAM EV
    (keys, freqs, versions exactly)."""
    tiered, whole, dram = evs
    _assert_same_state(tiered, whole)
    _assert_same_state(tiered, dram, exact=False)


def _train(ev, optimizer, batches, combiner="mean"):
    outs = []
    for ids in batches:
        with tf.GradientTape() as tape:
            (out,) = ge.group_embedding_lookup_sparse([ev], [ids], combiner)
            loss = tf.reduce_sum(out * tf.sin(out + 1.0))
        optimizer.apply(tape.gradient(loss, [ev]), [ev])
        outs.append(out.numpy())
    return outs


def _train_all(evs, make, batches, combiner="mean"):
    """Trains each EV with its own optimizer; checks the outputs."""
    got, whole, dram = [_train(ev, make(), batches, combiner) for ev in evs]
    for g, w, d in zip(got, whole, dram):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(g, d, rtol=3e-5, atol=2e-6)


@pytest.mark.parametrize("strategy", [ge.CacheStrategy.LFU,
                                      ge.CacheStrategy.LRU])
@pytest.mark.parametrize("name,make", [
    ("adagrad", lambda: ge.optimizers.Adagrad(0.1)),
    ("adam", lambda: ge.optimizers.Adam(0.05)),
    ("ftrl", lambda: ge.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                        l2_regularization_strength=0.02)),
    ("sgd", lambda: ge.optimizers.SGD(0.2)),
])
def test_keys_move_between_tiers_and_nothing_is_lost(strategy, name, make):
    evs = _evs(f"move_{name}_{strategy.name}", strategy)
    _train_all(evs, make, _batches(3, steps=14))
    _check(evs)
    # Most keys are in host memory, the GPU table is full: the tier was
    # used, and a key is in one tier only.
    gpu, host = evs[0].storage.tier_sizes(evs[0].handle).numpy()
    assert gpu == evs[0].storage.capacity and host > gpu
    assert gpu + host == int(evs[0].size())
    assert list(evs[1].storage.tier_sizes(evs[1].handle).numpy()) == [
        int(evs[1].size()), 0]


def test_keys_read_in_a_step_are_not_displaced_by_keys_coming_back():
    """LRU, one full bucket: a step reads its oldest keys still on the GPU
    and keys back from host memory; bringing those back must not push the
    step's GPU keys out before they are read (they are pinned while the
    import runs), else they would read as new keys."""
    evs = _evs("pinning", ge.CacheStrategy.LRU)
    first, second = SPACE[:100], SPACE[100:200]
    # One-key steps between them advance the step: a lookup pins the keys
    # of the step before it (stamped by its update), so two steps' keys
    # must fit the bucket.
    batches = [tf.ragged.constant([list(first)], tf.int64),
               tf.ragged.constant([[SPACE[-1]]], tf.int64),
               tf.ragged.constant([list(second)], tf.int64),
               tf.ragged.constant([[SPACE[-2]]], tf.int64),
               # Some of `first` still on the GPU (the oldest), the rest
               # in host memory.
               tf.ragged.constant([list(first)], tf.int64)]
    _train_all(evs, lambda: ge.optimizers.Adagrad(0.1), batches, "sum")
    _check(evs)


def test_counter_filter_counts_survive_the_host_tier():
    evs = _evs("filter", filter_freq=3)
    _train_all(evs, lambda: ge.optimizers.Adagrad(0.1), _batches(5, steps=12))
    _check(evs)


def test_a_group_of_tiered_evs_with_a_shared_table():
    a = _evs("grp_a")
    b = _evs("grp_b", ge.CacheStrategy.LRU)
    batches = _batches(8, steps=12)

    def run(tables):
        opt = ge.optimizers.Adagrad(0.1)
        outs = []
        for i in range(0, len(batches), 3):
            ids = [batches[i + j] for j in range(3)]
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse(
                    tables, ids, ["sum", "mean", "sqrtn"])
                loss = tf.add_n([tf.reduce_sum(o * o) for o in out])
            distinct = [tables[0], tables[2]]
            opt.apply(tape.gradient(loss, distinct), distinct)
            outs.extend(o.numpy() for o in out)
        return outs

    got, whole = (run([a[i], a[i], b[i]]) for i in (0, 1))
    for g, w in zip(got, whole):
        np.testing.assert_array_equal(g, w)
    run([a[2], a[2], b[2]])
    _check(a)
    _check(b)


def test_sequence_lookups_of_keys_in_host_memory():
    """is_sequence=True over the tiers (traced, Adagrad): the whole-table
    HBM EV's outputs and state bitwise, the DRAM EV's to tolerance."""
    evs = _evs("seq")
    batches = _batches(12, steps=10)
    outs = []
    for ev in evs:
        opt = ge.optimizers.Adagrad(0.1)

        @tf.function
        def step(ids, ev=ev, opt=opt):
            with tf.GradientTape() as tape:
                (out,) = ge.group_embedding_lookup_sparse(
                    [ev], [ids], "sum", is_sequence=True)
                loss = tf.reduce_sum(out * tf.sin(out + 1.0))
            opt.apply(tape.gradient(loss, [ev]), [ev])
            return out

        outs.append([step(ids).numpy() for ids in batches])
    for g, w, d in zip(*outs):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(g, d, rtol=3e-5, atol=2e-6)
    _check(evs)
    assert evs[0].storage.tier_sizes(evs[0].handle).numpy()[1] > 0


def test_an_update_after_keys_moved_to_host_memory_brings_them_back():
    """The update skips looking for the keys of the step's lookup in host
    memory only while no key has gone there since: a restore between the
    lookup and the update (every key to host memory, then the hottest
    back to the GPU) makes it look again. Oracle: the whole-table HBM EV
    given the same calls, bitwise."""
    evs = _evs("moved")[:2]
    batches = _batches(15, steps=6)
    for ev in evs:
        opt = ge.optimizers.Adagrad(0.1)
        for ids in batches:
            with tf.GradientTape() as tape:
                (out,) = ge.group_embedding_lookup_sparse([ev], [ids],
                                                          "mean")
                loss = tf.reduce_sum(out * tf.sin(out + 1.0))
            grads = tape.gradient(loss, [ev])
            ev.storage.import_(ev.handle, *ev.storage.export(ev.handle, DIM))
            opt.apply(grads, [ev])
    _assert_same_state(evs[0], evs[1])
    assert evs[0].storage.tier_sizes(evs[0].handle).numpy()[1] > 0


def test_inference_reads_keys_in_host_memory_without_stamping():
    evs = _evs("infer")
    _train_all(evs, lambda: ge.optimizers.Adagrad(0.1), _batches(9, steps=8))
    ids = tf.ragged.constant([list(SPACE[:60]), list(SPACE[300:360]),
                              [123456789]], tf.int64)
    got, whole, dram = (
        ge.group_embedding_lookup_sparse([ev], [ids], "mean",
                                         training=False)[0].numpy()
        for ev in evs)
    np.testing.assert_array_equal(got, whole)
    np.testing.assert_allclose(got, dram, rtol=3e-5, atol=2e-6)
    _check(evs)


def test_per_key_updates_of_keys_in_host_memory():
    """An update of keys the step did not look up (IndexedSlices given
    directly) reaches keys in host memory too."""
    evs = _evs("direct")
    _train_all(evs, lambda: ge.optimizers.Adagrad(0.1),
               _batches(13, steps=8))
    keys = tf.constant(SPACE[::5][:90])
    grad = tf.IndexedSlices(
        tf.reshape(tf.range(90 * DIM, dtype=tf.float32) / 100.0, [90, DIM]),
        keys)
    for ev in evs:
        ge.optimizers.Adagrad(0.1).apply([grad], [ev])
    _check(evs)


@pytest.mark.parametrize("evict", [ge.GlobalStepEvict(steps_to_live=2),
                                   ge.L2WeightEvict(l2_weight_threshold=0.3)])
def test_eviction_policies_see_both_tiers(evict):
    evs = _evs(f"evict_{type(evict).__name__}", evict=evict)
    opts = [ge.optimizers.Adagrad(0.1) for _ in evs]
    removed = [[] for _ in evs]
    for batch in _batches(17, steps=10):
        for i, ev in enumerate(evs):
            _train(ev, opts[i], [batch])
            removed[i].append(int(ev.evict()))
        _check(evs)
    assert removed[0] == removed[1] == removed[2]
    assert sum(removed[0]) > 0


@pytest.mark.parametrize("saved,restored", [("tiered", "dram"),
                                            ("dram", "tiered"),
                                            ("tiered", "tiered")])
def test_checkpoints_restore_both_ways(tmp_path, saved, restored):
    tiered, _, dram = _evs(f"ck_{saved}_{restored}", filter_freq=2)
    batches = _batches(31, steps=10)
    for ev in (tiered, dram):
        _train(ev, ge.optimizers.Adam(0.05), batches)
    source = tiered if saved == "tiered" else dram
    path = tf.train.Checkpoint(ev=source).write(str(tmp_path / saved))
    name = f"ck_{saved}_{restored}_into"
    target = (_tiered(name, filter_freq=2) if restored == "tiered" else
              ge.get_embedding_variable(name, DIM, ev_option=_option(
                  ge.StorageOption(), filter_freq=2)))
    tf.train.Checkpoint(ev=target).read(path).assert_consumed()
    _assert_same_state(target, source)
    if restored == "tiered":
        # The hottest keys by LFU (freq, then version, then key) are back
        # in the GPU table, up to half of it; the rest in host memory.
        gpu, host = target.storage.tier_sizes(target.handle).numpy()
        assert gpu == 64 and gpu + host == int(target.size())
        keys, _, freqs, versions = (np.asarray(x) for x in
                                    _state(target)[:4])
        hottest = sorted(zip(-freqs, -versions, keys))[:64]
        ids = tf.ragged.constant([[int(k) for _, _, k in hottest]],
                                 tf.int64)
        ge.group_embedding_lookup_sparse([target], [ids], "sum",
                                         training=False)
        # Reading them moved nothing.
        assert list(target.storage.tier_sizes(target.handle).numpy()) == [
            gpu, host]
    more = _batches(32, steps=4)
    opt_a, opt_b = ge.optimizers.Adam(0.05), ge.optimizers.Adam(0.05)
    for opt in (opt_a, opt_b):
        opt.iterations.assign(10)
    got, want = _train(target, opt_a, more), _train(source, opt_b, more)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=3e-5, atol=2e-6)
    _assert_same_state(target, source, exact=False)


def test_a_step_too_large_for_one_bucket_loses_nothing():
    """More distinct keys in one step than the GPU table holds is an error
    naming the EV, and every key stored before it is still there."""
    tiered, _, _ = _evs("overfull")
    _train(tiered, ge.optimizers.Adagrad(0.1), _batches(41, steps=6))
    before = _state(tiered)
    many = tf.ragged.constant([list(SPACE[:200])], tf.int64)
    with pytest.raises(tf.errors.ResourceExhaustedError,
                       match="overfull_tiered.*could not store"):
        ge.group_embedding_lookup_sparse([tiered], [many], "sum")
    after = _state(tiered)
    # Every key stored before is there with its row and slots.
    index = {int(k): i for i, k in enumerate(after[0])}
    idx = [index[int(k)] for k in before[0]]
    np.testing.assert_array_equal(after[1][idx], before[1])
    np.testing.assert_array_equal(after[5][idx], before[5])
    assert len(np.unique(after[0])) == len(after[0])


@pytest.mark.parametrize("evict", [None, ge.GlobalStepEvict(steps_to_live=2)])
def test_incremental_deltas_cover_both_tiers(tmp_path, evict):
    """save_tables(..., full_every=3) each step: the tiered EV writes the
    DRAM EV's full saves and deltas (changed keys of both tiers, removed
    keys), and every chain restores bitwise into a fresh EV of either
    kind."""
    tag = type(evict).__name__
    tiered, _, dram = _evs(f"inc_{tag}", evict=evict)
    evs = {"tiered": tiered, "dram": dram}
    opts = {kind: ge.optimizers.Adagrad(0.1) for kind in evs}
    kinds, removed = [], 0
    for step, batch in enumerate(_batches(61, steps=7), 1):
        for kind, ev in evs.items():
            _train(ev, opts[kind], [batch])
        saved = {kind: ge.save_tables(str(tmp_path / kind), {"t": ev}, step,
                                      full_every=3)
                 for kind, ev in evs.items()}
        got, want = (dict(np.load(f"{saved[k]}/shard-0-of-1.npz"))
                     for k in ("tiered", "dram"))
        assert sorted(got) == sorted(want)
        np.testing.assert_array_equal(np.sort(got["t/keys"]),
                                      np.sort(want["t/keys"]))
        if "t/removed" in got:
            kinds.append("delta")
            np.testing.assert_array_equal(np.sort(got["t/removed"]),
                                          np.sort(want["t/removed"]))
            removed += got["t/removed"].size
        else:
            kinds.append("full")
        for kind in ("tiered", "dram"):
            name = f"inc_{tag}_{step}_{kind}"
            fresh = (_tiered(name) if kind == "tiered" else
                     ge.get_embedding_variable(name, DIM, ev_option=_option(
                         ge.StorageOption())))
            ge.restore_tables(saved["tiered"], {"t": fresh})
            _assert_same_state(fresh, tiered)
    assert kinds == ["full", "delta", "delta"] * 2 + ["full"]
    assert (removed > 0) == (evict is not None)


def test_stress_many_steps_two_tables_shared_features():
    """60 steps over two tiered EVs (LFU with a CounterFilter, LRU with
    GlobalStepEvict), three features (two share a table), random and
    duplicate ids from a space 8x the GPU table, inference reads and
    evictions between steps: every step's outputs and the final state
    equal the whole-table HBM EVs bit for bit, nothing lost or doubled."""
    a = _evs("stress_a", ge.CacheStrategy.LFU, filter_freq=2)
    b = _evs("stress_b", ge.CacheStrategy.LRU,
             evict=ge.GlobalStepEvict(steps_to_live=15))
    feats = [_batches(100 + f, steps=60, rows=8, per_row=6) for f in range(3)]
    probe = tf.ragged.constant([list(SPACE[::7][:90])], tf.int64)
    outs, evicted = [], 0
    for i in (0, 1):
        opt = ge.optimizers.Adam(0.05)
        tables = [a[i], a[i], b[i]]
        got = []
        for step in range(60):
            ids = [feats[f][step] for f in range(3)]
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse(
                    tables, ids, ["sum", "mean", "sqrtn"])
                loss = tf.add_n([tf.reduce_sum(o * tf.cos(o)) for o in out])
            distinct = [a[i], b[i]]
            opt.apply(tape.gradient(loss, distinct), distinct)
            got.extend(o.numpy() for o in out)
            if step % 10 == 9:
                got.append(ge.group_embedding_lookup_sparse(
                    [a[i]], [probe], "mean", training=False)[0].numpy())
                got.append(np.array([int(b[i].evict())]))
                evicted += int(got[-1][0])
        outs.append(got)
    for g, w in zip(*outs):
        np.testing.assert_array_equal(g, w)
    assert evicted > 0
    for evs in (a, b):
        _assert_same_state(evs[0], evs[1])
        gpu, host = evs[0].storage.tier_sizes(evs[0].handle).numpy()
        assert gpu <= 128 < gpu + host


def test_a_lookup_waits_for_the_stream_a_fixed_number_of_times():
    """A training lookup of a group of K tiered EVs that all give keys up
    waits once to read the keys of every EV (their host tiers are not
    empty), once for the counters and every evicted count together, and
    once for all the records moving out and the pooling's error counts:
    3 for any K, counted by the host stand-in. An HBM EV's lookup waits
    once; the fused update of either kind never waits (its keys are the
    lookup's, and none has moved to host memory since)."""
    evs = [_evs(f"waits_{i}")[0] for i in range(3)]
    opt = ge.optimizers.SGD(0.1)
    for step in range(4):  # the tiers fill: each step brings 60 new keys
        ids = [tf.ragged.constant([list(SPACE[60 * step:60 * step + 60])],
                                  tf.int64) for _ in evs]
        with tf.GradientTape() as tape:
            out = ge.group_embedding_lookup_sparse(evs, ids, "sum")
            loss = tf.add_n([tf.reduce_sum(o) for o in out])
        opt.apply(tape.gradient(loss, evs), evs)
    assert all(ev.storage.tier_sizes(ev.handle).numpy()[1] > 0 for ev in evs)
    ids = [tf.ragged.constant([list(SPACE[300:360])], tf.int64) for _ in evs]
    before = gpu_kernel_library.host_stand_in_waits()
    ge.group_embedding_lookup_sparse(evs, ids, "sum")
    waits = gpu_kernel_library.host_stand_in_waits() - before
    # Each table gave 60 keys up: 300 keys, 128 on the GPU.
    assert all(list(ev.storage.tier_sizes(ev.handle).numpy()) == [128, 172]
               for ev in evs)
    assert waits == 3, waits

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            out = ge.group_embedding_lookup_sparse(evs, ids, "sum")
            loss = tf.add_n([tf.reduce_sum(o) for o in out])
        opt.apply(tape.gradient(loss, evs), evs)

    # A traced step of the same keys (on the GPU now, nothing moves): the
    # lookup reads the keys, the counters and the pooling's error counts;
    # the one update op of the three EVs does not wait.
    step(ids)
    before = gpu_kernel_library.host_stand_in_waits()
    step(ids)
    assert gpu_kernel_library.host_stand_in_waits() - before == 3
    # The same lookup on HBM EVs (no tier): the counters and the
    # pooling's error counts, read in one wait.
    whole = [_evs(f"waits_hbm_{i}")[1] for i in range(3)]
    before = gpu_kernel_library.host_stand_in_waits()
    ge.group_embedding_lookup_sparse(whole, ids, "sum")
    assert gpu_kernel_library.host_stand_in_waits() - before == 1
