"""The one door between the lookup core and the distributed layer.

The core (lookups, their plan, feature columns, EmbeddingVariable) never
imports `group_embedding.distributed`: that package imports the core, and
`enable_distributed_strategy("collective")` registers a `Runtime` here.
The core asks `runtime()` (None in a single process) where it must know:
which groups are model parallel (`lookup_plan`), where a scoped feature
column's table lives (`feature_column`), and which keys a worker owns
(`EmbeddingVariable` restore).
"""

import dataclasses
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Tuple

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What collective mode lends the core.

    Attributes:
        rank: this worker's Horovod rank.
        size: the number of workers.
        pooled_lookup: `(group, call) -> [B, D] tensors` for one
            model-parallel `lookup_plan.TableGroup`.
        sequence_lookup: `(group, call) -> [B, T, D] tensors`, same.
        collective_table: `(name, vocab_size, dim, initializer, create)`
            -> the table of a feature column inside a group scope (a
            `ShardedVariable`, or the replicated variable `create(value)`
            makes); see `distributed.sharded_variable.collective_table`.
    """

    rank: int
    size: int
    pooled_lookup: Callable[..., Any]
    sequence_lookup: Callable[..., Any]
    collective_table: Callable[..., Any]


_registered: List[Runtime] = []


def register(runtime_: Runtime) -> None:
    """Installs `runtime_` (replacing any earlier one)."""
    _registered[:] = [runtime_]


def unregister() -> None:
    """Back to a single process (tests; a finished job)."""
    _registered.clear()


def runtime() -> Optional[Runtime]:
    """The registered runtime; None outside collective mode."""
    return _registered[0] if _registered else None


def world() -> Tuple[int, int]:
    """(rank, size) of this worker; (0, 1) outside collective mode."""
    r = runtime()
    return (0, 1) if r is None else (r.rank, r.size)


def key_owner(keys: Any, size: int) -> Any:
    """The worker that owns each EmbeddingVariable key: key mod N.

    The one owner rule: the collective lookup routes a key to this worker,
    the checkpoints restore it there, and an EV refuses other keys.

    Args:
        keys: integer keys, a numpy array (checkpoint files) or a tensor.
        size: N, the number of workers (> 0).

    Returns:
        The owner ranks, same type and shape as `keys`; floor modulo, so
        negative keys map into [0, N) too.
    """
    if isinstance(keys, np.ndarray):
        return np.mod(keys, size)
    return tf.math.floormod(keys, size)
