"""Inputs and the stock oracle shared by the feature-column tests.

`ROWS` holds one batch of 6 rows per feature as Python lists (multi-hot,
empty rows, out-of-vocabulary values, negative and fractional weights);
`make_features` turns it into dense (padded with the stock default ""/-1),
SparseTensor or RaggedTensor inputs. `stock_categorical_columns` builds one
stock categorical column of every supported kind over these features.
"""

import itertools
from typing import Dict
from typing import List

import numpy as np
import tensorflow as tf

DIM = 4
BATCH = 6

ROWS: Dict[str, List[list]] = {
    # identity, 10 buckets
    "uid": [[1, 3, 3], [], [9], [0, 2], [5], [7, 7, 8]],
    # identity, 10 buckets (shares a table with "uid" in shared tests)
    "uid2": [[2], [4, 4], [], [9, 0], [1], []],
    # hash bucket, 20 buckets
    "tag": [["a", "b"], ["c"], [], ["a"], ["zz", "y", "x"], ["q"]],
    # vocabulary list; "xx" and "oov" are out of vocabulary (dropped)
    "city": [["sf", "xx"], ["ny"], ["la", "la"], [], ["oov"], ["sf"]],
    # vocabulary file of ints, 2 OOV buckets (99 hashes into one)
    "item": [[10, 20], [30], [99], [], [20], [10, 30]],
    # identity weighted by "wid_w"; row 4's weight is negative
    "wid": [[1, 2], [3], [], [4, 4], [0], [5]],
    "wid_w": [[0.5, 2.0], [1.0], [], [0.3, 0.7], [-1.5], [1.25]],
}
VOCAB_FILE_LINES = ["10", "20", "30"]
_uid = itertools.count()


def unique_name(prefix: str) -> str:
    """A scope name no other test uses (scope names are process-wide)."""
    return f"{prefix}_{next(_uid)}"


def _dtype(key: str) -> tf.DType:
    first = next(v for row in ROWS[key] for v in row)
    if isinstance(first, str):
        return tf.string
    return tf.float32 if isinstance(first, float) else tf.int64


def make_feature(rows: List[list], dtype: tf.DType, kind: str):
    """One feature's batch as a dense, sparse or ragged tensor."""
    if kind == "ragged":
        return tf.ragged.constant(rows, dtype=dtype, ragged_rank=1) \
            if any(rows) else tf.RaggedTensor.from_row_lengths(
                tf.zeros([0], dtype), [0] * len(rows))
    if kind == "sparse":
        indices = [[b, j] for b, row in enumerate(rows)
                   for j in range(len(row))]
        values = [v for row in rows for v in row]
        width = max(1, max(len(r) for r in rows))
        return tf.SparseTensor(
            tf.constant(indices, tf.int64, shape=[len(values), 2]),
            tf.constant(values, dtype, shape=[len(values)]),
            [len(rows), width])
    pad = {tf.string: "", tf.float32: 0.0}.get(dtype, -1)
    width = max(1, max(len(r) for r in rows))
    return tf.constant([row + [pad] * (width - len(row)) for row in rows],
                       dtype)


def make_features(kind: str, keys=None) -> Dict[str, object]:
    """The batch of `ROWS` (or of `keys` only) as `kind` tensors."""
    return {k: make_feature(ROWS[k], _dtype(k), kind)
            for k in (keys or ROWS)}


def write_vocab_file(directory) -> str:
    path = str(directory / "items.txt")
    with open(path, "w") as f:
        f.write("\n".join(VOCAB_FILE_LINES) + "\n")
    return path


def stock_categorical_columns(vocab_file: str) -> list:
    """One stock categorical column of each supported kind."""
    fc = tf.feature_column
    return [
        fc.categorical_column_with_identity("uid", 10),
        fc.categorical_column_with_hash_bucket("tag", 20),
        fc.categorical_column_with_vocabulary_list("city", ["sf", "ny",
                                                           "la"]),
        fc.categorical_column_with_vocabulary_file(
            "item", vocab_file, vocabulary_size=3, dtype=tf.int64,
            num_oov_buckets=2),
        fc.weighted_categorical_column(
            fc.categorical_column_with_identity("wid", 8), "wid_w"),
    ]


def run_graph(graph: tf.Graph, fetches, before=None):
    """Initialises variables and tables of `graph`, runs `before`, then
    returns `fetches` evaluated."""
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run([tf.compat.v1.global_variables_initializer(),
                  tf.compat.v1.tables_initializer()])
        if before is not None:
            sess.run(before)
        return sess.run(fetches)


def random_weights(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)
