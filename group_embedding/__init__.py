"""group-embedding: DeepRec's embedding stack on stock TensorFlow 2.

Users write `import group_embedding as ge`; everything public is listed in
`__all__`.
"""

from group_embedding import optimizers
from group_embedding.lookup import group_embedding_lookup
from group_embedding.lookup import group_embedding_lookup_sparse

__version__ = "0.1.0"

__all__ = [
    "group_embedding_lookup",
    "group_embedding_lookup_sparse",
    "optimizers",
]
