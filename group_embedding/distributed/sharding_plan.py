"""Where each embedding table lives in collective mode.

Three placements, written as the table's `partition_strategy` string so
that the router, the lookups and the checkpoints read one field:

- replicated: a full copy on every worker, trained data parallel (its
  gradient is allreduced). Small tables: a local copy costs less than the
  all-to-all round trip.
- row-sharded, "mod" or "div": every worker owns ~1/N of the rows.
- table-wise, "table:R": worker R holds the whole table, the others a
  zero-row shard; all its ids go to one peer. For mid-size tables: fewer
  peers per exchange, and no table is split into tiny slices.

`plan_placements` is the planner: a pure function of the tables' byte
sizes and the worker count, so every worker computes the same plan without
communicating.
"""

import re
from typing import Dict
from typing import List
from typing import Mapping
from typing import Optional
from typing import Tuple
from typing import Union

import numpy as np
import tensorflow as tf

# Default of `replicate_below_bytes`: tables with fewer bytes stay
# replicated; for a few thousand rows the all-to-all round trip costs
# more than a local copy.
REPLICATE_BELOW_BYTES = 256 * 1024
# Default of `table_wise_fraction`: a sharded table up to this fraction of
# one worker's fair share (sharded bytes / N) is placed whole.
TABLE_WISE_FRACTION = 0.5
# Values of `get_embedding_table(placement=...)` besides "table:<rank>".
SUPPORTED_PLACEMENTS = ("replicate", "row", "table")
ROW_PARTITIONS = ("mod", "div")
_TABLE_PREFIX = "table:"
_TABLE_RE = re.compile(r"table:(\d{1,9})")

# A table's size: bytes, or (vocab_size, embedding_dim[, dtype]).
TableSize = Union[int, Tuple[int, int], Tuple[int, int, object]]


def table_partition(rank: int) -> str:
    """The `partition_strategy` string of a table placed on `rank`."""
    return f"{_TABLE_PREFIX}{int(rank)}"


def table_owner(partition_strategy: str) -> Optional[int]:
    """The owner rank of a table-wise partition string; None for mod/div.

    Does not check the rank against a worker count (see
    `check_partition`).
    """
    match = _TABLE_RE.fullmatch(partition_strategy)
    return None if match is None else int(match.group(1))


def check_partition(name: str, partition_strategy: str,
                    num_workers: int) -> None:
    """Validates the layout of a sharded table.

    Raises:
        ValueError: not "mod", "div" or "table:<rank>" with a rank in
            `[0, num_workers)`; the message names the table.
    """
    if partition_strategy in ROW_PARTITIONS:
        return
    owner = table_owner(partition_strategy)
    if owner is None:
        raise ValueError(
            f"Invalid `partition_strategy` for table {name!r}: "
            f"{partition_strategy!r}, use one of "
            f"{', '.join(ROW_PARTITIONS)} or 'table:<rank>'.")
    if owner >= num_workers:
        raise ValueError(
            f"Table {name!r}: `placement` {partition_strategy!r} names "
            f"rank {owner}, but there are {num_workers} workers (ranks "
            f"0..{num_workers - 1}).")


def check_placement(name: str, placement: Optional[str]) -> None:
    """Validates a `placement` argument (the rank is checked later, once
    the worker count is known).

    Raises:
        TypeError: `placement` is not a string or None.
        ValueError: not one of `SUPPORTED_PLACEMENTS` or "table:<rank>".
    """
    if placement is None:
        return
    if not isinstance(placement, str):
        raise TypeError(f"Table {name!r}: `placement` must be a string or "
                        f"None, got {type(placement).__name__}.")
    if placement in SUPPORTED_PLACEMENTS or table_owner(placement) is not None:
        return
    raise ValueError(
        f"Invalid `placement` for table {name!r}: {placement!r}, use one "
        f"of {', '.join(SUPPORTED_PLACEMENTS)} or 'table:<rank>'.")


def table_bytes(size: TableSize, name: str = "?") -> int:
    """Bytes of a table given as bytes or (vocab_size, embedding_dim[,
    dtype]) (dtype default float32).

    Raises:
        ValueError: a negative or malformed size; names the table.
    """
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        nbytes = int(size)
    elif isinstance(size, (tuple, list)) and len(size) in (2, 3):
        dtype = tf.as_dtype(size[2] if len(size) == 3 else tf.float32)
        nbytes = int(size[0]) * int(size[1]) * dtype.size
    else:
        raise ValueError(
            f"Table {name!r}: a size must be bytes or (vocab_size, "
            f"embedding_dim[, dtype]), got {size!r}.")
    if nbytes < 0:
        raise ValueError(f"Table {name!r}: size {nbytes} bytes is "
                         "negative.")
    return nbytes


def least_loaded(loads: List[int]) -> int:
    """The worker with the fewest bytes; the lowest rank on a tie."""
    return int(np.argmin(loads))


def plan_placements(table_sizes: Mapping[str, TableSize], num_workers: int,
                    *, replicate_below_bytes: int = REPLICATE_BELOW_BYTES,
                    table_wise_fraction: float = TABLE_WISE_FRACTION
                    ) -> Dict[str, str]:
    """Chooses replicated, table-wise or row-sharded placement per table.

    The rule, in order:

    1. a table of fewer than `replicate_below_bytes` bytes is replicated;
    2. of the others (the sharded tables, S bytes in all), a table of at
       most `table_wise_fraction * S / N` bytes is placed whole on one
       worker. These tables are placed largest first (ties: by name), each
       on the worker holding the fewest table-wise bytes so far (ties: the
       lowest rank), which balances the bytes per worker;
    3. the rest are row-sharded.

    With N = 1 every table stays whole (the lookup is then local anyway).
    A pure function of its arguments: every worker computes the same plan.

    Example::

        plan_placements({"ads": 10 << 20, "users": 400 << 20,
                         "site": 4 << 10, "city": (50_000, 16)}, 4)
        # {"ads": "table:0", "users": "row", "site": "replicate",
        #  "city": "table:1"}
        # S = 413.05 MiB, N = 4: whole tables up to 51.6 MiB.

    Args:
        table_sizes: table name -> bytes, or (vocab_size, embedding_dim[,
            dtype]) with dtype default float32.
        num_workers: N >= 1.
        replicate_below_bytes: (keyword only) replicate tables smaller than
            this; default `REPLICATE_BELOW_BYTES` (256 KiB); 0 replicates
            none.
        table_wise_fraction: (keyword only) in [0, 1]; default 0.5. 0
            places no table whole (step 2 off); 1 places whole every table
            up to one worker's fair share.

    Returns:
        name -> "replicate", "row" (row-sharded with the table's
        `partition_strategy`) or "table:<rank>".

    Raises:
        ValueError: `num_workers` < 1, a negative `replicate_below_bytes`,
            `table_wise_fraction` outside [0, 1], or a malformed size
            (naming the table).
    """
    if int(num_workers) < 1:
        raise ValueError(f"`num_workers` must be >= 1, got {num_workers}.")
    if replicate_below_bytes < 0:
        raise ValueError("`replicate_below_bytes` must be >= 0, got "
                         f"{replicate_below_bytes}.")
    if not 0.0 <= table_wise_fraction <= 1.0:
        raise ValueError("`table_wise_fraction` must be in [0, 1], got "
                         f"{table_wise_fraction}.")
    n = int(num_workers)
    sizes = {name: table_bytes(s, name) for name, s in table_sizes.items()}
    plan = {name: "replicate" for name, b in sizes.items()
            if b < replicate_below_bytes}
    sharded = {name: b for name, b in sizes.items() if name not in plan}
    limit = table_wise_fraction * sum(sharded.values()) / n
    loads = [0] * n
    for name in sorted(sharded, key=lambda t: (-sharded[t], t)):
        if n == 1 or sharded[name] <= limit:
            rank = least_loaded(loads)
            loads[rank] += sharded[name]
            plan[name] = table_partition(rank)
        else:
            plan[name] = "row"
    return {name: plan[name] for name in table_sizes}
