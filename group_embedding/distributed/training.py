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

from typing import Any
from typing import List
from typing import Sequence

import keras
import tensorflow as tf

from group_embedding import model_parallel
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed import transport
from group_embedding.embedding_variable.keras_variable import (
    embedding_variable_of,
)
from group_embedding.ops import backward_apply
from group_embedding.ops import collective_routing
from group_embedding.ops import sparse_apply
from group_embedding.ops import tf_variables


@tf.autograph.experimental.do_not_convert
def allreduce_gradients(gradients: Sequence[Any],
                        variables: Sequence[Any]) -> List[Any]:
    """Turns per-worker gradients into those of the global batch.

    Args:
        gradients: list of gradients (Tensor, IndexedSlices or None).
        variables: the matching variables.

    Returns:
        The list of reduced gradients (unchanged outside collective mode).
    """
    if not distributed_strategy.is_collective():
        return list(gradients)
    gradients, variables = list(gradients), list(variables)
    hvd = distributed_strategy.horovod()
    size = hvd.size()
    if size == 1:
        # One worker: the single-process step, no collective to wait on.
        return gradients
    reduced: List[Any] = []
    dense_at = []
    for i, (g, v) in enumerate(zip(gradients, variables)):
        if g is None:
            reduced.append(None)
        elif (distributed_strategy.is_shard(v)
              or embedding_variable_of(v) is not None):
            # Shards and EmbeddingVariables: every worker's gradient rows
            # already reached the owner through the all-to-all backward.
            hbm = backward_apply.scaled_hbm_gradient(g, 1.0 / size)
            if hbm is not None:
                # An HBM EV's, for its lookup's fused update, which sums
                # the rows of a key itself.
                reduced.append(hbm)
                continue
            scaled = collective_routing.scaled_shard_gradient(g, 1.0 / size)
            if scaled is not None:
                g = scaled
            elif isinstance(g, tf.IndexedSlices):
                g = tf.IndexedSlices(g.values / size, g.indices,
                                     g.dense_shape)
            else:
                g = g / size
            reduced.append(_unique_rows(g))
        elif isinstance(g, tf.IndexedSlices):
            reduced.append(_unique_rows(_allreduce_slices(hvd, g, i)))
        else:
            reduced.append(None)
            dense_at.append(i)
    if dense_at:
        # All dense gradients in one reduction: one reduce-scatter +
        # all-gather over the peer sockets, or one grouped Horovod request.
        dense = [tf.convert_to_tensor(gradients[i]) for i in dense_at]
        if transport.active():
            averaged = transport.tracked(
                hvd, lambda xs: transport.allreduce_mean(
                    xs, "dense_gradients"), dense)
        else:
            averaged = hvd.grouped_allreduce(dense, op=hvd.Average)
        for i, g in zip(dense_at, averaged):
            reduced[i] = g
    return reduced


def _allreduce_slices(hvd, grad, i):
    """Averaged IndexedSlices: every worker's rows, concatenated."""
    if not transport.active():
        return hvd.allreduce(grad, op=hvd.Average)
    size = transport.world_size()
    values, indices = transport.tracked(
        hvd, lambda vi: (transport.allgather(vi[0], f"slices{i}/values"),
                         transport.allgather(vi[1], f"slices{i}/indices")),
        (grad.values, grad.indices))
    return tf.IndexedSlices(values / size, indices, grad.dense_shape)


# Ops whose gradient indices are already distinct (the C++ collective
# lookup sums every source's rows per id): no second dedup needed.
_DISTINCT_INDEX_OPS = collective_routing.OWNER_GRAD_OPS


def _unique_rows(grad):
    """Sums the rows of IndexedSlices that share an index.

    Several workers may send gradient rows for one id (and Horovod's
    allreduce of IndexedSlices concatenates them); optimizers that square
    sparse values (Keras Adam) would then see sum(g^2), not (sum g)^2.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    # Graph mode only: eager tensors have no producing op to ask.
    op = getattr(grad.indices, "op", None)
    if op is not None and op.type in _DISTINCT_INDEX_OPS:
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


def broadcast_variables(variables: Sequence[Any],
                        root_rank: int = 0) -> None:
    """Copies root's values of the non-shard variables to every worker.

    For an EmbeddingVariable, its default-value matrix is broadcast (new
    keys must start from the same rows whichever worker owns them); its
    keys stay where they are.
    """
    if model_parallel.world()[1] == 1:
        return  # one worker (or none): nothing to copy
    hvd = distributed_strategy.horovod()
    dense = []
    for v in variables:
        # Ask before unwrapping: Keras may have swapped the tf.Variable
        # behind a keras.Variable since the shard was registered.
        if distributed_strategy.is_shard(v):
            continue
        ev = embedding_variable_of(v)
        if ev is not None:
            dense.append(ev.default_values)
            continue
        dense.append(tf_variables.to_tf_variable(v))
    if dense:
        hvd.broadcast_variables(dense, root_rank=root_rank)


class BroadcastVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1: after the session starts, copies worker `root_rank`'s values of
    every global variable that is not a table shard to all workers (and
    EmbeddingVariables' default rows), so dense weights start equal.

    Args:
        root_rank: the worker whose values win, default 0.
    """

    def __init__(self, root_rank=0):
        self._root_rank = root_rank
        self._op = None

    def begin(self):
        if not distributed_strategy.is_collective():
            return
        hvd = distributed_strategy.horovod()
        dense = [v for v in tf.compat.v1.global_variables()
                 if not distributed_strategy.is_shard(v)]
        if dense:
            self._op = hvd.broadcast_variables(dense, self._root_rank)

    def after_create_session(self, session, coord):
        del coord
        if self._op is not None:
            session.run(self._op)


def DistributedOptimizer(optimizer):  # noqa: N802 - reads like a class
    """Makes an optimizer reduce gradients across workers before applying.

    Args:
        optimizer: a Keras 3 optimizer (any, including `ge.optimizers.*`),
            or a `tf.compat.v1.train.Optimizer` (including `ge.train.*`).

    Returns:
        The same optimizer object, now of a subclass whose `apply` (Keras:
        used by `model.fit` and `apply_gradients`) or `compute_gradients`
        (TF1: used by `minimize`) calls `allreduce_gradients`.

    Raises:
        TypeError: `optimizer` is neither kind.
    """
    base = type(optimizer)
    if getattr(base, "_ge_distributed", False):
        return optimizer
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        def compute_gradients(self, *args, **kwargs):
            # A stock optimizer that would skip the loss's EVs raises
            # here (embedding_variable/stock_optimizer_guard.py).
            pairs = base.compute_gradients(self, *args, **kwargs)
            grads = allreduce_gradients([g for g, _ in pairs],
                                        [v for _, v in pairs])
            return list(zip(grads, [v for _, v in pairs]))

        optimizer.__class__ = type(
            f"Distributed{base.__name__}", (base,),
            {"compute_gradients": compute_gradients,
             "_ge_distributed": True})
        return optimizer
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError("`optimizer` must be a Keras or tf.compat.v1.train "
                        f"optimizer, got {base.__name__}.")

    def apply(self, grads, trainable_variables=None):
        variables = (trainable_variables if trainable_variables is not None
                     else self._trainable_variables)
        grads = allreduce_gradients(list(grads), list(variables))
        return base.apply(self, grads, trainable_variables)

    optimizer.__class__ = type(f"Distributed{base.__name__}", (base,),
                               {"apply": apply, "_ge_distributed": True})
    return optimizer
