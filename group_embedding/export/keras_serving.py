"""Serving endpoints of a Keras model, typed by its own inputs.

Keras 3's `model.export()` and `tf.saved_model.save(model)` give every
input a dense `tf.TensorSpec`, so a model on ragged (multi-hot) or sparse
inputs rejects the requests it was built for. `ge.export_saved_model`
saves a `KerasServing` of the model instead, whose endpoints take each
input as what it is.
"""

from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

import keras
import tensorflow as tf

# Ragged requests are built with int64 row splits (`tf.ragged.constant`,
# `tf.RaggedTensor.from_row_lengths` of numpy lengths).
_ROW_SPLITS_DTYPE = tf.int64


def _input_kind(x) -> str:
    """"ragged", "sparse" or "dense" of a Keras input."""
    if x.ragged:
        return "ragged"
    return "sparse" if x.sparse else "dense"


def _ragged_rank(x) -> int:
    # Keras leaves it None for the default: every dimension but the last.
    return x.ragged_rank if x.ragged_rank is not None else len(x.shape) - 1


def _spec(x, name: str):
    """The `serve` endpoint's spec of Keras input `x`."""
    kind = _input_kind(x)
    if kind == "ragged":
        return tf.RaggedTensorSpec(x.shape, x.dtype, _ragged_rank(x),
                                   _ROW_SPLITS_DTYPE)
    if kind == "sparse":
        return tf.SparseTensorSpec(x.shape, x.dtype)
    return tf.TensorSpec(x.shape, x.dtype, name=name)


def _components(x, name: str) -> List[tf.TensorSpec]:
    """The dense tensors that carry input `x` in `serving_default`."""
    kind = _input_kind(x)
    if kind == "dense":
        return [tf.TensorSpec(x.shape, x.dtype, name=name)]
    if kind == "sparse":
        rank = len(x.shape)
        return [tf.TensorSpec([None, rank], tf.int64, name=f"{name}_indices"),
                tf.TensorSpec([None], x.dtype, name=f"{name}_values"),
                tf.TensorSpec([rank], tf.int64, name=f"{name}_dense_shape")]
    ragged_rank = _ragged_rank(x)
    splits = [tf.TensorSpec([None], _ROW_SPLITS_DTYPE,
                            name=f"{name}_row_splits" + (f"_{i + 1}" if i
                                                         else ""))
              for i in range(ragged_rank)]
    values = tf.TensorSpec([None] + list(x.shape[ragged_rank + 1:]),
                           x.dtype, name=f"{name}_values")
    return [values] + splits


def _assemble(x, parts: List[tf.Tensor]):
    """Input `x` from its `_components` tensors."""
    kind = _input_kind(x)
    if kind == "dense":
        return parts[0]
    if kind == "sparse":
        return tf.SparseTensor(*parts)
    # Checked: bad splits from a request get TF's InvalidArgument, not a
    # wrong read.
    return tf.RaggedTensor.from_nested_row_splits(parts[0], parts[1:],
                                                  validate=True)


def model_inputs(model: keras.Model) -> Optional[Tuple[Any, Dict[str, Any]]]:
    """(the structure `model` is called with, {name: Keras input}), or
    None for a model with no defined inputs (a subclassed model)."""
    try:
        structure = model.input
    except AttributeError:  # Keras: "has never been called"
        return None
    if isinstance(structure, dict):
        return structure, dict(structure)
    flat = tf.nest.flatten(structure)
    return structure, {x.name: x for x in flat}


def _layers(model: keras.Model) -> List[keras.layers.Layer]:
    """`model`'s layers, those of nested models in their place. A Keras
    model in a SavedModel adds a `serving_default` of its own, which gives
    every input a dense spec (Keras' `_default_save_signature`) and fails
    on a layer that takes ragged ids only."""
    layers: List[keras.layers.Layer] = []
    for layer in model.layers:
        layers.extend(_layers(layer) if isinstance(layer, keras.Model)
                      else [layer])
    return layers


class KerasServing(tf.Module):
    """A Keras model with two serving endpoints, for
    `tf.saved_model.save` (what `ge.export_saved_model(model, dir)`
    writes).

    * `serve(inputs)`: `model(inputs, training=False)`, with the model's
      own input structure (a dict by its keys, a list, or one tensor) and
      each input's kind: `tf.RaggedTensorSpec` (int64 row splits) for a
      `keras.Input(ragged=True)`, `tf.SparseTensorSpec` for
      `sparse=True`, else `tf.TensorSpec`.
    * `serving_default` (the SignatureDef TF Serving calls): dense
      tensors by name. Input `NAME` (its dict key, else its Keras name)
      is `NAME` when dense; `NAME_values` (the flat values) and
      `NAME_row_splits` (then `NAME_row_splits_2`, ... for a deeper
      ragged rank, outermost first) when ragged; `NAME_indices`,
      `NAME_values`, `NAME_dense_shape` when sparse. Outputs as TF names
      them (`output_0` for a single tensor).

    Args:
        model: a Keras model with defined inputs (functional, or
            `keras.Sequential` with an `Input`).

    Raises:
        ValueError: the model has no defined inputs, or two inputs'
            tensor names collide (e.g. a ragged `tag` and a dense
            `tag_values`).
    """

    def __init__(self, model: keras.Model):
        super().__init__(name="keras_serving")
        found = model_inputs(model)
        if found is None:
            raise ValueError(
                f"Model {model.name!r} has no defined inputs (a subclassed "
                "model): pass `signatures` (tf.functions with an "
                "input_signature) to export it.")
        structure, named = found
        # What the endpoints read, tracked: the layers, not the model.
        self.layers = _layers(model)
        parts = {name: _components(x, name) for name, x in named.items()}
        owner: Dict[str, str] = {}
        for name, specs in parts.items():
            for spec in specs:
                if spec.name in owner:
                    raise ValueError(
                        f"Model {model.name!r}: inputs "
                        f"{owner[spec.name]!r} and {name!r} both need the "
                        f"serving tensor name {spec.name!r}; rename one.")
                owner[spec.name] = name
        by_input = {id(x): name for name, x in named.items()}
        serve_spec = tf.nest.map_structure(
            lambda x: _spec(x, by_input[id(x)]), structure)

        def call(features):
            return model(features, training=False)

        self.serve = tf.function(call, input_signature=[serve_spec])

        flat_specs = {s.name: s for specs in parts.values() for s in specs}

        def serving_default(tensors):
            assembled = {name: _assemble(named[name],
                                         [tensors[s.name] for s in specs])
                         for name, specs in parts.items()}
            features = tf.nest.map_structure(
                lambda x: assembled[by_input[id(x)]], structure)
            return call(features)

        self.serving_default = tf.function(serving_default,
                                           input_signature=[flat_specs])

    def signatures(self) -> Dict[str, Any]:
        """The `signatures` argument of `tf.saved_model.save`."""
        return {"serving_default": self.serving_default}
