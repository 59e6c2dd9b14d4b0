"""Python wrappers of the EmbeddingVariable storage ops
(`ops/kernels/embedding_variable_ops.cc`).

The storage is one C++ resource per variable holding keys, values,
frequencies, versions and optimizer slots. Unlike the fused lookup, it has
no pure-TF fallback (stock TF has no growable keyed table that can also
hold optimizer slots), so it needs the C++ kernels whatever
`GROUP_EMBEDDING_KERNELS` says.

Gradient of `GroupEmbeddingEVGather`: per variable, `tf.IndexedSlices(values=row
gradients, indices=keys)` with `dense_shape=None`: keys are arbitrary
int64 values, not row numbers, so there is no dense shape to give;
densifying such a gradient raises instead of allocating 2**63 rows.
"""

from typing import List
from typing import Sequence

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.saved_model import save_context

from group_embedding.ops import kernel_library
from group_embedding.ops import op_names


def library():
    """Returns the loaded kernel module (built on first use).

    Raises:
        RuntimeError: if the kernels cannot be built or loaded.
    """
    module = kernel_library.library()
    if module is None:
        raise RuntimeError(
            "EmbeddingVariable needs the group-embedding C++ kernels, which "
            "could not be built or loaded: "
            f"{kernel_library.unavailable_reason()}. Run `python -m "
            "group_embedding.ops.kernel_library -v` to see the build.")
    return module


def create_handle(variable_name: str, shared_name: str, embedding_dim: int,
                  filter_freq: int, no_permission: float, steps_to_live: int,
                  l2_weight_threshold: float, cbf_counters: int = 0,
                  cbf_hashes: int = 0, cbf_counter_bytes: int = 8,
                  max_rows: int = 0, storage_path: str = "",
                  dram_bytes: int = 0, cache_lru: bool = False) -> tf.Tensor:
    """Creates (or finds) the storage resource and returns its handle.

    `cbf_*` size a CBFFilter's counting Bloom filter (0 counters: none);
    `max_rows` > 0 lowers the row limit (2**32 - 2), for tests only.
    A non-empty `storage_path` (an existing folder) adds the disk tier of
    StorageType.DRAM_SSDHASH (`dram_bytes` > 0) or SSDHASH (0), spilling
    by LRU if `cache_lru` else LFU.
    """
    return library().group_embedding_ev_handle(
        shared_name=shared_name, variable_name=variable_name,
        embedding_dim=embedding_dim, filter_freq=filter_freq,
        default_value_no_permission=no_permission,
        steps_to_live=steps_to_live,
        l2_weight_threshold=l2_weight_threshold, cbf_counters=cbf_counters,
        cbf_hashes=cbf_hashes, cbf_counter_bytes=cbf_counter_bytes,
        max_rows=max_rows, storage_path=storage_path,
        dram_bytes=dram_bytes, cache_lru=cache_lru)


def group_gather(variables: Sequence, keys: List[tf.Tensor],
                 training) -> tf.Tensor:
    """Rows of several same-dim EVs for their keys, concatenated.

    Args:
        variables: K `EmbeddingVariable`s of one embedding dim D.
        keys: K int64 key vectors `[n_i]`.
        training: Python or tensor bool; True inserts new keys and counts
            frequencies, False only reads (unknown keys read defaults).

    Returns:
        float32 `[sum n_i, D]`.
    """
    if save_context.in_save_context():
        # A SavedModel is being written: read the EVs' frozen snapshots
        # (stock ops; see group_embedding/export/ev_snapshot.py).
        from group_embedding.export import ev_snapshot
        return ev_snapshot.frozen_gather(variables, keys)
    for v in variables:
        # Lets the tapes (and the function being traced, for later calls
        # under a tape) see the storage handle as a watched source.
        resource_variable_ops.variable_accessed(v)
    return library().group_embedding_ev_gather(
        handles=[v.handle for v in variables],
        keys=[tf.cast(k, tf.int64) for k in keys],
        default_values=[v.default_values for v in variables],
        training=tf.convert_to_tensor(training, tf.bool),
        embedding_dim=int(variables[0].embedding_dim))


@op_names.register_gradient("GroupEmbeddingEVGather")
def _group_gather_grad(op, grad):
    # A consumer that gathers from the rows sends IndexedSlices; the
    # per-EV slices below need dense row gradients.
    grad = tf.convert_to_tensor(grad)
    k = op.get_attr("num_tables")
    keys = op.inputs[k:2 * k]
    if k == 1:
        parts = [grad]
    else:
        parts = tf.split(grad, tf.stack([tf.size(x) for x in keys]), num=k)
    slices = [tf.IndexedSlices(p, key) for p, key in zip(parts, keys)]
    return slices + [None] * (2 * k) + [None]


def ensure_slot(handle, slot_name: str, initial_value: float):
    """Creates slot `slot_name` (existing keys set to its initial value)."""
    return library().group_embedding_ev_ensure_slot(handle, slot_name=slot_name,
                                                    initial_value=float(initial_value))


def size(handle):
    """Returns (number of live keys, bytes held), int64 scalars."""
    return library().group_embedding_ev_size(handle)


def tier_stats(handle) -> tf.Tensor:
    """int64 `[8]`: keys in DRAM, keys on disk, promotions (disk -> DRAM,
    the DRAM tier's misses), spills (DRAM -> disk), bytes of the disk
    tier's in-memory index, nanoseconds spent promoting, nanoseconds spent
    spilling (compactions included), compactions (StorageType.DRAM_SSDHASH
    / SSDHASH)."""
    return library().group_embedding_ev_tier_stats(handle)


def export(handle, embedding_dim: int):
    """Consistent snapshot: (keys, values, freqs, versions, slot_names,
    slot_inits, slots [n, S * D], step)."""
    return library().group_embedding_ev_export(
        handle, embedding_dim=embedding_dim)


def export_changes(handle, embedding_dim: int, since):
    """Incremental-checkpoint snapshot, under one lock: every live key
    (`since` == 0) or the keys written (inserted, counted, stamped,
    updated, imported) since the confirmed save `since`, laid out as
    `export`, plus the keys evicted since, and this export's number.

    Returns:
        (keys, values, freqs, versions, slot_names, slot_inits, slots,
        step, removed, covered); pass `covered` to `confirm_save` once
        the files are durable.

    Raises:
        FailedPreconditionError: `since` is not the base `delta_base`
            names (a restore, a new slot, an untracked eviction or
            another confirmed save came since); export with `since` = 0.
    """
    return library().group_embedding_ev_export_changes(
        handle, tf.cast(since, tf.int64), embedding_dim=embedding_dim)


def confirm_save(handle, covered):
    """Export `covered` is durable: the next delta extends it."""
    return library().group_embedding_ev_confirm_save(
        handle, tf.cast(covered, tf.int64))


def delta_base(handle, restored: bool = False, restored_slot_names=()):
    """The `since` the next delta may use (0: none, save in full). With
    `restored` (right after a restore of a checkpoint with slots
    `restored_slot_names`), the content becomes that base, unless the
    variable's slots are others (it kept some the checkpoint lacks)."""
    return library().group_embedding_ev_delta_base(
        handle, restored=restored,
        restored_slot_names=[_text(n) for n in restored_slot_names])


def _text(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def import_(handle, keys, values, freqs, versions, slot_names, slot_inits,
            slots, step):
    """Replaces the whole content with an `export` snapshot.

    Frequencies and versions are 64-bit in storage; 32-bit arrays (older
    snapshots, numpy uint32) are widened, never wrapped.
    """
    return library().group_embedding_ev_import(
        handle, keys, values, tf.cast(freqs, tf.int64),
        tf.cast(versions, tf.int64), slot_names, slot_inits, slots,
        tf.cast(step, tf.int64))


def evict(handle):
    """Runs the variable's eviction policy; returns the number removed."""
    return library().group_embedding_ev_evict(handle)


def _args(keys, grad, step):
    return (tf.cast(keys, tf.int64), tf.cast(grad, tf.float32),
            tf.cast(step, tf.int64))


def apply_sgd(handle, keys, grad, step, lr):
    """`var -= lr * g` on the admitted keys (duplicates summed)."""
    return library().group_embedding_ev_apply_sgd(
        handle, *_args(keys, grad, step), tf.cast(lr, tf.float32))


def apply_adagrad(handle, keys, grad, step, lr, epsilon, slot_name):
    """`accum += g^2; var -= lr * g / (sqrt(accum) + epsilon)`."""
    return library().group_embedding_ev_apply_adagrad(
        handle, *_args(keys, grad, step), tf.cast(lr, tf.float32),
        tf.cast(epsilon, tf.float32), slot_name=slot_name)


def apply_adagrad_decay(handle, keys, grad, step, lr, decay_rate, floor,
                        period, slot_names):
    """DeepRec's AdagradDecay on the touched keys (see the kernel)."""
    return library().group_embedding_ev_apply_adagrad_decay(
        handle, *_args(keys, grad, step), tf.cast(lr, tf.float32),
        tf.cast(decay_rate, tf.float32), tf.cast(floor, tf.float32),
        tf.cast(period, tf.int64), slot_names=slot_names)


def apply_adam(handle, keys, grad, step, alpha, beta1, beta2, epsilon,
               slot_names):
    """Lazy Adam: only the touched keys' m, v and values change."""
    return library().group_embedding_ev_apply_adam(
        handle, *_args(keys, grad, step), tf.cast(alpha, tf.float32),
        tf.cast(beta1, tf.float32), tf.cast(beta2, tf.float32),
        tf.cast(epsilon, tf.float32), slot_names=slot_names)


def apply_ftrl(handle, keys, grad, step, lr, l1, l2, l2_shrinkage,
               lr_power, slot_names):
    """TF's FTRL-proximal (ApplyFtrlV2) on the touched keys."""
    return library().group_embedding_ev_apply_ftrl(
        handle, *_args(keys, grad, step), tf.cast(lr, tf.float32),
        tf.cast(l1, tf.float32), tf.cast(l2, tf.float32),
        tf.cast(l2_shrinkage, tf.float32), tf.cast(lr_power, tf.float32),
        slot_names=slot_names)
