"""The CUDA core and its TF adaptor, checked on a machine without a GPU.

* every parity case of `cuda_parity.py` (the ones the GPU machine runs on
  the CUDA core) through the core's host stand-in, numpy oracle;
* the host stand-in against the C++ CPU kernels on the same inputs;
* the CUDA sources compile with PyPI's nvcc, and the library loads and
  reports a CUDA error (not a crash) where there is no GPU;
* the GPU op library (adaptor + core) links with `--no-undefined` against
  tensorflow-cpu and loads into it; a reference to a GPU-only TF symbol
  fails that same link (negative control);
* the adaptor's TF plumbing runs through TF on CPU: built with
  GE_ADAPTOR_ON_HOST it registers the same kernels under the label
  "ge_host_core", and graphs using that label must match the CPU kernels.
* marked `gpu_wheel` (run with GE_TEST_GPU_WHEEL=/path/to/venv/bin/python,
  a venv with the GPU `tensorflow==2.21.0` wheel): the GPU op library
  loads into the TF that GPU users have.
"""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.lookup import group_embedding_lookup_sparse
from group_embedding.ops import capabilities
from group_embedding.ops import gpu_kernel_library
from group_embedding.ops import kernel_library

import cuda_parity

cc = cuda_parity.cc
NVCC = gpu_kernel_library.find_nvcc()
needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="no CUDA compiler (pip install .[cuda-build])")


@pytest.fixture(scope="module")
def host_core(tmp_path_factory):
    path = tmp_path_factory.mktemp("core") / "libge_host.so"
    return cc.Core(gpu_kernel_library.compile_host_core(str(path)))


@pytest.fixture(scope="module")
def ctx(host_core):
    return cuda_parity.Context(host_core, cc.HostMemory())


@pytest.mark.parametrize("name,case", cuda_parity.all_cases(),
                         ids=[n for n, _ in cuda_parity.all_cases()])
def test_host_stand_in_parity(ctx, name, case):
    case(ctx)


def test_parity_cases_catch_a_wrong_sum(ctx, monkeypatch):
    """Negative control: an oracle off by one occurrence fails a case."""
    real = cuda_parity.oracle_grad_sums

    def dropped(x, grad, max_norm):
        sums = real(x, grad, max_norm)
        first = sorted(sums)[0]
        sums[first] = sums[first] * 0.5
        return sums

    monkeypatch.setattr(cuda_parity, "oracle_grad_sums", dropped)
    with pytest.raises(cuda_parity.Failure):
        cuda_parity.case_pooled(ctx, 16, False, -1.0, False)


# -- the host stand-in against the C++ CPU kernels ---------------------------
def _cpu_lib():
    lib = kernel_library.library()
    assert lib is not None, kernel_library.unavailable_reason()
    return lib


def _tables(seed, dim, weighted, sequence=False, concat=False):
    rng = np.random.default_rng(seed)
    specs = cuda_parity.SEQ_SPECS if sequence else cuda_parity.SPECS
    if concat:
        specs = [(v, 40, c) for v, _, c in specs]
    return rng, cuda_parity.make_tables(rng, specs, dim, weighted=weighted,
                                        sequence=sequence)


def _weights(x):
    return (tf.constant(x.weights) if x.weights is not None
            else tf.zeros([0], tf.float32))


@pytest.mark.parametrize("dim", [16, 7])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_norm", [-1.0, 0.8])
def test_pooled_matches_cpu_kernels(ctx, dim, weighted, max_norm):
    lib = _cpu_lib()
    rng, tables = _tables(dim + weighted, dim, weighted)
    variables = [tf.Variable(x.table) for x in tables]
    common = dict(ids=[tf.constant(x.ids) for x in tables],
                  row_splits=[tf.constant(x.splits) for x in tables],
                  weights=[_weights(x) for x in tables])
    want = lib.group_embedding_pooled_lookup(
        tables=[v.handle for v in variables], **common,
        combiners=[x.combiner for x in tables],
        table_names=[f"t{i}" for i in range(len(tables))],
        embedding_dim=dim, max_norm=max_norm)
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    got = call.lookup()
    for t in range(len(tables)):
        np.testing.assert_allclose(got[t], want[t].numpy(), rtol=1e-6,
                                   atol=1e-6)
    grads = [rng.normal(size=g.shape).astype(np.float32) for g in got]
    call.set_grads(grads)
    cpu_ids, cpu_grads = lib.group_embedding_pooled_lookup_grad(
        grads=grads, **common, combiners=[x.combiner for x in tables],
        embedding_dim=dim)
    for t, (ids, g) in enumerate(call.backward()):
        order = np.argsort(cpu_ids[t].numpy())
        np.testing.assert_array_equal(ids, cpu_ids[t].numpy()[order])
        if max_norm < 0:
            np.testing.assert_allclose(g, cpu_grads[t].numpy()[order],
                                       rtol=1e-6, atol=1e-6)
    if weighted:
        cpu_dw = lib.group_embedding_weight_grad(
            tables=[v.handle for v in variables], **common, grads=grads,
            pooled=[w.numpy() for w in want],
            combiners=[x.combiner for x in tables], max_norm=max_norm)
        got_dw = call.weight_grads([w.numpy() for w in want])
        for t in range(len(tables)):
            np.testing.assert_allclose(got_dw[t], cpu_dw[t].numpy(),
                                       rtol=1e-5, atol=1e-5)


def test_concat_and_sequence_match_cpu_kernels(ctx):
    lib = _cpu_lib()
    rng, tables = _tables(5, 16, True, concat=True)
    variables = [tf.Variable(x.table) for x in tables]
    want = lib.group_embedding_concat_lookup(
        tables=[v.handle for v in variables],
        ids=[x.ids for x in tables], row_splits=[x.splits for x in tables],
        weights=[x.weights for x in tables],
        combiners=[x.combiner for x in tables],
        table_names=[f"t{i}" for i in range(len(tables))],
        embedding_dim=16, max_norm=-1.0)
    got = cc.GroupCall(ctx.core, ctx.mem, tables, concat=True).lookup()
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)

    rng, tables = _tables(6, 16, True, sequence=True)
    variables = [tf.Variable(x.table) for x in tables]
    common = dict(ids=[x.ids for x in tables],
                  row_splits=[x.splits for x in tables],
                  positions=[x.positions for x in tables],
                  weights=[x.weights for x in tables])
    want = lib.group_embedding_sequence_lookup(
        tables=[v.handle for v in variables], **common,
        max_lens=[np.int64(x.seq_len) for x in tables],
        table_names=[f"t{i}" for i in range(len(tables))],
        embedding_dim=16, max_norm=0.8)
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=0.8)
    got = call.lookup()
    for t in range(len(tables)):
        np.testing.assert_allclose(got[t], want[t].numpy(), rtol=1e-6,
                                   atol=1e-6)
    grads = [rng.normal(size=g.shape).astype(np.float32) for g in got]
    call = cc.GroupCall(ctx.core, ctx.mem, tables)  # no clip: same op
    call.set_grads(grads)
    cpu_ids, cpu_grads = lib.group_embedding_sequence_lookup_grad(
        grads=grads, **common, embedding_dim=16)
    for t, (ids, g) in enumerate(call.backward()):
        order = np.argsort(cpu_ids[t].numpy())
        np.testing.assert_array_equal(ids, cpu_ids[t].numpy()[order])
        np.testing.assert_allclose(g, cpu_grads[t].numpy()[order],
                                   rtol=1e-6, atol=1e-6)


def test_adagrad_matches_cpu_kernel(ctx):
    lib = _cpu_lib()
    rng = np.random.default_rng(9)
    x = cc.TableBatch(
        table=rng.normal(size=(30, 16)).astype(np.float32),
        ids=rng.integers(0, 12, 70).astype(np.int64),
        slots=[rng.uniform(0.1, 1, (30, 16)).astype(np.float32)])
    grad = rng.normal(size=(70, 16)).astype(np.float32)
    var, acc = tf.Variable(x.table), tf.Variable(x.slots[0])
    lib.group_embedding_sparse_apply_adagrad(
        var=var.handle, accum=acc.handle, lr=0.1, epsilon=1e-7, indices=x.ids,
        grad=grad)
    call = cc.GroupCall(ctx.core, ctx.mem, [x])
    call.set_grads([grad])
    (value, (accum,)), = call.backward_apply(
        call.optimizer_config("adagrad", lr=0.1, epsilon=1e-7))
    np.testing.assert_allclose(value, var.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(accum, acc.numpy(), rtol=1e-6, atol=1e-6)


# -- building with a CUDA toolchain -----------------------------------------
@needs_nvcc
def test_core_compiles_with_pypi_nvcc_and_fails_cleanly_without_gpu(
        tmp_path):
    path = gpu_kernel_library.compile_core(str(tmp_path / "libge_cuda.so"),
                                           capabilities=("90",))
    core = cc.Core(path)
    assert core.backend == "cuda"
    # No GPU here: the call returns a CUDA error code instead of crashing.
    x = cc.TableBatch(table=np.ones((4, 8), np.float32),
                      ids=np.arange(3, dtype=np.int64))
    call = cc.GroupCall(core, cc.HostMemory(), [x])
    with pytest.raises(cc.CoreError, match="CUDA error"):
        call.launch_lookup()


_GPU_ONLY_REFERENCE = r"""
#include <string>
namespace Eigen { struct GpuDevice; }
namespace tensorflow {
template <typename D> struct DeviceName;
template <> struct DeviceName<Eigen::GpuDevice> {
  static const std::string value;
};
}
extern "C" const void* ge_probe() {
  return &tensorflow::DeviceName<Eigen::GpuDevice>::value;
}
"""


def _link_like_the_gpu_library(tmp_path, source):
    """Compiles and links `source` as the GPU library is linked."""
    src = tmp_path / "probe.cc"
    src.write_text(source)
    out = tmp_path / "probe.so"
    gpu_kernel_library._run(
        ["g++", "-shared", "-fPIC", str(src), "-o", str(out)]
        + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
        + ["-Wl,--no-undefined"], "linking the probe", False)
    return out


@needs_nvcc
def test_gpu_library_links_and_loads_into_tensorflow_cpu(tmp_path):
    path = gpu_kernel_library.compile_tf_library(
        str(tmp_path / "gpu_ops.so"), capabilities=("90",))
    # A fresh process: the CPU library first (it defines the ops).
    code = ("import tensorflow as tf\n"
            "from group_embedding.ops import kernel_library as k\n"
            "assert k.library() is not None\n"
            f"tf.load_op_library({path!r})\n"
            "print('loaded')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, env=dict(os.environ,
                                              TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded" in proc.stdout
    # The same link refuses a GPU-only framework symbol.
    with pytest.raises(RuntimeError, match="undefined reference"):
        _link_like_the_gpu_library(tmp_path, _GPU_ONLY_REFERENCE)


# -- the adaptor through TF, on the host stand-in -----------------------------
LABELLED = ("GroupEmbeddingPooledLookup", "GroupEmbeddingConcatLookup",
            "GroupEmbeddingSequenceLookup", "GroupEmbeddingPooledLookupGrad",
            "GroupEmbeddingConcatLookupGrad",
            "GroupEmbeddingSequenceLookupGrad")


_ADAPTOR = {}


@pytest.fixture(scope="module")
def host_adaptor():
    _cpu_lib()
    # The process's one copy (the HBM EV tests load the same library).
    gpu_kernel_library.host_stand_in_library()
    _ADAPTOR["path"] = gpu_kernel_library.host_stand_in_path()
    return _cpu_lib()


@pytest.fixture
def synchronize_calls(host_adaptor):
    """ge_synchronize calls made so far by the loaded adaptor's stand-in
    (the same library TF loaded: ctypes shares its handle)."""
    lib = ctypes.CDLL(_ADAPTOR["path"])
    lib.ge_host_synchronize_calls.restype = ctypes.c_longlong
    return lib.ge_host_synchronize_calls


def _on_adaptor(fn, ops=LABELLED):
    """fn() run as a graph with the adaptor's kernels of `ops`."""
    @tf.function
    def labelled():
        graph = tf.compat.v1.get_default_graph()
        with graph._kernel_label_map({op: "ge_host_core" for op in ops}):
            return fn()
    return labelled()


def _both(fn, ops=LABELLED):
    """fn() run as a graph with the CPU kernels and with the adaptor's
    kernels of `ops`."""
    return tf.function(fn)(), _on_adaptor(fn, ops)


def _assert_padded_grads(got_ids, got_grads, want_ids, want_grads, ids,
                         what):
    """The adaptor's backward outputs of one table (a row per id: the
    distinct ids ascending with their sums, then the table's own ids with
    zero rows) against the CPU kernels' (distinct ids, first-occurrence
    order): same sums per id once duplicates are added up."""
    got_ids, got_grads = np.asarray(got_ids), np.asarray(got_grads)
    want_ids = np.asarray(want_ids)
    u = len(want_ids)
    assert got_ids.shape == (len(ids),), what
    order = np.argsort(want_ids)
    np.testing.assert_array_equal(got_ids[:u], want_ids[order],
                                  err_msg=what)
    np.testing.assert_allclose(got_grads[:u], np.asarray(want_grads)[order],
                               rtol=1e-6, atol=1e-6, err_msg=what)
    assert set(got_ids[u:].tolist()) <= set(np.asarray(ids).tolist()), what
    np.testing.assert_array_equal(got_grads[u:], 0.0, err_msg=what)


def test_adaptor_runs_through_tf(host_adaptor):
    lib = host_adaptor
    rng, tables = _tables(11, 16, True, concat=True)
    variables = [tf.Variable(x.table) for x in tables]
    k = len(tables)
    ragged = dict(ids=[x.ids for x in tables],
                  row_splits=[x.splits for x in tables],
                  weights=[x.weights for x in tables])
    names = [f"t{i}" for i in range(k)]
    combiners = [x.combiner for x in tables]
    grad = rng.normal(size=(40, 16 * k)).astype(np.float32)

    def pooled_and_grads():
        per_table = lib.group_embedding_pooled_lookup(
            tables=[v.handle for v in variables], **ragged,
            combiners=combiners, table_names=names, embedding_dim=16,
            max_norm=0.8)
        concat = lib.group_embedding_concat_lookup(
            tables=[v.handle for v in variables], **ragged,
            combiners=combiners, table_names=names, embedding_dim=16)
        ids, grads = lib.group_embedding_concat_lookup_grad(
            grads=grad, **ragged, combiners=combiners, embedding_dim=16)
        return per_table, concat, ids, grads

    (want_p, want_c, want_i, want_g), (got_p, got_c, got_i, got_g) = \
        _both(pooled_and_grads)
    for w, g in zip(want_p, got_p):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6,
                                   atol=1e-6)
    np.testing.assert_allclose(got_c.numpy(), want_c.numpy(), rtol=1e-6,
                               atol=1e-6)
    for t in range(k):
        _assert_padded_grads(got_i[t], got_g[t], want_i[t], want_g[t],
                             tables[t].ids, f"table {t}")

    rng, seq = _tables(12, 8, False, sequence=True)
    seq_vars = [tf.Variable(x.table) for x in seq]
    seq_grads = [rng.normal(size=(x.batch, x.seq_len, 8)).astype(np.float32)
                 for x in seq]

    def sequence():
        args = dict(ids=[x.ids for x in seq],
                    row_splits=[x.splits for x in seq],
                    positions=[x.positions for x in seq],
                    weights=[tf.zeros([0]) for _ in seq])
        out = lib.group_embedding_sequence_lookup(
            tables=[v.handle for v in seq_vars], **args,
            max_lens=[np.int64(x.seq_len) for x in seq],
            table_names=[f"s{i}" for i in range(len(seq))],
            embedding_dim=8)
        ids, grads = lib.group_embedding_sequence_lookup_grad(
            grads=seq_grads, **args, embedding_dim=8)
        return out, ids, grads

    (want_o, want_i, want_g), (got_o, got_i, got_g) = _both(sequence)
    for t in range(len(seq)):
        np.testing.assert_allclose(got_o[t].numpy(), want_o[t].numpy(),
                                   rtol=1e-6, atol=1e-6)
        _assert_padded_grads(got_i[t], got_g[t], want_i[t], want_g[t],
                             seq[t].ids, f"sequence table {t}")


def test_adaptor_names_the_table_of_a_bad_id(host_adaptor):
    lib = host_adaptor
    table = tf.Variable(np.ones((5, 4), np.float32))

    def lookup():
        return lib.group_embedding_pooled_lookup(
            tables=[table.handle, table.handle],
            ids=[np.array([1, 2], np.int64), np.array([0, 7], np.int64)],
            row_splits=[np.array([0, 1, 2], np.int64)] * 2,
            weights=[tf.zeros([0])] * 2, combiners=["sum", "sum"],
            table_names=["users", "items"], embedding_dim=4)

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"items: id 7 is out of range \[0, 5\)"):
        _both(lookup)


# -- every lookup variant through the adaptor (issue 35.1) --------------------
# The ops a training step builds, forward and backward, for which the
# adaptor registers kernels.
STEP_OPS = LABELLED + ("GroupEmbeddingClipGrad", "GroupEmbeddingTableSnapshot",
                       "GroupEmbeddingWeightGradFromSnapshots",
                       "GroupEmbeddingSequenceWeightGradFromSnapshots",
                       "GroupEmbeddingCheckIds")


def _step_inputs(seed, sequence):
    """Three dim-8 tables of one group, their ragged ids and weights, and
    a gradient for each output; the same for every path."""
    rng = np.random.default_rng(seed)
    batch = 6
    tables, ids, weights = [], [], []
    for vocab in (20, 7, 30):
        lengths = rng.integers(0, 4, batch)
        splits = np.concatenate([[0], np.cumsum(lengths)])
        # Rows well above and below the max_norm bound (1.5).
        tables.append((rng.normal(size=(vocab, 8)) * rng.uniform(
            0.1, 1.2, (vocab, 1))).astype(np.float32))
        ids.append((rng.integers(0, vocab, splits[-1]), splits))
        weights.append(rng.uniform(0.2, 2.0, splits[-1]).astype(np.float32))
    return rng, tables, ids, weights


def _step_function(step, labelled):
    """step() as a tf.function, its training-step ops on the adaptor's
    kernels when `labelled`."""
    @tf.function
    def traced():
        if not labelled:
            return step()
        graph = tf.compat.v1.get_default_graph()
        with graph._kernel_label_map({op: "ge_host_core"
                                      for op in STEP_OPS}):
            return step()
    return traced


def _train_step(lib_mode, monkeypatch, seed, mode, weighted, max_norm,
                labelled, copy_on_read=False):
    """Outputs, table gradients (dense) and weight gradients of one
    grouped lookup, traced with `GROUP_EMBEDDING_KERNELS=lib_mode`, its
    training-step ops on the adaptor's kernels when `labelled`; also the
    set of op types that got the adaptor's label."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", lib_mode)
    sequence = mode == "sequence"
    rng, arrays, ids, weights = _step_inputs(seed, sequence)
    tables = [tf.Variable(a) for a in arrays]
    if copy_on_read:
        # A sparse read puts a variable in copy-on-read mode: the snapshot
        # then copies the ids' rows (by position).
        for t in tables:
            tf.gather(t, [0])
    weight_values = [tf.constant(w) for w in weights]
    combiners = ["sum", "mean", "sqrtn"]

    def step():
        with tf.GradientTape() as tape:
            tape.watch(weight_values)
            sp_ids = [tf.RaggedTensor.from_row_splits(v, s)
                      for v, s in ids]
            sp_weights = ([tf.RaggedTensor.from_row_splits(w, s)
                           for w, (_, s) in zip(weight_values, ids)]
                          if weighted else None)
            out = group_embedding_lookup_sparse(
                tables, sp_ids, combiners, sp_weights,
                is_sequence=sequence, concat_outputs=mode == "concat",
                max_norm=max_norm)
            outs = [out] if mode == "concat" else out
            loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                             for i, o in enumerate(outs)])
        table_grads, weight_grads = tape.gradient(
            loss, (tables, weight_values))
        return (outs, [tf.convert_to_tensor(g) for g in table_grads],
                weight_grads if weighted else [])

    traced = _step_function(step, labelled)

    result = traced()
    graph = traced.get_concrete_function().graph
    on_adaptor = {op.type for op in graph.get_operations()
                  if op.type in STEP_OPS
                  and op.node_def.attr["_kernel"].s == b"ge_host_core"}
    return result, on_adaptor


def _assert_same(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5,
                                   atol=2e-5, err_msg=f"{what} {i}")


@pytest.mark.parametrize("mode", ["pooled", "concat", "sequence"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_norm", [None, 1.5])
def test_training_step_on_the_adaptor_matches_cpu_kernels_and_stock_tf(
        host_adaptor, monkeypatch, mode, weighted, max_norm):
    """The whole step (forward, table and weight gradients) of every
    variant, with the adaptor's kernels, equals the C++ CPU kernels' and
    the pure-TF (stock ops) path's."""
    seed = 40 + weighted + (max_norm is not None) * 2
    (out, tg, wg), used = _train_step("auto", monkeypatch, seed, mode,
                                      weighted, max_norm, labelled=True)
    (c_out, c_tg, c_wg), _ = _train_step("auto", monkeypatch, seed, mode,
                                         weighted, max_norm, labelled=False)
    (s_out, s_tg, s_wg), _ = _train_step("tf", monkeypatch, seed, mode,
                                         weighted, max_norm, labelled=False)
    forward = {"pooled": "GroupEmbeddingPooledLookup",
               "concat": "GroupEmbeddingConcatLookup",
               "sequence": "GroupEmbeddingSequenceLookup"}[mode]
    want_ops = {forward, forward + "Grad"}
    if max_norm is not None:
        want_ops.add("GroupEmbeddingClipGrad")
    if weighted:
        want_ops |= {"GroupEmbeddingTableSnapshot",
                     "GroupEmbedding" + ("Sequence" if mode == "sequence"
                                         else "")
                     + "WeightGradFromSnapshots"}
    assert used == want_ops
    for name, got, cpu, stock in (("output", out, c_out, s_out),
                                  ("table gradient", tg, c_tg, s_tg),
                                  ("weight gradient", wg, c_wg, s_wg)):
        _assert_same(got, cpu, f"{name} vs the CPU kernels")
        _assert_same(got, stock, f"{name} vs stock TF")
    if weighted:
        assert any(np.abs(np.asarray(w)).max() > 0 for w in wg)


@pytest.mark.parametrize("mode", ["pooled", "sequence"])
def test_weight_gradients_from_a_copy_on_read_snapshot(host_adaptor,
                                                       monkeypatch, mode):
    """Variables in copy-on-read mode: the adaptor's snapshot copies the
    ids' rows and its weight gradient reads them by position."""
    (out, tg, wg), used = _train_step("auto", monkeypatch, 50, mode, True,
                                      1.5, labelled=True, copy_on_read=True)
    (s_out, s_tg, s_wg), _ = _train_step("tf", monkeypatch, 50, mode, True,
                                         1.5, labelled=False)
    assert "GroupEmbeddingTableSnapshot" in used
    _assert_same(wg, s_wg, "weight gradient vs stock TF")
    _assert_same(tg, s_tg, "table gradient vs stock TF")


def test_backward_waits_for_the_stream_once(host_adaptor, synchronize_calls):
    """Issue 35.3: a backward built by hand waits once, to read its own
    error counts (its outputs have a row per id: no distinct id count is
    read back), and names the table of a bad id; built by a gradient
    function (`ids_checked`: the forward checked the ids) it does not
    wait at all."""
    lib = host_adaptor
    rng, tables = _tables(13, 8, False)
    grads = [rng.normal(size=(x.batch, 8)).astype(np.float32)
             for x in tables]

    def backward(ids_checked, ids=None):
        return lib.group_embedding_pooled_lookup_grad(
            grads=grads, ids=ids or [x.ids for x in tables],
            row_splits=[x.splits for x in tables],
            weights=[tf.zeros([0]) for _ in tables],
            combiners=[x.combiner for x in tables], embedding_dim=8,
            ids_checked=ids_checked)

    for ids_checked, waits in ((False, 1), (True, 0)):
        traced = tf.function(lambda c=ids_checked: backward(c))
        _on_adaptor(traced.python_function)  # traced and run once
        before = synchronize_calls()
        _on_adaptor(traced.python_function)
        assert synchronize_calls() - before == waits, ids_checked
    bad = [x.ids.copy() for x in tables]
    bad[2][0] = -3
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"table 2: id -3 is out of range"):
        _on_adaptor(lambda: backward(False, bad))


# (mode, weighted, max_norm, copy_on_read): every kind of group a step
# has, the snapshot copying rows in the last.
STEP_VARIANTS = [("pooled", False, None, False), ("pooled", True, 1.5, False),
                 ("concat", True, 1.5, False), ("sequence", False, None, False),
                 ("sequence", True, 1.5, False), ("pooled", True, 1.5, True)]


@pytest.mark.parametrize("mode,weighted,max_norm,copy_on_read",
                         STEP_VARIANTS)
def test_training_step_waits_for_the_stream_once(
        host_adaptor, monkeypatch, synchronize_calls, mode, weighted,
        max_norm, copy_on_read):
    """Issue 35.3: the whole training step of a group (forward, backward,
    clip, snapshot, weight gradients) waits for its stream once: the
    forward reads its error counts; the ops its gradient function builds
    take the forward's checked ids and do not wait. The results are those
    of the CPU kernels (the second step is compared)."""
    args = (monkeypatch, 60, mode, weighted, max_norm)
    _train_step("auto", *args, labelled=True, copy_on_read=copy_on_read)
    before = synchronize_calls()
    (out, tg, wg), used = _train_step("auto", *args, labelled=True,
                                      copy_on_read=copy_on_read)
    waits = synchronize_calls() - before
    assert waits == 1, waits
    assert any(op.endswith("LookupGrad") for op in used), used
    (want_out, want_tg, want_wg), _ = _train_step(
        "auto", *args, labelled=False, copy_on_read=copy_on_read)
    _assert_same(out, want_out, "outputs")
    _assert_same(tg, want_tg, "table gradients")
    _assert_same(wg, want_wg, "weight gradients")


def _two_group_step(rng, tables, ids_of):
    """A step of three tables in two groups (dims 8, 8, 4), its loss's
    table gradients as dense tensors."""
    splits = np.array([0, 2, 3, 5], np.int64)

    def step():
        sp_ids = [tf.RaggedTensor.from_row_splits(ids_of(t), splits)
                  for t in range(len(tables))]
        with tf.GradientTape() as tape:
            out = group_embedding_lookup_sparse(tables, sp_ids,
                                                ["sum", "mean", "sum"])
            loss = tf.add_n([tf.reduce_sum(o * o) for o in out])
        return [tf.convert_to_tensor(g)
                for g in tape.gradient(loss, tables)]
    return step


def _pretend_gpu(patch):
    """The lookup plans for a GPU (TF "sees" one, the GPU library
    "loads"), so that it builds what it builds there; the kernel label
    of `_step_function` runs those ops on the host stand-in."""
    patch.setattr(gpu_kernel_library, "_gpus", [True])
    # Snapshots made with the real devices are set aside meanwhile.
    patch.setattr(capabilities, "_snapshots", {})
    patch.setattr(gpu_kernel_library, "_state", dict(
        gpu_kernel_library._state, tried=True, module=object(), error=None))


@pytest.fixture
def pretended_gpu(monkeypatch):
    _pretend_gpu(monkeypatch)


def test_a_step_of_two_groups_waits_for_the_stream_at_most_once(
        host_adaptor, monkeypatch, synchronize_calls):
    """Issue 35.3 for several groups: one GroupEmbeddingCheckIds checks
    the ids of both groups (one wait), their forward ops take
    `ids_checked` and wait no more; the gradients are the CPU kernels'.
    (The plan on a pretended GPU; the unlabelled run on the CPU.)"""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    rng = np.random.default_rng(80)
    arrays = [rng.normal(size=(20, d)).astype(np.float32)
              for d in (8, 8, 4)]
    ids = [rng.integers(0, 20, 5) for _ in arrays]
    results = {}
    for labelled in (True, False):
        with monkeypatch.context() as m:
            if labelled:
                _pretend_gpu(m)
            tables = [tf.Variable(a) for a in arrays]
            traced = _step_function(
                _two_group_step(rng, tables, lambda t: ids[t]), labelled)
            traced()
        graph = traced.get_concrete_function().graph
        types = [op.type for op in graph.get_operations()]
        before = synchronize_calls()
        results[labelled] = [g.numpy() for g in traced()]
        if labelled:
            assert types.count("GroupEmbeddingPooledLookup") == 2
            assert types.count("GroupEmbeddingCheckIds") == 1
            assert synchronize_calls() - before == 1
    _assert_same(results[True], results[False], "table gradient")


def test_the_check_of_several_groups_names_the_table_of_a_bad_id(
        host_adaptor, monkeypatch, pretended_gpu):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    rng = np.random.default_rng(81)
    tables = [tf.Variable(rng.normal(size=(20, d)).astype(np.float32),
                          name=f"t{i}")
              for i, d in enumerate((8, 8, 4))]
    ids = [rng.integers(0, 20, 5) for _ in tables]
    ids[2][3] = 20
    traced = _step_function(
        _two_group_step(rng, tables, lambda t: ids[t]), labelled=True)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"t2.*: id 20 is out of range \[0, 20\)"):
        traced()


def _optimizer_step(monkeypatch, labelled, make_optimizer, mode):
    """Tables after two steps of `make_optimizer()` applying the
    IndexedSlices of a weighted max_norm group (the adaptor's when
    `labelled`, a row per id with zero rows past the distinct ids; else
    the CPU kernels', distinct ids only)."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    sequence = mode == "sequence"
    _, arrays, ids, weights = _step_inputs(70, sequence)
    tables = [tf.Variable(a) for a in arrays]
    optimizer = make_optimizer()
    optimizer.build(tables)

    def step():
        sp_ids = [tf.RaggedTensor.from_row_splits(v, s) for v, s in ids]
        sp_weights = [tf.RaggedTensor.from_row_splits(w, s)
                      for w, (_, s) in zip(weights, ids)]
        with tf.GradientTape() as tape:
            out = group_embedding_lookup_sparse(
                tables, sp_ids, ["sum", "mean", "sqrtn"], sp_weights,
                is_sequence=sequence, max_norm=1.5)
            loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                             for i, o in enumerate(out)])
        grads = tape.gradient(loss, tables)
        assert all(isinstance(g, tf.IndexedSlices) for g in grads)
        optimizer.apply_gradients(zip(grads, tables))
        return [(tf.size(g.indices), tf.size(tf.unique(g.indices)[0]))
                for g in grads]

    traced = _step_function(step, labelled)

    traced()
    rows = traced()
    return [t.numpy() for t in tables], [(int(n), int(u)) for n, u in rows]


@pytest.mark.parametrize("name", ["ge_sgd", "ge_adagrad", "ge_adam",
                                  "ge_ftrl", "keras_adagrad", "keras_adam"])
@pytest.mark.parametrize("mode", ["pooled", "sequence"])
def test_optimizers_apply_the_padded_backward_as_the_cpu_kernels(
        host_adaptor, monkeypatch, name, mode):
    """The backward's rows past the distinct ids (the table's own ids,
    zero gradients) change no optimizer's update: two steps of each
    optimizer end with the tables the CPU kernels' gradients give."""
    import keras

    import group_embedding as ge
    make = {"ge_sgd": lambda: ge.optimizers.SGD(0.1),
            "ge_adagrad": lambda: ge.optimizers.Adagrad(0.1),
            "ge_adam": lambda: ge.optimizers.Adam(0.05),
            "ge_ftrl": lambda: ge.optimizers.Ftrl(0.1),
            "keras_adagrad": lambda: keras.optimizers.Adagrad(0.1),
            "keras_adam": lambda: keras.optimizers.Adam(0.05)}[name]
    got, got_rows = _optimizer_step(monkeypatch, True, make, mode)
    want, want_rows = _optimizer_step(monkeypatch, False, make, mode)
    _, start, ids, _ = _step_inputs(70, mode == "sequence")
    # The adaptor's rows: one per id, some of them padding.
    assert got_rows == [(len(v), u) for (v, _), (_, u) in zip(ids, want_rows)]
    assert any(n > u for n, u in got_rows)
    assert all(n == u for n, u in want_rows)
    for t, (g, w, s0) in enumerate(zip(got, want, start)):
        assert np.abs(w - s0).max() > 1e-4, f"table {t} did not move"
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} table {t}")


@pytest.fixture
def backward_calls(host_adaptor):
    """ge_backward(_padded) calls so far: gradients written out."""
    lib = ctypes.CDLL(_ADAPTOR["path"])
    lib.ge_host_backward_calls.restype = ctypes.c_longlong
    return lib.ge_host_backward_calls


# The fused path's ops: the training step's and the backward-apply.
FUSED_OPS = STEP_OPS + ("GroupEmbeddingBackwardApply",)


def _run_twice(ops, body):
    """body() traced with `ops` on the adaptor's kernels, run twice; the
    op types of the traced graph."""
    @tf.function
    def traced():
        graph = tf.compat.v1.get_default_graph()
        with graph._kernel_label_map({op: "ge_host_core" for op in ops}):
            body()

    traced()
    traced()
    return {op.type for op in traced.get_concrete_function().graph
            .get_operations()}


def _fused_step(monkeypatch, ops, make_optimizer, mode, weighted, max_norm):
    """Tables and slots after two `ge.optimizers` steps of one group with
    `ops` on the adaptor's kernels (none: the CPU kernels), and the op
    types of the traced step."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    sequence = mode == "sequence"
    _, arrays, ids, weights = _step_inputs(90, sequence)
    tables = [tf.Variable(a) for a in arrays]
    optimizer = make_optimizer()
    optimizer.build(tables)
    combiners = ["sum", "mean", "sqrtn"]

    def step():
        sp_ids = [tf.RaggedTensor.from_row_splits(v, s) for v, s in ids]
        sp_weights = ([tf.RaggedTensor.from_row_splits(w, s)
                       for w, (_, s) in zip(weights, ids)]
                      if weighted else None)
        with tf.GradientTape() as tape:
            out = group_embedding_lookup_sparse(
                tables, sp_ids, combiners, sp_weights, is_sequence=sequence,
                concat_outputs=mode == "concat", max_norm=max_norm)
            outs = [out] if mode == "concat" else out
            loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                             for i, o in enumerate(outs)])
        optimizer.apply_gradients(zip(tape.gradient(loss, tables), tables))

    types = _run_twice(ops, step)
    slots = [v.numpy() for v in optimizer.variables
             if len(v.shape) == 2]
    return [t.numpy() for t in tables], slots, types


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam", "ftrl"])
@pytest.mark.parametrize("mode,weighted,max_norm",
                         [("pooled", False, None), ("pooled", True, None),
                          ("concat", True, None), ("sequence", True, None),
                          ("pooled", True, 1.5)])
def test_optimizers_fuse_the_backward_and_the_update_on_the_gpu_kernels(
        host_adaptor, monkeypatch, backward_calls, name, mode, weighted,
        max_norm):
    """Issue 35.2: on the adaptor's kernels `ge.optimizers` update a
    group's plain tables with ONE GroupEmbeddingBackwardApply (the core's
    fused backward-apply): no gradient is written out (the host
    stand-in's backward is never called), and tables and slots equal
    those of the CPU kernels' IndexedSlices and the optimizer's own
    sparse update. A max_norm group is not fused (see
    backward_apply.fuse), with the same results."""
    import group_embedding as ge
    make = {"sgd": lambda: ge.optimizers.SGD(0.1),
            "adagrad": lambda: ge.optimizers.Adagrad(0.1),
            "adam": lambda: ge.optimizers.Adam(0.05),
            "ftrl": lambda: ge.optimizers.Ftrl(
                0.1, l1_regularization_strength=0.01,
                l2_regularization_strength=0.02,
                l2_shrinkage_regularization_strength=0.01)}[name]
    args = (make, mode, weighted, max_norm)
    before = backward_calls()
    got, got_slots, types = _fused_step(monkeypatch, FUSED_OPS, *args)
    if max_norm is None:
        assert backward_calls() == before, "a gradient was written out"
        assert "GroupEmbeddingBackwardApply" in types
    else:
        # The clip's backward reads the tables, so TF would run it and
        # the gradient op before the update anyway: not fused.
        assert backward_calls() > before
        assert "GroupEmbeddingBackwardApply" not in types
    want, want_slots, want_types = _fused_step(monkeypatch, (), *args)
    assert "GroupEmbeddingBackwardApply" not in want_types
    _, start, _, _ = _step_inputs(90, mode == "sequence")
    for t, (g, w, s0) in enumerate(zip(got, want, start)):
        assert np.abs(w - s0).max() > 1e-4, f"table {t} did not move"
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} table {t}")
    assert len(got_slots) == len(want_slots)
    for i, (g, w) in enumerate(zip(got_slots, want_slots)):
        # FTRL's linear slot takes differences of powers (powf against
        # tf.pow): a few float32 roundings apart.
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{name} slot {i}")


def _tf1_step(ops, make_optimizer, mode, max_norm=None):
    """Tables and slots after two TF1 `ge.train` steps of one weighted
    group (a graph and a session), `ops` on the adaptor's kernels; and
    the op types of the graph."""
    sequence = mode == "sequence"
    _, arrays, ids, weights = _step_inputs(92, sequence)
    graph = tf.Graph()
    with graph.as_default(), graph._kernel_label_map(
            {op: "ge_host_core" for op in ops}):
        tables = [tf.compat.v1.get_variable(
            f"t{i}", initializer=a, use_resource=True)
            for i, a in enumerate(arrays)]
        sp_ids = [tf.RaggedTensor.from_row_splits(v, s) for v, s in ids]
        sp_weights = [tf.RaggedTensor.from_row_splits(w, s)
                      for w, (_, s) in zip(weights, ids)]
        out = group_embedding_lookup_sparse(
            tables, sp_ids, ["sum", "mean", "sqrtn"], sp_weights,
            is_sequence=sequence, concat_outputs=mode == "concat",
            max_norm=max_norm)
        outs = [out] if mode == "concat" else out
        loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + float(i)))
                         for i, o in enumerate(outs)])
        optimizer = make_optimizer()
        train = optimizer.minimize(loss, var_list=tables)
        slots = [optimizer.get_slot(t, n) for t in tables
                 for n in optimizer.get_slot_names()]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            sess.run(train)
            got = sess.run(tables), sess.run(slots)
    return got, {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("name", ["sgd", "adagrad", "ftrl"])
@pytest.mark.parametrize("mode,max_norm", [
    ("pooled", None), ("concat", None), ("sequence", None),
    ("pooled", 1.5), ("sequence", 1.5)])
def test_tf1_optimizers_fuse_the_backward_and_the_update_on_the_gpu_kernels(
        host_adaptor, monkeypatch, backward_calls, name, mode, max_norm):
    """Issue 35.2, `ge.train` (TF1 graphs): the same fused op for SGD,
    Adagrad and FTRL (TF1's Adam decays m and v of every row, which the
    core's lazy Adam does not: it keeps the stock update), with the
    results of the CPU kernels' path and no gradient written out; max_norm
    groups too (a session runs only what the train op needs: the clip's
    backward and the gradient op are left out)."""
    import group_embedding as ge
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    make = {"sgd": lambda: ge.train.GradientDescentOptimizer(0.1),
            "adagrad": lambda: ge.train.AdagradOptimizer(0.1),
            "ftrl": lambda: ge.train.FtrlOptimizer(
                0.1, l1_regularization_strength=0.01,
                l2_regularization_strength=0.02,
                l2_shrinkage_regularization_strength=0.01)}[name]
    before = backward_calls()
    (got, got_slots), types = _tf1_step(FUSED_OPS, make, mode, max_norm)
    assert backward_calls() == before, "a gradient was written out"
    assert "GroupEmbeddingBackwardApply" in types
    (want, want_slots), want_types = _tf1_step((), make, mode, max_norm)
    assert "GroupEmbeddingBackwardApply" not in want_types
    _, start, _, _ = _step_inputs(92, mode == "sequence")
    for t, (g, w, s0) in enumerate(zip(got, want, start)):
        assert np.abs(w - s0).max() > 1e-4, f"table {t} did not move"
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} table {t}")
    for i, (g, w) in enumerate(zip(got_slots, want_slots)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{name} slot {i}")


@pytest.mark.parametrize("mode", ["pooled", "sequence"])
def test_fused_update_after_the_weight_gradients_read_the_tables(
        host_adaptor, monkeypatch, backward_calls, mode):
    """Trainable per-id weights: their gradients read the tables' rows
    (through snapshots) that the fused op updates in place in the same
    step. Tables and weights after two steps equal the CPU kernels'
    path, so every read saw the rows from before the update."""
    import group_embedding as ge
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    sequence = mode == "sequence"
    _, arrays, ids, weights = _step_inputs(93, sequence)

    def run(ops):
        tables = [tf.Variable(a) for a in arrays]
        ws = [tf.Variable(w) for w in weights]
        optimizer = ge.optimizers.Adagrad(0.1)
        optimizer.build(tables + ws)

        def step():
            sp_ids = [tf.RaggedTensor.from_row_splits(v, s)
                      for v, s in ids]
            with tf.GradientTape() as tape:
                sp_w = [tf.RaggedTensor.from_row_splits(w, s)
                        for w, (_, s) in zip(ws, ids)]
                out = group_embedding_lookup_sparse(
                    tables, sp_ids, ["sum", "mean", "sqrtn"], sp_w,
                    is_sequence=sequence)
                loss = tf.add_n([tf.reduce_sum(o * tf.sin(o + i))
                                 for i, o in enumerate(out)])
            variables = tables + ws
            optimizer.apply_gradients(
                zip(tape.gradient(loss, variables), variables))

        types = _run_twice(ops, step)
        return [v.numpy() for v in tables + ws], types

    before = backward_calls()
    got, types = run(FUSED_OPS)
    assert "GroupEmbeddingBackwardApply" in types
    assert backward_calls() == before
    want, _ = run(())
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"variable {i}")
    assert any(np.abs(w - w0).max() > 1e-4
               for w, w0 in zip(want[3:], weights)), "weights did not move"


def test_fused_update_leaves_a_changed_gradient_to_the_optimizer(
        host_adaptor, monkeypatch, backward_calls):
    """A gradient changed between the backward and the update (here
    scaled) is not the lookup's any more: the group keeps the gradient op
    and the optimizer's own update, with the same result as the CPU
    kernels."""
    import group_embedding as ge
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    _, arrays, ids, _ = _step_inputs(91, False)

    def run(ops):
        tables = [tf.Variable(a) for a in arrays]
        optimizer = ge.optimizers.Adagrad(0.1)
        optimizer.build(tables)

        def step():
            sp_ids = [tf.RaggedTensor.from_row_splits(v, s) for v, s in ids]
            with tf.GradientTape() as tape:
                out = group_embedding_lookup_sparse(
                    tables, sp_ids, ["sum", "mean", "sqrtn"])
                loss = tf.add_n([tf.reduce_sum(o * o) for o in out])
            grads = [tf.IndexedSlices(g.values * 0.5, g.indices,
                                      g.dense_shape)
                     for g in tape.gradient(loss, tables)]
            optimizer.apply_gradients(zip(grads, tables))

        types = _run_twice(ops, step)
        return [t.numpy() for t in tables], types

    before = backward_calls()
    got, types = run(FUSED_OPS)
    assert backward_calls() > before
    assert "GroupEmbeddingBackwardApply" not in types
    want, _ = run(())
    _assert_same(got, want, "table")


def test_adaptor_clip_and_snapshot_name_the_table_of_a_bad_id(host_adaptor):
    lib = host_adaptor
    table = tf.Variable(np.ones((5, 4), np.float32))
    tf.gather(table, [0])  # copy-on-read: the snapshot gathers rows

    def clip():
        return lib.group_embedding_clip_grad(
            tables=[table.handle, table.handle],
            unique_ids=[np.array([1], np.int64), np.array([0, 9], np.int64)],
            id_grads=[np.ones((1, 4), np.float32),
                      np.ones((2, 4), np.float32)], max_norm=0.5)

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"table 1: id 9 is out of range \[0, 5\)"):
        _on_adaptor(clip, ("GroupEmbeddingClipGrad",))

    def snapshot():
        return lib.group_embedding_table_snapshot(
            table=table.handle, ids=np.array([2, -1], np.int64),
            table_name="items")

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"items: id -1 is out of range \[0, 5\)"):
        _on_adaptor(snapshot, ("GroupEmbeddingTableSnapshot",))


def test_adaptor_weight_grad_checks_the_snapshot_rows(host_adaptor):
    lib = host_adaptor

    def weight_grad():
        return lib.group_embedding_weight_grad_from_snapshots(
            tables=[np.ones((3, 4), np.float32)], by_position=[True],
            ids=[np.array([0, 1], np.int64)],
            row_splits=[np.array([0, 2], np.int64)],
            weights=[np.ones(2, np.float32)],
            grads=[np.ones((1, 4), np.float32)],
            pooled=[np.ones((1, 4), np.float32)], combiners=["mean"])

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="the snapshot has 3 rows for 2 ids"):
        _on_adaptor(weight_grad, ("GroupEmbeddingWeightGradFromSnapshots",))


# -- the GPU TF wheel (documented run, not every CI run) ----------------------
@pytest.mark.skipif(not os.environ.get("GE_TEST_GPU_WHEEL"),
                    reason="set GE_TEST_GPU_WHEEL to the python of a venv "
                    "with tensorflow==2.21.0 (the GPU wheel)")
@needs_nvcc
def test_gpu_library_loads_into_the_gpu_tensorflow_wheel(tmp_path):
    """Builds the CPU and GPU libraries against tensorflow-cpu's headers
    and loads both into the GPU wheel of the same version."""
    python = os.environ["GE_TEST_GPU_WHEEL"]
    cpu_lib = kernel_library.build()
    gpu_lib = gpu_kernel_library.compile_tf_library(
        str(tmp_path / "gpu_ops.so"), capabilities=("90",))
    code = ("import tensorflow as tf\n"
            "assert tf.test.is_built_with_cuda()\n"
            f"tf.load_op_library({cpu_lib!r})\n"
            f"tf.load_op_library({gpu_lib!r})\n"
            "print('loaded into', tf.__version__, "
            "tf.sysconfig.get_build_info()['cuda_version'])\n")
    proc = subprocess.run([python, "-c", code], capture_output=True,
                          text=True, env=dict(os.environ,
                                              TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded into 2.21.0" in proc.stdout
