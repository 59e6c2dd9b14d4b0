"""Weight gradients of the C++ lookups: computed only when asked for in a
`tf.function` training step, and right whatever mode the table is in.

TF's automatic control dependencies keep every op that takes a resource,
so the weight-gradient ops read `GroupEmbeddingTableSnapshot` outputs
instead of the variables; these tests pin both halves of that design.
"""

import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import capabilities
from group_embedding.ops import kernel_library

from testing import assert_close
from testing import random_case
from testing import to_dense

WEIGHT_GRAD_OPS = ("GroupEmbeddingWeightGradFromSnapshots",
                   "GroupEmbeddingSequenceWeightGradFromSnapshots",
                   "GroupEmbeddingWeightGrad",
                   "GroupEmbeddingSequenceWeightGrad")


@pytest.fixture(autouse=True)
def _custom_kernels(monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    assert capabilities.current().kernels is not None, \
        kernel_library.unavailable_reason()


def _ops_that_run(concrete):
    """Types of the ops a call of `concrete` runs: those the outputs and
    the control outputs reach through data and control edges."""
    graph = concrete.graph
    todo = [t.op for t in graph.outputs] + list(graph.control_outputs)
    seen = set()
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op.type for op in seen]


def _case():
    return random_case(0, dims=[4, 4, 4], kinds=["sparse", "ragged",
                                                 "sparse"],
                       combiners=["sum", "mean", "sqrtn"], weighted=True,
                       batch_size=6, max_len=4)


# concat_outputs is for pooled lookups only.
@pytest.mark.parametrize("is_sequence,concat",
                         [(False, False), (False, True), (True, False)],
                         ids=["pooled", "pooled-concat", "sequence"])
def test_unused_weight_gradients_do_not_run(is_sequence, concat):
    case = _case()
    opt = ge.optimizers.Adagrad(0.1)
    opt.build(case.tables)
    w_var = tf.Variable(case.features[0].flat_weights())

    def step(ids, differentiate_weights):
        with tf.GradientTape() as tape:
            weights = case.sp_weights()
            if differentiate_weights:
                weights[0] = case.features[0].sp_weights(w_var * 1.0)
            out = ge.group_embedding_lookup_sparse(
                case.tables, ids, case.combiners, sp_weights=weights,
                is_sequence=is_sequence, concat_outputs=concat)
            loss = tf.add_n([tf.reduce_sum(tf.square(o))
                             for o in tf.nest.flatten(out)])
        sources = case.tables + ([w_var] if differentiate_weights else [])
        grads = tape.gradient(loss, sources)
        opt.apply_gradients(zip(grads[:len(case.tables)], case.tables))
        return grads[len(case.tables):]

    plain = tf.function(lambda ids: step(ids, False))
    ran = _ops_that_run(plain.get_concrete_function(case.sp_ids()))
    assert not set(WEIGHT_GRAD_OPS) & set(ran), ran
    plain(case.sp_ids())
    # Control: asked for, the weight gradient runs (and is returned).
    wanted = tf.function(lambda ids: step(ids, True))
    ran = _ops_that_run(wanted.get_concrete_function(case.sp_ids()))
    assert set(WEIGHT_GRAD_OPS) & set(ran), ran
    (g,) = wanted(case.sp_ids())
    assert g is not None


def _loss(outputs):
    # Squares: every weight gets a distinct, data-dependent gradient.
    return tf.add_n([tf.reduce_sum(tf.square(o) * (i + 1.0))
                     for i, o in enumerate(outputs)])


@pytest.mark.parametrize("is_sequence", [False, True],
                         ids=["pooled", "sequence"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_weight_gradients_of_a_copy_on_read_table(is_sequence, graph):
    # tf.gather puts a variable in copy-on-read mode: the snapshot then
    # copies the ids' rows instead of aliasing the table; the gradients
    # must not change (oracle: stock embedding_lookup_sparse).
    case = _case()
    for t in case.tables:
        tf.gather(t, [0])
    w_vars = [tf.Variable(f.flat_weights()) for f in case.features]

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            weights = case.sp_weights([v * 1.0 for v in w_vars])
            got = ge.group_embedding_lookup_sparse(
                case.tables, case.sp_ids(), case.combiners,
                sp_weights=weights, is_sequence=is_sequence)
            got_loss = _loss(got)
        return tape.gradient(got_loss, w_vars)

    got = tf.function(grads)() if graph else grads()
    with tf.GradientTape() as tape:
        weights = case.sp_weights([v * 1.0 for v in w_vars])
        if is_sequence:
            want = ge.group_embedding_lookup_sparse(
                case.tables, case.sp_ids(), case.combiners,
                sp_weights=weights, is_sequence=True)
        else:
            want = case.stock(weights)
        want_loss = _loss(want)
    if is_sequence:
        # Oracle for sequences: the same lookup on tables that were never
        # put in copy-on-read mode.
        fresh = [tf.Variable(t.numpy()) for t in case.tables]
        with tf.GradientTape() as tape:
            weights = case.sp_weights([v * 1.0 for v in w_vars])
            want = ge.group_embedding_lookup_sparse(
                fresh, case.sp_ids(), case.combiners, sp_weights=weights,
                is_sequence=True)
            want_loss = _loss(want)
    for g, w, v in zip(got, tape.gradient(want_loss, w_vars), w_vars):
        assert_close(g, to_dense(w, v.shape))


def test_snapshot_rejects_bad_ids():
    lib = kernel_library.library()
    table = tf.Variable(tf.ones([4, 2]))
    rows, by_position = lib.group_embedding_table_snapshot(
        table=table.handle, ids=tf.constant([3, 0], tf.int64),
        table_name="clicks")
    assert not bool(by_position) and rows.shape == (4, 2)
    tf.gather(table, [0])  # copy-on-read mode: rows of the ids only
    rows, by_position = lib.group_embedding_table_snapshot(
        table=table.handle, ids=tf.constant([3, 0], tf.int64),
        table_name="clicks")
    assert bool(by_position) and rows.shape == (2, 2)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"clicks: id 4 is out of range \[0, 4\)"):
        lib.group_embedding_table_snapshot(
            table=table.handle, ids=tf.constant([4], tf.int64),
            table_name="clicks")
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="ids must be a vector|rank"):
        lib.group_embedding_table_snapshot(
            table=table.handle, ids=tf.constant([[1]], tf.int64),
            table_name="clicks")
