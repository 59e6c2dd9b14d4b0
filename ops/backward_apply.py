"""The fused backward-apply of a group on the GPU kernels (issue 35.2).

A plain table's gradient from the grouped lookup is IndexedSlices built by
the group's gradient op (`GroupEmbedding*LookupGrad`, see
`lookup_gradients`): the table's distinct ids and their summed rows,
written to memory, then read again and sorted again by the optimizer's
sparse update. On the GPU kernels the core does better in one call
(`ge_backward_apply`): the group's ids sorted once, each distinct id's
gradient summed in registers and applied to the table and its slots in
place.

`fuse()` takes the (gradient, variable) pairs of one optimizer step, finds
each group whose every table's gradient comes straight from such an op,
and builds ONE `GroupEmbeddingBackwardApply` per group from the gradient
op's own inputs (the lookup outputs' gradients, ids, row_splits,
weights). The gradient op is then left without a consumer and pruned
from the step's function: no IndexedSlices are materialised.

Only a traced step (`tf.function`, `model.fit`) has ops to follow. Eager
gradients, a table that two lookups read (its gradient is a sum of two),
a gradient changed on its way (scaled, clipped), `max_norm` groups in a
traced function (see `fuse`) and tables whose lookup did not run on the
GPU kernels keep the optimizer's own sparse update.

EmbeddingVariables (issue 36.5): `fuse_ev()` does the same for the groups
of a pooled EV lookup on the CPU kernels (`GroupEmbeddingEVLookup`, whose
gradient op is `GroupEmbeddingPooledLookupGrad` with keys as ids): ONE
`GroupEmbeddingEVBackwardApply` per group resolves each distinct key
once and updates its row, slots and version in place, instead of the
gradient op's IndexedSlices and one `GroupEmbeddingEVApply*` per variable.
EVs in GPU memory (HBM, HBM_DRAM): their lookup's gradient function
(`hbm_ev_storage`) remembers each feature's keys and pooled gradient
(`remember_hbm_forward`); `fuse_ev()` gives the EVs of one such lookup ONE
`GroupEmbeddingHbmEVApply` (their storage's `apply_group`), which sums and
applies every EV's key gradients in one core call without waiting for
the stream.
"""

import collections
from typing import Any
from typing import Dict
from typing import List
from typing import NamedTuple
from typing import Optional
from typing import Sequence
from typing import Set
from typing import Tuple

import tensorflow as tf

from group_embedding.ops import capabilities
from group_embedding.ops import ev_storage
from group_embedding.ops import kernel_library
from group_embedding.ops import op_names
from group_embedding.ops.tf_variables import to_tf_variable

# Gradient op type -> the layout of its `grads` input.
_LAYOUTS = {name: layout
            for op, layout in (("GroupEmbeddingPooledLookupGrad", "pooled"),
                               ("GroupEmbeddingConcatLookupGrad", "concat"),
                               ("GroupEmbeddingSequenceLookupGrad",
                                "sequence"))
            for name in op_names.with_alias(op)}
APPLY_OP = "GroupEmbeddingBackwardApply"
EV_APPLY_OP = "GroupEmbeddingEVBackwardApply"
# The ops that read an EV group's rows for its weights' gradients.
_EV_WEIGHT_GRAD = "GroupEmbeddingEVWeightGrad"
_CLIP = "GroupEmbeddingClipGrad"
_SNAPSHOT = "GroupEmbeddingTableSnapshot"
# The kernel label of the adaptor's host stand-in (tests on CPU machines).
HOST_LABEL = b"ge_host_core"
OPTIMIZERS = ("sgd", "adagrad", "adam", "ftrl")


class Rule(NamedTuple):
    """How an optimizer's sparse update maps onto the core's.

    optimizer: one of OPTIMIZERS.
    slots: variable -> its slot variables, in the core's order (Adagrad:
        accumulator; Adam: m, v; FTRL: accumulator, linear; SGD: none).
    hyper: this step's hyperparameters, from `hyper()`.
    ev_slots: EmbeddingVariables' slot names, in the same order
        (`fuse_ev` only).
    step: the step stamped as the EV keys' version (`fuse_ev` only;
        None: EV groups are not fused).
    """

    optimizer: str
    slots: Any
    hyper: Any
    ev_slots: Sequence[str] = ()
    step: Any = None


def hyper(lr=0.0, epsilon=0.0, beta_1=0.0, beta_2=0.0, l1=0.0, l2=0.0,
          l2_shrinkage=0.0, lr_power=0.0):
    """The fused op's `hyper` input: a float32 vector of the 8 values.

    Args:
        lr: the learning rate (Adam: its bias-corrected step size).
        epsilon: Adagrad's (under the root) or Adam's (outside it).
        beta_1, beta_2: Adam's decay rates.
        l1, l2, l2_shrinkage, lr_power: TF's FtrlV2 arguments (l2 with
            Keras' `beta` folded in).
    Each a float or a scalar tensor.
    """
    return tf.stack([tf.cast(x, tf.float32) for x in (
        lr, epsilon, beta_1, beta_2, l1, l2, l2_shrinkage, lr_power)])


class HbmForward(NamedTuple):
    """One feature of an HBM EV lookup, as its gradient's fused update
    needs it (`remember_hbm_forward`)."""

    lookup: Any       # the lookup op (None: a gradient given per key)
    values: Any       # the IndexedSlices values it was remembered for
    keys: Any
    row_splits: Any
    weights: Any      # empty: none
    grads: Any        # d loss / d pooled output [B, D]
    combiner: str
    max_norm: float


# HBM lookup features remembered for a fused update (the newest first
# out: slices nobody applies are forgotten).
_MAX_REMEMBERED = 256
_remembered: "collections.OrderedDict[int, HbmForward]" = (
    collections.OrderedDict())


def remember_hbm_forward(forward: HbmForward) -> None:
    """Remembers the feature whose gradient's values are `forward.values`
    (the HBM lookup's gradient function calls it)."""
    _remembered[id(forward.values)] = forward
    while len(_remembered) > _MAX_REMEMBERED:
        _remembered.popitem(last=False)


def hbm_forward_of(keys, values) -> Optional[HbmForward]:
    """The HBM lookup feature whose untouched gradient is IndexedSlices
    (keys, values), taken out of the memory; None if there is none."""
    # TF1's gradient gating passes the values through an Identity op.
    values = _through_identities(values)
    found = _remembered.get(id(values))
    if (found is None or found.values is not values
            or _through_identities(found.keys) is not
            _through_identities(keys)):
        return None
    del _remembered[id(values)]
    return found


def scaled_hbm_gradient(grad, scale: float):
    """`grad` times `scale`, still applied by its lookup's fused update.

    When `grad` is the untouched gradient of an HBM lookup feature (its
    gradient function remembered it), the scaled values are remembered in
    its place, with the feature's upstream gradient scaled alike (the
    update is linear in it): the optimizer finds them as it finds an
    unscaled gradient (collective mode averages an EV's gradient over
    the workers this way).

    Args:
        grad: a gradient (`tf.IndexedSlices`, a tensor or None).
        scale: the factor, e.g. 1 / number of workers.

    Returns:
        The scaled `tf.IndexedSlices`, or None where `grad` is no such
        gradient (eager, another op): scale it yourself.
    """
    if not isinstance(grad, tf.IndexedSlices) or tf.executing_eagerly():
        return None
    found = hbm_forward_of(grad.indices, grad.values)
    if found is None:
        return None
    values = grad.values * scale
    # A gradient given per key is its own upstream (the unpooled lookups).
    upstream = (values if found.grads is found.values
                else found.grads * scale)
    remember_hbm_forward(found._replace(values=values, grads=upstream))
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)


class _Source(NamedTuple):
    """Where a table's IndexedSlices come from."""

    op: Any              # the group's gradient op
    table: int           # the table's position in the group
    clip: Optional[Any]  # the max_norm clip's backward between them


def _through_identities(t):
    """`t` past the Identity ops that TF1's gradient gating inserts."""
    for _ in range(8):
        if getattr(t, "op", None) is None or t.op.type != "Identity":
            break
        t = t.op.inputs[0]
    return t


def _source(grad) -> Optional[_Source]:
    """The gradient op that made `grad`, untouched, else None."""
    if not isinstance(grad, tf.IndexedSlices):
        return None
    ids = _through_identities(grad.indices)
    values = _through_identities(grad.values)
    if not hasattr(ids, "op") or ids.op.type not in _LAYOUTS:
        return None
    op = ids.op
    k = op.get_attr("num_tables")
    t = ids.value_index
    sums = op.outputs[k + t]
    producer = getattr(values, "op", None)
    if producer is op and values.value_index == k + t:
        return _Source(op, t, None)
    # A max_norm group's sums pass the clip's backward (its own output t
    # from this op's ids and sums).
    if producer is None or producer.type != _CLIP:
        return None
    kc, tc = producer.get_attr("num_tables"), values.value_index
    if (_same(_through_identities(producer.inputs[kc + tc]), ids)
            and _same(_through_identities(producer.inputs[2 * kc + tc]),
                      sums)):
        return _Source(op, t, producer)
    return None


def _same(a, b) -> bool:
    """Whether two graph tensors are the same output of the same op."""
    return (getattr(a, "op", None) is b.op
            and a.value_index == b.value_index)


def _on_gpu_kernels(op, variables: Sequence[Any]) -> bool:
    """Whether the group's ops run on the adaptor's kernels: the GPU
    kernels with every table on a GPU, or (tests on CPU machines) the
    host stand-in's label on the gradient op and on the op to build."""
    if _label(op) == HOST_LABEL:
        graph = tf.compat.v1.get_default_graph()
        labels = getattr(graph, "_op_to_kernel_label_map", {})
        return labels.get(APPLY_OP) == HOST_LABEL.decode()
    found = capabilities.current()
    if not (found.gpu and found.use_gpu_kernels()):
        return False
    return all(tf.DeviceSpec.from_string(to_tf_variable(v).device)
               .device_type == "GPU" for v in variables)


def _label(op) -> Optional[bytes]:
    try:
        return op.get_attr("_kernel")
    except ValueError:
        return None


def fuse(pairs: Sequence[Tuple[Any, Any]], rule: Rule,
         ) -> Tuple[List[Tuple[Any, Any]], List[Any]]:
    """Applies every whole group of `pairs` through the core in one op.

    Args:
        pairs: (gradient, variable) pairs of one optimizer step.
        rule: the optimizer's mapping (`Rule`).

    Returns:
        (left, ops): the pairs left for the optimizer's own update (every
        pair of a group that could not be fused, and every other pair, in
        order), and the fused ops built, for a TF1 train op to group.
    """
    if tf.executing_eagerly() or rule.optimizer not in OPTIMIZERS:
        return list(pairs), []
    fused: Set[int] = set()
    built: List[Any] = []
    for op, entries in _whole_groups(pairs):
        variables = [var for _, _, var in entries]
        clips = {src.clip for _, src, _ in entries}
        if (len(clips) != 1 or op.get_attr("embedding_dim") < 1
                or not _on_gpu_kernels(op, variables)):
            continue
        clip = clips.pop()
        # In a traced function, TF orders the clip's read of the tables
        # before any update of them: the clip and the gradient op would
        # run anyway, and a fused op would only add work. A TF1 graph
        # runs only what the train op needs: there it is fused.
        if (clip is not None
                and tf.compat.v1.get_default_graph().building_function):
            continue
        built.append(_build(op, clip, variables, rule))
        fused.update(i for i, _, _ in entries)
    return [p for i, p in enumerate(pairs) if i not in fused], built


def fuse_ev(pairs: Sequence[Tuple[Any, Any]], rule: Rule,
            ) -> Tuple[List[Tuple[Any, Any]], List[Any]]:
    """Applies every whole pooled EV group of `pairs` in one op, and the
    EVs of each HBM lookup whose gradients `pairs` holds in one op.

    Args:
        pairs: (gradient, EmbeddingVariable) pairs of one optimizer step
            (EVs themselves, not their Keras wrappers).
        rule: the optimizer's mapping, with `ev_slots` and `step` set.

    Returns:
        (left, ops) as `fuse`: the pairs left for the per-variable
        update, and the fused ops built.
    """
    if (tf.executing_eagerly() or rule.optimizer not in OPTIMIZERS
            or rule.step is None):
        return list(pairs), []
    fused: Set[int] = set()
    built: List[Any] = []
    for op, entries in _whole_groups(pairs):
        evs = [var for _, _, var in entries]
        if (_LAYOUTS[op.type] != "pooled"
                or any(src.clip is not None for _, src, _ in entries)
                or not all(_on_cpu_storage(ev) for ev in evs)):
            continue
        built.append(_build_ev(op, evs, rule))
        fused.update(i for i, _, _ in entries)
    for entries in _hbm_groups(pairs, fused):
        evs = [ev for _, ev, _ in entries]
        built.append(evs[0].storage.apply_group(
            [ev.handle for ev in evs], [f for _, _, f in entries], rule))
        fused.update(i for i, _, _ in entries)
    return [p for i, p in enumerate(pairs) if i not in fused], built


def _hbm_groups(pairs, skip: Set[int]):
    """[(pair index, EV, HbmForward)] of each HBM lookup whose features'
    untouched gradients are in `pairs` (but not at the indices `skip`),
    features in order; their forwards are taken out of the memory."""
    groups: Dict[Any, List[Tuple[int, Any, HbmForward]]] = {}
    for i, (grad, ev) in enumerate(pairs):
        if (i in skip or not isinstance(grad, tf.IndexedSlices)
                or _on_cpu_storage(ev)):
            continue
        found = hbm_forward_of(grad.indices, grad.values)
        if found is not None and ev.storage.takes_forward(found):
            # Distinct EVs: the features of a table two features read
            # are remembered as one (hbm_ev_storage's gradient).
            groups.setdefault(found.lookup, []).append((i, ev, found))
    return list(groups.values())


def _whole_groups(pairs):
    """(gradient op, [(pair index, _Source, variable)] in table order)
    for every group whose every table's gradient in `pairs` comes
    straight from its gradient op."""
    groups: Dict[Any, Dict[int, Tuple[int, _Source, Any]]] = {}
    for i, (grad, var) in enumerate(pairs):
        src = _source(grad)
        if src is not None:
            groups.setdefault(src.op, {})
            # A table twice in a group: TF would have summed its two
            # gradients (no longer straight from the op); never fused.
            groups[src.op].setdefault(src.table, (i, src, var))
    for op, tables in groups.items():
        k = op.get_attr("num_tables")
        if sorted(tables) == list(range(k)):  # else some went elsewhere
            yield op, [tables[t] for t in range(k)]


def _on_cpu_storage(ev) -> bool:
    """Whether EV `ev` lives in the C++ CPU storage (DRAM, with or
    without an SSD tier)."""
    return ev.storage is ev_storage


def _build_ev(op, evs, rule: Rule):
    """One GroupEmbeddingEVBackwardApply from gradient op `op`'s inputs
    (returns the op)."""
    k = op.get_attr("num_tables")
    inputs = list(op.inputs)
    grads, keys, splits, weights = (inputs[i * k:(i + 1) * k]
                                    for i in range(4))
    reads = []
    if not tf.compat.v1.get_default_graph().building_function:
        # A TF1 graph: after the weight gradients that are used (they
        # read the rows updated here). A traced function orders every op
        # on the variables' handles anyway.
        reads = [c for t in keys for c in t.consumers()
                 if c.type == _EV_WEIGHT_GRAD
                 and any(o.consumers() for o in c.outputs)]
    with tf.control_dependencies(reads):
        return ev_storage.library().group_embedding_ev_backward_apply(
            handles=[ev.handle for ev in evs], grads=grads, keys=keys,
            row_splits=splits, weights=weights,
            global_step=tf.cast(rule.step, tf.int64), hyper=rule.hyper,
            combiners=op_names.string_list_attr(op, "combiners"),
            embedding_dim=op.get_attr("embedding_dim"),
            optimizer=rule.optimizer, slot_names=list(rule.ev_slots))


def _table_reads(ids) -> List[Any]:
    """The snapshots of the tables that the weight gradients of the
    lookup with these ids take (they read the rows the update changes)."""
    return [c for t in ids for c in t.consumers() if c.type == _SNAPSHOT]


def _build(op, clip, variables, rule: Rule):
    """One GroupEmbeddingBackwardApply from gradient op `op`'s inputs
    (returns the op)."""
    layout = _LAYOUTS[op.type]
    k = op.get_attr("num_tables")
    inputs = list(op.inputs)
    num_grads = 1 if layout == "concat" else k
    grads, rest = inputs[:num_grads], inputs[num_grads:]
    ids, splits = rest[:k], rest[k:2 * k]
    positions = rest[2 * k:3 * k] if layout == "sequence" else []
    weights = rest[-k:]
    tables = [to_tf_variable(v) for v in variables]
    per_table = [[to_tf_variable(s) for s in rule.slots(v)]
                 for v in variables]
    slots = [s[j] for j in range(len(per_table[0])) for s in per_table]
    combiners = ([] if layout == "sequence" else
                 op_names.string_list_attr(op, "combiners"))
    lib = kernel_library.library()
    # After the weight gradients' snapshots of the same tables: a traced
    # function orders them so anyway; a TF1 graph would not (its gradient
    # gating, which the fused op bypasses, did). A snapshot that aliases
    # a table then makes the update copy it first (copy on write).
    with tf.control_dependencies(_table_reads(ids)):
        return lib.group_embedding_backward_apply(
            tables=[t.handle for t in tables],
            slots=[s.handle for s in slots], grads=grads, ids=ids,
            row_splits=splits, positions=positions, weights=weights,
            hyper=rule.hyper, layout=layout, optimizer=rule.optimizer,
            combiners=combiners, embedding_dim=op.get_attr("embedding_dim"),
            max_norm=-1.0 if clip is None else clip.get_attr("max_norm"),
            table_names=[t.name for t in tables], ids_checked=True)
