"""`import group_embedding.compat`: DeepRec's names on stock TF.

Every test installs the names and uninstalls them afterwards, so no other
test sees a patched `tf`.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.feature_column import feature_column_v2 as fc_v2

import group_embedding as ge

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, os.pardir, os.pardir, "tutorials"))
import data  # noqa: E402

V1 = tf.compat.v1
# Captured before any install(): the stock functions.
STOCK_INPUT_LAYER = V1.feature_column.input_layer
STOCK_EMBEDDING_COLUMN = tf.feature_column.embedding_column
STOCK_ADAGRAD = V1.train.AdagradOptimizer


def test_install_adds_deeprec_names_to_both_namespaces(compat):
    for root in (tf, V1):
        assert root.nn.group_embedding_lookup_sparse is \
            ge.group_embedding_lookup_sparse
        assert root.nn.group_embedding_lookup is ge.group_embedding_lookup
        assert root.get_embedding_variable is ge.get_embedding_variable
        assert root.config.experimental.enable_distributed_strategy is \
            ge.enable_distributed_strategy
        fc = root.feature_column
        assert fc.group_embedding_column_scope is \
            ge.feature_column.group_embedding_column_scope
        assert fc.categorical_column_with_embedding is \
            ge.feature_column.categorical_column_with_embedding
        assert fc.input_layer is compat.input_layer
        assert fc.embedding_column is compat.embedding_column
        assert fc.shared_embedding_columns is \
            compat.shared_embedding_columns
        for name in ("EmbeddingVariableOption", "CounterFilter",
                     "InitializerOption", "GlobalStepEvict",
                     "L2WeightEvict"):
            assert getattr(root, name) is getattr(ge, name)
    assert tf.feature_column.shared_embeddings is \
        compat.shared_embedding_columns
    assert V1.train.AdagradOptimizer is ge.train.AdagradOptimizer
    assert issubclass(V1.train.AdagradOptimizer, STOCK_ADAGRAD)


def test_uninstall_restores_originals(compat):
    compat.install()  # twice: still one set of originals
    compat.uninstall()
    assert not compat.is_installed()
    assert V1.feature_column.input_layer is STOCK_INPUT_LAYER
    assert tf.feature_column.embedding_column is STOCK_EMBEDDING_COLUMN
    assert V1.train.AdagradOptimizer is STOCK_ADAGRAD
    assert not hasattr(tf.nn, "group_embedding_lookup_sparse")
    assert not hasattr(V1, "CounterFilter")
    assert not hasattr(tf.feature_column, "input_layer")
    compat.install()
    assert tf.nn.group_embedding_lookup_sparse is \
        ge.group_embedding_lookup_sparse


def _features():
    return {
        "uid": tf.constant([[1, 3], [0, -1], [9, 9], [-1, -1]], tf.int64),
        "tag": tf.constant([["a", "b"], ["c", ""], ["", ""], ["d", "a"]]),
        "price": tf.constant([[1.0], [2.0], [0.5], [3.0]]),
    }


def test_scope_columns_and_stock_columns_equal_stock_input_layer(compat):
    uid = tf.feature_column.categorical_column_with_identity("uid", 10)
    tag = tf.feature_column.categorical_column_with_hash_bucket("tag", 20)
    price = tf.feature_column.numeric_column("price")
    with tf.Graph().as_default() as graph:
        with tf.feature_column.group_embedding_column_scope("compat_eq"):
            ours = [tf.feature_column.embedding_column(uid, 4, "sum"),
                    tf.feature_column.embedding_column(tag, 4, "sqrtn")]
        # A stock embedding column built without the library.
        stock_tag = fc_v2.embedding_column(
            V1.feature_column.categorical_column_with_hash_bucket(
                "tag2", 20), 3)
        features = dict(_features(), tag2=_features()["tag"])
        ours_vars, stock_vars = {}, {}
        got = V1.feature_column.input_layer(
            features, ours + [price, stock_tag], cols_to_vars=ours_vars)
        want = STOCK_INPUT_LAYER(
            features, [STOCK_EMBEDDING_COLUMN(uid, 4, "sum"),
                       STOCK_EMBEDDING_COLUMN(tag, 4, "sqrtn"), price,
                       stock_tag], cols_to_vars=stock_vars)
        lookups = [op for op in graph.get_operations()
                   if "compat_eq" in op.name]
        assert lookups, "the scope's grouped lookup is missing"
        ours_by_name = {c.name: v for c, v in ours_vars.items() if v}
        copies = [w[0].assign(ours_by_name[c.name][0])
                  for c, w in stock_vars.items()
                  if c.name in ours_by_name]
        stock_by_name = {c.name: v for c, v in stock_vars.items() if v}
        copies.append(stock_by_name["tag2_embedding"][0].assign(
            ours_vars[stock_tag][0]))
        with V1.Session() as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(copies)
            got, want = sess.run([got, want])
    assert got.shape == (4, 4 + 1 + 4 + 3)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_embedding_column_routing_and_rejected_arguments(compat):
    a = tf.feature_column.categorical_column_with_identity("a", 5)
    b = tf.feature_column.categorical_column_with_identity("b", 5)
    crossed = tf.feature_column.crossed_column([a, b], 10)
    # Outside scopes, a column the library cannot embed stays stock...
    assert isinstance(tf.feature_column.embedding_column(crossed, 2),
                      fc_v2.EmbeddingColumn)
    # ...inside a scope it is an error naming the column and the scope.
    with tf.feature_column.group_embedding_column_scope("compat_bad"):
        with pytest.raises(TypeError, match="compat_bad"):
            tf.feature_column.embedding_column(crossed, 2)
    with pytest.raises(NotImplementedError, match="ckpt_to_load_from"):
        tf.feature_column.embedding_column(a, 2, ckpt_to_load_from="/x")
    with pytest.raises(NotImplementedError, match="ckpt_to_load_from"):
        V1.feature_column.shared_embedding_columns(
            [a, b], 2, tensor_name_in_ckpt="t")
    shared = V1.feature_column.shared_embedding_columns([a, b], 2)
    assert {c.table_name for c in shared} == {"a_b_shared_embedding"}


def test_deeprec_style_script_learns(tmp_path):
    frame, bayes_auc = data.generate(10_000, seed=3)
    train_csv, eval_csv = str(tmp_path / "train.csv"), str(
        tmp_path / "eval.csv")
    data.write_csv(frame[:8000], train_csv)
    data.write_csv(frame[8000:], eval_csv)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(
        [sys.executable, os.path.join(_HERE, "deeprec_style_script.py"),
         "--train", train_csv, "--eval", eval_csv,
         "--checkpoint_dir", str(tmp_path / "ckpt"), "--steps", "150"],
        capture_output=True, text=True, env=env, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["steps"] == 150
    assert result["last_loss"] < result["first_loss"] - 0.05
    assert result["auc"] > 0.65, (result, bayes_auc)
