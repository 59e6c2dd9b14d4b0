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
from typing import Any, Optional

import keras

from group_embedding.distributed import horovod_settings
from group_embedding.distributed import transport
from group_embedding.distributed import watchdog

SUPPORTED_STRATEGIES = ("collective",)

# Tables with fewer bytes than this stay replicated (data parallel): for a
# few thousand rows the all-to-all round trip costs more than a local copy.
REPLICATE_BELOW_BYTES = 256 * 1024

# "collectives": `hvd`, or the `TrackedHorovod` that the watchdog reads.
_state: dict = {"strategy": None, "hvd": None, "collectives": None,
                "timeout": None}
# Shard variables, keyed by ref: their gradients are already complete on
# the owner and must not be allreduced.
_shard_refs: "weakref.WeakValueDictionary[Any, Any]" = (
    weakref.WeakValueDictionary())


def enable_distributed_strategy(strategy="collective", *,
                                collective_timeout: Optional[float] = None):
    """Switches the library to model-parallel (collective) training.

    Initialises Horovod once (later calls are no-ops) and makes every
    embedding table created afterwards a row shard owned by this worker.
    Before `hvd.init()` it sets the Horovod variables of
    `horovod_settings.DEFAULTS` (`HOROVOD_CYCLE_TIME`) that the
    environment does not set already.

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

    Returns:
        The `horovod.tensorflow` module, initialised.

    Raises:
        ValueError: unknown `strategy`; a different strategy or timeout was
            already enabled; a negative `collective_timeout` or a bad
            `GROUP_EMBEDDING_COLLECTIVE_TIMEOUT`.
        TypeError: `collective_timeout` is not a number.
        ImportError: Horovod is not installed (with the install command).
    """
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(f"Invalid `strategy`: {strategy!r}, use one of "
                         f"{', '.join(SUPPORTED_STRATEGIES)}.")
    timeout = (None if collective_timeout is None
               else watchdog.resolve_timeout(collective_timeout))
    if _state["strategy"] is not None:
        if _state["strategy"] != strategy:
            raise ValueError(
                f"Distributed strategy {_state['strategy']!r} is already "
                f"enabled; cannot switch to {strategy!r}.")
        if timeout is not None and timeout != _state["timeout"]:
            raise ValueError(
                f"`collective_timeout` is already {_state['timeout']:g} s; "
                f"cannot change it to {timeout:g} s.")
        return _state["hvd"]
    if timeout is None:
        timeout = watchdog.resolve_timeout(None)
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            "enable_distributed_strategy('collective') needs Horovod built "
            "with TensorFlow: run `bash scripts/build_horovod.sh`.") from e
    # Latency settings for our chain of small collectives (see
    # horovod_settings); the user's environment wins.
    horovod_settings.apply_defaults()
    hvd.init()
    _state["hvd"] = hvd
    _state["collectives"] = _start_watchdog(hvd, timeout)
    # The step's exchanges go over peer sockets (no negotiation) unless
    # GROUP_EMBEDDING_TRANSPORT=horovod; see transport.py.
    transport.connect(hvd, timeout)
    _state["timeout"] = timeout
    _state["strategy"] = strategy
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
