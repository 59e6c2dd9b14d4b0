"""`enable_distributed_strategy("collective")`: model-parallel embeddings.

After the call, tables created with `ge.get_embedding_table` (and the
feature columns' tables) are row-sharded over the Horovod workers, and the
grouped lookups exchange ids and rows with `alltoall`. Dense variables stay
data parallel: `ge.DistributedGradientTape` averages their gradients.

Launch with `horovodrun -np N python train.py`; each worker feeds its own
slice of the global batch.
"""

import weakref
from typing import Any

import keras

SUPPORTED_STRATEGIES = ("collective",)

# Tables with fewer bytes than this stay replicated (data parallel): for a
# few thousand rows the all-to-all round trip costs more than a local copy.
REPLICATE_BELOW_BYTES = 256 * 1024

_state: dict = {"strategy": None, "hvd": None}
# Shard variables, keyed by ref: their gradients are already complete on
# the owner and must not be allreduced.
_shard_refs: "weakref.WeakValueDictionary[Any, Any]" = (
    weakref.WeakValueDictionary())


def enable_distributed_strategy(strategy="collective"):
    """Switches the library to model-parallel (collective) training.

    Initialises Horovod once (later calls are no-ops) and makes every
    embedding table created afterwards a row shard owned by this worker.

    Args:
        strategy: "collective" (the only strategy): tables sharded over all
            Horovod workers, all-to-all exchange of ids and rows.

    Returns:
        The `horovod.tensorflow` module, initialised.

    Raises:
        ValueError: unknown `strategy`, or a different strategy was already
            enabled.
        ImportError: Horovod is not installed (with the install command).
    """
    if strategy not in SUPPORTED_STRATEGIES:
        raise ValueError(f"Invalid `strategy`: {strategy!r}, use one of "
                         f"{', '.join(SUPPORTED_STRATEGIES)}.")
    if _state["strategy"] is not None:
        if _state["strategy"] != strategy:
            raise ValueError(
                f"Distributed strategy {_state['strategy']!r} is already "
                f"enabled; cannot switch to {strategy!r}.")
        return _state["hvd"]
    try:
        import horovod.tensorflow as hvd
    except ImportError as e:
        raise ImportError(
            "enable_distributed_strategy('collective') needs Horovod built "
            "with TensorFlow: run `bash scripts/build_horovod.sh`.") from e
    hvd.init()
    _state["hvd"] = hvd
    _state["strategy"] = strategy
    return hvd


def is_collective() -> bool:
    """True once `enable_distributed_strategy("collective")` has run."""
    return _state["strategy"] == "collective"


def horovod():
    """The initialised `horovod.tensorflow` module.

    Raises:
        RuntimeError: collective mode is not enabled.
    """
    if not is_collective():
        raise RuntimeError(
            "Collective mode is not enabled: call "
            "ge.enable_distributed_strategy('collective') first.")
    return _state["hvd"]


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
