"""The grouped lookup of `lookup.py`, model parallel over Horovod workers.

For one group of same-dim sharded tables, every worker:
1. deduplicates its ids per table and groups them by owner worker;
2. sends them with ONE `alltoall` (rows of (table slot, local row));
3. looks up what it received in its own shards (one fused op);
4. returns the rows with a second `alltoall`;
5. pools the rows of its own batch locally.
Autodiff runs the same path backwards (Horovod's alltoall gradient), so
each owner receives exactly the gradient rows of the ids it owns and its
optimizer updates only those rows of its shard.
"""

from typing import List

import tensorflow as tf

from group_embedding import distributed_strategy
from group_embedding.ops import fused_lookup
from group_embedding.ops.ragged_ids import FeatureIds


def _one_id_rows(ids: tf.Tensor, name: str) -> FeatureIds:
    # A ragged batch of one-id rows: "sum" pooling is then a plain gather.
    splits = tf.range(tf.size(ids, out_type=tf.int64) + 1)
    return FeatureIds(ids, splits, None, None, None, name)


def _check_partition(tables, partition_strategy, names):
    for t, n in zip(tables, names):
        if t.partition_strategy != partition_strategy:
            raise ValueError(
                f"{n} was sharded with partition_strategy "
                f"{t.partition_strategy!r} but the lookup asks for "
                f"{partition_strategy!r}; use the table's strategy.")


def exchange_rows(tables, feats: List[FeatureIds], names) -> tf.Tensor:
    """Rows `[sum nnz, D]` for the ids of `feats`, fetched from their owners.

    Args:
        tables: `ShardedVariable`s of one group (same dim and dtype).
        feats: this worker's ids, one `FeatureIds` per table.
        names: table names for error messages.

    Returns:
        The row of every id of every feature, in feature order.
    """
    hvd = distributed_strategy.horovod()
    size = hvd.size()
    k = len(tables)
    slots, owners, local, table_of = [], [], [], []
    offset = tf.constant(0, tf.int64)
    # A bad id must fail here, naming the table, not as a wrong row or
    # an anonymous error on the owner.
    checked = fused_lookup.checked_ids([f.values for f in feats],
                                       [t.vocab_size for t in tables], names)
    for i, (t, ids) in enumerate(zip(tables, checked)):
        u, idx = tf.unique(ids, out_idx=tf.int64)
        slots.append(idx + offset)
        offset += tf.size(u, out_type=tf.int64)
        owners.append(t.owner(u))
        local.append(t.local_row(u))
        table_of.append(tf.fill(tf.shape(u), tf.constant(i, tf.int64)))
    owner = tf.concat(owners, 0)
    # Stable sort by owner: the send buffer is grouped by destination.
    order = tf.argsort(owner, stable=True)
    send = tf.gather(tf.stack([tf.concat(table_of, 0),
                               tf.concat(local, 0)], 1), order)
    splits = tf.math.bincount(tf.cast(owner, tf.int32), minlength=size,
                              maxlength=size)
    received, received_splits = hvd.alltoall(send, splits=splits)
    # Owner side: look the received rows up in the local shards, fused.
    parts = tf.dynamic_partition(received[:, 1],
                                 tf.cast(received[:, 0], tf.int32), k)
    positions = tf.dynamic_partition(
        tf.range(tf.shape(received, out_type=tf.int64)[0]),
        tf.cast(received[:, 0], tf.int32), k)
    shard_rows = fused_lookup.pooled_lookup(
        [t.shard for t in tables],
        [_one_id_rows(p, n) for p, n in zip(parts, names)],
        ["sum"] * k, [f"{n} (local shard)" for n in names])
    owned = tf.dynamic_stitch([tf.cast(p, tf.int32) for p in positions],
                              shard_rows)
    returned, _ = hvd.alltoall(owned, splits=received_splits)
    # Undo the sort by owner, then expand unique ids to every occurrence.
    unique_rows = tf.gather(returned, tf.math.invert_permutation(order))
    return tf.gather(unique_rows, tf.concat(slots, 0))


def pooled_lookup(tables, feats, combiners, names, partition_strategy,
                  max_norm=None):
    """Model-parallel `[B, D]` pooled lookups of one group of shards."""
    _check_partition(tables, partition_strategy, names)
    rows = exchange_rows(tables, feats, names)
    if max_norm is not None:
        rows = fused_lookup.clip_rows(rows, max_norm)
    return fused_lookup.pool_rows(rows, feats, combiners)


def sequence_lookup(tables, feats, names, partition_strategy, max_norm=None):
    """Model-parallel `[B, T, D]` unpooled lookups of one group."""
    _check_partition(tables, partition_strategy, names)
    rows = exchange_rows(tables, feats, names)
    if max_norm is not None:
        rows = fused_lookup.clip_rows(rows, max_norm)
    return fused_lookup.sequence_rows(rows, feats)
