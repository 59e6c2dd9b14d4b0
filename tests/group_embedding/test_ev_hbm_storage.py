"""EmbeddingVariables in GPU memory (StorageType.HBM), on the CUDA core's
host stand-in: this machine has no GPU, so `GROUP_EMBEDDING_HBM_ON_HOST=1`
runs the GPU op library built against the stand-in (same adaptor, same
core interface and placement rules; the GPU machine runs the CUDA core).

The oracle is a DRAM EV (the C++ CPU storage, its own lookup kernels and
sparse updates) given the same default matrix and the same batches: an
HBM EV must read the same rows and end with the same keys, frequencies
and versions (exactly) and the same rows and optimizer slots (to float
tolerance: the two paths compute a pooled row's gradient with different
but equivalent float expressions, the CPU kernel in C++, the HBM path as
the DRAM EV's TF path does, so the last bits may differ; without
duplicates or combiner scales the updates are bitwise equal, which one
case checks). Without a GPU and without the test hook, an HBM EV is an
error naming it. Checkpoints: an HBM EV writes the CPU EV's entries
(names, dtypes, shapes) and either kind restores the other's bitwise.
Eviction policies remove the keys the DRAM EV removes, when it removes
them; incremental saves write the DRAM EV's deltas (changed and removed
keys), and either chain restores bitwise into either kind.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import feature_column as ge_fc
from group_embedding import lookup_plan
from group_embedding.distributed import checkpoint as ge_checkpoint
from group_embedding.ops import backward_apply
from group_embedding.ops import capabilities
from group_embedding.ops import config
from group_embedding.ops import ev_storage
from group_embedding.ops import gpu_kernel_library

DIM = 4
DEFAULT_ROWS = 5
# No INT64_MIN: the HBM table reserves it for free slots (tested apart).
KEYS = np.array([-7, 0, 3, 11, 2**40 + 5, 2**63 - 1, -2**62, 12, 19, 40],
                np.int64)


@pytest.fixture
def hbm(monkeypatch):
    """HBM EVs run on the host stand-in for the test."""
    monkeypatch.setenv(config.HBM_ON_HOST, "1")


def _option(storage, filter_freq=0, no_permission=0.0, evict=None):
    return ge.EmbeddingVariableOption(
        init_option=ge.InitializerOption(
            default_value_dim=DEFAULT_ROWS,
            default_value_no_permission=no_permission),
        filter_option=(ge.CounterFilter(filter_freq) if filter_freq
                       else None),
        evict_option=evict,
        storage_option=storage)


def _pair(name, filter_freq=0, hbm_bytes=1 << 20, strategy=None,
          evict=None):
    """(HBM EV, DRAM EV) with the same default matrix."""
    init = tf.keras.initializers.RandomUniform(-1.0, 1.0, seed=7)
    out = []
    for kind, storage in (
            ("hbm", ge.StorageOption(ge.StorageType.HBM,
                                     storage_size=[hbm_bytes],
                                     cache_strategy=strategy)),
            ("dram", ge.StorageOption())):
        out.append(ge.get_embedding_variable(
            f"{name}_{kind}", DIM, initializer=init,
            ev_option=_option(storage, filter_freq, no_permission=0.25,
                              evict=evict)))
    out[1].default_values.assign(out[0].default_values)
    return out


def _batches(seed, steps, batch=6, weighted=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        rows = [list(rng.choice(KEYS, size=rng.integers(0, 5)))
                for _ in range(batch)]
        ids = tf.ragged.constant(rows, dtype=tf.int64,
                                 row_splits_dtype=tf.int64)
        w = None
        if weighted:
            w = tf.RaggedTensor.from_row_splits(
                tf.constant(rng.uniform(0.2, 2.0, ids.values.shape[0]),
                            tf.float32), ids.row_splits)
        out.append((ids, w))
    return out


def _state(ev):
    """Every key's state as numpy, sorted by key: keys, values, freqs,
    versions, slot names, slots [n, S * D], step."""
    keys, values, freqs, versions, names, _, slots, step = (
        x.numpy() for x in ev.storage.export(ev.handle, DIM))
    order = np.argsort(keys)
    return (keys[order], values[order], freqs[order], versions[order],
            list(names), slots[order], int(step))


def _assert_same_state(hbm_ev, dram_ev, exact=False, rtol=2e-6, atol=1e-7):
    got, want = _state(hbm_ev), _state(dram_ev)
    np.testing.assert_array_equal(got[0], want[0])   # keys
    np.testing.assert_array_equal(got[2], want[2])   # freqs
    np.testing.assert_array_equal(got[3], want[3])   # versions
    assert got[4] == want[4] and got[6] == want[6]   # slot names, step
    for g, w in ((got[1], want[1]), (got[5], want[5])):
        if exact:
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _train(ev, optimizer, batches, combiner, max_norm=None):
    outs = []
    for ids, w in batches:
        with tf.GradientTape() as tape:
            (out,) = ge.group_embedding_lookup_sparse(
                [ev], [ids], combiner, None if w is None else [w],
                max_norm=max_norm)
            loss = tf.reduce_sum(out * tf.sin(out + 1.0))
        optimizer.apply(tape.gradient(loss, [ev]), [ev])
        outs.append(out.numpy())
    return outs


# -- 34.2: the storage options and the refusal without a GPU ----------------
def test_storage_option_accepts_hbm_and_hbm_dram():
    hbm = ge.StorageOption(ge.StorageType.HBM)
    assert hbm.storage_size == [1 << 30] and hbm.hbm_bytes() == 1 << 30
    assert hbm.cache_strategy == ge.CacheStrategy.LFU and hbm.is_hbm()
    # Hashable (feature columns holding it are dict keys).
    assert hash(hbm) == hash(ge.StorageOption(ge.StorageType.HBM))
    both = ge.StorageOption(ge.StorageType.HBM_DRAM, storage_size=[4096],
                            cache_strategy=ge.CacheStrategy.LRU)
    assert both.hbm_bytes() == 4096 and not both.is_tiered()
    for opt in (hbm, both):
        again = ge.EmbeddingVariableOption.from_config(
            ge.EmbeddingVariableOption(storage_option=opt).get_config())
        assert again.storage_option == opt
    with pytest.raises(ValueError, match=r"\[hbm_bytes\].*HBM_DRAM"):
        ge.StorageOption(ge.StorageType.HBM_DRAM, storage_size=[0])
    with pytest.raises(NotImplementedError, match="HBM keeps no disk"):
        ge.StorageOption(ge.StorageType.HBM, storage_path="/tmp/x")
    with pytest.raises(NotImplementedError, match="LEVELDB"):
        ge.StorageOption(ge.StorageType.LEVELDB)


@pytest.mark.parametrize("kind", [ge.StorageType.HBM,
                                  ge.StorageType.HBM_DRAM])
def test_without_gpu_an_hbm_ev_is_an_error_naming_it(monkeypatch, kind):
    monkeypatch.setenv(config.HBM_ON_HOST, "0")
    monkeypatch.setattr(capabilities, "_hbm_support", {})
    monkeypatch.setattr(capabilities, "_snapshots", {})
    option = ge.EmbeddingVariableOption(
        storage_option=ge.StorageOption(kind))
    with pytest.raises(RuntimeError, match=r"'user_hbm'.*StorageType.HBM "
                                           r"needs the GPU kernels.*sees no "
                                           r"GPU"):
        ge.get_embedding_variable("user_hbm", DIM, ev_option=option)


def test_the_test_hook_is_checked(monkeypatch):
    monkeypatch.setenv(config.HBM_ON_HOST, "yes")
    with pytest.raises(ValueError, match=config.HBM_ON_HOST):
        config.hbm_on_host()


def test_what_hbm_tables_do_not_do_yet_is_an_error_naming_the_ev(hbm):
    for kind in (ge.StorageType.HBM, ge.StorageType.HBM_DRAM):
        option = ge.EmbeddingVariableOption(
            storage_option=ge.StorageOption(kind),
            filter_option=ge.CBFFilter(2, 10, 0.01))
        with pytest.raises(NotImplementedError, match="'todo'.*CBFFilter"):
            ge.get_embedding_variable("todo", DIM, ev_option=option)


def test_a_tensor_max_norm_names_the_ev_and_collective_mode_runs(
        hbm, monkeypatch):
    """A tensor max_norm is an error naming the HBM EV, never silently
    ignored; in collective mode the lookup goes to the collective runtime
    (whose owners use the HBM ops: tests/distributed)."""
    from group_embedding import model_parallel
    from group_embedding.lookup_plan import Backend
    from group_embedding.lookup_plan import TableKind
    ev = ge.get_embedding_variable("unsup", DIM, ev_option=_option(
        ge.StorageOption(ge.StorageType.HBM)))
    ids = tf.ragged.constant([[1, 2]], tf.int64)
    with pytest.raises(NotImplementedError,
                       match=r"unsup.*not a number >= 0"):
        ge.group_embedding_lookup_sparse([ev], [ids], "sum",
                                         max_norm=tf.constant(0.5))

    def never(*args, **kwargs):
        raise AssertionError("a sequence lookup was not asked for")

    planned = []

    def pooled(group, call):
        planned.append((group.kind, group.backend, group.names))
        return [tf.zeros([1, DIM])]

    saved = model_parallel.runtime()
    model_parallel.register(model_parallel.Runtime(
        rank=0, size=2, pooled_lookup=pooled, sequence_lookup=never,
        collective_table=None))
    try:
        ge.group_embedding_lookup_sparse([ev], [ids], "sum")
    finally:
        model_parallel.unregister()
        if saved is not None:
            model_parallel.register(saved)
    assert [(k, b) for k, b, _ in planned] == [
        (TableKind.HBM_EV, Backend.COLLECTIVE)]
    planned.clear()
    # Without a GPU (nor the stand-in), collective mode refuses the HBM EV
    # as a single process does, naming it.
    monkeypatch.setenv(config.HBM_ON_HOST, "0")
    monkeypatch.setattr(capabilities, "_hbm_support", {})
    monkeypatch.setattr(capabilities, "_snapshots", {})
    model_parallel.register(model_parallel.Runtime(
        rank=0, size=2, pooled_lookup=pooled, sequence_lookup=never,
        collective_table=None))
    try:
        with pytest.raises(RuntimeError, match=r"unsup.*sees no GPU"):
            ge.group_embedding_lookup_sparse([ev], [ids], "sum")
    finally:
        model_parallel.unregister()
        if saved is not None:
            model_parallel.register(saved)
    assert not planned


def _adagrad_decay(step):
    return ge.train.AdagradDecayOptimizer(
        0.1, step, initial_accumulator_value=0.2, accumulator_decay_step=2,
        accumulator_decay_rate=0.5)


def _adam_async(step):
    del step
    return ge.train.AdamAsyncOptimizer(0.05)


@pytest.mark.parametrize("tier", [ge.StorageType.HBM, ge.StorageType.HBM_DRAM])
@pytest.mark.parametrize("make", [_adagrad_decay, _adam_async])
def test_deeprec_ev_optimizers_equal_the_dram_ev(hbm, tier, make):
    """DeepRec's EV optimizers of `ge.train` (TF1) on an HBM / HBM_DRAM
    EV give the DRAM EV's rows and slots: AdagradDecay through the core's
    rule (decay power in element 0 of its second slot; a decay period of
    2 steps makes keys decay several times), AdamAsync through the core's
    Adam with its per-EV beta powers."""
    batches = _batches(71, steps=7)
    states = []
    for kind in ("hbm", "dram"):
        with tf.Graph().as_default():
            storage = (ge.StorageOption(tier, storage_size=[1])
                       if kind == "hbm" else ge.StorageOption())
            ev = ge.get_embedding_variable(
                "decay", DIM, initializer=tf.keras.initializers.RandomUniform(
                    -1.0, 1.0, seed=7),
                ev_option=_option(storage))
            values = tf.compat.v1.placeholder(tf.int64, [None])
            splits = tf.compat.v1.placeholder(tf.int64, [None])
            ids = tf.RaggedTensor.from_row_splits(values, splits)
            (out,) = ge.group_embedding_lookup_sparse([ev], [ids], "mean")
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = make(step)
            train = opt.minimize(tf.reduce_sum(out * tf.sin(out + 1.0)),
                                 global_step=step, var_list=[ev])
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for batch, _ in batches:
                    sess.run(train, {values: batch.values.numpy(),
                                     splits: batch.row_splits.numpy()})
                states.append(sess.run(ev.storage.export(ev.handle, DIM)))
    got, want = ([np.asarray(x) for x in st] for st in states)
    og, ow = np.argsort(got[0]), np.argsort(want[0])
    np.testing.assert_array_equal(got[0][og], want[0][ow])
    np.testing.assert_array_equal(got[2][og], want[2][ow])   # freqs
    np.testing.assert_array_equal(got[3][og], want[3][ow])   # versions
    assert list(got[4]) == list(want[4])                     # slot names
    for i in (1, 6):  # values, slots (accumulator, power)
        np.testing.assert_allclose(got[i][og], want[i][ow], rtol=2e-6,
                                   atol=1e-7)
    if make is _adagrad_decay:
        powers = want[6][ow][:, DIM]  # element 0 of the power slot
        assert powers.max() >= 2, powers


# -- 34.3: lookups and updates against the DRAM EV --------------------------
def test_plan_gives_hbm_evs_their_own_group_and_backend(hbm):
    hbm_ev, dram_ev = _pair("plan")
    # Pooled plans read no feature of an EV group.
    call = lookup_plan.LookupCall(mode=lookup_plan.Mode.POOLED)
    groups = lookup_plan.group_tables(
        [hbm_ev, dram_ev], [None, None], ["h", "d"], ["sum", "sum"], call,
        params_num_per_group=8)
    assert [(g.kind.value, g.backend.value) for g in groups] == [
        ("hbm_ev", "gpu_kernels"), ("ev", "cpu_kernels")]


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_lookup_and_adagrad_equal_the_dram_ev(hbm, combiner, weighted):
    hbm_ev, dram_ev = _pair(f"ada_{combiner}_{weighted}")
    batches = _batches(3 + weighted, steps=4, weighted=weighted)
    got = _train(hbm_ev, ge.optimizers.Adagrad(0.1), batches, combiner)
    want = _train(dram_ev, ge.optimizers.Adagrad(0.1), batches, combiner)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


@pytest.mark.parametrize("name,make", [
    ("sgd", lambda: ge.optimizers.SGD(0.2)),
    ("adam", lambda: ge.optimizers.Adam(0.05)),
    ("ftrl", lambda: ge.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                        l2_regularization_strength=0.02)),
])
def test_every_optimizer_equals_the_dram_ev(hbm, name, make):
    hbm_ev, dram_ev = _pair(f"opt_{name}")
    batches = _batches(11, steps=4)
    got = _train(hbm_ev, make(), batches, "mean")
    want = _train(dram_ev, make(), batches, "mean")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


def test_max_norm_equals_the_dram_ev(hbm):
    hbm_ev, dram_ev = _pair("clip")
    batches = _batches(5, steps=3, weighted=True)
    got = _train(hbm_ev, ge.optimizers.SGD(0.5), batches, "sqrtn", 0.3)
    want = _train(dram_ev, ge.optimizers.SGD(0.5), batches, "sqrtn", 0.3)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


def test_distinct_keys_with_sgd_are_bitwise_equal(hbm):
    """One key per row, no duplicates, sum: nothing is summed or scaled,
    so both paths do the same float operations."""
    hbm_ev, dram_ev = _pair("bitwise")
    ids = tf.ragged.constant([[k] for k in KEYS], tf.int64)
    batches = [(ids, None)] * 3
    got = _train(hbm_ev, ge.optimizers.SGD(0.5), batches, "sum")
    want = _train(dram_ev, ge.optimizers.SGD(0.5), batches, "sum")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    _assert_same_state(hbm_ev, dram_ev, exact=True)


def test_counter_filter_admission_and_duplicates(hbm):
    """CounterFilter(3): keys read no_permission for their first 3
    occurrences (counted per occurrence, duplicates in one batch read the
    same row), get no update until admitted, and are stamped anyway."""
    hbm_ev, dram_ev = _pair("filter", filter_freq=3)
    ids = tf.ragged.constant([[1, 1, 2], [1], [5, 5, 5, 5], []], tf.int64)
    batches = [(ids, None)] * 2 + _batches(2, steps=3)
    got = _train(hbm_ev, ge.optimizers.Adagrad(0.1), batches, "mean")
    want = _train(dram_ev, ge.optimizers.Adagrad(0.1), batches, "mean")
    # The first batch reads only no_permission rows.
    np.testing.assert_array_equal(got[0][:3], np.full((3, DIM), 0.25))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


@pytest.mark.parametrize("tier", ["hbm", "hbm_dram"])
def test_a_key_admitted_by_an_earlier_feature_of_the_call(hbm, tier):
    """CounterFilter(2), one EV read by three features of one lookup: a
    key counted once before and once by the first feature is admitted
    when the second reads it, which reads its row, as on the CPU EV
    (features read in order, each seeing the counts the ones before it
    raised). Before, the HBM table read every occurrence of the call as
    before the call: no_permission."""
    hbm_ev, dram_ev = _pair(f"earlier_{tier}", filter_freq=2)
    if tier == "hbm_dram":
        hbm_ev = ge.get_embedding_variable(
            "earlier_tiered", DIM, ev_option=_option(ge.StorageOption(
                ge.StorageType.HBM_DRAM, storage_size=[1]), filter_freq=2,
                no_permission=0.25))
        hbm_ev.default_values.assign(dram_ev.default_values)
    feats = [tf.ragged.constant([[7], [19]], tf.int64),
             tf.ragged.constant([[7, 19], [11]], tf.int64),
             tf.ragged.constant([[19], [11, 7]], tf.int64)]
    outs = []
    for ev in (hbm_ev, dram_ev):
        ev.lookup_rows(tf.constant([7, 11], tf.int64))  # counted once
        outs.append([o.numpy() for o in ge.group_embedding_lookup_sparse(
            [ev] * 3, feats, "sum")])
    got, want = outs
    # Feature 0 reads key 7 before counting it: no_permission.
    np.testing.assert_array_equal(want[0][0], np.full(DIM, 0.25))
    # Feature 1 reads 7's row (admitted by feature 0) + 19 (seen once).
    row7 = dram_ev.lookup_rows(tf.constant([7], tf.int64),
                               training=False).numpy()[0]
    np.testing.assert_allclose(want[1][0], row7 + 0.25, rtol=1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


@pytest.mark.parametrize("traced", [False, True])
def test_max_norm_gradient_of_a_key_admitted_by_its_lookup(hbm, traced):
    """CounterFilter(2) and max_norm 0.6: at its second lookup a key
    reads no_permission (norm 0.5: not clipped) and is admitted, so that
    step updates it with the upstream gradient, as the DRAM EV does. The
    fused update clipped at the stored row instead (norm 0.83 > 0.6):
    such updates go per key."""
    hbm_ev, dram_ev = _pair(f"mn_admit_{traced}", filter_freq=2)
    ids = tf.ragged.constant([[3]], tf.int64)
    upstream = tf.constant([[1.0, -2.0, 0.5, 3.0]])
    for ev in (hbm_ev, dram_ev):
        opt = ge.optimizers.SGD(1.0)

        def step(ev=ev, opt=opt):
            with tf.GradientTape() as tape:
                (out,) = ge.group_embedding_lookup_sparse(
                    [ev], [ids], "sum", max_norm=0.6)
                loss = tf.reduce_sum(out * upstream)
            opt.apply_gradients([(tape.gradient(loss, ev), ev)])

        run = tf.function(step) if traced else step
        run()
        init = _state(ev)[1][0].copy()
        assert np.linalg.norm(init) > 0.6
        run()
        np.testing.assert_allclose(init - _state(ev)[1][0], upstream[0],
                                   rtol=1e-6, atol=1e-6)
    _assert_same_state(hbm_ev, dram_ev)


def test_group_of_several_hbm_evs_with_a_shared_table(hbm):
    """Three features over two HBM EVs (one shared) in one fused op."""
    a, a_ref = _pair("grp_a")
    b, b_ref = _pair("grp_b")
    batches = _batches(8, steps=6)

    def run(tables):
        opt = ge.optimizers.Adagrad(0.1)
        outs = []
        for i in range(0, len(batches), 3):
            ids = [batches[i + j][0] for j in range(3)]
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse(
                    tables, ids, ["sum", "mean", "sqrtn"])
                loss = tf.add_n([tf.reduce_sum(o * o) for o in out])
            distinct = [tables[0], tables[2]]
            opt.apply(tape.gradient(loss, distinct), distinct)
            outs.append([o.numpy() for o in out])
        return outs

    got = run([a, a, b])
    want = run([a_ref, a_ref, b_ref])
    for gs, ws in zip(got, want):
        for g, w in zip(gs, ws):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(a, a_ref)
    _assert_same_state(b, b_ref)


def test_inference_reads_without_inserting(hbm):
    hbm_ev, dram_ev = _pair("infer")
    ids = tf.ragged.constant([[3, 4], [2**40 + 5]], tf.int64)
    for ev in (hbm_ev, dram_ev):
        ge.group_embedding_lookup_sparse([ev], [ids[:1]], "sum")
    got = ge.group_embedding_lookup_sparse([hbm_ev], [ids], "mean",
                                           training=False)[0]
    want = ge.group_embedding_lookup_sparse([dram_ev], [ids], "mean",
                                            training=False)[0]
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(hbm_ev.size()) == int(dram_ev.size()) == 2
    np.testing.assert_array_equal(hbm_ev.lookup_rows([3, 9]).numpy(),
                                  dram_ev.lookup_rows([3, 9]).numpy())


def test_traced_training_step_equals_the_dram_ev(hbm):
    hbm_ev, dram_ev = _pair("traced")
    batches = _batches(21, steps=3)

    def run(ev):
        opt = ge.optimizers.Adam(0.05)

        @tf.function
        def step(ids):
            with tf.GradientTape() as tape:
                (out,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
                loss = tf.reduce_sum(out * out)
            opt.apply(tape.gradient(loss, [ev]), [ev])
            return out

        return [step(ids).numpy() for ids, _ in batches]

    for g, w in zip(run(hbm_ev), run(dram_ev)):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


def _apply_ops(graph):
    """The GroupEmbeddingHbmEVApply nodes of a graph and of its functions:
    the number of EVs each updates."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sorted(n.attr["num_tables"].i for n in nodes
                  if n.op == "GroupEmbeddingHbmEVApply")


@pytest.mark.parametrize("name,make", [
    ("sgd", lambda: ge.optimizers.SGD(0.2)),
    ("adagrad", lambda: ge.optimizers.Adagrad(0.1)),
    ("adam", lambda: ge.optimizers.Adam(0.05)),
    ("ftrl", lambda: ge.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                        l2_regularization_strength=0.02)),
])
def test_a_lookups_evs_are_updated_by_one_op_without_a_wait(
        hbm, monkeypatch, name, make):
    """A traced step over three HBM EVs (three combiners, one weighted
    feature): the update is ONE op for the three EVs, the step waits for
    the stream once (the lookup's error counts), and every output, key,
    row, slot, freq and version is bitwise what one update op per EV
    gives, and equals the DRAM EVs."""
    pairs = [_pair(f"one_op_{name}_{i}") for i in range(3)]
    batches = [_batches(90 + i, steps=4, weighted=i == 1) for i in range(3)]

    def run(evs):
        opt = make()

        @tf.function
        def step(ids, w):
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse(
                    evs, ids, ["sum", "mean", "sqrtn"], [None, w, None])
                loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + 1.0))
                                 for o in out])
            opt.apply(tape.gradient(loss, evs), evs)
            return out

        outs, waits = [], []
        for b in range(4):
            ids = [batches[i][b][0] for i in range(3)]
            count = None
            if b > 0 and evs[0].storage is not ev_storage:
                count = gpu_kernel_library.host_stand_in_waits
                before = count()
            outs.append([o.numpy() for o in step(ids, batches[1][b][1])])
            if count is not None:
                waits.append(count() - before)
        graph = step.get_concrete_function(ids, batches[1][0][1]).graph
        return outs, waits, _apply_ops(graph)

    hbm_evs = [p[0] for p in pairs]
    got, waits, ops = run(hbm_evs)
    assert ops == [3] and waits == [1, 1, 1], (ops, waits)
    want, _, _ = run([p[1] for p in pairs])
    # FTRL's accumulators grow large: its last bits differ a little more.
    rtol, atol = (1e-5, 1e-6) if name == "ftrl" else (2e-6, 1e-7)
    for gs, ws in zip(got, want):
        for g, w in zip(gs, ws):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    for hbm_ev, dram_ev in pairs:
        _assert_same_state(hbm_ev, dram_ev, rtol=rtol, atol=atol)
    # One update op per EV: bitwise the same.
    monkeypatch.setattr(backward_apply, "_hbm_groups", lambda *a: [])
    apart = [_pair(f"apart_{name}_{i}")[0] for i in range(3)]
    alone, waits, ops = run(apart)
    assert ops == [1, 1, 1] and waits == [1, 1, 1], (ops, waits)
    for gs, ws in zip(got, alone):
        for g, w in zip(gs, ws):
            np.testing.assert_array_equal(g, w)
    for ev, other in zip(hbm_evs, apart):
        _assert_same_state(ev, other, exact=True)


def test_a_tf1_train_op_updates_a_lookups_evs_in_one_op(hbm):
    """`ge.train.AdagradOptimizer` in a TF1 graph: one update op for the
    lookup's three HBM EVs, one wait a step; the DRAM EVs' results."""
    batches = [_batches(95 + i, steps=3) for i in range(3)]
    states, ops, waits = [], [], []
    for kind in (0, 1):
        with tf.Graph().as_default() as graph:
            evs = [_pair(f"tf1_one_op_{i}")[kind] for i in range(3)]
            feeds, ids = [], []
            for _ in evs:
                values = tf.compat.v1.placeholder(tf.int64, [None])
                splits = tf.compat.v1.placeholder(tf.int64, [None])
                feeds.append((values, splits))
                ids.append(tf.RaggedTensor.from_row_splits(values, splits))
            out = ge.group_embedding_lookup_sparse(evs, ids, "mean")
            loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + 1.0)) for o in out])
            step = tf.compat.v1.train.get_or_create_global_step()
            train = ge.train.AdagradOptimizer(0.1).minimize(
                loss, global_step=step, var_list=evs)
            ops.append(_apply_ops(graph))
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for b in range(3):
                    feed = {}
                    for (values, splits), feature in zip(feeds, batches):
                        feed[values] = feature[b][0].values.numpy()
                        feed[splits] = feature[b][0].row_splits.numpy()
                    if kind == 0 and b > 0:
                        count = gpu_kernel_library.host_stand_in_waits
                        before = count()
                    sess.run(train, feed)
                    if kind == 0 and b > 0:
                        waits.append(count() - before)
                states.append([sess.run(ev.storage.export(ev.handle, DIM))
                               for ev in evs])
    assert ops == [[3], []] and waits == [1, 1], (ops, waits)
    for got, want in zip(*states):
        og, ow = np.argsort(got[0]), np.argsort(want[0])
        for i in (0, 2, 3):  # keys, freqs, versions
            np.testing.assert_array_equal(got[i][og], want[i][ow])
        for i in (1, 6):  # values, accumulators
            np.testing.assert_allclose(got[i][og], want[i][ow], rtol=2e-6,
                                       atol=1e-7)


def _run_steps(step, tables, batches):
    """Runs traced `step(ids, w)` on the features batches[i + 0..2] (the
    weights of the second) for i = 0, 3, 6, 9: the outputs and, for HBM
    EVs, the stream waits of each step after the first and the update
    ops of the trace (`_apply_ops`)."""
    outs, waits, ops = [], [], None
    for i in range(0, len(batches), 3):
        ids = [batches[i + j][0] for j in range(3)]
        on_gpu = i > 0 and tables[0].storage is not ev_storage
        count = gpu_kernel_library.host_stand_in_waits if on_gpu else None
        before = count() if count else 0
        outs.append([o.numpy() for o in step(ids, batches[i + 1][1])])
        if count:
            waits.append(count() - before)
    if waits:
        ops = _apply_ops(step.get_concrete_function(
            ids, batches[len(batches) - 2][1]).graph)
    return outs, waits, ops


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_sequence_lookups_equal_the_dram_ev(hbm, max_norm):
    """is_sequence=True: three features over two HBM EVs (one shared, one
    feature weighted), four traced Adagrad steps, then an inference read:
    the DRAM EVs' outputs and, after, their keys, rows and slots. Both
    EVs are updated by one op (the shared one's two features as one),
    and a step waits once (the lookup's counters)."""
    a, a_ref = _pair(f"seq_a_{max_norm}")
    b, b_ref = _pair(f"seq_b_{max_norm}")
    batches = _batches(61, steps=12, weighted=True)

    def run(tables):
        opt = ge.optimizers.Adagrad(0.1)
        distinct = tables[:2]

        @tf.function
        def step(ids, w):
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse(
                    tables, ids, "sum", [None, w, None], is_sequence=True,
                    max_norm=max_norm)
                loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + 1.0))
                                 for o in out])
            opt.apply(tape.gradient(loss, distinct), distinct)
            return out

        outs, waits, ops = _run_steps(step, tables, batches)
        if waits:
            assert ops == [2] and waits == [1, 1, 1], (ops, waits)
        read = ge.group_embedding_lookup_sparse(
            tables, [batches[0][0]] * 3, "sum", is_sequence=True,
            training=False, max_norm=max_norm)
        outs.append([o.numpy() for o in read])
        return outs

    got = run([a, b, a])
    want = run([a_ref, b_ref, a_ref])
    assert got[0][0].ndim == 3
    for gs, ws in zip(got, want):
        for g, w in zip(gs, ws):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(a, a_ref)
    _assert_same_state(b, b_ref)


@pytest.mark.parametrize("combiners", [["mean", "mean", "sqrtn"],
                                       ["sum", "mean", "sqrtn"]])
def test_an_ev_two_features_read_is_updated_once(hbm, combiners):
    """Three features over two HBM EVs, the first EV read by two features
    (one weighted), traced Adagrad steps. With one combiner, the shared
    EV's two features go to the one update op as one feature (one op,
    one wait a step); with two, its update is per key (its gradients
    joined, checked with a wait). The DRAM EVs' outputs and state."""
    tag = "_".join(combiners[:2])
    a, a_ref = _pair(f"twice_a_{tag}")
    b, b_ref = _pair(f"twice_b_{tag}")
    batches = _batches(23, steps=12, weighted=True)

    def run(tables):
        opt = ge.optimizers.Adagrad(0.1)
        distinct = [tables[0], tables[2]]

        @tf.function
        def step(ids, w):
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse(
                    tables, ids, combiners, [None, w, None])
                loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + 1.0))
                                 for o in out])
            opt.apply(tape.gradient(loss, distinct), distinct)
            return out

        return _run_steps(step, tables, batches)

    got, waits, ops = run([a, a, b])
    if combiners[0] == combiners[1]:
        assert ops == [2] and waits == [1, 1, 1], (ops, waits)
    else:
        assert ops == [1, 1] and waits == [2, 2, 2], (ops, waits)
    want, _, _ = run([a_ref, a_ref, b_ref])
    for gs, ws in zip(got, want):
        for g, w in zip(gs, ws):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(a, a_ref)
    _assert_same_state(b, b_ref)


def test_reserved_key_and_full_bucket_are_errors_naming_the_ev(hbm):
    (ev, _) = _pair("limits", hbm_bytes=1)  # one bucket of 128 keys
    assert ev.storage.capacity == 128
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="limits_hbm.*int64 min"):
        ge.group_embedding_lookup_sparse(
            [ev], [tf.ragged.constant([[-2**63]], tf.int64)], "sum")
    many = tf.ragged.constant([list(range(129))], tf.int64)
    with pytest.raises(tf.errors.ResourceExhaustedError,
                       match="limits_hbm.*could not store 1 keys"):
        ge.group_embedding_lookup_sparse([ev], [many], "sum")
    # A gradient given per key (not the lookup's own) is checked too.
    grad = tf.IndexedSlices(tf.ones([1, DIM]), tf.constant([-2**63],
                                                           tf.int64))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="limits_hbm.*int64 min"):
        ge.optimizers.SGD(0.1).apply([grad], [ev])


# -- 34.1: eviction policies, run when the CPU EV runs them -----------------
def _phased_batches():
    """Six steps: the first three see every key, the last three only the
    first four keys (the others age out under GlobalStepEvict)."""
    early = _batches(51, steps=3)
    few = KEYS[:4]
    rng = np.random.default_rng(52)
    late = [(tf.ragged.constant(
        [list(rng.choice(few, size=3)) for _ in range(4)], tf.int64), None)
        for _ in range(3)]
    return early + late


@pytest.mark.parametrize("evict", [
    ge.GlobalStepEvict(steps_to_live=2),
    ge.GlobalStepEvict(steps_to_live=1),
    ge.L2WeightEvict(l2_weight_threshold=0.3),
])
def test_explicit_evict_removes_what_the_dram_ev_removes(hbm, evict):
    """`ev.evict()` (the CPU EV's explicit eviction) after each step
    removes on the HBM EV exactly the keys the DRAM EV removes, and
    training goes on alike (evicted keys come back as new keys)."""
    hbm_ev, dram_ev = _pair(f"ev_{type(evict).__name__}_"
                            f"{getattr(evict, 'steps_to_live', 0)}",
                            evict=evict)
    removed = {"hbm": [], "dram": []}
    opts = {"hbm": ge.optimizers.Adagrad(0.1),
            "dram": ge.optimizers.Adagrad(0.1)}
    for batch in _phased_batches() + _batches(53, steps=2):
        for kind, ev in (("hbm", hbm_ev), ("dram", dram_ev)):
            _train(ev, opts[kind], [batch], "mean")
            removed[kind].append(int(ev.evict()))
        _assert_same_state(hbm_ev, dram_ev)
    assert removed["hbm"] == removed["dram"]
    assert sum(removed["hbm"]) > 0, removed  # the case evicts something


def test_an_ev_without_policy_evicts_nothing(hbm):
    hbm_ev, dram_ev = _pair("ev_none")
    _train(hbm_ev, ge.optimizers.SGD(0.1), _batches(1, steps=2), "sum")
    assert int(hbm_ev.evict()) == 0 and int(hbm_ev.size()) > 0
    del dram_ev


@pytest.mark.parametrize("saver", ["checkpoint", "v1"])
def test_save_runs_the_policy_as_the_dram_ev_does(hbm, tmp_path, saver):
    """The CPU EV evicts just before each save (tf.train.Checkpoint and
    the v1 Saver): the HBM EV does too, and both checkpoints hold the
    same keys."""
    evict = ge.GlobalStepEvict(steps_to_live=1)
    batches = _phased_batches()
    states = []
    for kind in ("hbm", "dram"):
        name = f"evsave_{saver}_{kind}"
        storage = (ge.StorageOption(ge.StorageType.HBM,
                                    storage_size=[1 << 20])
                   if kind == "hbm" else ge.StorageOption())
        option = _option(storage, evict=evict)
        init = tf.keras.initializers.RandomUniform(-1.0, 1.0, seed=7)
        path = str(tmp_path / kind)
        if saver == "checkpoint":
            ev = ge.get_embedding_variable(name, DIM, initializer=init,
                                           ev_option=option)
            _train(ev, ge.optimizers.SGD(0.1), batches, "sum")
            before = int(ev.size())
            written = tf.train.Checkpoint(ev=ev).write(path)
            assert int(ev.size()) < before  # the save evicted
            states.append((_state(ev), written))
            continue
        with tf.Graph().as_default():
            ev = ge.get_embedding_variable(name, DIM, initializer=init,
                                           ev_option=option)
            ids = tf.compat.v1.placeholder(tf.int64, [None])
            splits = tf.compat.v1.placeholder(tf.int64, [None])
            (out,) = ge.group_embedding_lookup_sparse(
                [ev], [tf.RaggedTensor.from_row_splits(ids, splits)], "sum")
            grads = tf.gradients(tf.reduce_sum(out * out), [ev.handle])
            step = tf.compat.v1.train.get_or_create_global_step()
            train = ge.train.GradientDescentOptimizer(0.1).apply_gradients(
                [(grads[0], ev)], global_step=step)
            saver_ = tf.compat.v1.train.Saver([ev])
            export = ev.storage.export(ev.handle, DIM)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for batch, _ in batches:
                    sess.run(train, {ids: batch.values.numpy(),
                                     splits: batch.row_splits.numpy()})
                written = saver_.save(sess, path)
                got = sess.run(export)
            order = np.argsort(got[0])
            states.append(((got[0][order],), written))
    (hbm_state, hbm_path), (dram_state, dram_path) = states
    np.testing.assert_array_equal(hbm_state[0], dram_state[0])
    reader_h = tf.train.load_checkpoint(hbm_path)
    reader_d = tf.train.load_checkpoint(dram_path)
    suffix = ("ev/.ATTRIBUTES/keys" if saver == "checkpoint" else "-keys")
    h_keys = [k for k in reader_h.get_variable_to_shape_map()
              if k.endswith(suffix)]
    d_keys = [k for k in reader_d.get_variable_to_shape_map()
              if k.endswith(suffix)]
    assert len(h_keys) == len(d_keys) == 1
    np.testing.assert_array_equal(
        np.sort(reader_h.get_tensor(h_keys[0])),
        np.sort(reader_d.get_tensor(d_keys[0])))
    np.testing.assert_array_equal(np.sort(reader_h.get_tensor(h_keys[0])),
                                  hbm_state[0])


# -- 34.4: checkpoints in the CPU EV's format, restored into either kind -----
def _checkpoint_entries(path):
    """{checkpoint key: (dtype, shape)} of a checkpoint, without the
    object graph (which names the saving program's Python objects)."""
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    return {k: (dtype, tuple(shapes[k]))
            for k, dtype in reader.get_variable_to_dtype_map().items()
            if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


def _fresh(kind, name):
    storage = (ge.StorageOption(ge.StorageType.HBM, storage_size=[1 << 20])
               if kind == "hbm" else ge.StorageOption())
    return ge.get_embedding_variable(name, DIM, ev_option=_option(
        storage, filter_freq=2, no_permission=0.25))


def _assert_exact_state(a, b):
    sa, sb = _state(a), _state(b)
    for x, y in zip(sa, sb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("saved,restored", [("hbm", "dram"), ("dram", "hbm"),
                                            ("hbm", "hbm")])
def test_checkpoint_format_and_restore_both_ways(hbm, tmp_path, saved,
                                                 restored):
    hbm_ev, dram_ev = _pair(f"ck_{saved}_{restored}", filter_freq=2)
    batches = _batches(31, steps=4)
    opts = [ge.optimizers.Adam(0.05), ge.optimizers.Adam(0.05)]
    for ev, opt in zip((hbm_ev, dram_ev), opts):
        _train(ev, opt, batches, "mean")
    paths = {kind: tf.train.Checkpoint(ev=ev).write(str(tmp_path / kind))
             for kind, ev in (("hbm", hbm_ev), ("dram", dram_ev))}
    # The same entries (names, dtypes, shapes) whichever kind saved.
    assert _checkpoint_entries(paths["hbm"]) == _checkpoint_entries(
        paths["dram"])
    source = hbm_ev if saved == "hbm" else dram_ev
    target = _fresh(restored, f"ck_{saved}_{restored}_into")
    tf.train.Checkpoint(ev=target).read(paths[saved]).assert_consumed()
    # Bitwise: keys, rows, slots, freqs, versions, step and the default
    # matrix.
    _assert_exact_state(target, source)
    np.testing.assert_array_equal(target.default_values.numpy(),
                                  source.default_values.numpy())
    # Training continues alike (Adam's moments restored with the keys).
    more = _batches(32, steps=2)
    opt_a, opt_b = ge.optimizers.Adam(0.05), ge.optimizers.Adam(0.05)
    for opt in (opt_a, opt_b):
        opt.iterations.assign(4)
    got = _train(target, opt_a, more, "sum")
    want = _train(source, opt_b, more, "sum")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(target, source)


@pytest.mark.parametrize("tier", ["hbm", "hbm_dram"])
def test_a_checkpoint_older_than_the_optimizer_keeps_its_slots(
        hbm, tmp_path, tier):
    """Rewinding to a checkpoint written before the optimizer built its
    slots (or with fewer of them) keeps the table's slots, every key's
    entry their initial value, as the CPU EV's import does; training goes
    on alike. Before, the HBM import dropped them: the next step failed
    ("optimizer slot 'adam/m' was not created")."""
    hbm_ev, dram_ev = _pair(f"older_{tier}")
    if tier == "hbm_dram":
        hbm_ev = ge.get_embedding_variable(
            "older_tiered", DIM, ev_option=_option(ge.StorageOption(
                ge.StorageType.HBM_DRAM, storage_size=[1])))
        hbm_ev.default_values.assign(dram_ev.default_values)
    evs = (hbm_ev, dram_ev)
    early = _batches(41, steps=2)
    sgd = [ge.optimizers.SGD(0.1) for _ in evs]
    for ev, opt in zip(evs, sgd):
        _train(ev, opt, early, "sum")  # keys, no slots
    paths = [tf.train.Checkpoint(ev=ev).write(str(tmp_path / f"e{i}"))
             for i, ev in enumerate(evs)]
    adam = [ge.optimizers.Adam(0.05) for _ in evs]
    for ev, opt in zip(evs, adam):
        _train(ev, opt, _batches(42, steps=3), "mean")
    for ev, path in zip(evs, paths):
        tf.train.Checkpoint(ev=ev).read(path).assert_consumed()
    state = _state(hbm_ev)
    assert state[4] == [b"adam/m", b"adam/v"] == _state(dram_ev)[4]
    assert np.all(state[5] == 0.0)  # Adam's initial moments
    _assert_same_state(hbm_ev, dram_ev)
    got, want = (_train(ev, opt, _batches(43, steps=3), "sum")
                 for ev, opt in zip(evs, adam))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
    _assert_same_state(hbm_ev, dram_ev)


def test_v1_saver_names_and_restores_an_hbm_ev(hbm, tmp_path):
    """A TF1 graph's Saver writes DeepRec's `<name>-keys`, ... for an HBM
    EV, and a DRAM EV of the same name restores them."""
    keys = np.array([5, -3, 5, 2**40], np.int64)
    path = str(tmp_path / "v1")
    states = []
    for kind in ("hbm", "dram"):
        with tf.Graph().as_default():
            ev = _fresh(kind, "v1_ev")
            ids = tf.RaggedTensor.from_row_splits(
                tf.constant(keys), tf.constant([0, 2, 4], tf.int64))
            (out,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
            grads = tf.gradients(tf.reduce_sum(out * out), [ev.handle])
            train = ge.train.GradientDescentOptimizer(0.1).apply_gradients(
                [(grads[0], ev)])
            saver = tf.compat.v1.train.Saver()
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                if kind == "hbm":
                    for _ in range(3):
                        sess.run(train)
                    saver.save(sess, path)
                else:
                    saver.restore(sess, path)
                states.append([x for x in sess.run(
                    ev.storage.export(ev.handle, DIM))])
    names = set(_checkpoint_entries(path))
    assert {"v1_ev-keys", "v1_ev-values", "v1_ev-freqs", "v1_ev-versions",
            "v1_ev/default_values"} <= names
    (hk, *hrest), (dk, *drest) = states
    ho, do = np.argsort(hk), np.argsort(dk)
    np.testing.assert_array_equal(hk[ho], dk[do])
    for i in (0, 1, 2):  # values, freqs, versions
        np.testing.assert_array_equal(hrest[i][ho], drest[i][do])


def test_feature_columns_with_hbm_evs_fit_like_dram_evs(hbm):
    """`group_embedding_column_scope` + `GroupEmbeddingFeatures` in a
    Keras model trained by `model.fit`: HBM EV columns give the DRAM EV
    columns' losses, rows and sizes, and a fit step waits for the stream
    once (its update of both EVs is one op that does not wait)."""
    rng = np.random.default_rng(0)
    uid = rng.integers(0, 6, 32)
    city = rng.choice(["sf", "ny", "la"], 32)
    y = ((uid % 2 == 0) ^ (city == "sf")).astype("float32")[:, None]
    ds = tf.data.Dataset.from_tensor_slices(
        ({"uid": uid, "city": city}, y)).batch(8)
    results = []
    for kind in ("hbm", "dram"):
        storage = (ge.StorageOption(ge.StorageType.HBM,
                                    storage_size=[1 << 16])
                   if kind == "hbm" else ge.StorageOption())
        option = ge.EmbeddingVariableOption(
            init_option=ge.InitializerOption(
                initializer=tf.keras.initializers.RandomUniform(
                    -0.5, 0.5, seed=1), default_value_dim=7),
            storage_option=storage)
        with ge_fc.group_embedding_column_scope(f"fc_{kind}"):
            cols = [ge_fc.embedding_column(
                        ge_fc.categorical_column_with_embedding(
                            "uid", dtype=tf.int64, ev_option=option), 4,
                        "sum"),
                    ge_fc.embedding_column(
                        ge_fc.categorical_column_with_embedding(
                            "city", ev_option=option), 4)]
        features = ge_fc.GroupEmbeddingFeatures(cols)
        inputs = {"uid": keras.Input((), dtype="int64", name="uid"),
                  "city": keras.Input((), dtype="string", name="city")}
        out = keras.layers.Dense(
            1, kernel_initializer=keras.initializers.Constant(0.2))(
                features(inputs))
        model = keras.Model(inputs, out)
        model.compile(optimizer=ge.optimizers.Adagrad(0.3), loss="mse")
        losses = model.fit(ds, epochs=4, verbose=0).history["loss"]
        # A fit step updates both EVs in one op: it waits once, as an
        # evaluate step does (4 batches).
        count = (gpu_kernel_library.host_stand_in_waits if kind == "hbm"
                 else None)
        waits = []
        for run in (lambda: model.evaluate(ds, verbose=0),
                    lambda: model.fit(ds, epochs=1, verbose=0)):
            before = count() if count else 0
            run()
            if count:
                waits.append(count() - before)
        assert waits == ([4, 4] if count else []), waits
        evs = features.embedding_variables
        assert [ev.ge_table_kind for ev in evs] == (
            ["hbm_ev"] * 2 if kind == "hbm" else ["ev"] * 2)
        results.append((losses, [_state(ev) for ev in evs]))
    (got_losses, got), (want_losses, want) = results
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g[0], w[0])  # keys
        np.testing.assert_array_equal(g[2], w[2])  # freqs
        np.testing.assert_allclose(g[1], w[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("traced", [False, True])
def test_untouched_gradients_take_the_fused_backward_apply(hbm, monkeypatch,
                                                           traced):
    """An optimizer applying the lookup's own slices runs the fused
    backward-apply (the feature's ids and pooled gradient into one core
    update); slices changed on the way (here scaled by 1) take the
    per-key update. Both equal the DRAM EV."""
    found = []
    real = backward_apply.hbm_forward_of

    def spy(keys, values):
        forward = real(keys, values)
        found.append(forward is not None)
        return forward

    monkeypatch.setattr(backward_apply, "hbm_forward_of", spy)
    batches = _batches(41, steps=3, weighted=True)
    for scale in (None, 1.0):
        hbm_ev, dram_ev = _pair(f"fused_{traced}_{scale}")
        outs = []
        for ev in (hbm_ev, dram_ev):
            opt = ge.optimizers.Adagrad(0.1)

            def step(ids, w, ev=ev, opt=opt):
                with tf.GradientTape() as tape:
                    (out,) = ge.group_embedding_lookup_sparse(
                        [ev], [ids], "sqrtn", [w], max_norm=0.4)
                    loss = tf.reduce_sum(out * tf.sin(out + 1.0))
                (g,) = tape.gradient(loss, [ev])
                if scale is not None:
                    g = tf.IndexedSlices(g.values * scale, g.indices)
                opt.apply([g], [ev])
                return out

            run = tf.function(step) if traced else step
            outs.append([run(ids, w).numpy() for ids, w in batches])
        for g, w in zip(*outs):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)
        _assert_same_state(hbm_ev, dram_ev)
        assert found and all(found) == (scale is None), (scale, found)
        found.clear()


# -- 34.4: incremental checkpoints (save_tables(..., full_every=K)) ----------
def _shard(path):
    return dict(np.load(f"{path}/shard-0-of-1.npz"))


def _kind(path):
    import json
    with open(f"{path}/{ge_checkpoint.MANIFEST}") as f:
        return json.load(f)["kind"]


def _by_key(shard, field):
    order = np.argsort(shard["t/keys"])
    return shard[f"t/{field}"][order]


@pytest.mark.parametrize("evict,every,filter_freq", [
    (None, 1, 0), (ge.GlobalStepEvict(steps_to_live=2), 1, 0),
    (ge.GlobalStepEvict(steps_to_live=1), 2, 2),
    (ge.L2WeightEvict(l2_weight_threshold=0.3), 1, 0)])
def test_incremental_deltas_equal_the_dram_evs(hbm, tmp_path, evict, every,
                                               filter_freq):
    """A DRAM EV and an HBM EV trained on the same ids, saved every
    `every` steps with full_every=3: each save is full or a delta alike,
    a delta holds the same changed keys (rows, slots, freqs, versions)
    and the same removed keys (also keys inserted and evicted between two
    saves), and either chain restores bitwise into a fresh EV of either
    kind (under a CounterFilter too)."""
    tag = f"{type(evict).__name__}_{every}"
    hbm_ev, dram_ev = _pair(f"inc_{tag}", evict=evict,
                            filter_freq=filter_freq)
    opts = {"hbm": ge.optimizers.Adagrad(0.1),
            "dram": ge.optimizers.Adagrad(0.1)}
    evs = {"hbm": hbm_ev, "dram": dram_ev}
    batches = _phased_batches() + _batches(61, steps=2)
    kinds, removed = [], 0
    for step, batch in enumerate(batches, 1):
        saved = {}
        for kind, ev in evs.items():
            _train(ev, opts[kind], [batch], "mean")
        if step % every:
            continue
        for kind, ev in evs.items():
            saved[kind] = ge.save_tables(str(tmp_path / kind), {"t": ev},
                                         step, full_every=3)
        assert _kind(saved["hbm"]) == _kind(saved["dram"])
        kinds.append(_kind(saved["hbm"]))
        got, want = _shard(saved["hbm"]), _shard(saved["dram"])
        assert sorted(got) == sorted(want)
        np.testing.assert_array_equal(np.sort(got["t/keys"]),
                                      np.sort(want["t/keys"]))
        for field in ("freqs", "versions"):
            np.testing.assert_array_equal(_by_key(got, field),
                                          _by_key(want, field))
        for field in ("values", "slots"):
            np.testing.assert_allclose(_by_key(got, field),
                                       _by_key(want, field),
                                       rtol=2e-6, atol=1e-7)
        if kinds[-1] == "delta":
            np.testing.assert_array_equal(np.sort(got["t/removed"]),
                                          np.sort(want["t/removed"]))
            removed += got["t/removed"].size
        # The chain restores bitwise into either kind.
        for source in ("hbm", "dram"):
            for target in ("hbm", "dram"):
                fresh = _fresh(target, f"inc_{tag}_{step}_{source}_"
                                       f"{target}")
                ge.restore_tables(saved[source], {"t": fresh})
                _assert_exact_state(fresh, evs[source])
    assert kinds == (["full", "delta", "delta"] * 3)[:len(batches) // every]
    assert (removed > 0) == (evict is not None)


def _train_one_row(ev, opt, keys):
    """One step on one bag of `keys` (sum)."""
    _train(ev, opt, [(tf.ragged.constant([keys], tf.int64), None)], "sum")


def test_keys_inserted_and_evicted_between_saves_are_removed(hbm,
                                                            tmp_path):
    """GlobalStepEvict(1), saves at steps 2 and 5: keys first seen at
    step 3 and evicted at the second save are listed as removed (as the
    DRAM EV lists them), next to the base's keys evicted."""
    hbm_ev, dram_ev = _pair("inc_between",
                            evict=ge.GlobalStepEvict(steps_to_live=1))
    rows = [KEYS[:5], KEYS[:5], KEYS[5:8], KEYS[:2], KEYS[:2]]
    removed = {}
    for kind, ev in (("hbm", hbm_ev), ("dram", dram_ev)):
        opt = ge.optimizers.SGD(0.1)
        for step, keys in enumerate(rows, 1):
            _train_one_row(ev, opt, keys)
            if step in (2, 5):
                path = ge.save_tables(str(tmp_path / kind), {"t": ev}, step,
                                      full_every=3)
        assert _kind(path) == "delta"
        removed[kind] = np.sort(_shard(path)["t/removed"])
    np.testing.assert_array_equal(removed["hbm"], removed["dram"])
    assert set(KEYS[2:8].tolist()) == set(removed["hbm"].tolist())


def test_empty_tables_and_everything_evicted_make_deltas(hbm, tmp_path):
    """An empty table saves (full, then an empty delta), and a delta after
    the policy removed every key lists them all as removed, as the DRAM
    EV's does."""
    hbm_ev, dram_ev = _pair("inc_empty",
                            evict=ge.L2WeightEvict(l2_weight_threshold=1e9))
    got = {}
    for kind, ev in (("hbm", hbm_ev), ("dram", dram_ev)):
        where = str(tmp_path / kind)
        paths = [ge.save_tables(where, {"t": ev}, 1, full_every=5),
                 ge.save_tables(where, {"t": ev}, 2, full_every=5)]
        ev.lookup_rows(tf.constant(KEYS[:4]))
        # The whole-table export keeps them (no policy runs there); the
        # incremental save evicts them all.
        paths.append(ge.save_tables(where, {"t": ev}, 3, full_every=5))
        assert int(ev.size()) == 0
        got[kind] = [(_kind(p), np.sort(_shard(p)["t/keys"]),
                      np.sort(_shard(p).get("t/removed", np.zeros(0))))
                     for p in paths]
    for (hk, hkeys, hrem), (dk, dkeys, drem) in zip(got["hbm"], got["dram"]):
        assert hk == dk
        np.testing.assert_array_equal(hkeys, dkeys)
        np.testing.assert_array_equal(hrem, drem)
    assert [k for k, _, _ in got["hbm"]] == ["full", "delta", "delta"]
    assert set(got["hbm"][2][2].tolist()) == set(KEYS[:4].tolist())


def test_failed_save_keeps_its_evicted_keys_for_the_next_delta(
        hbm, tmp_path, monkeypatch):
    """The save that fails has already evicted: the next delta lists
    those keys as removed (the base's, and keys first seen after it), as
    the DRAM EV's does."""
    hbm_ev, dram_ev = _pair("inc_fail_evict",
                            evict=ge.GlobalStepEvict(steps_to_live=1))
    rows = [KEYS[:6], np.concatenate([KEYS[6:8], KEYS[:2]]), KEYS[:2],
            KEYS[:2], KEYS[:2]]
    real = np.savez

    def full_disk(*args, **kwargs):
        raise OSError("disk full (simulated)")

    removed = {}
    for kind, ev in (("hbm", hbm_ev), ("dram", dram_ev)):
        opt = ge.optimizers.SGD(0.1)
        for step, keys in enumerate(rows, 1):
            _train_one_row(ev, opt, keys)
            if step == 4:  # evicts KEYS[2:8], then fails
                monkeypatch.setattr(np, "savez", full_disk)
                with pytest.raises(RuntimeError, match="disk full"):
                    ge.save_tables(str(tmp_path / kind), {"t": ev}, step,
                                   full_every=5)
                monkeypatch.setattr(np, "savez", real)
            elif step in (1, 5):
                path = ge.save_tables(str(tmp_path / kind), {"t": ev}, step,
                                      full_every=5)
        assert _kind(path) == "delta"
        removed[kind] = np.sort(_shard(path)["t/removed"])
        fresh = _fresh("dram", f"inc_fail_evict_{kind}_into")
        ge.restore_tables(path, {"t": fresh})
        _assert_exact_state(fresh, ev)
    np.testing.assert_array_equal(removed["hbm"], removed["dram"])
    assert set(KEYS[2:8].tolist()) == set(removed["hbm"].tolist())


def test_failed_hbm_delta_loses_no_changes(hbm, tmp_path, monkeypatch):
    """A save that fails before its confirmation moves no base: the next
    delta holds the failed save's changes too."""
    ev, _ = _pair("inc_fail")
    ev.lookup_rows(tf.constant(KEYS[:6]))
    first = ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    ev.lookup_rows(tf.constant(KEYS[1:3]))

    def full_disk(*args, **kwargs):
        raise OSError("disk full (simulated)")

    real = np.savez
    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(RuntimeError, match="disk full"):
        ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    monkeypatch.setattr(np, "savez", real)
    assert ge_checkpoint.latest_checkpoint(str(tmp_path)) == first
    ev.lookup_rows(tf.constant(KEYS[8:9]))
    second = ge.save_tables(str(tmp_path), {"t": ev}, 2, full_every=5)
    assert _kind(second) == "delta"
    assert sorted(_shard(second)["t/keys"]) == sorted(
        KEYS[1:3].tolist() + KEYS[8:9].tolist())
    # Nothing changed since: an empty delta.
    third = ge.save_tables(str(tmp_path), {"t": ev}, 3, full_every=5)
    assert _kind(third) == "delta" and _shard(third)["t/keys"].size == 0
    fresh = _fresh("dram", "inc_fail_into")
    ge.restore_tables(third, {"t": fresh})
    _assert_exact_state(fresh, ev)


def test_hbm_delta_after_restore_and_new_slot(hbm, tmp_path):
    """A restore makes the restored content the next delta's base; a new
    optimizer slot forces a full save (as on the CPU EV); a stale `since`
    is an error naming the EV."""
    ev, _ = _pair("inc_slots")
    ev.lookup_rows(tf.constant(KEYS[:5]))
    ge.save_tables(str(tmp_path), {"t": ev}, 1, full_every=5)
    again = _fresh("hbm", "inc_slots_again")
    ge.restore_tables(str(tmp_path), {"t": again})
    again.lookup_rows(tf.constant(KEYS[7:9]))
    second = ge.save_tables(str(tmp_path), {"t": again}, 2, full_every=5)
    assert _kind(second) == "delta"
    assert sorted(_shard(second)["t/keys"]) == sorted(KEYS[7:9].tolist())
    again.ensure_slot("adam/m", 0.0)
    assert _kind(ge.save_tables(str(tmp_path), {"t": again}, 3,
                                full_every=5)) == "full"
    with pytest.raises(tf.errors.FailedPreconditionError,
                       match="inc_slots_again.*since=0"):
        again.storage.export_changes(again.handle, DIM, 12345)
