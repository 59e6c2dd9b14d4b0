"""The op names of the kernel library (ops/op_names.py,
ops/kernels/op_registration.h): one prefix, and the old names of renamed
ops kept as aliases so that graphs saved before the rename still run.
"""

import importlib.util
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels
from tensorflow.python.framework import op_def_registry

from group_embedding.ops import capabilities
from group_embedding.ops import kernel_library
from group_embedding.ops import op_names

V1 = tf.compat.v1
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.fixture(name="lib", scope="module")
def _lib():
    lib = capabilities.current().kernels
    if lib is None:
        pytest.skip(f"no kernels: {kernel_library.unavailable_reason()}")
    return lib


def _op_defs(lib):
    """The OpDefs of the ops the library registers: its module has one
    CamelCase wrapper per op (as frozen_graph.is_library_op reads
    it), none of them a stock op."""
    names = [n for n in dir(lib) if n[:1].isupper() and callable(
        getattr(lib, n)) and n not in dir(tf.raw_ops)
        and op_def_registry.get(n) is not None]  # not typing's names
    assert len(names) >= 40, names
    return {n: op_def_registry.get(n) for n in names}


def test_every_op_has_the_prefix_or_is_a_listed_alias(lib):
    unnamed = sorted(name for name in _op_defs(lib)
                     if not name.startswith(op_names.PREFIX)
                     and name not in op_names.ALIASES)
    assert not unnamed, f"ops without the {op_names.PREFIX} prefix: {unnamed}"
    for new in op_names.ALIASES.values():
        assert new.startswith(op_names.PREFIX), new


def test_aliases_have_the_same_op_def_and_cpu_kernel(lib):
    defs = _op_defs(lib)
    for old, new in op_names.ALIASES.items():
        assert old in defs and new in defs, (old, new)
        want, got = type(defs[new])(), type(defs[old])()
        want.CopyFrom(defs[new])
        got.CopyFrom(defs[old])
        got.name = want.name
        assert got == want, f"{old} differs from {new}"
        cpu = [k for k in kernels.get_registered_kernels_for_op(old).kernel
               if k.device_type == "CPU"]
        assert cpu, f"{old} has no CPU kernel"


def test_with_alias():
    assert op_names.with_alias("GroupEmbeddingEVGather") == (
        "GroupEmbeddingEVGather", "EVGroupGather")
    assert op_names.with_alias("GroupEmbeddingConcatLookup") == (
        "GroupEmbeddingConcatLookup",)
    with pytest.raises(ValueError,
                       match="old name of 'GroupEmbeddingEVGather'"):
        op_names.with_alias("EVGroupGather")


def _graph_module():
    spec = importlib.util.spec_from_file_location(
        "make_old_graph", os.path.join(DATA, "make_old_graph.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_step(graph, train_op, fetches, tables):
    """Initialises `graph`, fetches, runs one training step, fetches again."""
    with graph.as_default(), V1.Session(graph=graph) as sess:
        sess.run([V1.global_variables_initializer()]
                 + V1.get_collection("ev_init_var_ops"))
        sess.run(V1.get_collection("ev_init_slot_ops"))
        before = sess.run(list(fetches))
        sess.run(train_op)
        after = sess.run(list(fetches) + list(tables))
    return before + after


def test_graph_saved_before_the_rename_imports_and_trains(lib):
    # old_op_names.meta: written by make_old_graph.py at the commit before
    # the rename (forward, gradient and Adagrad ops of plain tables and an
    # EV, SparseTensor ids); the same model built now must equal it.
    del lib  # loaded: the imported graph needs the ops registered
    mog = _graph_module()
    old_graph = tf.Graph()
    with old_graph.as_default():
        V1.train.import_meta_graph(os.path.join(DATA, "old_op_names.meta"))
        old_types = {op.type for op in old_graph.get_operations()}
        old_train = old_graph.get_operation_by_name(mog.TRAIN_OP)
    assert {"GroupEmbeddingVariableLookup", "GroupEmbeddingVariableLookupGrad",
            "EVGroupLookup", "EVApplyAdagrad", "EVHandleOp",
            "GroupSparseToRagged", "GroupSparseApplyAdagrad"} <= old_types
    new_graph = tf.Graph()
    with new_graph.as_default():
        V1.set_random_seed(1)
        new_train = mog.build()
        new_types = {op.type for op in new_graph.get_operations()}
    assert not new_types & set(op_names.ALIASES), new_types
    assert "GroupEmbeddingPooledLookup" in new_types
    got = _run_step(old_graph, old_train, mog.FETCHES, mog.TABLES)
    want = _run_step(new_graph, new_train, mog.FETCHES, mog.TABLES)
    for name, g, w in zip(2 * mog.FETCHES + mog.TABLES, got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)


def test_old_graph_differentiates_through_the_aliases(lib):
    # Gradients are registered for both names: tf.gradients on an imported
    # old graph builds the new gradient ops.
    del lib
    graph = tf.Graph()
    with graph.as_default():
        V1.train.import_meta_graph(os.path.join(DATA, "old_op_names.meta"))
        loss = graph.get_tensor_by_name("loss:0")
        lookup = [op for op in graph.get_operations()
                  if op.type == "GroupEmbeddingVariableLookup"][0]
        grads = tf.gradients(loss, lookup.inputs[0])
        types = {op.type for op in graph.get_operations()}
    assert grads[0] is not None
    assert "GroupEmbeddingPooledLookupGrad" in types
