"""`input_layer` for TF1-style graphs (`tf.compat.v1`, model_fn).

Tables are created with `tf.compat.v1.get_variable` (resource variables)
under `<scope>/<table name>/embedding_weights`, the names stock
`input_layer` uses, with `AUTO_REUSE`: a second model_fn trace in the same
graph, or a second `input_layer` call, reuses them. EV tables are created
once per graph with `ge.get_embedding_variable`.

Under a partitioned `variable_scope` (DeepRec's model zoo
`--input_layer_partitioner`), `get_variable` returns a `PartitionedVariable`
for a stock-column table, exactly as for stock `input_layer`; its shards
join the scope's grouped lookup. EV tables ignore the partitioner: an EV is
one hash table.

Each graph remembers, per features object and column, the embedding it
already computed: calling `input_layer` twice on the same features (twice
in one model_fn) adds no second lookup. DeepRec runs the grouped lookup
again for every call.
"""

from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import tensorflow as tf
from tensorflow.python.feature_column import feature_column_v2 as fc_v2

from group_embedding import model_parallel
from group_embedding.embedding_variable.variable import get_embedding_variable
from group_embedding.feature_column import column_lookup
from group_embedding.feature_column import partitioned_table
from group_embedding.feature_column import sparse_ids

_DEFAULT_SCOPE = "input_layer"


class _GraphState:
    """What one graph keeps between `input_layer` calls."""

    def __init__(self):
        self.state_manager = sparse_ids.TableStateManager()
        self.evs: Dict[str, Any] = {}
        # Table name -> table (tf.Variable, ShardedVariable or EV).
        self.tables: Dict[str, Any] = {}
        # key -> (tensor, objects the key's ids refer to, kept alive so
        # that an id is never reused by another object).
        self.outputs: Dict[Tuple, Tuple[tf.Tensor, Tuple]] = {}


# Kept on the graph object itself: a WeakKeyDictionary would never free
# a graph, because the cached tensors refer back to it.
_STATE_ATTRIBUTE = "_group_embedding_feature_column_state"


def _graph_state(graph: tf.Graph) -> _GraphState:
    state = getattr(graph, _STATE_ATTRIBUTE, None)
    if state is None:
        state = _GraphState()
        setattr(graph, _STATE_ATTRIBUTE, state)
    return state


def graph_tables(graph: tf.Graph) -> Dict[str, Any]:
    """Table name -> table created by `input_layer` in `graph`."""
    return dict(_graph_state(graph).tables)


def check_context() -> None:
    """Raises RuntimeError unless building a TF1 graph (eager code and
    TF2 `tf.function`s must use the Keras layer)."""
    if tf.executing_eagerly() or tf.inside_function() and \
            tf.compat.v1.executing_eagerly_outside_functions():
        raise RuntimeError(
            "ge.feature_column.input_layer creates tf.compat.v1 variables "
            "and needs a TF1 graph (`with tf.Graph().as_default():` or "
            "tf.compat.v1.disable_eager_execution()); in TF2 code use the "
            "Keras layer ge.feature_column.GroupEmbeddingFeatures.")


def _tf1_initializer(column):
    if column.initializer is not None:
        return column.table_initializer()
    # Stock default, drawn from the graph seed like every TF1 variable.
    return tf.compat.v1.truncated_normal_initializer(
        mean=0.0, stddev=1.0 / column.dimension ** 0.5)


def _create_tables(columns, state: _GraphState, trainable: bool,
                   collections: List[str]) -> Dict[str, Any]:
    tables = {}
    for name, c in column_lookup.table_specs(columns).items():
        with tf.compat.v1.variable_scope(name):
            if c.is_ev:
                full = tf.compat.v1.get_variable_scope().name + \
                    "/embedding_weights"
                ev = state.evs.get(full)
                if ev is None:
                    ev = state.evs[full] = get_embedding_variable(
                        full, c.dimension, key_dtype=tf.int64,
                        initializer=c.initializer,
                        trainable=c.trainable and trainable,
                        ev_option=c.ev_option)
                tables[name] = ev
            elif c.scope is not None and model_parallel.runtime():
                tables[name] = _collective_tf1_table(c, trainable,
                                                     collections)
            else:
                # Under a partitioned variable_scope this is a
                # PartitionedVariable, as for stock (column_lookup reads
                # its shards).
                tables[name] = tf.compat.v1.get_variable(
                    "embedding_weights", [c.num_buckets, c.dimension],
                    tf.float32, initializer=_tf1_initializer(c),
                    trainable=c.trainable and trainable,
                    collections=collections, use_resource=True)
    return tables


def _collective_tf1_table(column, trainable, collections):
    """Collective mode: the (sharded) table of a scoped column.

    The initial rows are computed now (numpy), so that any worker count
    starts from the same values; they enter the graph as the initializer's
    constant, which suits tables of up to a few hundred MB per worker.
    """
    def create(value):
        # The collective strategy shards the table itself: a partitioner
        # of an enclosing variable_scope must not cut it again.
        tf.compat.v1.get_variable_scope().set_partitioner(None)
        return tf.compat.v1.get_variable(
            "embedding_weights", value.shape, tf.float32,
            initializer=tf.compat.v1.constant_initializer(value),
            trainable=column.trainable and trainable,
            collections=collections, use_resource=True)

    return model_parallel.runtime().collective_table(
        tf.compat.v1.get_variable_scope().name, column.num_buckets,
        column.dimension, column.table_initializer(), create)


def _cache_key(column, features, vs_name: str, training
               ) -> Tuple[Tuple, Tuple]:
    refs = tuple(features[k] for k in column.keys)
    if not isinstance(training, bool):
        refs += (training,)
        training = ("tensor", id(training))
    return (vs_name, column, training,
            tuple(id(r) for r in refs)), refs


def input_layer(features, feature_columns, weight_collections=None,
                trainable: bool = True, cols_to_vars=None,
                cols_to_output_tensors=None, *, scope: Optional[str] = None,
                training=True) -> tf.Tensor:
    """A dense `[B, sum of column dims]` tensor from `feature_columns`.

    Equals stock `tf.compat.v1.feature_column.input_layer` on the same
    weights: columns sorted by name, each embedding pooled with its
    combiner. Columns of one `group_embedding_column_scope` share ONE
    grouped lookup (one per distinct `max_norm`); other columns are looked
    up alone, as stock does.

    Example::

        def model_fn(features, labels, mode):
            x = ge.feature_column.input_layer(features, columns)
            ...

    Args:
        features: dict from feature key to a dense `[B]` / `[B, k]` Tensor
            (default value "" or -1 = missing), SparseTensor `[B, T]` or
            RaggedTensor `[B, None]`.
        feature_columns: `EmbeddingColumn`s from this package and stateless
            stock dense columns (numeric, bucketized, indicator).
        weight_collections: extra graph collections for the tables (they
            always join GLOBAL_VARIABLES and MODEL_VARIABLES).
        trainable: if False, no table is trainable (default True).
        cols_to_vars: None, or a dict filled with column -> [tables] (the
            shards of a partitioned table, as stock lists them).
        cols_to_output_tensors: None, or a dict filled with column ->
            `[B, D]` output.
        scope: (keyword only) variable scope (name or
            `tf.compat.v1.VariableScope`) of the tables, default
            "input_layer"; calls with the same scope share tables.
        training: (keyword only) Python or tensor bool, default True;
            False stops EV tables from inserting new keys.

    Returns:
        A float32 `[B, sum of dims]` tensor.

    Raises:
        RuntimeError: called eagerly or inside a tf.function.
        TypeError: bad `features`, unsupported column, or ids of the wrong
            dtype (the message names the key and column).
        ValueError: a feature key missing from `features`, duplicate
            column names, or two scopes sharing a name.
    """
    check_context()
    columns = column_lookup.check_feature_columns(feature_columns)
    embedded, tables, cache, state = embed_columns(
        features, columns, weight_collections, trainable,
        scope or _DEFAULT_SCOPE, training)
    outputs = column_lookup.dense_outputs(columns, embedded, cache,
                                          state.state_manager)
    fill_cols_to_vars(cols_to_vars, columns, embedded, tables)
    if cols_to_output_tensors is not None:
        cols_to_output_tensors.update(outputs)
    return column_lookup.concat(outputs)


def fill_cols_to_vars(cols_to_vars, columns, embedded, tables) -> None:
    """Column -> its table variables (a partitioned table's shards, as
    stock lists them; [] for columns without a table)."""
    if cols_to_vars is None:
        return
    for c in columns:
        if c not in embedded:
            cols_to_vars[c] = []
            continue
        table = tables[c.table_name]
        cols_to_vars[c] = (list(table)
                           if partitioned_table.is_partitioned(table)
                           else [table])


def embed_columns(features, columns, weight_collections, trainable: bool,
                  scope: str, training):
    """Creates (or reuses) the tables of `columns` under variable scope
    `scope` and looks the embedding columns up, once per graph, features
    and column.

    Args:
        features: the features dict of `input_layer`.
        columns: checked columns (`column_lookup.check_feature_columns`).
        weight_collections, trainable, training: as in `input_layer`.
        scope: variable scope name of the tables.

    Returns:
        (column -> embedding tensor, table name -> table,
        FeatureTransformationCache over the prepared features, the graph's
        `_GraphState`).
    """
    prepared = sparse_ids.prepare_features(features, columns)
    collections = list(weight_collections or [])
    for c in (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES,
              tf.compat.v1.GraphKeys.MODEL_VARIABLES):
        if c not in collections:
            collections.append(c)
    state = _graph_state(tf.compat.v1.get_default_graph())
    cache = fc_v2.FeatureTransformationCache(prepared)
    embedded_columns = column_lookup.embedding_columns(columns)
    with tf.compat.v1.variable_scope(scope,
                                     reuse=tf.compat.v1.AUTO_REUSE) as vs:
        tables = _create_tables(embedded_columns, state, trainable,
                                collections)
        state.tables.update(tables)
        keys = {c: _cache_key(c, features, vs.name, training)
                for c in embedded_columns}
        embedded = {c: state.outputs[keys[c][0]][0]
                    for c in embedded_columns if keys[c][0] in state.outputs}
        missing = [c for c in embedded_columns if c not in embedded]
        if missing:
            new = column_lookup.lookup_columns(
                missing, cache, state.state_manager, tables, training)
            for c, t in new.items():
                state.outputs[keys[c][0]] = (t, keys[c][1])
            embedded.update(new)
    return embedded, tables, cache, state
