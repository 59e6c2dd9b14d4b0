"""The capability snapshot: made once per (kernel mode, save context),
frozen, carried by the plan, and what the sites below the plan read."""

import dataclasses

import pytest
import tensorflow as tf
from tensorflow.python.saved_model import save_context
from tensorflow.python.saved_model import save_options

from group_embedding import lookup_plan
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import Mode
from group_embedding.ops import capabilities
from group_embedding.ops import collective_routing
from group_embedding.ops import gpu_kernel_library
from group_embedding.ops import kernel_library
from group_embedding.ops import peer_exchange
from group_embedding.ops import sparse_apply
from group_embedding.ops.config import KernelMode
from group_embedding.ops.ragged_ids import FeatureIds

pytestmark = pytest.mark.skipif(
    kernel_library.library() is None,
    reason=f"no kernels: {kernel_library.unavailable_reason()}")


@pytest.fixture
def fresh(monkeypatch):
    """Snapshots made before the test are set aside during it."""
    monkeypatch.setattr(capabilities, "_snapshots", {})


def _snake(op_name):
    # The wrapper name TF generates for an op (as peer_exchange does).
    return peer_exchange._function_name(op_name)


def test_one_snapshot_per_mode_and_save_context(monkeypatch, fresh):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    custom = capabilities.current()
    assert capabilities.current() is custom
    assert custom.mode is KernelMode.CUSTOM and not custom.in_save
    assert custom.kernels is kernel_library.library()
    with pytest.raises(dataclasses.FrozenInstanceError):
        custom.kernels = None
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "tf")
    pure = capabilities.current()
    assert pure.kernels is None and pure.kernel_ops == frozenset()
    assert not pure.collective_routing and not pure.peer_exchange
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    with save_context.save_context(save_options.SaveOptions()):
        saving = capabilities.current()
        assert saving.in_save and saving.kernels is None
        assert capabilities.current() is saving
    assert capabilities.current() is custom


def test_decided_once_not_probed_again(monkeypatch, fresh):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    made = capabilities.current()
    # What the snapshot read changes; the snapshot does not.
    monkeypatch.setattr(gpu_kernel_library, "_gpus", [not made.gpu])
    assert capabilities.current().gpu == made.gpu
    monkeypatch.setattr(capabilities, "_snapshots", {})
    assert capabilities.current().gpu == (not made.gpu)


def test_op_families_match_the_loaded_module(monkeypatch, fresh):
    """The registry's view of the library agrees with the module's own
    wrappers (what the old `hasattr` probes looked at)."""
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    found = capabilities.current()
    module = kernel_library.library()
    assert "GroupEmbeddingPooledLookup" in found.kernel_ops
    for op in found.kernel_ops:
        assert callable(getattr(module, _snake(op))), op
    assert found.collective_routing == hasattr(
        module, "group_embedding_collective_route_ids")
    assert found.peer_exchange == hasattr(
        module, "group_embedding_peer_all_to_all")
    assert collective_routing.library() is (
        module if found.collective_routing else None)
    assert peer_exchange.library() is (
        module if found.peer_exchange else None)
    assert found.kernel_ops == capabilities.library_ops()


def test_a_stale_library_without_an_op_family_is_seen_as_such(
        monkeypatch, fresh):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    monkeypatch.setattr(capabilities, "_library_ops", [frozenset(
        op for op in capabilities.library_ops()
        if op not in (capabilities.ROUTING_OP,
                      capabilities.PEER_EXCHANGE_OP))])
    found = capabilities.current()
    assert found.kernels is not None
    assert not found.collective_routing and not found.peer_exchange
    assert collective_routing.library() is None
    assert peer_exchange.library() is None
    with pytest.raises(RuntimeError, match="collective lookup kernels are "
                                           "not loaded"):
        collective_routing._kernels()


def test_required_kernels_missing_is_an_error_each_time(monkeypatch, fresh):
    monkeypatch.setattr(kernel_library, "_state", dict(
        kernel_library._state, loaded=True, module=None,
        error="g++: not found (test)"))
    monkeypatch.setattr(capabilities, "_library_ops", [])
    for mode in ("custom", "cuda"):
        monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", mode)
        for _ in range(2):
            with pytest.raises(RuntimeError, match=rf"KERNELS={mode} but "
                               r"the C\+\+ kernels could not be built: "
                               r"g\+\+: not found \(test\)"):
                capabilities.current()
    assert capabilities._snapshots == {}
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "auto")
    assert capabilities.current().kernels is None


def test_the_plan_carries_the_snapshot_it_chose_from(monkeypatch, fresh):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    ids = tf.constant([1, 2], tf.int64)
    feats = [FeatureIds(ids, tf.constant([0, 1, 2], tf.int64), None, None,
                        None, "f")]
    (group,) = lookup_plan.group_tables(
        [tf.Variable(tf.zeros([4, 2]))], feats, ["t"], ["sum"],
        LookupCall(mode=Mode.POOLED), 8)
    assert group.capabilities is capabilities.current()
    expected = (lookup_plan.Backend.GPU_KERNELS if group.capabilities.gpu
                else lookup_plan.Backend.CPU_KERNELS)
    assert group.backend is expected


def test_sparse_adagrad_reads_the_snapshot(monkeypatch, fresh):
    table = tf.Variable(tf.zeros([4, 2]))
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    assert sparse_apply.has_fused_adagrad(table) == (
        not capabilities.current().gpu)
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "tf")
    assert not sparse_apply.has_fused_adagrad(table)
