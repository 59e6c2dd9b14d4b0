"""EmbeddingVariable: an embedding table keyed by arbitrary int64 keys,
growing as new keys arrive (DeepRec's `get_embedding_variable`)."""

import copy
import dataclasses
import itertools
import json
import logging
import math
import os
import shutil
import weakref
from typing import Any
from typing import Dict
from typing import Optional

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.framework import variable_pb2
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import trackable_utils
from tensorflow.python.training.saving import saveable_object_util

from group_embedding import model_parallel
from group_embedding.embedding_variable.options import CacheStrategy
from group_embedding.embedding_variable.options import CBFFilter
from group_embedding.embedding_variable.options import EmbeddingVariableOption
from group_embedding.embedding_variable.options import GlobalStepEvict
from group_embedding.embedding_variable.options import L2WeightEvict
from group_embedding.embedding_variable.options import StorageType
from group_embedding.embedding_variable.stock_optimizer_guard import add_guard
from group_embedding.ops import capabilities
from group_embedding.ops import ev_storage
from group_embedding.ops import hbm_ev_storage
from group_embedding.ops.ragged_ids import FeatureIds

SUPPORTED_KEY_DTYPES = (tf.int64, tf.int32)
_uid = itertools.count()
# Graph -> {disk tier folder: EV name}: in a graph the kernel's own claim
# of a folder (OpenTier) only runs with the graph, so a second EV given
# the same folder is refused here, when it is built.
_GRAPH_TIER_DIRS: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, str]]" = \
    weakref.WeakKeyDictionary()
_logger = logging.getLogger(__name__)


def default_initializer(embedding_dim: int):
    """Truncated normal, stddev `1/sqrt(embedding_dim)`, seeded like a stock
    initializer with `seed=None`: the op seed comes from the graph-level
    seed (`tf.random.set_seed`, `tf.compat.v1.set_random_seed`) through
    `tf.compat.v1.get_seed`, so a seeded script draws the same values on
    every run, and an unseeded one different values."""
    stddev = 1.0 / math.sqrt(embedding_dim)

    def init(shape, dtype=tf.float32):
        graph_seed, op_seed = tf.compat.v1.get_seed(None)
        if graph_seed is None:
            return tf.random.truncated_normal(shape, stddev=stddev,
                                              dtype=dtype)
        return tf.random.stateless_truncated_normal(
            shape, seed=[graph_seed, op_seed], stddev=stddev, dtype=dtype)

    return init


class StockOptimizerError(TypeError, AttributeError):
    """A stock optimizer was given an EmbeddingVariable.

    Also an AttributeError, so that `hasattr(ev, "_unique_id")` stays
    False for code that probes for resource variables.
    """



class EmbeddingVariable(tf.Module):
    """A `[unbounded, D]` embedding table keyed by int64 (or int32) keys.

    Create it with `ge.get_embedding_variable`. Keys may be any value of
    the key dtype (negative, 0, 2**63-1). Storage is a C++ resource that
    holds, per key, the value row, an occurrence count (`freq`), the last
    step the key was seen in training (`version`) and every optimizer
    slot; it grows up to 2**32 - 2 rows (then inserting fails with
    `ResourceExhaustedError`) and reuses the rows of evicted keys.

    Training vs inference:
        `ge.group_embedding_lookup_sparse(..., training=True)` (the
        default) inserts keys seen for the first time (under a `CBFFilter`
        only once admitted), initialised from row `key mod
        default_value_dim` of the default matrix, counts occurrences and
        stamps the key's version with the latest step applied. With
        `training=False` nothing is inserted or counted: unknown keys
        read their default row (or `default_value_no_permission` under a
        filter).

    Gradients: `tape.gradient(loss, ev)` is a `tf.IndexedSlices` whose
    `indices` are keys (not row numbers) and whose `dense_shape` is None.
    Apply it with `ge.optimizers` / `ge.train` optimizers, which update only
    the touched keys and their slots.

    Checkpoints: `tf.train.Checkpoint` and `tf.compat.v1.train.Saver` save
    keys, values, freqs, versions and all slots as one snapshot (and the
    default matrix as a variable); restoring replaces the whole content.
    The eviction policy runs just before each save. Saver keys are
    `<name>-keys`, `<name>-values`, ... (DeepRec's names); Checkpoint keys
    follow the object path (`<path>/.ATTRIBUTES/keys`), so restoring does
    not depend on the variable's name. The default matrix is saved as
    `<name>/default_values` both by the default Saver (as a global
    variable) and by `Saver(var_list=[ev, ...])` (with the EV), so either
    Saver restores the other's checkpoints; do not list
    `ev.default_values` next to `ev` (the Saver refuses the duplicate
    name). Its initializer, in `EV_INIT_VAR_OPS` and in the global
    initializer, assigns only once, as DeepRec initializes an EV once.

    MetaGraphs: `export_meta_graph`/`import_meta_graph` (and SavedModel)
    carry the EV; the imported graph's SAVEABLE_OBJECTS hold EVs bound to
    the imported ops, so a new Saver there saves and restores them.

    Keras: wrap it in a `KerasEmbeddingVariable` inside the owning layer
    so that `model.fit` trains it with `ge.optimizers`.

    Note: DeepRec saves values and slots at different moments; here one
    lock covers the whole snapshot, so slots always belong to the saved
    keys.

    Attributes:
        embedding_dim: D.
        key_dtype: tf.int64 or tf.int32.
        ev_option: the `EmbeddingVariableOption`.
        default_values: `[default_value_dim, D]` non-trainable variable.
    """

    _should_act_as_resource_variable = True  # tape/gradients use `.handle`
    # What `lookup_plan` plans for it (no type probes below the plan);
    # "hbm_ev" for a table in GPU memory (StorageType.HBM).
    ge_table_kind = "ev"
    # The storage calls (export, import, slots, updates): the C++ CPU
    # storage, or an `hbm_ev_storage.HbmStorage` (StorageType.HBM).
    storage: Any = ev_storage

    def __init__(self, name: str, embedding_dim: int, key_dtype, value_dtype,
                 initializer, trainable: bool,
                 ev_option: EmbeddingVariableOption):
        # tf.Module wants a Python identifier; ours may hold '/'.
        super().__init__()
        self._ev_name = name
        # Checkpoint code names resource-variable-like objects by this.
        self._shared_name = name
        self.embedding_dim = embedding_dim
        self.key_dtype = key_dtype
        self._dtype = value_dtype
        self._trainable = trainable
        self.ev_option = ev_option
        init_opt = ev_option.init_option
        # DeepRec's precedence: the InitializerOption's initializer wins.
        init = init_opt.initializer or initializer or \
            default_initializer(embedding_dim)
        shape = [init_opt.default_value_dim, embedding_dim]
        with tf.init_scope():
            self.default_values = tf.Variable(
                lambda: tf.cast(init(shape, dtype=tf.float32), tf.float32),
                trainable=False, name=f"{name}/default_values")
            if not tf.executing_eagerly():
                self._make_defaults_init_idempotent()
            self._handle = self._create_handle()
            if tf.executing_eagerly():
                self._deleter = resource_variable_ops.EagerResourceDeleter(
                    self._handle, self._handle.device)
            else:
                # The default Saver takes GLOBAL_VARIABLES (which hold
                # default_values) plus SAVEABLE_OBJECTS: the collection gets
                # a view of this EV that saves the table alone, else the
                # default matrix would be written twice under one name.
                tf.compat.v1.add_to_collection(
                    tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS,
                    self.table_only())
                add_guard(self)

    def table_only(self) -> "EmbeddingVariable":
        """This EV as a Saver entry that leaves the default matrix out.

        `Saver(var_list=[ev])` saves and restores `<name>/default_values`
        with the table. Checkpoints written by such a Saver before it did
        so hold the table alone; restore them with
        `Saver(var_list=[ev.table_only()])`, which restores what is there
        and keeps the current default matrix (run
        `ev.default_values.initializer` first in a fresh session). The
        result shares all state with `ev`.
        """
        if not self._saves_default_values:
            return self
        view = copy.copy(self)
        view._saves_default_values = False
        return view

    def _make_defaults_init_idempotent(self):
        """Makes `default_values.initializer` assign only while the
        variable is uninitialized.

        DeepRec's init sequence runs `EV_INIT_VAR_OPS` and then
        `global_variables_initializer()`, and both hold this initializer;
        DeepRec initializes an EV once, so the second run must not redraw
        a seeded random matrix. The initial value stays outside the cond
        so that its op seed is the one a stock variable would get.
        """
        var = self.default_values
        initial = var.initial_value
        with tf.name_scope(var.op.name + "/"), tf.name_scope("InitOnce"):
            done = tf.cond(
                resource_variable_ops.var_is_initialized_op(var.handle),
                lambda: tf.constant(False),
                lambda: _assign_true(var, initial))
        # Both EV_INIT_VAR_OPS and the global initializer take this op;
        # a MetaGraph export records it as the variable's initializer.
        var._initializer_op = done.op  # pylint: disable=protected-access

    def _create_handle(self):
        opt = self.ev_option
        evict = opt.evict_option
        steps = (evict.steps_to_live or 0
                 if isinstance(evict, GlobalStepEvict) else 0)
        l2 = (float(evict.l2_weight_threshold)
              if isinstance(evict, L2WeightEvict) else -1.0)
        filt = opt.filter_option
        freq = 0 if filt is None else filt.filter_freq
        cbf = filt if isinstance(filt, CBFFilter) else None
        if tf.executing_eagerly():
            shared = f"{self._ev_name}_{next(_uid)}"
        else:
            shared = tf.compat.v1.get_default_graph().unique_name(
                self._ev_name + "/storage", mark_as_used=True)
        storage = opt.storage_option
        if storage.is_hbm():
            return self._create_hbm_handle(shared, freq, steps, l2)
        path = ""
        if storage.is_tiered():
            path = _prepare_storage_path(self._ev_name, storage,
                                         self.embedding_dim)
            if not tf.executing_eagerly():
                _claim_in_graph(self._ev_name, path)
        try:
            return ev_storage.create_handle(
                self._ev_name, shared, self.embedding_dim, freq,
                float(opt.init_option.default_value_no_permission), steps, l2,
                cbf_counters=cbf.num_counters if cbf else 0,
                cbf_hashes=cbf.num_hashes if cbf else 0,
                cbf_counter_bytes=cbf.counter_bytes if cbf else 8,
                max_rows=self._max_rows_for_testing, storage_path=path,
                dram_bytes=storage.dram_bytes(),
                cache_lru=storage.cache_strategy == CacheStrategy.LRU)
        except tf.errors.InvalidArgumentError as e:
            # A folder another live EV owns, a file that cannot be
            # created: a bad storage_path (eager; a graph reports what
            # _claim_in_graph cannot see at its first run).
            raise ValueError(e.message) from None

    def _create_hbm_handle(self, shared: str, filter_freq: int,
                           steps_to_live: int, l2_threshold: float):
        """The table in GPU memory (StorageType.HBM; HBM_DRAM adds a
        host-memory tier for the keys it gives up); its eviction policy
        (`steps_to_live`, `l2_threshold`: `_create_handle`'s) runs in
        `evict`, when the CPU EV's does.

        Raises:
            RuntimeError: no GPU kernels here (TF sees no GPU, naming the
                EV; no CPU fallback).
            NotImplementedError: a CBFFilter (not on the GPU table yet).
        """
        opt = self.ev_option
        storage = opt.storage_option
        module = capabilities.current().hbm_ev_module(
            [f"EmbeddingVariable '{self._ev_name}'"])
        if isinstance(opt.filter_option, CBFFilter):
            raise NotImplementedError(
                f"EmbeddingVariable '{self._ev_name}': a CBFFilter is not "
                "built for GPU tables yet; use a CounterFilter, or "
                "StorageType.DRAM.")
        buckets = hbm_ev_storage.num_buckets(storage.hbm_bytes(),
                                             self.embedding_dim)
        hbm = hbm_ev_storage.HbmStorage(
            module, self._ev_name, self.embedding_dim, buckets,
            steps_to_live, l2_threshold,
            host_tier=storage.storage_type == StorageType.HBM_DRAM)
        self.storage = hbm
        self.ge_table_kind = "hbm_ev"
        return hbm.create_handle(
            shared, filter_freq,
            float(opt.init_option.default_value_no_permission),
            lfu=storage.cache_strategy != CacheStrategy.LRU)

    # False for the SAVEABLE_OBJECTS view (see __init__): a Saver given
    # the EV in `var_list` saves its default matrix too.
    _saves_default_values = True

    # > 0: the row limit of tables created from now on (the real one,
    # 2**32 - 2, cannot be reached in a test).
    _max_rows_for_testing = 0

    # --- variable-like surface used by the grouped lookup and the tape ---
    @property
    def name(self) -> str:
        return self._ev_name

    @property
    def handle(self) -> tf.Tensor:
        return self._handle

    @property
    def dtype(self):
        return self._dtype

    @property
    def shape(self) -> tf.TensorShape:
        return tf.TensorShape([None, self.embedding_dim])

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def _unique_id(self):
        # Stock optimizers (Keras 3, tf.compat.v1.train) key their slots by
        # `_unique_id` and update dense rows, not keys: refuse them here,
        # their first touch of the variable.
        raise StockOptimizerError(
            f"EmbeddingVariable '{self._ev_name}' is keyed by key and can "
            "only be trained by `ge.optimizers` (Keras, e.g. "
            "ge.optimizers.Adagrad) or `ge.train` (tf.compat.v1) "
            "optimizers, not by a stock optimizer.")

    def __repr__(self):
        return (f"<EmbeddingVariable '{self._ev_name}' dim="
                f"{self.embedding_dim} key_dtype={self.key_dtype.name}>")

    def check_keys(self, keys, argument: str):
        """Checks that `keys` can address this variable.

        Args:
            keys: a Tensor, SparseTensor or RaggedTensor of keys.
            argument: how the caller names `keys` in messages.

        Raises:
            TypeError: float/string keys, or int64 keys for an int32
                variable.
        """
        dtype = tf.as_dtype(keys.dtype)
        if not dtype.is_integer:
            raise TypeError(f"EmbeddingVariable '{self._ev_name}': "
                            f"`{argument}` must hold integer keys, got "
                            f"{dtype.name}.")
        if dtype not in SUPPORTED_KEY_DTYPES or (
                self.key_dtype == tf.int32 and dtype != tf.int32):
            raise TypeError(f"EmbeddingVariable '{self._ev_name}': "
                            f"`{argument}` has dtype {dtype.name} but the "
                            f"variable's key_dtype is {self.key_dtype.name}.")

    def lookup_rows(self, keys, training=True) -> tf.Tensor:
        """Rows for `keys` of any shape S: returns `S + [D]`.

        Args:
            keys: integer tensor of keys.
            training: True (default) inserts new keys and counts them;
                False reads only (Python bool or bool tensor).
        """
        keys = tf.convert_to_tensor(keys)
        self.check_keys(keys, "keys")
        flat = tf.cast(tf.reshape(keys, [-1]), tf.int64)
        if self.ge_table_kind == "hbm_ev":
            # One key per pooled row, summed: the key's row.
            one_each = FeatureIds(
                values=flat, row_splits=tf.range(
                    tf.size(flat, out_type=tf.int64) + 1),
                weights=None, positions=None, max_len=None, name="keys")
            rows = hbm_ev_storage.pooled_lookup(
                self.storage.module, [self], [one_each], ["sum"], None,
                training)[0]
        else:
            rows = ev_storage.group_gather([self], [flat], training)
        return tf.reshape(rows, tf.concat(
            [tf.shape(keys), [self.embedding_dim]], 0))

    def ensure_slot(self, slot_name: str, initial_value: float):
        """Creates optimizer slot `slot_name` if missing (keys present get
        `initial_value`); returns the op (None when run eagerly)."""
        return self.storage.ensure_slot(self._handle, slot_name,
                                        initial_value)

    def size(self) -> tf.Tensor:
        """Number of live keys (int64 scalar)."""
        return self.storage.size(self._handle)[0]

    def bytes_per_key(self) -> tf.Tensor:
        """Bytes held by the storage per live key (float64 scalar).

        Counts the hash map, every allocated row (values, key, freq,
        version, all slots) and the free list; rows are allocated in
        chunks of 1024, so small tables read higher.
        """
        n, b = self.storage.size(self._handle)
        return tf.cast(b, tf.float64) / tf.cast(tf.maximum(n, 1), tf.float64)

    def export(self):
        """Returns (keys [n], values [n, D], versions [n], freqs [n]),
        DeepRec's order, from one consistent snapshot."""
        keys, values, freqs, versions, _, _, _, _ = self.storage.export(
            self._handle, self.embedding_dim)
        return keys, values, versions, freqs

    def evict(self) -> tf.Tensor:
        """Runs the eviction policy now; returns how many keys it removed
        (always 0 without an `evict_option`)."""
        return self.storage.evict(self._handle)

    # --- DeepRec's statistics accessors (read from one export snapshot) ---
    def total_count(self) -> tf.Tensor:
        """DeepRec's `total_count()`: int64 `[number of keys, D]`, the
        variable's current dynamic shape."""
        return tf.stack([self.size(),
                         tf.constant(self.embedding_dim, tf.int64)])

    def get_dynamic_shape(self) -> tf.Tensor:
        """DeepRec's newer name of `total_count()`."""
        return self.total_count()

    def _per_key(self, ids, column: int, missing: int) -> tf.Tensor:
        ids = tf.convert_to_tensor(ids)
        self.check_keys(ids, "ids")
        keys, _, versions, freqs = self.export()
        stat = (freqs, versions)[column]
        order = tf.argsort(keys)
        keys, stat = tf.gather(keys, order), tf.gather(stat, order)
        flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
        pos = tf.searchsorted(keys, flat, out_type=tf.int64)
        # One sentinel row so that `pos` == n (absent, past the end) can
        # be gathered, also from an empty table.
        keys = tf.concat([keys, [0]], 0)
        stat = tf.concat([tf.cast(stat, tf.int64), [missing]], 0)
        found = tf.logical_and(pos < tf.size(keys, tf.int64) - 1,
                               tf.equal(tf.gather(keys, pos), flat))
        values = tf.where(found, tf.gather(stat, pos),
                          tf.constant(missing, tf.int64))
        return tf.reshape(values, tf.shape(ids))

    def get_frequency(self, ids) -> tf.Tensor:
        """DeepRec's `get_frequency(ids)`: int64 occurrence count of each
        key in `ids` (same shape), 0 for keys not stored. Reads nothing
        into the table (no insertion)."""
        return self._per_key(ids, 0, 0)

    def get_version(self, ids) -> tf.Tensor:
        """DeepRec's `get_version(ids)`: int64 last step each key was seen
        in training, admitted or not (same shape as `ids`), -1 for keys
        not stored."""
        return self._per_key(ids, 1, -1)

    # --- checkpointing -------------------------------------------------
    def _serialize_to_tensors(self):
        from group_embedding.export import ev_snapshot
        if ev_snapshot.writing_saved_model():
            # A SavedModel holds the EV as its stock-TF snapshot
            # (export/ev_snapshot.py): no storage op may enter its graph,
            # and its checkpoint holds no copy of the table.
            if not ev_snapshot.freezing():
                # The save now writes its checkpoint, whose object graph
                # holds the snapshot: the copy kept for the save can go.
                ev_snapshot.release([self])
            return {}
        deps = []
        if self.ev_option.evict_option is not None:
            deps.append(self.evict())
        with tf.control_dependencies(deps if not tf.executing_eagerly()
                                     else []):
            out = self.storage.export(self._handle, self.embedding_dim)
        names = ("keys", "values", "freqs", "versions", "slot_names",
                 "slot_inits", "slots", "step")
        return dict(zip(names, out))

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":
            from group_embedding.export import ev_snapshot
            if ev_snapshot.freezing():
                # What the SavedModel's lookups read (stock TF variables).
                children = dict(children, serving_snapshot=ev_snapshot.
                                snapshot_for_save(self))
        return children

    def _write_object_proto(self, proto, options):
        # A SavedModel calls this for objects that act as resource
        # variables, which the EV does; when one lists the EV (e.g. among
        # the variables a traced function read), store an empty object:
        # the rows are in the EV's snapshot.
        del options
        proto.user_object.identifier = "_generic_user_object"
        proto.user_object.version.producer = 1
        proto.user_object.version.min_consumer = 1

    def _gather_saveables_for_checkpoint(self):
        # Only `tf.compat.v1.train.Saver` calls this (tf.train.Checkpoint
        # uses `_serialize_to_tensors`, keyed by object path). The Saver
        # names tensors by their local names alone, so every EV would
        # write bare `keys`, `values`, ... and the last one would win;
        # prefix them with the variable's name, like DeepRec (`name-keys`)
        # and TF's MutableHashTable.
        factory = saveable_object_util.saveable_objects_from_trackable(
            self)[trackable_utils.SERIALIZE_TO_TENSORS_NAME]

        # The dict form `Saver({key: ev})` passes its key; the tensors keep
        # DeepRec's names, which other readers of the checkpoint expect.
        def table(name=None):
            del name
            return factory(name=f"{self._ev_name}-")

        out = {trackable_utils.SERIALIZE_TO_TENSORS_NAME: table}
        if self._saves_default_values:
            # `Saver(var_list=[ev])`: the default matrix goes with the
            # table, under the key the default Saver gives the variable,
            # so both Savers read each other's checkpoints.
            def defaults(name=None):
                del name
                var = self.default_values
                return saveable_object_util.ResourceVariableSaveable(
                    var, "", var._shared_name)  # pylint: disable=protected-access

            out["default_values"] = defaults
        return out

    def _restore_from_tensors(self, restored_tensors):
        t = restored_tensors
        values = t["values"]
        dim = values.shape[-1] if values.shape.rank == 2 else None
        if dim is not None and dim != self.embedding_dim:
            raise ValueError(
                f"EmbeddingVariable '{self._ev_name}': checkpoint has "
                f"embedding_dim {dim} but the variable has "
                f"{self.embedding_dim}.")
        with tf.control_dependencies(self._check_restored_keys(t["keys"])):
            return self.storage.import_(
                self._handle, t["keys"], values, t["freqs"], t["versions"],
                t["slot_names"], t["slot_inits"], t["slots"], t["step"])

    def _check_restored_keys(self, keys):
        """Refuses keys that an int32 variable could never look up (an
        int64 checkpoint) and, in collective mode, keys another worker
        owns (another worker's shard, or a checkpoint of another worker
        count); returns the graph-mode assertion ops."""
        keys = tf.reshape(tf.cast(keys, tf.int64), [-1])
        checks = [self._check_owned_keys(keys)]
        if self.key_dtype == tf.int32:
            outside = tf.logical_or(keys < tf.int32.min,
                                    keys > tf.int32.max)
            checks.append(self._refuse_keys(
                keys, outside, "the checkpoint holds keys outside the "
                "int32 range but the variable's key_dtype is int32 "
                "(restore into an int64 variable)"))
        return [op for ops in checks for op in ops]

    def _check_owned_keys(self, keys):
        rank, size = model_parallel.world()
        if size == 1:
            return []
        foreign = tf.not_equal(model_parallel.key_owner(keys, size), rank)
        return self._refuse_keys(
            keys, foreign, f"this is worker {rank} of {size}, which owns "
            f"the keys k with k mod {size} == {rank}, but the checkpoint "
            "holds keys other workers own: it was written by another "
            "worker or at another worker count (change the count with "
            "ge.save_tables / ge.restore_tables)")

    def _refuse_keys(self, keys, bad, reason):
        """Raises (eagerly) or returns the assertion ops that fail (graph)
        when any of `keys` is `bad`, naming the EV and the reason."""
        message = f"EmbeddingVariable '{self._ev_name}': {reason}"
        if tf.executing_eagerly():
            found = tf.boolean_mask(keys, bad).numpy()
            if len(found):
                raise ValueError(f"{message}: {len(found)} such keys, e.g. "
                                 f"{int(found[0])}.")
            return []
        return [tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(bad)),
            [message + "; first such keys:", tf.boolean_mask(keys, bad)],
            summarize=3)]


    # --- MetaGraph export / import (SAVEABLE_OBJECTS) ------------------
    def _to_proto(self, export_scope=None):
        """Describes this EV for a MetaGraphDef: names of its graph
        elements and its options (the initializer is left out: the
        default matrix is a variable of the graph)."""
        def strip(name):
            return tf_ops.strip_name_scope(name, export_scope)

        option = dataclasses.replace(
            self.ev_option, init_option=dataclasses.replace(
                self.ev_option.init_option, initializer=None))
        attrs = {
            "name": attr_value_pb2.AttrValue(s=strip(self._ev_name).encode()),
            "handle": attr_value_pb2.AttrValue(
                s=strip(self._handle.name).encode()),
            "default_values": attr_value_pb2.AttrValue(
                s=self.default_values.to_proto(
                    export_scope=export_scope).SerializeToString()),
            "embedding_dim": attr_value_pb2.AttrValue(i=self.embedding_dim),
            "key_dtype": attr_value_pb2.AttrValue(
                type=self.key_dtype.as_datatype_enum),
            "trainable": attr_value_pb2.AttrValue(b=self._trainable),
            "saves_default_values": attr_value_pb2.AttrValue(
                b=self._saves_default_values),
            "ev_option": attr_value_pb2.AttrValue(s=json.dumps(
                option.get_config(),
                default=lambda x: getattr(x, "name", str(x))).encode()),
        }
        return attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(
            name=_EV_PROTO_NAME, attr=attrs))

    @classmethod
    def _from_proto(cls, func, import_scope=None):
        """Rebinds an EV to the graph elements an imported MetaGraphDef
        created (the inverse of `_to_proto`)."""
        attrs = func.attr
        graph = tf.compat.v1.get_default_graph()

        def scoped(key):
            return tf_ops.prepend_name_scope(attrs[key].s.decode(),
                                             import_scope)

        ev = cls.__new__(cls)
        tf.Module.__init__(ev)
        ev._ev_name = ev._shared_name = scoped("name")
        ev.embedding_dim = int(attrs["embedding_dim"].i)
        ev.key_dtype = tf.as_dtype(attrs["key_dtype"].type)
        ev._dtype = tf.float32
        ev._trainable = bool(attrs["trainable"].b)
        ev._saves_default_values = bool(attrs["saves_default_values"].b)
        ev.ev_option = EmbeddingVariableOption.from_config(
            json.loads(attrs["ev_option"].s.decode()))
        variable_def = variable_pb2.VariableDef()
        variable_def.ParseFromString(attrs["default_values"].s)
        ev.default_values = resource_variable_ops.ResourceVariable(
            variable_def=variable_def, import_scope=import_scope)
        ev._handle = graph.as_graph_element(scoped("handle"))
        return ev


_EV_PROTO_NAME = "EmbeddingVariable"


def _saveable_to_proto(item, export_scope=None):
    """SAVEABLE_OBJECTS exporter: EVs as a description, anything else by
    its node name, as TF exports it without a registered function."""
    if is_embedding_variable(item):
        return item._to_proto(export_scope)  # pylint: disable=protected-access
    if export_scope and not item.name.startswith(export_scope):
        return None
    return attr_value_pb2.AttrValue(
        s=tf_ops.strip_name_scope(item.name, export_scope).encode())


def _saveable_from_proto(proto, import_scope=None):
    """SAVEABLE_OBJECTS importer (inverse of `_saveable_to_proto`)."""
    if proto.WhichOneof("value") == "func":
        return EmbeddingVariable._from_proto(  # pylint: disable=protected-access
            proto.func, import_scope)
    return tf.compat.v1.get_default_graph().as_graph_element(
        tf_ops.prepend_name_scope(proto.s.decode(), import_scope))


def _register_saveable_proto_functions():
    """Makes MetaGraph export/import carry EVs: without it an EV is
    exported by its name, which is no op, and the import fails."""
    key = tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS
    if tf_ops.get_to_proto_function(key) is None:
        tf_ops.register_proto_function(
            key, proto_type=attr_value_pb2.AttrValue,
            to_proto=_saveable_to_proto, from_proto=_saveable_from_proto)


def _assign_true(var, value):
    """Assigns `value` to `var`; returns True once assigned."""
    with tf.control_dependencies([var.assign(value, read_value=False)]):
        return tf.constant(True)


# Bytes of one DRAM row besides its floats: key, freq and version, and the
# hash bucket, change bits and spill candidate (sizeof(KeyMeta) +
# kDramRowOverheadBytes in ops/kernels/ev_storage.h).
_DRAM_ROW_OVERHEAD_BYTES = 24 + 29


def _prepare_storage_path(name: str, storage, embedding_dim: int) -> str:
    """Checks and creates the disk tier's folder of EV `name`.

    Returns:
        The folder, absolute.

    Raises:
        ValueError: the folder cannot be created or written, its file
            system has no room for one row, or `storage_size[0]` cannot
            hold one row.
    """
    path = os.path.abspath(storage.storage_path)
    row = _DRAM_ROW_OVERHEAD_BYTES + 4 * embedding_dim
    if storage.storage_type == StorageType.DRAM_SSDHASH and \
            storage.dram_bytes() < row:
        raise ValueError(
            f"EmbeddingVariable '{name}': `storage_size[0]` of "
            f"{storage.dram_bytes()} bytes cannot hold one row ({row} bytes "
            f"with dim {embedding_dim}, more with optimizer slots).")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"EmbeddingVariable '{name}': cannot create "
                         f"`storage_path` '{path}': {e.strerror}.") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"EmbeddingVariable '{name}': `storage_path` "
                         f"'{path}' is not writable.")
    if shutil.disk_usage(path).free < 16 + row + 4:
        raise ValueError(f"EmbeddingVariable '{name}': `storage_path` "
                         f"'{path}' is full (no room for one row).")
    return path


def _claim_in_graph(name: str, path: str) -> None:
    """Refuses, when EV `name` is built in a graph, a disk tier folder
    that another EV of the same graph was given (the kernel's check of
    live EVs only runs with the graph)."""
    claims = _GRAPH_TIER_DIRS.setdefault(
        tf.compat.v1.get_default_graph(), {})
    folder = os.path.realpath(path)
    owner = claims.setdefault(folder, name)
    if owner != name:
        raise ValueError(
            f"EmbeddingVariable '{name}': storage_path '{path}' is already "
            f"used by EmbeddingVariable '{owner}'; give each "
            "EmbeddingVariable its own folder.")


def is_embedding_variable(x: object) -> bool:
    """True if `x` is an `EmbeddingVariable`: the one way to ask.

    A `KerasEmbeddingVariable` is not one (it stands for one in a Keras
    layer; `keras_variable.embedding_variable_of` reaches the EV behind
    it).
    """
    return isinstance(x, EmbeddingVariable)


def get_embedding_variable(name: str, embedding_dim: int,
                           key_dtype=tf.int64, value_dtype=tf.float32,
                           initializer=None, trainable: bool = True,
                           ev_option: Optional[EmbeddingVariableOption] = None,
                           *, regularizer=None, collections=None,
                           caching_device=None, partitioner=None,
                           validate_shape=True, custom_getter=None,
                           constraint=None, steps_to_live=None,
                           init_data_source=None):
    """Creates an `EmbeddingVariable` (DeepRec's signature).

    Example::

        ev = ge.get_embedding_variable("user", 16)
        ids = tf.ragged.constant([[7, -3], [2**63 - 1]], tf.int64)
        (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "mean")
        # emb: [2, 16]; keys 7, -3 and 2**63-1 are now stored.

    Args:
        name: variable name, used in checkpoints and error messages.
        embedding_dim: D, int >= 1.
        key_dtype: tf.int64 (default) or tf.int32; int32 keys may address
            an int64 variable, not the reverse.
        value_dtype: tf.float32 (the only supported dtype).
        initializer: draws the default matrix. As in DeepRec,
            `ev_option.init_option.initializer` wins when both are set
            (a warning is logged). Default: truncated normal, stddev
            `1/sqrt(D)`, seeded from the graph-level seed like stock
            initializers (`tf.random.set_seed`).
        trainable: whether gradients flow to the variable (default True).
        ev_option: `EmbeddingVariableOption` (default: no filter, no
            eviction, 4096 default rows).
        regularizer, custom_getter, constraint, init_data_source:
            (keyword only) DeepRec arguments; must be None.
        collections: (keyword only) graph collections to add the variable
            to (graph mode only); the stock variable collections are
            skipped, an EV is not a dense variable.
        caching_device, validate_shape: (keyword only) accepted, no effect.
        partitioner: (keyword only) DeepRec's partitioned EV. Accepted, but
            an EV is one growable hash table here, so nothing is split:
            given a partitioner the result is a one-element list holding
            the EV, which iterates and looks up (`tf.nn.embedding_lookup`,
            `ge.embedding_lookup`) like DeepRec's partitioned variable.
        steps_to_live: (keyword only) DeepRec's shortcut for
            `ev_option.evict_option=GlobalStepEvict(steps_to_live)`.

    Note: DeepRec's 6th positional argument is `regularizer`; here the
    DeepRec-only arguments are keyword-only, so pass them by name.

    Returns:
        The `EmbeddingVariable` (a one-element list of it when
        `partitioner` is given).

    Raises:
        ValueError: bad name or embedding_dim.
        TypeError: unsupported key dtype or a wrong option type.
        NotImplementedError: `value_dtype` other than float32.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
    if (isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int)
            or embedding_dim < 1):
        raise ValueError(f"EmbeddingVariable '{name}': `embedding_dim` must "
                         f"be an int >= 1, got {embedding_dim!r}.")
    key_dtype = tf.as_dtype(key_dtype)
    if key_dtype not in SUPPORTED_KEY_DTYPES:
        raise TypeError(f"EmbeddingVariable '{name}': `key_dtype` must be "
                        f"int64 or int32, got {key_dtype.name}.")
    value_dtype = tf.as_dtype(value_dtype)
    if value_dtype != tf.float32:
        raise NotImplementedError(
            f"EmbeddingVariable '{name}': `value_dtype` {value_dtype.name} "
            "is not supported, use float32.")
    if ev_option is None:
        ev_option = EmbeddingVariableOption()
    if not isinstance(ev_option, EmbeddingVariableOption):
        raise TypeError(f"EmbeddingVariable '{name}': `ev_option` must be an "
                        "EmbeddingVariableOption, got "
                        f"{type(ev_option).__name__}.")
    other = ev_option.init_option.initializer
    if initializer is not None and other is not None \
            and other is not initializer:
        _logger.warning(
            "EmbeddingVariable '%s': both `initializer` and "
            "`ev_option.init_option.initializer` are set; using the "
            "InitializerOption's (DeepRec's precedence).", name)
    ev_option = _with_steps_to_live(name, ev_option, steps_to_live)
    for argument, value in (("regularizer", regularizer),
                            ("custom_getter", custom_getter),
                            ("constraint", constraint),
                            ("init_data_source", init_data_source)):
        if value is not None:
            raise NotImplementedError(
                f"EmbeddingVariable '{name}': `{argument}` is not supported "
                "by group_embedding; leave it None.")
    del caching_device, validate_shape  # no meaning for one hash table
    ev = EmbeddingVariable(name, embedding_dim, key_dtype, value_dtype,
                           initializer, trainable, ev_option)
    if not tf.executing_eagerly():
        # DeepRec scripts run these to initialise EVs on their own.
        tf.compat.v1.add_to_collection(EV_INIT_VAR_OPS,
                                       ev.default_values.initializer)
        keys = tf.compat.v1.GraphKeys
        for collection in collections or ():
            # Variable collections feed stock initialisers and savers,
            # which would treat the EV as a dense variable.
            if collection not in (keys.GLOBAL_VARIABLES,
                                  keys.TRAINABLE_VARIABLES,
                                  keys.LOCAL_VARIABLES,
                                  keys.MODEL_VARIABLES):
                tf.compat.v1.add_to_collection(collection, ev)
    return [ev] if partitioner is not None else ev


# DeepRec's `tf.GraphKeys` collection names.
EV_INIT_VAR_OPS = "ev_init_var_ops"
EV_INIT_SLOT_OPS = "ev_init_slot_ops"


def _with_steps_to_live(name, ev_option, steps_to_live):
    """`ev_option` with `GlobalStepEvict(steps_to_live)` when given."""
    if steps_to_live is None:
        return ev_option
    evict = GlobalStepEvict(steps_to_live)
    if ev_option.evict_option not in (None, evict):
        raise ValueError(
            f"EmbeddingVariable '{name}': `steps_to_live`={steps_to_live} "
            f"conflicts with ev_option.evict_option="
            f"{ev_option.evict_option!r}; give one of them.")
    return dataclasses.replace(ev_option, evict_option=evict)


_register_saveable_proto_functions()
