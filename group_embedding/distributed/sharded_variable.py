"""Embedding tables that shard themselves in collective mode.

`get_embedding_table` returns a plain `tf.Variable` in a single process and
a `ShardedVariable` (this worker's rows only) once
`enable_distributed_strategy("collective")` has run, so one training script
serves both. Initial values are drawn per fixed chunk of global rows with a
seed derived from the table, so every row starts with the same value
whatever the number of workers: N-worker runs equal the single-process run.
"""

import re
import zlib
from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

from group_embedding.distributed import strategy as distributed_strategy

PARTITION_STRATEGIES = ("mod", "div")
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
    r // N) or `div` (contiguous blocks of ceil(V / N) rows).

    Args:
        name: table name (also names the shard variable).
        vocab_size: V, rows of the whole table.
        embedding_dim: D.
        partition_strategy: "mod" or "div".
        num_shards: N workers; shard_index: this worker's rank.
        initial_value: `[rows of this shard, D]` array (ignored when
            `variable` is given).
        trainable: whether the shard is trained.
        variable: (keyword only) an existing `[rows of this shard, D]`
            variable to use as the shard, e.g. one a Keras layer created
            with `add_weight` so that Keras tracks and trains it.
    """

    def __init__(self, name, vocab_size, embedding_dim, partition_strategy,
                 num_shards, shard_index, initial_value=None, trainable=True,
                 *, variable=None):
        # tf.Module names must be identifiers; table names may hold "/".
        super().__init__(name=re.sub(r"\W|^(?=\d)", "_", name))
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
        if isinstance(self.shard, keras.Variable):
            return self.shard.value
        return self.shard

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

    def rows_per_shard(self) -> int:
        """Rows per block under `div` (the last block may be shorter)."""
        return -(-self.vocab_size // self.num_shards)

    def owner(self, ids: tf.Tensor) -> tf.Tensor:
        """Worker that owns each (global) id."""
        if self.partition_strategy == "mod":
            return ids % self.num_shards
        return ids // self.rows_per_shard()

    def local_row(self, ids: tf.Tensor) -> tf.Tensor:
        """Row of each id inside its owner's shard."""
        if self.partition_strategy == "mod":
            return ids // self.num_shards
        return ids - self.owner(ids) * self.rows_per_shard()

    def global_rows(self) -> np.ndarray:
        """Global ids of this shard's rows, in local order."""
        return shard_rows(self.vocab_size, self.partition_strategy,
                          self.num_shards, self.shard_index)


def shard_rows(vocab_size, partition_strategy, num_shards, shard_index):
    """Global row ids held by shard `shard_index`, in local-row order."""
    if partition_strategy == "mod":
        return np.arange(shard_index, vocab_size, num_shards, dtype=np.int64)
    per = -(-vocab_size // num_shards)
    return np.arange(shard_index * per,
                     min(vocab_size, (shard_index + 1) * per),
                     dtype=np.int64)


def is_sharded_here(vocab_size, embedding_dim, dtype=tf.float32,
                    replicate=None) -> bool:
    """Whether a new table of this size is sharded (collective mode,
    N > 1, and not replicated by `replicate` or the size rule)."""
    _, size = distributed_strategy.world()
    if replicate is None:
        nbytes = vocab_size * embedding_dim * tf.as_dtype(dtype).size
        replicate = nbytes < distributed_strategy.REPLICATE_BELOW_BYTES
    return size > 1 and not replicate


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
    any worker count) and a `mod` shard when the size rule says so.

    Args:
        name: table name (seeds the initial values).
        vocab_size, embedding_dim: the whole table's shape.
        initializer: Keras initializer of the values.
        create_variable: `f(initial_value: np.ndarray) -> variable`.

    Returns:
        A `ShardedVariable` around the created shard, or the created
        `[V, D]` variable when the table stays replicated.
    """
    rank, size = distributed_strategy.world()
    sharded = is_sharded_here(vocab_size, embedding_dim)
    rows = (shard_rows(vocab_size, "mod", size, rank) if sharded
            else np.arange(vocab_size, dtype=np.int64))
    variable = create_variable(initial_rows(
        name, vocab_size, embedding_dim, rows, initializer))
    if not sharded:
        return variable
    return ShardedVariable(name, vocab_size, embedding_dim, "mod", size,
                           rank, variable=variable)


def get_embedding_table(name: str, vocab_size: int, embedding_dim: int,
                        initializer=None, partition_strategy: str = "mod",
                        dtype=tf.float32, trainable: bool = True, *,
                        seed: Optional[int] = None,
                        replicate: Optional[bool] = None):
    """Creates an embedding table, sharded in collective mode.

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
            (data parallel), False always shards; default: replicate when
            smaller than `REPLICATE_BELOW_BYTES`.

    Returns:
        A `tf.Variable [V, D]` outside collective mode or when replicated,
        else a `ShardedVariable` holding this worker's rows.

    Raises:
        ValueError: bad `partition_strategy`, sizes < 1.
    """
    if partition_strategy not in PARTITION_STRATEGIES:
        raise ValueError(f"Invalid `partition_strategy` for table {name!r}: "
                         f"{partition_strategy!r}, use one of "
                         f"{', '.join(PARTITION_STRATEGIES)}.")
    if vocab_size < 1 or embedding_dim < 1:
        raise ValueError(f"Table {name!r}: `vocab_size` and `embedding_dim` "
                         f"must be >= 1, got {vocab_size}, {embedding_dim}.")
    rank, size = distributed_strategy.world()
    if not is_sharded_here(vocab_size, embedding_dim, dtype, replicate):
        value = initial_rows(name, vocab_size, embedding_dim,
                             np.arange(vocab_size, dtype=np.int64),
                             initializer, dtype, seed)
        return tf.Variable(value, name=name, trainable=trainable)
    rows = shard_rows(vocab_size, partition_strategy, size, rank)
    value = initial_rows(name, vocab_size, embedding_dim, rows, initializer,
                         dtype, seed)
    return ShardedVariable(name, vocab_size, embedding_dim,
                           partition_strategy, size, rank, value, trainable)
