"""`enable_distributed_strategy("collective")`: model-parallel embeddings.

After the call, tables created with `ge.get_embedding_table` (and the
feature columns' tables) are row-sharded over the Horovod workers, and the
grouped lookups exchange ids and rows with `alltoall`. Dense variables stay
data parallel: `ge.DistributedGradientTape` averages their gradients.

Launch with `horovodrun -np N python train.py`; each worker feeds its own
slice of the global batch.

This module starts everything (Horovod, the watchdog, the peer transport,
the per-worker TF1 checkpoints) and registers the collective lookups with
the core (`group_embedding.model_parallel`); `strategy` holds the state.
"""

import time
import warnings
from typing import Any
from typing import Mapping
from typing import Optional

from group_embedding import model_parallel
from group_embedding.distributed import collective_lookup
from group_embedding.distributed import horovod_settings
from group_embedding.distributed import sharded_variable
from group_embedding.distributed import strategy as state
from group_embedding.distributed import transport
from group_embedding.distributed import watchdog
from group_embedding.distributed import worker_checkpoints


def enable_distributed_strategy(
        strategy="collective", *, collective_timeout: Optional[float] = None,
        replicate_below_bytes: Optional[int] = None,
        table_sizes: Optional[Mapping[str, Any]] = None,
        table_wise_fraction: Optional[float] = None):
    """Switches the library to model-parallel (collective) training.

    Initialises Horovod once (later calls are no-ops) and makes every
    embedding table created afterwards a shard on the workers: replicated
    below `replicate_below_bytes`, row-sharded above. With `table_sizes`,
    the planner (`ge.distributed.plan_placements`) decides per table
    between replicated, table-wise (the whole table on one worker) and
    row-sharded, and `get_embedding_table` and the feature columns' tables
    follow its plan by table name.
    Before `hvd.init()` it sets the Horovod variables of
    `horovod_settings` (`HOROVOD_CYCLE_TIME`: 20 ms with the peer-socket
    transport, 2 ms with Horovod's) that the environment does not set
    already.

    Collective timeout: Horovod waits forever for a worker that stays
    alive but never reaches a collective (deadlocked, waiting on input).
    With a timeout, a worker that has waited longer than it inside one of
    group_embedding's collectives (lookup all-to-alls, forward and
    backward; gradient allreduce; broadcasts; checkpoint barriers) stops
    every worker (exit status 124) with a message on stderr that names the
    stuck rank(s). Workers exchange heartbeats through horovodrun's
    rendezvous server, so the timeout needs `horovodrun` (Gloo); collectives
    built inside a TF1 graph, and your own `hvd.*` calls, are not watched.

    Args:
        strategy: "collective" (the only strategy): tables sharded over all
            Horovod workers, all-to-all exchange of ids and rows.
        collective_timeout: seconds a worker may wait inside one
            collective for the others; 0 disables the watchdog (and its
            two counter increments per collective). Default: the
            environment variable `GROUP_EMBEDDING_COLLECTIVE_TIMEOUT`, else
            300. Workers stop at most `collective_timeout` + 3 checks
            after the stall (a check every tenth of it, at most 10 s).
        replicate_below_bytes: tables with fewer bytes stay replicated
            (data parallel) unless their creation says otherwise. Default
            `REPLICATE_BELOW_BYTES` (256 KiB); 0 shards every table.
        table_sizes: table name -> bytes or (vocab_size, embedding_dim[,
            dtype]) of every table the program will create (feature
            columns: their variable-scope name, or `layer/feature` for
            `GroupEmbeddingFeatures`). Default None: no plan, the size rule
            above with row sharding. Given, `plan_placements(table_sizes,
            N, ...)` runs once here and tables created under a planned
            name take its placement (their size must match).
        table_wise_fraction: the planner's `table_wise_fraction`; default
            `sharding_plan.TABLE_WISE_FRACTION` (0.5). Needs
            `table_sizes`.

    Returns:
        The `horovod.tensorflow` module, initialised.

    Raises:
        ValueError: unknown `strategy`; a different strategy, timeout or
            placement setting was already enabled; a negative
            `collective_timeout` or a bad
            `GROUP_EMBEDDING_COLLECTIVE_TIMEOUT`; a bad planner argument;
            `table_wise_fraction` without `table_sizes`.
        TypeError: `collective_timeout` is not a number.
        ImportError: Horovod is not installed (with the install command).
    """
    if strategy not in state.SUPPORTED_STRATEGIES:
        raise ValueError(f"Invalid `strategy`: {strategy!r}, use one of "
                         f"{', '.join(state.SUPPORTED_STRATEGIES)}.")
    timeout = (None if collective_timeout is None
               else watchdog.resolve_timeout(collective_timeout))
    placement = (replicate_below_bytes, table_sizes, table_wise_fraction)
    if table_sizes is None and table_wise_fraction is not None:
        raise ValueError("`table_wise_fraction` needs `table_sizes`: the "
                         "planner only runs on declared tables.")
    # Bad placement arguments fail before Horovod starts (the real plan
    # needs N, known after hvd.init()).
    state.placement_settings(1, *placement)
    now = state.current()
    if now["strategy"] is not None:
        if now["strategy"] != strategy:
            raise ValueError(
                f"Distributed strategy {now['strategy']!r} is already "
                f"enabled; cannot switch to {strategy!r}.")
        if timeout is not None and timeout != now["timeout"]:
            raise ValueError(
                f"`collective_timeout` is already {now['timeout']:g} s; "
                f"cannot change it to {timeout:g} s.")
        if placement != (None, None, None) and (
                state.placement_settings(now["hvd"].size(), *placement)
                != now["placement"]):
            raise ValueError(
                "The placement settings (`replicate_below_bytes`, "
                "`table_sizes`, `table_wise_fraction`) are already set; "
                "cannot change them.")
        return now["hvd"]
    if timeout is None:
        timeout = watchdog.resolve_timeout(None)
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            "enable_distributed_strategy('collective') needs Horovod built "
            "with TensorFlow: run `bash scripts/build_horovod.sh`.") from e
    # Horovod settings for the transport the step will use (see
    # horovod_settings); the user's environment wins.
    horovod_settings.apply_defaults(transport.expects_sockets())
    # Taken before the start barrier (hvd.init returns on no worker before
    # every worker entered it): no checkpoint this job writes predates it.
    joined_ns = time.time_ns()
    hvd.init()
    # Planned before any collective: a bad argument fails on every worker.
    state.update(placement=state.placement_settings(hvd.size(), *placement),
                 hvd=hvd)
    state.update(collectives=_start_watchdog(hvd, timeout))
    # The step's exchanges go over peer sockets (no negotiation) unless
    # GROUP_EMBEDDING_TRANSPORT=horovod; see transport.py.
    transport.connect(hvd, timeout)
    # Each worker holds other rows: its TF1 Saver files go to its own
    # directory even when the script gives every worker the same one.
    worker_checkpoints.install(joined_ns)
    state.update(timeout=timeout, strategy=strategy)
    # The core's one door to this layer (see model_parallel).
    model_parallel.register(model_parallel.Runtime(
        rank=hvd.rank(), size=hvd.size(),
        pooled_lookup=collective_lookup.pooled_lookup,
        sequence_lookup=collective_lookup.sequence_lookup,
        collective_table=sharded_variable.collective_table))
    return hvd




def _start_watchdog(hvd, timeout):
    """Horovod with our collectives tracked, if a watchdog can run."""
    if timeout == 0 or hvd.size() == 1:
        return hvd
    store = watchdog.RendezvousStore.from_env()
    if store is None or not watchdog.can_track():
        warnings.warn(
            "group_embedding: no collective timeout - it needs horovodrun "
            "(Gloo rendezvous server) and eager TensorFlow; a stuck worker "
            "will hang the others.", RuntimeWarning)
        return hvd
    counters = watchdog.CollectiveCounters()
    watchdog.Watchdog(hvd.rank(), hvd.size(), timeout, counters,
                      store).start()
    return watchdog.TrackedHorovod(hvd, counters)
