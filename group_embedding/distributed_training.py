"""What a training loop needs in collective mode.

Gradients of a table shard are complete on its owner (the all-to-all
backward already summed every worker's contribution), so they are only
rescaled; every other gradient (dense layers, replicated tables) is
averaged over the workers with `allreduce`. With each worker minimising the
mean loss of its slice of the global batch, the result equals the
single-process step on the whole batch.

- custom loops: `ge.DistributedGradientTape(tape)` or `allreduce_gradients`;
- Keras `model.fit`: `model.compile(optimizer=ge.DistributedOptimizer(opt))`;
- start: `ge.broadcast_variables(model.variables)` so dense weights agree.
"""

import keras
import tensorflow as tf

from group_embedding import distributed_strategy
from group_embedding.ops import sparse_apply


@tf.autograph.experimental.do_not_convert
def allreduce_gradients(gradients, variables):
    """Turns per-worker gradients into those of the global batch.

    Args:
        gradients: list of gradients (Tensor, IndexedSlices or None).
        variables: the matching variables.

    Returns:
        The list of reduced gradients (unchanged outside collective mode).
    """
    if not distributed_strategy.is_collective():
        return list(gradients)
    hvd = distributed_strategy.horovod()
    size = hvd.size()
    reduced = []
    for g, v in zip(gradients, variables):
        if g is None:
            reduced.append(None)
        elif distributed_strategy.is_shard(v) or hasattr(v, "lookup_rows"):
            if isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(g.values / size, g.indices,
                                     g.dense_shape)
            else:
                g = g / size
            reduced.append(_unique_rows(g))
        else:
            reduced.append(_unique_rows(hvd.allreduce(g, op=hvd.Average)))
    return reduced


def _unique_rows(grad):
    """Sums the rows of IndexedSlices that share an index.

    Several workers may send gradient rows for one id (and Horovod's
    allreduce of IndexedSlices concatenates them); optimizers that square
    sparse values (Keras Adam) would then see sum(g^2), not (sum g)^2.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    indices, values = sparse_apply.dedup(grad.indices, grad.values)
    return tf.IndexedSlices(values, indices, grad.dense_shape)


class DistributedGradientTape:
    """A `tf.GradientTape` whose `gradient()` reduces across workers.

    Args:
        tape: the `tf.GradientTape` that recorded the step.
    """

    def __init__(self, tape: tf.GradientTape):
        self._tape = tape

    def gradient(self, target, sources, **kwargs):
        """Like `tf.GradientTape.gradient`, then `allreduce_gradients`."""
        grads = self._tape.gradient(target, sources, **kwargs)
        if isinstance(sources, (list, tuple)):
            return allreduce_gradients(grads, sources)
        return allreduce_gradients([grads], [sources])[0]


def broadcast_variables(variables, root_rank=0):
    """Copies root's values of the non-shard variables to every worker.

    For an EmbeddingVariable, its default-value matrix is broadcast (new
    keys must start from the same rows whichever worker owns them); its
    keys stay where they are.
    """
    if not distributed_strategy.is_collective():
        return
    hvd = distributed_strategy.horovod()
    dense = []
    for v in variables:
        if isinstance(v, keras.Variable):
            v = v.value
        if hasattr(v, "default_values"):
            v = v.default_values
        if not distributed_strategy.is_shard(v):
            dense.append(v)
    if dense:
        hvd.broadcast_variables(dense, root_rank=root_rank)


def DistributedOptimizer(optimizer):  # noqa: N802 - reads like a class
    """Makes a Keras 3 optimizer reduce gradients before applying them.

    Args:
        optimizer: a `keras.optimizers.Optimizer` instance (any, including
            `ge.optimizers.*`).

    Returns:
        The same optimizer object, now of a subclass whose `apply` (used by
        `model.fit` and `apply_gradients`) calls `allreduce_gradients`.
    """
    base = type(optimizer)
    if getattr(base, "_ge_distributed", False):
        return optimizer

    def apply(self, grads, trainable_variables=None):
        variables = (trainable_variables if trainable_variables is not None
                     else self._trainable_variables)
        grads = allreduce_gradients(list(grads), list(variables))
        return base.apply(self, grads, trainable_variables)

    optimizer.__class__ = type(f"Distributed{base.__name__}", (base,),
                               {"apply": apply, "_ge_distributed": True})
    return optimizer
