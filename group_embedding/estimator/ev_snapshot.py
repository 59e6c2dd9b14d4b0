"""EmbeddingVariables as stock-TF lookups, for SavedModels that plain
TensorFlow serves (the mechanism of tutorials/serving.py, for TF1 graphs).

An EV lives in a C++ resource of this library, which a model server does
not have. `replace_ev_gathers` rewires every `GroupEmbeddingEVGather` op of an
inference graph to read a frozen copy of the restored tables instead:
`ops/ev_snapshot.EmbeddingSnapshot` (the snapshot TF2 SavedModels hold
too), here as constants of the graph.
"""

from typing import List

import tensorflow as tf

from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.ops import ev_snapshot
from group_embedding.ops import op_names

EV_GATHER_OPS = op_names.with_alias("GroupEmbeddingEVGather")


def snapshot_of(ev: EmbeddingVariable,
                session) -> ev_snapshot.EmbeddingSnapshot:
    """Reads `ev` in `session` and builds its snapshot (constants) in the
    current graph."""
    keys, values, _, freqs = session.run(ev.export())
    defaults = session.run(ev.default_values)
    return ev_snapshot.from_arrays(ev, keys, values, freqs, defaults,
                                   as_variables=False)


def replace_ev_gathers(graph: tf.Graph, session) -> int:
    """Makes every consumer of an `GroupEmbeddingEVGather` op read snapshots.

    Args:
        graph: the inference graph (built with `training=False` lookups on
            the pure-TF path, `GROUP_EMBEDDING_KERNELS=tf`, so that EV rows
            come from `GroupEmbeddingEVGather`).
        session: a session of `graph` holding the restored EVs.

    Returns:
        The number of ops replaced.

    Raises:
        ValueError: an op reads an EV that is not in the graph's
            SAVEABLE_OBJECTS collection.
    """
    evs = {ev.handle.name: ev for ev in graph.get_collection(
        tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS)
        if isinstance(ev, EmbeddingVariable)}
    snapshots = {}
    gathers: List[tf.Operation] = [op for op in graph.get_operations()
                                   if op.type in EV_GATHER_OPS]
    with graph.as_default():
        for op in gathers:
            k = (len(op.inputs) - 1) // 3  # handles, keys, defaults, flag
            parts = []
            for handle, keys in zip(op.inputs[:k], op.inputs[k:2 * k]):
                ev = evs.get(handle.name)
                if ev is None:
                    raise ValueError(
                        f"Op '{op.name}' reads the EmbeddingVariable "
                        f"handle '{handle.name}', which is not in the "
                        "graph's SAVEABLE_OBJECTS collection.")
                if ev.name not in snapshots:
                    with tf.compat.v1.name_scope("ev_snapshot"):
                        snapshots[ev.name] = snapshot_of(ev, session)
                with tf.compat.v1.name_scope(op.name + "_snapshot"):
                    parts.append(snapshots[ev.name].lookup(keys))
            rows = parts[0] if k == 1 else tf.concat(parts, 0)
            output = op.outputs[0]
            for consumer in list(output.consumers()):
                for i, tensor in enumerate(consumer.inputs):
                    if tensor is output:
                        # No public API rewires an existing op's input.
                        consumer._update_input(i, rows)  # noqa: SLF001
    return len(gathers)
