"""The lookup shared by `input_layer` (TF1) and `GroupEmbeddingFeatures`
(Keras): columns in, one dense `[B, sum of dims]` tensor out.

Columns of one scope (and one `max_norm`) go through ONE
`group_embedding_lookup_sparse` call; columns built outside any scope are
looked up alone, with stock `safe_embedding_lookup_sparse` (or, for EV
tables and sequence columns, a one-column grouped lookup). A table that a
partitioned `variable_scope` turned into a `PartitionedVariable` enters the
grouped op shard by shard (`partitioned_table`). Outputs are concatenated
sorted by column name, as stock `input_layer` does. Tables are passed in:
this module holds no state.
"""

import collections
import sys
from typing import Any
from typing import Dict
from typing import List
from typing import Mapping
from typing import Sequence

import tensorflow as tf
from tensorflow.python.feature_column import feature_column_v2 as fc_v2

from group_embedding.feature_column import columns as columns_lib
from group_embedding.feature_column import partitioned_table
from group_embedding.feature_column import sparse_ids
from group_embedding.lookup import group_embedding_lookup_sparse
from group_embedding.ops import tf_variables

# Stock dense columns that would create their own tables: the grouped
# lookup cannot see them, so they are rejected with a pointer to ours.
_STOCK_EMBEDDING_COLUMNS = (fc_v2.EmbeddingColumn,
                            fc_v2.SharedEmbeddingColumn)


def check_feature_columns(feature_columns, sequence: bool = False
                          ) -> List[Any]:
    """Validates the columns of one call; returns them sorted by name.

    Accepted: `EmbeddingColumn`s and stateless stock dense columns
    (numeric, bucketized, indicator); with `sequence=True` only embedding
    columns of sequence categorical columns (and only those).

    Raises:
        TypeError: not a list of columns, a categorical column passed
            directly, a stock embedding column, or a sequence column where
            `sequence` is False (or another column where it is True).
        ValueError: empty list, or two columns with the same name.
    """
    if isinstance(feature_columns, (columns_lib.EmbeddingColumn,
                                    fc_v2.DenseColumn)):
        feature_columns = [feature_columns]
    if not isinstance(feature_columns, (list, tuple)):
        raise TypeError("`feature_columns` must be a list of columns, got "
                        f"{type(feature_columns).__name__}.")
    if not feature_columns:
        raise ValueError("`feature_columns` is empty; give at least one "
                         "column.")
    names: Dict[str, Any] = {}
    for c in feature_columns:
        name = getattr(c, "name", repr(c))
        if isinstance(c, _STOCK_EMBEDDING_COLUMNS):
            raise TypeError(
                f"Column '{name}' is a stock tf.feature_column embedding "
                "column; build it with ge.feature_column.embedding_column "
                "(or shared_embedding_columns) instead.")
        if not isinstance(c, (columns_lib.EmbeddingColumn,
                              fc_v2.DenseColumn)):
            raise TypeError(
                f"Column '{name}' of type {type(c).__name__} is not a dense "
                "column; wrap categorical columns in "
                "ge.feature_column.embedding_column.")
        is_sequence = isinstance(c, columns_lib.EmbeddingColumn) and \
            c.is_sequence
        if is_sequence and not sequence:
            raise TypeError(
                f"Column '{name}' embeds a sequence column ([batch, time, "
                "dim] output); read it with "
                "ge.feature_column.sequence_input_layer.")
        if sequence and not is_sequence:
            raise TypeError(
                f"Column '{name}' of type {type(c).__name__} is not an "
                "embedding of a sequence column; sequence_input_layer "
                "takes ge.feature_column.embedding_column over "
                "sequence_categorical_column_with_* only.")
        if name in names:
            raise ValueError(f"Duplicate feature column name '{name}'.")
        names[name] = c
    return [names[n] for n in sorted(names)]


def embedding_columns(columns: Sequence[Any]
                      ) -> List[columns_lib.EmbeddingColumn]:
    """The `EmbeddingColumn`s among `columns`, in the same order."""
    return [c for c in columns if isinstance(c, columns_lib.EmbeddingColumn)]


def table_specs(columns: Sequence[columns_lib.EmbeddingColumn]
                ) -> Dict[str, columns_lib.EmbeddingColumn]:
    """Table name -> the first column using it (shared tables once).

    Raises:
        ValueError: two columns name one table but disagree on its shape
            or kind.
    """
    specs: Dict[str, columns_lib.EmbeddingColumn] = {}
    for c in columns:
        first = specs.setdefault(c.table_name, c)
        if (first.dimension, first.num_buckets, first.is_ev) != (
                c.dimension, c.num_buckets, c.is_ev):
            raise ValueError(
                f"Columns '{first.name}' and '{c.name}' both use table "
                f"'{c.table_name}' but disagree on its shape or kind "
                f"(dim {first.dimension} vs {c.dimension}, buckets "
                f"{first.num_buckets} vs {c.num_buckets}).")
    return specs


def _check_scopes(columns: Sequence[columns_lib.EmbeddingColumn]) -> None:
    by_name: Dict[str, Any] = {}
    for c in columns:
        if c.scope is None:
            continue
        other = by_name.setdefault(c.scope.name, c)
        if other.scope != c.scope:
            raise ValueError(
                f"Columns '{other.name}' and '{c.name}' come from two "
                f"group_embedding_column_scope named '{c.scope.name}' "
                f"({other.scope} vs {c.scope}); two scopes cannot share a "
                "name.")


def _stock_lookup(table, ids, weights, column) -> tf.Tensor:
    table = tf_variables.to_tf_variable(table)
    # A PartitionedVariable is read as stock does ("div" over its shards).
    return tf.nn.safe_embedding_lookup_sparse(
        table, ids, weights, combiner=column.combiner,
        max_norm=column.max_norm, name=f"{column.name}_weights")


def _lookup_entries(column, table, ids, weights):
    """(tables, ids, weights, combiner) the grouped op gets for a column:
    one entry, or one per shard of a partitioned table."""
    if not partitioned_table.is_partitioned(table):
        return [table], [ids], [weights], column.combiner
    tables = partitioned_table.shards(table, column.name)
    if len(tables) == 1:
        # The model zoo's min_max partitioner without parameter servers
        # (max_partitions=0) makes one shard: nothing to split.
        return tables, [ids], [weights], column.combiner
    shard_ids, shard_weights, combiner = partitioned_table.split_ids(
        ids, weights, column.combiner, tables, column.is_sequence)
    return tables, shard_ids, shard_weights, combiner


def _grouped(members, ids, tables, training, name, max_norm,
             params_num_per_group=sys.maxsize) -> List[tf.Tensor]:
    """ONE `group_embedding_lookup_sparse` call for `members` (all
    sequence or all pooled); the shard results of a partitioned table are
    added back into one output per column."""
    params: List[Any] = []
    sp_ids: List[Any] = []
    combiners: List[str] = []
    sp_weights: List[Any] = []
    spans: List[Any] = []
    for c in members:
        t, i, w, combiner = _lookup_entries(c, tables[c.table_name],
                                            *ids[c])
        spans.append((len(params), len(params) + len(t)))
        params += t
        sp_ids += i
        sp_weights += w
        combiners += [combiner] * len(t)
    results = group_embedding_lookup_sparse(
        params, sp_ids, combiners, sp_weights,
        is_sequence=members[0].is_sequence,
        params_num_per_group=params_num_per_group, name=name,
        max_norm=max_norm, training=training)
    return [results[a] if b - a == 1 else tf.add_n(results[a:b])
            for a, b in spans]


def lookup_columns(columns: Sequence[columns_lib.EmbeddingColumn],
                   cache: fc_v2.FeatureTransformationCache,
                   state_manager, tables: Mapping[str, Any],
                   training=True) -> Dict[Any, tf.Tensor]:
    """Embeddings of `columns`: `[B, D]` pooled, or `[B, T, D]` for
    sequence columns; one grouped lookup per scope, `max_norm` and kind
    (pooled / sequence).

    Args:
        columns: `EmbeddingColumn`s, sorted by name.
        cache: `FeatureTransformationCache` over prepared features.
        state_manager: holds the vocabulary tables of stock columns.
        tables: table name -> tf.Variable / keras.Variable /
            EmbeddingVariable / PartitionedVariable (split by rows, see
            `partitioned_table`).
        training: passed to EV lookups (False inserts no new keys).

    Returns:
        Column -> `[B, D]` (or `[B, T, D]`) tensor.

    Raises:
        ValueError: two different scopes share a name.
        NotImplementedError: a table partitioned along another axis than
            rows.
    """
    _check_scopes(columns)
    ids = {c: sparse_ids.column_sparse_ids(c, cache, state_manager)
           for c in columns}
    out: Dict[Any, tf.Tensor] = {}
    groups = collections.defaultdict(list)
    for c in columns:
        if c.scope is not None:
            groups[(c.scope, c.max_norm, c.is_sequence)].append(c)
            continue
        with tf.name_scope(c.name):
            if c.is_ev or c.is_sequence:
                # Alone, through a one-column grouped lookup (stock has
                # no EV; its sequence path is the same unpooled lookup).
                out[c] = _grouped([c], ids, tables, training, None,
                                  c.max_norm)[0]
            else:
                out[c] = _stock_lookup(tables[c.table_name], *ids[c], c)
    for (scope, max_norm, _), members in groups.items():
        results = _grouped(members, ids, tables, training, scope.name,
                           max_norm, scope.params_num_per_group)
        out.update(zip(members, results))
    return out


def dense_outputs(columns: Sequence[Any], embedded: Mapping[Any, tf.Tensor],
                  cache: fc_v2.FeatureTransformationCache,
                  state_manager) -> Dict[Any, tf.Tensor]:
    """Every column's `[B, D_i]` output, in `columns` order.

    Stock dense columns (numeric, ...) are computed here by stock code.
    """
    outputs = {}
    for c in columns:
        if c in embedded:
            t = embedded[c]
            dim = c.dimension
        else:
            t = c.get_dense_tensor(cache, state_manager)
            dim = c.variable_shape.num_elements()
        outputs[c] = tf.reshape(tf.cast(t, tf.float32), [-1, dim])
    return outputs


def concat(outputs: Mapping[Any, tf.Tensor]) -> tf.Tensor:
    """Concatenates `dense_outputs` along the feature axis."""
    tensors = list(outputs.values())
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, 1)
