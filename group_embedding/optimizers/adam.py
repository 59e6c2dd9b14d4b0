"""Lazy Adam: row-wise sparse updates (Keras 3 optimizer)."""

import keras
import tensorflow as tf

from group_embedding.ops import backward_apply
from group_embedding.ops import sparse_apply
from group_embedding.optimizers.base_optimizer import BaseOptimizer

EV_SLOTS = ("adam/m", "adam/v")


# Registered so that `keras.models.load_model` finds it in a saved model.
@keras.saving.register_keras_serializable(package="group_embedding")
class Adam(BaseOptimizer, keras.optimizers.Adam):
    """`keras.optimizers.Adam` with lazy updates for sparse gradients.

    On a sparse gradient (an `EmbeddingVariable`, or IndexedSlices of a
    plain variable) only the touched rows, and their m and v, change;
    dense gradients take the stock Keras update. Arguments are Keras's.

    Note: lazy, as DeepRec's Adam for EVs: rows absent from a batch keep
    their m and v instead of decaying, so results equal stock Adam only
    for rows touched at every step.

    Raises:
        NotImplementedError: (at apply) `amsgrad=True` with a sparse
            gradient.
    """

    def _ev_slots(self):
        return [(EV_SLOTS[0], 0.0), (EV_SLOTS[1], 0.0)]

    def _alpha(self, learning_rate):
        step = tf.cast(self.iterations + 1, tf.float32)
        b1 = tf.pow(tf.cast(self.beta_1, tf.float32), step)
        b2 = tf.pow(tf.cast(self.beta_2, tf.float32), step)
        return tf.cast(learning_rate, tf.float32) * tf.sqrt(1 - b2) / (1 - b1)

    def _check_amsgrad(self, name):
        if self.amsgrad:
            raise NotImplementedError(
                f"Adam: `amsgrad=True` is not supported for the sparse "
                f"gradient of '{name}'.")

    def _ev_update_step(self, gradient, variable, learning_rate):
        self._check_amsgrad(variable.name)
        variable.storage.apply_adam(variable.handle, gradient.indices,
                              gradient.values, self._ev_step(),
                              self._alpha(learning_rate), self.beta_1,
                              self.beta_2, self.epsilon, list(EV_SLOTS))

    def _fused_rule(self):
        if self.amsgrad:
            return None  # update_step names the variable it refuses

        def slots(v):
            i = self._get_variable_index(v)
            return [self._momentums[i], self._velocities[i]]

        return backward_apply.Rule("adam", slots, backward_apply.hyper(
            lr=self._alpha(self._get_current_learning_rate()),
            epsilon=self.epsilon, beta_1=self.beta_1, beta_2=self.beta_2))

    def update_step(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        self._check_amsgrad(variable.name)
        i = self._get_variable_index(variable)
        sparse_apply.lazy_adam(
            variable, self._momentums[i], self._velocities[i],
            tf.cast(self._alpha(learning_rate), variable.dtype),
            self.beta_1, self.beta_2, self.epsilon, gradient.indices,
            gradient.values)
