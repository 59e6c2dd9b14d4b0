"""From raw features to the `[B, T]` SparseTensor ids (and weights) of an
embedding column.

Stock categorical columns keep their own transformation (hashing,
vocabulary tables, identity range handling): we ask them through the v2
API `get_sparse_tensors(FeatureTransformationCache, state_manager)` and then
drop what stock `safe_embedding_lookup_sparse` drops (ids < 0, and weights
<= 0 unless the combiner is "sum"), so that only the lookup itself differs
from stock. EV columns hash strings to int64 keys.

Raw features may be dense `[B]` / `[B, k]` tensors (the default value, ""
or -1, means missing), SparseTensors or 2-D RaggedTensors.
"""

from typing import Any
from typing import Dict
from typing import List
from typing import Mapping
from typing import Optional
from typing import Tuple

import tensorflow as tf
from tensorflow.python.feature_column import feature_column_v2 as fc_v2

from group_embedding.feature_column import columns as columns_lib

# Keys are int64 in [0, 2**63 - 1): a fingerprint, the same in every run.
_STRING_KEY_BUCKETS = 2 ** 63 - 1


def _weight_keys(column: Any) -> set:
    cat = getattr(column, "categorical_column", None)
    if isinstance(cat, fc_v2.WeightedCategoricalColumn):
        return {cat.weight_feature_key}
    return set()


def _to_sparse(value, key: str, column_name: str):
    if isinstance(value, tf.RaggedTensor):
        if value.ragged_rank != 1 or value.shape.rank != 2:
            raise ValueError(
                f"Feature '{key}' of column '{column_name}' must be a 2-D "
                f"RaggedTensor [batch, None], got shape {value.shape}.")
        return value.to_sparse()
    return value


def prepare_features(features: Mapping[str, Any], feature_columns
                     ) -> Dict[str, Any]:
    """Checks the features the embedding columns read; ragged -> sparse.

    Args:
        features: dict from feature key to Tensor / SparseTensor /
            RaggedTensor (or anything convertible to a Tensor).
        feature_columns: the columns of one `input_layer` call.

    Returns:
        A new dict: `features` with the RaggedTensors read by embedding
        columns converted to SparseTensors.

    Raises:
        TypeError: `features` is not a mapping, ids are not integers or
            strings, or weights are not floats (naming key and column).
        ValueError: a key read by a column is missing from `features`.
    """
    if not isinstance(features, Mapping):
        raise TypeError("`features` must be a dict from feature key to "
                        f"tensor, got {type(features).__name__}.")
    out = dict(features)
    for column in feature_columns:
        if not isinstance(column, columns_lib.EmbeddingColumn):
            continue
        weights = _weight_keys(column)
        for key in column.keys:
            if key not in features:
                raise ValueError(
                    f"Feature '{key}' of column '{column.name}' is not in "
                    f"`features` (keys: {sorted(features)}).")
            value = _to_sparse(features[key], key, column.name)
            if not isinstance(value, (tf.SparseTensor, tf.Tensor)):
                value = tf.convert_to_tensor(value)
            if key in weights:
                if not value.dtype.is_floating:
                    raise TypeError(
                        f"Weight feature '{key}' of column '{column.name}' "
                        f"must hold floats, got {value.dtype.name}.")
            elif not (value.dtype.is_integer or value.dtype == tf.string):
                raise TypeError(
                    f"Feature '{key}' of column '{column.name}' must hold "
                    f"integer or string ids, got {value.dtype.name}.")
            out[key] = value
    return out


def _ev_sparse_ids(cat, column_name: str, cache,
                   state_manager) -> tf.SparseTensor:
    raw = cache.get(cat.key, state_manager)
    sparse = fc_v2._to_sparse_input_and_drop_ignore_values(raw)  # noqa
    is_string = sparse.dtype == tf.string
    if is_string != (cat.dtype == tf.string):
        raise TypeError(
            f"Feature '{cat.key}' of column '{column_name}' holds "
            f"{sparse.dtype.name} ids but the column's dtype is "
            f"{cat.dtype.name}.")
    if is_string:
        values = tf.strings.to_hash_bucket_fast(sparse.values,
                                                _STRING_KEY_BUCKETS)
    else:
        values = tf.cast(sparse.values, tf.int64)
    return tf.SparseTensor(sparse.indices, values, sparse.dense_shape)


def _check_rank(ids: tf.SparseTensor, column_name: str) -> None:
    rank = tf.compat.dimension_value(ids.dense_shape.shape[0])
    if rank is not None and rank != 2:
        raise ValueError(
            f"Column '{column_name}': ids must be [batch, ids per row] "
            f"(rank 2), got rank {rank}.")


def _prune(ids: tf.SparseTensor, weights: Optional[tf.SparseTensor],
           keep: tf.Tensor):
    ids = tf.sparse.retain(ids, keep)
    if weights is not None:
        weights = tf.sparse.retain(weights, keep)
    return ids, weights


def _raw_sparse_ids(column, cache, state_manager):
    """(ids, weights) of a column before anything is pruned.

    Sequence columns are read through the column they wrap: their 2-D
    `[B, T]` ids, whose column index is the position in the sequence.
    """
    cat = column.categorical_column
    if columns_lib.is_sequence_column(cat):
        cat = cat.categorical_column
    base = columns_lib.base_categorical_column(cat)
    if columns_lib.is_ev_column(base):
        ids = _ev_sparse_ids(base, column.name, cache, state_manager)
        weights = None
        if isinstance(cat, fc_v2.WeightedCategoricalColumn):
            # Stock's own conversion of the weight feature (dense zeros
            # mean missing), so weights line up as they do for stock ids.
            weights = cat._transform_weight_tensor(  # noqa
                cache.get(cat.weight_feature_key, state_manager))
        return ids, weights
    pair = cat.get_sparse_tensors(cache, state_manager)
    return pair.id_tensor, pair.weight_tensor


def column_sparse_ids(column, cache: fc_v2.FeatureTransformationCache,
                      state_manager
                      ) -> Tuple[tf.SparseTensor, Optional[tf.SparseTensor]]:
    """The ids and weights an embedding column looks up.

    Args:
        column: an `EmbeddingColumn`.
        cache: `FeatureTransformationCache` over `prepare_features` output,
            shared by the columns of one call (one transformation per
            categorical column).
        state_manager: holds the vocabulary tables of stock columns.

    Returns:
        (ids, weights): int64 SparseTensor `[B, T]`, and None or a float
        SparseTensor with the same indices.

    Raises:
        TypeError: string/int mismatch between an EV column and its input.
        ValueError: ids of rank other than 2.
    """
    ids, weights = _raw_sparse_ids(column, cache, state_manager)
    _check_rank(ids, column.name)
    if ids.dtype != tf.int64:
        ids = tf.SparseTensor(ids.indices, tf.cast(ids.values, tf.int64),
                              ids.dense_shape)
    if not column.is_ev:
        # What stock safe_embedding_lookup_sparse prunes (missing
        # vocabulary entries map to -1). EV keys may be negative: for
        # them only dense defaults count as missing.
        ids, weights = _prune(ids, weights, ids.values >= 0)
    if weights is not None and column.combiner != "sum":
        # Non-positive weights would divide by <= 0 (stock prunes them).
        ids, weights = _prune(ids, weights, weights.values > 0)
    if weights is not None and weights.dtype != tf.float32:
        weights = tf.SparseTensor(weights.indices,
                                  tf.cast(weights.values, tf.float32),
                                  weights.dense_shape)
    return ids, weights


def sequence_length(column, cache: fc_v2.FeatureTransformationCache,
                    state_manager) -> tf.Tensor:
    """Int64 `[B]` lengths of a sequence column's rows, as stock computes
    them: last occupied position + 1, counted before invalid ids (e.g. out
    of vocabulary) are dropped; 0 for an empty row."""
    ids, _ = _raw_sparse_ids(column, cache, state_manager)
    batch = ids.dense_shape[0]
    last = tf.math.unsorted_segment_max(ids.indices[:, 1] + 1,
                                        ids.indices[:, 0], batch)
    # Empty rows get the dtype's lowest value from the segment max.
    return tf.maximum(last, 0)


class TableStateManager(fc_v2.StateManager):
    """Holds the vocabulary tables stock columns create, so that every
    call reuses them (one per column) instead of building new ones."""

    def __init__(self):
        self._resources: Dict[Tuple[Any, str], Any] = {}

    def add_resource(self, feature_column, resource_name, resource):
        self._resources[(feature_column, resource_name)] = resource
        return resource

    def has_resource(self, feature_column, resource_name):
        return (feature_column, resource_name) in self._resources

    def get_resource(self, feature_column, resource_name):
        return self._resources[(feature_column, resource_name)]

    def resources(self) -> List[Any]:
        """Every resource held, in the order they were added."""
        return list(self._resources.values())
