"""Error paths of the grouped lookups: one test per error, each checking
the class and that the message names the argument (and its index).

All run on both kernel paths (`kernel_mode`): static checks must not
depend on the path, run-time checks live in different ops on each.
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge

from testing import random_case
from testing import random_table

ids_ = tf.constant  # short alias for literal id tensors


def _sparse(indices, values, shape, dtype=tf.int64):
    return tf.SparseTensor(indices, tf.constant(values, dtype), shape)


def _ragged(values, lengths, dtype=tf.int64):
    return tf.RaggedTensor.from_row_lengths(tf.constant(values, dtype),
                                            lengths)


@pytest.fixture
def tables():
    rng = np.random.default_rng(0)
    return [random_table(rng, 5, 4, "t0"), random_table(rng, 7, 4, "t1")]


@pytest.fixture
def sp_ids():
    return [_sparse([[0, 0], [2, 1]], [1, 2], [3, 2]),
            _ragged([3, 0, 6], [1, 0, 2])]


def _lookup(tables, sp_ids, combiners="sum", **kwargs):
    return ge.group_embedding_lookup_sparse(tables, sp_ids, combiners,
                                            **kwargs)


# ---------------------------------------------------------------------------
# List arguments.
# ---------------------------------------------------------------------------
def test_params_not_a_list_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError, match=r"`params` must be a list.*"
                                        r"ResourceVariable"):
        _lookup(tables[0], sp_ids[:1])


def test_empty_params_fails(kernel_mode):
    with pytest.raises(ValueError, match=r"`params` is empty"):
        _lookup([], [])


def test_param_not_a_variable_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError,
                       match=r"`params\[1\]` must be a tf.Variable.*"
                             r"got EagerTensor"):
        _lookup([tables[0], tf.constant(tables[1].numpy())], sp_ids)


def test_param_not_a_matrix_fails(kernel_mode, sp_ids):
    table = tf.Variable(tf.zeros([5, 4, 2]), name="cube")
    with pytest.raises(ValueError, match=r"`params\[0\]` \(cube:0\) must "
                                         r"be a \[vocab, dim\] table"):
        _lookup([table], sp_ids[:1])


def test_sp_ids_not_a_list_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError, match=r"`sp_ids` must be a list.*"
                                        r"SparseTensor"):
        _lookup(tables[:1], sp_ids[0])


def test_fewer_sp_ids_than_params_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(ValueError, match=r"`sp_ids` has 1 entries but "
                                         r"`params` has 2"):
        _lookup(tables, sp_ids[:1])


def test_fewer_combiners_than_params_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(ValueError, match=r"`combiners` has 1 entries but "
                                         r"`params` has 2"):
        _lookup(tables, sp_ids, ["sum"])


def test_unknown_combiner_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(ValueError, match=r"Invalid `combiners\[1\]`: "
                                         r"'max', use one of sum, mean, "
                                         r"sqrtn"):
        _lookup(tables, sp_ids, ["mean", "max"])


def test_wrong_number_of_sp_weights_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(ValueError, match=r"`sp_weights` must be None or a "
                                         r"list of 2 entries.*got 3"):
        _lookup(tables, sp_ids, sp_weights=[None] * 3)


def test_sp_weights_not_a_list_fails(kernel_mode, tables, sp_ids):
    weights = tf.SparseTensor([[0, 0], [2, 1]], [1.0, 2.0], [3, 2])
    with pytest.raises(TypeError, match=r"`sp_weights` must be None or a "
                                        r"list.*got SparseTensor"):
        _lookup(tables[:1], sp_ids[:1], sp_weights=weights)


def test_invalid_partition_strategy_fails(kernel_mode, tables, sp_ids):
    with pytest.raises(ValueError, match=r"Invalid `partition_strategy`: "
                                         r"'hash', use one of mod, div"):
        _lookup(tables, sp_ids, partition_strategy="hash")


@pytest.mark.parametrize("value", [0, -1, 1.5], ids=str)
def test_invalid_params_num_per_group_fails(kernel_mode, tables, sp_ids,
                                            value):
    with pytest.raises(ValueError, match=r"`params_num_per_group` must be "
                                         r"a positive int"):
        _lookup(tables, sp_ids, params_num_per_group=value)


def test_invalid_kernel_mode_env_fails(monkeypatch, tables, sp_ids):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "rocm")
    with pytest.raises(ValueError, match=r"Invalid "
                                         r"`GROUP_EMBEDDING_KERNELS`: "
                                         r"'rocm', use one of auto, custom, "
                                         r"tf, cuda"):
        _lookup(tables, sp_ids)


# ---------------------------------------------------------------------------
# Id tensors.
# ---------------------------------------------------------------------------
def test_dense_ids_fail(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError, match=r"`sp_ids\[1\]` must be a "
                                        r"SparseTensor or RaggedTensor, "
                                        r"got EagerTensor"):
        _lookup(tables, [sp_ids[0], ids_([[1, 2], [0, 1], [3, 3]])])


def test_float_sparse_ids_fail(kernel_mode, tables, sp_ids):
    float_ids = _sparse([[0, 0], [1, 0]], [1.0, 2.0], [3, 1], tf.float32)
    with pytest.raises(TypeError, match=r"`sp_ids\[1\]` must hold int32 "
                                        r"or int64 ids, got float32"):
        _lookup(tables, [sp_ids[0], float_ids])


def test_float_ragged_ids_fail(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError, match=r"`sp_ids\[0\]` must hold int32 "
                                        r"or int64 ids, got float64"):
        _lookup(tables, [_ragged([1.0], [1, 0, 0], tf.float64), sp_ids[1]])


def test_rank3_sparse_ids_fail(kernel_mode, tables, sp_ids):
    cube = _sparse([[0, 0, 0], [2, 1, 0]], [1, 2], [3, 2, 2])
    with pytest.raises(ValueError, match=r"`sp_ids\[1\]` must be a rank-2 "
                                         r"SparseTensor.*got rank 3"):
        _lookup(tables, [sp_ids[0], cube])


@pytest.mark.parametrize("kernel_mode", [
    "custom", "tf"],
    indirect=True)
def test_rank3_sparse_ids_of_unknown_rank_fail(kernel_mode, tables):
    @tf.function(input_signature=[tf.SparseTensorSpec(None, tf.int64)])
    def lookup(ids):
        return _lookup(tables[:1], [ids])

    cube = _sparse([[0, 0, 0], [2, 1, 0]], [1, 2], [3, 2, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_ids\[0\]`.*rank 2"):
        lookup(cube)


def test_rank3_ragged_ids_fail(kernel_mode, tables, sp_ids):
    cube = tf.RaggedTensor.from_nested_row_lengths(
        tf.constant([1, 2, 3], tf.int64), [[1, 1, 0], [2, 1]])
    with pytest.raises(ValueError, match=r"`sp_ids\[1\]` must be a 2-D "
                                         r"RaggedTensor"):
        _lookup(tables, [sp_ids[0], cube])


def test_sparse_row_index_outside_batch_fails(kernel_mode, tables, sp_ids):
    outside = _sparse([[0, 0], [3, 0]], [1, 2], [3, 1])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_ids\[1\]`: row index"):
        _lookup(tables, [sp_ids[0], outside])


def test_static_batch_sizes_differ_fails(kernel_mode, tables, sp_ids):
    four_rows = _ragged([1, 2], [1, 0, 0, 1])
    with pytest.raises(ValueError, match=r"`sp_ids\[1\]` has batch size 4 "
                                         r"but `sp_ids\[0\]` has 3"):
        _lookup(tables, [sp_ids[0], four_rows])


@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_dynamic_batch_sizes_differ_fails(kernel_mode, tables, kind):
    spec = (tf.SparseTensorSpec([None, None], tf.int64) if kind == "sparse"
            else tf.RaggedTensorSpec([None, None], tf.int64, 1))

    @tf.function(input_signature=[spec, spec])
    def lookup(a, b):
        return _lookup(tables, [a, b])

    three = random_case(0, [4, 4], [kind] * 2, ["sum"] * 2, batch_size=3,
                        vocab=5)
    four = random_case(1, [4, 4], [kind] * 2, ["sum"] * 2, batch_size=4,
                       vocab=5)
    lookup(*three.sp_ids())  # same batch: fine
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_ids\[1\]` has a different batch size "
                             r"than `sp_ids\[0\]`"):
        lookup(three.sp_ids()[0], four.sp_ids()[1])


# ---------------------------------------------------------------------------
# Ids outside the vocabulary.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad_id", [-1, 7, 100], ids=lambda i: f"id{i}")
@pytest.mark.parametrize("kind", ["sparse", "ragged"])
def test_id_outside_vocab_fails(kernel_mode, tables, sp_ids, kind, bad_id):
    # tables[1] has 7 rows: valid ids are 0..6.
    bad = (_sparse([[0, 0], [1, 0]], [2, bad_id], [3, 2]) if kind ==
           "sparse" else _ragged([2, bad_id], [1, 1, 0]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"params\[1\] \(t1:0\)"):
        _lookup(tables, [sp_ids[0], bad])


def test_id_outside_vocab_fails_in_tf_function(kernel_mode, tables,
                                               sp_ids):
    @tf.function(input_signature=[tf.RaggedTensorSpec([None, None],
                                                      tf.int64, 1)])
    def lookup(ids):
        return _lookup(tables, [sp_ids[0], ids])

    lookup(_ragged([6, 0], [1, 1, 0]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"params\[1\] \(t1:0\)"):
        lookup(_ragged([7, 0], [1, 1, 0]))


def test_id_outside_vocab_fails_in_sequence_lookup(kernel_mode, tables,
                                                   sp_ids):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"params\[0\] \(t0:0\)"):
        _lookup(tables, [_ragged([5], [1, 0, 0]), sp_ids[1]],
                is_sequence=True)



@pytest.mark.parametrize("kernel_mode,loss_kind", [
    ("custom", "square"), ("custom", "linear"), ("tf", "square"),
    ("tf", "linear")],
    indirect=["kernel_mode"])
def test_failed_train_step_leaves_tables_unchanged(kernel_mode, loss_kind):
    rng = np.random.default_rng(1)
    # One group; id 6 is valid for tables 0 and 1, not for table 2.
    tables = [random_table(rng, v, 4, f"t{i}")
              for i, v in enumerate((7, 9, 5))]
    opt = ge.optimizers.Adagrad(0.1)

    @tf.function
    def train_step(ids):
        sp_ids = [tf.SparseTensor([[0, 0], [1, 0]], ids, [2, 1])] * 3
        with tf.GradientTape() as tape:
            outs = _lookup(tables, sp_ids, "sum")
            if loss_kind == "square":
                outs = [tf.square(o) for o in outs]
            loss = tf.add_n([tf.reduce_sum(o) for o in outs])
        opt.apply_gradients(zip(tape.gradient(loss, tables), tables))

    train_step(ids_([1, 2], tf.int64))
    before = [t.numpy() for t in tables]
    # Accumulators (Keras itself counts the failed step in `iterations`).
    accumulators = [v for v in opt.variables
                    if "accumulator" in v.path]
    assert len(accumulators) == 3
    slots = [v.numpy() for v in accumulators]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"params\[2\] \(t2:0\)"):
        train_step(ids_([1, 6], tf.int64))
    for t, b in zip(tables, before):
        np.testing.assert_array_equal(t.numpy(), b)
    for v, s in zip(accumulators, slots):
        np.testing.assert_array_equal(v.numpy(), s)


# ---------------------------------------------------------------------------
# Weights.
# ---------------------------------------------------------------------------
def test_weights_of_other_kind_fail(kernel_mode, tables, sp_ids):
    ragged_w = tf.RaggedTensor.from_row_lengths([1.0, 2.0], [1, 0, 1])
    with pytest.raises(TypeError, match=r"`sp_weights\[0\]` must be a "
                                        r"SparseTensor like its ids, got "
                                        r"RaggedTensor"):
        _lookup(tables, sp_ids, sp_weights=[ragged_w, None])


def test_dense_weights_fail(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError, match=r"`sp_weights\[1\]` must be a "
                                        r"RaggedTensor like its ids, got "
                                        r"EagerTensor"):
        _lookup(tables, sp_ids, sp_weights=[None, tf.ones([3])])


def test_integer_weights_fail(kernel_mode, tables, sp_ids):
    int_w = tf.RaggedTensor.from_row_lengths([1, 2, 3], [1, 0, 2])
    with pytest.raises(TypeError, match=r"`sp_weights\[1\]` must hold "
                                        r"float weights, got int32"):
        _lookup(tables, sp_ids, sp_weights=[None, int_w])


@pytest.mark.parametrize("kernel_mode", [
    "custom", "tf"],
    indirect=True)
@pytest.mark.parametrize("num_weights", [1, 3])
def test_sparse_weights_count_mismatch_fails(kernel_mode, tables, sp_ids,
                                             num_weights):
    indices = [[0, 0], [1, 0], [2, 0]][:num_weights]
    weights = tf.SparseTensor(indices, [1.0] * num_weights, [3, 2])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_(ids|weights)\[0\]`.*weights"):
        _lookup(tables, sp_ids, sp_weights=[weights, None])


def test_ragged_weights_row_lengths_mismatch_fails(kernel_mode, tables,
                                                   sp_ids):
    weights = tf.RaggedTensor.from_row_lengths([1.0, 2.0, 3.0], [2, 0, 1])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_ids\[1\]`: weights must have the same "
                             r"row lengths"):
        _lookup(tables, sp_ids, sp_weights=[None, weights])


def test_ragged_weights_row_lengths_mismatch_fails_in_tf_function(
        kernel_mode, tables, sp_ids):
    @tf.function
    def lookup(weights):
        return _lookup(tables, sp_ids, sp_weights=[None, weights])

    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"`sp_ids\[1\]`: weights must have the same "
                             r"row lengths"):
        lookup(tf.RaggedTensor.from_row_lengths([1.0, 2.0, 3.0],
                                                [2, 0, 1]))


def test_ragged_weights_row_lengths_mismatch_fails_in_v1_session(
        kernel_mode):
    with tf.Graph().as_default():
        table = tf.compat.v1.get_variable(
            "t", initializer=np.ones([5, 4], np.float32), use_resource=True)
        ids = _ragged([1, 2, 3], [2, 1])
        weights = tf.RaggedTensor.from_row_lengths([1.0, 2.0, 3.0], [1, 2])
        out = _lookup([table], [ids], sp_weights=[weights])
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"`sp_ids\[0\]`: weights must have "
                                     r"the same row lengths"):
                sess.run(out)


# ---------------------------------------------------------------------------
# group_embedding_lookup (dense ids).
# ---------------------------------------------------------------------------
def test_dense_lookup_ids_not_a_list_fails(kernel_mode, tables):
    with pytest.raises(TypeError, match=r"`ids` must be a list"):
        ge.group_embedding_lookup(tables[:1], ids_([1, 2]))


def test_dense_lookup_sparse_ids_fail(kernel_mode, tables, sp_ids):
    with pytest.raises(TypeError, match=r"`ids\[1\]` must be a dense "
                                        r"tensor; use "
                                        r"group_embedding_lookup_sparse"):
        ge.group_embedding_lookup(tables, [ids_([1]), sp_ids[1]])


def test_dense_lookup_float_ids_fail(kernel_mode, tables):
    with pytest.raises(TypeError, match=r"`ids\[0\]` must hold int32 or "
                                        r"int64 ids, got float32"):
        ge.group_embedding_lookup(tables, [ids_([1.0]), ids_([1])])


def test_dense_lookup_fewer_ids_than_params_fails(kernel_mode, tables):
    with pytest.raises(ValueError, match=r"`ids` has 1 entries but "
                                         r"`params` has 2"):
        ge.group_embedding_lookup(tables, [ids_([1])])


@pytest.mark.parametrize("bad_id", [-2, 7], ids=lambda i: f"id{i}")
def test_dense_lookup_id_outside_vocab_fails(kernel_mode, tables, bad_id):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"params\[1\] \(t1:0\)"):
        ge.group_embedding_lookup(tables, [ids_([1]),
                                           ids_([[0, 1], [bad_id, 2]])])


def test_dense_lookup_invalid_partition_strategy_fails(kernel_mode,
                                                       tables):
    with pytest.raises(ValueError, match=r"Invalid `partition_strategy`: "
                                         r"'range'"):
        ge.group_embedding_lookup(tables, [ids_([1]), ids_([2])],
                                  partition_strategy="range")
