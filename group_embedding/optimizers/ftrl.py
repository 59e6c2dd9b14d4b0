"""FTRL-proximal with row-wise sparse updates (Keras 3 optimizer)."""

import keras
import tensorflow as tf

from group_embedding.ops import backward_apply
from group_embedding.ops import sparse_apply
from group_embedding.optimizers.base_optimizer import BaseOptimizer

EV_SLOTS = ("ftrl/accumulator", "ftrl/linear")


# Registered so that `keras.models.load_model` finds it in a saved model.
@keras.saving.register_keras_serializable(package="group_embedding")
class Ftrl(BaseOptimizer, keras.optimizers.Ftrl):
    """`keras.optimizers.Ftrl` that updates only the touched rows of
    sparse gradients (TF's ApplyFtrlV2 row-wise), EVs included.

    Note: Keras densifies sparse gradients, which recomputes every row
    from its `linear` slot (a row never touched becomes 0 on the first
    step); here untouched rows keep their values, as with
    `tf.compat.v1.train.FtrlOptimizer`. Arguments are Keras's.
    """

    def _ev_slots(self):
        return [(EV_SLOTS[0], self.initial_accumulator_value),
                (EV_SLOTS[1], 0.0)]

    def _l2(self, lr):
        return self.l2_regularization_strength + self.beta / (2.0 * lr)

    def _ev_update_step(self, gradient, variable, learning_rate):
        lr = tf.cast(learning_rate, tf.float32)
        variable.storage.apply_ftrl(
            variable.handle, gradient.indices, gradient.values,
            self._ev_step(), lr, self.l1_regularization_strength,
            self._l2(lr), self.l2_shrinkage_regularization_strength,
            self.learning_rate_power, list(EV_SLOTS))

    def _fused_rule(self):
        lr = tf.cast(self._get_current_learning_rate(), tf.float32)

        def slots(v):
            i = self._get_variable_index(v)
            return [self._accumulators[i], self._linears[i]]

        return backward_apply.Rule("ftrl", slots, backward_apply.hyper(
            lr=lr, l1=self.l1_regularization_strength, l2=self._l2(lr),
            l2_shrinkage=self.l2_shrinkage_regularization_strength,
            lr_power=self.learning_rate_power))

    def update_step(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable, learning_rate)
        i = self._get_variable_index(variable)
        lr = tf.cast(learning_rate, variable.dtype)
        sparse_apply.ftrl(
            variable, self._accumulators[i], self._linears[i], lr,
            self.l1_regularization_strength, self._l2(lr),
            self.l2_shrinkage_regularization_strength,
            self.learning_rate_power, gradient.indices, gradient.values)
