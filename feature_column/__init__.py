"""DeepRec-style feature columns (`group_embedding.feature_column`).

Columns built inside `group_embedding_column_scope` share one grouped
lookup; `input_layer` (TF1 graphs) and the Keras layer
`GroupEmbeddingFeatures` (TF2) turn them into one dense tensor that equals
stock `tf.compat.v1.feature_column.input_layer` on the same weights;
`sequence_input_layer` does the same for sequence columns (`[B, T, D]`).
"""

from group_embedding.feature_column.columns import (
    categorical_column_with_embedding,
)
from group_embedding.feature_column.columns import embedding_column
from group_embedding.feature_column.columns import (
    sequence_categorical_column_with_embedding,
)
from group_embedding.feature_column.columns import shared_embedding_columns
from group_embedding.feature_column.input_layer import input_layer
from group_embedding.feature_column.keras_layer import GroupEmbeddingFeatures
from group_embedding.feature_column.scope import group_embedding_column_scope
from group_embedding.feature_column.sequence_input_layer import (
    sequence_input_layer,
)

__all__ = [
    "GroupEmbeddingFeatures",
    "categorical_column_with_embedding",
    "embedding_column",
    "group_embedding_column_scope",
    "input_layer",
    "sequence_categorical_column_with_embedding",
    "sequence_input_layer",
    "shared_embedding_columns",
]
