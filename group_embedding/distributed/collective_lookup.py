"""The grouped lookup of `lookup.py`, model parallel over Horovod workers.

For one group of same-dim sharded tables (or EmbeddingVariables, whose
keys are owned by worker `key mod N`), every worker:
1. deduplicates its ids per table and groups them by owner worker;
2. sends them with ONE `alltoall` (ids, with per-table counts);
3. looks up what it received in its own shards (one fused op);
4. returns the rows with a second `alltoall`;
5. pools the rows of its own batch locally.
Autodiff runs the same path backwards (the alltoall's gradient), so
each owner receives exactly the gradient rows of the ids it owns and its
optimizer updates only those rows of its shard.

Sharded float32 tables on CPU (no `max_norm`) take the C++ path of
`ops/collective_routing.py`: steps 1, 3 and 5 are one kernel each, and the
backward reuses the forward's routing (one gradient row per distinct id,
no second dedup). Everything else (EVs, sequences, `max_norm`, GPU,
`GROUP_EMBEDDING_KERNELS=tf`) takes the pure-TF path below, which computes
the same numbers.
"""

import contextlib
from typing import Any
from typing import Dict
from typing import Iterator
from typing import List
from typing import Optional

import tensorflow as tf
from tensorflow.python.saved_model import save_context

from group_embedding import lookup
from group_embedding import lookup_plan
from group_embedding import model_parallel
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed import transport
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.lookup_plan import LookupCall
from group_embedding.lookup_plan import TableGroup
from group_embedding.ops import capabilities
from group_embedding.ops import collective_routing
from group_embedding.ops import ev_storage
from group_embedding.ops import hbm_ev_storage
from group_embedding.ops import lookup_tf
from group_embedding.ops import ragged_ids
from group_embedding.ops.ragged_ids import FeatureIds

# The exchanges (steps 2 and 4, and the gradient of 4) go over
# `transport`'s peer sockets when they are connected, else Horovod.


def _alltoall(hvd, data, splits, name, expected=None, derived=0):
    """One exchange: over the peer sockets when connected, else Horovod.
    `expected`: the rows each worker must send here, where known (the
    peer transport refuses another count; Horovod negotiates them).
    `derived`: bytes this worker allocates later per row received,
    counted against the transport's byte cap."""
    # The transport was chosen once, by `transport.connect` when collective
    # mode was enabled (GROUP_EMBEDDING_TRANSPORT and whether the kernels
    # hold the exchange op); this reads that choice.
    if transport.active():
        return transport.tracked(
            hvd, lambda x: transport.alltoall(
                x, splits, name, expected_splits=expected,
                derived_bytes_per_row=derived),
            data, True)
    return hvd.alltoall(data, splits=splits)


def owner_bytes_per_id(tables) -> int:
    """What an owner allocates for one id a peer sends it, beyond the id:
    its row in the widest table of the group (forward), then, in the
    backward, that row's gradient and its merged gradient (the forward
    row is gone by then). The byte cap bounds these too: a message of
    ids within the cap cannot become rows many times the cap."""
    return 2 * max(int(t.embedding_dim) * tf.as_dtype(t.dtype).size
                   for t in tables)


# An EV key's count travels to tf.repeat: bounded like one int32 split.
_MAX_COUNT = 2**31 - 1


def _first_failure(bad, parts):
    """An assert that fails when any of `bad` holds; its message joins
    `parts` (strings, or int64 [n] tensors read at the first bad entry)."""
    any_bad = tf.reduce_any(bad)

    def message():  # built only on failure (and never for an empty `bad`)
        at = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
        return tf.strings.join([
            p if isinstance(p, str) else
            (p[at] if p.dtype == tf.string else tf.strings.as_string(p[at]))
            for p in parts])

    text = tf.cond(any_bad, message, lambda: tf.constant(""))
    return tf.debugging.Assert(tf.logical_not(any_bad), [text],
                               name="check_received_ids")


def _check_received(tables, received, received_splits, names, rank, size,
                    is_ev):
    """Checks what the peers sent this owner before it looks anything up:
    a table slot of the group, EV keys this worker owns (key mod N ==
    rank; another's key would be inserted here and make the checkpoint
    unrestorable) with counts in [1, _MAX_COUNT], shard rows inside the
    shard. Errors name the table and the sending worker.

    Returns:
        The assert ops; run them before the lookup.
    """
    k = len(tables)
    slot, ids, count = received[:, 0], received[:, 1], received[:, 2]
    n = tf.shape(received, out_type=tf.int64)[0]
    sender = tf.searchsorted(
        tf.cumsum(tf.cast(received_splits, tf.int64)), tf.range(n),
        side="right")
    bad_slot = (slot < 0) | (slot >= k)
    checks = [_first_failure(bad_slot, [
        "worker ", sender, " sent an id of table slot ", slot,
        (f", the group has {k} table{'s' if k > 1 else ''} "
         f"({', '.join(names)}).")])]
    name = tf.gather(tf.constant(list(names)),
                     tf.where(bad_slot, tf.zeros_like(slot), slot))
    if is_ev:
        owner = model_parallel.key_owner(ids, size)
        bad_count = ~bad_slot & ((count < 1) | (count > _MAX_COUNT))
        checks.append(_first_failure(bad_count, [
            name, ": worker ", sender, " sent key ", ids, " with count ",
            count, f", outside [1, {_MAX_COUNT}]."]))
        # What tf.repeat allocates per sender, and the rows gathered for
        # those keys: bounded like the ids of one exchange (each key's
        # count is < 2**31, so the sum cannot wrap).
        most = transport.max_ids_per_peer(owner_bytes_per_id(tables))
        per_sender = tf.math.unsorted_segment_sum(
            tf.where(bad_slot | bad_count, tf.zeros_like(count), count),
            sender, size)
        checks.append(_first_failure(per_sender > most, [
            "worker ", tf.range(size, dtype=tf.int64), " sent EV keys of ",
            f"{', '.join(names)} whose counts sum to ", per_sender,
            f", more than {most} ids (GROUP_EMBEDDING_TRANSPORT_MAX_BYTES "
            f"over {8 + owner_bytes_per_id(tables)} bytes an id and its "
            f"rows) in one exchange."]))
        # tf.not_equal, not `!=`: TF1 graphs may compare tensors as objects.
        checks.append(_first_failure(~bad_slot & tf.not_equal(owner, rank), [
            name, ": worker ", sender, " sent key ", ids,
            ", owned by worker ", owner,
            f" (key mod {size}), not by this worker ({rank})."]))
    else:
        rows = tf.constant([t.shard_variable.shape[0] for t in tables],
                           tf.int64)
        limit = tf.gather(rows, tf.where(bad_slot, tf.zeros_like(slot),
                                         slot))
        checks.append(_first_failure(~bad_slot & ((ids < 0) | (ids >= limit)),
                                     [name, ": worker ", sender,
                                      " sent local row ", ids,
                                      ", outside this shard's [0, ", limit,
                                      ")."]))
    return checks


def check_partition(tables, partition_strategy, names):
    for t, n in zip(tables, names):
        # EV keys are always owned by key mod N, and a table-wise table by
        # its one worker: the lookup's partition_strategy cannot apply.
        if not isinstance(t, ShardedVariable) or t.placement == "table":
            continue
        if t.partition_strategy != partition_strategy:
            raise ValueError(
                f"{n} was sharded with partition_strategy "
                f"{t.partition_strategy!r} but the lookup asks for "
                f"{partition_strategy!r}; use the table's strategy.")


def _route_sharded(tables, feats, names):
    """Per table: (unique ids, slot of each id, owner, local row, count)."""
    checked = lookup_tf.checked_ids([f.values for f in feats],
                                    [t.vocab_size for t in tables], names)
    routes = []
    for t, ids in zip(tables, checked):
        u, slot = tf.unique(ids, out_idx=tf.int64)
        routes.append((u, slot, t.owner(u), t.local_row(u),
                       tf.ones_like(u)))
    return routes


def _route_ev(tables, feats, size):
    """EV keys: owner = key mod N; counts travel along so the owner's
    frequency counting (CounterFilter) sees every occurrence, exactly as
    a single process would."""
    routes = []
    for f in feats:
        u, slot, count = tf.unique_with_counts(f.values, out_idx=tf.int64)
        routes.append((u, slot, model_parallel.key_owner(u, size), u,
                       count))
    return routes


def _owner_rows_sharded(tables, parts, counts, names, training):
    del counts, training  # one id, one row; nothing is counted
    return lookup.lookup_feature_ids(
        [t.shard_variable for t in tables],
        [ragged_ids.from_ragged(ragged_ids.one_id_rows(p), None, n)
         for p, n in zip(parts, names)],
        ["sum"] * len(tables), [f"{n} (local shard)" for n in names],
        LookupCall(mode=lookup_plan.Mode.POOLED))


def _owner_rows_ev(tables, parts, counts, names, training):
    # Expand keys by their counts (frequencies), gather, keep one row per
    # received key: the first of its run.
    expanded = [tf.repeat(p, c) for p, c in zip(parts, counts)]
    if (lookup_plan.table_kind(tables[0]) == lookup_plan.TableKind.HBM_EV
            and not save_context.in_save_context()):
        # HBM EVs: the GPU library's lookup op, unpooled. (A SavedModel
        # save reads every kind's frozen snapshot: group_gather.)
        module = capabilities.current().hbm_ev_module(names)
        rows = hbm_ev_storage.gather(module, tables, expanded, training)
    else:
        rows = ev_storage.group_gather(tables, expanded, training)
    sizes = [tf.size(x) for x in expanded]
    firsts = [tf.cumsum(c, exclusive=True) for c in counts]
    offsets = tf.cumsum(tf.stack(sizes), exclusive=True)
    first_rows = tf.concat([f + tf.cast(offsets[i], tf.int64)
                            for i, f in enumerate(firsts)], 0)
    return tf.split(tf.gather(rows, first_rows),
                    tf.stack([tf.size(p) for p in parts]), num=len(parts))


def exchange_rows(tables, feats: List[FeatureIds], names,
                  training=True) -> tf.Tensor:
    """Rows `[sum nnz, D]` for the ids of `feats`, fetched from their owners.

    Args:
        tables: one group: `ShardedVariable`s, or `EmbeddingVariable`s
            (whose keys are owned by worker `key mod N`).
        feats: this worker's ids, one `FeatureIds` per table.
        names: table names for error messages.
        training: EVs: whether owners insert new keys.

    Returns:
        The row of every id of every feature, in feature order.
    """
    hvd = distributed_strategy.horovod()
    size = hvd.size()
    k = len(tables)
    is_ev = is_embedding_variable(tables[0])
    routes = (_route_ev(tables, feats, size) if is_ev
              else _route_sharded(tables, feats, names))
    slots, offset = [], tf.constant(0, tf.int64)
    for u, slot, _, _, _ in routes:
        slots.append(slot + offset)
        offset += tf.size(u, out_type=tf.int64)
    owner = tf.concat([r[2] for r in routes], 0)
    # Stable sort by owner: the send buffer is grouped by destination;
    # each row is (table slot in the group, local row or key, count).
    order = tf.argsort(owner, stable=True)
    table_of = [tf.fill(tf.shape(r[0]), tf.constant(i, tf.int64))
                for i, r in enumerate(routes)]
    send = tf.gather(tf.stack([tf.concat(table_of, 0),
                               tf.concat([r[3] for r in routes], 0),
                               tf.concat([r[4] for r in routes], 0)], 1),
                     order)
    splits = tf.math.bincount(tf.cast(owner, tf.int32), minlength=size,
                              maxlength=size)
    key = group_key(names)
    # Each received row (slot, id, count) is split three ways below, then
    # turns into rows: looked up, stitched, and in the backward their
    # gradients.
    received, received_splits = _alltoall(
        hvd, send, splits, f"ids:{key}",
        derived=24 + 3 * owner_bytes_per_id(tables) // 2)
    with tf.control_dependencies(_check_received(
            tables, received, received_splits, names, hvd.rank(), size,
            is_ev)):
        received = tf.identity(received)
    # Owner side: one fused lookup of what was received, per table.
    which = tf.cast(received[:, 0], tf.int32)
    parts = tf.dynamic_partition(received[:, 1], which, k)
    counts = tf.dynamic_partition(received[:, 2], which, k)
    positions = tf.dynamic_partition(
        tf.range(tf.shape(received)[0]), which, k)
    lookup = _owner_rows_ev if is_ev else _owner_rows_sharded
    owned = tf.dynamic_stitch(positions,
                              lookup(tables, parts, counts, names, training))
    # Each owner sends back exactly one row per id this worker sent it.
    returned, _ = _alltoall(hvd, owned, received_splits, f"rows:{key}",
                            expected=splits)
    # Undo the sort by owner, then expand unique ids to every occurrence.
    unique_rows = tf.gather(returned, tf.math.invert_permutation(order))
    return tf.gather(unique_rows, tf.concat(slots, 0))


def is_kernel_path(group: TableGroup, max_norm) -> bool:
    """Whether the C++ routing kernels serve this planned group: the
    plan's capability snapshot has them (loaded, with the routing ops) and
    no GPU, there is no `max_norm`, and the tables are sharded float32."""
    found = group.capabilities
    if max_norm is not None or not found.collective_routing or found.gpu:
        return False
    return all(isinstance(t, ShardedVariable)
               and tf.as_dtype(t.dtype) == tf.float32 for t in group.tables)


# Id exchanges done ahead of their lookup (`ge.distributed.exchange_ids`),
# innermost last; read while a lookup is traced or run eagerly.
_exchanged_stack: List[Dict[str, Dict]] = []


@contextlib.contextmanager
def exchanged_ids(exchanged: Dict[str, Any]) -> Iterator[None]:
    """Inside, kernel-path groups found in `exchanged` (by `group_key`)
    reuse those ids instead of routing and sending their own."""
    _exchanged_stack.append(dict(exchanged or {}))
    try:
        yield
    finally:
        _exchanged_stack.pop()


def group_key(names) -> str:
    """Key of one lookup group in an `exchange_ids` result."""
    return "|".join(names)


def exchange_group_ids(tables, feats, names) -> Dict[str, Any]:
    """Routes one kernel-path group's ids and sends them to their owners.

    The part of the lookup that depends only on the ids (not on any
    variable), so it may run a step ahead.

    Returns:
        {"received": int64 ids that this worker owns and was asked for,
        "received_splits": int32 `[N]`, "offsets": K int64 `[nnz_t]`}.
    """
    hvd = distributed_strategy.horovod()
    send, send_splits, offsets = collective_routing.route_ids(
        [f.values for f in feats], [t.vocab_size for t in tables],
        [t.embedding_dim for t in tables],
        [t.partition_strategy for t in tables], hvd.size(), names)
    # The per-source table counts in `send` turn into no rows: counting
    # every int64 as an id bounds the rows from above.
    received, received_splits = _alltoall(
        hvd, send, send_splits, f"ids:{group_key(names)}",
        derived=owner_bytes_per_id(tables))
    return {"received": received, "received_splits": received_splits,
            "offsets": tuple(offsets)}


def _prefetched(feats, names) -> Optional[Dict[str, Any]]:
    """The exchange `use_exchanged_ids` holds for this group, checked."""
    key = group_key(names)
    found = next((e[key] for e in reversed(_exchanged_stack) if key in e),
                 None)
    if found is None:
        return None
    offsets = list(found["offsets"])
    checks = []
    for f, o, n in zip(feats, offsets, names):
        # Cheap guard against a batch other than the exchanged one.
        checks.append(tf.debugging.assert_equal(
            tf.size(o, out_type=tf.int64),
            tf.size(f.values, out_type=tf.int64),
            message=f"{n}: the ids exchanged ahead (ge.distributed."
                    f"exchange_ids) are not those of this lookup's batch"))
    with tf.control_dependencies(checks):
        offsets = [tf.identity(o) for o in offsets]
    return {"received": found["received"],
            "received_splits": found["received_splits"],
            "offsets": offsets}


def kernel_pooled_lookup(tables, feats, combiners, names) -> List[tf.Tensor]:
    """Pooled lookups of sharded float32 tables with the C++ routing.

    Two `alltoall`s forward (ids out, rows back) and one backward (the
    gradient rows), whatever the number of tables; the tables may have
    different dims, so one call can serve several groups. Inside
    `ge.distributed.use_exchanged_ids` the ids alltoall (and the routing)
    done ahead for this group is reused.

    Args:
        tables: K `ShardedVariable`s (float32), any dims.
        feats: this worker's `FeatureIds`, one per table.
        combiners: "sum" | "mean" | "sqrtn" per table.
        names: table names for error messages.

    Returns:
        K tensors `[B, D_t]`.
    """
    hvd = distributed_strategy.horovod()
    dims = [t.embedding_dim for t in tables]
    exchanged = _prefetched(feats, names)
    if exchanged is None:
        exchanged = exchange_group_ids(tables, feats, names)
    received = exchanged["received"]
    received_splits = exchanged["received_splits"]
    offsets = list(exchanged["offsets"])
    rows, row_splits = collective_routing.owner_gather(
        [t.shard_variable for t in tables], received, received_splits, dims,
        names)
    returned, _ = _alltoall(hvd, rows, row_splits,
                            f"rows:{group_key(names)}")
    return collective_routing.pool(returned, offsets, feats, combiners, dims)


def pooled_lookup(group: TableGroup, call: LookupCall) -> List[tf.Tensor]:
    """Model-parallel `[B, D]` pooled lookups of one planned group."""
    tables, feats, names = list(group.tables), list(group.feats), group.names
    check_partition(tables, call.partition_strategy, names)
    if is_kernel_path(group, call.max_norm):
        return kernel_pooled_lookup(tables, feats, group.combiners, names)
    rows = exchange_rows(tables, feats, names, call.training)
    if call.max_norm is not None:
        rows = lookup_tf.clip_rows(rows, call.max_norm)
    return lookup_tf.pool_rows(rows, feats, list(group.combiners))


def sequence_lookup(group: TableGroup, call: LookupCall) -> List[tf.Tensor]:
    """Model-parallel `[B, T, D]` unpooled lookups of one planned group."""
    tables, feats, names = list(group.tables), list(group.feats), group.names
    check_partition(tables, call.partition_strategy, names)
    rows = exchange_rows(tables, feats, names, call.training)
    if call.max_norm is not None:
        rows = lookup_tf.clip_rows(rows, call.max_norm)
    return lookup_tf.sequence_rows(rows, feats)
