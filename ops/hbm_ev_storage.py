"""Python wrappers of the HBM EmbeddingVariable ops
(`ops/cuda/tf_ev_table_kernels.cc`): `StorageType.HBM` and `HBM_DRAM`
(the same table with `host_tier`: the keys it gives up live in host
memory, `ops/cuda/ev_host_tier.h`, and every op below sees both tiers).

An HBM EV's table is the CUDA core's EV table (`ops/cuda/ev_table.h`) in
GPU memory, owned by a TF resource of the GPU op library. `HbmStorage`
is what such an EV holds instead of the `ev_storage` module: the same
calls (`ensure_slot`, `size`, `export`, `import_`, `apply_*`) with the
same arguments and results, so the EV, its checkpoints and the
optimizers treat both alike; `pooled_lookup` is the group's fused
find-or-insert + pooling (`lookup_plan`'s HBM EV backend), and
`sequence_lookup` places the same op's rows in TF.

Fused backward-apply: the lookup's gradient function gives each EV
IndexedSlices (one row per occurrence) and remembers, for those values,
the feature's ids and its pooled output's gradient
(`backward_apply.remember_hbm_forward`). When an optimizer applies
exactly those slices, the update op takes the feature's ids and pooled
gradient instead, and the core computes, sums and applies each key's
gradient in one pass: in a traced step the per-occurrence rows are then
never computed (their ops have no consumer). `ge.optimizers` and
`ge.train` SGD, Adagrad, Adam and FTRL update every EV of one lookup in
ONE op (`apply_group`, from `backward_apply.fuse_ev`) that never waits
for the stream; the other optimizers update each EV alone (`apply_*`).
Slices changed on the way (scaled, clipped, summed over two lookups)
take the per-key update.

Eviction policies (`evict`) run the adaptor's evict op with the CPU
EV's rules; incremental checkpoints (`export_changes`, `confirm_save`,
`delta_base`) compare exports with the last confirmed save's content
(`hbm_ev_deltas`).

Where TF sees no GPU, the op library is the adaptor built against the
core's host stand-in (tests, `GROUP_EMBEDDING_HBM_ON_HOST=1`), whose
kernels run on the CPU: same ops, same results.
"""

from typing import Any
from typing import Dict
from typing import List
from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from group_embedding.ops import backward_apply
from group_embedding.ops import hbm_ev_deltas
from group_embedding.ops import lookup_tf
from group_embedding.ops import op_names
from group_embedding.ops.ragged_ids import FeatureIds

BUCKET = 128
# Bytes of a key besides its floats: key, digest, freq and version.
KEY_BYTES = 8 + 1 + 16
# Optimizer slots a table's budget makes room for (Adam, FTRL: two).
BUDGET_SLOTS = 2
LOOKUP_OP = "GroupEmbeddingHbmEVLookup"
def num_buckets(hbm_bytes: int, embedding_dim: int) -> int:
    """Buckets of 128 keys (a power of two, at least one) that fit
    `hbm_bytes` with each key's row and two optimizer slots."""
    per_key = KEY_BYTES + 4 * embedding_dim * (1 + BUDGET_SLOTS)
    buckets = max(1, hbm_bytes // (per_key * BUCKET))
    return 1 << (int(buckets).bit_length() - 1)


class HbmStorage:
    """The storage calls of one HBM EV, on the op module that serves it.

    Args:
        module: the loaded op library with the HBM EV ops.
        name: the EV's name (for errors).
        embedding_dim: D.
        buckets: the table's buckets (`num_buckets`); capacity is
            `buckets * 128` keys.
        steps_to_live: GlobalStepEvict's, 0: none.
        l2_threshold: L2WeightEvict's, negative: none.
        host_tier: StorageType.HBM_DRAM: the keys the full table gives up
            go to host memory with their state (and come back when an op
            reads or updates them) instead of being dropped.
    """

    def __init__(self, module: Any, name: str, embedding_dim: int,
                 buckets: int, steps_to_live: int = 0,
                 l2_threshold: float = -1.0, host_tier: bool = False):
        self.module = module
        self.name = name
        self.embedding_dim = embedding_dim
        self.capacity = buckets * BUCKET
        self.buckets = buckets
        self.steps_to_live = steps_to_live
        self.l2_threshold = l2_threshold
        self.host_tier = host_tier
        self.deltas = hbm_ev_deltas.DeltaTracker(name)

    # The CounterFilter's threshold (0: none), set by create_handle.
    filter_freq = 0

    def create_handle(self, shared_name: str, filter_freq: int,
                      no_permission: float, lfu: bool) -> tf.Tensor:
        """Creates (or finds) the table's resource; its handle."""
        self.filter_freq = filter_freq
        return self.module.group_embedding_hbm_ev_handle(
            shared_name=shared_name, variable_name=self.name,
            embedding_dim=self.embedding_dim, num_buckets=self.buckets,
            filter_freq=filter_freq,
            default_value_no_permission=no_permission, lfu=lfu,
            host_tier=self.host_tier)

    def ensure_slot(self, handle, slot_name: str, initial_value: float):
        """Creates slot `slot_name` (every key's entry `initial_value`)."""
        plane = tf.fill([self.capacity, self.embedding_dim],
                        tf.constant(initial_value, tf.float32))
        return self.module.group_embedding_hbm_ev_ensure_slot(
            handle, plane, slot_name=slot_name)

    def size(self, handle):
        """(number of stored keys, bytes the table holds), int64."""
        slots = BUDGET_SLOTS  # the budget's, not the current count
        held = self.capacity * (KEY_BYTES + 4 * self.embedding_dim
                                * (1 + slots))
        return (self.module.group_embedding_hbm_ev_size(handle),
                tf.constant(held, tf.int64))

    def tier_sizes(self, handle):
        """int64 [2]: keys in the GPU table, keys in host memory (HBM_DRAM's
        host tier; 0 for HBM)."""
        return self.module.group_embedding_hbm_ev_tier_sizes(handle)

    def export(self, handle, embedding_dim: int):
        """The CPU EV's snapshot (`ev_storage.export`): keys, values,
        freqs, versions, slot_names, slot_inits, slots [n, S * D], step."""
        (keys, values, freqs, versions, names, inits, slots,
         step) = self.module.group_embedding_hbm_ev_export(handle)
        n = tf.shape(keys)[0]
        flat = tf.reshape(tf.transpose(slots, [1, 0, 2]),
                          [n, tf.size(names) * embedding_dim])
        return keys, values, freqs, versions, names, inits, flat, step

    def _numpy_export(self, handle, embedding_dim: int):
        return [np.asarray(x) for x in self.export(handle, embedding_dim)]

    def export_changes(self, handle, embedding_dim: int, since):
        """Incremental-checkpoint snapshot (eager), the CPU EV's
        `ev_storage.export_changes` result: every key (`since` == 0) or
        the keys changed since the confirmed save `since`, the keys
        removed since and this export's number (`hbm_ev_deltas`)."""
        self._take_evicted(handle)
        return self.deltas.changes(self._numpy_export(handle, embedding_dim),
                                   int(since))

    def _take_evicted(self, handle) -> None:
        keys, lost = self.module.group_embedding_hbm_ev_take_evicted(handle)
        self.deltas.record_evicted(np.asarray(keys), bool(lost))

    def confirm_save(self, handle, covered):
        """Export `covered` is durable: the next delta extends it."""
        del handle
        self.deltas.confirm(int(covered))

    def delta_base(self, handle, restored: bool = False,
                   restored_slot_names=()):
        """The `since` the next delta may use (0: none, save in full).
        With `restored` (right after a restore of a checkpoint with slots
        `restored_slot_names`), the content becomes that base, unless the
        table's slots are others (it kept some the checkpoint lacks)."""
        self._take_evicted(handle)
        if restored:
            return self.deltas.restored(
                self._numpy_export(handle, self.embedding_dim),
                restored_slot_names)
        names, _ = self.module.group_embedding_hbm_ev_slot_names(handle)
        return self.deltas.delta_base(np.asarray(names))

    def import_(self, handle, keys, values, freqs, versions, slot_names,
                slot_inits, slots, step):
        """Replaces the whole content with a snapshot in the CPU EV's
        layout (`ev_storage.import_`). As the CPU EV's import, slots the
        table has and the snapshot lacks (an optimizer built after that
        save) stay, every key's entry their initial value, before the
        snapshot's others; a slot of both takes the snapshot's initial
        value."""
        d = self.embedding_dim
        keys = tf.reshape(tf.cast(keys, tf.int64), [-1])
        n = tf.size(keys)
        by_slot = tf.transpose(
            tf.reshape(tf.cast(slots, tf.float32),
                       tf.stack([n, tf.size(slot_names), d])), [1, 0, 2])
        slot_names, inits, by_slot = self._with_kept_slots(
            handle, slot_names, tf.cast(slot_inits, tf.float32), by_slot)
        planes = tf.broadcast_to(tf.reshape(inits, [-1, 1, 1]),
                                 tf.stack([tf.size(slot_names),
                                           self.capacity, d]))
        return self.module.group_embedding_hbm_ev_import(
            handle, keys, tf.reshape(tf.cast(values, tf.float32),
                                     tf.stack([n, d])),
            tf.cast(freqs, tf.int64),
            # Steps are >= 0 in storage, as the CPU EV's import clamps
            # them (Deepray's FTRL stamps -1).
            tf.maximum(tf.cast(versions, tf.int64), 0),
            slot_names, inits, planes, by_slot,
            tf.maximum(tf.cast(step, tf.int64), 0))

    def _with_kept_slots(self, handle, names, inits, by_slot):
        """The table's slots in their order, then the snapshot's others:
        their names, initial values and entries [S, n, D] of the
        snapshot's keys (the snapshot's, else the initial value)."""
        have, have_inits = self.module.group_embedding_hbm_ev_slot_names(
            handle)
        # Known ranks for the masks (a Saver's restored tensors have none).
        names, inits = tf.reshape(names, [-1]), tf.reshape(inits, [-1])
        same = tf.equal(have[:, None], names[None, :])  # [table, snapshot]
        count = tf.size(names)
        columns = tf.range(count)
        # Each slot's column of the snapshot (names are distinct), or
        # `count` (a padding column): the table's alone. No argmax: the
        # snapshot may have no slots.
        src = tf.concat([
            tf.where(tf.reduce_any(same, 1),
                     tf.reduce_sum(tf.cast(same, tf.int32)
                                   * columns[None, :], 1), count),
            tf.boolean_mask(columns,
                            tf.logical_not(tf.reduce_any(same, 0)))], 0)
        from_snapshot = src < count
        kept = tf.size(have)
        new_names = tf.concat([have, tf.gather(names, src[kept:])], 0)
        new_inits = tf.where(
            from_snapshot, tf.gather(tf.concat([inits, [0.0]], 0), src),
            tf.concat([have_inits, tf.zeros(tf.shape(src[kept:]))], 0))
        shape = tf.shape(by_slot)
        padded = tf.concat([by_slot, tf.zeros(tf.concat([[1], shape[1:]],
                                                         0))], 0)
        new_slots = tf.where(tf.reshape(from_snapshot, [-1, 1, 1]),
                             tf.gather(padded, src),
                             tf.reshape(new_inits, [-1, 1, 1]))
        return new_names, new_inits, new_slots

    def evict(self, handle):
        """Runs the eviction policy (the CPU EV's rules, against the last
        step an update applied); returns the number of keys removed."""
        return self.module.group_embedding_hbm_ev_evict(
            handle, steps_to_live=self.steps_to_live,
            l2_threshold=self.l2_threshold)

    # -- optimizer updates (`ev_storage.apply_*`) --------------------------
    def takes_forward(self, forward) -> bool:
        """Whether the fused backward-apply of `forward` (a lookup's keys
        and pooled gradient) gives this table the lookup's gradient. Not
        under `max_norm` with a filter: the fused update clips at each
        key's stored row, but a key admitted by the lookup itself read
        `no_permission` there (its gradient is then the upstream's, as
        the per-key update applies it)."""
        return forward.max_norm < 0 or self.filter_freq == 0

    def _apply(self, handle, keys, grad, step, optimizer, slot_names,
               **hyperparameters):
        forward = backward_apply.hbm_forward_of(keys, grad)
        values = backward_apply.hyper(**hyperparameters)
        if forward is not None and self.takes_forward(forward):
            # The fused backward-apply of the lookup's feature.
            return self._update([handle], [forward], step, optimizer,
                                slot_names, values)
        keys = tf.reshape(tf.cast(keys, tf.int64), [-1])
        per_key = backward_apply.HbmForward(
            lookup=None, values=None, keys=keys,
            row_splits=tf.range(tf.size(keys, out_type=tf.int64) + 1),
            weights=tf.zeros([0], tf.float32), grads=tf.cast(grad, tf.float32),
            combiner="sum", max_norm=-1.0)
        return self._update([handle], [per_key], step, optimizer, slot_names,
                            values, keys_checked=False)

    def _update(self, handles, forwards, step, optimizer, slot_names,
                hyper_values, keys_checked=True):
        """One `GroupEmbeddingHbmEVApply` of the EVs `handles` (distinct,
        of one dim), EV t's gradient given by `forwards[t]`
        (`backward_apply.HbmForward`: a lookup feature's keys and pooled
        gradient, or keys with one gradient row each). `keys_checked`:
        the keys are a forward lookup's, which refused bad keys, so the
        op need not read its counters back (no wait for the stream)."""
        max_norms = {f.max_norm for f in forwards}
        if len(max_norms) != 1:
            raise ValueError(f"{self.name}: one update takes one max_norm, "
                             f"got {sorted(max_norms)}.")
        return self.module.group_embedding_hbm_ev_apply(
            handles=list(handles), keys=[f.keys for f in forwards],
            row_splits=[f.row_splits for f in forwards],
            weights=[f.weights for f in forwards],
            grads=[f.grads for f in forwards],
            global_step=tf.cast(step, tf.int64), hyper=hyper_values,
            combiners=[f.combiner for f in forwards],
            max_norm=max_norms.pop(), optimizer=optimizer,
            slot_names=list(slot_names), keys_checked=keys_checked)

    def apply_group(self, handles, forwards, rule):
        """The fused backward-apply of several EVs of one lookup in one op
        (`backward_apply.fuse_ev`).

        Args:
            handles: the EVs' handles (distinct EVs of this one's dim).
            forwards: each EV's `backward_apply.HbmForward`.
            rule: the optimizer's `backward_apply.Rule` (`optimizer`,
                `hyper`, `ev_slots`, `step`).
        Returns the op.
        """
        return self._update(handles, forwards, rule.step, rule.optimizer,
                            rule.ev_slots, rule.hyper)

    def apply_sgd(self, handle, keys, grad, step, lr):
        """`var -= lr * g` on the admitted keys (duplicates summed)."""
        return self._apply(handle, keys, grad, step, "sgd", [], lr=lr)

    def apply_adagrad(self, handle, keys, grad, step, lr, epsilon,
                      slot_name):
        """`accum += g^2; var -= lr * g / sqrt(accum + epsilon)`."""
        return self._apply(handle, keys, grad, step, "adagrad", [slot_name],
                           lr=lr, epsilon=epsilon)

    def apply_adam(self, handle, keys, grad, step, alpha, beta1, beta2,
                   epsilon, slot_names):
        """Lazy Adam, `alpha` bias-corrected by the caller."""
        return self._apply(handle, keys, grad, step, "adam", slot_names,
                           lr=alpha, beta_1=beta1, beta_2=beta2,
                           epsilon=epsilon)

    def apply_ftrl(self, handle, keys, grad, step, lr, l1, l2, l2_shrinkage,
                   lr_power, slot_names):
        """TF's FTRL-proximal (ApplyFtrlV2) on the touched keys."""
        return self._apply(handle, keys, grad, step, "ftrl", slot_names,
                           lr=lr, l1=l1, l2=l2, l2_shrinkage=l2_shrinkage,
                           lr_power=lr_power)

    def apply_adagrad_decay(self, handle, keys, grad, step, lr, decay_rate,
                            floor, period, slot_names):
        """DeepRec's AdagradDecay (`ev_storage.apply_adagrad_decay`): a
        key whose decay power (element 0 of slot 2) is behind `period`
        first decays, `accum = max(accum * decay_rate, floor)`, power + 1;
        then `accum += g^2; var -= lr * g / sqrt(accum)`. The core takes
        the period as a float, exact up to 2^24 periods as the power."""
        return self._apply(handle, keys, grad, step, "adagrad_decay",
                           slot_names, lr=lr, beta_1=decay_rate,
                           beta_2=floor, l1=tf.cast(period, tf.float32))


def pooled_lookup(module: Any, variables: Sequence[Any],
                  feats: Sequence[FeatureIds], combiners: Sequence[str],
                  max_norm: Any, training: Any) -> List[tf.Tensor]:
    """`GroupEmbeddingHbmEVLookup`: the group's find-or-insert and its
    pooled `[B_i, D]` outputs (weights, every combiner, `max_norm`) in one
    op. The gradient is each EV's IndexedSlices keyed by key, one row per
    occurrence (the updates sum duplicates), as the TF path of a DRAM EV
    computes it from the rows read."""
    return list(_lookup(module, variables, feats, combiners, max_norm,
                        training, pool=True)[0])


def sequence_lookup(module: Any, variables: Sequence[Any],
                    feats: Sequence[FeatureIds], max_norm: Any,
                    training: Any) -> List[tf.Tensor]:
    """`[B_i, T_i, D]` lookups of the group: the rows the lookup op reads
    (one find-or-insert for the group, `[sum nnz, D]`), clipped to
    `max_norm` and placed at their slots with their weights in TF, as a
    DRAM EV's TF path places them (`lookup_tf.sequence_rows`). Their
    gradient reaches each EV as IndexedSlices keyed by key, a key a row,
    which the fused update applies as given (`fuse_ev`)."""
    rows = _lookup(module, variables, feats, ["sum"] * len(feats), None,
                   training, pool=False)[1]
    if max_norm is not None:
        rows = lookup_tf.clip_rows(rows, max_norm)
    return lookup_tf.sequence_rows(rows, feats)


def gather(module: Any, variables: Sequence[Any],
           keys: Sequence[tf.Tensor], training: Any) -> tf.Tensor:
    """Rows `[sum n_i, D]` of K same-dim HBM EVs for their int64 key
    vectors `keys` (one row per key, in order): the group's one
    find-or-insert (each occurrence counted when `training`), unpooled,
    as `sequence_lookup` reads them. The owners of collective mode look
    their received keys up with it. The gradient reaches each EV as
    IndexedSlices keyed by key, a key a row."""
    feats = [FeatureIds(values=k, row_splits=tf.range(
        tf.size(k, out_type=tf.int64) + 1), weights=None, positions=None,
        max_len=None, name=f"table {t}") for t, k in enumerate(keys)]
    return _lookup(module, variables, feats, ["sum"] * len(feats), None,
                   training, pool=False)[1]


def _lookup(module, variables, feats, combiners, max_norm, training, pool):
    """The lookup op's outputs: (pooled per feature, rows `[sum nnz, D]`);
    `pool` False: only the rows (the pooled outputs are empty)."""
    for v in variables:
        resource_variable_ops.variable_accessed(v)
    empty = tf.zeros([0], tf.float32)
    sizes = [tf.size(f.values, out_type=tf.int64) for f in feats]
    positions = tf.range(tf.reduce_max(tf.stack(sizes)))
    return module.group_embedding_hbm_ev_lookup(
        handles=[v.handle for v in variables],
        keys=[tf.cast(f.values, tf.int64) for f in feats],
        row_splits=[f.row_splits for f in feats],
        weights=[empty if f.weights is None else f.weights for f in feats],
        default_values=[v.default_values for v in variables],
        positions=positions,
        training=tf.convert_to_tensor(training, tf.bool),
        combiners=list(combiners),
        embedding_dim=int(variables[0].embedding_dim),
        max_norm=-1.0 if max_norm is None else float(max_norm), pool=pool)


@op_names.register_gradient(LOOKUP_OP)
def _lookup_grad(op, *grads):
    k = op.get_attr("num_tables")
    keys = op.inputs[k:2 * k]
    splits = op.inputs[2 * k:3 * k]
    weights = op.inputs[3 * k:4 * k]
    rows = op.outputs[k]
    max_norm = op.get_attr("max_norm")
    if not op.get_attr("pool"):
        # A sequence lookup: the gradient of the rows it placed, per key.
        rows_grad = (tf.zeros_like(rows) if grads[k] is None
                     else tf.convert_to_tensor(grads[k]))
        parts = tf.split(rows_grad, tf.stack([tf.size(x) for x in keys]),
                         num=k)
        slices, tables = _slices_by_table(op, k, parts, keys)
        for ts, values, ids in tables:
            # Applied as given (a key a row), keys checked by this op.
            backward_apply.remember_hbm_forward(backward_apply.HbmForward(
                op, values, ids,
                tf.range(tf.size(ids, out_type=tf.int64) + 1),
                tf.zeros([0], tf.float32), values, "sum", -1.0))
        return slices + [None] * (4 * k) + [None, None]
    combiners = [c.decode() if isinstance(c, bytes) else c
                 for c in op.get_attr("combiners")]
    feats = []
    for t in range(k):
        n = tf.size(keys[t])
        # Absent weights are ones: the same scales for every combiner.
        w = tf.cond(tf.equal(tf.size(weights[t]), 0),
                    lambda n=n: tf.ones([n], tf.float32),
                    lambda t=t: weights[t])
        feats.append(FeatureIds(values=keys[t], row_splits=splits[t],
                                weights=w, positions=None, max_len=None,
                                name=f"table {t}"))
    with tf.GradientTape() as tape:
        tape.watch(rows)
        read = rows if max_norm < 0 else lookup_tf.clip_rows(rows, max_norm)
        pooled = lookup_tf.pool_rows(read, feats, combiners)
    upstream = [tf.zeros_like(p) if g is None else g
                for p, g in zip(pooled, grads[:k])]
    row_grads = tape.gradient(pooled, rows, output_gradients=upstream)
    parts = tf.split(row_grads, tf.stack([tf.size(x) for x in keys]), num=k)
    slices, tables = _slices_by_table(op, k, parts, keys)
    for ts, values, ids in tables:
        if len({combiners[t] for t in ts}) > 1:
            continue  # one update needs one combiner: this EV's is per key
        if len(ts) == 1:
            t = ts[0]
            forward = backward_apply.HbmForward(
                op, values, ids, splits[t], weights[t], upstream[t],
                combiners[t], max_norm)
        else:
            # Features of one EV as one: rows after rows, ids after ids.
            forward = backward_apply.HbmForward(
                op, values, ids, _joined_splits([splits[t] for t in ts]),
                tf.concat([feats[t].weights for t in ts], 0),
                tf.concat([upstream[t] for t in ts], 0), combiners[ts[0]],
                max_norm)
        backward_apply.remember_hbm_forward(forward)
    return slices + [None] * (4 * k) + [None, None]


def _slices_by_table(op, k, parts, keys):
    """Each table's gradient of lookup `op` from the features' rows
    `parts` and `keys`: (the k handle inputs' gradients, [(the table's
    features, its rows, its keys)]). A table two features read has their
    rows and keys joined; its gradient goes to its first feature, whole,
    and the others give None, so that TF adds nothing to it and an
    optimizer finds the slices this gradient function remembers."""
    groups: Dict[int, List[int]] = {}
    for t in range(k):
        groups.setdefault(id(op.inputs[t]), []).append(t)
    slices: List[Any] = [None] * k
    tables = []
    for ts in groups.values():
        values = _joined([parts[t] for t in ts])
        ids = _joined([keys[t] for t in ts])
        slices[ts[0]] = tf.IndexedSlices(values, ids)
        tables.append((ts, values, ids))
    return slices, tables


def _joined(tensors):
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, 0)


def _joined_splits(splits):
    """row_splits of features' rows one after the other."""
    out, base = [splits[0]], splits[0][-1]
    for s in splits[1:]:
        out.append(s[1:] + base)
        base = base + s[-1]
    return tf.concat(out, 0)
