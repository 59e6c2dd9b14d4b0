"""DeepRec feature columns: the EV-backed categorical column and the
embedding columns that `input_layer` looks up in groups.

All columns are frozen dataclasses (immutable, hashable value objects, like
the namedtuples of TF's `feature_column_v2.py`); each round-trips through
`get_config()` / `from_config()`. They hold no state: tables are created by
`input_layer` (TF1 graphs, `tf.compat.v1.get_variable`) or by the Keras
layer `GroupEmbeddingFeatures` (`add_weight`).
"""

import dataclasses
import math
import numbers
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

import keras
import tensorflow as tf
from tensorflow.python.feature_column import feature_column_v2 as fc_v2
from tensorflow.python.feature_column import serialization

from group_embedding.embedding_variable.options import EmbeddingVariableOption
from group_embedding.feature_column import scope as scope_lib
from group_embedding.lookup_inputs import SUPPORTED_COMBINERS

# Stock categorical columns whose ids an embedding column can look up.
SUPPORTED_STOCK_COLUMNS = (
    fc_v2.IdentityCategoricalColumn,
    fc_v2.HashedCategoricalColumn,
    fc_v2.VocabularyListCategoricalColumn,
    fc_v2.VocabularyFileCategoricalColumn,
)
SUPPORTED_EV_DTYPES = (tf.string, tf.int64, tf.int32)


def _is_positive_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) \
        and int(x) >= 1


@dataclasses.dataclass(frozen=True)
class EmbeddingCategoricalColumn:
    """Categorical ids backed by an `EmbeddingVariable` (no vocabulary).

    Build it with `categorical_column_with_embedding`. String ids are
    hashed to int64 keys with a 64-bit fingerprint
    (`tf.strings.to_hash_bucket_fast(x, 2**63 - 1)`); integer ids are used
    as keys directly, negative ones included. In dense inputs the default
    value (`""` or -1) means "missing", as for stock columns.

    Args:
        key: feature key in the `features` dict.
        dtype: tf.string (default), tf.int64 or tf.int32.
        partition_num: None or 1; sharding is done by
            `ge.enable_distributed_strategy`, not per column.
        ev_option: the `EmbeddingVariableOption` of the table.

    Raises:
        ValueError: empty key, or `partition_num` not None or >= 1.
        TypeError: unsupported dtype or a wrong `ev_option`.
        NotImplementedError: `partition_num` > 1.
    """

    key: str
    dtype: tf.DType = tf.string
    partition_num: Optional[int] = None
    ev_option: EmbeddingVariableOption = dataclasses.field(
        default_factory=EmbeddingVariableOption)

    def __post_init__(self):
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("`key` of categorical_column_with_embedding "
                             f"must be a non-empty string, got {self.key!r}.")
        dtype = tf.as_dtype(self.dtype)
        if dtype not in SUPPORTED_EV_DTYPES:
            raise TypeError(f"categorical_column_with_embedding "
                            f"'{self.key}': `dtype` must be string, int64 or "
                            f"int32, got {dtype.name}.")
        object.__setattr__(self, "dtype", dtype)
        p = self.partition_num
        if p is not None and not _is_positive_int(p):
            raise ValueError(f"categorical_column_with_embedding "
                             f"'{self.key}': `partition_num` must be None or "
                             f"a positive int, got {p!r}.")
        if p is not None and p > 1:
            # Rejected rather than ignored: tables are sharded over workers
            # by `ge.enable_distributed_strategy`, not split per column.
            raise NotImplementedError(
                f"categorical_column_with_embedding '{self.key}': "
                f"`partition_num`={p} is not supported; use None and shard "
                "with ge.enable_distributed_strategy('collective').")
        if not isinstance(self.ev_option, EmbeddingVariableOption):
            raise TypeError(f"categorical_column_with_embedding "
                            f"'{self.key}': `ev_option` must be an "
                            "EmbeddingVariableOption, got "
                            f"{type(self.ev_option).__name__}.")

    @property
    def name(self) -> str:
        """Column name (the feature key, as for stock columns)."""
        return self.key

    @property
    def keys(self) -> List[str]:
        """Feature keys this column reads."""
        return [self.key]

    @property
    def parse_example_spec(self) -> Dict[str, Any]:
        """`{key: VarLenFeature(dtype)}`, as stock categorical columns
        give; stock wrappers (`weighted_categorical_column`,
        `SequenceCategoricalColumn`) read it."""
        return {self.key: tf.io.VarLenFeature(self.dtype)}

    def get_config(self) -> Dict[str, Any]:
        """Returns the constructor arguments, JSON-serializable."""
        return {"key": self.key, "dtype": self.dtype.name,
                "partition_num": self.partition_num,
                "ev_option": self.ev_option.get_config()}

    @classmethod
    def from_config(cls, config: Dict[str, Any]
                    ) -> "EmbeddingCategoricalColumn":
        """Rebuilds the column from `get_config()`."""
        config = dict(config)
        config["dtype"] = tf.as_dtype(config["dtype"])
        config["ev_option"] = EmbeddingVariableOption.from_config(
            config["ev_option"])
        return cls(**config)


def is_ev_column(column: Any) -> bool:
    """True for a column backed by an `EmbeddingVariable`."""
    return isinstance(column, EmbeddingCategoricalColumn)


def is_sequence_column(column: Any) -> bool:
    """True for a `SequenceCategoricalColumn` (stock or over an EV)."""
    return isinstance(column, fc_v2.SequenceCategoricalColumn)


def base_categorical_column(column: Any) -> Any:
    """The id column under the sequence / weighted wrappers."""
    if is_sequence_column(column):
        column = column.categorical_column
    if isinstance(column, fc_v2.WeightedCategoricalColumn):
        column = column.categorical_column
    return column


def categorical_column_keys(column: Any) -> List[str]:
    """Feature keys a categorical column reads (ids, then weights)."""
    if is_ev_column(column):
        return column.keys
    return list(column.parse_example_spec)


def is_embeddable(column: Any) -> bool:
    """True if `embedding_column` of this package accepts `column`."""
    inner = column
    if is_sequence_column(inner):
        inner = inner.categorical_column
        # Weights of a sequence would be consumed by stock's per-position
        # combiner (w * e / w); nothing uses them, so they are not offered.
        if isinstance(inner, fc_v2.WeightedCategoricalColumn):
            return False
    if isinstance(inner, fc_v2.WeightedCategoricalColumn):
        inner = inner.categorical_column
    return is_ev_column(inner) or isinstance(inner, SUPPORTED_STOCK_COLUMNS)


def _check_categorical(column: Any, where: str) -> None:
    if is_embeddable(column):
        return
    name = getattr(column, "name", repr(column))
    raise TypeError(
        f"{where}: column '{name}' of type {type(column).__name__} cannot "
        "be embedded; use categorical_column_with_embedding or a stock "
        "categorical_column_with_identity / _hash_bucket / "
        "_vocabulary_list / _vocabulary_file, optionally wrapped in "
        "weighted_categorical_column (or their sequence_ versions, "
        "unweighted).")


def categorical_to_config(column: Any) -> Dict[str, Any]:
    """Serializes a categorical column that may hold an EV column.

    Stock serialization cannot write `EmbeddingCategoricalColumn`, so the
    weighted and sequence wrappers around one are written here.
    """
    if is_ev_column(column):
        return {"class_name": "EmbeddingCategoricalColumn",
                "config": column.get_config()}
    if is_ev_column(base_categorical_column(column)):
        if is_sequence_column(column):
            return {"class_name": "SequenceEmbeddingCategoricalColumn",
                    "config": categorical_to_config(
                        column.categorical_column)}
        return {"class_name": "WeightedEmbeddingCategoricalColumn",
                "config": {
                    "categorical_column": categorical_to_config(
                        column.categorical_column),
                    "weight_feature_key": column.weight_feature_key,
                    "dtype": column.dtype.name}}
    return serialization.serialize_feature_column(column)


def categorical_from_config(config: Dict[str, Any]) -> Any:
    """Inverse of `categorical_to_config`."""
    name = config["class_name"]
    if name == "EmbeddingCategoricalColumn":
        return EmbeddingCategoricalColumn.from_config(config["config"])
    if name == "SequenceEmbeddingCategoricalColumn":
        return fc_v2.SequenceCategoricalColumn(
            categorical_from_config(config["config"]))
    if name == "WeightedEmbeddingCategoricalColumn":
        inner = config["config"]
        return fc_v2.WeightedCategoricalColumn(
            categorical_from_config(inner["categorical_column"]),
            inner["weight_feature_key"], tf.as_dtype(inner["dtype"]))
    return serialization.deserialize_feature_column(config)


@dataclasses.dataclass(frozen=True)
class EmbeddingColumn:
    """A dense `[B, dimension]` embedding of a categorical column.

    Build it with `embedding_column` or `shared_embedding_columns`.

    Args:
        categorical_column: an `EmbeddingCategoricalColumn`, or a stock
            identity / hash_bucket / vocabulary_list / vocabulary_file
            column, either optionally wrapped in
            `weighted_categorical_column`; or a sequence column of one of
            them (`sequence_categorical_column_with_*`, read by
            `sequence_input_layer` only).
        dimension: embedding dim D, int >= 1.
        combiner: "mean" (default), "sum" or "sqrtn".
        initializer: initializer of the table (a Keras initializer, its
            name, or a `tf.compat.v1` initializer), or None for truncated
            normal with stddev `1/sqrt(dimension)` (stock default).
        max_norm: None, or a positive float: looked-up rows with a larger
            L2 norm are rescaled to it before pooling.
        trainable: whether the table is trained (default True).
        scope: the `GroupEmbeddingScope` the column was built in, or None
            (the column is then looked up alone, as stock does).
        shared_name: for `shared_embedding_columns`, the name of the table
            shared by all columns of the call; None for a private table.

    Raises:
        TypeError: an unsupported categorical column.
        ValueError: bad dimension, combiner or max_norm.
    """

    categorical_column: Any
    dimension: int
    combiner: str = "mean"
    initializer: Any = None
    max_norm: Optional[float] = None
    trainable: bool = True
    scope: Optional[scope_lib.GroupEmbeddingScope] = None
    shared_name: Optional[str] = None

    def __post_init__(self):
        where = "embedding_column" if self.scope is None else \
            f"embedding_column in group_embedding_column_scope " \
            f"'{self.scope.name}'"
        _check_categorical(self.categorical_column, where)
        cat = self.categorical_column.name
        if not _is_positive_int(self.dimension):
            raise ValueError(f"embedding_column '{cat}': `dimension` must "
                             f"be a positive int, got {self.dimension!r}.")
        if self.combiner not in SUPPORTED_COMBINERS:
            raise ValueError(f"embedding_column '{cat}': invalid `combiner`: "
                             f"{self.combiner!r}, use one of "
                             f"{', '.join(SUPPORTED_COMBINERS)}.")
        m = self.max_norm
        if m is not None and (isinstance(m, bool) or not isinstance(
                m, numbers.Real) or not m > 0):
            raise ValueError(f"embedding_column '{cat}': `max_norm` must be "
                             f"None or a positive number, got {m!r}.")
        if self.initializer is not None and not callable(self.initializer) \
                and not isinstance(self.initializer, str):
            raise ValueError(f"embedding_column '{cat}': `initializer` must "
                             "be callable, a Keras initializer name or None, "
                             f"got {self.initializer!r}.")

    @property
    def name(self) -> str:
        """Stock name: `<categorical>_embedding` (`_shared_embedding`)."""
        suffix = "_shared_embedding" if self.shared_name else "_embedding"
        return self.categorical_column.name + suffix

    @property
    def table_name(self) -> str:
        """Name of the table: the shared name, else the column name."""
        return self.shared_name or self.name

    @property
    def keys(self) -> List[str]:
        """Feature keys this column reads."""
        return categorical_column_keys(self.categorical_column)

    @property
    def is_ev(self) -> bool:
        """True if the table is an `EmbeddingVariable`."""
        return is_ev_column(base_categorical_column(self.categorical_column))

    @property
    def is_sequence(self) -> bool:
        """True for a sequence column: `[B, T, D]` unpooled output."""
        return is_sequence_column(self.categorical_column)

    @property
    def ev_option(self) -> Optional[EmbeddingVariableOption]:
        """The `EmbeddingVariableOption` of an EV table, else None."""
        base = base_categorical_column(self.categorical_column)
        return base.ev_option if is_ev_column(base) else None

    @property
    def num_buckets(self) -> Optional[int]:
        """Rows of the table (None for an `EmbeddingVariable`)."""
        return None if self.is_ev else self.categorical_column.num_buckets

    def table_initializer(self):
        """The initializer to build the table with (never None)."""
        if self.initializer is None:
            return keras.initializers.TruncatedNormal(
                mean=0.0, stddev=1.0 / math.sqrt(self.dimension))
        if isinstance(self.initializer, str):
            return keras.initializers.get(self.initializer)
        return self.initializer

    def get_config(self) -> Dict[str, Any]:
        """Returns the constructor arguments, JSON-serializable.

        Raises:
            TypeError: the initializer is neither None, a name nor a Keras
                initializer, so it cannot be serialized.
        """
        cat = self.categorical_column
        init = self.initializer
        if init is not None and not isinstance(init, str):
            if not isinstance(init, keras.initializers.Initializer):
                raise TypeError(
                    f"embedding_column '{self.name}': cannot serialize "
                    f"`initializer` of type {type(init).__name__}; use a "
                    "Keras initializer to save the model.")
            init = keras.initializers.serialize(init)
        return {
            "categorical_column": categorical_to_config(cat),
            "dimension": self.dimension, "combiner": self.combiner,
            "initializer": init, "max_norm": self.max_norm,
            "trainable": self.trainable,
            "scope": None if self.scope is None else self.scope.get_config(),
            "shared_name": self.shared_name,
        }

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "EmbeddingColumn":
        """Rebuilds the column from `get_config()`."""
        config = dict(config)
        config["categorical_column"] = categorical_from_config(
            config["categorical_column"])
        if isinstance(config.get("initializer"), dict):
            config["initializer"] = keras.initializers.deserialize(
                config["initializer"])
        if config.get("scope") is not None:
            config["scope"] = scope_lib.GroupEmbeddingScope.from_config(
                config["scope"])
        return cls(**config)


def categorical_column_with_embedding(
        key: str, dtype=tf.string, partition_num: Optional[int] = None,
        ev_option: Optional[EmbeddingVariableOption] = None
) -> EmbeddingCategoricalColumn:
    """A categorical column whose table is an `EmbeddingVariable`.

    Any id value is accepted (no vocabulary size): strings are hashed to
    int64 keys, integers are keys. Wrap it in `embedding_column`.

    Args:
        key: feature key in the `features` dict.
        dtype: tf.string (default), tf.int64 or tf.int32.
        partition_num: None (default) or 1; see `EmbeddingCategoricalColumn`.
        ev_option: `EmbeddingVariableOption` (default: no filter, no
            eviction).

    Returns:
        An `EmbeddingCategoricalColumn`.

    Raises:
        ValueError / TypeError / NotImplementedError: see
            `EmbeddingCategoricalColumn`.
    """
    return EmbeddingCategoricalColumn(
        key, dtype, partition_num,
        EmbeddingVariableOption() if ev_option is None else ev_option)


def sequence_categorical_column_with_embedding(
        key: str, dtype=tf.int64, partition_num: Optional[int] = None,
        ev_option: Optional[EmbeddingVariableOption] = None
) -> fc_v2.SequenceCategoricalColumn:
    """A sequence of ids looked up in an `EmbeddingVariable`.

    DeepRec's sequence version of `categorical_column_with_embedding`: the
    stock `SequenceCategoricalColumn` wrapper around one. Wrap it in
    `embedding_column` and read it with `sequence_input_layer`, which
    returns one unpooled row per position, `[B, T, D]`, and the sequence
    lengths.

    Example::

        hist = ge.feature_column.sequence_categorical_column_with_embedding(
            "hist_items", tf.int64)
        with ge.feature_column.group_embedding_column_scope("seq"):
            hist_emb = ge.feature_column.embedding_column(hist, 8)
        x, length = ge.feature_column.sequence_input_layer(features,
                                                           [hist_emb])
        # x: [B, T, 8], zeros past each row's last id; length: [B] int64.

    Args:
        key: feature key in the `features` dict (a `[B, T]` SparseTensor,
            RaggedTensor, or dense tensor padded with -1 / "").
        dtype: tf.int64 (default, as DeepRec), tf.int32 or tf.string.
        partition_num: None (default) or 1; see
            `EmbeddingCategoricalColumn`.
        ev_option: `EmbeddingVariableOption` (default: no filter, no
            eviction).

    Returns:
        A stock `SequenceCategoricalColumn` over an
        `EmbeddingCategoricalColumn`.

    Raises:
        ValueError / TypeError / NotImplementedError: see
            `EmbeddingCategoricalColumn`.
    """
    return fc_v2.SequenceCategoricalColumn(categorical_column_with_embedding(
        key, dtype, partition_num, ev_option))


def embedding_column(categorical_column, dimension: int,
                     combiner: str = "mean", initializer=None,
                     max_norm: Optional[float] = None,
                     trainable: bool = True, *,
                     do_fusion=None) -> EmbeddingColumn:
    """An embedding column; inside a scope it joins that scope's lookup.

    Example::

        ids = tf.feature_column.categorical_column_with_identity("cat", 100)
        with ge.feature_column.group_embedding_column_scope("g"):
            emb = ge.feature_column.embedding_column(ids, 8, "sum")
        # ge.feature_column.input_layer(features, [emb]) equals stock
        # tf.compat.v1.feature_column.input_layer(features,
        #     [tf.feature_column.embedding_column(ids, 8, "sum")]).

    Args:
        categorical_column: see `EmbeddingColumn`.
        dimension: embedding dim, int >= 1.
        combiner: "mean" (default), "sum" or "sqrtn". A sequence column's
            output is unpooled, one row per position
            (`sequence_input_layer`): as in stock, nothing is combined.
        initializer: see `EmbeddingColumn`; default truncated normal with
            stddev `1/sqrt(dimension)`.
        max_norm: None (default) or a positive float.
        trainable: default True.
        do_fusion: (keyword only) DeepRec's switch to fuse the lookups of
            embedding columns: None (default), a bool, or a string (later
            DeepRec versions name a fusion kind). Accepted and without
            effect: columns of a `group_embedding_column_scope` are always
            looked up by one fused op per scope.

    Returns:
        An `EmbeddingColumn` recording the innermost open scope (or None).

    Raises:
        TypeError: unsupported categorical column (the message names it and
            the scope), or `do_fusion` not None, a bool or a string.
        ValueError: bad dimension, combiner or max_norm.
    """
    if do_fusion is not None and not isinstance(do_fusion, (bool, str)):
        raise TypeError(
            f"embedding_column '{getattr(categorical_column, 'name', '?')}'"
            ": `do_fusion` must be None, a bool or a string, got "
            f"{type(do_fusion).__name__}.")
    return EmbeddingColumn(categorical_column, dimension, combiner,
                           initializer, max_norm, trainable,
                           scope_lib.current_scope())


def shared_embedding_columns(categorical_columns: Sequence[Any],
                             dimension: int, combiner: str = "mean",
                             initializer=None,
                             shared_embedding_collection_name: Optional[
                                 str] = None,
                             max_norm: Optional[float] = None,
                             trainable: bool = True
                             ) -> List[EmbeddingColumn]:
    """Embedding columns that look up ONE shared table.

    Like stock `tf.compat.v1.feature_column.shared_embedding_columns`, the
    stock columns must have the same number of buckets. Inside a scope the
    columns join its grouped lookup; the table is passed once per column
    and its gradients are summed.

    Args:
        categorical_columns: categorical columns of one kind (all stock with
            a vocabulary, or all `categorical_column_with_embedding`).
        dimension: embedding dim, int >= 1.
        combiner: "mean" (default), "sum" or "sqrtn".
        initializer: as in `embedding_column`.
        shared_embedding_collection_name: table name; default: the sorted
            column names joined by `_`, plus `_shared_embedding` (stock).
        max_norm: None (default) or a positive float.
        trainable: default True.

    Returns:
        One `EmbeddingColumn` per input column, in input order.

    Raises:
        ValueError: empty list, a mix of EV and stock columns, or stock
            columns with different numbers of buckets.
        TypeError: an unsupported categorical column.
    """
    columns = list(categorical_columns)
    if not columns:
        raise ValueError("`categorical_columns` of shared_embedding_columns "
                         "is empty; give at least one column.")
    for c in columns:
        _check_categorical(c, "shared_embedding_columns")
    kinds = {is_ev_column(base_categorical_column(c)) for c in columns}
    if len(kinds) > 1:
        raise ValueError(
            "shared_embedding_columns: columns "
            f"{[c.name for c in columns]} mix "
            "categorical_column_with_embedding and stock columns; one table "
            "cannot be both an EmbeddingVariable and a tf.Variable.")
    if not kinds.pop():
        buckets = {c.name: c.num_buckets for c in columns}
        if len(set(buckets.values())) > 1:
            raise ValueError(
                "shared_embedding_columns: all columns must have the same "
                f"number of buckets to share one table, got {buckets}.")
    name = shared_embedding_collection_name or "_".join(
        sorted(c.name for c in columns)) + "_shared_embedding"
    scope = scope_lib.current_scope()
    return [EmbeddingColumn(c, dimension, combiner, initializer, max_norm,
                            trainable, scope, name) for c in columns]
