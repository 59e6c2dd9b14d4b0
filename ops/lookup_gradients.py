"""Gradients of the lookup kernels (`lookup_kernels`).

Each forward op's gradient is one gradient op per group: per table the
unique ids (or EV keys) and their summed gradients, as IndexedSlices;
the weights' gradients only when some table has weights; the max_norm
clip's backward when the forward clipped. Inputs are sliced by position
(the ops take K tables' inputs side by side).

Every op built here takes the forward's ids (or distinct ids of them),
which the forward checked against the same tables: `ids_checked=True`
lets their GPU kernels skip the host wait that reading their error counts
again would cost (issue 35.3; IdsCheckedAttr in ops/kernels/op_checks.h).
"""

from typing import List

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps_utils as acd_utils

from group_embedding.ops import kernel_library
from group_embedding.ops import op_names


def _table_slices(lib, handles, uniq, sums, max_norm):
    """Per-table IndexedSlices of the kernels' per-unique-id gradients,
    taken through the max_norm clip when there is one."""
    if max_norm >= 0:
        sums = lib.group_embedding_clip_grad(
            tables=list(handles), unique_ids=list(uniq), id_grads=list(sums),
            max_norm=max_norm, ids_checked=True)
    return [tf.IndexedSlices(s, u, tf.raw_ops.VariableShape(
                input=h, out_type=tf.int64))
            for s, u, h in zip(sums, uniq, handles)]


def _weight_grads(lib, handles, ids, weights, compute):
    """The gradients w.r.t. the per-id weights of a lookup's tables.

    None for every table when none has weights (all of them the empty
    placeholders): nothing to differentiate, and nothing is built, which
    matters in eager mode where the gradient function runs every op.
    Else `compute(rows, by_position)` runs the weight-gradient op on
    `GroupEmbeddingTableSnapshot` outputs.

    Why snapshots: taking the variables as resource inputs made TF's
    automatic control dependencies order the weight-gradient ops before
    the optimizer's write, so they ran every training step even when no
    weight was differentiated. The snapshot is the only resource reader
    here (registered read-only, cheap: it aliases the table, or copies
    just the ids' rows when the variable is in copy-on-read mode); the
    weight-gradient op reading it is pruned when unused. Unweighted tables
    snapshot no ids.
    """
    if all(w.shape.as_list() == [0] for w in weights):
        return [None] * len(weights)
    rows, by_position = [], []
    for i, (h, x, w) in enumerate(zip(handles, ids, weights)):
        if w.shape.as_list() == [0]:
            x = tf.zeros([0], tf.int64)
        r, p = lib.group_embedding_table_snapshot(table=h, ids=x,
                                                  table_name=f"table {i}",
                                                  ids_checked=True)
        rows.append(r)
        by_position.append(p)
    return list(compute(rows, by_position))


_registered: List[bool] = []


def register():
    """Registers the gradients of the lookup ops (once per process)."""
    if _registered:
        return
    _registered.append(True)
    # Reads only: ordered before the next write to the table, and kept
    # only when its rows are consumed.
    acd_utils.register_read_only_resource_op("GroupEmbeddingTableSnapshot")
    def _pooled_grad(op, grads, concat):
        # GroupEmbeddingPooledLookup: one [B, D] gradient per table;
        # GroupEmbeddingConcatLookup: one [B, K * D] gradient for all.
        k = op.get_attr("num_tables")
        combiners = op_names.string_list_attr(op, "combiners")
        handles, ids, splits, weights = (
            list(op.inputs[i * k:(i + 1) * k]) for i in range(4))
        lib = kernel_library.library()
        grad_op = (lib.group_embedding_concat_lookup_grad if concat
                   else lib.group_embedding_pooled_lookup_grad)
        uniq, sums = grad_op(
            grads=grads[0] if concat else list(grads), ids=ids,
            row_splits=splits, weights=weights, combiners=combiners,
            embedding_dim=op.get_attr("embedding_dim"), ids_checked=True)
        max_norm = op.get_attr("max_norm")
        table_grads = _table_slices(lib, handles, uniq, sums, max_norm)

        def per_table(tensors):
            # The weight-gradient op takes per-table [B, D] blocks; split
            # only when some table has weights (`_weight_grads` asks).
            return tf.split(tensors[0], k, axis=1) if concat else tensors

        weight_grads = _weight_grads(
            lib, handles, ids, weights,
            lambda rows, by_position:
            lib.group_embedding_weight_grad_from_snapshots(
                tables=rows, by_position=by_position, ids=ids,
                row_splits=splits, weights=weights,
                grads=per_table(list(grads)),
                pooled=per_table(list(op.outputs)),
                combiners=combiners, max_norm=max_norm, ids_checked=True))
        return table_grads + [None] * (2 * k) + weight_grads

    op_names.register_gradient("GroupEmbeddingPooledLookup")(
        lambda op, *grads: _pooled_grad(op, grads, concat=False))
    op_names.register_gradient("GroupEmbeddingConcatLookup")(
        lambda op, *grads: _pooled_grad(op, grads, concat=True))

    @op_names.register_gradient("GroupEmbeddingSequenceLookup")
    def _sequence_grad(op, *grads):
        k = op.get_attr("num_tables")
        handles, ids, splits, positions, _, weights = (
            list(op.inputs[i * k:(i + 1) * k]) for i in range(6))
        grads = op_names.output_grads(op, grads)
        lib = kernel_library.library()
        uniq, sums = lib.group_embedding_sequence_lookup_grad(
            grads=grads, ids=ids, row_splits=splits, positions=positions,
            weights=weights, embedding_dim=op.get_attr("embedding_dim"),
            ids_checked=True)
        max_norm = op.get_attr("max_norm")
        table_grads = _table_slices(lib, handles, uniq, sums, max_norm)
        weight_grads = _weight_grads(
            lib, handles, ids, weights,
            lambda rows, by_position:
            lib.group_embedding_sequence_weight_grad_from_snapshots(
                tables=rows, by_position=by_position, ids=ids,
                row_splits=splits, positions=positions, weights=weights,
                grads=grads, max_norm=max_norm, ids_checked=True))
        return table_grads + [None] * (4 * k) + weight_grads

    @op_names.register_gradient("GroupEmbeddingEVSequenceLookup")
    def _ev_sequence_grad(op, *grads):
        k = op.get_attr("num_tables")
        keys, splits, positions = (list(op.inputs[i * k:(i + 1) * k])
                                   for i in range(1, 4))
        grads = op_names.output_grads(op, grads)
        empty = tf.zeros([0], tf.float32)
        uniq, sums = kernel_library.library().\
            group_embedding_sequence_lookup_grad(
                grads=grads, ids=keys, row_splits=splits, positions=positions,
                weights=[empty] * k,
                embedding_dim=op.get_attr("embedding_dim"))
        # Keys are not row numbers: no dense shape (as
        # GroupEmbeddingEVGather's).
        return ([tf.IndexedSlices(s, u) for s, u in zip(sums, uniq)]
                + [None] * (5 * k + 1))

    @op_names.register_gradient("GroupEmbeddingEVLookup")
    def _ev_lookup_grad(op, *grads):
        k = op.get_attr("num_tables")
        combiners = op_names.string_list_attr(op, "combiners")
        dim = op.get_attr("embedding_dim")
        handles, keys, splits, weights, defaults = (
            list(op.inputs[i * k:(i + 1) * k]) for i in range(5))
        grads = op_names.output_grads(op, grads)
        lib = kernel_library.library()
        # Keys play the role of ids: per variable, unique keys (first occurrence
        # order) and their summed gradients. Keys are not row numbers, so the
        # slices have no dense shape (as GroupEmbeddingEVGather's).
        uniq, sums = lib.group_embedding_pooled_lookup_grad(
            grads=grads, ids=keys, row_splits=splits, weights=weights,
            combiners=combiners, embedding_dim=dim)
        weight_grads = lib.group_embedding_ev_weight_grad(
            handles=handles, keys=keys, row_splits=splits, weights=weights,
            default_values=defaults, grads=grads, pooled=list(op.outputs),
            combiners=combiners, embedding_dim=dim)
        return ([tf.IndexedSlices(s, u) for s, u in zip(sums, uniq)]
                + [None] * (2 * k) + list(weight_grads) + [None] * (k + 1))
