"""Embedding tables that shard themselves in collective mode.

`get_embedding_table` returns a plain `tf.Variable` in a single process and
a `ShardedVariable` (this worker's rows only) once
`enable_distributed_strategy("collective")` has run, so one training script
serves both. Initial values are drawn per fixed chunk of global rows with a
seed derived from the table, so every row starts with the same value
whatever the number of workers: N-worker runs equal the single-process run.
"""

import zlib
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from group_embedding import distributed_strategy

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
        block = np.asarray(init(shape=(INIT_CHUNK_ROWS, dim), dtype=dtype))
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
        initial_value: `[rows of this shard, D]` array.
        trainable: whether the shard is trained.
    """

    def __init__(self, name, vocab_size, embedding_dim, partition_strategy,
                 num_shards, shard_index, initial_value, trainable=True):
        super().__init__(name=name)
        self.vocab_size = int(vocab_size)
        self.embedding_dim = int(embedding_dim)
        self.partition_strategy = partition_strategy
        self.num_shards = int(num_shards)
        self.shard_index = int(shard_index)
        self.shard = tf.Variable(initial_value, name=f"{name}_shard",
                                 trainable=trainable)
        distributed_strategy.register_shard(self.shard)

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
    dtype = tf.as_dtype(dtype)
    if initializer is None:
        initializer = keras.initializers.TruncatedNormal(
            stddev=1.0 / np.sqrt(embedding_dim))
    initializer = keras.initializers.get(initializer)
    if seed is None:
        seed = zlib.crc32(name.encode()) % (2 ** 30)
    rank, size = distributed_strategy.world()
    if replicate is None:
        nbytes = vocab_size * embedding_dim * dtype.size
        replicate = nbytes < distributed_strategy.REPLICATE_BELOW_BYTES
    if size == 1 or replicate:
        rows = np.arange(vocab_size, dtype=np.int64)
        value = _chunked_initial_rows(initializer, vocab_size, embedding_dim,
                                      dtype, seed, rows)
        return tf.Variable(value, name=name, trainable=trainable)
    rows = shard_rows(vocab_size, partition_strategy, size, rank)
    value = _chunked_initial_rows(initializer, vocab_size, embedding_dim,
                                  dtype, seed, rows)
    return ShardedVariable(name, vocab_size, embedding_dim,
                           partition_strategy, size, rank, value, trainable)
