"""The fused EmbeddingVariable lookup (C++ `GroupEmbeddingEVLookup`) against the
pure-TF EV path (`GROUP_EMBEDDING_KERNELS=tf`: one `GroupEmbeddingEVGather`,
then TF pooling), and both against stock TF (`test_training_equals_stock`: the
two paths share the storage code, so parity alone misses its defects).

Both paths run the same training steps on twin variables (same default matrix);
outputs, table gradients (summed per key), weight gradients and the stored keys,
values and frequencies must agree step after step, with weights, empty rows,
duplicate keys, a CounterFilter and a variable that serves two tables of one
group. EV sequences (C++ `GroupEmbeddingEVSequenceLookup` when unweighted, else
a gather placed in TF) are checked against a numpy oracle, and the sequence
kernel against the gather path step by step.
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

import ev_cases

FILTER = ge.EmbeddingVariableOption(
    filter_option=ge.CounterFilter(filter_freq=2),
    init_option=ge.InitializerOption(default_value_dim=5,
                                     default_value_no_permission=0.5))
COMBINERS = ["sum", "mean", "sqrtn", "mean"]


def _twins(tag):
    """Two identical sets of EVs (plain, plain, filtered), dim 4."""
    def make(path):
        return [ev_cases.make_ev(f"{tag}_{path}_a", seed=1),
                ev_cases.make_ev(f"{tag}_{path}_b", seed=2),
                ev_cases.make_ev(f"{tag}_{path}_f", seed=3,
                                 ev_option=FILTER)]
    return make("fused"), make("tf")


def _batch(rng, batch=7):
    """Ragged keys with empty rows and duplicates, and float weights."""
    rows = []
    for b in range(batch):
        n = 0 if b % 3 == 1 else int(rng.integers(1, 5))
        rows.append(list(rng.choice(ev_cases.KEYS[:5], size=n)))
    rows[0] = [3, 3, -7]  # duplicates inside a row
    # A key seen once per batch: the CounterFilter (freq 2) holds it back
    # at its first two lookups (DeepRec's rule, issue 9; it was the first
    # only while the filter admitted one lookup early).
    rows[2] = [int(ev_cases.KEYS[5])]
    keys = tf.ragged.constant(rows, tf.int64, row_splits_dtype=tf.int64)
    weights = tf.constant(rng.uniform(0.2, 2.0, keys.values.shape[0]),
                          tf.float32)
    return keys, weights


def _per_key(grad):
    """IndexedSlices keyed by key -> {key: summed gradient row}."""
    out = {}
    for k, g in zip(grad.indices.numpy(), grad.values.numpy()):
        out[int(k)] = out.get(int(k), 0.0) + g
    return out


def _step(evs, batches, weights, proj, optimizer, mode, monkeypatch,
          training=True):
    """One lookup (+ SGD update when training) on the `mode` path.

    Tables: evs[0] weighted, evs[1], evs[2] (filtered) and evs[0] again
    (shared), each with its own combiner.
    """
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
    params = [evs[0], evs[1], evs[2], evs[0]]
    with tf.GradientTape() as tape:
        tape.watch(weights)
        sp_weights = [tf.RaggedTensor.from_row_splits(
            weights, batches[0].row_splits), None, None, None]
        outs = ge.group_embedding_lookup_sparse(
            params, batches, COMBINERS, sp_weights, training=training)
        loss = tf.add_n([tf.reduce_sum(o * p) for o, p in zip(outs, proj)])
    grads = tape.gradient(loss, evs + [weights])
    if training:
        optimizer.apply_gradients(zip(grads[:3], evs))
    return outs, grads


def test_fused_lookup_equals_tf_path(monkeypatch):
    rng = np.random.default_rng(0)
    fused, plain = _twins("parity")
    opts = {"custom": ge.optimizers.SGD(0.5), "tf": ge.optimizers.SGD(0.5)}
    for step in range(4):
        keys = [_batch(rng) for _ in range(4)]
        batches = [k for k, _ in keys]
        weights = keys[0][1]
        proj = [tf.constant(rng.normal(size=(7, 4)), tf.float32)
                for _ in range(4)]
        got, got_g = _step(fused, batches, weights, proj, opts["custom"],
                           "custom", monkeypatch)
        want, want_g = _step(plain, batches, weights, proj, opts["tf"], "tf",
                             monkeypatch)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"step {step}")
        held_back = np.allclose(got[2].numpy()[2], 0.5)
        assert held_back == (step <= 1)
        for g in got_g[1:3]:
            # The fused gradient names each key once, already summed
            # (evs[0] serves two tables, so gets two sets of keys).
            assert len(set(g.indices.numpy())) == len(g.indices.numpy())
        for g, w in zip(got_g[:3], want_g[:3]):
            gk, wk = _per_key(g), _per_key(w)
            assert gk.keys() == wk.keys()
            for k in wk:
                np.testing.assert_allclose(gk[k], wk[k], rtol=1e-5,
                                           atol=1e-6)
        np.testing.assert_allclose(got_g[3].numpy(), want_g[3].numpy(),
                                   rtol=1e-5, atol=1e-6)
        for a, b in zip(fused, plain):
            for x, y in zip(ev_cases.export_sorted(a)[:3],
                            ev_cases.export_sorted(b)[:3]):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("filtered", [False, True])
def test_inference_reads_defaults_without_inserting(monkeypatch, filtered):
    fused, plain = _twins(f"infer{int(filtered)}")
    evs = [fused[2 if filtered else 1], plain[2 if filtered else 1]]
    train = tf.ragged.constant([[3, 0], [3]], tf.int64)
    query = tf.ragged.constant([[3, 11], [], [-7, 3, 3]], tf.int64)
    outs = []
    for ev, mode in zip(evs, ("custom", "tf")):
        monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
        ge.group_embedding_lookup_sparse([ev], [train], "sum")
        (out,) = ge.group_embedding_lookup_sparse([ev], [query], "mean",
                                                  training=False)
        outs.append(out.numpy())
        assert int(ev.size()) == 2  # nothing inserted by the query
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6)
    assert not np.any(outs[0][1])  # empty row


def test_fused_gradient_keys_are_unique(monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    ev = ev_cases.make_ev("unique_keys")
    keys = tf.ragged.constant([[3, 3, 0], [0], [], [3, -7]], tf.int64)
    with tf.GradientTape() as tape:
        (out,) = ge.group_embedding_lookup_sparse([ev], [keys], "sum")
        loss = tf.reduce_sum(out)
    grad = tape.gradient(loss, ev)
    assert isinstance(grad, tf.IndexedSlices)
    np.testing.assert_array_equal(grad.indices.numpy(), [3, 0, -7])
    np.testing.assert_allclose(grad.values.numpy(),
                               np.array([[3.0] * 4, [2.0] * 4, [1.0] * 4]))


def _sequence_input(rng, order):
    """A `[6, 4]` SparseTensor of keys (ids at random columns of each row,
    some rows empty) with weights; `order` "row_major" or "shuffled"
    (columns out of order inside rows); also (row, col, key, weight)
    tuples for the oracle."""
    entries = []
    for b in range(6):
        cols = sorted(rng.choice(4, size=int(rng.integers(0, 4)),
                                 replace=False))
        entries += [(b, int(c), int(rng.choice(ev_cases.KEYS)),
                     float(rng.uniform(0.2, 2.0))) for c in cols]
    if order == "shuffled":
        entries = [entries[i] for i in rng.permutation(len(entries))]
    indices = np.array([e[:2] for e in entries], np.int64).reshape(-1, 2)
    keys = tf.SparseTensor(indices, [e[2] for e in entries], [6, 4])
    weights = tf.SparseTensor(indices, np.array([e[3] for e in entries],
                                                np.float32), [6, 4])
    return keys, weights, entries


@pytest.mark.parametrize("order", ["row_major", "shuffled"])
@pytest.mark.parametrize("weighted", [False, True],
                         ids=["unweighted", "weighted"])
@pytest.mark.parametrize("mode", ["custom", "tf"])
def test_sequence_lookup_matches_numpy(monkeypatch, mode, order, weighted):
    # EV sequences gather the keys' rows, then place each at its
    # [row, column] slot: in one sorted segment sum when the slots come in
    # order, else an unsorted one. Oracle: the keys' initial rows placed
    # by numpy; gradient per key = sum of its slots' upstream * weight.
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
    rng = np.random.default_rng(5)
    evs = [ev_cases.make_ev(f"seq_{mode}_{order}_{weighted}_{i}", seed=i)
           for i in range(2)]
    inputs = [_sequence_input(rng, order) for _ in evs]
    upstream = [rng.normal(size=(6, 4, 4)).astype(np.float32) for _ in evs]
    with tf.GradientTape() as tape:
        outs = ge.group_embedding_lookup_sparse(
            evs, [k for k, _, _ in inputs], "sum",
            sp_weights=[w for _, w, _ in inputs] if weighted else None,
            is_sequence=True)
        loss = tf.add_n([tf.reduce_sum(o * u)
                         for o, u in zip(outs, upstream)])
    grads = tape.gradient(loss, evs)
    for ev, out, grad, up, (_, _, entries) in zip(evs, outs, grads,
                                                  upstream, inputs):
        want = np.zeros([6, 4, 4], np.float32)
        want_grad = {}
        for b, c, key, w in entries:
            w = w if weighted else 1.0
            want[b, c] += ev_cases.initial_rows(ev, np.array([key]))[0] * w
            want_grad[key] = want_grad.get(key, 0.0) + up[b, c] * w
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
        got_grad = _per_key(grad)
        assert got_grad.keys() == want_grad.keys()
        for k in want_grad:
            np.testing.assert_allclose(got_grad[k], want_grad[k], rtol=1e-5,
                                       atol=1e-6)


@pytest.mark.parametrize("order", ["row_major", "shuffled"])
@pytest.mark.parametrize("mode", ["custom", "tf"])
def test_sequence_weight_gradients_in_graph(monkeypatch, mode, order):
    # In a tf.function, with the weights read from variables: d loss / d w
    # of an id is its key's row . the upstream of its slot.
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
    rng = np.random.default_rng(11)
    evs = [ev_cases.make_ev(f"seqw_{mode}_{order}_{i}", seed=i)
           for i in range(2)]
    inputs = [_sequence_input(rng, order) for _ in evs]
    w_vars = [tf.Variable(w.values) for _, w, _ in inputs]
    upstream = [rng.normal(size=(6, 4, 4)).astype(np.float32) for _ in evs]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            weights = [tf.SparseTensor(w.indices, v * 1.0, w.dense_shape)
                       for (_, w, _), v in zip(inputs, w_vars)]
            outs = ge.group_embedding_lookup_sparse(
                evs, [k for k, _, _ in inputs], "sum", sp_weights=weights,
                is_sequence=True)
            loss = tf.add_n([tf.reduce_sum(o * u)
                             for o, u in zip(outs, upstream)])
        return outs, tape.gradient(loss, w_vars)

    outs, w_grads = step()
    for ev, out, g, up, (_, _, entries) in zip(evs, outs, w_grads, upstream,
                                                inputs):
        want = np.zeros([6, 4, 4], np.float32)
        want_g = []
        for b, c, key, w in entries:
            row = ev_cases.initial_rows(ev, np.array([key]))[0]
            want[b, c] += row * w
            want_g.append(float(row @ up[b, c]))
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g.numpy(), want_g, rtol=1e-5, atol=1e-5)


def _sequence_step(evs, batches, upstream, optimizer, mode, monkeypatch,
                   training=True):
    """One unweighted sequence lookup (+ SGD update when training) of
    evs[0], evs[1], evs[2] (filtered) and evs[0] again (shared)."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
    params = [evs[0], evs[1], evs[2], evs[0]]

    @tf.function
    def lookup():
        with tf.GradientTape() as tape:
            outs = ge.group_embedding_lookup_sparse(
                params, batches, "sum", is_sequence=True, training=training)
            loss = tf.add_n([tf.reduce_sum(o * u)
                             for o, u in zip(outs, upstream)])
        return outs, tape.gradient(loss, evs)

    graph = lookup.get_concrete_function().graph
    kernel_ops = [op for op in graph.get_operations()
                  if op.type == "GroupEmbeddingEVSequenceLookup"]
    assert bool(kernel_ops) == (mode == "custom")
    outs, grads = lookup()
    if training:
        optimizer.apply_gradients(zip(grads, evs))
    return outs, grads


def test_sequence_kernel_equals_gather_path(monkeypatch):
    # Twin variables, four training steps then an inference lookup: the
    # kernel's [B, T, D] outputs, per-key gradients (unique keys) and the
    # stored keys, values and frequencies equal the gather path's, with a
    # CounterFilter holding keys back and one variable serving two tables.
    rng = np.random.default_rng(3)
    fused, plain = _twins("seq_parity")
    opts = {"custom": ge.optimizers.SGD(0.5), "tf": ge.optimizers.SGD(0.5)}
    for step in range(5):
        training = step < 4
        inputs = [_sequence_input(rng, "shuffled" if t % 2 else "row_major")
                  for t in range(4)]
        batches = [k for k, _, _ in inputs]
        upstream = [tf.constant(rng.normal(size=(6, 4, 4)), tf.float32)
                    for _ in range(4)]
        got, got_g = _sequence_step(fused, batches, upstream,
                                    opts["custom"], "custom", monkeypatch,
                                    training)
        want, want_g = _sequence_step(plain, batches, upstream, opts["tf"],
                                      "tf", monkeypatch, training)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"step {step}")
        for g in got_g[1:]:
            # Unique keys (evs[0] serves two tables: two sets of them).
            assert len(set(g.indices.numpy())) == len(g.indices.numpy())
        for g, w in zip(got_g, want_g):
            gk, wk = _per_key(g), _per_key(w)
            assert gk.keys() == wk.keys()
            for k in wk:
                np.testing.assert_allclose(gk[k], wk[k], rtol=1e-5,
                                           atol=1e-6)
        for a, b in zip(fused, plain):
            for x, y in zip(ev_cases.export_sorted(a)[:3],
                            ev_cases.export_sorted(b)[:3]):
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _stock_pooled(table, rows, weights, combiner):
    """Stock `embedding_lookup_sparse` of oracle row numbers (ragged),
    weighted when `weights` (ragged) is given, padded to the batch."""
    sp = rows.to_sparse()
    sp_w = None if weights is None else weights.to_sparse()
    out = tf.nn.embedding_lookup_sparse(table, sp, sp_w, combiner=combiner)
    pad = tf.cast(sp.dense_shape[0], tf.int32) - tf.shape(out)[0]
    return tf.pad(out, [[0, pad], [0, 0]])


class _StockTwin:
    """The stock-TF oracle of `_step`'s three EVs: plain tables whose row
    r holds key `KEYS[r]` (from its initial row), stock lookups, and SGD
    written out in TF ops. The CounterFilter is counted here in numpy:
    a key reads the filter's constant while counted fewer than
    `filter_freq` times before the batch, and the batch's gradient
    reaches its row once the batch's own occurrences admit it."""

    def __init__(self, evs, filter_freq, no_permission, lr):
        self.tables = [tf.Variable(ev_cases.initial_rows(ev, ev_cases.KEYS))
                       for ev in evs]
        self.counts = np.zeros(len(ev_cases.KEYS), np.int64)
        self.seen = [set() for _ in evs]  # oracle rows of stored keys
        self.filter_freq, self.no_permission, self.lr = (
            filter_freq, no_permission, lr)

    def step(self, batches, weights, proj, training=True):
        rows = [ev_cases.to_rows(b) for b in batches]
        filtered_ids = rows[2].values.numpy()
        before = self.counts >= self.filter_freq
        after_counts = self.counts + np.bincount(
            filtered_ids, minlength=len(self.counts))
        with tf.GradientTape() as tape:
            tape.watch(weights)
            reads = [t.read_value() for t in self.tables]
            tape.watch(reads)
            # Keys not admitted before the batch read the constant.
            reads_filtered = tf.where(before[:, None], reads[2],
                                      self.no_permission)
            params = [reads[0], reads[1], reads_filtered, reads[0]]
            sp_weights = [tf.RaggedTensor.from_row_splits(
                weights, batches[0].row_splits), None, None, None]
            outs = [_stock_pooled(p, r, w, c) for p, r, w, c in
                    zip(params, rows, sp_weights, COMBINERS)]
            loss = tf.add_n([tf.reduce_sum(o * p)
                             for o, p in zip(outs, proj)])
        # The filtered table's gradient is taken at what its keys read,
        # held back or not: the library applies it to a key admitted by
        # this very batch.
        grads = tape.gradient(loss, reads[:2] + [reads_filtered, weights])
        grads = [tf.convert_to_tensor(g).numpy() for g in grads[:3]] + [
            grads[3].numpy()]
        if training:
            self.counts = after_counts
            admitted = (after_counts >= self.filter_freq)[:, None]
            updates = grads[:2] + [grads[2] * admitted]
            for t, g in zip(self.tables, updates):
                t.assign_sub(self.lr * g)
            for s, r in zip(self.seen, [rows[0], rows[1], rows[2]]):
                s.update(r.values.numpy().tolist())
            self.seen[0].update(rows[3].values.numpy().tolist())
        return outs, grads


@pytest.mark.parametrize("mode", ["custom", "tf"])
def test_training_equals_stock(monkeypatch, mode):
    """Each EV path against stock TF (not against the other path, with
    which it shares the storage code): a weighted EV that also serves a
    second table of the group, a plain one and a CounterFilter'ed one,
    four SGD steps on batches with duplicate keys within and across rows.
    Outputs, per-key table gradients, weight gradients, and after each
    step the stored keys and rows must equal the stock oracle's."""
    rng = np.random.default_rng(0)
    evs, _ = _twins(f"stock_{mode}")
    opt = ge.optimizers.SGD(0.5)
    oracle = _StockTwin(evs, 2, 0.5, 0.5)
    index = {int(k): i for i, k in enumerate(ev_cases.KEYS)}
    for step in range(4):
        keys = [_batch(rng) for _ in range(4)]
        batches = [k for k, _ in keys]
        weights = keys[0][1]
        proj = [tf.constant(rng.normal(size=(7, 4)), tf.float32)
                for _ in range(4)]
        got, got_g = _step(evs, batches, weights, proj, opt, mode,
                           monkeypatch)
        want, want_g = oracle.step(batches, weights, proj)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"step {step}")
        for t, (g, w) in enumerate(zip(got_g[:3], want_g[:3])):
            per_key = _per_key(g)
            # Keys the batch holds, with their summed gradient rows; the
            # oracle's gradient rows of other keys are zero.
            for k, row in per_key.items():
                np.testing.assert_allclose(row, w[index[k]], rtol=1e-5,
                                           atol=1e-6, err_msg=(step, t, k))
            absent = [i for k, i in index.items() if k not in per_key]
            assert not np.any(w[absent])
        np.testing.assert_allclose(got_g[3].numpy(), want_g[3], rtol=1e-5,
                                   atol=1e-6)
        for t, (ev, table) in enumerate(zip(evs, oracle.tables)):
            stored, values, _, _ = ev_cases.export_sorted(ev)
            assert sorted(index[int(k)] for k in stored) == sorted(
                oracle.seen[t])
            np.testing.assert_allclose(
                values, table.numpy()[[index[int(k)] for k in stored]],
                rtol=1e-5, atol=1e-6, err_msg=f"step {step} table {t}")
