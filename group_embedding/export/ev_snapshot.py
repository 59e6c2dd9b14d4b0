"""An EmbeddingVariable's content frozen into stock TF ops, for models that
plain TensorFlow serves (no op or resource of this library).

The storage resource and its ops exist only where this library is
loaded. A snapshot copies what a `training=False` lookup reads:

* the admitted keys, sorted, and their rows: a key is found with
  `tf.searchsorted` (exact on int64, no table to initialise, so the
  arrays can be variables of a SavedModel or constants of a frozen graph);
* for any other key: the filter's `default_value_no_permission` (a row of
  that constant) when the EV has a `CounterFilter` / `CBFFilter`, else row
  `key mod default_value_dim` of the EV's default matrix, as the kernel
  (`ReadKeys`, `DefaultRowOf`) reads it. Keys still under a
  `CounterFilter` are stored but not admitted: they read as unknown.

While `tf.saved_model.save` runs (`model.export`, `tf.saved_model.save`,
`ge.export_saved_model`), `ev_storage.group_gather` reads snapshots taken
at that save instead of the storage (see `frozen_gather`), and the kernel
library reports itself unavailable so that every lookup traces its pure-TF
path. The storage (ops/ev_storage.py) and `EmbeddingVariable`'s SavedModel
hooks import it only then (a user's own `tf.saved_model.save` freezes too);
TF1 graphs get the same snapshots as constants (frozen_graph.py).
"""

import contextlib
import os
import re
import sys
import types
import weakref
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import save_context


def sorted_rows(keys: np.ndarray, values: np.ndarray, admitted: np.ndarray,
                dim: int):
    """The admitted keys sorted, and their rows in that order, each with
    one padding entry at the end: `searchsorted` may point one past the
    last key (or at 0 in an empty table); the padding keeps that index
    valid and `EmbeddingSnapshot.lookup` rejects it. Sorted straight into
    the padded buffers (a 10M-key table is GBs: no further copies)."""
    keys = np.asarray(keys).astype(np.int64, copy=False)
    values = np.asarray(values, np.float32).reshape(-1, dim)
    if not np.all(admitted):
        keys, values = keys[admitted], values[admitted]
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    padded_keys = np.empty(n + 1, np.int64)
    np.take(keys, order, out=padded_keys[:n])
    padded_keys[n] = np.iinfo(np.int64).max
    rows = np.zeros([n + 1, dim], np.float32)
    np.take(values, order, axis=0, out=rows[:n])
    return padded_keys, rows


class EmbeddingSnapshot(tf.Module):
    """A frozen, stock-TF copy of one EV's content.

    Args:
        padded_keys: `[n + 1]` the admitted keys, sorted, then a padding
            entry (from `sorted_rows`).
        rows: `[n + 1, D]` their rows, then a padding row.
        default_values: `[default_value_dim, D]` the EV's default matrix.
        filtered: whether the EV has an admission filter (unknown keys
            then read `no_permission`).
        no_permission: the filter's value for keys not admitted.
        as_variables: hold the arrays in non-trainable `tf.Variable`s
            (a TF2 SavedModel stores them in its variables, outside the
            2 GB graph); False: constants of the current graph.
        name: module name.
    """

    def __init__(self, padded_keys: np.ndarray, rows: np.ndarray,
                 default_values: np.ndarray, filtered: bool,
                 no_permission: float, as_variables: bool = True,
                 name: str = "ev_snapshot"):
        super().__init__(name=name)
        dim = int(default_values.shape[1])
        self.num_keys = len(padded_keys) - 1
        if filtered:
            defaults = np.full([1, dim], no_permission, np.float32)
        else:
            defaults = np.asarray(default_values, np.float32)
        self.filtered = bool(filtered)
        make = _variable if as_variables else tf.constant
        with tf.init_scope() if as_variables else contextlib.nullcontext():
            self.sorted_keys = make(padded_keys, name="sorted_keys")
            self.rows = make(rows, name="rows")
            self.defaults = make(defaults, name="defaults")

    def lookup(self, keys: tf.Tensor) -> tf.Tensor:
        """`[n, D]` rows for keys `[n]`, as a `training=False` lookup of
        the EV reads them."""
        keys = tf.cast(keys, tf.int64)
        index = tf.searchsorted(self.sorted_keys, keys, out_type=tf.int64)
        found = tf.logical_and(
            tf.equal(tf.gather(self.sorted_keys, index), keys),
            index < self.num_keys)
        rows = tf.gather(self.rows, index)
        if self.filtered:
            default = tf.broadcast_to(self.defaults, tf.shape(rows))
        else:
            size = tf.shape(self.defaults, out_type=tf.int64)[0]
            default = tf.gather(self.defaults, tf.math.floormod(keys, size))
        return tf.where(found[:, None], rows, default)


def _direct_creator(next_creator, **kwargs):
    # Snapshots are taken while a save traces a function that already ran
    # once; tf.function refuses variables created on such a call, although
    # these belong to the snapshot, not to the function (nothing re-creates
    # them on a later call). Create them past its creator.
    del next_creator
    return resource_variable_ops.default_variable_creator_v2(None, **kwargs)


def _variable(value, name):
    with tf.variable_creator_scope(_direct_creator):
        return tf.Variable(value, trainable=False, name=name)


def filter_settings(ev):
    """(filtered, CBF, no-permission value) of an EV's options."""
    option = ev.ev_option
    filt = option.filter_option
    filter_freq = filt.filter_freq if filt is not None else 0
    is_cbf = type(filt).__name__ == "CBFFilter"
    return (filter_freq > 0, is_cbf,
            float(option.init_option.default_value_no_permission))


def _admitted(ev, freqs: np.ndarray) -> np.ndarray:
    """Which stored keys read their rows: under a `CBFFilter` all (a key
    is stored only once admitted), under a `CounterFilter` those counted
    at least `filter_freq` times."""
    filtered, is_cbf, _ = filter_settings(ev)
    if is_cbf or not filtered:
        return np.ones(len(freqs), bool)
    return np.asarray(freqs) >= ev.ev_option.filter_option.filter_freq


def _snapshot(ev, padded_keys, rows, default_values, as_variables):
    filtered, _, no_permission = filter_settings(ev)
    return EmbeddingSnapshot(
        padded_keys, rows, np.asarray(default_values), filtered,
        no_permission, as_variables=as_variables,
        name=re.sub(r"\W", "_", ev.name) + "_snapshot")


def from_arrays(ev, keys, values, freqs, default_values,
                as_variables=True) -> EmbeddingSnapshot:
    """A snapshot of `ev` from its exported arrays (`ev.export()`,
    numpy)."""
    padded_keys, rows = sorted_rows(keys, values, _admitted(ev, freqs),
                                    ev.embedding_dim)
    return _snapshot(ev, padded_keys, rows, default_values, as_variables)


def take(ev) -> EmbeddingSnapshot:
    """A snapshot of `ev`'s current content, read eagerly."""
    with tf.init_scope():
        keys, values, _, freqs = ev.export()
        padded_keys, rows = sorted_rows(
            keys.numpy(), values.numpy(), _admitted(ev, freqs.numpy()),
            ev.embedding_dim)
        # The export is dropped before the variables copy the sorted rows.
        del keys, values, freqs
        return _snapshot(ev, padded_keys, rows, ev.default_values.numpy(),
                         as_variables=True)


# EV -> (the SaveOptions of the save it was taken for, snapshot). A save
# takes each EV's snapshot once (its traces and its object graph share
# it); the next save takes a new one.
_taken: "weakref.WeakKeyDictionary[Any, Any]" = (
    weakref.WeakKeyDictionary())


def freezing() -> bool:
    """Whether EV reads are being traced for a SavedModel."""
    return save_context.in_save_context()


def writing_saved_model() -> bool:
    """Whether `tf.saved_model.save` is running: tracing (its save
    context) or writing the SavedModel's checkpoint (after that context
    closed; the writer's frame is then on the stack)."""
    if freezing():
        return True
    frame: Optional[types.FrameType] = sys._getframe(1)  # noqa: SLF001
    while frame is not None:
        code = frame.f_code
        if code.co_name == "save_and_return_nodes" and \
                code.co_filename.endswith(_SAVE_MODULE):
            return True
        frame = frame.f_back
    return False


_SAVE_MODULE = os.path.join("saved_model", "save.py")


def snapshot_for_save(ev) -> EmbeddingSnapshot:
    """The snapshot of `ev` for the SavedModel being written (taken at
    the first call of the save).

    Raises:
        RuntimeError: called outside `tf.saved_model.save`.
    """
    if not freezing():
        raise RuntimeError("EV snapshots for a SavedModel are taken only "
                           "while tf.saved_model.save runs.")
    options = save_context.get_save_options()
    entry = _taken.get(ev)
    if entry is None or entry[0] is not options:
        entry = (options, take(ev))
        _taken[ev] = entry
    return entry[1]


def release(evs=None):
    """Drops the snapshots kept after saves (of `evs`, default all)."""
    for ev in list(_taken.keys()) if evs is None else evs:
        _taken.pop(ev, None)


def frozen_gather(variables: Sequence, keys: List[tf.Tensor]) -> tf.Tensor:
    """`ev_storage.group_gather` while freezing: the rows of each EV's
    snapshot, concatenated (what a `training=False` gather reads)."""
    parts = [snapshot_for_save(v).lookup(k)
             for v, k in zip(variables, keys)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, 0)
