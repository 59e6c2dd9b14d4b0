"""The one reader of a group op's ragged inputs (ReadRaggedGroup,
op_checks.h): every lookup kernel that reads ids / keys, row_splits,
weights, positions and max_lens per table checks each table's before any
is read, and its errors name the table (its name, its variable's, or
"table <index>" where the op has no names). Each case breaks the SECOND
table of a group of two, so a reader naming the wrong one fails.
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import kernel_library

I64 = tf.int64
EMPTY_W = tf.zeros([0], tf.float32)


@pytest.fixture(scope="module")
def lib():
    lib = kernel_library.library()
    if lib is None:
        pytest.skip(kernel_library.unavailable_reason())
    return lib


def _ids(x):
    return tf.constant(x, I64)


OK_IDS, OK_SPLITS = _ids([0, 1, 3]), _ids([0, 2, 3])
BAD_SPLITS = _ids([0, 2, 9])  # ends past the 3 ids


def _raises(fn, *parts):
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        fn()
    for part in parts:
        assert part in info.value.message, info.value.message


@pytest.mark.parametrize("concat", [False, True])
def test_pooled_lookup_names_the_table(lib, concat):
    tables = [tf.Variable(tf.ones([4, 2])) for _ in range(2)]
    op = (lib.group_embedding_concat_lookup if concat
          else lib.group_embedding_pooled_lookup)

    def lookup(splits=OK_SPLITS, weights=EMPTY_W):
        return op(tables=[t.handle for t in tables], ids=[OK_IDS, OK_IDS],
                  row_splits=[OK_SPLITS, splits], weights=[EMPTY_W, weights],
                  combiners=["sum", "mean"], table_names=["a", "b"],
                  embedding_dim=2)

    np.testing.assert_allclose(np.asarray(lookup()).reshape(-1)[:2], [2, 2])
    _raises(lambda: lookup(splits=BAD_SPLITS), "b: row_splits must start "
            "at 0 and end at 3")
    _raises(lambda: lookup(weights=tf.ones([2])), "b: has 3 ids but 2 "
            "weights")


def test_pooled_grad_names_the_table_index(lib):
    def grad(splits):
        return lib.group_embedding_pooled_lookup_grad(
            grads=[tf.ones([2, 2])] * 2, ids=[OK_IDS, OK_IDS],
            row_splits=[OK_SPLITS, splits], weights=[EMPTY_W, EMPTY_W],
            combiners=["sum", "sum"], embedding_dim=2)

    uids, _ = grad(OK_SPLITS)
    np.testing.assert_array_equal(uids[1].numpy(), [0, 1, 3])
    _raises(lambda: grad(BAD_SPLITS), "table 1: row_splits")


def test_sequence_lookup_names_the_table(lib):
    tables = [tf.Variable(tf.ones([4, 2])) for _ in range(2)]
    ok_pos = _ids([0, 1, 0])

    def lookup(positions=ok_pos, max_len=2, ids=OK_IDS):
        return lib.group_embedding_sequence_lookup(
            tables=[t.handle for t in tables], ids=[OK_IDS, ids],
            row_splits=[OK_SPLITS, OK_SPLITS], positions=[ok_pos, positions],
            max_lens=[_ids(2), _ids(max_len)], weights=[EMPTY_W, EMPTY_W],
            table_names=["a", "b"], embedding_dim=2)

    assert lookup()[1].shape == (2, 2, 2)
    _raises(lambda: lookup(positions=_ids([0, 2, 0])), "b: position 2 of "
            "id 1 is outside the padded length [0, 2)")
    _raises(lambda: lookup(max_len=-1), "b: max_lens")
    _raises(lambda: lookup(max_len=2**62), "overflow")
    _raises(lambda: lookup(ids=_ids([0, 1, 4])), "b: id 4 is out of range "
            "[0, 4)")


def test_sequence_grad_names_the_table_index(lib):
    def grad(positions):
        return lib.group_embedding_sequence_lookup_grad(
            grads=[tf.ones([2, 2, 2])] * 2, ids=[OK_IDS, OK_IDS],
            row_splits=[OK_SPLITS, OK_SPLITS],
            positions=[_ids([0, 1, 0]), positions],
            weights=[EMPTY_W, EMPTY_W], embedding_dim=2)

    uids, _ = grad(_ids([0, 1, 0]))
    np.testing.assert_array_equal(uids[1].numpy(), [0, 1, 3])
    _raises(lambda: grad(_ids([0, 5, 0])), "table 1: position 5")


def test_ev_lookups_name_the_variable(lib):
    evs = [ge.get_embedding_variable(f"ragged_reader_{i}", 2)
           for i in range(2)]
    defaults = [tf.zeros([1, 2])] * 2

    def lookup(splits):
        return lib.group_embedding_ev_lookup(
            handles=[e.handle for e in evs], keys=[OK_IDS, OK_IDS],
            row_splits=[OK_SPLITS, splits], weights=[EMPTY_W, EMPTY_W],
            default_values=defaults, training=tf.constant(False),
            combiners=["sum", "sum"], embedding_dim=2)

    def sequence(max_len):
        return lib.group_embedding_ev_sequence_lookup(
            handles=[e.handle for e in evs], keys=[OK_IDS, OK_IDS],
            row_splits=[OK_SPLITS, OK_SPLITS],
            positions=[_ids([0, 1, 0])] * 2,
            max_lens=[_ids(2), _ids(max_len)], default_values=defaults,
            training=tf.constant(False), embedding_dim=2)

    assert lookup(OK_SPLITS)[1].shape == (2, 2)
    assert sequence(2)[1].shape == (2, 2, 2)
    _raises(lambda: lookup(BAD_SPLITS), "ragged_reader_1", "row_splits")
    _raises(lambda: sequence(1), "ragged_reader_1", "position 1 of id 1")
