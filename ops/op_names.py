"""The names of this library's TF ops, and their pre-rename aliases.

Every op is named `GroupEmbedding` + family + action (ops/kernels/
op_registration.h): no family word for the plain-table lookups
(`GroupEmbeddingPooledLookup`, `...ConcatLookup`, `...SequenceLookup`,
their gradients and weight gradients), `EV` for EmbeddingVariable storage,
lookups and updates, `Collective` for the model-parallel kernels, `Peer`
for the transport. The prefix keeps TF's global op names apart from other
libraries' (DeepRec's and Deepray's register ops of their own).

Ops renamed to this scheme keep their old name registered as an alias,
with the same OpDef and CPU kernel, so that graphs saved before the rename
(TF1 MetaGraphs, checkpoint graphs: any forward, gradient or apply op of a
training script) still import and run. Code that matches op types or
registers gradients covers both names through `with_alias`.
"""

from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Sequence
from typing import Tuple

import tensorflow as tf

PREFIX = "GroupEmbedding"

# Old name -> new name, for every renamed op.
ALIASES: Dict[str, str] = {
    # Plain-table lookup: "Variable" meant a tf.Variable table.
    "GroupEmbeddingVariableLookup": "GroupEmbeddingPooledLookup",
    "GroupEmbeddingVariableLookupGrad": "GroupEmbeddingPooledLookupGrad",
    # Ids and sparse apply.
    "GroupSparseToRagged": "GroupEmbeddingSparseToRagged",
    "GroupUnpackIds": "GroupEmbeddingUnpackIds",
    "GroupSparseApplyAdagrad": "GroupEmbeddingSparseApplyAdagrad",
    # EmbeddingVariable.
    "EVHandleOp": "GroupEmbeddingEVHandle",
    "EVEnsureSlot": "GroupEmbeddingEVEnsureSlot",
    "EVSize": "GroupEmbeddingEVSize",
    "EVExport": "GroupEmbeddingEVExport",
    "EVExportChanges": "GroupEmbeddingEVExportChanges",
    "EVDeltaBase": "GroupEmbeddingEVDeltaBase",
    "EVConfirmSave": "GroupEmbeddingEVConfirmSave",
    "EVImport": "GroupEmbeddingEVImport",
    "EVEvict": "GroupEmbeddingEVEvict",
    "EVApplySGD": "GroupEmbeddingEVApplySGD",
    "EVApplyAdagrad": "GroupEmbeddingEVApplyAdagrad",
    "EVApplyAdagradDecay": "GroupEmbeddingEVApplyAdagradDecay",
    "EVApplyAdam": "GroupEmbeddingEVApplyAdam",
    "EVApplyFtrl": "GroupEmbeddingEVApplyFtrl",
    "EVGroupLookup": "GroupEmbeddingEVLookup",
    "EVGroupSequenceLookup": "GroupEmbeddingEVSequenceLookup",
    "EVGroupWeightGrad": "GroupEmbeddingEVWeightGrad",
    "EVGroupGather": "GroupEmbeddingEVGather",
    # Collective (model-parallel) lookup.
    "CollectiveRouteIds": "GroupEmbeddingCollectiveRouteIds",
    "CollectiveOwnerGather": "GroupEmbeddingCollectiveOwnerGather",
    "CollectiveOwnerGatherGrad": "GroupEmbeddingCollectiveOwnerGatherGrad",
    "CollectivePool": "GroupEmbeddingCollectivePool",
    "CollectivePoolGrad": "GroupEmbeddingCollectivePoolGrad",
    "CollectivePoolWeightGrad": "GroupEmbeddingCollectivePoolWeightGrad",
    # Transport.
    "PeerAllToAll": "GroupEmbeddingPeerAllToAll",
}

_OLD_NAME = {new: old for old, new in ALIASES.items()}


def with_alias(op_type: str) -> Tuple[str, ...]:
    """`op_type` (a current name) and its pre-rename alias, if it has one.

    Raises:
        ValueError: `op_type` is an old name (pass the current one).
    """
    if op_type in ALIASES:
        raise ValueError(f"Invalid `op_type`: {op_type!r} is the old name "
                         f"of {ALIASES[op_type]!r}; pass the current one.")
    old = _OLD_NAME.get(op_type)
    return (op_type,) if old is None else (op_type, old)


def register_gradient(op_type: str) -> Callable:
    """`tf.RegisterGradient` for op `op_type` and its alias (a decorator):
    an old graph, imported, differentiates as a new one."""
    def register(fn: Callable) -> Callable:
        for name in with_alias(op_type):
            tf.RegisterGradient(name)(fn)
        return fn
    return register


def string_list_attr(op: Any, name: str) -> List[str]:
    """Attr `name` of `op`, a list(string), as `str` values: a graph op
    gives bytes, and the kernels' attrs want the names back as text."""
    return [v.decode() if isinstance(v, bytes) else v
            for v in op.get_attr(name)]


def output_grads(op: Any, grads: Sequence[Any]) -> List[tf.Tensor]:
    """The gradient of every output of `op`, as a gradient function gets
    them: TF passes None for an unused output, and the gradient kernels
    want one tensor per output, so an unused one gets zeros."""
    return [tf.zeros_like(o) if g is None else tf.convert_to_tensor(g)
            for g, o in zip(grads, op.outputs)]
