"""`sequence_input_layer` for TF1-style graphs: sequence columns in,
`([B, T, sum of dims], sequence_length)` out.

DeepRec scripts (modelzoo BST, DIN, DIEN) call
`tf.contrib.feature_column.sequence_input_layer(features, columns)` on
`embedding_column`s of `sequence_categorical_column_with_*` columns
(`_with_embedding` for EV tables). Here the columns of one
`group_embedding_column_scope` share ONE unpooled grouped lookup
(`group_embedding_lookup_sparse(..., is_sequence=True)`); tables are
created and cached exactly as by `input_layer`.
"""

from typing import Optional
from typing import Tuple

import tensorflow as tf

from group_embedding.feature_column import column_lookup
from group_embedding.feature_column import sparse_ids

# By name: the package exports the function `input_layer`, which hides the
# module of the same name as an attribute.
from group_embedding.feature_column.input_layer import check_context
from group_embedding.feature_column.input_layer import embed_columns

_DEFAULT_SCOPE = "sequence_input_layer"


def sequence_input_layer(features, feature_columns, weight_collections=None,
                         trainable: bool = True, *,
                         scope: Optional[str] = None, training=True
                         ) -> Tuple[tf.Tensor, tf.Tensor]:
    """Unpooled embeddings of sequence columns and their lengths.

    Equals stock sequence feature columns on the same weights (TF 1.15's
    `tf.contrib.feature_column.sequence_input_layer`, TF 2's
    `SequenceFeatures`): position t of row b holds the row of the id at
    column t of the `[B, T]` input, zeros where there is none (padding,
    out-of-vocabulary ids); columns are concatenated sorted by name.

    Example::

        hist = tf.feature_column.sequence_categorical_column_with_identity(
            "hist", 1000)
        with ge.feature_column.group_embedding_column_scope("seq"):
            cols = [ge.feature_column.embedding_column(hist, 8)]
        x, length = ge.feature_column.sequence_input_layer(features, cols)
        # x: [B, T, 8]; length: [B] int64, last id position + 1.

    Args:
        features: dict from feature key to a `[B, T]` SparseTensor,
            RaggedTensor `[B, None]` or dense tensor (-1 / "" = missing).
        feature_columns: `ge.feature_column.embedding_column`s over
            `sequence_categorical_column_with_*` (stock identity /
            hash_bucket / vocabulary columns, or
            `sequence_categorical_column_with_embedding`), all with the
            same sequence lengths.
        weight_collections: extra graph collections for the tables.
        trainable: if False, no table is trainable (default True).
        scope: (keyword only) variable scope of the tables, default
            "sequence_input_layer".
        training: (keyword only) Python or tensor bool, default True;
            False stops EV tables from inserting new keys.

    Returns:
        (float32 `[B, T, sum of dims]`, int64 `[B]` sequence lengths). T is
        the padded length of the inputs (`dense_shape[1]`).

    Raises:
        RuntimeError: called eagerly or inside a tf.function.
        TypeError: a column that is not an embedding of a sequence column,
            or bad features (see `input_layer`).
        ValueError: a feature key missing, duplicate column names.
        tf.errors.InvalidArgumentError: (at run time) columns whose
            sequence lengths differ.
    """
    check_context()
    columns = column_lookup.check_feature_columns(feature_columns,
                                                  sequence=True)
    embedded, _, cache, state = embed_columns(
        features, columns, weight_collections, trainable,
        scope or _DEFAULT_SCOPE, training)
    lengths = [sparse_ids.sequence_length(c, cache, state.state_manager)
               for c in columns]
    length = lengths[0]
    if len(lengths) > 1:
        checks = [tf.debugging.assert_equal(
            length, other,
            message=f"sequence_input_layer: columns '{columns[0].name}' "
                    f"and '{c.name}' have different sequence lengths.")
            for c, other in zip(columns[1:], lengths[1:])]
        with tf.control_dependencies(checks):
            length = tf.identity(length)
    outputs = [embedded[c] for c in columns]
    dense = outputs[0] if len(outputs) == 1 else tf.concat(outputs, -1)
    return dense, length
