"""EmbeddingVariable: a dynamic-vocabulary table keyed by arbitrary ids.

`variable` holds the table and `get_embedding_variable`, `options` the
admission/eviction/initializer options, `keras_variable` the wrapper that
lets Keras track and save an EV as a model weight.
"""

from group_embedding.embedding_variable.keras_variable import (
    KerasEmbeddingVariable,
)
from group_embedding.embedding_variable.options import CBFFilter
from group_embedding.embedding_variable.options import CounterFilter
from group_embedding.embedding_variable.options import EmbeddingVariableOption
from group_embedding.embedding_variable.options import GlobalStepEvict
from group_embedding.embedding_variable.options import InitializerOption
from group_embedding.embedding_variable.options import L2WeightEvict
from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.embedding_variable.variable import get_embedding_variable

__all__ = [
    "CBFFilter",
    "CounterFilter",
    "EmbeddingVariable",
    "EmbeddingVariableOption",
    "GlobalStepEvict",
    "InitializerOption",
    "KerasEmbeddingVariable",
    "L2WeightEvict",
    "get_embedding_variable",
]
