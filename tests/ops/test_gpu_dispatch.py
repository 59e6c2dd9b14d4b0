"""Which path a lookup takes on a GPU machine, decided here by pretending
TF sees a GPU (the decision is plain Python; what runs is checked in
test_cuda_core.py and on the GPU machine)."""

import warnings

import pytest
import tensorflow as tf

from group_embedding import lookup
from group_embedding import lookup_plan
from group_embedding.lookup import group_embedding_lookup_sparse
from group_embedding.lookup_plan import Backend
from group_embedding.lookup_plan import Mode
from group_embedding.ops import capabilities
from group_embedding.ops import gpu_kernel_library
from group_embedding.ops.ragged_ids import FeatureIds
from group_embedding.packed_ids import pack_ids


@pytest.fixture
def fake_gpu(monkeypatch):
    """TF "sees" a GPU; the GPU library "loads" unless told otherwise."""
    monkeypatch.setattr(gpu_kernel_library, "_gpus", [True])
    # Snapshots made with the real devices are set aside for the test.
    monkeypatch.setattr(capabilities, "_snapshots", {})
    state = dict(gpu_kernel_library._state, tried=True, module=object(),
                 error=None)
    monkeypatch.setattr(gpu_kernel_library, "_state", state)
    return state


def _feats(weighted):
    ids = tf.constant([1, 2, 3], tf.int64)
    return [FeatureIds(values=ids,
                       row_splits=tf.constant([0, 2, 3], tf.int64),
                       weights=tf.ones([3]) if weighted else None,
                       positions=None, max_len=None, name="f")]


def _uses_kernel(max_norm=None):
    table = tf.Variable(tf.zeros([5, 4]))
    return lookup_plan.kernel_eligible([table], max_norm)


def _plan(tables, mode, weighted=False, max_norm=None):
    names = [f"t{i}" for i in range(len(tables))]
    call = lookup_plan.LookupCall(mode=mode, max_norm=max_norm)
    return lookup_plan.group_tables(
        tables, _feats(weighted) * len(tables), names,
        ["sum"] * len(tables), call, params_num_per_group=8)


def test_gpu_kernels_by_default_for_plain_groups(fake_gpu, monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    assert gpu_kernel_library.GPU_KERNELS_BY_DEFAULT
    assert _uses_kernel()
    assert _uses_kernel(max_norm=1.0)
    # Only what the kernels' attr cannot hold stays on pure TF.
    assert not _uses_kernel(max_norm=tf.constant(1.0))
    assert not _uses_kernel(max_norm=-1.0)


@pytest.mark.parametrize("mode", [Mode.POOLED, Mode.CONCAT,
                                  Mode.SEQUENCE])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_every_variant_of_float32_groups_plans_the_gpu_kernels(
        fake_gpu, monkeypatch, recwarn, mode, weighted, max_norm):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    tables = [tf.Variable(tf.zeros([5, 4])) for _ in range(2)]
    groups = _plan(tables, mode, weighted, max_norm)
    assert [g.backend for g in groups] == [Backend.GPU_KERNELS]
    assert not [w for w in recwarn if "pure-TF" in str(w.message)]


def test_other_dtypes_run_pure_tf_with_one_warning_naming_the_group(
        fake_gpu, monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    monkeypatch.setattr(lookup_plan, "_warned_groups", set())
    tables = [tf.Variable(tf.zeros([5, 4], tf.float16)),
              tf.Variable(tf.zeros([5, 4], tf.float16)),
              tf.Variable(tf.zeros([5, 4]))]
    with pytest.warns(RuntimeWarning,
                      match=r"tables t0, t1 runs the pure-TF path on the "
                            r"GPU.*float32 tables, got float16") as caught:
        groups = _plan(tables, Mode.POOLED)
    assert [(g.names, g.backend) for g in groups] == [
        (("t0", "t1"), Backend.TF_OPS),
        (("t2",), Backend.GPU_KERNELS)]
    assert len([w for w in caught if "pure-TF" in str(w.message)]) == 1
    # Once per group: planning it again warns no more.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(tables, Mode.POOLED)


def test_packed_ids_plan_the_gpu_kernels(fake_gpu, monkeypatch):
    """Packed ids are unpacked into per-table ids before the plan (CPU
    ops in the input's place); the lookup itself is on the GPU kernels."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    tables = [tf.Variable(tf.zeros([5, 4])) for _ in range(2)]
    ids = [tf.ragged.constant([[1, 2], [3]], tf.int64) for _ in tables]
    packed = pack_ids(ids, [tf.ragged.constant([[0.5, 1.0], [2.0]])] * 2)
    planned = []
    real = lookup_plan.group_tables

    def spy(*args, **kwargs):
        planned.extend(real(*args, **kwargs))
        return planned

    monkeypatch.setattr(lookup_plan, "group_tables", spy)
    monkeypatch.setattr(lookup, "run_group", lambda g, c: [
        tf.zeros([2, 4])] * len(g.members))
    group_embedding_lookup_sparse(tables, packed, ["sum", "mean"])
    assert [g.backend for g in planned] == [Backend.GPU_KERNELS]


@pytest.mark.parametrize("mode", ["tf", "custom"])
def test_tf_and_custom_modes_keep_the_pure_tf_path_on_gpu(fake_gpu,
                                                          monkeypatch, mode):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
    assert not _uses_kernel()


def test_without_the_library_auto_falls_back_and_cuda_says_why(
        fake_gpu, monkeypatch):
    fake_gpu.update(module=None, error="no CUDA compiler found")
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    assert not _uses_kernel()
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA compiler found"):
        _uses_kernel()


def test_without_gpu_the_cpu_kernels_serve_every_group(monkeypatch):
    monkeypatch.setattr(gpu_kernel_library, "_gpus", [False])
    monkeypatch.setattr(capabilities, "_snapshots", {})
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    assert _uses_kernel()
    assert _uses_kernel(max_norm=1.0)
