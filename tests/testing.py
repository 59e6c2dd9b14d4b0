"""Shared helpers of the group_embedding tests.

* `random_feature` / `random_case`: seeded random id batches (SparseTensor
  with shuffled indices or RaggedTensor; empty rows, duplicate ids,
  optional weights) and random tables.
* `stock_lookup`: the reference, stock `tf.nn.embedding_lookup_sparse` on
  row-major ids, padded to the batch size (stock returns only
  `max_row + 1` rows).
* `sequence_oracle`: a numpy loop building the unpooled `[B, T, D]` result.
* `to_dense` / `op_counts`: densify gradients, count op types of a graph.
* `second_tier_keys`: the keys an EV keeps in its second tier.
"""

import collections
import dataclasses
from typing import List
from typing import Optional
from typing import Sequence
from typing import Union

import keras
import numpy as np
import tensorflow as tf

KERNEL_MODES = ("custom", "tf")
COMBINERS = ("sum", "mean", "sqrtn")
RTOL = 1e-5
ATOL = 1e-5


def assert_close(got, want, rtol=RTOL, atol=ATOL):
    """`assert_allclose` on tensors, IndexedSlices or arrays."""
    np.testing.assert_allclose(to_dense(got), to_dense(want), rtol=rtol,
                               atol=atol)


def to_dense(x, shape=None):
    """Tensor / IndexedSlices / array -> numpy; None -> zeros of `shape`."""
    if x is None:
        return np.zeros(shape, np.float32)
    if isinstance(x, tf.IndexedSlices):
        x = tf.convert_to_tensor(x)
    if isinstance(x, (tf.Tensor, tf.Variable, keras.Variable)):
        return np.asarray(x.numpy())
    return np.asarray(x)


def op_counts(graph) -> collections.Counter:
    """Op type -> number of ops of that type in `graph`."""
    return collections.Counter(op.type for op in graph.get_operations())


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature's id batch: the numpy truth and the TF inputs built on it.

    Attributes:
        kind: "sparse" (SparseTensor `[B, width]`) or "ragged"
            (RaggedTensor `[B, None]`).
        rows: `rows[b]` holds the ids of row b (duplicates allowed).
        cols: `cols[b]` holds the column of each id of row b (distinct,
            sorted; `arange(len)` for ragged).
        weights: `weights[b]` float32 weights aligned with `rows[b]`, or
            None for an unweighted feature.
        width: dense_shape[1] of the SparseTensor; the padded length T of
            `is_sequence=True`.
        order: input position k holds row-major entry `order[k]`
            (SparseTensor indices are fed shuffled, ragged in row order).
        id_dtype: tf.int32 or tf.int64.
    """

    kind: str
    rows: List[np.ndarray]
    cols: List[np.ndarray]
    weights: Optional[List[np.ndarray]]
    width: int
    order: np.ndarray
    id_dtype: tf.DType

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def nnz(self) -> int:
        return int(sum(len(r) for r in self.rows))

    def _row_major(self, parts):
        return (np.concatenate(parts) if parts
                else np.zeros([0], np.int64))

    def flat_ids(self) -> np.ndarray:
        """Ids in input order."""
        return self._row_major(self.rows).astype(np.int64)[self.order]

    def flat_weights(self) -> np.ndarray:
        """Weights in input order (float32)."""
        assert self.weights is not None, "unweighted feature"
        w = self._row_major(self.weights).astype(np.float32)
        return w[self.order]

    def indices(self) -> np.ndarray:
        """`[nnz, 2]` SparseTensor indices in input order."""
        lens = [len(r) for r in self.rows]
        row = np.repeat(np.arange(self.batch_size), lens)
        col = self._row_major(self.cols)
        return np.stack([row, col], 1).astype(np.int64)[self.order]

    def row_splits(self) -> np.ndarray:
        lens = [len(r) for r in self.rows]
        return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

    def _wrap(self, values):
        if self.kind == "sparse":
            return tf.SparseTensor(self.indices(), values,
                                   [self.batch_size, self.width])
        splits_dtype = tf.int32 if self.id_dtype == tf.int32 else tf.int64
        return tf.RaggedTensor.from_row_splits(
            values, tf.constant(self.row_splits(), splits_dtype))

    def ids(self) -> Union[tf.SparseTensor, tf.RaggedTensor]:
        """The id batch as the lookup takes it."""
        return self._wrap(tf.constant(self.flat_ids(), self.id_dtype))

    def sp_weights(self, values=None):
        """The weights, same kind and layout as `ids()`, or None.

        Args:
            values: optional tensor of the weights in input order (e.g.
                read from a tf.Variable, so that a tape reaches it).
        """
        if values is None:
            if self.weights is None:
                return None
            values = tf.constant(self.flat_weights())
        return self._wrap(values)


def random_feature(rng: np.random.Generator, *, kind: str = "sparse",
                   batch_size: int = 5, vocab: int = 10, max_len: int = 4,
                   weighted: bool = False, id_dtype: tf.DType = tf.int64,
                   empty_prob: float = 0.3, trailing_empty: int = 0,
                   extra_width: Optional[int] = None,
                   shuffle: bool = True) -> Feature:
    """Draws a random id batch.

    Rows have 1..max_len ids in [0, vocab) (duplicates likely for small
    vocabularies); each row is empty with probability `empty_prob`, and the
    last `trailing_empty` rows always are. SparseTensor ids sit at distinct
    random columns of a row of width `max_len + extra_width`, and their
    indices are shuffled unless `shuffle=False`. Weights lie in [0.5, 2).
    """
    lens = rng.integers(1, max_len + 1, batch_size)
    lens[rng.random(batch_size) < empty_prob] = 0
    if trailing_empty:
        lens[batch_size - trailing_empty:] = 0
    if kind == "sparse":
        if extra_width is None:
            extra_width = int(rng.integers(0, 3))
        width = max_len + extra_width
        cols = [np.sort(rng.choice(width, n, replace=False)) for n in lens]
    elif kind == "ragged":
        width = int(lens.max()) if batch_size else 0
        cols = [np.arange(n) for n in lens]
    else:
        raise ValueError(f"unknown kind {kind!r}")
    rows = [rng.integers(0, vocab, n) for n in lens]
    weights = None
    if weighted:
        weights = [rng.uniform(0.5, 2.0, n).astype(np.float32)
                   for n in lens]
    nnz = int(lens.sum())
    order = (rng.permutation(nnz) if kind == "sparse" and shuffle
             else np.arange(nnz))
    return Feature(kind, rows, cols, weights, width, order, id_dtype)


def random_table(rng: np.random.Generator, vocab: int, dim: int,
                 name: str = "table", dtype=np.float32) -> tf.Variable:
    """A `[vocab, dim]` tf.Variable of standard normal values."""
    return tf.Variable(rng.normal(size=(vocab, dim)).astype(dtype),
                       name=name)


@dataclasses.dataclass
class LookupCase:
    """Tables, features and combiners of one grouped lookup."""

    tables: List[tf.Variable]
    features: List[Feature]
    combiners: List[str]

    @property
    def batch_size(self) -> int:
        return self.features[0].batch_size

    def sp_ids(self):
        return [f.ids() for f in self.features]

    def sp_weights(self, values=None):
        """Per feature weights (None entries for unweighted features).

        Args:
            values: optional list (one entry per feature, None allowed) of
                weight tensors in input order.
        """
        if values is None:
            values = [None] * len(self.features)
        weights = [f.sp_weights(v) for f, v in zip(self.features, values)]
        return None if all(w is None for w in weights) else weights

    def stock(self, sp_weights=None, max_norm=None) -> List[tf.Tensor]:
        """Stock per-table results for `sp_ids()` and `sp_weights`."""
        ids = self.sp_ids()
        if sp_weights is None:
            sp_weights = [None] * len(ids)
        return [stock_lookup(t, i, w, c, self.batch_size, max_norm)
                for t, i, w, c in zip(self.tables, ids, sp_weights,
                                      self.combiners)]


def random_case(seed: int, dims: Sequence[int], kinds: Sequence[str],
                combiners: Sequence[str], *,
                weighted: Union[bool, Sequence[bool]] = False,
                id_dtype: tf.DType = tf.int64,
                batch_size: Optional[int] = None,
                vocab: Optional[int] = None,
                max_len: Optional[int] = None,
                empty_prob: float = 0.3, trailing_empty: int = 0,
                table_dtype=np.float32) -> LookupCase:
    """Random tables and features for one lookup; shapes drawn from `seed`
    unless given."""
    rng = np.random.default_rng(seed)
    if batch_size is None:
        batch_size = int(rng.integers(1, 9))
    if isinstance(weighted, bool):
        weighted = [weighted] * len(dims)
    tables, features = [], []
    for i, (dim, kind, w) in enumerate(zip(dims, kinds, weighted)):
        v = int(rng.integers(3, 20)) if vocab is None else vocab
        n = int(rng.integers(1, 6)) if max_len is None else max_len
        tables.append(random_table(rng, v, dim, f"table{i}", table_dtype))
        features.append(random_feature(
            rng, kind=kind, batch_size=batch_size, vocab=v, max_len=n,
            weighted=w, id_dtype=id_dtype, empty_prob=empty_prob,
            trailing_empty=min(trailing_empty, batch_size)))
    return LookupCase(tables, features, list(combiners))


def _row_major_sparse(x):
    if isinstance(x, tf.RaggedTensor):
        return x.to_sparse()
    return tf.sparse.reorder(x)


def stock_lookup(table, sp_ids, sp_weights, combiner, batch_size,
                 max_norm=None) -> tf.Tensor:
    """Stock `tf.nn.embedding_lookup_sparse` padded to `batch_size` rows.

    Stock needs row-major indices (so they are reordered first) and returns
    only `max_row + 1` rows; the missing trailing rows are zeros.
    """
    if isinstance(table, keras.Variable):
        table = table.value
    dim = int(table.shape[1])
    ids = _row_major_sparse(sp_ids)
    weights = None if sp_weights is None else _row_major_sparse(sp_weights)
    if tf.compat.dimension_value(ids.values.shape[0]) == 0:
        return tf.zeros([batch_size, dim], table.dtype)
    out = tf.nn.embedding_lookup_sparse(table, ids, weights,
                                        combiner=combiner,
                                        max_norm=max_norm)
    missing = tf.cast(batch_size, tf.int32) - tf.shape(out)[0]
    return tf.pad(out, [[0, missing], [0, 0]])


def sequence_oracle(table: np.ndarray, feature: Feature,
                    weighted: bool = True) -> np.ndarray:
    """Unpooled `[B, T, D]` lookup: each id's row at its column, times its
    weight; zeros at padding. T is `feature.width`."""
    out = np.zeros([feature.batch_size, feature.width, table.shape[1]],
                   table.dtype)
    for b, (ids, cols) in enumerate(zip(feature.rows, feature.cols)):
        for j, (i, c) in enumerate(zip(ids, cols)):
            w = 1.0
            if weighted and feature.weights is not None:
                w = feature.weights[b][j]
            out[b, c] = table[i] * w
    return out


def second_tier_keys(ev) -> int:
    """Keys of EmbeddingVariable `ev` on disk (DRAM_SSDHASH, SSDHASH) or
    in host memory (HBM_DRAM); 0 for other EVs."""
    import group_embedding as ge
    from group_embedding.ops import ev_storage
    if ev.ge_table_kind == "hbm_ev":
        return int(ev.storage.tier_sizes(ev.handle).numpy()[1])
    if ev.ev_option.storage_option.storage_type == ge.StorageType.DRAM:
        return 0
    return int(ev_storage.tier_stats(ev.handle)[1])
