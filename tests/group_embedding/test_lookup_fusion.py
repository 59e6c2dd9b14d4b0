"""Fusion and tracing of the grouped lookup inside `tf.function`.

* one fused op per group, forward and backward (op counts of the traced
  graphs), `params_num_per_group` splitting a group;
* no retrace when only the batch size changes.
"""

import pytest
import tensorflow as tf

import group_embedding as ge

from testing import assert_close
from testing import op_counts
from testing import random_case

# 6 tables of dim 4 and 2 of dim 8: two groups.
DIMS = [4] * 6 + [8] * 2
COMBINERS = ["sum", "mean", "sqrtn"] * 2 + ["mean", "sum"]
KINDS = ["sparse", "ragged"] * 4
WEIGHTED = [True, False, False, True, False, False, True, False]

# Ops that would mean a per-table gather / reduction on the embedding path.
_UNFUSED = ("Gather", "Segment")


def _case(dims=DIMS, combiners=COMBINERS):
    return random_case(0, dims, (KINDS * 2)[:len(dims)], combiners,
                       weighted=(WEIGHTED * 2)[:len(dims)], batch_size=5,
                       vocab=9, max_len=3, empty_prob=0.2)


def _traced(case, fn):
    """Traces `fn(ids, weights)` on `case`'s inputs; returns (graph,
    result of running it)."""
    func = tf.function(fn)
    ids, weights = case.sp_ids(), case.sp_weights()
    concrete = func.get_concrete_function(ids, weights)
    return concrete.graph, func(ids, weights)


def _forward(case, **kwargs):
    def fn(ids, weights):
        return ge.group_embedding_lookup_sparse(
            case.tables, ids, case.combiners, sp_weights=weights, **kwargs)
    return _traced(case, fn)


def _backward(case, with_weights, **kwargs):
    def fn(ids, weights):
        with tf.GradientTape() as tape:
            outs = ge.group_embedding_lookup_sparse(
                case.tables, ids, case.combiners,
                sp_weights=weights if with_weights else None, **kwargs)
            loss = tf.add_n([tf.reduce_sum(o * o) for o in outs])
        return tape.gradient(loss, case.tables)
    return _traced(case, fn)


def _unfused_ops(graph):
    return {t: n for t, n in op_counts(graph).items()
            if any(u in t for u in _UNFUSED)}


def _stock_grads(case, with_weights):
    weights = case.sp_weights() if with_weights else None
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(o * o)
                         for o in case.stock(weights)])
    return tape.gradient(loss, case.tables)


@pytest.mark.parametrize("kernel_mode", ["custom"], indirect=True)
def test_custom_forward_is_one_op_per_group(kernel_mode):
    case = _case()
    graph, outs = _forward(case)
    counts = op_counts(graph)
    assert counts["GroupEmbeddingPooledLookup"] == 2
    assert _unfused_ops(graph) == {}
    assert counts["ResourceGather"] == 0 and counts["GatherV2"] == 0
    for got, want in zip(outs, case.stock(case.sp_weights())):
        assert_close(got, want)


@pytest.mark.parametrize("kernel_mode", ["custom"], indirect=True)
def test_custom_backward_is_one_op_per_group(kernel_mode):
    case = _case()
    graph, grads = _backward(case, with_weights=False)
    counts = op_counts(graph)
    assert counts["GroupEmbeddingPooledLookup"] == 2
    assert counts["GroupEmbeddingPooledLookupGrad"] == 2
    assert _unfused_ops(graph) == {}
    for got, want, t in zip(grads, _stock_grads(case, False), case.tables):
        assert isinstance(got, tf.IndexedSlices)
        assert_close(got, want)


@pytest.mark.parametrize("kernel_mode", ["custom"], indirect=True)
def test_custom_weighted_backward_is_one_grad_op_per_group(kernel_mode):
    case = _case()
    graph, grads = _backward(case, with_weights=True)
    assert op_counts(graph)["GroupEmbeddingPooledLookupGrad"] == 2
    for got, want in zip(grads, _stock_grads(case, True)):
        assert isinstance(got, tf.IndexedSlices)
        assert_close(got, want)


@pytest.mark.parametrize("kernel_mode", ["custom"], indirect=True)
def test_custom_weighted_backward_has_no_per_table_gather(kernel_mode):
    case = _case()
    graph, _ = _backward(case, with_weights=True)
    assert _unfused_ops(graph) == {}


@pytest.mark.parametrize("taped", [False, True],
                         ids=["inference", "training"])
@pytest.mark.parametrize("kernel_mode", ["tf"], indirect=True)
def test_tf_path_pools_per_table_without_concat_or_split(kernel_mode, taped):
    # Per table one sparse-matrix product: in training over the distinct
    # rows (one unique each), in inference (no tape) straight over the
    # table (no unique, no gather). The tables' rows are never
    # concatenated nor the outputs split (copies that cost more on CPU
    # than the per-table ops they save). Each "mean" / "sqrtn" table also
    # sums its ids' counts or weights, and nothing else reduces segments.
    case = _case()
    if taped:
        graph, _ = _backward(case, with_weights=True)
        outs = case.stock(case.sp_weights())  # checked by the grad tests
    else:
        graph, outs = _forward(case)
    counts = op_counts(graph)
    assert counts["Unique"] == (len(DIMS) if taped else 0)
    assert counts["ResourceGather"] == (len(DIMS) if taped else 0)
    products = counts["SparseTensorDenseMatMul"]
    # Training: each forward product has a transposed one as gradient.
    assert products == (2 * len(DIMS) if taped else len(DIMS))
    normalised = sum(c != "sum" for c in COMBINERS)
    assert counts["UnsortedSegmentSum"] == normalised
    assert not [t for t in counts if "Segment" in t
                and t != "UnsortedSegmentSum"]
    assert counts["SplitV"] == 0 and counts["Split"] == 0
    assert counts["GroupEmbeddingPooledLookup"] == 0
    for got, want in zip(outs, case.stock(case.sp_weights())):
        assert_close(got, want)


@pytest.mark.parametrize("taped", [False, True],
                         ids=["inference", "training"])
@pytest.mark.parametrize("kernel_mode", ["tf"], indirect=True)
def test_tf_path_wide_rows_add_by_segments(kernel_mode, taped):
    # Unweighted rows wider than 16 go forward through a sparse segment
    # sum (TF's sparse-dense product is slower there): over the distinct
    # rows in training, straight over the tables in inference (no
    # unique); the gradient stays the transposed product.
    case = random_case(1, [32, 32], ["sparse", "ragged"], ["sum", "mean"],
                       batch_size=5, vocab=9, max_len=3, empty_prob=0.2)
    if taped:
        graph, grads = _backward(case, with_weights=False)
        for got, want in zip(grads, _stock_grads(case, False)):
            assert_close(got, want)
    else:
        graph, outs = _forward(case)
        for got, want in zip(outs, case.stock(None)):
            assert_close(got, want)
    counts = op_counts(graph)
    assert counts["Unique"] == (2 if taped else 0)
    assert counts["SparseSegmentSumWithNumSegments"] == 2
    assert counts["SparseTensorDenseMatMul"] == (2 if taped else 0)


@pytest.mark.parametrize("weighted", [False, True],
                         ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kernel_mode", ["tf"], indirect=True)
def test_tf_inference_path_differentiated_from_outside(kernel_mode,
                                                       weighted):
    # A function traced without a tape pools straight from the tables;
    # called under an outer tape it is differentiated all the same: per
    # table IndexedSlices with unique indices (and the weights' gradient),
    # equal to stock's.
    case = random_case(0, DIMS, ["sparse"] * len(DIMS), COMBINERS,
                       weighted=weighted,
                       batch_size=5, vocab=9, max_len=3, empty_prob=0.2)
    ids, weights = case.sp_ids(), case.sp_weights()
    w_values = [w.values for w in weights] if weighted else []

    def rebuilt(values):
        # SparseTensor weights around the (watched) weight values.
        if not weighted:
            return None
        return [tf.SparseTensor(w.indices, v, w.dense_shape)
                for v, w in zip(values, weights)]

    lookup = tf.function(lambda ids, values: ge.group_embedding_lookup_sparse(
        case.tables, ids, case.combiners, sp_weights=rebuilt(values)))
    graph = lookup.get_concrete_function(ids, w_values).graph
    assert op_counts(graph)["Unique"] == 0  # traced as inference

    def grads(run):
        with tf.GradientTape() as tape:
            tape.watch(w_values)
            loss = tf.add_n([tf.reduce_sum(o * o) for o in run()])
        return tape.gradient(loss, case.tables + w_values)

    got = grads(lambda: lookup(ids, w_values))
    want = grads(lambda: case.stock(rebuilt(w_values)))
    for g, w in zip(got[:len(DIMS)], want[:len(DIMS)]):
        assert isinstance(g, tf.IndexedSlices)
        indices = g.indices.numpy()
        assert len(set(indices.tolist())) == len(indices)
        assert_close(g, w)
    for g, w in zip(got[len(DIMS):], want[len(DIMS):]):
        assert_close(g, w)


@pytest.mark.parametrize("kernel_mode", ["tf"], indirect=True)
def test_tf_path_backward_gives_unique_rows_per_table(kernel_mode):
    case = _case()
    graph, grads = _backward(case, with_weights=True)
    assert op_counts(graph)["SplitV"] == 0
    for got, want in zip(grads, _stock_grads(case, True)):
        assert isinstance(got, tf.IndexedSlices)
        indices = got.indices.numpy()
        assert len(set(indices.tolist())) == len(indices)
        assert_close(got, want)


@pytest.mark.parametrize("per_group,fused", [(2, 3), (4, 2), (6, 1),
                                             (1, 6)])
def test_params_num_per_group_splits_groups(kernel_mode, per_group, fused):
    case = _case(dims=[4] * 6, combiners=COMBINERS[:6])
    graph, outs = _forward(case, params_num_per_group=per_group)
    # The pure-TF path runs per-table ops but ONE range check per group.
    checks = sum(op.type in ("If", "StatelessIf")
                 and "group_range_check" in op.name
                 for op in graph.get_operations())
    assert (op_counts(graph)["GroupEmbeddingPooledLookup"]
            if kernel_mode == "custom" else checks) == fused
    for got, want in zip(outs, case.stock(case.sp_weights())):
        assert_close(got, want)


# ---------------------------------------------------------------------------
# Retracing.
# ---------------------------------------------------------------------------
_SPECS = {
    "sparse": tf.SparseTensorSpec([None, None], tf.int64),
    "ragged": tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1,
                                  row_splits_dtype=tf.int64),
}
_WEIGHT_SPECS = {
    "sparse": tf.SparseTensorSpec([None, None], tf.float32),
    "ragged": tf.RaggedTensorSpec([None, None], tf.float32, ragged_rank=1,
                                  row_splits_dtype=tf.int64),
}


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_no_retrace_when_batch_size_changes(kernel_mode, kind):
    template = _case(dims=[4, 4, 8], combiners=["mean", "sqrtn", "sum"])
    traces = []

    @tf.function(input_signature=[_SPECS[kind]] * 3
                 + [_WEIGHT_SPECS[kind]])
    def lookup(ids0, ids1, ids2, weights0):
        traces.append(1)
        return ge.group_embedding_lookup_sparse(
            template.tables, [ids0, ids1, ids2], template.combiners,
            sp_weights=[weights0, None, None])

    for batch_size in (3, 5, 8):
        case = random_case(batch_size, [4, 4, 8], [kind] * 3,
                           template.combiners, weighted=[True, False, False],
                           batch_size=batch_size, vocab=9, max_len=3)
        case.tables = template.tables
        weights = case.sp_weights()
        got = lookup(*case.sp_ids(), weights[0])
        for g, w in zip(got, case.stock(weights)):
            assert g.shape[0] == batch_size
            assert_close(g, w)
    assert len(traces) == 1
