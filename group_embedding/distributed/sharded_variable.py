"""Embedding tables that shard themselves in collective mode.

`get_embedding_table` returns a plain `tf.Variable` in a single process and
a `ShardedVariable` (this worker's rows only) once
`enable_distributed_strategy("collective")` has run, so one training script
serves both. Initial values are drawn per fixed chunk of global rows with a
seed derived from the table, so every row starts with the same value
whatever the number of workers: N-worker runs equal the single-process run.

Where a table lives (replicated, row-sharded, or whole on one worker) is
chosen per table: see `sharding_plan` and `get_embedding_table`'s
`placement`.
"""

import re
import zlib
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from group_embedding import model_parallel
from group_embedding.distributed import sharding_plan
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.ops import tf_variables

PARTITION_STRATEGIES = sharding_plan.ROW_PARTITIONS
# Rows per initialisation chunk: part of the initial values' definition
# (changing it changes the values), independent of the worker count.
INIT_CHUNK_ROWS = 8192


def _chunked_initial_rows(initializer, vocab_size, dim, dtype, seed,
                          global_rows: np.ndarray) -> np.ndarray:
    """Initial values of `global_rows` (sorted), chunk by chunk.

    Chunk c is drawn as one `[INIT_CHUNK_ROWS, dim]` block with seed
    `seed + c`; only the chunks holding wanted rows are drawn.
    """
    config = initializer.get_config()
    out = np.empty((len(global_rows), dim), dtype=dtype.as_numpy_dtype)
    chunks = global_rows // INIT_CHUNK_ROWS
    for c in np.unique(chunks):
        if "seed" in config:
            config["seed"] = seed + int(c)
            init = type(initializer).from_config(config)
        else:
            init = initializer
        # Eagerly, even while a TF1 graph is being built: the values are
        # needed as numbers to pick this worker's rows.
        with context.eager_mode():
            block = np.asarray(init(shape=(INIT_CHUNK_ROWS, dim),
                                    dtype=dtype))
        at = chunks == c
        out[at] = block[global_rows[at] - c * INIT_CHUNK_ROWS]
    return out


class ShardedVariable(tf.Module):
    """This worker's rows of a `[vocab_size, embedding_dim]` table.

    Rows are owned by `mod` (row r lives on worker r % N at local row
    r // N), `div` (contiguous blocks of ceil(V / N) rows) or
    `table:R` (the whole table on worker R at local row r; every other
    worker holds a `[0, D]` shard).

    Args:
        name: table name (also names the shard variable).
        vocab_size: V, rows of the whole table.
        embedding_dim: D.
        partition_strategy: "mod", "div" or "table:R" with R in [0, N).
        num_shards: N workers; shard_index: this worker's rank.
        initial_value: `[rows of this shard, D]` array (ignored when
            `variable` is given).
        trainable: whether the shard is trained.
        variable: (keyword only) an existing `[rows of this shard, D]`
            variable to use as the shard, e.g. one a Keras layer created
            with `add_weight` so that Keras tracks and trains it.

    Raises:
        ValueError: a bad `partition_strategy`, or a table-wise owner
            rank outside [0, N) (naming the table).
    """

    # What `lookup_plan` plans for it (no type probes below the plan).
    ge_table_kind = "sharded"

    def __init__(self, name, vocab_size, embedding_dim, partition_strategy,
                 num_shards, shard_index, initial_value=None, trainable=True,
                 *, variable=None):
        # tf.Module names must be identifiers; table names may hold "/".
        super().__init__(name=re.sub(r"\W|^(?=\d)", "_", name))
        sharding_plan.check_partition(name, partition_strategy, num_shards)
        self.table_name = name
        self.vocab_size = int(vocab_size)
        self.embedding_dim = int(embedding_dim)
        self.partition_strategy = partition_strategy
        self.num_shards = int(num_shards)
        self.shard_index = int(shard_index)
        if variable is None:
            variable = tf.Variable(initial_value, name=f"{name}_shard",
                                   trainable=trainable)
        self.shard = variable
        distributed_strategy.register_shard(variable)

    @property
    def shard_variable(self) -> tf.Variable:
        """The `tf.Variable` of the shard (unwrapping a keras.Variable)."""
        return tf_variables.to_tf_variable(self.shard)

    @property
    def shape(self) -> tf.TensorShape:
        """The logical (whole-table) shape `[V, D]`."""
        return tf.TensorShape([self.vocab_size, self.embedding_dim])

    @property
    def dtype(self):
        return self.shard.dtype

    @property
    def trainable(self):
        return self.shard.trainable

    @property
    def owner_rank(self) -> Optional[int]:
        """The worker holding the whole table (table-wise), else None."""
        return sharding_plan.table_owner(self.partition_strategy)

    @property
    def placement(self) -> str:
        """"table" (whole on `owner_rank`) or "row" (mod/div)."""
        return "row" if self.owner_rank is None else "table"

    def rows_per_shard(self) -> int:
        """Rows per block under `div` (the last block may be shorter)."""
        return -(-self.vocab_size // self.num_shards)

    def owner(self, ids: tf.Tensor) -> tf.Tensor:
        """Worker that owns each (global) id."""
        if self.owner_rank is not None:
            return tf.fill(tf.shape(ids), tf.cast(self.owner_rank, ids.dtype))
        if self.partition_strategy == "mod":
            return model_parallel.key_owner(ids, self.num_shards)
        return ids // self.rows_per_shard()

    def local_row(self, ids: tf.Tensor) -> tf.Tensor:
        """Row of each id inside its owner's shard."""
        if self.owner_rank is not None:
            return ids
        if self.partition_strategy == "mod":
            return ids // self.num_shards
        return ids - self.owner(ids) * self.rows_per_shard()

    def global_rows(self) -> np.ndarray:
        """Global ids of this shard's rows, in local order."""
        return shard_rows(self.vocab_size, self.partition_strategy,
                          self.num_shards, self.shard_index)


def shard_rows(vocab_size, partition_strategy, num_shards, shard_index):
    """Global row ids held by shard `shard_index`, in local-row order."""
    owner = sharding_plan.table_owner(partition_strategy)
    if owner is not None:
        count = vocab_size if shard_index == owner else 0
        return np.arange(count, dtype=np.int64)
    if partition_strategy == "mod":
        return np.arange(shard_index, vocab_size, num_shards, dtype=np.int64)
    per = -(-vocab_size // num_shards)
    return np.arange(shard_index * per,
                     min(vocab_size, (shard_index + 1) * per),
                     dtype=np.int64)


def resolve_partition(name, vocab_size, embedding_dim, dtype=tf.float32,
                      partition_strategy="mod", replicate=None,
                      placement=None) -> Optional[str]:
    """Where a new table lives: None (a full copy on every worker), or its
    shard layout "mod", "div" or "table:R".

    Precedence: an explicit `placement` (or `replicate`), then the plan of
    `enable_distributed_strategy(table_sizes=...)` for this name, then the
    size rule (`replicate_below_bytes`: replicated below, else row-sharded
    with `partition_strategy`). A single worker (or no collective mode)
    always gets None, after the arguments are checked.

    Args:
        name: table name (looked up in the plan; named in errors).
        vocab_size, embedding_dim, dtype: the whole table.
        partition_strategy: "mod" or "div", the row-sharded layout.
        replicate: True = placement "replicate", False = "row" (the
            pre-planner argument); None defers to `placement`.
        placement: None, "replicate", "row", "table" (whole, on the worker
            with the fewest table-wise bytes so far, unless the plan names
            one) or "table:R".

    Raises:
        ValueError: a bad `placement`, one contradicting `replicate`, a
            rank outside [0, N), or a planned size other than this table's.
    """
    sharding_plan.check_placement(name, placement)
    if replicate is not None and placement is not None and (
            bool(replicate) != (placement == "replicate")):
        raise ValueError(f"Table {name!r}: `replicate={replicate}` "
                         f"contradicts `placement={placement!r}`; pass one.")
    if placement is None and replicate is not None:
        placement = "replicate" if replicate else "row"
    rank, size = model_parallel.world()
    nbytes = vocab_size * embedding_dim * tf.as_dtype(dtype).size
    planned = distributed_strategy.planned_placement(name)
    if planned is not None and planned[1] != nbytes:
        raise ValueError(
            f"Table {name!r} was planned with {planned[1]} bytes "
            f"(`table_sizes` of enable_distributed_strategy) but is "
            f"created with {nbytes} ([{vocab_size}, {embedding_dim}] "
            f"{tf.as_dtype(dtype).name}).")
    if placement is None:
        if planned is not None:
            placement = planned[0]
        elif nbytes < distributed_strategy.replicate_below_bytes():
            placement = "replicate"
        else:
            placement = "row"
    if placement == "table":
        owner = None if planned is None else sharding_plan.table_owner(
            planned[0])
        if owner is None:
            owner = sharding_plan.least_loaded(
                distributed_strategy.table_wise_loads(size))
        placement = sharding_plan.table_partition(owner)
    owner = sharding_plan.table_owner(placement)
    if owner is not None:
        sharding_plan.check_partition(name, placement, size)
        distributed_strategy.table_wise_loads(size)[owner] += nbytes
    if size == 1 or placement == "replicate":
        return None
    return partition_strategy if placement == "row" else placement


def initial_rows(name, vocab_size, embedding_dim, rows, initializer=None,
                 dtype=tf.float32, seed=None) -> np.ndarray:
    """Initial values of the global `rows` of a table, the same whatever
    the number of workers (see `_chunked_initial_rows`).

    Args:
        name: table name; the default seed derives from it.
        vocab_size, embedding_dim: the whole table's shape.
        rows: sorted global row ids wanted.
        initializer: Keras initializer; default TruncatedNormal(1/sqrt(D)).
        dtype: value dtype.
        seed: base seed; default from `name`.
    """
    dtype = tf.as_dtype(dtype)
    if initializer is None:
        initializer = keras.initializers.TruncatedNormal(
            stddev=1.0 / np.sqrt(embedding_dim))
    initializer = keras.initializers.get(initializer)
    if seed is None:
        seed = zlib.crc32(name.encode()) % (2 ** 30)
    return _chunked_initial_rows(initializer, vocab_size, embedding_dim,
                                 dtype, seed, rows)


def collective_table(name, vocab_size, embedding_dim, initializer,
                     create_variable):
    """A table for collective mode built by a caller's variable factory.

    Feature columns use this so that Keras (`add_weight`) or TF1
    (`get_variable`) own the variable, while the values and the layout
    follow `get_embedding_table`: deterministic initial rows (the same at
    any worker count), and the placement of the strategy's plan for `name`
    or else the size rule (rows sharded `mod`).

    Args:
        name: table name (seeds the initial values).
        vocab_size, embedding_dim: the whole table's shape.
        initializer: Keras initializer of the values.
        create_variable: `f(initial_value: np.ndarray) -> variable`.

    Returns:
        A `ShardedVariable` around the created shard, or the created
        `[V, D]` variable when the table stays replicated.
    """
    rank, size = model_parallel.world()
    partition = resolve_partition(name, vocab_size, embedding_dim)
    rows = (np.arange(vocab_size, dtype=np.int64) if partition is None
            else shard_rows(vocab_size, partition, size, rank))
    variable = create_variable(initial_rows(
        name, vocab_size, embedding_dim, rows, initializer))
    if partition is None:
        return variable
    return ShardedVariable(name, vocab_size, embedding_dim, partition, size,
                           rank, variable=variable)


def get_embedding_table(name: str, vocab_size: int, embedding_dim: int,
                        initializer=None, partition_strategy: str = "mod",
                        dtype=tf.float32, trainable: bool = True, *,
                        seed: Optional[int] = None,
                        replicate: Optional[bool] = None,
                        placement: Optional[str] = None):
    """Creates an embedding table, sharded in collective mode.

    In collective mode with N > 1 workers a table is replicated (a full
    `tf.Variable` on every worker, trained data parallel), row-sharded
    (`partition_strategy`) or table-wise (whole on one worker, a `[0, D]`
    shard on the others). `placement` forces one; by default the plan of
    `enable_distributed_strategy(table_sizes=...)` decides for a planned
    name, else the size rule: replicated below `replicate_below_bytes`
    (256 KiB by default), row-sharded above. Every placement gives the
    same numbers as a single process.

    Args:
        name: table name; also seeds the default initial values.
        vocab_size: number of rows V (ids must lie in `[0, V)`).
        embedding_dim: row width D.
        initializer: Keras initializer (name, config or instance); default
            `TruncatedNormal(stddev=1/sqrt(D))` like `embedding_column`.
        partition_strategy: "mod" or "div": which worker owns a row.
        dtype: value dtype, default float32.
        trainable: whether the optimizer updates it.
        seed: (keyword only) seed of the initial values; default derived
            from `name`, so tables differ and runs repeat.
        replicate: (keyword only) True keeps a full copy on every worker
            (data parallel), False always row-shards; default None: see
            `placement`. Same as `placement="replicate"` / `"row"`.
        placement: (keyword only) "replicate"; "row" (sharded by
            `partition_strategy`); "table:R" (whole on worker R, 0 <= R <
            N); "table" (whole, on the worker the plan names, else the one
            with the fewest table-wise bytes created so far: create tables
            in the same order on every worker); default None: the plan,
            else the size rule.

    Returns:
        A `tf.Variable [V, D]` outside collective mode or when replicated,
        else a `ShardedVariable` holding this worker's rows.

    Raises:
        ValueError: bad `partition_strategy` or `placement`, sizes < 1,
            `replicate` contradicting `placement`, a rank outside [0, N),
            a size other than the plan's for this name.
        TypeError: `placement` is not a string.
    """
    if partition_strategy not in PARTITION_STRATEGIES:
        raise ValueError(f"Invalid `partition_strategy` for table {name!r}: "
                         f"{partition_strategy!r}, use one of "
                         f"{', '.join(PARTITION_STRATEGIES)}.")
    if vocab_size < 1 or embedding_dim < 1:
        raise ValueError(f"Table {name!r}: `vocab_size` and `embedding_dim` "
                         f"must be >= 1, got {vocab_size}, {embedding_dim}.")
    rank, size = model_parallel.world()
    partition = resolve_partition(name, vocab_size, embedding_dim, dtype,
                                  partition_strategy, replicate, placement)
    if partition is None:
        value = initial_rows(name, vocab_size, embedding_dim,
                             np.arange(vocab_size, dtype=np.int64),
                             initializer, dtype, seed)
        return tf.Variable(value, name=name, trainable=trainable)
    rows = shard_rows(vocab_size, partition, size, rank)
    value = initial_rows(name, vocab_size, embedding_dim, rows, initializer,
                         dtype, seed)
    return ShardedVariable(name, vocab_size, embedding_dim, partition, size,
                           rank, value, trainable)
