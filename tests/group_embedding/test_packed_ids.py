"""`ge.pack_ids`: packed ids look up exactly as the lists they came from.

Oracles: stock `tf.nn.embedding_lookup_sparse` per table (forward), a
plain `tf.Variable` trained with `keras.optimizers.Adagrad` on stock
lookups (backward + update), and numpy for sequences.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import capabilities

from testing import assert_close
from testing import random_case
from testing import stock_lookup
from testing import to_dense

COMBINERS = ["sum", "mean", "sqrtn", "mean"]


def _case(seed, weighted=(False, True, False, True), kinds=None):
    kinds = kinds or ["sparse", "ragged", "sparse", "sparse"]
    return random_case(seed, [4, 4, 4, 3], kinds, COMBINERS,
                       weighted=list(weighted), trailing_empty=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weighted", [(False,) * 4, (False, True, False,
                                                     True)])
def test_pooled_matches_stock(kernel_mode, seed, weighted):
    case = _case(seed, weighted)
    weights = case.sp_weights()
    packed = ge.pack_ids(case.sp_ids(), weights)
    assert packed.weighted == any(weighted)
    want = case.stock(weights)
    eager = ge.group_embedding_lookup_sparse(case.tables, packed,
                                             case.combiners)
    traced = tf.function(lambda p: ge.group_embedding_lookup_sparse(
        case.tables, p, case.combiners))(packed)
    for w, e, t in zip(want, eager, traced):
        assert_close(e, w)
        assert_close(t, w)


def test_concat_outputs_matches_stock(kernel_mode):
    case = _case(3)
    tables = case.tables[:3]
    ids = case.sp_ids()[:3]
    weights = case.sp_weights()[:3]
    got = ge.group_embedding_lookup_sparse(
        tables, ge.pack_ids(ids, weights), COMBINERS[:3],
        concat_outputs=True)
    assert_close(got, tf.concat(case.stock(weights)[:3], 1))


def test_training_matches_stock_adagrad(kernel_mode):
    """Three Adagrad steps through packed ids (weights included) leave the
    tables where stock lookups + Keras Adagrad leave plain copies."""
    case = _case(4, weighted=(False, True, True, False))
    tables = case.tables[:3]
    ids, weights = case.sp_ids()[:3], case.sp_weights()[:3]
    combiners = COMBINERS[:3]
    ours = [tf.Variable(t) for t in tables]
    ref = [tf.Variable(t) for t in tables]
    packed = ge.pack_ids(ids, weights)
    opt = ge.optimizers.Adagrad(0.1)
    ref_opt = keras.optimizers.Adagrad(0.1)
    # Mixed output columns, so that each table gets its own gradient.
    scale = tf.range(1.0, 13.0)

    @tf.function
    def step(p):
        with tf.GradientTape() as tape:
            out = ge.group_embedding_lookup_sparse(ours, p, combiners,
                                                   concat_outputs=True)
            loss = tf.reduce_sum(tf.square(out) * scale)
        opt.apply_gradients(zip(tape.gradient(loss, ours), ours))

    @tf.function
    def ref_step():
        with tf.GradientTape() as tape:
            out = tf.concat([stock_lookup(t, i, w, c, case.batch_size)
                             for t, i, w, c in zip(ref, ids, weights,
                                                   combiners)], 1)
            loss = tf.reduce_sum(tf.square(out) * scale)
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref), ref))

    for _ in range(3):
        step(packed)
        ref_step()
    for a, b in zip(ours, ref):
        assert_close(a, b)


def test_sequence_slots_follow_columns(kernel_mode):
    """Sequence slots are the ids' ranks in their rows, in column order
    even when the SparseTensor's indices come shuffled."""
    case = _case(5, weighted=(False, True, False, False),
                 kinds=["sparse", "sparse", "ragged", "sparse"])
    ids, weights = case.sp_ids(), case.sp_weights()
    got = ge.group_embedding_lookup_sparse(
        case.tables, ge.pack_ids(ids, weights), case.combiners,
        is_sequence=True)
    for table, feature, out in zip(case.tables, case.features, got):
        lens = [len(r) for r in feature.rows]
        want = np.zeros([feature.batch_size, max(lens), table.shape[1]],
                        np.float32)
        for b, row in enumerate(feature.rows):
            order = np.argsort(feature.cols[b], kind="stable")
            for slot, j in enumerate(order):
                w = (1.0 if feature.weights is None
                     else feature.weights[b][j])
                want[b, slot] = table.numpy()[row[j]] * w
        assert_close(out, want)


def _per_key(grad):
    """IndexedSlices keyed by key -> {key: summed gradient row}."""
    out = {}
    for k, g in zip(grad.indices.numpy(), grad.values.numpy()):
        out[int(k)] = out.get(int(k), 0.0) + g
    return out


def test_embedding_variables_match_stock(kernel_mode):
    """Packed keys into EVs look up (and differentiate) as stock lookups
    of the same ids into plain tables holding the EVs' rows.

    Each EV's default matrix is a random table of `vocab` rows with
    `default_value_dim=vocab`, so key k starts from row k: a key that
    pack_ids shifts or moves to another row reads another row (all-ones
    tables, as before, saw only the row lengths). Ids repeat within and
    across rows and come shuffled (SparseTensor features)."""
    # 8 rows over 7 keys: ids repeat within and across rows.
    case = random_case(6, [4, 4], ["sparse", "ragged"], ["sum", "mean"],
                       weighted=[False, True], batch_size=8, vocab=7,
                       max_len=5, trailing_empty=1)
    tables = [t.numpy() for t in case.tables]
    evs = [ge.get_embedding_variable(
        f"packed_ev{i}_{kernel_mode}", embedding_dim=t.shape[1],
        ev_option=ge.EmbeddingVariableOption(
            init_option=ge.InitializerOption(
                initializer=tf.constant_initializer(t),
                default_value_dim=t.shape[0])))
        for i, t in enumerate(tables)]
    ids, weights = case.sp_ids(), case.sp_weights()
    combiners = case.combiners
    rng = np.random.default_rng(6)
    upstream = [rng.normal(size=(case.batch_size, t.shape[1]))
                .astype(np.float32) for t in tables]
    with tf.GradientTape() as tape:
        got = ge.group_embedding_lookup_sparse(
            evs, ge.pack_ids(ids, weights), combiners)
        loss = tf.add_n([tf.reduce_sum(o * u) for o, u in zip(got, upstream)])
    grads = tape.gradient(loss, evs)
    ref = [tf.Variable(t) for t in tables]
    with tf.GradientTape() as tape:
        want = [stock_lookup(t, i, w, c, case.batch_size)
                for t, i, w, c in zip(ref, ids, weights, combiners)]
        ref_loss = tf.add_n([tf.reduce_sum(o * u)
                             for o, u in zip(want, upstream)])
    ref_grads = tape.gradient(ref_loss, ref)
    for ev, feature, g, w, grad, ref_grad in zip(
            evs, case.features, got, want, grads, ref_grads):
        assert_close(g, w)
        # Exactly the batch's keys were inserted, each key's gradient is
        # the stock gradient of its row (all occurrences summed).
        seen = np.unique(np.concatenate(feature.rows))
        np.testing.assert_array_equal(np.sort(ev.export()[0].numpy()), seen)
        dense = to_dense(ref_grad)
        per_key = _per_key(grad)
        assert sorted(per_key) == seen.tolist()
        for k in seen:
            assert_close(per_key[int(k)], dense[k])


def test_tf_data_pipeline_traces_once(kernel_mode):
    """Packed in `Dataset.map`, batches of different id counts and sizes
    run through ONE trace of the step."""
    rng = np.random.default_rng(7)
    table = tf.Variable(rng.normal(size=(30, 4)).astype(np.float32))
    rows = tf.ragged.constant([list(rng.integers(0, 30, n))
                               for n in rng.integers(0, 4, 12)],
                              dtype=tf.int64)
    # Batches of 5, 5 and 2 rows: different id counts and batch sizes.
    batches = tf.data.Dataset.from_tensor_slices(rows).batch(5)
    ds = batches.map(lambda x: ge.pack_ids([x, x]))
    traces = []

    @tf.function
    def lookup(p):
        traces.append(1)
        return ge.group_embedding_lookup_sparse([table, table], p,
                                                ["sum", "mean"])

    for p, x in zip(ds, batches):
        got = lookup(p)
        want = ge.group_embedding_lookup_sparse([table, table], [x, x],
                                                ["sum", "mean"])
        for g, w in zip(got, want):
            assert_close(g, w)
    assert len(traces) == 1


def test_unaligned_hand_made_layout(kernel_mode):
    """Features need not start on 8 ids: the kernels copy what they cannot
    view."""
    table = tf.Variable(np.arange(40, dtype=np.float32).reshape(10, 4))
    packed = ge.PackedIds(
        values=tf.constant([1, 2, 3, 4, 5, 6], tf.int64),
        row_splits=tf.constant([[0, 1, 3], [0, 2, 3]], tf.int64),
        offsets=tf.constant([0, 3], tf.int64),
        batch=tf.constant(2, tf.int64),
        weights=tf.zeros([0]))
    got = ge.group_embedding_lookup_sparse([table, table], packed, "sum")
    t = table.numpy()
    assert_close(got[0], [t[1], t[2] + t[3]])
    assert_close(got[1], [t[4] + t[5], t[6]])


@pytest.mark.parametrize("field,value,needle", [
    ("offsets", [0, 5], "packed ids"),
    ("offsets", [-1, 3], "packed ids"),
    ("offsets", [0, 0], "packed ids"),
    ("offsets", [3, 0], "packed ids"),
    ("row_splits", [[1, 1, 3], [0, 2, 3]], "packed ids"),
    ("row_splits", [[0, 3, 1], [0, 2, 3]], "packed ids"),
    ("batch", 3, "packed ids"),
    ("batch", -1, "packed ids"),
])
def test_bad_layout_is_a_clear_error(kernel_mode, field, value, needle):
    fields = dict(values=tf.constant([1, 2, 3, 4, 5, 6], tf.int64),
                  row_splits=tf.constant([[0, 1, 3], [0, 2, 3]], tf.int64),
                  offsets=tf.constant([0, 3], tf.int64),
                  batch=tf.constant(2, tf.int64), weights=tf.zeros([0]))
    fields[field] = tf.constant(value, tf.int64)
    table = tf.Variable(tf.ones([10, 4]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=needle):
        ge.group_embedding_lookup_sparse([table, table],
                                         ge.PackedIds(**fields), "sum")


def test_argument_errors():
    table = tf.Variable(tf.ones([10, 4]))
    ids = [tf.ragged.constant([[1], [2]], tf.int64)] * 2
    packed = ge.pack_ids(ids)
    with pytest.raises(ValueError, match="2 features but `params` has 3"):
        ge.group_embedding_lookup_sparse([table] * 3, packed, "sum")
    with pytest.raises(ValueError, match="carry their weights"):
        ge.group_embedding_lookup_sparse([table] * 2, packed, "sum",
                                         sp_weights=[None, None])
    with pytest.raises(ValueError, match="batch size"):
        ge.pack_ids([ids[0], tf.ragged.constant([[1]], tf.int64)])
    with pytest.raises(TypeError, match="non-empty list"):
        ge.pack_ids([])


def _address(t):
    return t._numpy().__array_interface__["data"][0]  # noqa: SLF001


@pytest.mark.skipif(capabilities.current().kernels is None, reason="no kernels")
def test_kernel_views_packed_buffers():
    """Aligned features come out of GroupEmbeddingUnpackIds as views of the
    packed
    buffers (no copy)."""
    ids = [tf.ragged.constant([[1, 2, 3], [4]], tf.int64),
           tf.ragged.constant([[5], [6, 7]], tf.int64)]
    p = ge.pack_ids(ids)
    lib = capabilities.current().kernels
    out_ids, out_splits, _ = lib.group_embedding_unpack_ids(
        values=p.values, row_splits=p.row_splits, offsets=p.offsets,
        batch=p.batch, weights=p.weights, num_features=2)
    assert [x.numpy().tolist() for x in out_ids] == [[1, 2, 3, 4],
                                                     [5, 6, 7]]
    assert [x.numpy().tolist() for x in out_splits] == [[0, 3, 4],
                                                        [0, 1, 3]]
    base = _address(p.values)
    assert [_address(x) - base for x in out_ids] == [
        8 * int(o) for o in p.offsets.numpy()]
    width = int(p.row_splits.shape[1])
    assert [_address(x) - _address(p.row_splits) for x in out_splits] == [
        0, 8 * width]
