"""EmbeddingVariables as stock-TF lookups, for SavedModels that plain
TensorFlow serves (the mechanism of tutorials/serving.py, for TF1 graphs).

An EV lives in a C++ resource of this library, which a model server does
not have. `replace_ev_gathers` rewires every `EVGroupGather` op of an
inference graph to read a frozen copy of the restored tables instead:

* a `tf.lookup.StaticHashTable` from admitted key to row, and the rows of
  the admitted keys as a constant (keys still under a `CounterFilter` are
  left out: they read as unknown, as they do in training);
* for unknown keys, what a `training=False` lookup reads: the filter's
  `default_value_no_permission` under a `CounterFilter`, else row
  `key mod default_value_dim` of the EV's default matrix.
"""

from typing import List

import numpy as np
import tensorflow as tf

from group_embedding.embedding_variable.variable import EmbeddingVariable

EV_GATHER_OP = "EVGroupGather"


class EmbeddingSnapshot:
    """A frozen, stock-TF copy of one EV's content, built in the current
    graph.

    Args:
        keys: `[n]` int64 keys held by the EV.
        values: `[n, D]` their rows.
        freqs: `[n]` their occurrence counts.
        default_values: `[default_value_dim, D]` the EV's default matrix.
        filter_freq: the `CounterFilter`'s threshold, 0 for none.
        no_permission: value read by keys not (yet) admitted by the filter.
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray,
                 freqs: np.ndarray, default_values: np.ndarray,
                 filter_freq: int, no_permission: float):
        admitted = freqs >= filter_freq
        keys = keys[admitted].astype(np.int64)
        values = values[admitted].astype(np.float32)
        dim = default_values.shape[1]
        self._table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(
                tf.constant(keys, tf.int64),
                tf.range(len(keys), dtype=tf.int64)),
            default_value=-1)
        # One extra row at the end, so that unknown keys gather a valid
        # row even when no key was admitted; `tf.where` then replaces it.
        self._values = tf.constant(np.concatenate(
            [values, np.zeros([1, dim], np.float32)]), name="values")
        self._filtered = filter_freq > 0
        if self._filtered:
            self._defaults = tf.constant(
                np.full([1, dim], no_permission, np.float32),
                name="no_permission")
        else:
            self._defaults = tf.constant(default_values.astype(np.float32),
                                         name="default_values")

    def lookup(self, keys: tf.Tensor) -> tf.Tensor:
        """`[n, D]` rows for int64 keys `[n]`, as `EVGroupGather` reads
        them with `training=False`."""
        keys = tf.cast(keys, tf.int64)
        index = self._table.lookup(keys)
        found = index >= 0
        last = tf.shape(self._values, out_type=tf.int64)[0] - 1
        rows = tf.gather(self._values, tf.where(found, index, last))
        if self._filtered:
            default = tf.broadcast_to(self._defaults, tf.shape(rows))
        else:
            size = tf.shape(self._defaults, out_type=tf.int64)[0]
            default = tf.gather(self._defaults, tf.math.floormod(keys, size))
        return tf.where(found[:, None], rows, default)


def snapshot_of(ev: EmbeddingVariable, session) -> EmbeddingSnapshot:
    """Reads `ev` in `session` and builds its snapshot in the current
    graph."""
    keys, values, _, freqs = session.run(ev.export())
    defaults = session.run(ev.default_values)
    option = ev.ev_option
    filter_freq = (option.filter_option.filter_freq
                   if option.filter_option is not None else 0)
    return EmbeddingSnapshot(
        keys, values, freqs, defaults, filter_freq,
        float(option.init_option.default_value_no_permission))


def replace_ev_gathers(graph: tf.Graph, session) -> int:
    """Makes every consumer of an `EVGroupGather` op read snapshots.

    Args:
        graph: the inference graph (built with `training=False` lookups on
            the pure-TF path, `GROUP_EMBEDDING_KERNELS=tf`, so that EV rows
            come from `EVGroupGather`).
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
                                   if op.type == EV_GATHER_OP]
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
