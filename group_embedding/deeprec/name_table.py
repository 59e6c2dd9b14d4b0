"""DeepRec drop-in names on stock TensorFlow (`import group_embedding.compat`).

DeepRec is a TensorFlow fork: its users write
`tf.nn.group_embedding_lookup_sparse`,
`tf.feature_column.group_embedding_column_scope`,
`tf.get_embedding_variable` and so on. Importing this module (or calling
`install()`) adds those names to both `tf` and `tf.compat.v1`, so such a
script runs on stock TF 2.21 by adding one import (`import group_embedding`
alone changes nothing in `tf`):

    import tensorflow.compat.v1 as tf
    import group_embedding.compat  # noqa: F401

What `install()` changes, in `tf` and in `tf.compat.v1`:

* added: `nn.group_embedding_lookup_sparse`, `nn.group_embedding_lookup`,
  `feature_column.group_embedding_column_scope`,
  `feature_column.categorical_column_with_embedding`,
  `feature_column.sequence_categorical_column_with_embedding`,
  `contrib.feature_column.sequence_input_layer` (no `contrib` in TF 2),
  `get_embedding_variable`, `config.experimental.enable_distributed_strategy`,
  `EmbeddingVariableOption`, `CounterFilter`, `CBFFilter`,
  `InitializerOption`, `GlobalStepEvict`, `L2WeightEvict`;
* routed through this library: `feature_column.embedding_column`,
  `feature_column.shared_embedding_columns` (and TF2's `shared_embeddings`),
  `feature_column.input_layer`, so that `group_embedding_column_scope`
  takes effect (`feature_column_adapters`). Stock
  categorical columns still work: ours embed them, and `input_layer`
  computes stock columns (including stock embedding columns built before
  `install()`) with stock code;
* EV-aware: `nn.embedding_lookup`, `nn.embedding_lookup_sparse`,
  `nn.safe_embedding_lookup_sparse` and `gather` also read an
  `EmbeddingVariable` (see `ge.embedding_lookup`); with anything else
  they call the stock function with the caller's arguments, untouched
  (`stock_lookups.ev_aware`);
* in `tf.compat.v1.train` only: `GradientDescentOptimizer`,
  `AdagradOptimizer`, `AdamOptimizer`, `FtrlOptimizer` become the
  `ge.train` subclasses, which also update EmbeddingVariables (in DeepRec
  the stock optimizers do). On plain variables they are the stock update.
  `Saver` becomes `checkpoint.Saver`, whose `restore` also reads
  DeepRec / Deepray checkpoints of EVs (`ge.restore_deeprec_checkpoint`);
* `estimator` (TF 2.16+ has none): `ge.estimator`;
* DeepRec runtime features stock TF lacks (`runtime_features`): `staged`,
  `make_prefetch_hook`, `get_multihash_variable`,
  `get_dynamic_dimension_embedding_variable`,
  `feature_column.categorical_column_with_multihash` /
  `_with_adaptive_embedding`, `tf.compat.v1.train.AdagradDecayOptimizerV2`,
  `contrib.layers.sparse_column_with_embedding` /
  `input_from_feature_columns` / `weighted_sum_from_feature_columns`,
  `contrib.opt.AdamWOptimizer`, and the modules `parquet_dataset_ops`,
  `dataframe`, `work_queue`, `adagrad_decay_v2`,
  `weight_decay_optimizers` (added to `sys.modules`) raise one
  NotImplementedError naming the feature when used;
* `config[.experimental].enable_group_embedding` (`runtime_features`):
  "localized" is a no-op, "collective" points to
  `enable_distributed_strategy`;
* `ConfigProto().graph_options.optimizer_options`: DeepRec's
  `do_op_fusion` is accepted and ignored (grappler fuses; logged once);
  switching on `do_smart_stage[_gpu]`, `stage_multi_stream`,
  `micro_batch_num`, `do_async_embedding` raises NotImplementedError,
  setting them off is accepted.

`uninstall()` puts every original back (and removes the added names).
This module holds only that name table and `install()` / `uninstall()` /
`is_installed()`; what it installs is defined where it belongs (its
siblings in deeprec/, or the core). It is imported as
`group_embedding.compat` (group_embedding/compat.py makes that path this
module).
"""

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any
from typing import Dict
from typing import List
from typing import Tuple

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.framework import config as tf_framework_config

from group_embedding import estimator as estimator_lib
from group_embedding import lookup
from group_embedding import train
from group_embedding.deeprec import checkpoint as deeprec_checkpoint
from group_embedding.deeprec import runtime_features
from group_embedding.deeprec import stock_lookups
from group_embedding.deeprec.feature_column_adapters import embedding_column
from group_embedding.deeprec.feature_column_adapters import input_layer
from group_embedding.deeprec.feature_column_adapters import (
    shared_embedding_columns,
)
from group_embedding.distributed.enable import enable_distributed_strategy
from group_embedding.embedding_variable import options
from group_embedding.embedding_variable import variable as embedding_variable
from group_embedding.feature_column import columns as columns_lib
from group_embedding.feature_column import scope as scope_lib
from group_embedding.feature_column.sequence_input_layer import (
    sequence_input_layer as ge_sequence_input_layer,
)

_MISSING = object()
_LOCK = threading.Lock()
# (namespace, attribute) -> value before install() (_MISSING: absent).
_ORIGINALS: Dict[Tuple[Any, str], Any] = {}


def _original(namespace, name: str):
    """The stock value of `namespace.name`, even while installed."""
    value = _ORIGINALS.get((namespace, name), _MISSING)
    if value is _MISSING:
        value = getattr(namespace, name)
    return value


def _ev_read_names(root) -> List[Tuple[Any, str, Any]]:
    """EV-aware versions of `root.nn.embedding_lookup*` and
    `root.gather`, each wrapping the stock function found there."""
    out = []
    for namespace, name, ours, first in (
            (root.nn, "embedding_lookup", stock_lookups.embedding_lookup,
             "params"),
            (root.nn, "embedding_lookup_sparse",
             stock_lookups.embedding_lookup_sparse, "params"),
            (root.nn, "safe_embedding_lookup_sparse",
             stock_lookups.safe_embedding_lookup_sparse,
             "embedding_weights"),
            (root, "gather", stock_lookups.gather, "params")):
        stock = _original(namespace, name)
        out.append((namespace, name,
                    stock_lookups.ev_aware(stock, ours, first)))
    return out


# `tf.contrib` as far as DeepRec's scripts and tests use it: TF 1.15's
# `contrib.feature_column.sequence_input_layer` (DeepRec's BST / DIN
# scripts), and stand-ins for the rest.
_CONTRIB = types.SimpleNamespace(
    feature_column=types.SimpleNamespace(
        sequence_input_layer=ge_sequence_input_layer),
    layers=runtime_features.CONTRIB_LAYERS,
    opt=runtime_features.CONTRIB_OPT)


def _deeprec_only_module(name: str) -> bool:
    """True when `name` is ours or no real module of that name exists."""
    present = sys.modules.get(name)
    if present is not None:
        return isinstance(present, runtime_features.UnavailableModule)
    return importlib.util.find_spec(name) is None


def _module_names() -> List[Tuple[Any, str, Any]]:
    """(parent package, leaf, stand-in) for each DeepRec-only module that
    stock TF does not ship; a real module of the same name wins."""
    out = []
    for module in runtime_features.MODULES:
        if _deeprec_only_module(module.__name__):
            parent, leaf = module.__name__.rsplit(".", 1)
            out.append((importlib.import_module(parent), leaf, module))
    return out


def _names() -> List[Tuple[Any, str, Any]]:
    """(namespace, attribute, value) for everything install() sets."""
    top = {
        "get_embedding_variable": embedding_variable.get_embedding_variable,
        "EmbeddingVariableOption": options.EmbeddingVariableOption,
        "CounterFilter": options.CounterFilter,
        "CBFFilter": options.CBFFilter,
        "InitializerOption": options.InitializerOption,
        "GlobalStepEvict": options.GlobalStepEvict,
        "L2WeightEvict": options.L2WeightEvict,
        "StorageOption": options.StorageOption,
        "StorageType": options.StorageType,
        "CacheStrategy": options.CacheStrategy,
    }
    top.update(runtime_features.UNSUPPORTED_NAMES)
    config = {"enable_group_embedding":
              runtime_features.enable_group_embedding}
    nn = {
        "group_embedding_lookup_sparse":
            lookup.group_embedding_lookup_sparse,
        "group_embedding_lookup": lookup.group_embedding_lookup,
    }
    feature_column: Dict[str, Any] = {
        "group_embedding_column_scope":
            scope_lib.group_embedding_column_scope,
        "categorical_column_with_embedding":
            columns_lib.categorical_column_with_embedding,
        "sequence_categorical_column_with_embedding":
            columns_lib.sequence_categorical_column_with_embedding,
        "embedding_column": embedding_column,
        "shared_embedding_columns": shared_embedding_columns,
        "input_layer": input_layer,
    }
    feature_column.update(runtime_features.UNSUPPORTED_FEATURE_COLUMNS)
    out = []
    for root in (tf, tf.compat.v1):
        out += [(root, k, v) for k, v in top.items()]
        out += [(root.nn, k, v) for k, v in nn.items()]
        out += [(root.feature_column, k, v)
                for k, v in feature_column.items()]
        out.append((root.config.experimental,
                    "enable_distributed_strategy",
                    enable_distributed_strategy))
        out += [(namespace, k, v) for k, v in config.items()
                for namespace in (root.config, root.config.experimental)]
        out += _ev_read_names(root)
    # DeepRec's collections of EV init ops, and its proto enums of EV
    # storage tiers (`config_pb2.StorageType.DRAM`) and of the policy of
    # a DRAM tier over disk (`config_pb2.CacheStrategy.LFU`).
    out.append((tf.compat.v1.GraphKeys, "EV_INIT_VAR_OPS",
                embedding_variable.EV_INIT_VAR_OPS))
    out.append((tf.compat.v1.GraphKeys, "EV_INIT_SLOT_OPS",
                embedding_variable.EV_INIT_SLOT_OPS))
    out.append((config_pb2, "StorageType", options.StorageType))
    out.append((config_pb2, "CacheStrategy", options.CacheStrategy))
    # DeepRec's test scripts call `framework.config.enable_group_embedding`.
    out += [(tf_framework_config, k, v) for k, v in config.items()]
    # DeepRec's fields of `ConfigProto.graph_options.optimizer_options`.
    out.append((config_pb2.OptimizerOptions, "__setattr__",
                runtime_features.set_optimizer_option))
    out.append((config_pb2.OptimizerOptions, "async_embedding_options",
                runtime_features.ASYNC_EMBEDDING_OPTIONS))
    out += _module_names()
    # TF2's name for shared_embedding_columns.
    out.append((tf.feature_column, "shared_embeddings",
                shared_embedding_columns))
    # TF 1.15's `tf.contrib.feature_column.sequence_input_layer` (DeepRec's
    # BST / DIN scripts); stock TF 2 has no `contrib` at all.
    for root in (tf, tf.compat.v1):
        stock = _ORIGINALS.get((root, "contrib"),
                               getattr(root, "contrib", _MISSING))
        if stock is _MISSING or stock is _CONTRIB:
            out.append((root, "contrib", _CONTRIB))
    for name in train.__all__:
        out.append((tf.compat.v1.train, name, getattr(train, name)))
    # Restores DeepRec's checkpoints too (`Saver().restore(sess, path)`).
    out.append((tf.compat.v1.train, "Saver", deeprec_checkpoint.Saver))
    out += [(tf.compat.v1.train, k, v)
            for k, v in runtime_features.UNSUPPORTED_V1_TRAIN.items()]
    # TF 2.16+ ships no tf.estimator: DeepRec's Estimator scripts get ours.
    for root in (tf, tf.compat.v1):
        stock = _ORIGINALS.get((root, "estimator"),
                               getattr(root, "estimator", _MISSING))
        if stock is _MISSING or stock is estimator_lib:
            out.append((root, "estimator", estimator_lib))
    return out


def _own(namespace, name: str):
    # On a class only its own attribute is restored: an inherited one
    # (OptimizerOptions.__setattr__) comes back by deleting ours.
    if isinstance(namespace, type):
        return vars(namespace).get(name, _MISSING)
    return getattr(namespace, name, _MISSING)


def install() -> None:
    """Adds DeepRec's names to `tf` and `tf.compat.v1` (idempotent), and
    DeepRec-only modules to `sys.modules`."""
    with _LOCK:
        for namespace, name, value in _names():
            key = (namespace, name)
            if key not in _ORIGINALS:
                _ORIGINALS[key] = _own(namespace, name)
            setattr(namespace, name, value)
        for _, _, module in _module_names():
            sys.modules[module.__name__] = module


def uninstall() -> None:
    """Restores every name `install()` changed (idempotent)."""
    with _LOCK:
        for (namespace, name), value in _ORIGINALS.items():
            if value is _MISSING:
                if hasattr(namespace, name):
                    delattr(namespace, name)
            else:
                setattr(namespace, name, value)
        _ORIGINALS.clear()
        for module in runtime_features.MODULES:
            if sys.modules.get(module.__name__) is module:
                del sys.modules[module.__name__]


def is_installed() -> bool:
    """True between `install()` and `uninstall()`."""
    return bool(_ORIGINALS)


install()
