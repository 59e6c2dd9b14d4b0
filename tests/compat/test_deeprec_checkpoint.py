"""DeepRec / Deepray checkpoints in (`ge.restore_deeprec_checkpoint`, and
`tf.train.Saver().restore` under compat).

Oracles: checkpoints written by Deepray 0.21.89 (DeepRec's EV code on
TF 2.15) and the expected.json beside each, produced by
`deeprec_checkpoints/make_checkpoint.py` (see its README): every key's
row, slots, freq and version after 3 steps, checked there against the live
Deepray EVs and an independent numpy model; and the losses Deepray's model
gave for 2 more steps after the save, with the state after them.
`deepray_adagrad/model.*` and its expected.json are the checkpoint shipped
in `../shared/peers/deepray/`.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.deeprec import checkpoint as deeprec_checkpoint
from group_embedding.ops import config
from group_embedding.ops import ev_storage

DATA = os.path.join(os.path.dirname(__file__), "deeprec_checkpoints")
FEATURES = ["user_ev", "item_ev"]
CASES = ["deepray_adagrad", "deepray_adam_part2", "deepray_ftrl_part3"]
# The storage's slot names of each optimizer's slots in expected.json.
SLOT_NAMES = {"adagrad": {"accumulator": "adagrad/accumulator"},
              "adam": {"m": "adam/m", "v": "adam/v"},
              "ftrl": {"accumulator": "ftrl/accumulator",
                       "linear": "ftrl/linear"}}


def _expected(case):
    with open(os.path.join(DATA, case, "expected.json")) as fh:
        exp = json.load(fh)
    exp["config"].setdefault("optimizer", "adagrad")
    path = os.path.join(DATA, case, "continuation.json")
    if os.path.exists(path):   # the shipped checkpoint's expected.json
        with open(path) as fh:
            exp["continuation"] = json.load(fh)["continuation"]
    return exp


def _slots_of(entry):
    """{slot: row} of a key in expected.json (the shipped file names the
    Adagrad accumulator "accumulator")."""
    if entry.get("slots") is not None:
        return entry["slots"]
    if entry.get("accumulator") is not None:
        return {"accumulator": entry["accumulator"]}
    return None


def _make_evs(cfg, storage_dir=None, hbm=False):
    """The fixture's EVs; with `storage_dir`, DRAM_SSDHASH EVs whose DRAM
    tier holds a few rows (most keys on disk); with `hbm`, StorageType.HBM
    EVs."""
    init = np.array(cfg["init_table"], np.float32)
    evs = {}
    for f in FEATURES:
        freq = cfg["filter_freq"][f]
        storage = ge.StorageOption() if storage_dir is None else \
            ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                             storage_path=os.path.join(storage_dir, f),
                             # The disk index (768 bytes while small)
                             # and two rows with two slots.
                             storage_size=[768 + 2 * (36 + 12 * cfg["dim"])])
        if hbm:
            storage = ge.StorageOption(ge.StorageType.HBM,
                                       storage_size=[1 << 20])
        evs[f] = ge.get_embedding_variable(
            f, cfg["dim"], ev_option=ge.EmbeddingVariableOption(
                filter_option=ge.CounterFilter(freq) if freq else None,
                init_option=ge.InitializerOption(
                    initializer=tf.constant_initializer(init),
                    default_value_dim=cfg["default_value_dim"]),
                storage_option=storage))
    return evs


def _make_optimizer(cfg):
    kind = cfg["optimizer"]
    if kind == "adagrad":   # Deepray's Adagrad has no epsilon
        return ge.optimizers.Adagrad(
            cfg["lr"], initial_accumulator_value=cfg["init_acc"],
            epsilon=0.0)
    if kind == "adam":
        return ge.optimizers.Adam(cfg["lr"], beta_1=cfg["beta1"],
                                  beta_2=cfg["beta2"],
                                  epsilon=cfg["adam_epsilon"])
    return ge.optimizers.Ftrl(cfg["lr"],
                              initial_accumulator_value=cfg["init_acc"])


def _contents(ev):
    """key -> (row, {slot: row}, freq, version) from the EV's storage."""
    t = {k: v.numpy() for k, v in ev._serialize_to_tensors().items()}
    names = [n.decode() for n in t["slot_names"]]
    d = ev.embedding_dim
    out = {}
    for i, k in enumerate(t["keys"]):
        slots = {n: t["slots"][i, j * d:(j + 1) * d]
                 for j, n in enumerate(names)}
        out[int(k)] = (t["values"][i], slots, int(t["freqs"][i]),
                       int(t["versions"][i]))
    return out


def _check_state(evs, keys, cfg, atol, versions=True):
    """Every key of expected.json's `keys` section: admitted keys' rows and
    slots, every key's freq and version, and what a lookup reads."""
    names = SLOT_NAMES[cfg["optimizer"]]
    for f in FEATURES:
        got = _contents(evs[f])
        assert sorted(got) == sorted(int(k) for k in keys[f]), f
        for k, e in keys[f].items():
            row, slots, freq, version = got[int(k)]
            assert freq == e["freq"], (f, k)
            if versions:
                # The storage keeps steps >= 0: Deepray's FTRL stamps none
                # (-1), which reads 0 here.
                assert version == max(e["version"], 0), (f, k)
            (lookup,) = ge.group_embedding_lookup_sparse(
                [evs[f]], [tf.ragged.constant([[int(k)]], tf.int64)],
                ["sum"], training=False)
            lookup = lookup.numpy()[0]
            if e["admitted"]:
                np.testing.assert_allclose(row, e["row"], rtol=1e-5,
                                           atol=atol, err_msg=f"{f}[{k}]")
                np.testing.assert_allclose(lookup, e["row"], rtol=1e-5,
                                           atol=atol)
                for s, value in _slots_of(e).items():
                    np.testing.assert_allclose(
                        slots[names[s]], value, rtol=1e-5, atol=atol,
                        err_msg=f"{f}[{k}] {s}")
            else:   # not admitted yet: reads the filter's zeros
                np.testing.assert_array_equal(lookup, 0.0)


def _train_step(evs, opt, batch):
    ids = [tf.ragged.constant(batch[f], tf.int64) for f in FEATURES]
    variables = [evs[f] for f in FEATURES]
    with tf.GradientTape() as tape:
        outs = ge.group_embedding_lookup_sparse(variables, ids,
                                                ["sum", "sum"])
        loss = tf.reduce_mean(tf.square(tf.concat(outs, axis=1)))
    opt.apply(tape.gradient(loss, variables), variables)
    return float(loss)


def _atol(cfg):
    # Adam: eps 1e-7 next to sqrt(v) ~ 1e-5 amplifies float32 rounding
    # (the generator compared Deepray with numpy at the same tolerance).
    return 1e-6 if cfg["optimizer"] == "adam" else 1e-7


def _restore(case, prefix="model", storage_dir=None, hbm=False, **kwargs):
    exp = _expected(case)
    cfg = exp["config"]
    evs = _make_evs(cfg, storage_dir, hbm)
    opt = _make_optimizer(cfg)
    out = ge.restore_deeprec_checkpoint(
        os.path.join(DATA, case, prefix), [evs[f] for f in FEATURES], opt,
        **kwargs)
    return exp, cfg, evs, opt, out


@pytest.mark.parametrize("case", CASES)
def test_every_key_equals_expected(case):
    exp, cfg, evs, opt, out = _restore(case)
    _check_state(evs, exp["keys"], cfg, _atol(cfg))
    assert int(opt.iterations.numpy()) == len(exp["batches"])
    filtered = sum(not e["admitted"] for e in exp["keys"]["user_ev"].values())
    assert out["user_ev"]["filtered_keys"] == filtered > 0
    if cfg.get("partitions"):
        parts = [t for t in out["user_ev"]["tensors"]
                 if "/part_" in t and not t.startswith(("Adam/", "Ftrl/"))]
        assert len(parts) == cfg["partitions"]


@pytest.mark.parametrize("case", CASES)
def test_deeprec_names(case):
    """The same tensors under DeepRec's own names: `<ev>-keys` (no
    ':0'), slots `<ev>/<Optimizer>[_1]`, `global_step`."""
    exp, cfg, evs, opt, out = _restore(case, "deeprec/model")
    _check_state(evs, exp["keys"], cfg, _atol(cfg))
    assert int(opt.iterations.numpy()) == len(exp["batches"])
    assert "user_ev" in out["user_ev"]["tensors"] or cfg.get("partitions")


@pytest.mark.parametrize("case", CASES)
def test_training_continues_as_deepray(case):
    """Deepray's losses for 2 more steps; a key the CounterFilter saw once
    before the save and once after is admitted at that step and read at
    the next (keys 3 and 5), as Deepray did."""
    exp, cfg, evs, opt, _ = _restore(case)
    cont = exp["continuation"]
    losses = [_train_step(evs, opt, b) for b in cont["batches"]]
    np.testing.assert_allclose(losses, cont["losses_deepray"], rtol=1e-5)
    assert exp["keys"]["user_ev"]["3"]["admitted"] is False
    assert cont["keys"]["user_ev"]["3"]["admitted"] is True
    _check_state(evs, cont["keys"], cfg, 10 * _atol(cfg),
                 versions=cfg["optimizer"] != "ftrl")


@pytest.mark.parametrize("case", CASES)
def test_restores_into_ssd_tiered_evs(case, tmp_path):
    """StorageType.DRAM_SSDHASH EVs with a few DRAM rows restore every key
    (most of them onto disk) and train on as Deepray did."""
    exp, cfg, evs, opt, _ = _restore(case, storage_dir=str(tmp_path))
    on_disk = [int(ev_storage.tier_stats(evs[f].handle)[1])
               for f in FEATURES]
    assert max(on_disk) > 0, on_disk
    _check_restored_and_continued(exp, cfg, evs, opt)


@pytest.mark.parametrize("case", CASES)
def test_restores_into_hbm_evs(case, monkeypatch):
    """StorageType.HBM EVs (on the GPU library's host stand-in) restore
    every key and train on as Deepray did."""
    monkeypatch.setenv(config.HBM_ON_HOST, "1")
    exp, cfg, evs, opt, _ = _restore(case, hbm=True)
    assert all(evs[f].ge_table_kind == "hbm_ev" for f in FEATURES)
    _check_restored_and_continued(exp, cfg, evs, opt)


def _check_restored_and_continued(exp, cfg, evs, opt):
    """Every key as expected.json holds it, then Deepray's losses for its
    2 more steps and the state after them."""
    _check_state(evs, exp["keys"], cfg, _atol(cfg))
    cont = exp["continuation"]
    losses = [_train_step(evs, opt, b) for b in cont["batches"]]
    np.testing.assert_allclose(losses, cont["losses_deepray"], rtol=1e-5)
    _check_state(evs, cont["keys"], cfg, 10 * _atol(cfg),
                 versions=cfg["optimizer"] != "ftrl")


def test_next_loss_needs_the_filtered_counts():
    """Without the filtered keys (their counts lost) key 3 would need two
    more sightings: the second continuation loss differs (the test above
    can fail). Every fixture's filtered count is 1, so the counts
    themselves are checked by `test_filtered_counts_are_restored`."""
    exp, cfg, evs, opt, _ = _restore("deepray_adagrad")
    cont = exp["continuation"]
    keys, values, freqs, versions, *rest = [
        t for t in evs["user_ev"]._serialize_to_tensors().values()]
    admitted = freqs >= 2
    evs["user_ev"]._restore_from_tensors(dict(zip(
        ["keys", "values", "freqs", "versions", "slot_names", "slot_inits",
         "slots", "step"],
        [keys[admitted], values[admitted], freqs[admitted],
         versions[admitted], rest[0], rest[1], rest[2][admitted], rest[3]])))
    losses = [_train_step(evs, opt, b) for b in cont["batches"]]
    assert not np.allclose(losses[1], cont["losses_deepray"][1], rtol=1e-5)


def test_filtered_counts_are_restored(tmp_path):
    """Every fixture's filtered key was seen once, so the counts are
    rewritten: [1, 2, 3, 4] for keys 3, 5, 6, 9 is what DeepRec saves
    under `CounterFilter(5)` for keys seen that many steps. Restored into
    one, each key keeps its count, reads the filter's zeros, and is
    admitted at the step its count reaches 5 (one count per step it
    occurs in), then reads its row; the rest stay filtered."""
    counts = {3: 1, 5: 2, 6: 3, 9: 4}

    def recount(t):
        keys = t["user_ev:0-keys_filtered"]
        assert sorted(keys) == sorted(counts)
        t["user_ev:0-freqs_filtered"] = np.array(
            [counts[int(k)] for k in keys], t["user_ev:0-freqs_filtered"].dtype)

    prefix = _rewrite(tmp_path, recount)
    cfg = dict(_expected("deepray_adagrad")["config"])
    cfg["filter_freq"] = dict(cfg["filter_freq"], user_ev=5)
    evs = _make_evs(cfg)
    opt = _make_optimizer(cfg)
    out = ge.restore_deeprec_checkpoint(prefix, [evs[f] for f in FEATURES],
                                        opt)
    assert out["user_ev"]["filtered_keys"] == len(counts)

    def read(key):
        (row,) = ge.group_embedding_lookup_sparse(
            [evs["user_ev"]], [tf.ragged.constant([[key]], tf.int64)],
            ["sum"], training=False)
        return row.numpy()[0]

    for step in range(4):
        got = _contents(evs["user_ev"])
        for key, count in counts.items():
            freq = count + step
            assert got[key][2] == freq, (key, step)
            admitted = freq >= 5
            # Admitted at the step that counted it to 5: its row (the
            # default row, then trained) is read from the next step on;
            # init_table holds no zero.
            assert np.all(read(key) != 0) == admitted, (key, step)
            assert np.all(read(key) == 0) == (not admitted), (key, step)
        _train_step(evs, opt, {"user_ev": [sorted(counts)],
                               "item_ev": [[10]]})


def test_restore_into_partitioned_ev_list():
    """`get_embedding_variable(partitioner=...)` gives a one-element list;
    it restores from the parts, in a dict or a list."""
    exp = _expected("deepray_adam_part2")
    cfg = exp["config"]
    evs = _make_evs(cfg)
    path = os.path.join(DATA, "deepray_adam_part2", "model")
    ge.restore_deeprec_checkpoint(path, {f: [evs[f]] for f in FEATURES},
                                  _make_optimizer(cfg))
    _check_state(evs, exp["keys"], cfg, _atol(cfg))
    evs = _make_evs(cfg)
    ge.restore_deeprec_checkpoint(path, [[evs[f]] for f in FEATURES],
                                  _make_optimizer(cfg))
    _check_state(evs, exp["keys"], cfg, _atol(cfg))


def test_dense_variables_and_directory():
    """Variables by tensor name; a directory means its latest checkpoint
    (here: written by tf.train.Checkpoint next to the EV tensors)."""
    path = os.path.join(DATA, "deepray_adagrad", "model")
    lr = tf.Variable(0.0)
    cfg = _expected("deepray_adagrad")["config"]
    evs = _make_evs(cfg)
    ge.restore_deeprec_checkpoint(
        path, [evs[f] for f in FEATURES], None,
        {"optimizer/learning_rate/.ATTRIBUTES/VARIABLE_VALUE": lr})
    assert lr.numpy() == np.float32(0.1)
    assert _contents(evs["user_ev"])[1][1] == {}   # no optimizer: no slots


# --- errors ---------------------------------------------------------------

def _rewrite(tmp_path, change):
    """The shipped checkpoint's tensors, changed by `change(dict)`, written
    to tmp_path/model."""
    src = os.path.join(DATA, "deepray_adagrad", "model")
    reader = tf.train.load_checkpoint(src)
    tensors = {n: reader.get_tensor(n)
               for n in reader.get_variable_to_shape_map()
               if n != "_CHECKPOINTABLE_OBJECT_GRAPH"}
    change(tensors)
    prefix = str(tmp_path / "model")
    names = sorted(tensors)
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names,
                      shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(tensors[n]) for n in names])
    return prefix


def _restore_at(prefix, optimizer=True, dim=None):
    cfg = dict(_expected("deepray_adagrad")["config"])
    if dim:
        cfg["dim"] = dim
        cfg["init_table"] = np.zeros([cfg["default_value_dim"], dim])
    evs = _make_evs(cfg)
    return ge.restore_deeprec_checkpoint(
        prefix, [evs[f] for f in FEATURES],
        _make_optimizer(cfg) if optimizer else None), evs


def test_missing_tensor_is_named(tmp_path):
    prefix = _rewrite(tmp_path, lambda t: t.pop("user_ev:0-freqs"))
    with pytest.raises(ValueError, match="'user_ev:0-freqs'"):
        _restore_at(prefix)


def _drop(prefix):
    """A `_rewrite` change removing every tensor whose name starts so."""
    def change(tensors):
        for name in [n for n in tensors if n.startswith(prefix)]:
            del tensors[name]
    return change


def test_missing_ev_is_named(tmp_path):
    with pytest.raises(ValueError, match="item_ev-keys"):
        _restore_at(_rewrite(tmp_path, _drop("item_ev:0-")))


def test_missing_slot_is_named(tmp_path):
    with pytest.raises(ValueError, match="'accumulator' for 'item_ev'"):
        _restore_at(_rewrite(tmp_path, _drop("Adagrad/item_ev/")))
    # Without the optimizer the EVs restore.
    _restore_at(str(tmp_path / "model"), optimizer=False)


@pytest.mark.parametrize("prefix", ["model", "deeprec/model"])
def test_slots_of_another_optimizer_are_refused(prefix):
    """Adam on an Adagrad checkpoint: DeepRec's `user_ev/Adagrad` sits
    where Adam's `m` would (`user_ev/Adam`) but is not taken."""
    cfg = _expected("deepray_adagrad")["config"]
    evs = _make_evs(cfg)
    path = os.path.join(DATA, "deepray_adagrad", prefix)
    with pytest.raises(ValueError, match="no optimizer slot 'm' for "
                       "'user_ev'.*optimizer name 'Adam'"):
        ge.restore_deeprec_checkpoint(path, [evs["user_ev"]],
                                      ge.optimizers.Adam(0.1))
    with pytest.raises(ValueError, match="found slots of Adagrad"):
        ge.restore_deeprec_checkpoint(path, [evs["user_ev"]],
                                      ge.optimizers.Adagrad(0.1),
                                      optimizer_name="MyAdagrad")


def test_wrong_dim_is_named():
    prefix = os.path.join(DATA, "deepray_adagrad", "model")
    with pytest.raises(ValueError, match="'user_ev:0-values'.*embedding_dim 8"):
        _restore_at(prefix, dim=8)


def test_wrong_shape_and_dtype_are_named(tmp_path):
    def wrong_length(t):
        t["item_ev:0-versions"] = t["item_ev:0-versions"][:-1]
    with pytest.raises(ValueError, match="'item_ev:0-versions'.*inconsistent"):
        _restore_at(_rewrite(tmp_path / "a", wrong_length))

    def wrong_dtype(t):
        t["item_ev:0-values"] = t["item_ev:0-values"].astype(np.float64)
    with pytest.raises(ValueError, match="'item_ev:0-values'.*float64"):
        _restore_at(_rewrite(tmp_path / "b", wrong_dtype))

    def wrong_rank(t):
        t["user_ev:0-keys_filtered"] = t["user_ev:0-keys_filtered"][:, None]
    with pytest.raises(ValueError, match="'user_ev:0-keys_filtered'.*rank 1"):
        _restore_at(_rewrite(tmp_path / "c", wrong_rank))

    def wrong_filtered_length(t):
        t["user_ev:0-freqs_filtered"] = t["user_ev:0-freqs_filtered"][:2]
    with pytest.raises(ValueError, match="'user_ev:0-freqs_filtered'"):
        _restore_at(_rewrite(tmp_path / "d", wrong_filtered_length))


def test_inconsistent_partition_offsets_are_named(tmp_path):
    def shift(t):
        t["user_ev:0-partition_offset"][-1] += 1
    with pytest.raises(ValueError, match="'user_ev:0-partition_offset'"):
        _restore_at(_rewrite(tmp_path, shift))


def test_duplicate_key_is_refused(tmp_path):
    def dup(t):
        t["user_ev:0-keys_filtered"][0] = t["user_ev:0-keys"][0]
    with pytest.raises(ValueError, match="key 1 more than once"):
        _restore_at(_rewrite(tmp_path, dup))


def test_nothing_written_when_a_later_ev_fails(tmp_path):
    """Everything is checked before anything is written."""
    prefix = _rewrite(tmp_path, lambda t: t.pop("item_ev:0-values"))
    cfg = _expected("deepray_adagrad")["config"]
    evs = _make_evs(cfg)
    ge.embedding_lookup(evs["user_ev"], tf.constant([77], tf.int64))
    with pytest.raises(ValueError, match="item_ev:0-values"):
        ge.restore_deeprec_checkpoint(prefix, [evs[f] for f in FEATURES])
    assert sorted(_contents(evs["user_ev"])) == [77]


# --- TF1: Saver().restore under compat --------------------------------------

def _tf1_optimizer(cfg, name=None):
    if cfg["optimizer"] == "adam":
        return tf.compat.v1.train.AdamOptimizer(
            cfg["lr"], cfg["beta1"], cfg["beta2"], cfg["adam_epsilon"],
            name=name or "Adam")
    return tf.compat.v1.train.AdagradOptimizer(
        cfg["lr"], initial_accumulator_value=cfg["init_acc"],
        name=name or "Adagrad")


def _tf1_continuation(case, saver_cls, prefix, opt_name=None):
    """A DeepRec TF1 script: EVs, a tf.train optimizer, Saver().restore of
    the checkpoint, then the continuation batches; returns the losses."""
    exp = _expected(case)
    cfg = exp["config"]
    graph = tf.Graph()
    with graph.as_default():
        gs = tf.compat.v1.train.get_or_create_global_step()
        evs = _make_evs(cfg)
        opt = _tf1_optimizer(cfg, opt_name)
        steps = []
        for batch in exp["continuation"]["batches"]:
            ids = [tf.ragged.constant(batch[f], tf.int64) for f in FEATURES]
            outs = ge.group_embedding_lookup_sparse(
                [evs[f] for f in FEATURES], ids, ["sum", "sum"])
            loss = tf.reduce_mean(tf.square(tf.concat(outs, axis=1)))
            train = opt.minimize(loss, global_step=gs)
            steps.append(loss)
            steps.append(train)
        saver = saver_cls()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.restore(sess, prefix if os.path.isabs(prefix)
                          else os.path.join(DATA, case, prefix))
            assert sess.run(gs) == len(exp["batches"])
            losses = []
            for loss, train in zip(steps[::2], steps[1::2]):
                losses.append(sess.run([loss, train])[0])
    return exp, losses


@pytest.mark.parametrize("case", ["deepray_adagrad", "deepray_adam_part2"])
def test_compat_saver_restores_deeprec_checkpoint(compat, case):
    """Adagrad, and Adam over a 2-part EV with TF1 Adam's beta powers."""
    assert tf.compat.v1.train.Saver is deeprec_checkpoint.Saver
    exp, losses = _tf1_continuation(case, tf.compat.v1.train.Saver,
                                    "deeprec/model")
    np.testing.assert_allclose(
        losses, exp["continuation"]["losses_deepray"], rtol=1e-5)


def test_compat_saver_finds_slots_of_a_named_optimizer(compat, tmp_path):
    """`AdagradOptimizer(name="MyAdagrad")`: DeepRec named its slot EVs
    `<ev>/MyAdagrad`; the Saver takes the name from the optimizer's ops."""
    src = os.path.join(DATA, "deepray_adagrad", "deeprec", "model")
    reader = tf.train.load_checkpoint(src)
    names = sorted(reader.get_variable_to_shape_map())
    renamed = [n.replace("/Adagrad-", "/MyAdagrad-") for n in names]
    assert renamed != names
    prefix = str(tmp_path / "model")
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=renamed,
                      shape_and_slices=[""] * len(names),
                      tensors=[tf.constant(reader.get_tensor(n))
                               for n in names])
    exp, losses = _tf1_continuation("deepray_adagrad",
                                    tf.compat.v1.train.Saver, prefix,
                                    opt_name="MyAdagrad")
    np.testing.assert_allclose(
        losses, exp["continuation"]["losses_deepray"], rtol=1e-5)


def test_compat_saver_keeps_stock_checkpoints(tmp_path):
    """Our own checkpoints still go through the stock restore."""
    graph = tf.Graph()
    with graph.as_default():
        ev = ge.get_embedding_variable("ev", 3)
        ge.embedding_lookup(ev, tf.constant([5, 6], tf.int64))
        v = tf.compat.v1.get_variable("v", initializer=[1.0, 2.0])
        saver = deeprec_checkpoint.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(ge.embedding_lookup(ev, tf.constant([5, 6], tf.int64)))
            path = saver.save(sess, str(tmp_path / "ours"))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(v.assign([0.0, 0.0]))
            saver.restore(sess, path)
            assert sess.run(ev.size()) == 2
            assert list(sess.run(v)) == [1.0, 2.0]


def test_monitored_session_restores_deeprec_checkpoint(compat, tmp_path):
    """MonitoredTrainingSession restores with a finalized graph: the
    Saver reopens it for its restore ops."""
    src = os.path.join(DATA, "deepray_adagrad", "deeprec")
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as a, \
                open(tmp_path / name, "wb") as b:
            b.write(a.read())
    tf.compat.v1.train.update_checkpoint_state(str(tmp_path),
                                               str(tmp_path / "model"))
    exp = _expected("deepray_adagrad")
    cfg = exp["config"]
    with tf.Graph().as_default():
        gs = tf.compat.v1.train.get_or_create_global_step()
        evs = _make_evs(cfg)
        batch = exp["continuation"]["batches"][0]
        ids = [tf.ragged.constant(batch[f], tf.int64) for f in FEATURES]
        outs = ge.group_embedding_lookup_sparse(
            [evs[f] for f in FEATURES], ids, ["sum", "sum"])
        loss = tf.reduce_mean(tf.square(tf.concat(outs, axis=1)))
        train = tf.compat.v1.train.AdagradOptimizer(
            cfg["lr"], initial_accumulator_value=cfg["init_acc"]).minimize(
                loss, global_step=gs)
        scaffold = tf.compat.v1.train.Scaffold(
            saver=tf.compat.v1.train.Saver())
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=str(tmp_path), scaffold=scaffold,
                save_checkpoint_secs=None, save_checkpoint_steps=None,
                save_summaries_steps=None, log_step_count_steps=None) as sess:
            got = sess.run([loss, train])[0]
    np.testing.assert_allclose(
        got, exp["continuation"]["losses_deepray"][0], rtol=1e-5)


def test_keras_model_continues_as_deepray():
    """A Keras model of EV feature columns (`GroupEmbeddingFeatures`),
    restored through a dict {checkpoint name: EV} (the layer names its
    tables), trains on with `train_on_batch` to Deepray's losses."""
    import keras

    from group_embedding import feature_column as ge_fc

    exp = _expected("deepray_adam_part2")
    cfg = exp["config"]
    init = np.array(cfg["init_table"], np.float32)
    cols = []
    for f in FEATURES:
        freq = cfg["filter_freq"][f]
        option = ge.EmbeddingVariableOption(
            filter_option=ge.CounterFilter(freq) if freq else None,
            init_option=ge.InitializerOption(
                initializer=tf.constant_initializer(init),
                default_value_dim=cfg["default_value_dim"]))
        cols.append(ge_fc.embedding_column(
            ge_fc.categorical_column_with_embedding(
                f, dtype=tf.int64, ev_option=option),
            cfg["dim"], combiner="sum"))

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.features = ge_fc.GroupEmbeddingFeatures(cols)

        def call(self, inputs):
            return self.features(inputs)

    def features(batch):
        return {f: tf.ragged.constant(batch[f], tf.int64) for f in FEATURES}

    model = Model()
    opt = _make_optimizer(cfg)
    model.compile(optimizer=opt,
                  loss=lambda y, p: tf.reduce_mean(tf.square(p)))
    model(features(exp["batches"][0]))   # builds the tables
    tables = model.features.tables
    evs = {f: next(ev for name, ev in tables.items() if f in name)
           for f in FEATURES}
    ge.restore_deeprec_checkpoint(
        os.path.join(DATA, "deepray_adam_part2", "model"), evs, opt)
    _check_state(evs, exp["keys"], cfg, _atol(cfg))
    cont = exp["continuation"]
    losses = [float(model.train_on_batch(features(b), np.zeros([3, 1])))
              for b in cont["batches"]]
    np.testing.assert_allclose(losses, cont["losses_deepray"], rtol=1e-5)


def test_compat_saver_bad_path_is_the_stock_error(tmp_path):
    with tf.Graph().as_default():
        ge.get_embedding_variable("ev", 3)
        saver = deeprec_checkpoint.Saver()
        with tf.compat.v1.Session() as sess:
            with pytest.raises(ValueError, match="not a valid checkpoint"):
                saver.restore(sess, str(tmp_path / "nothing"))


def test_other_filters_keep_admitted_rows():
    """Restored into a stricter CounterFilter(5), admitted keys stay
    admitted (freq raised to 5) and read their rows; a CBFFilter does not
    store keys before admission: the filtered ones are left out."""
    path = os.path.join(DATA, "deepray_adagrad", "model")
    exp = _expected("deepray_adagrad")
    keys = exp["keys"]["user_ev"]
    for option, filtered in ((ge.CounterFilter(5), 4),
                             (ge.CBFFilter(
                                 filter_freq=2, max_element_size=1000,
                                 false_positive_probability=0.01), 0)):
        ev = ge.get_embedding_variable(
            "user_ev", 4, ev_option=ge.EmbeddingVariableOption(
                filter_option=option))
        out = ge.restore_deeprec_checkpoint(path, [ev])
        assert out["user_ev"]["filtered_keys"] == filtered
        got = _contents(ev)
        assert len(got) == 3 + filtered
        for k, e in keys.items():
            if e["admitted"]:
                (row,) = ge.group_embedding_lookup_sparse(
                    [ev], [tf.ragged.constant([[int(k)]], tf.int64)],
                    ["sum"], training=False)
                np.testing.assert_allclose(row.numpy()[0], e["row"],
                                           rtol=1e-6)
                assert got[int(k)][2] == max(e["freq"], option.filter_freq)


def test_collective_worker_restores_the_keys_it_owns(monkeypatch):
    """Worker 1 of 2 keeps the keys k with k mod 2 == 1 (as its shard of a
    collective EV holds), admitted and filtered alike."""
    from group_embedding import model_parallel
    monkeypatch.setattr(model_parallel, "world", lambda: (1, 2))
    exp, cfg, evs, opt, out = _restore("deepray_adagrad")
    odd = {f: {k: e for k, e in exp["keys"][f].items() if int(k) % 2}
           for f in FEATURES}
    assert out["user_ev"]["filtered_keys"] == sum(
        not e["admitted"] for e in odd["user_ev"].values())
    _check_state(evs, odd, cfg, _atol(cfg))
