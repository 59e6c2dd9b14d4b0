"""Adagrad with row-wise sparse updates (Keras 3 optimizer)."""

import keras
import tensorflow as tf

from group_embedding.ops import backward_apply
from group_embedding.ops import sparse_apply
from group_embedding.optimizers.base_optimizer import BaseOptimizer

EV_ACCUMULATOR = "adagrad/accumulator"


# Registered so that `keras.models.load_model` finds it in a saved model.
@keras.saving.register_keras_serializable(package="group_embedding")
class Adagrad(BaseOptimizer, keras.optimizers.Optimizer):
    """Adagrad that touches only the rows present in sparse gradients.

    Update, per element: `accum += g^2; var -= lr * g / sqrt(accum +
    epsilon)`, identical to `keras.optimizers.Adagrad`. Sparse gradients of
    plain variables go to one multithreaded C++ op per variable that sums
    duplicate rows and updates each touched row of the variable and its
    accumulator in one pass (Keras runs several scatter ops instead).
    `EmbeddingVariable`s keep their accumulator with each key (slot
    "adagrad/accumulator").

    Args:
        learning_rate: float or schedule, default 0.001.
        initial_accumulator_value: starting value of the accumulators,
            default 0.1; must be >= 0.
        epsilon: small constant for numerical stability, default 1e-7.
        name: optimizer name.
        **kwargs: the base `keras.optimizers.Optimizer` arguments.
    """

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1,
                 epsilon=1e-7, name="adagrad", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        if initial_accumulator_value < 0:
            raise ValueError("`initial_accumulator_value` must be >= 0, got "
                             f"{initial_accumulator_value}.")
        self.initial_accumulator_value = initial_accumulator_value
        self.epsilon = epsilon

    def build(self, var_list):
        if self.built:
            return
        var_list = self._dense_variables(var_list)
        super().build(var_list)
        init = keras.initializers.Constant(self.initial_accumulator_value)
        self._accumulators = [
            self.add_variable_from_reference(v, "accumulator",
                                             initializer=init)
            for v in var_list]

    def _ev_slots(self):
        return [(EV_ACCUMULATOR, self.initial_accumulator_value)]

    def _ev_update_step(self, gradient, variable, learning_rate):
        variable.storage.apply_adagrad(variable.handle, gradient.indices,
                                 gradient.values, self._ev_step(),
                                 learning_rate, self.epsilon, EV_ACCUMULATOR)

    def _fused_rule(self):
        return backward_apply.Rule(
            "adagrad",
            lambda v: [self._accumulators[self._get_variable_index(v)]],
            backward_apply.hyper(lr=self._get_current_learning_rate(),
                                 epsilon=self.epsilon))

    def update_step(self, gradient, variable, learning_rate):
        accum = self._accumulators[self._get_variable_index(variable)]
        lr = tf.cast(learning_rate, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            sparse_apply.adagrad(variable, accum, lr, self.epsilon,
                                 gradient.indices, gradient.values)
            return
        gradient = tf.cast(gradient, variable.dtype)
        accum.assign_add(tf.square(gradient))
        variable.assign_sub(lr * gradient /
                            tf.sqrt(accum.value + self.epsilon))

    def get_config(self):
        config = super().get_config()
        config.update({
            "initial_accumulator_value": self.initial_accumulator_value,
            "epsilon": self.epsilon,
        })
        return config
