"""Tables that a partitioned `variable_scope` split into shards.

DeepRec's model zoo builds its input layer under
`tf.variable_scope(..., partitioner=min_max_variable_partitioner(...))`
(or `fixed_size_partitioner`), so `tf.compat.v1.get_variable` returns a
`PartitionedVariable`: the `[num_buckets, D]` table cut along rows into
shards, row r living in the shard whose row range holds it (stock's "div"
layout). Stock `input_layer` looks such a table up with `partition_strategy=
"div"`; here each shard becomes one table of the grouped lookup:

- ids are split by shard and made shard-local (`id - first row`);
- pooling over shards: every id carries the weight its row's combiner
  gives it (mean: `w / sum w`, sqrtn: `w / sqrt(sum w^2)`), each shard is
  pooled with "sum", and the shard results are added. That is exactly the
  combiner over the whole row, forward and backward.

EmbeddingVariables are one hash table each and are never partitioned.
"""

from typing import List
from typing import Optional
from typing import Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import variables as tf_variables


def is_partitioned(table) -> bool:
    """True for a `PartitionedVariable` table."""
    return isinstance(table, tf_variables.PartitionedVariable)


def shards(table, column_name: str) -> List[tf.Variable]:
    """The shards of a row-partitioned table, in row order.

    Raises:
        NotImplementedError: the table is cut along another axis than rows
            (the message names the column).
    """
    partitions = list(table._get_partitions())  # noqa: SLF001
    if any(p != 1 for p in partitions[1:]):
        raise NotImplementedError(
            f"embedding_column '{column_name}': its table is partitioned "
            f"{partitions} (along the embedding dim); only row "
            "partitioning (axis 0, what min_max_variable_partitioner and "
            "fixed_size_partitioner do by default) is supported.")
    return list(table)


def _pooling_weights(ids: tf.SparseTensor,
                     weights: Optional[tf.SparseTensor],
                     combiner: str) -> Optional[tf.SparseTensor]:
    """Per-id weights that turn `combiner` into a plain sum."""
    if combiner == "sum":
        return weights
    w = tf.ones_like(ids.values, tf.float32) if weights is None \
        else weights.values
    rows = ids.indices[:, 0]
    batch = ids.dense_shape[0]
    if combiner == "mean":
        denominator = tf.math.unsorted_segment_sum(w, rows, batch)
    else:  # sqrtn
        denominator = tf.sqrt(tf.math.unsorted_segment_sum(w * w, rows,
                                                           batch))
    # Pruned ids leave only positive weights, so a row with ids has a
    # positive denominator; empty rows are never gathered.
    return tf.SparseTensor(ids.indices, w / tf.gather(denominator, rows),
                           ids.dense_shape)


def split_ids(ids: tf.SparseTensor, weights: Optional[tf.SparseTensor],
              combiner: str, tables: List[tf.Variable], is_sequence: bool
              ) -> Tuple[List[tf.SparseTensor],
                         List[Optional[tf.SparseTensor]], str]:
    """Splits one column's ids over the shards of its table.

    Args:
        ids: int64 SparseTensor `[B, T]` of global row ids (pruned).
        weights: None or float SparseTensor with the same indices.
        combiner: the column's combiner.
        tables: the shards, in row order.
        is_sequence: unpooled lookup: positions are kept and the combiner
            is not applied.

    Returns:
        (ids per shard, weights per shard, combiner to use for every
        shard). Indices and dense shape are kept, so positions (sequence
        lookups) and the batch size are unchanged.
    """
    sizes = [int(t.shape[0]) for t in tables]
    ends = tf.constant(np.cumsum(sizes), tf.int64)
    starts = tf.constant(np.cumsum([0] + sizes[:-1]), tf.int64)
    if not is_sequence:
        weights = _pooling_weights(ids, weights, combiner)
        combiner = "sum"
    # An id past the last row goes to the last shard, whose range check
    # then reports it instead of the id being dropped.
    shard = tf.minimum(tf.searchsorted(ends, ids.values, side="right"),
                       len(tables) - 1)
    local = tf.SparseTensor(ids.indices,
                            ids.values - tf.gather(starts, shard),
                            ids.dense_shape)
    shard_ids, shard_weights = [], []
    for p in range(len(tables)):
        keep = tf.equal(shard, p)
        shard_ids.append(tf.sparse.retain(local, keep))
        shard_weights.append(None if weights is None
                             else tf.sparse.retain(weights, keep))
    return shard_ids, shard_weights, combiner
