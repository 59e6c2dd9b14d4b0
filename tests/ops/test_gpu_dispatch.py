"""Which path a lookup takes on a GPU machine, decided here by pretending
TF sees a GPU (the decision is plain Python; what runs is checked in
test_cuda_core.py and on the GPU machine)."""

import pytest
import tensorflow as tf

from group_embedding import lookup_plan
from group_embedding.ops import gpu_kernel_library
from group_embedding.ops.ragged_ids import FeatureIds


@pytest.fixture
def fake_gpu(monkeypatch):
    """TF "sees" a GPU; the GPU library "loads" unless told otherwise."""
    monkeypatch.setattr(gpu_kernel_library, "_gpus", [True])
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


def _uses_kernel(max_norm=None, weighted=False):
    table = tf.Variable(tf.zeros([5, 4]))
    return lookup_plan.kernel_eligible([table], max_norm, _feats(weighted))


def test_gpu_kernels_by_default_for_plain_groups(fake_gpu, monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    assert gpu_kernel_library.GPU_KERNELS_BY_DEFAULT
    assert _uses_kernel()
    # Their backward reads the tables in CPU-only ops: pure TF on a GPU.
    assert not _uses_kernel(weighted=True)
    assert not _uses_kernel(max_norm=1.0)


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
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    assert _uses_kernel()
    assert _uses_kernel(weighted=True)
    assert _uses_kernel(max_norm=1.0)
