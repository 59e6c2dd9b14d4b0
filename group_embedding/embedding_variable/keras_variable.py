"""`KerasEmbeddingVariable`: the Keras face of an EmbeddingVariable, so that
`model.fit` trains it.

Keras 3 lists, trains and counts only `keras.Variable`s found on its layers,
and an `EmbeddingVariable` is not one (it has no fixed shape and no value
tensor). The wrapper is a `keras.Variable` whose `handle` is the EV's
storage handle: Keras' `train_step` then finds it in `trainable_weights`,
`tape.gradient` returns the EV's gradient for it (IndexedSlices keyed by
key), and `ge.optimizers` route that gradient to the EV's update op.
"""

from typing import Optional

import keras
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.embedding_variable.variable import is_embedding_variable


class KerasEmbeddingVariable(keras.Variable):
    """A `keras.Variable` standing for an `EmbeddingVariable` in a layer.

    Create it in `build()` of a layer that owns EVs and keep it as a layer
    attribute (Keras tracks it like any weight); look up with the EV
    itself. `GroupEmbeddingFeatures` does this for its EV columns.

    Example::

        class Tags(keras.layers.Layer):
            def build(self, input_shape):
                self.ev = ge.get_embedding_variable("tags", 8)
                self.ev_weight = KerasEmbeddingVariable(self.ev)

            def call(self, ids):
                return ge.group_embedding_lookup_sparse(
                    [self.ev], [ids], "mean")[0]

        model.compile(optimizer=ge.optimizers.Adagrad(0.1), loss="mse")
        model.fit(...)  # trains the EV through `ev_weight`

    Its Keras value is an empty `[0, D]` tensor, so `model.summary()`,
    `save_weights()` and `get_weights()` work and hold nothing: the EV's
    content is saved by `tf.train.Checkpoint` / `Saver` (it is a tracked
    attribute of the layer).

    Note: only `ge.optimizers` can apply its gradients; stock Keras
    optimizers cannot update keyed rows and raise a TypeError naming the
    variable.

    Args:
        embedding_variable: the `EmbeddingVariable` to expose.
        name: Keras variable name (no "/"); default: the EV name's last
            path component.

    Raises:
        TypeError: `embedding_variable` is not an `EmbeddingVariable`.
    """

    def __init__(self, embedding_variable: EmbeddingVariable,
                 name: Optional[str] = None):
        if not is_embedding_variable(embedding_variable):
            raise TypeError("KerasEmbeddingVariable wraps an "
                            "EmbeddingVariable, got "
                            f"{type(embedding_variable).__name__}.")
        self._embedding_variable = embedding_variable
        super().__init__(
            initializer="zeros", shape=(0, embedding_variable.embedding_dim),
            dtype="float32", trainable=embedding_variable.trainable,
            name=name or embedding_variable.name.split("/")[-1])

    @property
    def embedding_variable(self) -> EmbeddingVariable:
        """The wrapped `EmbeddingVariable`."""
        return self._embedding_variable

    @property
    def overwrite_with_gradient(self) -> bool:
        # Only a stock Keras optimizer's `apply` reads this for the
        # variables it updates (`ge.optimizers` route EV gradients before
        # the stock path): refuse there, before it tries to convert the
        # keyed gradient.
        raise TypeError(_stock_optimizer_message(
            self._embedding_variable.name))

    @overwrite_with_gradient.setter
    def overwrite_with_gradient(self, value):
        keras.Variable.overwrite_with_gradient.fset(self, value)

    @property
    def handle(self) -> tf.Tensor:
        # GradientTape resolves variable sources to their handle: this
        # makes `tape.gradient(loss, wrapper)` the EV's gradient.
        return self._embedding_variable.handle

    def _initialize(self, value):
        # Stock Keras optimizers update `variable.value`: make that refuse
        # (at trace time, naming the EV) instead of scattering keys into
        # an empty tensor.
        self._value = _KeyedPlaceholder(
            value, dtype=self._dtype, trainable=self.trainable,
            name=self.name)
        self._value.embedding_variable_name = self._embedding_variable.name


class _KeyedPlaceholder(resource_variable_ops.ResourceVariable):
    """The empty Keras value of a KerasEmbeddingVariable; refuses updates."""

    embedding_variable_name = ""

    def _refuse_update(self, *args, **kwargs):
        raise TypeError(_stock_optimizer_message(
            self.embedding_variable_name))

    assign_add = assign_sub = _refuse_update
    scatter_add = scatter_sub = scatter_update = _refuse_update


def _stock_optimizer_message(name: str) -> str:
    return (f"EmbeddingVariable '{name}' is keyed by key and can only be "
            "trained by `ge.optimizers` (e.g. ge.optimizers.Adagrad), not "
            "by a stock Keras optimizer.")


def embedding_variable_of(variable) -> Optional[EmbeddingVariable]:
    """The `EmbeddingVariable` behind `variable` (itself or a
    `KerasEmbeddingVariable`), or None for any other variable."""
    if is_embedding_variable(variable):
        return variable
    if isinstance(variable, KerasEmbeddingVariable):
        return variable.embedding_variable
    return None
