"""Collective (model-parallel) training over Horovod.

`strategy` starts Horovod and holds its state (this worker's rank and
the size: `group_embedding.model_parallel.world`); `sharded_variable` splits
tables over workers; `collective_lookup` routes ids to their owners and
rows back; `training` reduces gradients and broadcasts dense weights;
`sharding_plan` chooses replicated, table-wise or row-sharded tables;
`checkpoint` saves per-worker shards that restore at any worker count;
`pipeline` lets a custom loop exchange the next batch's ids during the
current step (`exchange_ids`, `use_exchanged_ids`).
"""

from group_embedding.distributed.checkpoint import latest_checkpoint
from group_embedding.distributed.checkpoint import restore_tables
from group_embedding.distributed.checkpoint import save_tables
from group_embedding.distributed.enable import enable_distributed_strategy
from group_embedding.distributed.export import export_from_checkpoint
from group_embedding.distributed.pipeline import exchange_ids
from group_embedding.distributed.pipeline import use_exchanged_ids
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.distributed.sharded_variable import get_embedding_table
from group_embedding.distributed.sharding_plan import plan_placements
from group_embedding.distributed.training import BroadcastVariablesHook
from group_embedding.distributed.training import DistributedGradientTape
from group_embedding.distributed.training import DistributedOptimizer
from group_embedding.distributed.training import allreduce_gradients
from group_embedding.distributed.training import broadcast_variables

__all__ = [
    "BroadcastVariablesHook",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "ShardedVariable",
    "allreduce_gradients",
    "broadcast_variables",
    "enable_distributed_strategy",
    "export_from_checkpoint",
    "exchange_ids",
    "get_embedding_table",
    "latest_checkpoint",
    "plan_placements",
    "restore_tables",
    "save_tables",
    "use_exchanged_ids",
]
