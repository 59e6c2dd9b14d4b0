"""The fused C++ path allocates no `[nnz, D]` tensor, forward or backward.

A training step that gathers the looked-up rows before pooling moves every
row at least twice more than it must; at production batch sizes that
intermediate is the largest tensor of the step. The checks:

* static: every op output of a traced `tf.function` training step (lookup,
  tape gradient, optimizer update) whose shape is fully known;
* run time: the shape of every tensor a TF1 `Session` step produced,
  from the step stats of a `RunOptions(trace_level=FULL_TRACE)` run.

A shape is forbidden when its element count is `n * D` for n = the id
count of any table or of the whole group. Sizes are picked so that no
legitimate tensor (`[B, D]`, `[unique, D]`, `[vocab, D]`, `[B, T, D]`,
`[nnz]`) has such a count. The same checks run on a lookup that gathers
`[nnz, D]` rows before pooling, to show that they would catch one.
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

D = 24
BATCH = 13
VOCABS = (50, 43)
# Per table id count; 37 and 29 are prime, so no [BATCH, T] sequence
# output or [unique, D] gradient can have 37 * D or 29 * D elements.
NNZ = (37, 29)
# Ids drawn from [0, 5): at most 5 unique rows per table, far below nnz,
# so a per-unique-row gradient cannot pass for a per-id one.
ID_RANGE = 5
MODES = ("pooled", "weighted", "max_norm", "sequence")


def _forbidden_sizes():
    counts = set(NNZ) | {sum(NNZ)}
    return {n * D for n in counts}


def _row_splits(rng, nnz):
    """Random row splits of `nnz` ids over BATCH rows, some rows empty."""
    cuts = np.sort(rng.integers(0, nnz + 1, BATCH - 1))
    return np.concatenate([[0], cuts, [nnz]]).astype(np.int64)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    tables = [rng.normal(size=(v, D)).astype(np.float32) for v in VOCABS]
    ids = [rng.integers(0, ID_RANGE, n).astype(np.int64) for n in NNZ]
    splits = [_row_splits(rng, n) for n in NNZ]
    weights = [rng.uniform(0.5, 2.0, n).astype(np.float32) for n in NNZ]
    return tables, ids, splits, weights


def _to_sparse(values, splits):
    """Row-major SparseTensor [BATCH, width] from ragged ids."""
    lens = np.diff(splits)
    rows = np.repeat(np.arange(BATCH), lens)
    cols = np.arange(len(rows)) - splits[rows]
    width = int(max(lens.max(), 1))
    return tf.SparseTensor(np.stack([rows, cols], 1).astype(np.int64),
                           values, [BATCH, width])


def _lookup(mode, tables, ids, splits, weights):
    """Feature 0 as a SparseTensor, feature 1 ragged; one group (same D)."""
    sp_ids = [_to_sparse(ids[0], splits[0]),
              tf.RaggedTensor.from_row_splits(ids[1], splits[1])]
    sp_weights = None
    if mode == "weighted":
        sp_weights = [_to_sparse(weights[0], splits[0]), None]
    kwargs = {}
    if mode == "max_norm":
        kwargs["max_norm"] = 1.5
    return ge.group_embedding_lookup_sparse(
        tables, sp_ids, ["mean", "sqrtn"], sp_weights=sp_weights,
        is_sequence=(mode == "sequence"), **kwargs)


def _loss(outs):
    # Squares make the output gradient depend on the outputs, as in a
    # real loss (not a constant that could be folded).
    return tf.add_n([tf.reduce_sum(tf.square(o)) for o in outs])


def _graphs(graph):
    """`graph` and every function graph nested in it (tf.cond, calls)."""
    seen, todo = [], [graph]
    while todo:
        g = todo.pop()
        if any(g is s for s in seen):
            continue
        seen.append(g)
        for f in getattr(g, "_functions", {}).values():
            fg = getattr(f, "graph", None)
            if fg is not None:
                todo.append(fg)
    return seen


def _static_offenders(mode):
    """Op outputs of a traced training step with a forbidden size."""
    tables_np, ids, splits, weights = _inputs()
    tables = [tf.Variable(t, name=f"table{i}")
              for i, t in enumerate(tables_np)]
    opt = ge.optimizers.Adagrad(0.1)
    opt.build(tables)

    @tf.function
    def step(ids0, ids1, w0):
        with tf.GradientTape() as tape:
            outs = _lookup(mode, tables, [ids0, ids1], splits,
                           [w0, weights[1]])
            loss = _loss(outs)
        grads = tape.gradient(loss, tables)
        opt.apply_gradients(zip(grads, tables))
        return loss

    concrete = step.get_concrete_function(
        tf.TensorSpec([NNZ[0]], tf.int64), tf.TensorSpec([NNZ[1]], tf.int64),
        tf.TensorSpec([NNZ[0]], tf.float32))
    # Run once too: the traced step must be a working one.
    concrete(tf.constant(ids[0]), tf.constant(ids[1]),
             tf.constant(weights[0]))
    forbidden = _forbidden_sizes()
    offenders, types = [], set()
    for g in _graphs(concrete.graph):
        for op in g.get_operations():
            types.add(op.type)
            for out in op.outputs:
                shape = out.shape
                if (shape.rank and shape.is_fully_defined()
                        and shape.num_elements() in forbidden):
                    offenders.append(f"{op.type} {op.name}: {shape}")
    return offenders, types


def _runtime_offenders(mode):
    """Tensors of a TF1 Session training step with a forbidden size."""
    tables_np, ids, splits, weights = _inputs()
    with tf.Graph().as_default():
        tables = [tf.compat.v1.get_variable(f"table{i}", initializer=t,
                                            use_resource=True)
                  for i, t in enumerate(tables_np)]
        # Placeholders of unknown size: nothing can be constant-folded
        # and every shape below is decided at run time.
        ph_ids = [tf.compat.v1.placeholder(tf.int64, [None])
                  for _ in NNZ]
        ph_splits = [tf.compat.v1.placeholder(tf.int64, [None])
                     for _ in NNZ]
        ph_w = tf.compat.v1.placeholder(tf.float32, [None])
        sp_ids = [tf.RaggedTensor.from_row_splits(i, s, validate=False)
                  for i, s in zip(ph_ids, ph_splits)]
        sp_weights = None
        if mode == "weighted":
            sp_weights = [tf.RaggedTensor.from_row_splits(
                ph_w, ph_splits[0], validate=False), None]
        kwargs = {"max_norm": 1.5} if mode == "max_norm" else {}
        outs = ge.group_embedding_lookup_sparse(
            tables, sp_ids, ["mean", "sqrtn"], sp_weights=sp_weights,
            is_sequence=(mode == "sequence"), **kwargs)
        train = ge.train.AdagradOptimizer(0.1).minimize(_loss(outs))
        feed = {ph_w: weights[0]}
        for p, v in zip(ph_ids + ph_splits, ids + splits):
            feed[p] = v
        meta = tf.compat.v1.RunMetadata()
        options = tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train, feed, options=options, run_metadata=meta)
    forbidden = _forbidden_sizes()
    offenders, labels = [], []
    for dev in meta.step_stats.dev_stats:
        for node in dev.node_stats:
            labels.append(node.timeline_label)
            for out in node.output:
                dims = [d.size for d in out.tensor_description.shape.dim]
                if dims and int(np.prod(dims)) in forbidden:
                    offenders.append(f"{node.timeline_label}: {dims}")
    return offenders, labels


def _kernel_op(mode):
    return ("GroupEmbeddingSequenceLookup" if mode == "sequence"
            else "GroupEmbeddingPooledLookup")


@pytest.mark.parametrize("mode", MODES)
def test_traced_step_has_no_nnz_by_dim_tensor(mode, monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    offenders, types = _static_offenders(mode)
    assert _kernel_op(mode) in types, sorted(types)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("mode", MODES)
def test_session_step_allocates_no_nnz_by_dim_tensor(mode, monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    offenders, labels = _runtime_offenders(mode)
    assert any(_kernel_op(mode) in label for label in labels), labels
    assert not offenders, "\n".join(offenders)


def _gather_then_pool(tables, feats, combiners, table_names, max_norm=None,
                      training=True):
    """The classic lookup the fused path avoids: gather `[nnz, D]` rows,
    then segment-sum them (combiners ignored: only its tensors matter)."""
    del combiners, table_names, max_norm, training
    outs = []
    for t, f in zip(tables, feats):
        rows = tf.gather(t, f.values)
        batch = tf.shape(f.row_splits, out_type=tf.int64)[0] - 1
        outs.append(tf.math.unsorted_segment_sum(
            rows, tf.ragged.row_splits_to_segment_ids(f.row_splits), batch))
    return outs


@pytest.mark.parametrize("check", [_static_offenders, _runtime_offenders],
                         ids=["traced", "session"])
def test_checks_catch_a_gather_before_pooling(check, monkeypatch):
    # Both checks must see the [nnz, D] rows of a gather placed before
    # pooling, else they prove nothing about the fused path.
    from group_embedding import lookup
    from group_embedding.lookup_plan import Backend
    from group_embedding.lookup_plan import Mode
    from group_embedding.lookup_plan import TableKind
    for backend in (Backend.CPU_KERNELS, Backend.TF_OPS):
        monkeypatch.setitem(
            lookup._DISPATCH, (TableKind.VARIABLE, backend, Mode.POOLED),
            lambda g, c: _gather_then_pool(g.tables, g.feats, g.combiners,
                                           g.names))
    offenders, _ = check("pooled")
    assert any("Gather" in o for o in offenders), offenders
