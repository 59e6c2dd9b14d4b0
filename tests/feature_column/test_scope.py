"""`group_embedding_column_scope`: registration, coexisting scopes,
`params_num_per_group`, and the error paths of the feature columns."""

import sys

import pytest
import tensorflow as tf

from group_embedding import feature_column as ge_fc
from group_embedding.feature_column import columns as columns_lib
from group_embedding.feature_column import scope as scope_lib

import fc_cases
from testing import op_counts

FC = tf.feature_column
FUSED_OP = "GroupEmbeddingPooledLookup"


def _identity(key="uid", buckets=10):
    return FC.categorical_column_with_identity(key, buckets)


def test_columns_record_innermost_scope():
    outer_name = fc_cases.unique_name("outer")
    with ge_fc.group_embedding_column_scope(outer_name) as outer:
        a = ge_fc.embedding_column(_identity("a"), 2)
        with ge_fc.group_embedding_column_scope(
                fc_cases.unique_name("inner")) as inner:
            b = ge_fc.embedding_column(_identity("b"), 2)
        c = ge_fc.embedding_column(_identity("c"), 2)
    d = ge_fc.embedding_column(_identity("d"), 2)
    assert a.scope == outer and c.scope == outer
    assert b.scope == inner
    assert d.scope is None and scope_lib.current_scope() is None
    assert outer.name == outer_name


def test_default_names_are_unique():
    with ge_fc.group_embedding_column_scope() as first:
        pass
    with ge_fc.group_embedding_column_scope() as second:
        pass
    assert first.name != second.name
    assert first.name.startswith("group_embedding_column_scope")


def test_reentering_a_name_adds_to_the_same_scope():
    name = fc_cases.unique_name("again")
    with ge_fc.group_embedding_column_scope(name) as s1:
        pass
    with ge_fc.group_embedding_column_scope(name) as s2:
        pass
    assert s1 == s2


def test_nested_scopes_with_same_name_fail():
    name = fc_cases.unique_name("dup")
    with ge_fc.group_embedding_column_scope(name):
        with pytest.raises(ValueError, match=f"'{name}' is already open"):
            with ge_fc.group_embedding_column_scope(name):
                pass


def test_same_name_with_other_params_fails():
    name = fc_cases.unique_name("params")
    with ge_fc.group_embedding_column_scope(name):
        pass
    with pytest.raises(ValueError, match=f"'{name}' already exists"):
        with ge_fc.group_embedding_column_scope(name, 2):
            pass


@pytest.mark.parametrize("name,params,match", [
    ("has space", sys.maxsize, "Invalid `name`"),
    ("", sys.maxsize, "Invalid `name`"),
    ("ok_name_x", 0, "params_num_per_group"),
])
def test_invalid_scope_arguments_fail(name, params, match):
    with pytest.raises(ValueError, match=match):
        with ge_fc.group_embedding_column_scope(name, params):
            pass


def test_params_num_per_group_splits_the_fused_op():
    graph = tf.Graph()
    with graph.as_default():
        with ge_fc.group_embedding_column_scope(
                fc_cases.unique_name("cap"), params_num_per_group=2):
            cols = [ge_fc.embedding_column(_identity(k), 3)
                    for k in ("uid", "uid2", "wid")]
        ge_fc.input_layer(fc_cases.make_features("sparse"), cols)
        assert op_counts(graph)[FUSED_OP] == 2


def test_columns_from_two_scopes_with_one_name_fail():
    # Possible only through configs (from_config skips the registry).
    a = ge_fc.embedding_column(_identity("uid"), 2)
    scope = scope_lib.GroupEmbeddingScope(fc_cases.unique_name("cfg"))
    other = scope_lib.GroupEmbeddingScope(scope.name, 3)
    cols = [columns_lib.EmbeddingColumn(a.categorical_column, 2, scope=scope),
            columns_lib.EmbeddingColumn(_identity("uid2"), 2, scope=other)]
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="two scopes cannot share"):
            ge_fc.input_layer(fc_cases.make_features("sparse"), cols)


# --- error paths of columns and input_layer -------------------------------

def test_missing_feature_key_names_key_and_column():
    col = ge_fc.embedding_column(_identity("absent"), 2)
    with tf.Graph().as_default():
        with pytest.raises(ValueError,
                           match="'absent' of column 'absent_embedding'"):
            ge_fc.input_layer(fc_cases.make_features("sparse"), [col])


def test_float_ids_name_key_and_column():
    col = ge_fc.embedding_column(_identity("x"), 2)
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="'x' of column 'x_embedding' "
                                            "must hold integer or string"):
            ge_fc.input_layer({"x": tf.constant([[1.5]])}, [col])


def test_float_keys_for_ev_column_fail():
    col = ge_fc.embedding_column(
        ge_fc.categorical_column_with_embedding("k", tf.int64), 2)
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="'k' of column 'k_embedding'"):
            ge_fc.input_layer({"k": tf.constant([0.5])}, [col])


def test_ev_column_dtype_mismatch_fails():
    col = ge_fc.embedding_column(
        ge_fc.categorical_column_with_embedding("k"), 2)  # string keys
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="column's dtype is string"):
            ge_fc.input_layer({"k": tf.constant([3], tf.int64)}, [col])


def test_wrong_column_kind_in_scope_names_column_and_scope():
    name = fc_cases.unique_name("kind")
    with ge_fc.group_embedding_column_scope(name):
        with pytest.raises(TypeError, match=f"scope '{name}'.*'price'"):
            ge_fc.embedding_column(FC.numeric_column("price"), 2)
        # Sequence columns are embeddable (sequence_input_layer), but not
        # weighted ones.
        seq = tf.feature_column.sequence_categorical_column_with_identity(
            "s", 4).__class__(tf.feature_column.weighted_categorical_column(
                _identity("s"), "w"))
        with pytest.raises(TypeError, match="'s_weighted_by_w' of type "
                                            "Sequence"):
            ge_fc.embedding_column(seq, 2)


def test_stock_embedding_column_in_input_layer_fails():
    col = FC.embedding_column(_identity("uid"), 2)
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="'uid_embedding' is a stock"):
            ge_fc.input_layer(fc_cases.make_features("sparse"), [col])


def test_categorical_column_in_input_layer_fails():
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="'uid' .* is not a dense"):
            ge_fc.input_layer(fc_cases.make_features("sparse"),
                              [_identity("uid")])


def test_duplicate_column_names_fail():
    cols = [ge_fc.embedding_column(_identity("uid"), 2)] * 2
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="Duplicate feature column "
                                             "name 'uid_embedding'"):
            ge_fc.input_layer(fc_cases.make_features("sparse"), cols)


def test_eager_input_layer_points_to_keras_layer():
    col = ge_fc.embedding_column(_identity("uid"), 2)
    with pytest.raises(RuntimeError, match="GroupEmbeddingFeatures"):
        ge_fc.input_layer(fc_cases.make_features("sparse"), [col])


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dimension": 0}, ValueError, "`dimension` must be a positive int"),
    ({"combiner": "max"}, ValueError, "invalid `combiner`: 'max'"),
    ({"max_norm": -1.0}, ValueError, "`max_norm` must be None or a "
                                     "positive"),
    ({"initializer": 3}, ValueError, "`initializer` must be callable"),
])
def test_invalid_embedding_column_arguments(kwargs, error, match):
    args = {"dimension": 2, **kwargs}
    with pytest.raises(error, match=match):
        ge_fc.embedding_column(_identity("uid"), **args)


def test_invalid_ev_column_arguments():
    with pytest.raises(NotImplementedError, match="`partition_num`=2"):
        ge_fc.categorical_column_with_embedding("k", partition_num=2)
    with pytest.raises(TypeError, match="'k': `dtype` must be string"):
        ge_fc.categorical_column_with_embedding("k", tf.float32)
    with pytest.raises(ValueError, match="`key`"):
        ge_fc.categorical_column_with_embedding("")
    col = ge_fc.categorical_column_with_embedding("k", partition_num=1)
    assert col.partition_num == 1


def test_shared_columns_mixing_ev_and_stock_fail():
    with pytest.raises(ValueError, match="mix"):
        ge_fc.shared_embedding_columns(
            [_identity("a"), ge_fc.categorical_column_with_embedding("b")],
            2)
    with pytest.raises(ValueError, match="same number of buckets"):
        ge_fc.shared_embedding_columns([_identity("a", 3),
                                        _identity("b", 4)], 2)


def test_out_of_range_identity_id_fails_at_run_time():
    graph = tf.Graph()
    with graph.as_default():
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("oor")):
            col = ge_fc.embedding_column(_identity("uid", 5), 2)
        out = ge_fc.input_layer({"uid": tf.constant([[7]], tf.int64)}, [col])
        with pytest.raises(tf.errors.InvalidArgumentError):
            fc_cases.run_graph(graph, out)
