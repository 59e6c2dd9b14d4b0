"""`GroupEmbeddingFeatures`: the Keras 3 layer that owns the tables of a
list of feature columns (the role of the removed `DenseFeatures`)."""

import json
from typing import Any
from typing import Dict
from typing import List

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.feature_column import feature_column_v2 as fc_v2
from tensorflow.python.feature_column import serialization

from group_embedding import model_parallel
from group_embedding.embedding_variable.keras_variable import (
    KerasEmbeddingVariable,
)
from group_embedding.embedding_variable.variable import get_embedding_variable
from group_embedding.feature_column import column_lookup
from group_embedding.feature_column import columns as columns_lib
from group_embedding.feature_column import sparse_ids

# What `save_own_variables` writes per EV (its checkpoint tensors).
_EV_FIELDS = ("keys", "values", "freqs", "versions", "slot_names",
              "slot_inits", "slots", "step")
_EV_PREFIX = "ev"


def _strings_to_array(strings: np.ndarray) -> np.ndarray:
    """Slot names as the uint8 bytes of a JSON list."""
    names = [n.decode() if isinstance(n, bytes) else str(n)
             for n in strings.ravel()]
    return np.frombuffer(json.dumps(names).encode(), np.uint8)


def _array_to_strings(array: np.ndarray) -> np.ndarray:
    return np.asarray(json.loads(array.astype(np.uint8).tobytes()),
                      dtype=object).astype(bytes)


class _PlainEntries:
    """A store without the EV entries: what Keras' own loader expects."""

    def __init__(self, store):
        self._store = store

    def keys(self):
        return [k for k in self._store.keys()
                if not k.startswith(_EV_PREFIX)]

    def __len__(self):
        return len(self.keys())

    def __getitem__(self, key):
        return self._store[key]


def _column_to_config(column) -> Dict[str, Any]:
    if isinstance(column, columns_lib.EmbeddingColumn):
        return {"class_name": "EmbeddingColumn",
                "config": column.get_config()}
    return serialization.serialize_feature_column(column)


def _column_from_config(config: Dict[str, Any]):
    if config["class_name"] == "EmbeddingColumn":
        return columns_lib.EmbeddingColumn.from_config(config["config"])
    return serialization.deserialize_feature_column(config)


def _is_deferred(table) -> bool:
    """Whether `table` is a Keras variable whose value does not exist yet
    (created while Keras traces a model symbolically)."""
    return isinstance(table, keras.Variable) and table._value is None


def _batch_size(features) -> tf.Tensor:
    """The batch size of a features dict (dense, sparse or ragged)."""
    value = next(iter(features.values()))
    if isinstance(value, tf.SparseTensor):
        return tf.cast(value.dense_shape[0], tf.int32)
    if isinstance(value, tf.RaggedTensor):
        return tf.cast(value.nrows(), tf.int32)
    return tf.shape(value)[0]


@keras.saving.register_keras_serializable(package="group_embedding")
class GroupEmbeddingFeatures(keras.layers.Layer):
    """Turns a features dict into one dense tensor, like `input_layer`.

    Output `[B, sum of column dims]`, columns sorted by name; it equals
    stock `tf.compat.v1.feature_column.input_layer` on the same weights.
    Columns of one `group_embedding_column_scope` share ONE grouped lookup
    per call; columns outside scopes are looked up alone.

    Model creation:
        `build()` creates one table per table name with `add_weight`
        (`[num_buckets, D]`, named after the column, or after the shared
        name for `shared_embedding_columns`, so a shared table is one
        variable), or one `EmbeddingVariable` for EV columns, which Keras
        sees as a `KerasEmbeddingVariable` in `trainable_weights`.
        `call()` creates no state. Train EV tables with `ge.optimizers`,
        in `model.fit` or in a custom loop (pass `embedding_variables`).

    Example::

        layer = ge.feature_column.GroupEmbeddingFeatures(columns)
        x = layer({"uid": uid_sparse, "city": city_strings})  # [B, sum D]

    Args:
        feature_columns: `EmbeddingColumn`s of this package and stateless
            stock dense columns (numeric, bucketized, indicator).
        trainable: default True; False freezes every table.
        name: layer name.
        **kwargs: other `keras.layers.Layer` arguments.

    Raises:
        TypeError: unsupported column (see `input_layer`).
        ValueError: empty list or duplicate column names.
    """

    def __init__(self, feature_columns, trainable: bool = True,
                 name=None, **kwargs):
        super().__init__(trainable=trainable, name=name, **kwargs)
        self._feature_columns = column_lookup.check_feature_columns(
            feature_columns)
        self._embedding_columns = column_lookup.embedding_columns(
            self._feature_columns)
        self._specs = column_lookup.table_specs(self._embedding_columns)
        self._state_manager = sparse_ids.TableStateManager()
        self._tables: Dict[str, Any] = {}
        self._evs: List[Any] = []
        self._ev_weights: List[KerasEmbeddingVariable] = []

    @property
    def feature_columns(self) -> List[Any]:
        """The columns, sorted by name (the output order)."""
        return list(self._feature_columns)

    @property
    def tables(self) -> Dict[str, Any]:
        """Table name -> variable (or EmbeddingVariable).

        Raises:
            RuntimeError: the layer is not built yet.
        """
        if not self.built:
            raise RuntimeError(f"Layer '{self.name}' has no tables yet: "
                               "build it first (call it on features).")
        return dict(self._tables)

    @property
    def embedding_variables(self) -> List[Any]:
        """The `EmbeddingVariable` tables (Keras tracks them through their
        `KerasEmbeddingVariable`s)."""
        return list(self._evs)

    def build(self, input_shape=None):
        if self.built:
            return
        for name, c in self._specs.items():
            if c.is_ev:
                ev = get_embedding_variable(
                    f"{self.name}/{name}", c.dimension, key_dtype=tf.int64,
                    initializer=c.initializer,
                    trainable=c.trainable and self.trainable,
                    ev_option=c.ev_option)
                self._evs.append(ev)
                # Keras sees (and model.fit trains) the EV through it.
                self._ev_weights.append(KerasEmbeddingVariable(
                    ev, name=name.replace("/", "_")))
                self._tables[name] = ev
            elif c.scope is not None and model_parallel.runtime():
                self._tables[name] = model_parallel.runtime().collective_table(
                    f"{self.name}/{name}", c.num_buckets, c.dimension,
                    c.table_initializer(),
                    lambda value, name=name, c=c: self.add_weight(
                        name=name, shape=value.shape, dtype="float32",
                        initializer=keras.initializers.Constant(value),
                        trainable=c.trainable))
            else:
                self._tables[name] = self.add_weight(
                    name=name, shape=(c.num_buckets, c.dimension),
                    initializer=c.table_initializer(), dtype="float32",
                    trainable=c.trainable)
        self.built = True

    def save_own_variables(self, store):
        """Saves the plain tables and every EV's full content.

        `model.save()` / `save_weights()` call this. Besides Keras' own
        entries ("0", "1", ...), each EV i writes `ev{i}_<field>`: keys,
        values, freqs, versions, optimizer slots (with their names, initial
        values and step) and its default matrix, the snapshot
        `tf.train.Checkpoint` saves.
        """
        super().save_own_variables(store)
        for i, ev in enumerate(self._evs):
            tensors = ev._serialize_to_tensors()
            for field in _EV_FIELDS:
                value = np.asarray(tensors[field])
                if field == "slot_names":  # Keras stores numbers only
                    value = _strings_to_array(value)
                store[f"{_EV_PREFIX}{i}_{field}"] = value
            store[f"{_EV_PREFIX}{i}_default_values"] = \
                ev.default_values.numpy()

    def load_own_variables(self, store):
        """Restores what `save_own_variables` saved (EV contents included).

        Raises:
            ValueError: the store lacks an EV's content (saved by an older
                version or by another layer).
        """
        super().load_own_variables(_PlainEntries(store))
        for i, ev in enumerate(self._evs):
            prefix = f"{_EV_PREFIX}{i}_"
            missing = [f for f in _EV_FIELDS + ("default_values",)
                       if prefix + f not in store.keys()]
            if missing:
                raise ValueError(
                    f"Layer '{self.name}': the saved state has no content "
                    f"for EmbeddingVariable '{ev.name}' (missing "
                    f"{', '.join(missing)}).")
            tensors = {f: np.asarray(store[prefix + f]) for f in _EV_FIELDS}
            tensors["slot_names"] = _array_to_strings(tensors["slot_names"])
            ev._restore_from_tensors({f: tf.convert_to_tensor(v)
                                      for f, v in tensors.items()})
            ev.default_values.assign(store[prefix + "default_values"])

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            # The vocabulary tables stock columns create on their first
            # call: a SavedModel's functions read them, so it holds them.
            for i, table in enumerate(self._state_manager.resources()):
                children[f"column_table_{i}"] = table
        return children

    def build_from_config(self, config):
        # Tables depend on the columns only, not on input shapes.
        self.build()

    def call(self, features, training=None):
        if any(_is_deferred(t) for t in self._tables.values()):
            # Keras traces call() symbolically to build a subclassed model,
            # with variables created there left uninitialised: no table
            # exists to read yet, and only the output's shape is asked.
            return tf.zeros(tf.stack([_batch_size(features),
                                      self.compute_output_shape(None)[1]]))
        prepared = sparse_ids.prepare_features(features,
                                               self._feature_columns)
        cache = fc_v2.FeatureTransformationCache(prepared)
        embedded = column_lookup.lookup_columns(
            self._embedding_columns, cache, self._state_manager,
            self._tables, training=True if training is None else training)
        return column_lookup.concat(column_lookup.dense_outputs(
            self._feature_columns, embedded, cache, self._state_manager))

    def compute_output_shape(self, input_shape):
        dims = 0
        for c in self._feature_columns:
            dims += c.dimension if c in self._embedding_columns else \
                c.variable_shape.num_elements()
        return (None, dims)

    def get_config(self) -> Dict[str, Any]:
        config = super().get_config()
        config["feature_columns"] = [_column_to_config(c)
                                     for c in self._feature_columns]
        return config

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "GroupEmbeddingFeatures":
        config = dict(config)
        config["feature_columns"] = [_column_from_config(c)
                                     for c in config["feature_columns"]]
        return cls(**config)
