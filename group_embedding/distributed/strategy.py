"""The state of collective mode, and what the distributed layer asks of it.

`enable.enable_distributed_strategy("collective")` fills it. After
that call, tables created with `ge.get_embedding_table` (and the
feature columns' tables) are row-sharded over the Horovod workers, and the
grouped lookups exchange ids and rows with `alltoall`. Dense variables stay
data parallel: `ge.DistributedGradientTape` averages their gradients.

Launch with `horovodrun -np N python train.py`; each worker feeds its own
slice of the global batch.
"""

import weakref
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import keras

from group_embedding.distributed import sharding_plan
from group_embedding.ops import tf_variables

SUPPORTED_STRATEGIES = ("collective",)

# Default size rule: tables with fewer bytes stay replicated (see
# sharding_plan); `enable_distributed_strategy(replicate_below_bytes=...)`.
REPLICATE_BELOW_BYTES = sharding_plan.REPLICATE_BELOW_BYTES

# "collectives": `hvd`, or the `TrackedHorovod` that the watchdog reads.
# "placement": the sharding settings (see `placement_settings`).
_state: dict = {"strategy": None, "hvd": None, "collectives": None,
                "timeout": None, "placement": None}
# Shard variables, keyed by ref: their gradients are already complete on
# the owner and must not be allreduced.
_shard_refs: "weakref.WeakValueDictionary[Any, Any]" = (
    weakref.WeakValueDictionary())


def placement_settings(size, replicate_below_bytes, table_sizes,
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


def current() -> Dict[str, Any]:
    """The collective-mode state (read only): strategy, hvd, collectives,
    timeout, placement; set by `distributed.enable`."""
    return dict(_state)


def update(**fields) -> None:
    """Sets fields of the state (`distributed.enable` only)."""
    unknown = set(fields) - set(_state)
    if unknown:
        raise KeyError(f"unknown collective-mode state {sorted(unknown)}")
    _state.update(fields)


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


# Keras variables by id: Keras may swap the tf.Variable behind one after
# it was registered (deferred creation during a model's first call).
_keras_shards: "weakref.WeakValueDictionary[int, Any]" = (
    weakref.WeakValueDictionary())


def register_shard(variable):
    """Marks `variable` (tf.Variable or keras.Variable) as a model-parallel
    shard (see `is_shard`)."""
    if isinstance(variable, keras.Variable):
        _keras_shards[id(variable)] = variable
    variable = tf_variables.to_tf_variable(variable)
    _shard_refs[variable.ref()] = variable


def is_shard(variable) -> bool:
    """True for the local shard of a model-parallel table."""
    if isinstance(variable, keras.Variable) and \
            _keras_shards.get(id(variable)) is variable:
        return True
    variable = tf_variables.to_tf_variable(variable)
    ref = getattr(variable, "ref", None)
    return ref is not None and ref() in _shard_refs
