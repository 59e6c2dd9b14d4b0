"""The `tf.Variable` behind a Keras 3 variable.

Keras 3 wraps each TensorFlow variable in a `keras.Variable`; the kernels,
the lookup plan and Horovod want the `tf.Variable` (its handle, its
`ref()`). This is the one place that unwraps.
"""

from typing import Any

import keras


def to_tf_variable(variable: Any) -> Any:
    """The `tf.Variable` that `variable` wraps if it is a `keras.Variable`.

    Read it again at each use: Keras may swap the `tf.Variable` behind a
    `keras.Variable` (deferred creation during a model's first call).

    Args:
        variable: a `keras.Variable`, or anything else (a `tf.Variable`,
            an EmbeddingVariable, a sharded table).

    Returns:
        `variable.value` for a `keras.Variable`; `variable` unchanged
        otherwise.
    """
    if isinstance(variable, keras.Variable):
        return variable.value
    return variable
