"""Stock `tf.feature_column` functions, stock signatures, routed through
this library (what `group_embedding.compat` installs under their names).

DeepRec scripts build their columns with `tf.feature_column.
embedding_column` / `shared_embedding_columns` and feed them to
`tf.compat.v1.feature_column.input_layer`; in DeepRec those honour
`group_embedding_column_scope`. The three functions here take the stock
arguments and return `ge` columns (or the stock result where this library
has nothing to add), so that a scope takes effect with the stock names:

* `embedding_column`: a `ge` `EmbeddingColumn`; outside scopes, a
  categorical column the library cannot embed (e.g. a crossed column) gets
  the stock embedding column;
* `shared_embedding_columns`: `ge` `EmbeddingColumn`s sharing one table;
* `input_layer`: stock when no `ge` column is given; else the `ge` columns
  and stateless stock ones in one grouped lookup per scope, stock embedding
  columns computed by stock code, outputs sorted by column name.

The stock functions these fall back to are captured when this module is
first imported; `name_table` (`group_embedding.compat`) imports it before
it installs anything, so they are TF's own.

Note: DeepRec's `embedding_column` builds its table itself; ours returns a
column description whose table `input_layer` creates, with the same
variable names stock uses (`input_layer/<column>/embedding_weights`).
"""

from typing import Any
from typing import Dict

import tensorflow as tf

from group_embedding.feature_column import column_lookup
from group_embedding.feature_column import columns as columns_lib
from group_embedding.feature_column import scope as scope_lib
from group_embedding.feature_column.input_layer import (
    input_layer as ge_input_layer,
)

# TF's own functions, as found before anything replaced them.
_STOCK_EMBEDDING_COLUMN = tf.feature_column.embedding_column
_STOCK_INPUT_LAYER = tf.compat.v1.feature_column.input_layer


def _reject_ckpt_arguments(where: str, ckpt_to_load_from,
                           tensor_name_in_ckpt) -> None:
    # Honoured or rejected, never ignored (STYLE: Errors).
    if ckpt_to_load_from is not None or tensor_name_in_ckpt is not None:
        raise NotImplementedError(
            f"{where}: `ckpt_to_load_from` / `tensor_name_in_ckpt` are not "
            "supported by group_embedding; restore the tables with "
            "tf.train.Saver or tf.train.init_from_checkpoint instead.")


def _is_supported_categorical(column) -> bool:
    # EV and stock columns, weighted or sequence ones included.
    return columns_lib.is_embeddable(column)


def embedding_column(categorical_column, dimension, combiner="mean",
                     initializer=None, ckpt_to_load_from=None,
                     tensor_name_in_ckpt=None, max_norm=None,
                     trainable=True, use_safe_embedding_lookup=True,
                     do_fusion=None):
    """`tf.feature_column.embedding_column` with the stock signature,
    routed through `ge.feature_column.embedding_column`.

    Inside a `group_embedding_column_scope` the column joins the scope's
    grouped lookup. Outside scopes, a categorical column the library cannot
    embed (e.g. a crossed column) gets the stock embedding column.

    Args:
        categorical_column, dimension, combiner, initializer, max_norm,
            trainable: as in `ge.feature_column.embedding_column`.
        ckpt_to_load_from, tensor_name_in_ckpt: must be None.
        use_safe_embedding_lookup: accepted either way: the grouped lookup
            always drops invalid ids and empty rows give zeros, which is
            what the safe lookup does and, on valid input, equals the
            unsafe one.
        do_fusion: DeepRec's embedding-fusion switch: see
            `ge.feature_column.embedding_column` (accepted, no effect: the
            grouped lookup is always one fused op per scope).

    Returns:
        A `ge` `EmbeddingColumn` (or a stock one, see above).

    Raises:
        NotImplementedError: checkpoint arguments given.
        TypeError / ValueError: see `ge.feature_column.embedding_column`.
    """
    _reject_ckpt_arguments("embedding_column", ckpt_to_load_from,
                           tensor_name_in_ckpt)
    if scope_lib.current_scope() is None and not _is_supported_categorical(
            categorical_column):
        return _STOCK_EMBEDDING_COLUMN(
            categorical_column, dimension, combiner=combiner,
            initializer=initializer, max_norm=max_norm, trainable=trainable,
            use_safe_embedding_lookup=use_safe_embedding_lookup)
    return columns_lib.embedding_column(categorical_column, dimension,
                                        combiner, initializer, max_norm,
                                        trainable, do_fusion=do_fusion)


def shared_embedding_columns(categorical_columns, dimension,
                             combiner="mean", initializer=None,
                             shared_embedding_collection_name=None,
                             ckpt_to_load_from=None,
                             tensor_name_in_ckpt=None, max_norm=None,
                             trainable=True,
                             use_safe_embedding_lookup=True):
    """`tf.compat.v1.feature_column.shared_embedding_columns` (stock
    signature) routed through `ge.feature_column.shared_embedding_columns`.

    Args:
        As stock; `ckpt_to_load_from` / `tensor_name_in_ckpt` must be None,
        `use_safe_embedding_lookup` as in `embedding_column`.

    Returns:
        One `ge` `EmbeddingColumn` per categorical column.

    Raises:
        NotImplementedError: checkpoint arguments given.
        TypeError / ValueError: see
            `ge.feature_column.shared_embedding_columns`.
    """
    del use_safe_embedding_lookup  # always safe, see embedding_column
    _reject_ckpt_arguments("shared_embedding_columns", ckpt_to_load_from,
                           tensor_name_in_ckpt)
    return columns_lib.shared_embedding_columns(
        categorical_columns, dimension, combiner, initializer,
        shared_embedding_collection_name, max_norm, trainable)


def _is_ours(column) -> bool:
    return isinstance(column, columns_lib.EmbeddingColumn)


def _handled_by_ge(column) -> bool:
    try:
        column_lookup.check_feature_columns([column])
    except (TypeError, ValueError):
        return False
    return True


def _stock_input_layer_scope():
    """The variable scope stock `input_layer` would open for this call:
    "input_layer", then "input_layer_1", ... (TF's default-name counters,
    reset when an enclosing named scope is re-entered)."""
    with tf.compat.v1.variable_scope(None, default_name="input_layer") as vs:
        return vs


def input_layer(features, feature_columns, weight_collections=None,
                trainable=True, cols_to_vars=None,
                cols_to_output_tensors=None):
    """`tf.compat.v1.feature_column.input_layer`, scopes included.

    With no `ge` embedding column among `feature_columns` this is the stock
    function, unchanged. Otherwise `ge.feature_column.input_layer` computes
    the `ge` columns and the stateless stock ones (one grouped lookup per
    scope); stock embedding columns, if any, are computed by the stock
    function; the outputs are concatenated sorted by column name, as stock
    does.

    Tables are named and shared as stock (and DeepRec) do: each call opens
    `variable_scope(None, default_name="input_layer")`, so a second call
    gets tables of its own under `input_layer_1/` (DeepRec's DeepFM feeds
    its wide and deep parts from two calls, i.e. two sets of tables), and
    calls share tables only where the TF1 idiom makes stock share them: a
    re-entered named `variable_scope`, whose default names start afresh.

    Args:
        As stock `tf.compat.v1.feature_column.input_layer`.

    Returns:
        `[B, sum of column dims]` float32.
    """
    stock = _STOCK_INPUT_LAYER
    columns = list(feature_columns) if isinstance(
        feature_columns, (list, tuple)) else [feature_columns]
    if not any(_is_ours(c) for c in columns):
        return stock(features, columns, weight_collections, trainable,
                     cols_to_vars, cols_to_output_tensors)
    rest = [c for c in columns if not _handled_by_ge(c)]
    if not rest:
        return ge_input_layer(
            features, columns, weight_collections, trainable, cols_to_vars,
            cols_to_output_tensors, scope=_stock_input_layer_scope())
    ours = [c for c in columns if _handled_by_ge(c)]
    outputs: Dict[Any, tf.Tensor] = {}
    stock(features, rest, weight_collections, trainable, cols_to_vars,
          outputs)
    ge_input_layer(features, ours, weight_collections, trainable,
                   cols_to_vars, outputs, scope=_stock_input_layer_scope())
    ordered = sorted(outputs.items(), key=lambda item: item[0].name)
    if cols_to_output_tensors is not None:
        cols_to_output_tensors.update(ordered)
    return tf.concat([t for _, t in ordered], 1)
