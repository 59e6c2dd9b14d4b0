"""The lookup plan: one frozen TableGroup per fused lookup, its kind and
backend decided once, and the collective runtime reached only through
`model_parallel`'s registration."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import lookup_plan
from group_embedding import model_parallel
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import Mode
from group_embedding.ops import lookup_kernels
from group_embedding.ops.ragged_ids import FeatureIds

from tests.testing import assert_close


def _feats(n, weighted=False):
    ids = tf.constant([1, 2, 3], tf.int64)
    return [FeatureIds(values=ids,
                       row_splits=tf.constant([0, 2, 3], tf.int64),
                       weights=tf.ones([3]) if weighted else None,
                       positions=None, max_len=None, name=f"f{i}")
            for i in range(n)]


def _plan(tables, mode=Mode.POOLED, max_norm=None, weighted=False,
          per_group=100):
    n = len(tables)
    return lookup_plan.group_tables(
        tables, _feats(n, weighted), [f"t{i}" for i in range(n)],
        ["sum"] * n, LookupCall(mode=mode, max_norm=max_norm), per_group)


@pytest.fixture
def no_runtime():
    saved = model_parallel.runtime()
    model_parallel.unregister()
    yield
    if saved is not None:
        model_parallel.register(saved)
    else:
        model_parallel.unregister()


class FakeRuntime:
    """A registered collective runtime that records what it is asked."""

    def __init__(self, size):
        self.calls = []
        self.runtime = model_parallel.Runtime(
            rank=0, size=size, pooled_lookup=self._pooled,
            sequence_lookup=self._pooled, collective_table=None)

    def _pooled(self, group, call):
        self.calls.append((group.kind, group.backend, call.mode))
        return [tf.zeros([2, int(t.shape[-1])]) for t in group.tables]


def test_groups_are_frozen_and_keyed_by_dim_dtype_kind(monkeypatch,
                                                       no_runtime):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    a, b = tf.Variable(tf.zeros([5, 4])), tf.Variable(tf.zeros([5, 8]))
    c = tf.Variable(tf.zeros([5, 4]))
    d = tf.Variable(tf.zeros([5, 4], tf.float64))
    groups = _plan([a, b, c, d])
    assert lookup_plan.describe(groups) == [
        {"members": [0, 2], "names": ["t0", "t2"], "kind": "variable",
         "backend": "cpu_kernels"},
        {"members": [1], "names": ["t1"], "kind": "variable",
         "backend": "cpu_kernels"},
        # The kernels take float32 only.
        {"members": [3], "names": ["t3"], "kind": "variable",
         "backend": "tf_ops"}]
    assert not groups[0].consecutive and groups[1].consecutive
    with pytest.raises(dataclasses.FrozenInstanceError):
        groups[0].backend = "tf_ops"
    assert [g.members for g in _plan([a, c, c], per_group=2)] == [
        (0, 1), (2,)]


def test_backend_follows_the_kernel_mode_and_arguments(monkeypatch,
                                                       no_runtime):
    table = tf.Variable(tf.zeros([5, 4]))
    ev = ge.get_embedding_variable("plan_ev", 4)
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "tf")
    assert _plan([table])[0].backend == "tf_ops"
    assert _plan([ev])[0].backend == "tf_ops"
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    assert _plan([table], max_norm=1.0)[0].backend == "cpu_kernels"
    # A tensor bound (or a negative one) only the TF path applies.
    assert _plan([table], max_norm=tf.constant(1.0))[0].backend == "tf_ops"
    assert _plan([ev])[0].backend == "cpu_kernels"
    assert _plan([ev], max_norm=1.0)[0].backend == "tf_ops"
    assert _plan([ev], mode=Mode.SEQUENCE,
                 weighted=True)[0].backend == "tf_ops"
    assert lookup_kernels.kernel_max_norm(-1.0) is None


def test_one_worker_sharded_table_plans_the_single_process_path(
        monkeypatch, no_runtime):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    rows = np.random.RandomState(0).rand(6, 4).astype(np.float32)
    sharded = ShardedVariable("plan_one", 6, 4, "mod", 1, 0,
                              initial_value=rows)
    (group,) = _plan([sharded])
    assert (group.kind, group.backend) == ("variable", "cpu_kernels")
    assert group.tables[0] is sharded.shard_variable
    ids = tf.ragged.constant([[0, 5, 5], [], [2]], tf.int64)
    with tf.GradientTape() as tape:
        out = ge.group_embedding_lookup_sparse([sharded], [ids], "mean")[0]
        loss = tf.reduce_sum(out * out)
    plain = tf.Variable(rows)
    with tf.GradientTape() as stock_tape:
        stock = tf.nn.embedding_lookup_sparse(plain, ids.to_sparse(), None,
                                              combiner="mean")
        stock_loss = tf.reduce_sum(stock * stock)
    assert_close(out, stock)
    assert_close(tf.convert_to_tensor(
        tape.gradient(loss, sharded.shard_variable)),
        tf.convert_to_tensor(stock_tape.gradient(stock_loss, plain)))


def test_sharded_table_without_collective_mode_is_refused(no_runtime):
    sharded = ShardedVariable("plan_two", 6, 4, "mod", 2, 0,
                              initial_value=np.zeros([3, 4], np.float32))
    with pytest.raises(ValueError, match=r"t0 is sharded over 2 workers "
                                         r"but collective mode is not"):
        _plan([sharded])


def test_collective_groups_go_to_the_registered_runtime(monkeypatch,
                                                        no_runtime):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    ev = ge.get_embedding_variable("plan_ev2", 4)
    table = tf.Variable(tf.zeros([5, 4]))
    sharded = ShardedVariable("plan_three", 6, 4, "mod", 2, 0,
                              initial_value=np.zeros([3, 4], np.float32))
    fake = FakeRuntime(size=2)
    model_parallel.register(fake.runtime)
    groups = _plan([ev, table, sharded])
    assert [(g.kind, g.backend) for g in groups] == [
        ("ev", "collective"), ("variable", "cpu_kernels"),
        ("sharded", "collective")]
    ids = tf.ragged.constant([[1], [2, 3]], tf.int64)
    outs = ge.group_embedding_lookup_sparse([ev, table, sharded],
                                            [ids] * 3, "sum")
    assert fake.calls == [("ev", "collective", "pooled"),
                          ("sharded", "collective", "pooled")]
    assert [tuple(o.shape) for o in outs] == [(2, 4)] * 3
    # One worker registered: EVs are not model parallel.
    model_parallel.register(FakeRuntime(size=1).runtime)
    assert _plan([ev])[0].backend == "cpu_kernels"
