"""The fused EV backward-apply (issue 36.5, ops/backward_apply.py
`fuse_ev`): in a traced step, `ge.optimizers` apply a pooled EV group's
gradient with ONE `GroupEmbeddingEVBackwardApply` instead of the gradient
op's IndexedSlices and a `GroupEmbeddingEVApply*` per variable.

Oracle: the unfused path on a twin set of EVs, the same ids for 3 steps,
its gradients made "changed" (values + 0, bitwise the same numbers), which
the fuse leaves to the per-variable update. Keys, rows, slots, freqs and
versions must agree.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.embedding_variable.keras_variable import (
    KerasEmbeddingVariable,
)
from group_embedding.ops import backward_apply
from group_embedding.ops import ev_storage

DIM = 4
STEPS = 3
EV_APPLY = "GroupEmbeddingEVApply"
FUSED = backward_apply.EV_APPLY_OP
GRAD_OP = "GroupEmbeddingPooledLookupGrad"

# FTRL's regularisation, Keras and TF1 alike.
FTRL = dict(l1_regularization_strength=0.01, l2_regularization_strength=0.02,
            l2_shrinkage_regularization_strength=0.01)
OPTIMIZERS = {
    "adagrad": lambda: ge.optimizers.Adagrad(0.1, 0.1),
    "sgd": lambda: ge.optimizers.SGD(0.1),
    "adam": lambda: ge.optimizers.Adam(0.05),
    "ftrl": lambda: ge.optimizers.Ftrl(0.1, **FTRL),
}


def _ids(seed, tables=3, batch=5):
    """Ragged keys per table: keys from a small range (duplicates within
    and across rows, the same key values in every table), an empty row."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tables):
        rows = [list(rng.integers(-3, 9, size=rng.integers(1, 5)))
                for _ in range(batch)]
        rows[1] = []
        rows[2] = [5, 5, 7]
        out.append(rows)
    return out


def _evs(tag, n, filter_freq=0, tier_dir=None):
    """`n` EVs; with `tier_dir`, each with an SSD tier there whose DRAM
    budget holds the disk index and about 3 rows with 2 slots."""
    def option(i):
        tier = {} if tier_dir is None else {
            "storage_option": ge.StorageOption(
                ge.StorageType.DRAM_SSDHASH,
                storage_path=f"{tier_dir}/{tag}_{i}",
                storage_size=[768 + 3 * (36 + 4 * DIM * 3)])}
        return ge.EmbeddingVariableOption(
            init_option=ge.InitializerOption(default_value_dim=7),
            filter_option=(ge.CounterFilter(filter_freq=filter_freq)
                           if filter_freq else None), **tier)
    return [ge.get_embedding_variable(
        f"{tag}_{i}", DIM, ev_option=option(i),
        initializer=tf.keras.initializers.RandomUniform(-1.0, 1.0, seed=i))
        for i in range(n)]


def _state(ev):
    """Everything an EV stores, sorted by key."""
    keys, values, freqs, versions, names, _, slots, _ = (
        ev_storage.export(ev.handle, DIM))
    order = np.argsort(keys.numpy())
    return {"keys": keys.numpy()[order], "values": values.numpy()[order],
            "freqs": freqs.numpy()[order],
            "versions": versions.numpy()[order],
            "slot_names": list(names.numpy()),
            "slots": slots.numpy()[order]}


def _train(tag, fused, make_optimizer, combiners, weighted, filter_freq,
           seed, tier_dir=None):
    """EV states after STEPS traced steps, and the traced graph (one
    table per combiner)."""
    ids = _ids(seed, tables=len(combiners))
    evs = _evs(tag, len(ids), filter_freq, tier_dir)
    optimizer = make_optimizer()
    sp_ids = [tf.ragged.constant(r, tf.int64, row_splits_dtype=tf.int64)
              for r in ids]
    rng = np.random.default_rng(seed + 1)
    sp_w = ([tf.RaggedTensor.from_row_splits(
        tf.constant(rng.uniform(0.2, 2.0, x.values.shape[0]), tf.float32),
        x.row_splits) for x in sp_ids] if weighted else None)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            out = ge.group_embedding_lookup_sparse(evs, sp_ids, combiners,
                                                   sp_w)
            loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                             for i, o in enumerate(out)])
        grads = tape.gradient(loss, evs)
        if not fused:
            grads = [tf.IndexedSlices(g.values + 0.0, g.indices)
                     for g in grads]
        optimizer.apply_gradients(zip(grads, evs))

    for _ in range(STEPS):
        step()
    states = [_state(ev) for ev in evs]
    if tier_dir is not None:
        for state, ev in zip(states, evs):
            state["tier"] = ev_storage.tier_stats(ev.handle).numpy()
    return states, step.get_concrete_function().graph


def _op_types(graph):
    return [op.type for op in graph.get_operations()]


def assert_fused(graph):
    """The step applied through the fused op only: no per-variable
    update, and no consumer of the gradient op (pruned at run time)."""
    types = _op_types(graph)
    assert FUSED in types
    assert not [t for t in types if t.startswith(EV_APPLY)]
    for op in graph.get_operations():
        if op.type == GRAD_OP:
            assert not [c for o in op.outputs for c in o.consumers()]


def assert_same(got, want, exact=True):
    for t, (g, w) in enumerate(zip(got, want)):
        for field in ("keys", "freqs", "versions", "slot_names"):
            np.testing.assert_array_equal(g[field], w[field],
                                          err_msg=f"table {t} {field}")
        for field in ("values", "slots"):
            if exact:
                np.testing.assert_array_equal(g[field], w[field],
                                              err_msg=f"table {t} {field}")
            else:
                np.testing.assert_allclose(g[field], w[field], rtol=1e-6,
                                           atol=1e-7,
                                           err_msg=f"table {t} {field}")


@pytest.mark.parametrize("combiners,weighted,filter_freq", [
    (["sum", "sum", "sum"], False, 0),
    (["sum", "mean", "sqrtn"], False, 0),
    (["sum", "mean", "sqrtn"], True, 0),
    (["mean", "sqrtn", "sum"], True, 4),
    # Fewer variables than threads: the update sharded over keys.
    (["sqrtn"], True, 4),
])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_equals_unfused(name, combiners, weighted, filter_freq):
    tag = f"fused_{name}_{combiners[0]}_{int(weighted)}_{filter_freq}"
    args = (OPTIMIZERS[name], combiners, weighted, filter_freq, 3)
    got, graph = _train(tag + "_f", True, *args)
    want, unfused = _train(tag + "_u", False, *args)
    assert_fused(graph)
    assert FUSED not in _op_types(unfused)
    assert any(t.startswith(EV_APPLY) for t in _op_types(unfused))
    assert_same(got, want)
    for w in want:
        assert (w["versions"] == STEPS - 1).any()
    if filter_freq:
        # Keys seen fewer times than the filter's threshold: stored,
        # stamped, never updated (their rows keep the default).
        for w, ev in zip(want, _evs(tag + "_fresh", len(want))):
            low = w["freqs"] < filter_freq
            assert low.any() and not low.all()
            np.testing.assert_array_equal(
                w["values"][low],
                ev.default_values.numpy()[np.mod(w["keys"][low], 7)])


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_ssd_tier(tmp_path, name):
    """EVs with an SSD tier whose DRAM holds a few rows: the fused op
    brings the keys on disk back first, as the per-variable update."""
    args = (OPTIMIZERS[name], ["sum", "mean", "sqrtn"], True, 0, 4)
    got, graph = _train(f"tier_{name}_f", True, *args,
                        tier_dir=tmp_path)
    want, _ = _train(f"tier_{name}_u", False, *args, tier_dir=tmp_path)
    assert_fused(graph)
    assert_same(got, want)
    # Rows went to disk and came back (promotions, spills).
    assert all(g["tier"][2] > 0 and g["tier"][3] > 0 for g in got)


def test_trainable_weights_read_the_rows_before_the_update():
    """Per-id weights trained with the EVs: their gradients read the rows
    the fused op updates in place in the same step; weights and EVs after
    3 steps equal the unfused path's, so every read came first."""
    def run(tag, fused):
        ids = _ids(9)
        evs = _evs(tag, len(ids))
        sp_ids = [tf.ragged.constant(r, tf.int64, row_splits_dtype=tf.int64)
                  for r in ids]
        rng = np.random.default_rng(3)
        ws = [tf.Variable(rng.uniform(0.2, 2.0, x.values.shape[0]),
                          dtype=tf.float32) for x in sp_ids]
        optimizer = ge.optimizers.Adagrad(0.1)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                sp_w = [tf.RaggedTensor.from_row_splits(w, x.row_splits)
                        for w, x in zip(ws, sp_ids)]
                out = ge.group_embedding_lookup_sparse(
                    evs, sp_ids, ["sum", "mean", "sqrtn"], sp_w)
                loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                                 for i, o in enumerate(out)])
            variables = evs + ws
            grads = tape.gradient(loss, variables)
            if not fused:
                grads = [tf.IndexedSlices(g.values + 0.0, g.indices)
                         for g in grads[:len(evs)]] + grads[len(evs):]
            optimizer.apply_gradients(zip(grads, variables))

        start = [w.numpy() for w in ws]
        for _ in range(STEPS):
            step()
        assert all(np.abs(w.numpy() - w0).max() > 1e-4
                   for w, w0 in zip(ws, start)), "weights did not move"
        graph = step.get_concrete_function().graph
        return [_state(ev) for ev in evs], [w.numpy() for w in ws], graph

    got, got_w, graph = run("weights_f", True)
    want, want_w, _ = run("weights_u", False)
    assert_fused(graph)
    assert_same(got, want)
    for g, w in zip(got_w, want_w):
        np.testing.assert_array_equal(g, w)


def test_shared_variable_keeps_the_per_variable_update():
    """Two features of one EV in a group: TF sums its two gradients, no
    longer the gradient op's; the group keeps the unfused path."""
    def run(tag):
        ev = _evs(tag, 1)[0]
        optimizer = ge.optimizers.Adagrad(0.1)
        sp = [tf.ragged.constant(r, tf.int64, row_splits_dtype=tf.int64)
              for r in _ids(5, tables=2)]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                out = ge.group_embedding_lookup_sparse([ev, ev], sp, "sum")
                loss = tf.reduce_sum(tf.square(tf.concat(out, 1)))
            optimizer.apply_gradients([(tape.gradient(loss, ev), ev)])

        step()
        return _state(ev), _op_types(step.get_concrete_function().graph)

    got, types = run("shared_ev")
    assert FUSED not in types
    assert any(t.startswith(EV_APPLY) for t in types)
    assert len(got["keys"]) > 0


class FusedTower(keras.Model):
    """Three EV features (one group) and a dense head."""

    def __init__(self, tag):
        super().__init__()
        self.tag = tag
        self.head = keras.layers.Dense(
            1, kernel_initializer=keras.initializers.Constant(0.3))

    def build(self, input_shape=None):
        self.evs = _evs(self.tag, 3, filter_freq=2)
        self.ev_weights = [KerasEmbeddingVariable(ev) for ev in self.evs]
        self.head.build((None, 3 * DIM))

    def call(self, features):
        embs = ge.group_embedding_lookup_sparse(
            self.evs, [features[f"f{i}"] for i in range(3)],
            ["sum", "mean", "sqrtn"])
        return self.head(tf.concat(embs, 1))


def test_model_fit_fuses(monkeypatch):
    """`model.fit` (a traced train step) applies the group with the fused
    op; `run_eagerly=True` (never fused) is the oracle."""
    ids = _ids(11, batch=8)
    feats = {f"f{i}": tf.ragged.constant(r, tf.int64,
                                         row_splits_dtype=tf.int64)
             for i, r in enumerate(ids)}
    labels = tf.constant(np.linspace(-1, 1, 8)[:, None], tf.float32)
    ds = tf.data.Dataset.from_tensors((feats, labels)).repeat(STEPS)

    def fit(tag, eager):
        model = FusedTower(tag)
        model.compile(optimizer=ge.optimizers.Adagrad(0.1), loss="mse",
                      run_eagerly=eager)
        losses = model.fit(ds, epochs=1, verbose=0).history["loss"]
        return model, losses

    # What `fuse_ev` built and left in the traced train step.
    built, left = [], []
    fuse_ev = backward_apply.fuse_ev

    def spy(pairs, rule):
        rest, ops = fuse_ev(pairs, rule)
        built.append(ops)
        left.extend(rest)
        return rest, ops

    monkeypatch.setattr(backward_apply, "fuse_ev", spy)
    got, got_loss = fit("fit_fused", False)
    monkeypatch.undo()
    want, want_loss = fit("fit_eager", True)
    assert built and all(len(b) == 1 for b in built), "not fused"
    assert not left
    # The dense head's gradients differ in the last bit between eager
    # and traced runs: close, not equal.
    assert_same([_state(ev) for ev in got.evs],
                [_state(ev) for ev in want.evs], exact=False)
    np.testing.assert_allclose(got.head.kernel.numpy(),
                               want.head.kernel.numpy(), rtol=1e-6)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)


TF1_OPTIMIZERS = {
    "sgd": lambda: ge.train.GradientDescentOptimizer(0.1),
    "adagrad": lambda: ge.train.AdagradOptimizer(0.1),
    "ftrl": lambda: ge.train.FtrlOptimizer(0.1, **FTRL),
}


def _train_tf1(tag, fused, make_optimizer, seed=7):
    """EV states after STEPS session runs of a TF1 `ge.train` step (a
    weighted group with a CounterFilter), and the graph's op types."""
    ids = _ids(seed)
    rng = np.random.default_rng(seed + 1)
    graph = tf.Graph()
    with graph.as_default():
        evs = _evs(tag, len(ids), filter_freq=4)
        sp_ids = [tf.ragged.constant(r, tf.int64, row_splits_dtype=tf.int64)
                  for r in ids]
        sp_w = [tf.RaggedTensor.from_row_splits(
            tf.constant(rng.uniform(0.2, 2.0, x.values.shape[0]),
                        tf.float32), x.row_splits) for x in sp_ids]
        out = ge.group_embedding_lookup_sparse(
            evs, sp_ids, ["sum", "mean", "sqrtn"], sp_w)
        loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                         for i, o in enumerate(out)])
        step = tf.compat.v1.train.get_or_create_global_step()
        optimizer = make_optimizer()
        pairs = optimizer.compute_gradients(loss, var_list=evs)
        if not fused:
            pairs = [(tf.IndexedSlices(g.values + 0.0, g.indices), v)
                     for g, v in pairs]
        train = optimizer.apply_gradients(pairs, global_step=step)
        needed = _needed(tf.group(train))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(STEPS):
                sess.run(train)
            states = []
            for ev in evs:
                keys, values, freqs, versions, names, _, slots, _ = (
                    sess.run(ev_storage.export(ev.handle, DIM)))
                order = np.argsort(keys)
                states.append({
                    "keys": keys[order], "values": values[order],
                    "freqs": freqs[order], "versions": versions[order],
                    "slot_names": list(names), "slots": slots[order]})
    return states, needed


def _needed(op):
    """The types of the ops a session runs for `op` (its inputs and
    control inputs, transitively)."""
    seen, stack = set(), [op]
    while stack:
        o = stack.pop()
        if o in seen:
            continue
        seen.add(o)
        stack.extend(t.op for t in o.inputs)
        stack.extend(o.control_inputs)
    return [o.type for o in seen]


@pytest.mark.parametrize("name", sorted(TF1_OPTIMIZERS))
def test_tf1_optimizers_fuse(name):
    """`ge.train` (a TF1 session): the train op runs the fused op, not
    the gradient op nor a per-variable update."""
    got, types = _train_tf1(f"tf1_{name}_f", True, TF1_OPTIMIZERS[name])
    want, unfused = _train_tf1(f"tf1_{name}_u", False, TF1_OPTIMIZERS[name])
    assert FUSED in types and GRAD_OP not in types
    assert not [t for t in types if t.startswith(EV_APPLY)]
    assert FUSED not in unfused and GRAD_OP in unfused
    assert_same(got, want)
    for w in want:
        assert (w["versions"] == STEPS - 1).any()


@pytest.mark.parametrize("fused", [True, False])
def test_tf1_slots_register_in_declared_order(fused):
    """A TF1 session registers an EV's slots in the optimizer's order
    every time (a slot's index in checkpoints and exports is its
    registration order): each slot's ensure op waits on the one before.
    Without the edge the session ran FTRL's two in either order."""
    graph = tf.Graph()
    with graph.as_default():
        evs = _evs(f"tf1_order_{fused}", 2)
        sp_ids = [tf.ragged.constant([[1, 2], [3]], tf.int64,
                                     row_splits_dtype=tf.int64)] * 2
        out = ge.group_embedding_lookup_sparse(evs, sp_ids, ["sum", "sum"])
        loss = tf.add_n([tf.reduce_sum(o * o) for o in out])
        optimizer = TF1_OPTIMIZERS["ftrl"]()
        pairs = optimizer.compute_gradients(loss, var_list=evs)
        if not fused:
            pairs = [(tf.IndexedSlices(g.values + 0.0, g.indices), v)
                     for g, v in pairs]
        train = optimizer.apply_gradients(pairs)
        ensure = tf.compat.v1.get_collection(
            ge.embedding_variable.variable.EV_INIT_SLOT_OPS)
        assert len(ensure) == 4
        for first, second in zip(ensure[0::2], ensure[1::2]):
            assert first in second.control_inputs
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            for ev in evs:
                names = sess.run(ev_storage.export(ev.handle, DIM))[4]
                assert list(names) == [b"ftrl/accumulator", b"ftrl/linear"]


def _direct_inputs(evs, ids, seed=0):
    """The fused op's inputs for EVs `evs` (repeats allowed) and ragged
    key lists `ids`: random pooled gradients, sum/mean combiners."""
    rng = np.random.default_rng(seed)
    sp = [tf.ragged.constant(r, tf.int64, row_splits_dtype=tf.int64)
          for r in ids]
    return dict(
        handles=[ev.handle for ev in evs],
        grads=[tf.constant(rng.normal(size=(len(r), DIM)), tf.float32)
               for r in ids],
        keys=[x.values for x in sp], row_splits=[x.row_splits for x in sp],
        weights=[tf.zeros([0], tf.float32)] * len(ids),
        global_step=tf.constant(2, tf.int64),
        hyper=backward_apply.hyper(lr=0.1, epsilon=1e-7),
        combiners=["sum", "mean"][:len(ids)], embedding_dim=DIM,
        optimizer="adagrad", slot_names=["adagrad/accumulator"])


def _inserted(tag, ids):
    """One EV holding every key of `ids`, with an Adagrad slot."""
    ev = _evs(tag, 1)[0]
    ev.lookup_rows(np.unique(np.array(
        [k for table in ids for row in table for k in row], np.int64)))
    ev.ensure_slot("adagrad/accumulator", 0.1)
    return ev


def test_one_variable_in_two_tables_sums_both():
    """Called directly with one EV for two tables (ops/backward_apply.py
    never builds that: TF sums such gradients first), the op sums a
    key's gradients over both tables, as the per-variable update of the
    concatenated slices does."""
    ids = _ids(4, tables=2)
    got, want = _inserted("two_tables_f", ids), _inserted("two_tables_u", ids)
    lib = ev_storage.library()
    args = _direct_inputs([got, got], ids)
    before = _state(got)["values"]
    lib.group_embedding_ev_backward_apply(**args)
    assert np.abs(_state(got)["values"] - before).max() > 1e-3
    uniq, sums = lib.group_embedding_pooled_lookup_grad(
        grads=args["grads"], ids=args["keys"],
        row_splits=args["row_splits"], weights=args["weights"],
        combiners=args["combiners"], embedding_dim=DIM)
    ev_storage.apply_adagrad(want.handle, tf.concat(uniq, 0),
                             tf.concat(sums, 0), 2, 0.1, 1e-7,
                             "adagrad/accumulator")
    assert_same([_state(got)], [_state(want)])


def test_bad_inputs_name_the_variable():
    ids = _ids(6, tables=2)
    evs = [_inserted(f"bad_{i}", ids) for i in range(2)]
    lib = ev_storage.library()
    args = _direct_inputs(evs, ids)
    bad = dict(args, grads=[args["grads"][0], args["grads"][1][:-1]])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="bad_1_0: grads must have shape"):
        lib.group_embedding_ev_backward_apply(**bad)
    bad = dict(args, row_splits=[args["row_splits"][0],
                                 args["row_splits"][1] + 1])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="bad_1_0: row_splits must start at 0"):
        lib.group_embedding_ev_backward_apply(**bad)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="bad_0_0: optimizer slot 'adam/m' was not"):
        lib.group_embedding_ev_backward_apply(
            **dict(args, optimizer="adam", slot_names=["adam/m", "adam/v"]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="hyper must be a vector of 8"):
        lib.group_embedding_ev_backward_apply(
            **dict(args, hyper=tf.zeros([3])))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="combiners must have 2 entries, got 1"):
        lib.group_embedding_ev_backward_apply(
            **dict(args, combiners=["sum"]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="needs 1 slot names, got 0"):
        lib.group_embedding_ev_backward_apply(**dict(args, slot_names=[]))
