"""Sparse optimizer updates on resource variables (rows touched only).

Duplicate indices are summed first, so every update equals the dense update
with the densified gradient.
"""

import keras
import tensorflow as tf

from group_embedding.ops import kernel_library


def _resource(variable):
    # keras.Variable wraps a tf.Variable; the kernels want its handle.
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable


def dedup(indices, values):
    """Sums the rows of `values` that share an index: (unique, summed)."""
    unique, slot = tf.unique(tf.cast(indices, tf.int64))
    summed = tf.math.unsorted_segment_sum(values, slot, tf.size(unique))
    return unique, summed


def adagrad(variable, accum, lr, epsilon, indices, values):
    """`accum[i] += g^2; variable[i] -= lr * g / (sqrt(accum[i]) + eps)`.

    Args:
        variable: `[rows, D]` variable (tf.Variable or keras.Variable).
        accum: its accumulator, same shape.
        lr: scalar learning rate.
        epsilon: float added to the square root.
        indices: `[n]` row indices, duplicates allowed.
        values: `[n, D]` gradient rows.
    """
    var, acc = _resource(variable), _resource(accum)
    lib = kernel_library.load()
    if (lib is not None and var.dtype == tf.float32
            and not tf.config.list_logical_devices("GPU")):
        return lib.group_sparse_apply_adagrad(
            var=var.handle, accum=acc.handle, lr=tf.cast(lr, tf.float32),
            epsilon=tf.constant(epsilon, tf.float32),
            indices=tf.cast(indices, tf.int64),
            grad=tf.cast(values, tf.float32))
    unique, g = dedup(indices, tf.cast(values, var.dtype))
    acc.scatter_add(tf.IndexedSlices(g * g, unique))
    rows = tf.gather(acc, unique)
    return var.scatter_sub(tf.IndexedSlices(
        lr * g / (tf.sqrt(rows) + epsilon), unique))
