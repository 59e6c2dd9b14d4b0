"""NaN and inf through the combiner and max_norm math (combiner_math.h).

The CPU kernels and the CUDA core (through its host stand-in) share one
header for the combiner scale, the max_norm clip, its backward and the
weight gradient. Stock TF is the oracle on rows and weights holding NaN
or inf, where the copies used to differ: `tf.clip_by_norm` divides by
`tf.maximum(|e|, c)`, which keeps a NaN norm, so a clipped NaN row is NaN
in every column and its gradient is NaN (an fmaxf-style max returned c and
left the row's other columns unclipped; the backward took a NaN norm for
"below the bound" and passed the gradient through).
"""

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.ops import gpu_kernel_library
from group_embedding.ops import kernel_library

import cuda_parity

cc = cuda_parity.cc
NAN, INF = np.nan, np.inf
MAX_NORM = 1.0
COMBINERS = ("sum", "mean", "sqrtn")
# Rows 0-5: NaN, inf, -inf, a norm whose square overflows float32, zero,
# below the bound; 6-7 above it.
SPECIAL_ROWS = [[NAN, 1.0, 2.0], [INF, 1.0, 2.0], [-INF, 0.0, 1.0],
                [1e20, 1e20, 1.0], [0.0, 0.0, 0.0], [0.3, -0.2, 0.1],
                [3.0, 4.0, 0.0], [-1.0, 2.0, 2.0]]
# Each special row beside a plain one, a plain row alone, a NaN row alone.
EXAMPLES = [[0, 6], [1, 6], [2, 7], [3, 6], [4, 7], [5, 6], [6], [0],
            [7, 5, 6]]


def _table(dim):
    """[8, dim]: the special rows, then columns of plain values."""
    rng = np.random.default_rng(dim)
    table = rng.uniform(-1, 1, (len(SPECIAL_ROWS), dim)).astype(np.float32)
    table[:, :3] = np.array(SPECIAL_ROWS, np.float32)
    return table


def _ragged(weights):
    ids = np.array([i for e in EXAMPLES for i in e], np.int64)
    splits = np.cumsum([0] + [len(e) for e in EXAMPLES]).astype(np.int64)
    w = None if weights is None else np.asarray(weights, np.float32)
    return ids, splits, w


def _weights(kind):
    """Per-id weights: none, finite, or with a NaN and an inf."""
    n = sum(len(e) for e in EXAMPLES)
    if kind == "none":
        return None
    w = np.linspace(0.5, 2.0, n).astype(np.float32)
    if kind == "nonfinite":
        w[-3] = NAN  # example [7, 5, 6]
        w[-4] = INF  # example [0]
    return w


def _sparse(ids, splits, values):
    rows = np.repeat(np.arange(len(splits) - 1), np.diff(splits))
    cols = np.concatenate([np.arange(len(e)) for e in EXAMPLES])
    return tf.sparse.SparseTensor(np.stack([rows, cols], 1), values,
                                  [len(splits) - 1, 3])


def _stock_pooled(table, combiner, w, max_norm, grad=None):
    """Stock's pooled rows, and with `grad` its table and weight
    gradients of sum(pooled * grad)."""
    ids, splits, _ = _ragged(w)
    var = tf.Variable(table)
    weights = tf.Variable(w) if w is not None else None
    with tf.GradientTape() as tape:
        out = tf.nn.embedding_lookup_sparse(
            var, _sparse(ids, splits, ids),
            None if w is None else _sparse(ids, splits, weights),
            combiner=combiner, max_norm=max_norm if max_norm >= 0 else None)
        loss = tf.reduce_sum(out * (grad if grad is not None else 0.0))
    if grad is None:
        return out.numpy()
    if w is None:
        dt, dw = tape.gradient(loss, var), None
    else:
        dt, dw = tape.gradient(loss, [var, weights])
    return (out.numpy(), tf.convert_to_tensor(dt).numpy(),
            None if dw is None else tf.convert_to_tensor(dw).numpy())


def _cpu_lib():
    lib = kernel_library.library()
    assert lib is not None, kernel_library.unavailable_reason()
    return lib


@pytest.fixture(scope="module")
def host_ctx(tmp_path_factory):
    path = tmp_path_factory.mktemp("core") / "libge_host.so"
    core = cc.Core(gpu_kernel_library.compile_host_core(str(path)))
    return cuda_parity.Context(core, cc.HostMemory())


def _close(got, want, what):
    """Equal to float32 rounding, NaN exactly where stock has NaN."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want),
                                  err_msg=f"{what}: NaN positions")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                               err_msg=what)


def _cpu_pooled(lib, table, w, max_norm, grads=None):
    """The CPU kernels' pooled rows of one table per combiner; with
    `grads`, the clipped per-id gradients (pooled backward, then
    GroupEmbeddingClipGrad) and the weight gradients."""
    ids, splits, _ = _ragged(w)
    variables = [tf.Variable(table) for _ in COMBINERS]
    common = dict(ids=[ids] * 3, row_splits=[splits] * 3,
                  weights=[w if w is not None else np.zeros(0, np.float32)]
                  * 3)
    pooled = lib.group_embedding_pooled_lookup(
        tables=[v.handle for v in variables], **common,
        combiners=list(COMBINERS), table_names=list(COMBINERS),
        embedding_dim=table.shape[1], max_norm=max_norm)
    if grads is None:
        return [p.numpy() for p in pooled]
    uids, ugrads = lib.group_embedding_pooled_lookup_grad(
        grads=grads, **common, combiners=list(COMBINERS),
        embedding_dim=table.shape[1])
    clipped = lib.group_embedding_clip_grad(
        tables=[v.handle for v in variables], unique_ids=uids,
        id_grads=ugrads, max_norm=max_norm)
    dws = None
    if w is not None:
        dws = lib.group_embedding_weight_grad(
            tables=[v.handle for v in variables], **common, grads=grads,
            pooled=pooled, combiners=list(COMBINERS), max_norm=max_norm)
        dws = [d.numpy() for d in dws]
    return ([p.numpy() for p in pooled],
            [(u.numpy(), g.numpy()) for u, g in zip(uids, clipped)], dws)


def _host_pooled(ctx, table, w, max_norm, grads=None):
    """The same through the CUDA core's host stand-in (its backward
    applies the clip's backward itself)."""
    ids, splits, _ = _ragged(w)
    tables = [cc.TableBatch(table=table, ids=ids, splits=splits,
                            combiner=c, weights=w) for c in COMBINERS]
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    pooled = [np.asarray(p) for p in call.lookup()]
    if grads is None:
        return pooled
    call.set_grads(grads)
    per_id = [(np.asarray(u), np.asarray(g)) for u, g in call.backward()]
    dws = None
    if w is not None:
        dws = [np.asarray(d) for d in call.weight_grads(pooled)]
    return pooled, per_id, dws


def _grads(dim):
    rng = np.random.default_rng(7)
    return [rng.normal(size=(len(EXAMPLES), dim)).astype(np.float32)
            for _ in COMBINERS]


@pytest.mark.parametrize("dim", [3, 4, 16])
@pytest.mark.parametrize("weights", ["none", "finite", "nonfinite"])
@pytest.mark.parametrize("max_norm", [-1.0, MAX_NORM])
def test_pooled_forward_follows_stock_on_nan_and_inf(host_ctx, dim, weights,
                                                     max_norm):
    table, w = _table(dim), _weights(weights)
    want = [_stock_pooled(table, c, w, max_norm) for c in COMBINERS]
    for path, got in (("CPU kernels", _cpu_pooled(_cpu_lib(), table, w,
                                                  max_norm)),
                      ("host stand-in", _host_pooled(host_ctx, table, w,
                                                     max_norm))):
        for c, g, s in zip(COMBINERS, got, want):
            _close(g, s, f"{path}, {c}")


def test_clipped_nan_row_is_nan_in_every_column(host_ctx):
    """The case the two copies disagreed on, spelled out: example [0]
    reads the NaN row alone."""
    table = _table(3)
    for got in (_cpu_pooled(_cpu_lib(), table, None, MAX_NORM),
                _host_pooled(host_ctx, table, None, MAX_NORM)):
        assert np.isnan(got[0][7]).all()
        # Beside a plain row: NaN there too, as stock.
        assert np.isnan(got[0][0]).all()


@pytest.mark.parametrize("dim", [3, 16])
@pytest.mark.parametrize("weighted", [False, True])
def test_clip_backward_follows_stock_on_nan_and_inf(host_ctx, dim, weighted):
    table = _table(dim)
    w = _weights("finite" if weighted else "none")
    grads = _grads(dim)
    stock = [_stock_pooled(table, c, w, MAX_NORM, grad=g)
             for c, g in zip(COMBINERS, grads)]
    for path, (_, per_id, dws) in (
            ("CPU kernels", _cpu_pooled(_cpu_lib(), table, w, MAX_NORM,
                                        grads)),
            ("host stand-in", _host_pooled(host_ctx, table, w, MAX_NORM,
                                           grads))):
        for t, c in enumerate(COMBINERS):
            ids, g = per_id[t]
            _close(g, stock[t][1][ids], f"{path}, {c}: table gradient")
            # The NaN and inf rows' gradients are NaN, as stock's.
            assert np.isnan(g[list(ids).index(0)]).all(), path
            assert np.isnan(g[list(ids).index(1)]).all(), path
            if weighted:
                _close(dws[t], stock[t][2], f"{path}, {c}: weight gradient")


def _sequence_inputs(dim, weighted):
    ids, splits, _ = _ragged(None)
    positions = np.concatenate([np.arange(len(e)) for e in EXAMPLES])
    w = _weights("finite" if weighted else "none")
    return ids, splits, positions.astype(np.int64), w


def _stock_sequence(table, ids, splits, positions, w, max_norm):
    rows = tf.nn.embedding_lookup(
        tf.constant(table), ids,
        max_norm=max_norm if max_norm >= 0 else None).numpy()
    if w is not None:
        rows = rows * w[:, None]
    out = np.zeros((len(splits) - 1, 3, table.shape[1]), np.float32)
    for b in range(len(splits) - 1):
        for j in range(splits[b], splits[b + 1]):
            out[b, positions[j]] += rows[j]
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_norm", [-1.0, MAX_NORM])
def test_sequence_forward_follows_stock_on_nan_and_inf(host_ctx, weighted,
                                                       max_norm):
    dim = 5
    table = _table(dim)
    ids, splits, positions, w = _sequence_inputs(dim, weighted)
    want = _stock_sequence(table, ids, splits, positions, w, max_norm)
    var = tf.Variable(table)
    cpu = _cpu_lib().group_embedding_sequence_lookup(
        tables=[var.handle], ids=[ids], row_splits=[splits],
        positions=[positions], max_lens=[np.int64(3)],
        weights=[w if w is not None else np.zeros(0, np.float32)],
        table_names=["seq"], embedding_dim=dim, max_norm=max_norm)
    _close(cpu[0].numpy(), want, "CPU kernels, sequence")
    x = cc.TableBatch(table=table, ids=ids, splits=splits, weights=w,
                      positions=positions, seq_len=3)
    host = cc.GroupCall(host_ctx.core, host_ctx.mem, [x],
                        max_norm=max_norm).lookup()
    _close(np.asarray(host[0]), want, "host stand-in, sequence")
