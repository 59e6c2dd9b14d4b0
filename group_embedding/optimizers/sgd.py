"""SGD with row-wise sparse updates (Keras 3 optimizer)."""

import keras
import tensorflow as tf

from group_embedding.ops import backward_apply
from group_embedding.ops import sparse_apply
from group_embedding.optimizers.base_optimizer import BaseOptimizer


# Registered so that `keras.models.load_model` finds it in a saved model.
@keras.saving.register_keras_serializable(package="group_embedding")
class SGD(BaseOptimizer, keras.optimizers.SGD):
    """`keras.optimizers.SGD` that also trains `EmbeddingVariable`s.

    `var -= lr * g` on the touched rows only; without momentum, sparse
    gradients of plain variables are applied with one `scatter_sub`
    instead of Keras's dense rewrite. Arguments are Keras's.

    Raises:
        NotImplementedError: (at apply) `momentum` != 0 with an
            EmbeddingVariable.
    """

    def _ev_update_step(self, gradient, variable, learning_rate):
        if self.momentum != 0:
            raise NotImplementedError(
                f"SGD: `momentum`={self.momentum} is not supported for "
                f"EmbeddingVariable '{variable.name}'; use momentum=0.")
        variable.storage.apply_sgd(variable.handle, gradient.indices,
                             gradient.values, self._ev_step(),
                             learning_rate)

    def _fused_rule(self):
        if self.momentum != 0:
            return None
        return backward_apply.Rule(
            "sgd", lambda variable: [],
            backward_apply.hyper(lr=self._get_current_learning_rate()))

    def update_step(self, gradient, variable, learning_rate):
        if isinstance(gradient, tf.IndexedSlices) and self.momentum == 0:
            sparse_apply.sgd(variable, tf.cast(learning_rate,
                                               variable.dtype),
                             gradient.indices, gradient.values)
            return
        super().update_step(gradient, variable, learning_rate)
