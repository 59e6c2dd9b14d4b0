"""Stand-ins for DeepRec runtime features that stock TensorFlow lacks.

DeepRec scripts reach these features through names (`tf.staged`,
`tf.contrib.layers.*`, `tf.config.experimental.enable_group_embedding`),
modules (`parquet_dataset_ops`, `work_queue`) and fields DeepRec added to
`ConfigProto.graph_options.optimizer_options` (`do_smart_stage`).
`group_embedding.compat` installs the stand-ins defined here, so that each
one either does nothing, where stock TF already does the job, or raises
one NotImplementedError naming the feature and the stock alternative,
instead of an AttributeError or ImportError deep inside TF. Nothing here
changes `tf` by itself.
"""

import importlib.machinery
import logging
import operator
import types

from tensorflow.core.protobuf import config_pb2

_logger = logging.getLogger(__name__)


class Unavailable:
    """A DeepRec name with no meaning on stock TF.

    Calling it, or reading one of its public attributes (DeepRec's
    `parquet_dataset_ops.DataFrame.Field`), raises NotImplementedError
    naming the feature and what to do instead. Private and dunder
    attributes stay AttributeErrors, so that `hasattr` probes (copy,
    inspect, doc tools) keep working.

    Args:
        feature: the DeepRec name or feature, as the error shows it.
        alternative: what to do on stock TF, one sentence.
    """

    def __init__(self, feature: str, alternative: str):
        self.feature = feature
        self.alternative = alternative
        self.__name__ = feature.split(" ", 1)[0].rsplit(".", 1)[-1]

    def error(self) -> NotImplementedError:
        """The error every use of this name raises."""
        return NotImplementedError(
            f"{self.feature} is a DeepRec runtime feature that "
            "group_embedding does not provide on stock TensorFlow; "
            f"{self.alternative}")

    def __call__(self, *args, **kwargs):
        raise self.error()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        raise self.error()

    def __repr__(self):
        return f"<unavailable DeepRec feature {self.feature}>"


class UnavailableModule(types.ModuleType):
    """A DeepRec-only module: importing it works, and every public name
    read from it is an `Unavailable` naming the module's feature.

    Args:
        name: the module's dotted name.
        feature: the DeepRec feature the module provides.
        alternative: what to do on stock TF, one sentence.
    """

    def __init__(self, name: str, feature: str, alternative: str):
        super().__init__(name, f"DeepRec's {feature}: not available on "
                               f"stock TensorFlow; {alternative}")
        # A spec, so that importlib treats the module as loaded.
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)
        self._feature = feature
        self._alternative = alternative

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(
                f"module {self.__name__!r} has no attribute {attr!r}")
        return Unavailable(f"{attr} ({self._feature}, {self.__name__})",
                           self._alternative)


_READ_PARQUET = ("read the files with pandas.read_parquet or "
                 "pyarrow.parquet and feed tf.data.Dataset."
                 "from_tensor_slices, or convert them to CSV / TFRecord "
                 "for tf.data.TextLineDataset / TFRecordDataset.")

_ADAGRAD_DECAY = ("use tf.train.AdagradDecayOptimizer (DeepRec's first "
                  "version, provided for EVs and plain variables).")

# DeepRec-only modules that its scripts and tests import.
MODULES = tuple(UnavailableModule(*spec) for spec in (
    ("tensorflow.python.data.experimental.ops.parquet_dataset_ops",
     "ParquetDataset", _READ_PARQUET),
    ("tensorflow.python.data.experimental.ops.dataframe",
     "ParquetDataset's DataFrame", _READ_PARQUET),
    ("tensorflow.python.ops.work_queue", "WorkQueue",
     "list the files per worker yourself, e.g. "
     "tf.data.Dataset.list_files(...).shard(num_workers, worker_index)."),
    ("tensorflow.python.training.adagrad_decay_v2",
     "AdagradDecayOptimizerV2", _ADAGRAD_DECAY),
    ("tensorflow.python.training.weight_decay_optimizers",
     "AdamWOptimizer",
     "use tf.train.AdamOptimizer and apply the decoupled weight decay "
     "yourself (var -= lr * weight_decay * var), or keras.optimizers."
     "AdamW on plain variables in TF2 code."),
))


# --- DeepRec names with no meaning here ---
# Referenced by DeepRec's model zoo scripts and its EV tests; compat
# installs each under its name (attribute -> stand-in).

_MULTIHASH = ("use categorical_column_with_embedding: an EV stores every "
              "id, with no hash collisions to compress away.")
# In `tf` and `tf.compat.v1`.
UNSUPPORTED_NAMES = {
    "staged": Unavailable("tf.staged (SmartStage)",
                          "drop the call and use tf.data prefetch()."),
    "make_prefetch_hook": Unavailable(
        "tf.make_prefetch_hook (SmartStage)",
        "drop the hook; tf.data prefetch() does it."),
    "get_multihash_variable": Unavailable(
        "tf.get_multihash_variable (Multi-Hash Variable)", _MULTIHASH),
    "get_dynamic_dimension_embedding_variable": Unavailable(
        "tf.get_dynamic_dimension_embedding_variable (dynamic-dimension "
        "EV)", "use get_embedding_variable with one embedding_dim."),
}
# In `tf.feature_column` and `tf.compat.v1.feature_column`.
UNSUPPORTED_FEATURE_COLUMNS = {
    "categorical_column_with_adaptive_embedding": Unavailable(
        "tf.feature_column.categorical_column_with_adaptive_embedding",
        "use categorical_column_with_embedding."),
    "categorical_column_with_multihash": Unavailable(
        "tf.feature_column.categorical_column_with_multihash (Multi-Hash "
        "Variable)", _MULTIHASH),
}
# In `tf.compat.v1.train`.
UNSUPPORTED_V1_TRAIN = {
    "AdagradDecayOptimizerV2": Unavailable(
        "tf.train.AdagradDecayOptimizerV2", _ADAGRAD_DECAY),
}

_CONTRIB_COLUMNS = ("use tf.feature_column.categorical_column_with_"
                    "embedding, embedding_column and input_layer (a "
                    "linear model: embedding_column(..., 1, 'sum')).")
# `tf.contrib.layers` and `tf.contrib.opt` as far as DeepRec's scripts and
# tests use them (compat's `tf.contrib` also holds
# `feature_column.sequence_input_layer`, which this library provides).
CONTRIB_LAYERS = types.SimpleNamespace(**{
    name: Unavailable(f"tf.contrib.layers.{name}", _CONTRIB_COLUMNS)
    for name in ("sparse_column_with_embedding",
                 "input_from_feature_columns",
                 "weighted_sum_from_feature_columns")})
CONTRIB_OPT = types.SimpleNamespace(AdamWOptimizer=Unavailable(
    "tf.contrib.opt.AdamWOptimizer",
    "use tf.train.AdamOptimizer and apply the decoupled weight decay "
    "yourself (var -= lr * weight_decay * var)."))

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


# --- DeepRec's fields of ConfigProto.graph_options.optimizer_options ---
# Protobuf messages take no fields beyond their descriptor's, and upb
# message classes cannot be subclassed, so compat patches
# `OptimizerOptions.__setattr__` (and one property): real ConfigProtos
# still reach Session, MonitoredTrainingSession and RunConfig untouched.

_SMART_STAGE = ("delete the line; tf.data prefetch() overlaps input "
                "with training.")
# name -> the feature it switches on, and what to do instead.
REFUSED_OPTIMIZER_OPTIONS = {
    "do_smart_stage": Unavailable(
        "SmartStage (optimizer_options.do_smart_stage)", _SMART_STAGE),
    "do_smart_stage_gpu": Unavailable(
        "SmartStage (optimizer_options.do_smart_stage_gpu)", _SMART_STAGE),
    "stage_multi_stream": Unavailable(
        "SmartStage (optimizer_options.stage_multi_stream)", _SMART_STAGE),
    "micro_batch_num": Unavailable(
        "Auto Micro Batch (optimizer_options.micro_batch_num)",
        "delete the line, or split the batch and accumulate the "
        "gradients yourself."),
    "do_async_embedding": Unavailable(
        "async embedding (optimizer_options.do_async_embedding)",
        "delete the line; tf.data prefetch() overlaps input with "
        "training."),
    "embedding_layer_device_placement_optimization": Unavailable(
        "embedding placement optimization (optimizer_options."
        "embedding_layer_device_placement_optimization)",
        "delete the line; place ops with tf.device if needed."),
}
ASYNC_EMBEDDING = Unavailable(
    "async embedding (optimizer_options.async_embedding_options)",
    "delete the lines setting it.")
OP_FUSION = "do_op_fusion"
_state = {"op_fusion_warned": False}


def _switches_on(name: str, value) -> bool:
    """True when `value` turns the knob on; off values mean stock
    behaviour, so setting them is accepted and ignored."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"optimizer_options.{name} takes "
            f"{'an int' if name == 'micro_batch_num' else 'a bool'}, got "
            f"{value!r}.") from None
    # One micro batch is the whole batch: DeepRec's "off" too.
    return number > 1 if name == "micro_batch_num" else number != 0


def set_optimizer_option(message, name: str, value) -> None:
    """`OptimizerOptions.__setattr__` while compat is installed.

    `do_op_fusion` is a no-op (logged once): TF's grappler remapper fuses
    ops by default. Turning on another DeepRec field of
    `REFUSED_OPTIMIZER_OPTIONS` (SmartStage, micro batches, async
    embedding) raises NotImplementedError naming it; setting it off
    (False, 0, one micro batch) is accepted and does nothing.
    `async_embedding_options` is refused whatever the value. Every other
    name is protobuf's own field assignment.

    Raises:
        NotImplementedError: a DeepRec runtime feature switched on.
        TypeError: a DeepRec field given a value of the wrong type.
    """
    if name == OP_FUSION:
        if _switches_on(name, value) and not _state["op_fusion_warned"]:
            _state["op_fusion_warned"] = True
            _logger.warning(
                "optimizer_options.do_op_fusion is ignored: stock "
                "TensorFlow's grappler already fuses ops (remapper).")
        return
    if name == "async_embedding_options":
        raise ASYNC_EMBEDDING.error()
    if name in REFUSED_OPTIMIZER_OPTIONS:
        if _switches_on(name, value):
            raise REFUSED_OPTIMIZER_OPTIONS[name].error()
        return
    super(config_pb2.OptimizerOptions, message).__setattr__(name, value)


def _refuse_read(message):
    del message
    raise ASYNC_EMBEDDING.error()


# Read before its fields are set (`...async_embedding_options.capacity =`).
ASYNC_EMBEDDING_OPTIONS = property(
    _refuse_read, doc="DeepRec's async embedding options: not available.")
