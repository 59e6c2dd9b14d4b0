"""Malformed inputs give clear errors (or stock results), never a crash.

Inputs that used to abort or segfault the process run in a subprocess:
the test then fails on a crash instead of taking the suite down. Each
subprocess checks both lookup paths (C++ kernels and pure TF,
`GROUP_EMBEDDING_KERNELS` is read on every lookup).
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import kernel_library

from testing import stock_lookup

_PRELUDE = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import tensorflow as tf
import group_embedding as ge
from group_embedding.ops import kernel_library

def expect_error(what, fn, *needles, errors=(tf.errors.InvalidArgumentError,)):
    # Runs fn, which must raise one of `errors` whose message holds every
    # needle; prints progress first so that a crash names its case.
    print("case:", what, flush=True)
    try:
        fn()
    except errors as e:
        msg = str(e)
        for n in needles:
            assert n in msg, (what, n, msg)
        return
    raise AssertionError(f"{what}: no error")

def each_mode(fn):
    for mode in ("custom", "tf"):
        os.environ["GROUP_EMBEDDING_KERNELS"] = mode
        fn(mode)
"""


def run_isolated(body: str, timeout: float = 300):
    """Runs `body` (after `_PRELUDE`) in a fresh interpreter; it must exit
    0 and print DONE."""
    code = _PRELUDE + textwrap.dedent(body) + "\nprint('DONE', flush=True)\n"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-c", code], env=env,
                            capture_output=True, text=True, timeout=timeout,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    assert result.returncode == 0 and "DONE" in result.stdout, (
        f"returncode {result.returncode}\nstdout:\n{result.stdout[-3000:]}"
        f"\nstderr:\n{result.stderr[-3000:]}")


def _lib():
    lib = kernel_library.library()
    # setup.sh builds the kernels; their absence is a failure, not a skip.
    assert lib is not None, kernel_library.unavailable_reason()
    return lib


# --- 1. dense_shape[0] overflow / negative batch ---------------------------

def test_huge_or_negative_batch_is_invalid_argument():
    run_isolated("""
    table = tf.Variable(tf.ones([4, 3]))

    def check(mode):
        huge = tf.SparseTensor([[0, 0]], tf.constant([1], tf.int64),
                               [2**63 - 1, 2])
        expect_error(f"{mode}: eager dense_shape[0] = 2**63 - 1",
                     lambda: ge.group_embedding_lookup_sparse(
                         [table], [huge], "sum"),
                     "sp_ids[0]", "dense_shape[0]")

        @tf.function(input_signature=[tf.TensorSpec([2], tf.int64)])
        def lookup(shape):
            sp = tf.SparseTensor(tf.zeros([0, 2], tf.int64),
                                 tf.zeros([0], tf.int64), shape)
            return ge.group_embedding_lookup_sparse([table], [sp], "mean")[0]

        expect_error(f"{mode}: tf.function negative batch",
                     lambda: lookup(tf.constant([-5, 2], tf.int64)),
                     "sp_ids[0]", "dense_shape[0]")
        # A sane batch still works: zeros for 3 empty rows.
        np.testing.assert_array_equal(
            lookup(tf.constant([3, 2], tf.int64)).numpy(), np.zeros([3, 3]))

    each_mode(check)
    """)


# --- 2. every kernel validates ranks and sizes -----------------------------

def test_indices_without_columns_is_invalid_argument():
    run_isolated("""
    table = tf.Variable(tf.ones([4, 3]))

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64),
                                  tf.TensorSpec([None], tf.int64),
                                  tf.TensorSpec([2], tf.int64)])
    def lookup(indices, values, shape):
        sp = tf.SparseTensor(indices, values, shape)
        return ge.group_embedding_lookup_sparse([table], [sp], "sum")[0]

    def check(mode):
        expect_error(f"{mode}: indices [3, 0]",
                     lambda: lookup(tf.zeros([3, 0], tf.int64),
                                    tf.constant([0, 1, 2], tf.int64),
                                    tf.constant([2, 4], tf.int64)),
                     "sp_ids[0]", "indices")
        expect_error(f"{mode}: indices [3, 1]",
                     lambda: lookup(tf.zeros([3, 1], tf.int64),
                                    tf.constant([0, 1, 2], tf.int64),
                                    tf.constant([2, 4], tf.int64)),
                     "sp_ids[0]", "indices")

    each_mode(check)
    """)


def test_raw_kernels_reject_malformed_inputs():
    """Every op of ops/kernels, called directly with a wrong rank or size
    for each input kind, raises InvalidArgument naming the input."""
    _lib()
    run_isolated("""
    lib = kernel_library.library()
    i64 = lambda x: tf.constant(x, tf.int64)
    f32 = lambda x: tf.constant(x, tf.float32)
    table = tf.Variable(tf.ones([4, 2]))
    accum = tf.Variable(tf.ones([4, 2]))
    empty_w = tf.zeros([0], tf.float32)
    ok_ids, ok_splits = i64([0, 1, 3]), i64([0, 2, 3])

    def lookup(ids=ok_ids, splits=ok_splits, weights=empty_w):
        return lib.group_embedding_pooled_lookup(
            tables=[table.handle], ids=[ids], row_splits=[splits],
            weights=[weights], combiners=["sum"], table_names=["t"],
            embedding_dim=2)

    expect_error("lookup ids [3, 1]", lambda: lookup(ids=i64([[0], [1], [3]])),
                 "ids must be a vector")
    expect_error("lookup weights [3, 1]",
                 lambda: lookup(weights=f32([[1.0], [1.0], [1.0]])),
                 "weights must be a vector")
    expect_error("lookup splits scalar", lambda: lookup(splits=i64(0)),
                 "row_splits")

    def grad(grads, ids=ok_ids, splits=ok_splits):
        return lib.group_embedding_pooled_lookup_grad(
            grads=[grads], ids=[ids], row_splits=[splits], weights=[empty_w],
            combiners=["mean"], embedding_dim=2)

    expect_error("grad: grads [1, 2] for batch 2",
                 lambda: grad(tf.ones([1, 2])), "grads", "[2, 2]")
    expect_error("grad: grads [2, 5]", lambda: grad(tf.ones([2, 5])),
                 "grads")
    expect_error("grad: splits end past ids",
                 lambda: grad(tf.ones([2, 2]), splits=i64([0, 2, 9])),
                 "row_splits")
    expect_error("grad: ids [3, 1]",
                 lambda: grad(tf.ones([2, 2]), ids=i64([[0], [1], [3]])),
                 "ids must be a vector")

    def concat_lookup(splits2):
        return lib.group_embedding_concat_lookup(
            tables=[table.handle, table.handle], ids=[ok_ids, ok_ids],
            row_splits=[ok_splits, splits2], weights=[empty_w, empty_w],
            combiners=["sum", "sum"], table_names=["t", "u"],
            embedding_dim=2)

    expect_error("concat lookup: batch 2 and 3",
                 lambda: concat_lookup(i64([0, 1, 2, 3])), "u", "3 rows",
                 "equal batch sizes")
    expect_error("concat lookup: id past the table",
                 lambda: lib.group_embedding_concat_lookup(
                     tables=[table.handle], ids=[i64([0, 1, 4])],
                     row_splits=[ok_splits], weights=[empty_w],
                     combiners=["sum"], table_names=["t"], embedding_dim=2),
                 "t: id 4 is out of range [0, 4)")

    def concat_grad(grads, splits2=ok_splits):
        return lib.group_embedding_concat_lookup_grad(
            grads=grads, ids=[ok_ids, ok_ids], row_splits=[ok_splits, splits2],
            weights=[empty_w, empty_w], combiners=["sum", "mean"],
            embedding_dim=2)

    expect_error("concat grad: grads [2, 2] for 2 tables of dim 2",
                 lambda: concat_grad(tf.ones([2, 2])), "grads", "[2, 4]")
    expect_error("concat grad: grads vector", lambda: concat_grad(
        tf.ones([8])), "grads")
    expect_error("concat grad: batch 2 and 3", lambda: concat_grad(
        tf.ones([2, 4]), splits2=i64([0, 1, 2, 3])), "equal batch sizes")

    def wgrad(grads, pooled, ids=ok_ids):
        return lib.group_embedding_weight_grad(
            tables=[table.handle], ids=[ids], row_splits=[ok_splits],
            weights=[f32([1.0, 2.0, 3.0])], grads=[grads], pooled=[pooled],
            combiners=["sum"])

    expect_error("weight grad: grads [1, 2]",
                 lambda: wgrad(tf.ones([1, 2]), tf.ones([2, 2])), "grads")
    expect_error("weight grad: pooled [2, 7]",
                 lambda: wgrad(tf.ones([2, 2]), tf.ones([2, 7])), "pooled")
    expect_error("weight grad: id 99 outside the table",
                 lambda: wgrad(tf.ones([2, 2]), tf.ones([2, 2]),
                               ids=i64([0, 1, 99])), "99")

    def to_ragged(indices=i64([[0, 0], [1, 0]]), ids=i64([5, 6]),
                  shape=i64([2, 3]), weights=empty_w):
        return lib.group_embedding_sparse_to_ragged(
            indices=[indices], ids=[ids], dense_shapes=[shape],
            weights=[weights], feature_names=["f"])

    expect_error("to_ragged indices [2, 0]",
                 lambda: to_ragged(indices=tf.zeros([2, 0], tf.int64)),
                 "f: indices")
    expect_error("to_ragged indices [2, 3]",
                 lambda: to_ragged(indices=tf.zeros([2, 3], tf.int64)),
                 "f: indices")
    expect_error("to_ragged ids [2, 1]",
                 lambda: to_ragged(ids=i64([[5], [6]])), "values")
    expect_error("to_ragged dense_shape [1, 2]",
                 lambda: to_ragged(shape=i64([[2, 3]])), "dense_shape")
    expect_error("to_ragged weights [2, 1]",
                 lambda: to_ragged(weights=f32([[1.0], [1.0]])), "weights")
    expect_error("to_ragged batch 2**63 - 1",
                 lambda: to_ragged(shape=i64([2**63 - 1, 3])),
                 "dense_shape[0]")
    expect_error("to_ragged batch -1",
                 lambda: to_ragged(indices=tf.zeros([0, 2], tf.int64),
                                   ids=i64([]), shape=i64([-1, 3])),
                 "dense_shape[0]")

    def adagrad(lr=f32(0.1), eps=f32(1e-7), indices=i64([0, 2]),
                g=tf.ones([2, 2])):
        return lib.group_embedding_sparse_apply_adagrad(
            var=table.handle, accum=accum.handle, lr=lr, epsilon=eps,
            indices=indices, grad=g)

    expect_error("adagrad lr [2]", lambda: adagrad(lr=f32([0.1, 0.2])), "lr")
    expect_error("adagrad epsilon []", lambda: adagrad(eps=f32([])),
                 "epsilon")
    expect_error("adagrad indices [2, 1]",
                 lambda: adagrad(indices=i64([[0], [2]])), "indices")
    expect_error("adagrad grad [4]", lambda: adagrad(g=tf.ones([4])),
                 "grad")
    expect_error("adagrad grad [2, 3]", lambda: adagrad(g=tf.ones([2, 3])),
                 "grad")

    # --- EmbeddingVariable kernels
    ev = ge.get_embedding_variable("hardening_ev", 2)
    lib.group_embedding_ev_ensure_slot(ev.handle, slot_name="acc",
                                       initial_value=0.1)
    lib.group_embedding_ev_ensure_slot(ev.handle, slot_name="m",
                                       initial_value=0.0)
    dflt = ev.default_values

    def ev_lookup(training=tf.constant(True), keys=ok_ids):
        return lib.group_embedding_ev_lookup(
            handles=[ev.handle], keys=[keys], row_splits=[ok_splits],
            weights=[empty_w], default_values=[dflt], training=training,
            combiners=["sum"], embedding_dim=2)

    def ev_gather(training=tf.constant(True), keys=ok_ids):
        return lib.group_embedding_ev_gather(
            handles=[ev.handle], keys=[keys], default_values=[dflt],
            training=training, embedding_dim=2)

    def ev_sequence(training=tf.constant(True), keys=ok_ids,
                    positions=i64([0, 1, 0]), max_len=i64(2)):
        return lib.group_embedding_ev_sequence_lookup(
            handles=[ev.handle], keys=[keys], row_splits=[ok_splits],
            positions=[positions], max_lens=[max_len], default_values=[dflt],
            training=training, embedding_dim=2)

    expect_error("GroupEmbeddingEVSequenceLookup position 2 of max_len 2",
                 lambda: ev_sequence(positions=i64([0, 2, 0])),
                 "hardening_ev", "position 2", "[0, 2)")
    expect_error("GroupEmbeddingEVSequenceLookup position -1",
                 lambda: ev_sequence(positions=i64([0, -1, 0])),
                 "position -1")
    expect_error("GroupEmbeddingEVSequenceLookup 2 positions for 3 keys",
                 lambda: ev_sequence(positions=i64([0, 1])), "positions",
                 "3 entries")
    expect_error("GroupEmbeddingEVSequenceLookup max_len -1",
                 lambda: ev_sequence(max_len=i64(-1)), "max_lens", ">= 0")
    expect_error("GroupEmbeddingEVSequenceLookup max_len [1]",
                 lambda: ev_sequence(max_len=i64([2])),
                 "max_lens must be a scalar")
    expect_error("GroupEmbeddingEVSequenceLookup [B, T, D] overflowing int64",
                 lambda: ev_sequence(max_len=i64(2**62)), "overflow")
    for name, fn in (("GroupEmbeddingEVLookup", ev_lookup),
                     ("GroupEmbeddingEVGather", ev_gather),
                     ("GroupEmbeddingEVSequenceLookup", ev_sequence)):
        expect_error(f"{name} training [2]",
                     lambda: fn(training=tf.constant([True, False])),
                     "training must be a scalar")
        expect_error(f"{name} training []",
                     lambda: fn(training=tf.zeros([0], tf.bool)),
                     "training must be a scalar")
        expect_error(f"{name} keys [3, 1]",
                     lambda: fn(keys=i64([[0], [1], [3]])), "keys")

    expect_error("GroupEmbeddingEVWeightGrad grads [1, 2]",
                 lambda: lib.group_embedding_ev_weight_grad(
                     handles=[ev.handle], keys=[ok_ids],
                     row_splits=[ok_splits], weights=[f32([1.0, 1.0, 1.0])],
                     default_values=[dflt], grads=[tf.ones([1, 2])],
                     pooled=[tf.ones([2, 2])], combiners=["sum"],
                     embedding_dim=2), "grads")

    def sgd(keys=i64([0, 1]), g=tf.ones([2, 2]), step=i64(1), lr=f32(0.1)):
        return lib.group_embedding_ev_apply_sgd(ev.handle, keys, g, step, lr)

    expect_error("GroupEmbeddingEVApplySGD step [2]",
                 lambda: sgd(step=i64([1, 2])),
                 "global_step")
    expect_error("GroupEmbeddingEVApplySGD lr [1]",
                 lambda: sgd(lr=f32([0.1])), "lr")
    expect_error("GroupEmbeddingEVApplySGD keys [2, 1]",
                 lambda: sgd(keys=i64([[0], [1]])),
                 "keys")
    expect_error("GroupEmbeddingEVApplySGD grad [4]",
                 lambda: sgd(g=tf.ones([4])),
                 "gradient")
    expect_error("GroupEmbeddingEVApplyAdagrad epsilon [2]",
                 lambda: lib.group_embedding_ev_apply_adagrad(
                     ev.handle, i64([0]), tf.ones([1, 2]), i64(1), f32(0.1),
                     f32([1e-7, 1e-7]), slot_name="acc"), "epsilon")
    expect_error("GroupEmbeddingEVApplyAdam beta2 [1]",
                 lambda: lib.group_embedding_ev_apply_adam(
                     ev.handle, i64([0]), tf.ones([1, 2]), i64(1), f32(0.1),
                     f32(0.9), f32([0.999]), f32(1e-7),
                     slot_names=["m", "acc"]), "beta2")
    expect_error("GroupEmbeddingEVApplyFtrl lr_power [1]",
                 lambda: lib.group_embedding_ev_apply_ftrl(
                     ev.handle, i64([0]), tf.ones([1, 2]), i64(1), f32(0.1),
                     f32(0.0), f32(0.0), f32(0.0), f32([-0.5]),
                     slot_names=["m", "acc"]), "lr_power")

    def ev_import(keys=i64([1]), step=i64(3)):
        return lib.group_embedding_ev_import(
            ev.handle, keys, tf.ones([1, 2]), i64([1]), i64([1]),
            tf.constant([], tf.string), tf.zeros([0]), tf.zeros([1, 0]), step)

    expect_error("GroupEmbeddingEVImport step [1]",
                 lambda: ev_import(step=i64([3])),
                 "step")
    expect_error("GroupEmbeddingEVImport keys [1, 1]",
                 lambda: ev_import(keys=i64([[1]])),
                 "vectors")
    """)


def test_unpack_ids_rejects_malformed_inputs():
    """GroupEmbeddingUnpackIds (packed ids) checks every input before
    viewing any buffer: ranks, feature count, batch against the splits' width,
    offsets and counts inside the values, weights count."""
    _lib()
    run_isolated("""
    lib = kernel_library.library()
    i64 = lambda x: tf.constant(x, tf.int64)

    def unpack(values=i64([1, 2, 3]), splits=i64([[0, 1, 3]]),
               offsets=i64([0]), batch=i64(2), weights=tf.zeros([0]), k=1):
        return lib.group_embedding_unpack_ids(values=values, row_splits=splits,
                                              offsets=offsets, batch=batch,
                                              weights=weights, num_features=k)

    expect_error("values [3, 1]", lambda: unpack(values=i64([[1], [2], [3]])),
                 "must be vectors")
    expect_error("splits vector", lambda: unpack(splits=i64([0, 1, 3])),
                 "row_splits a matrix")
    expect_error("batch [1]", lambda: unpack(batch=i64([2])), "batch")
    expect_error("2 features asked", lambda: unpack(k=2), "1 features")
    expect_error("batch past width", lambda: unpack(batch=i64(3)),
                 "does not fit")
    expect_error("negative batch", lambda: unpack(batch=i64(-1)),
                 "does not fit")
    expect_error("offset past values", lambda: unpack(offsets=i64([1])),
                 "overflow")
    expect_error("huge offset",
                 lambda: unpack(offsets=i64([2**62])), "overflow")
    expect_error("negative offset", lambda: unpack(offsets=i64([-1])),
                 "overflow")
    expect_error("splits start at 1", lambda: unpack(splits=i64([[1, 1, 3]])),
                 "start at 0")
    expect_error("splits decrease", lambda: unpack(splits=i64([[0, 3, 2]])),
                 "non-decreasing")
    expect_error("2 weights for 3 values",
                 lambda: unpack(weights=tf.ones([2])), "2 weights")
    ids, splits, w = unpack()
    assert ids[0].numpy().tolist() == [1, 2, 3]
    assert splits[0].numpy().tolist() == [0, 1, 3]
    assert w[0].shape == [0]
    """)


def test_shape_functions_reject_known_bad_ranks():
    """Known wrong ranks fail when the graph is traced, naming the input."""
    lib = _lib()
    ev = ge.get_embedding_variable("hardening_shape_ev", 2)

    @tf.function
    def gather():
        return lib.group_embedding_ev_gather(
            handles=[ev.handle], keys=[tf.constant([1], tf.int64)],
            default_values=[ev.default_values],
            training=tf.constant([True, False]), embedding_dim=2)

    @tf.function
    def to_ragged():
        return lib.group_embedding_sparse_to_ragged(
            indices=[tf.zeros([2, 2], tf.int64)],
            ids=[tf.zeros([2, 1], tf.int64)],
            dense_shapes=[tf.constant([2, 3], tf.int64)],
            weights=[tf.zeros([0])], feature_names=["f"])

    for fn in (gather, to_ragged):
        with pytest.raises(ValueError, match="rank"):
            fn.get_concrete_function()


# --- 3. training must be a scalar (public API) -----------------------------

def test_ev_lookup_training_must_be_scalar():
    run_isolated("""
    ev = ge.get_embedding_variable("training_scalar_ev", 3)
    ids = tf.ragged.constant([[1, 2], [3]], dtype=tf.int64)

    def check(mode):
        for training in (tf.constant([True, False]), tf.zeros([0], tf.bool)):
            for seq in (False, True):
                expect_error(
                    f"{mode}: training shape {training.shape} seq {seq}",
                    lambda: ge.group_embedding_lookup_sparse(
                        [ev], [ids], "sum", is_sequence=seq,
                        training=training),
                    "training must be a scalar")
        out = ge.group_embedding_lookup_sparse([ev], [ids], "sum",
                                               training=tf.constant(False))
        assert out[0].shape == (2, 3)

    each_mode(check)
    """)


# --- 6. sequence column index outside [0, dense_shape[1]) ------------------

@pytest.mark.parametrize("column", [3, 7, -1])
def test_sequence_column_outside_dense_shape(kernel_mode, column):
    table = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]))
    sp = tf.SparseTensor([[0, 0], [1, column]], tf.constant([1, 2], tf.int64),
                         [2, 3])
    # Stock's densification rejects the same SparseTensor.
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.sparse.to_dense(tf.sparse.reorder(sp))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"sp_ids\[0\].*column"):
        ge.group_embedding_lookup_sparse([table], [sp], "sum",
                                         is_sequence=True)
    ev = ge.get_embedding_variable(f"seq_col_ev_{kernel_mode}_{column + 1}",
                                   3)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"sp_ids\[0\].*column"):
        ge.group_embedding_lookup_sparse([ev], [sp], "sum", is_sequence=True)


def test_sequence_valid_columns_match_to_dense(kernel_mode):
    table = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]))
    sp = tf.SparseTensor([[1, 2], [0, 0], [1, 0]],
                         tf.constant([1, 2, 3], tf.int64), [2, 3])
    got = ge.group_embedding_lookup_sparse([table], [sp], "sum",
                                           is_sequence=True)[0]
    dense_ids = tf.sparse.to_dense(tf.sparse.reorder(sp), default_value=-1)
    mask = tf.cast(dense_ids >= 0, tf.float32)[..., None]
    want = tf.gather(table, tf.maximum(dense_ids, 0)) * mask
    np.testing.assert_array_equal(got.numpy(), want.numpy())


# --- 16. a [vocab, 0] table -----------------------------------------------

def test_zero_dim_table_matches_stock(kernel_mode):
    table = tf.Variable(tf.zeros([5, 0]), name="empty_dim_table")
    other = tf.Variable(tf.ones([5, 0]))
    sp = tf.SparseTensor([[0, 0], [0, 1], [2, 0]],
                         tf.constant([1, 4, 2], tf.int64), [3, 2])
    ragged = tf.ragged.constant([[0], [], [3, 3]], dtype=tf.int64)
    with tf.GradientTape() as tape:
        out = ge.group_embedding_lookup_sparse(
            [table, other], [sp, ragged], ["mean", "sqrtn"])
        loss = tf.reduce_sum(out[0]) + tf.reduce_sum(out[1])
    for o, t, ids, c in zip(out, (table, other), (sp, ragged.to_sparse()),
                            ("mean", "sqrtn")):
        want = stock_lookup(t, ids, None, c, 3)
        assert o.shape == want.shape == (3, 0)
    grads = tape.gradient(loss, [table, other])
    for g in grads:
        assert tf.convert_to_tensor(g).shape == (5, 0)
    seq = ge.group_embedding_lookup_sparse([table], [sp], "sum",
                                           is_sequence=True)[0]
    assert seq.shape == (3, 2, 0)
    dense = ge.group_embedding_lookup([table], [tf.constant([[1, 2]])])[0]
    assert dense.shape == tf.nn.embedding_lookup(table, [[1, 2]]).shape
