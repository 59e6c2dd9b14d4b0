"""The one preparation of a lookup's inputs (`lookup_inputs.prepare_*`):
what the plan receives, against the ids written out by hand."""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import lookup_inputs
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import Mode

# 2 features x batch of 3:   row 0     row 1   row 2
ROWS = [[[7, 1], [2], []],  # sp_ids[0]
        [[1, 4], [], [4, 4, 9]]]  # sp_ids[1]


def _sparse_unordered(rows):
    """A SparseTensor of `rows` with its rows in reverse order."""
    indices = [[r, c] for r in reversed(range(len(rows)))
               for c in range(len(rows[r]))]
    values = [rows[r][c] for r, c in indices]
    return tf.SparseTensor(indices, tf.constant(values, tf.int64),
                           [len(rows), max(len(r) for r in rows)])


def _tables():
    return [tf.Variable(tf.zeros([10, 4]), name="user"),
            tf.Variable(tf.zeros([10, 2]), name="tags")]


def _as_rows(feat):
    values, splits = feat.values.numpy(), feat.row_splits.numpy()
    return [values[splits[b]:splits[b + 1]].tolist()
            for b in range(len(splits) - 1)]


@pytest.mark.parametrize("mode", [Mode.POOLED, Mode.SEQUENCE])
def test_sparse_ragged_and_packed_ids_prepare_alike(mode):
    tables = _tables()
    call = LookupCall(mode=mode)
    sparse = lookup_inputs.prepare_sparse(
        tables, [_sparse_unordered(ROWS[0]), _sparse_unordered(ROWS[1])],
        "mean", None, call, 8)
    ragged_ids = [tf.ragged.constant(r, tf.int64) for r in ROWS]
    ragged = lookup_inputs.prepare_sparse(tables, ragged_ids,
                                          ["sum", "sqrtn"], None, call, 8)
    packed = lookup_inputs.prepare_sparse(tables, ge.pack_ids(ragged_ids),
                                          "sum", None, call, 8)
    assert sparse.tables == tuple(tables)
    assert sparse.names == ("params[0] (user:0)", "params[1] (tags:0)")
    assert sparse.combiners == ("mean", "mean")
    assert ragged.combiners == ("sum", "sqrtn")
    for prepared in (sparse, ragged, packed):
        assert [_as_rows(f) for f in prepared.feats] == ROWS
        assert prepared.dense_ids == ()
        if mode == Mode.SEQUENCE:
            # Each id's slot in its row; T is the longest row.
            for f, rows in zip(prepared.feats, ROWS):
                assert f.positions.numpy().tolist() == [
                    c for row in rows for c in range(len(row))]
                assert int(f.max_len) == max(len(r) for r in rows)


def test_dense_ids_become_one_id_rows():
    tables = _tables()
    ids = [tf.constant([[3, 1], [0, 9]]), [5, 6, 7]]
    prepared = lookup_inputs.prepare_dense(tables, ids, "mod")
    assert [_as_rows(f) for f in prepared.feats] == [
        [[3], [1], [0], [9]], [[5], [6], [7]]]
    assert prepared.combiners == ("sum", "sum")
    assert [d.shape.as_list() for d in prepared.dense_ids] == [[2, 2], [3]]
    np.testing.assert_array_equal(prepared.dense_ids[1], [5, 6, 7])


def test_errors_name_the_argument():
    tables = _tables()
    with pytest.raises(ValueError, match="concat_outputs=True.*is_sequence"):
        lookup_inputs.lookup_mode(is_sequence=True, concat_outputs=True)
    assert lookup_inputs.lookup_mode(False, True) is Mode.CONCAT
    call = LookupCall(mode=Mode.POOLED)
    bad = [tf.ragged.constant([[1]], tf.int64),
           tf.ragged.constant([[1.0]])]
    with pytest.raises(TypeError, match=r"`sp_ids\[1\]` must hold int32 "
                                        "or int64 ids, got float32"):
        lookup_inputs.prepare_sparse(tables, bad, "sum", None, call, 8)
    with pytest.raises(TypeError, match=r"`ids\[0\]` must be a dense "
                                        "tensor"):
        lookup_inputs.prepare_dense(tables, bad, "mod")
    with pytest.raises(ValueError, match="Packed `sp_ids` hold 1 features "
                                         "but `params` has 2 tables"):
        lookup_inputs.prepare_sparse(tables, ge.pack_ids(bad[:1]), "sum",
                                     None, call, 8)
