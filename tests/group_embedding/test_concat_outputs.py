"""`group_embedding_lookup_sparse(..., concat_outputs=True)` against stock
TF: the concat of stock `embedding_lookup_sparse` outputs, forward and
backward (tables and weights), on both kernel paths; the C++ path writes
the concatenated output itself (no ConcatV2, no split of its gradient).
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import capabilities
from group_embedding.ops import kernel_library

from testing import assert_close
from testing import random_case
from testing import stock_lookup
from testing import to_dense

# One group in params order; two groups with a dim-8 table between dim-4
# ones (their group is not consecutive); weights on some tables; empty rows.
CASES = {
    "one_group": dict(dims=[4] * 5, kinds=["sparse", "ragged"] * 2
                      + ["sparse"], combiners=["sum", "mean", "sqrtn",
                                               "sum", "mean"]),
    "interleaved_groups": dict(dims=[4, 4, 8, 4],
                               kinds=["sparse", "ragged", "sparse",
                                      "ragged"],
                               combiners=["sum", "mean", "sqrtn", "mean"]),
    "consecutive_groups": dict(dims=[4, 4, 8, 8],
                               kinds=["sparse"] * 4,
                               combiners=["mean", "sum", "sqrtn", "sum"]),
    "weighted": dict(dims=[4, 4, 4], kinds=["sparse", "ragged", "sparse"],
                     combiners=["sum", "mean", "sqrtn"],
                     weighted=[True, False, True]),
    "trailing_empty_rows": dict(dims=[3, 3], kinds=["sparse", "ragged"],
                                combiners=["mean", "sqrtn"], batch_size=6,
                                trailing_empty=3),
    "all_rows_empty": dict(dims=[2, 2], kinds=["sparse", "ragged"],
                           combiners=["sum", "mean"], batch_size=4,
                           empty_prob=1.0),
    # Tables whose gradient sums outgrow the cache (the kernel's second
    # way of building them).
    "many_distinct_ids": dict(dims=[64, 64], kinds=["sparse", "ragged"],
                              combiners=["sum", "sqrtn"],
                              weighted=[False, True], vocab=6000,
                              batch_size=2000, max_len=5),
}
SEEDS = (0, 1)


def _column_scale(outputs_width, seed):
    return tf.constant(np.random.default_rng(seed).normal(
        size=(1, outputs_width)).astype(np.float32))


@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["plain", "max_norm"])
@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_concat_of_stock(kernel_mode, name, seed, max_norm):
    case = random_case(seed, **CASES[name])
    width = sum(int(t.shape[1]) for t in case.tables)
    scale = _column_scale(width, seed)
    w_vars = [None if f.weights is None else tf.Variable(f.flat_weights())
              for f in case.features]

    def weights():
        if all(v is None for v in w_vars):
            return None
        return case.sp_weights([None if v is None else v * 1.0
                                for v in w_vars])

    with tf.GradientTape(persistent=True) as tape:
        got = ge.group_embedding_lookup_sparse(
            case.tables, case.sp_ids(), case.combiners, sp_weights=weights(),
            max_norm=max_norm, concat_outputs=True)
        want = tf.concat(case.stock(weights(), max_norm=max_norm), 1)
        got_loss = tf.reduce_sum(got * scale)
        want_loss = tf.reduce_sum(want * scale)
    assert isinstance(got, tf.Tensor)
    assert got.shape == (case.batch_size, width)
    assert_close(got, want)
    for i, t in enumerate(case.tables):
        g = tape.gradient(got_loss, t)
        assert isinstance(g, tf.IndexedSlices), f"table {i}"
        assert_close(g, to_dense(tape.gradient(want_loss, t), t.shape))
    for i, v in enumerate(w_vars):
        if v is not None:
            assert_close(tape.gradient(got_loss, v),
                         to_dense(tape.gradient(want_loss, v), v.shape))


def _graph_ops(fn, *args):
    return [op.type for op in fn.get_concrete_function(*args).graph
            .get_operations()]


def test_kernel_writes_the_concatenated_output(monkeypatch):
    """On the C++ path ONE concat-lookup op makes the output, and the
    training graph has no ConcatV2 (forward) nor split (backward)."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    assert capabilities.current().kernels is not None, \
        kernel_library.unavailable_reason()
    case = random_case(0, **CASES["one_group"])
    ids = case.sp_ids()
    opt = ge.optimizers.Adagrad(0.1)
    opt.build(case.tables)

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            out = ge.group_embedding_lookup_sparse(
                case.tables, ids, case.combiners, concat_outputs=True)
            loss = tf.reduce_sum(tf.square(out))
        opt.apply_gradients(zip(tape.gradient(loss, case.tables),
                                case.tables))
        return out

    ops = _graph_ops(step, ids)
    assert ops.count("GroupEmbeddingConcatLookup") == 1
    assert ops.count("GroupEmbeddingConcatLookupGrad") == 1
    assert "GroupEmbeddingPooledLookup" not in ops
    assert not {"ConcatV2", "SplitV", "Split"} & set(ops), ops
    # Static width in graphs: a dense layer after it needs shape[-1].
    spec = step.get_concrete_function(ids).structured_outputs
    assert spec.shape[-1] == sum(int(t.shape[1]) for t in case.tables)
    # The step trains like per-table outputs concatenated by hand.
    ref_tables = [tf.Variable(t.numpy()) for t in case.tables]
    ref_opt = ge.optimizers.Adagrad(0.1)
    ref_opt.build(ref_tables)
    for _ in range(3):
        step(ids)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.concat(
                [stock_lookup(t, i, None, c, case.batch_size)
                 for t, i, c in zip(ref_tables, ids, case.combiners)], 1)))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref_tables),
                                    ref_tables))
    for t, r in zip(case.tables, ref_tables):
        assert_close(t, r)


def test_sequence_is_refused():
    case = random_case(0, **CASES["one_group"])
    with pytest.raises(ValueError, match="is_sequence"):
        ge.group_embedding_lookup_sparse(case.tables, case.sp_ids(),
                                         case.combiners, is_sequence=True,
                                         concat_outputs=True)


def test_bad_id_names_its_table(kernel_mode):
    table = tf.Variable(tf.ones([5, 2]), name="clicks")
    other = tf.Variable(tf.ones([5, 2]), name="views")
    ok = tf.ragged.constant([[1], [2, 3]], tf.int64)
    bad = tf.ragged.constant([[4], [7]], tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"(?s)(views|params\[1\]).*(7|out of range"
                             r"|must lie in)"):
        ge.group_embedding_lookup_sparse([table, other], [ok, bad], "sum",
                                         concat_outputs=True)
