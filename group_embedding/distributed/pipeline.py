"""Opt-in pipelining for custom loops: the next batch's ids travel during
the current step.

In collective mode a grouped lookup first routes its ids (dedup, bucket by
owner) and sends them to their owners with an `alltoall`, then fetches the
rows with a second one. The first part depends only on the batch, not on
any variable, so it can run one step ahead: the step that trains on batch
t also routes and sends the ids of batch t+1, and that exchange can wait
in Horovod's background thread while this step computes. The results are
exactly those of the plain loop (owners still read their rows after the
previous update).

    @tf.function(reduce_retracing=True)
    def step(sp_ids, exchanged, next_sp_ids):
        with tf.GradientTape() as tape:
            with ge.distributed.use_exchanged_ids(exchanged):
                emb = ge.group_embedding_lookup_sparse(tables, sp_ids, "sum")
            loss = ...
        ...  # gradients, ge.allreduce_gradients, optimizer, as usual
        return loss, ge.distributed.exchange_ids(tables, next_sp_ids)

    exchanged = tf.function(ge.distributed.exchange_ids)(tables, batches[0])
    for t in range(steps):
        loss, exchanged = step(batches[t], exchanged, batches[t + 1])

Pass `exchange_ids` the same tables, in the same order, as the lookup (and
the same `params_num_per_group`). Outside collective mode both functions
do nothing, so the same loop runs in a single process.

Limit (seen in the Horovod timeline of benchmarks/scaling_bench.py): TF
issues the next batch's alltoall late in the step, in the same Horovod
cycle as the gradient alltoall, and Horovod's background thread runs
collectives one at a time, so the exchange often runs after the gradient
alltoall instead of during compute. Measure (`--sizes 1,2,2p`) before
relying on it.
"""

import contextlib
import sys
from typing import Any
from typing import Dict
from typing import Iterator

import tensorflow as tf

from group_embedding import lookup_inputs
from group_embedding import lookup_plan
from group_embedding.distributed import collective_lookup
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.lookup_plan import LookupCall
from group_embedding.ops import ragged_ids


@tf.autograph.experimental.do_not_convert
def exchange_ids(params, sp_ids, partition_strategy="mod",
                 params_num_per_group=sys.maxsize) -> Dict[str, Any]:
    """Routes `sp_ids` and sends them to their owners, ahead of the lookup.

    Args:
        params: the tables of the later `group_embedding_lookup_sparse`
            call, in the same order.
        sp_ids: the id batch (SparseTensor or RaggedTensor per table) that
            call will look up.
        partition_strategy: as the lookup's.
        params_num_per_group: as the lookup's.

    Returns:
        A dict of tensors (pass it through `tf.function` arguments and
        results), one entry per group of sharded float32 tables served by
        the C++ routing; `{}` outside collective mode. Other groups (EVs,
        replicated tables) are exchanged by the lookup itself as usual.

    Raises:
        ValueError: a table sharded with another partition strategy (the
            error names it).
    """
    if not distributed_strategy.is_collective():
        return {}
    params = list(params)
    sp_ids = list(sp_ids)
    tables, names = lookup_inputs.prepare_tables(params)
    out: Dict[str, Any] = {}
    with tf.name_scope("ge_exchange_ids"):
        feats = ragged_ids.to_feature_ids(sp_ids, [None] * len(sp_ids))
        # The lookup's own plan: the same groups, the same keys.
        call = LookupCall(mode=lookup_plan.Mode.POOLED,
                          partition_strategy=partition_strategy)
        for g in lookup_plan.group_tables(tables, feats, names,
                                          ["sum"] * len(tables), call,
                                          params_num_per_group):
            # Only the C++ path takes exchanged ids (max_norm is checked
            # again by the lookup, which then ignores this entry).
            if (g.kind != lookup_plan.TableKind.SHARDED
                    or g.backend != lookup_plan.Backend.COLLECTIVE
                    or not collective_lookup.is_kernel_path(g, None)):
                continue
            collective_lookup.check_partition(g.tables, partition_strategy,
                                              g.names)
            out[collective_lookup.group_key(g.names)] = (
                collective_lookup.exchange_group_ids(
                    g.tables, list(g.feats), g.names))
    return out


@contextlib.contextmanager
def use_exchanged_ids(exchanged: Dict[str, Any]) -> Iterator[None]:
    """Lookups inside reuse `exchanged` (from `exchange_ids`) for their
    groups instead of routing and sending their ids again.

    A group whose ids were exchanged for another batch fails at run time
    (the id counts differ, the error names the table) when the counts
    differ; equal counts cannot be told apart, so pass the same batch.
    """
    with collective_lookup.exchanged_ids(exchanged):
        yield
