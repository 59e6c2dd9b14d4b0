"""group-embedding: DeepRec's embedding stack on stock TensorFlow 2.

Users write `import group_embedding as ge`; everything public is listed in
`__all__`.
"""

from group_embedding import feature_column
from group_embedding import optimizers
from group_embedding import train
from group_embedding.deeprec.checkpoint import restore_deeprec_checkpoint
from group_embedding.deeprec.stock_lookups import embedding_lookup
from group_embedding.deeprec.stock_lookups import embedding_lookup_sparse
from group_embedding.deeprec.stock_lookups import gather
from group_embedding.deeprec.stock_lookups import safe_embedding_lookup_sparse
from group_embedding.distributed.checkpoint import latest_checkpoint
from group_embedding.distributed.checkpoint import restore_tables
from group_embedding.distributed.checkpoint import save_tables
from group_embedding.distributed.enable import enable_distributed_strategy
from group_embedding.distributed.export import export_from_checkpoint
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.distributed.sharded_variable import get_embedding_table
from group_embedding.distributed.training import BroadcastVariablesHook
from group_embedding.distributed.training import DistributedGradientTape
from group_embedding.distributed.training import DistributedOptimizer
from group_embedding.distributed.training import allreduce_gradients
from group_embedding.distributed.training import broadcast_variables
from group_embedding.embedding_variable.options import CacheStrategy
from group_embedding.embedding_variable.options import CBFFilter
from group_embedding.embedding_variable.options import CounterFilter
from group_embedding.embedding_variable.options import EmbeddingVariableOption
from group_embedding.embedding_variable.options import GlobalStepEvict
from group_embedding.embedding_variable.options import InitializerOption
from group_embedding.embedding_variable.options import L2WeightEvict
from group_embedding.embedding_variable.options import StorageOption
from group_embedding.embedding_variable.options import StorageType
from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.embedding_variable.variable import get_embedding_variable
from group_embedding.export.saved_model import export_saved_model
from group_embedding.lookup import group_embedding_lookup
from group_embedding.lookup import group_embedding_lookup_sparse
from group_embedding.packed_ids import PackedIds
from group_embedding.packed_ids import pack_ids

__version__ = "0.1.0"


def __getattr__(name):
    # The estimator (a tf.estimator for TF 2.21) is imported when first
    # used, not by every `import group_embedding`.
    if name == "estimator":
        import importlib
        return importlib.import_module("group_embedding.estimator")
    raise AttributeError(f"module 'group_embedding' has no attribute "
                         f"{name!r}")


__all__ = [
    "BroadcastVariablesHook",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "ShardedVariable",
    "allreduce_gradients",
    "broadcast_variables",
    "enable_distributed_strategy",
    "export_from_checkpoint",
    "get_embedding_table",
    "latest_checkpoint",
    "restore_deeprec_checkpoint",
    "restore_tables",
    "save_tables",
    "CBFFilter",
    "CacheStrategy",
    "CounterFilter",
    "EmbeddingVariable",
    "EmbeddingVariableOption",
    "GlobalStepEvict",
    "InitializerOption",
    "L2WeightEvict",
    "StorageOption",
    "StorageType",
    "embedding_lookup",
    "embedding_lookup_sparse",
    "estimator",
    "export_saved_model",
    "feature_column",
    "gather",
    "get_embedding_variable",
    "group_embedding_lookup",
    "group_embedding_lookup_sparse",
    "pack_ids",
    "PackedIds",
    "optimizers",
    "safe_embedding_lookup_sparse",
    "train",
]
