"""DeepRec drop-in names on stock TensorFlow (`import group_embedding.compat`).

DeepRec is a TensorFlow fork: its users write
`tf.nn.group_embedding_lookup_sparse`,
`tf.feature_column.group_embedding_column_scope`,
`tf.get_embedding_variable` and so on. Importing this module (or calling
`install()`) adds those names to both `tf` and `tf.compat.v1`, so such a
script runs on stock TF 2.21 by adding one import:

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
  takes effect. Stock categorical columns still work: ours embed them, and
  `input_layer` computes stock columns (including stock embedding columns
  built before `install()`) with stock code;
* EV-aware: `nn.embedding_lookup`, `nn.embedding_lookup_sparse`,
  `nn.safe_embedding_lookup_sparse` and `gather` also read an
  `EmbeddingVariable` (see `ge.embedding_lookup`); with anything else
  they call the stock function with the caller's arguments, untouched;
* in `tf.compat.v1.train` only: `GradientDescentOptimizer`,
  `AdagradOptimizer`, `AdamOptimizer`, `FtrlOptimizer` become the
  `ge.train` subclasses, which also update EmbeddingVariables (in DeepRec
  the stock optimizers do). On plain variables they are the stock update.
  `Saver` becomes `deeprec_checkpoint.Saver`, whose `restore` also reads
  DeepRec / Deepray checkpoints of EVs (`ge.restore_deeprec_checkpoint`);

* DeepRec runtime features stock TF lacks (`group_embedding.
  runtime_features`): `staged`, `make_prefetch_hook`,
  `get_multihash_variable`,
  `get_dynamic_dimension_embedding_variable`,
  `feature_column.categorical_column_with_multihash` /
  `_with_adaptive_embedding`, `tf.compat.v1.train.AdagradDecayOptimizerV2`,
  `contrib.layers.sparse_column_with_embedding` /
  `input_from_feature_columns` / `weighted_sum_from_feature_columns`,
  `contrib.opt.AdamWOptimizer`, and the modules `parquet_dataset_ops`,
  `dataframe`, `work_queue`, `adagrad_decay_v2`,
  `weight_decay_optimizers` (added to `sys.modules`) raise one
  NotImplementedError naming the feature when used;
* `config[.experimental].enable_group_embedding`: "localized" is a
  no-op, "collective" points to `enable_distributed_strategy`;
* `ConfigProto().graph_options.optimizer_options`: DeepRec's
  `do_op_fusion` is accepted and ignored (grappler fuses; logged once);
  switching on `do_smart_stage[_gpu]`, `stage_multi_stream`,
  `micro_batch_num`, `do_async_embedding` raises NotImplementedError,
  setting them off is accepted.

`uninstall()` puts every original back (and removes the added names).

Note: DeepRec's `embedding_column` builds its table itself; ours returns a
column description whose table `input_layer` creates, with the same
variable names stock uses (`input_layer/<column>/embedding_weights`).
"""

import functools
import importlib
import importlib.util
import inspect
import sys
import threading
import types
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Tuple

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.framework import config as tf_framework_config

from group_embedding.embedding_variable import variable as embedding_variable
from group_embedding.embedding_variable import options
from group_embedding import stock_lookups as ev_reads
from group_embedding import deeprec_checkpoint
from group_embedding import lookup
from group_embedding import runtime_features
from group_embedding import train
from group_embedding.distributed.enable import enable_distributed_strategy
from group_embedding import estimator as estimator_lib
from group_embedding.feature_column import column_lookup
from group_embedding.feature_column import columns as columns_lib
from group_embedding.feature_column.input_layer import \
    input_layer as ge_input_layer
from group_embedding.feature_column.sequence_input_layer import \
    sequence_input_layer as ge_sequence_input_layer
from group_embedding.feature_column import scope as scope_lib

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


def _reject_ckpt_arguments(where: str, ckpt_to_load_from,
                           tensor_name_in_ckpt) -> None:
    # Honoured or rejected, never ignored (STYLE: Errors).
    if ckpt_to_load_from is not None or tensor_name_in_ckpt is not None:
        raise NotImplementedError(
            f"{where}: `ckpt_to_load_from` / `tensor_name_in_ckpt` are not "
            "supported by group_embedding; restore the tables with "
            "tf.train.Saver or tf.train.init_from_checkpoint instead.")


def _is_supported_categorical(column) -> bool:
    # EV and stock columns, weighted or sequence ones included.
    return columns_lib.is_embeddable(column)


def embedding_column(categorical_column, dimension, combiner="mean",
                     initializer=None, ckpt_to_load_from=None,
                     tensor_name_in_ckpt=None, max_norm=None,
                     trainable=True, use_safe_embedding_lookup=True,
                     do_fusion=None):
    """`tf.feature_column.embedding_column` with the stock signature,
    routed through `ge.feature_column.embedding_column`.

    Inside a `group_embedding_column_scope` the column joins the scope's
    grouped lookup. Outside scopes, a categorical column the library cannot
    embed (e.g. a crossed column) gets the stock embedding column.

    Args:
        categorical_column, dimension, combiner, initializer, max_norm,
            trainable: as in `ge.feature_column.embedding_column`.
        ckpt_to_load_from, tensor_name_in_ckpt: must be None.
        use_safe_embedding_lookup: accepted either way: the grouped lookup
            always drops invalid ids and empty rows give zeros, which is
            what the safe lookup does and, on valid input, equals the
            unsafe one.
        do_fusion: DeepRec's embedding-fusion switch: see
            `ge.feature_column.embedding_column` (accepted, no effect: the
            grouped lookup is always one fused op per scope).

    Returns:
        A `ge` `EmbeddingColumn` (or a stock one, see above).

    Raises:
        NotImplementedError: checkpoint arguments given.
        TypeError / ValueError: see `ge.feature_column.embedding_column`.
    """
    _reject_ckpt_arguments("embedding_column", ckpt_to_load_from,
                           tensor_name_in_ckpt)
    if scope_lib.current_scope() is None and not _is_supported_categorical(
            categorical_column):
        return _original(tf.feature_column, "embedding_column")(
            categorical_column, dimension, combiner=combiner,
            initializer=initializer, max_norm=max_norm, trainable=trainable,
            use_safe_embedding_lookup=use_safe_embedding_lookup)
    return columns_lib.embedding_column(categorical_column, dimension,
                                        combiner, initializer, max_norm,
                                        trainable, do_fusion=do_fusion)


def shared_embedding_columns(categorical_columns, dimension,
                             combiner="mean", initializer=None,
                             shared_embedding_collection_name=None,
                             ckpt_to_load_from=None,
                             tensor_name_in_ckpt=None, max_norm=None,
                             trainable=True,
                             use_safe_embedding_lookup=True):
    """`tf.compat.v1.feature_column.shared_embedding_columns` (stock
    signature) routed through `ge.feature_column.shared_embedding_columns`.

    Args:
        As stock; `ckpt_to_load_from` / `tensor_name_in_ckpt` must be None,
        `use_safe_embedding_lookup` as in `embedding_column`.

    Returns:
        One `ge` `EmbeddingColumn` per categorical column.

    Raises:
        NotImplementedError: checkpoint arguments given.
        TypeError / ValueError: see
            `ge.feature_column.shared_embedding_columns`.
    """
    del use_safe_embedding_lookup  # always safe, see embedding_column
    _reject_ckpt_arguments("shared_embedding_columns", ckpt_to_load_from,
                           tensor_name_in_ckpt)
    return columns_lib.shared_embedding_columns(
        categorical_columns, dimension, combiner, initializer,
        shared_embedding_collection_name, max_norm, trainable)


def _is_ours(column) -> bool:
    return isinstance(column, columns_lib.EmbeddingColumn)


def _handled_by_ge(column) -> bool:
    try:
        column_lookup.check_feature_columns([column])
    except (TypeError, ValueError):
        return False
    return True


def _stock_input_layer_scope():
    """The variable scope stock `input_layer` would open for this call:
    "input_layer", then "input_layer_1", ... (TF's default-name counters,
    reset when an enclosing named scope is re-entered)."""
    with tf.compat.v1.variable_scope(None, default_name="input_layer") as vs:
        return vs


def input_layer(features, feature_columns, weight_collections=None,
                trainable=True, cols_to_vars=None,
                cols_to_output_tensors=None):
    """`tf.compat.v1.feature_column.input_layer`, scopes included.

    With no `ge` embedding column among `feature_columns` this is the stock
    function, unchanged. Otherwise `ge.feature_column.input_layer` computes
    the `ge` columns and the stateless stock ones (one grouped lookup per
    scope); stock embedding columns, if any, are computed by the stock
    function; the outputs are concatenated sorted by column name, as stock
    does.

    Tables are named and shared as stock (and DeepRec) do: each call opens
    `variable_scope(None, default_name="input_layer")`, so a second call
    gets tables of its own under `input_layer_1/` (DeepRec's DeepFM feeds
    its wide and deep parts from two calls, i.e. two sets of tables), and
    calls share tables only where the TF1 idiom makes stock share them: a
    re-entered named `variable_scope`, whose default names start afresh.

    Args:
        As stock `tf.compat.v1.feature_column.input_layer`.

    Returns:
        `[B, sum of column dims]` float32.
    """
    stock = _original(tf.compat.v1.feature_column, "input_layer")
    columns = list(feature_columns) if isinstance(
        feature_columns, (list, tuple)) else [feature_columns]
    if not any(_is_ours(c) for c in columns):
        return stock(features, columns, weight_collections, trainable,
                     cols_to_vars, cols_to_output_tensors)
    rest = [c for c in columns if not _handled_by_ge(c)]
    if not rest:
        return ge_input_layer(
            features, columns, weight_collections, trainable, cols_to_vars,
            cols_to_output_tensors, scope=_stock_input_layer_scope())
    ours = [c for c in columns if _handled_by_ge(c)]
    outputs: Dict[Any, tf.Tensor] = {}
    stock(features, rest, weight_collections, trainable, cols_to_vars,
          outputs)
    ge_input_layer(features, ours, weight_collections, trainable,
                   cols_to_vars, outputs, scope=_stock_input_layer_scope())
    ordered = sorted(outputs.items(), key=lambda item: item[0].name)
    if cols_to_output_tensors is not None:
        cols_to_output_tensors.update(ordered)
    return tf.concat([t for _, t in ordered], 1)


def _reads_ev(value) -> bool:
    # A one-element list of an EV is DeepRec's partitioned EV here.
    return isinstance(value, embedding_variable.EmbeddingVariable) or (
        isinstance(value, (list, tuple)) and any(
            isinstance(v, embedding_variable.EmbeddingVariable)
            for v in value))


def _ev_aware(stock: Callable, ours: Callable, first: str) -> Callable:
    """`stock` unchanged unless its `first` argument holds an EV; then
    `ours` with the same arguments, bound by name (so TF1 and TF2
    signatures, whose argument orders differ, both work)."""
    signature = inspect.signature(stock)
    accepted = set(inspect.signature(ours).parameters)

    @functools.wraps(stock)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return stock(*args, **kwargs)  # stock's own error
        if not _reads_ev(bound.arguments.get(first)):
            return stock(*args, **kwargs)
        return ours(**{k: v for k, v in bound.arguments.items()
                       if k in accepted})

    wrapper.__wrapped_stock__ = stock  # type: ignore[attr-defined]
    return wrapper


def _ev_read_names(root) -> List[Tuple[Any, str, Any]]:
    """EV-aware versions of `root.nn.embedding_lookup*` and
    `root.gather`, each wrapping the stock function found there."""
    out = []
    for namespace, name, ours, first in (
            (root.nn, "embedding_lookup", ev_reads.embedding_lookup,
             "params"),
            (root.nn, "embedding_lookup_sparse",
             ev_reads.embedding_lookup_sparse, "params"),
            (root.nn, "safe_embedding_lookup_sparse",
             ev_reads.safe_embedding_lookup_sparse, "embedding_weights"),
            (root, "gather", ev_reads.gather, "params")):
        stock = _original(namespace, name)
        out.append((namespace, name, _ev_aware(stock, ours, first)))
    return out


_unsupported = runtime_features.Unavailable

_MULTIHASH = ("use categorical_column_with_embedding: an EV stores every "
              "id, with no hash collisions to compress away.")
# DeepRec names with no meaning here, referenced by its modelzoo scripts
# and its EV tests.
_UNSUPPORTED = {
    "staged": ("tf.staged (SmartStage)",
               "drop the call and use tf.data prefetch()."),
    "make_prefetch_hook": ("tf.make_prefetch_hook (SmartStage)",
                           "drop the hook; tf.data prefetch() does it."),
    "get_multihash_variable": ("tf.get_multihash_variable (Multi-Hash "
                               "Variable)", _MULTIHASH),
    "get_dynamic_dimension_embedding_variable": (
        "tf.get_dynamic_dimension_embedding_variable (dynamic-dimension "
        "EV)", "use get_embedding_variable with one embedding_dim."),
}
_UNSUPPORTED_FEATURE_COLUMN = {
    "categorical_column_with_adaptive_embedding": (
        "tf.feature_column.categorical_column_with_adaptive_embedding",
        "use categorical_column_with_embedding."),
    "categorical_column_with_multihash": (
        "tf.feature_column.categorical_column_with_multihash (Multi-Hash "
        "Variable)", _MULTIHASH),
}
_UNSUPPORTED_V1_TRAIN = {
    "AdagradDecayOptimizerV2": (
        "tf.train.AdagradDecayOptimizerV2",
        "use tf.train.AdagradDecayOptimizer (DeepRec's first version, "
        "provided for EVs and plain variables)."),
}

_CONTRIB_COLUMNS = ("use tf.feature_column.categorical_column_with_"
                    "embedding, embedding_column and input_layer (a "
                    "linear model: embedding_column(..., 1, 'sum')).")
# `tf.contrib` as far as DeepRec's scripts and tests use it.
_CONTRIB = types.SimpleNamespace(
    feature_column=types.SimpleNamespace(
        sequence_input_layer=ge_sequence_input_layer),
    layers=types.SimpleNamespace(**{
        name: _unsupported(f"tf.contrib.layers.{name}", _CONTRIB_COLUMNS)
        for name in ("sparse_column_with_embedding",
                     "input_from_feature_columns",
                     "weighted_sum_from_feature_columns")}),
    opt=types.SimpleNamespace(AdamWOptimizer=_unsupported(
        "tf.contrib.opt.AdamWOptimizer",
        "use tf.train.AdamOptimizer and apply the decoupled weight decay "
        "yourself (var -= lr * weight_decay * var).")))

FUSION_TYPES = ("localized", "collective")


def enable_group_embedding(fusion_type="collective"):
    """DeepRec's first switch for grouped lookups
    (`tf.config.experimental.enable_group_embedding`), which later DeepRec
    replaced by `enable_distributed_strategy`.

    Args:
        fusion_type: "localized": a no-op, since grouped lookups in one
            process need no switch here. "collective": refused with a
            pointer to `tf.config.experimental.enable_distributed_strategy`
            (`ge.enable_distributed_strategy`), whose Horovod sharding
            replaces DeepRec's SOK-based collective mode.

    Raises:
        NotImplementedError: `fusion_type="collective"`.
        ValueError: any other `fusion_type`.
    """
    if fusion_type == "localized":
        return
    if fusion_type == "collective":
        raise NotImplementedError(
            "enable_group_embedding(fusion_type='collective') is DeepRec's "
            "SOK-based mode and is not provided; call "
            "tf.config.experimental.enable_distributed_strategy("
            "'collective') (ge.enable_distributed_strategy) instead, which "
            "shards the tables over Horovod workers.")
    raise ValueError(f"enable_group_embedding: fusion_type must be one of "
                     f"{FUSION_TYPES}, got {fusion_type!r}.")


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
    }
    top.update({k: _unsupported(*v) for k, v in _UNSUPPORTED.items()})
    config = {"enable_group_embedding": enable_group_embedding}
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
    feature_column.update({k: _unsupported(*v) for k, v in
                           _UNSUPPORTED_FEATURE_COLUMN.items()})
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
    # DeepRec's collections of EV init ops, and its proto enum of EV
    # storage tiers (`config_pb2.StorageType.DRAM`).
    out.append((tf.compat.v1.GraphKeys, "EV_INIT_VAR_OPS",
                embedding_variable.EV_INIT_VAR_OPS))
    out.append((tf.compat.v1.GraphKeys, "EV_INIT_SLOT_OPS",
                embedding_variable.EV_INIT_SLOT_OPS))
    out.append((config_pb2, "StorageType", options.StorageType))
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
    out += [(tf.compat.v1.train, k, _unsupported(*v))
            for k, v in _UNSUPPORTED_V1_TRAIN.items()]
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
