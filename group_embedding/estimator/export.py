"""`tf.estimator.export`: what `Estimator.export_saved_model` serves.

A `serving_input_receiver_fn` builds, in the export graph, the tensors a
request feeds (`receiver_tensors`) and the `features` the `model_fn`
receives. The two builders below make the usual ones.
"""

from typing import Dict
from typing import Optional

import tensorflow as tf

_SINGLE_FEATURE_KEY = "feature"
_SINGLE_RECEIVER_KEY = "input"
_SINGLE_OUTPUT_KEY = "output"
_EXAMPLES_KEY = "examples"


def _as_dict(value, default_key: str, argument: str) -> Dict[str, object]:
    if isinstance(value, dict):
        out = dict(value)
    else:
        out = {default_key: value}
    for key, tensor in out.items():
        if not isinstance(key, str):
            raise TypeError(f"`{argument}` keys must be strings, got "
                            f"{key!r}.")
        if not isinstance(tensor, (tf.Tensor, tf.SparseTensor,
                                   tf.RaggedTensor)):
            raise TypeError(f"`{argument}['{key}']` must be a Tensor, "
                            f"SparseTensor or RaggedTensor, got "
                            f"{type(tensor).__name__}.")
    return out


class ServingInputReceiver:
    """The input side of an exported model (stock
    `tf.estimator.export.ServingInputReceiver`).

    Args:
        features: a Tensor (keyed "feature") or dict of Tensors /
            SparseTensors / RaggedTensors passed to `model_fn`.
        receiver_tensors: a Tensor (keyed "input") or dict of the Tensors
            a request feeds: the signature's inputs.
        receiver_tensors_alternatives: must be None.

    Raises:
        TypeError: non-tensor values or non-string keys.
        NotImplementedError: `receiver_tensors_alternatives` given.
    """

    def __init__(self, features, receiver_tensors,
                 receiver_tensors_alternatives=None):
        if receiver_tensors_alternatives is not None:
            raise NotImplementedError(
                "`receiver_tensors_alternatives` is not supported; export "
                "one receiver per SavedModel.")
        self.features = _as_dict(features, _SINGLE_FEATURE_KEY, "features")
        self.receiver_tensors = _as_dict(receiver_tensors,
                                         _SINGLE_RECEIVER_KEY,
                                         "receiver_tensors")
        for key, tensor in self.receiver_tensors.items():
            if not isinstance(tensor, tf.Tensor):
                raise TypeError(f"`receiver_tensors['{key}']` must be a "
                                "dense Tensor (a signature input), got "
                                f"{type(tensor).__name__}.")
        self.receiver_tensors_alternatives = None


class PredictOutput:
    """A `predict` signature's outputs (stock
    `tf.estimator.export.PredictOutput`).

    Args:
        outputs: a Tensor (keyed "output") or dict name -> Tensor.

    Raises:
        TypeError: a value is not a dense Tensor.
    """

    def __init__(self, outputs):
        self.outputs = _as_dict(outputs, _SINGLE_OUTPUT_KEY, "outputs")
        for key, tensor in self.outputs.items():
            if not isinstance(tensor, tf.Tensor):
                raise TypeError(f"`outputs['{key}']` must be a dense "
                                f"Tensor, got {type(tensor).__name__}.")


def build_parsing_serving_input_receiver_fn(
        feature_spec: Dict[str, object],
        default_batch_size: Optional[int] = None):
    """A receiver fn parsing serialized `tf.train.Example`s.

    Args:
        feature_spec: dict key -> `tf.io.FixedLenFeature` /
            `VarLenFeature` / ... as for `tf.io.parse_example`.
        default_batch_size: batch dimension of the input (default None:
            any).

    Returns:
        A function returning a `ServingInputReceiver` whose one input,
        "examples", is a `[batch]` string tensor.
    """
    def serving_input_receiver_fn():
        serialized = tf.compat.v1.placeholder(
            tf.string, [default_batch_size], name="input_example_tensor")
        features = tf.io.parse_example(serialized, feature_spec)
        return ServingInputReceiver(features, {_EXAMPLES_KEY: serialized})

    return serving_input_receiver_fn


def build_raw_serving_input_receiver_fn(features,
                                        default_batch_size: Optional[
                                            int] = None):
    """A receiver fn feeding raw tensors straight to `model_fn`.

    Args:
        features: a Tensor or dict of Tensors whose dtype and shape (after
            the batch dimension) the inputs take; values are not used.
        default_batch_size: batch dimension of the inputs (default None:
            any).

    Returns:
        A function returning a `ServingInputReceiver` with one placeholder
        per feature, which is both the feature and the signature input.

    Raises:
        TypeError: a feature is not a dense Tensor (feed sparse ids as
            dense tensors with -1 or "" for missing, as `input_layer`
            reads them).
    """
    specs = {}
    for key, value in _as_dict(features, _SINGLE_FEATURE_KEY,
                               "features").items():
        if not isinstance(value, tf.Tensor):
            raise TypeError(f"`features['{key}']` must be a dense Tensor, "
                            f"got {type(value).__name__}.")
        specs[key] = (value.dtype, [default_batch_size] +
                      value.shape.as_list()[1:])
    single = not isinstance(features, dict)

    def serving_input_receiver_fn():
        placeholders = {key: tf.compat.v1.placeholder(dtype, shape,
                                                      name=key)
                        for key, (dtype, shape) in specs.items()}
        if single:
            tensor = placeholders[_SINGLE_FEATURE_KEY]
            return ServingInputReceiver(tensor, tensor)
        return ServingInputReceiver(placeholders, placeholders)

    return serving_input_receiver_fn
