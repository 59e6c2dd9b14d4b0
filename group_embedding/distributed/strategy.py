"""`enable_distributed_strategy("collective")`: model-parallel embeddings.

After the call, tables created with `ge.get_embedding_table` (and the
feature columns' tables) are row-sharded over the Horovod workers, and the
grouped lookups exchange ids and rows with `alltoall`. Dense variables stay
data parallel: `ge.DistributedGradientTape` averages their gradients.

Launch with `horovodrun -np N python train.py`; each worker feeds its own
slice of the global batch.
"""

import warnings
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

import keras

from group_embedding.distributed import horovod_settings
from group_embedding.distributed import sharding_plan
from group_embedding.distributed import transport
from group_embedding.distributed import watchdog
from group_embedding.distributed import worker_checkpoints

SUPPORTED_STRATEGIES = ("collective",)

# Default size rule: tables with fewer bytes stay replicated (see
# sharding_plan); `enable_distributed_strategy(replicate_below_bytes=...)`.
REPLICATE_BELOW_BYTES = sharding_plan.REPLICATE_BELOW_BYTES

# "collectives": `hvd`, or the `TrackedHorovod` that the watchdog reads.
# "placement": the sharding settings (see `_placement_settings`).
_state: dict = {"strategy": None, "hvd": None, "collectives": None,
                "timeout": None, "placement": None}
# Shard variables, keyed by ref: their gradients are already complete on
# the owner and must not be allreduced.
_shard_refs: "weakref.WeakValueDictionary[Any, Any]" = (
    weakref.WeakValueDictionary())


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
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(f"Invalid `strategy`: {strategy!r}, use one of "
                         f"{', '.join(SUPPORTED_STRATEGIES)}.")
    timeout = (None if collective_timeout is None
               else watchdog.resolve_timeout(collective_timeout))
    placement = (replicate_below_bytes, table_sizes, table_wise_fraction)
    if table_sizes is None and table_wise_fraction is not None:
        raise ValueError("`table_wise_fraction` needs `table_sizes`: the "
                         "planner only runs on declared tables.")
    # Bad placement arguments fail before Horovod starts (the real plan
    # needs N, known after hvd.init()).
    _placement_settings(1, *placement)
    if _state["strategy"] is not None:
        if _state["strategy"] != strategy:
            raise ValueError(
                f"Distributed strategy {_state['strategy']!r} is already "
                f"enabled; cannot switch to {strategy!r}.")
        if timeout is not None and timeout != _state["timeout"]:
            raise ValueError(
                f"`collective_timeout` is already {_state['timeout']:g} s; "
                f"cannot change it to {timeout:g} s.")
        if placement != (None, None, None) and (
                _placement_settings(_state["hvd"].size(), *placement)
                != _state["placement"]):
            raise ValueError(
                "The placement settings (`replicate_below_bytes`, "
                "`table_sizes`, `table_wise_fraction`) are already set; "
                "cannot change them.")
        return _state["hvd"]
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
    hvd.init()
    # Planned before any collective: a bad argument fails on every worker.
    _state["placement"] = _placement_settings(hvd.size(), *placement)
    _state["hvd"] = hvd
    _state["collectives"] = _start_watchdog(hvd, timeout)
    # The step's exchanges go over peer sockets (no negotiation) unless
    # GROUP_EMBEDDING_TRANSPORT=horovod; see transport.py.
    transport.connect(hvd, timeout)
    # Each worker holds other rows: its TF1 Saver files go to its own
    # directory even when the script gives every worker the same one.
    worker_checkpoints.install()
    _state["timeout"] = timeout
    _state["strategy"] = strategy
    return hvd


def _placement_settings(size, replicate_below_bytes, table_sizes,
                        table_wise_fraction) -> Dict[str, Any]:
    """The sharding settings: the size rule, and the plan by table name
    (name -> (placement, bytes)) when `table_sizes` is given."""
    below = (sharding_plan.REPLICATE_BELOW_BYTES
             if replicate_below_bytes is None else int(replicate_below_bytes))
    if below < 0:
        raise ValueError("`replicate_below_bytes` must be >= 0, got "
                         f"{below}.")
    plan: Dict[str, Tuple[str, int]] = {}
    if table_sizes is not None:
        fraction = (sharding_plan.TABLE_WISE_FRACTION
                    if table_wise_fraction is None else table_wise_fraction)
        placements = sharding_plan.plan_placements(
            table_sizes, size, replicate_below_bytes=below,
            table_wise_fraction=fraction)
        plan = {name: (p, sharding_plan.table_bytes(table_sizes[name], name))
                for name, p in placements.items()}
    return {"replicate_below_bytes": below, "plan": plan}


def replicate_below_bytes() -> int:
    """Tables with fewer bytes stay replicated (the size rule)."""
    settings = _state["placement"]
    if settings is None:
        return sharding_plan.REPLICATE_BELOW_BYTES
    return settings["replicate_below_bytes"]


def planned_placement(name: str) -> Optional[Tuple[str, int]]:
    """(placement, bytes) the plan of `enable_distributed_strategy(
    table_sizes=...)` gives table `name`, or None if it has none."""
    settings = _state["placement"]
    return None if settings is None else settings["plan"].get(name)


# Bytes of the table-wise tables created so far, per worker: placement
# "table" without a rank picks the least loaded. Every worker creates its
# tables in the same order, so every worker picks the same rank.
_table_loads: List[int] = []


def table_wise_loads(size: int) -> List[int]:
    """The (mutable) per-worker bytes of table-wise tables created so far
    in this process, for `size` workers."""
    if len(_table_loads) != size:
        _table_loads[:] = [0] * size
    return _table_loads


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


def is_collective() -> bool:
    """True once `enable_distributed_strategy("collective")` has run."""
    return _state["strategy"] == "collective"


def horovod():
    """The initialised `horovod.tensorflow` module, for group_embedding's
    own collectives: they are counted for the collective timeout.

    Raises:
        RuntimeError: collective mode is not enabled.
    """
    if not is_collective():
        raise RuntimeError(
            "Collective mode is not enabled: call "
            "ge.enable_distributed_strategy('collective') first.")
    return _state["collectives"]


def world():
    """(rank, size) of this worker; (0, 1) outside collective mode."""
    if not is_collective():
        return 0, 1
    hvd = _state["hvd"]
    return hvd.rank(), hvd.size()


# Keras variables by id: Keras may swap the tf.Variable behind one after
# it was registered (deferred creation during a model's first call).
_keras_shards: "weakref.WeakValueDictionary[int, Any]" = (
    weakref.WeakValueDictionary())


def register_shard(variable):
    """Marks `variable` (tf.Variable or keras.Variable) as a model-parallel
    shard (see `is_shard`)."""
    if isinstance(variable, keras.Variable):
        _keras_shards[id(variable)] = variable
        variable = variable.value
    _shard_refs[variable.ref()] = variable


def is_shard(variable) -> bool:
    """True for the local shard of a model-parallel table."""
    if isinstance(variable, keras.Variable):
        if _keras_shards.get(id(variable)) is variable:
            return True
        variable = variable.value
    ref = getattr(variable, "ref", None)
    return ref is not None and ref() in _shard_refs
