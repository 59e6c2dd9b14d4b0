"""Restores checkpoints written by DeepRec (TF 1.15) or Deepray (TF 2.15)
into this library's EmbeddingVariables, optimizer slots and variables.

DeepRec's EV saver writes plain tensors into a TF checkpoint, per EV (and
per slot EV, which is an EV of its own), after the EV's tensor prefix:

    -keys [n] int64, -values [n, D], -freqs [n], -versions [n]
        the admitted keys;
    -keys_filtered, -freqs_filtered, -versions_filtered [m]
        keys a filter has not admitted yet (no rows);
    -partition_offset, -partition_filter_offset [P + 1] int32
        where each of DeepRec's P hash partitions (key mod P) starts.

The prefix is the variable's name: DeepRec writes it without `:0`
(`user_ev`), Deepray with it (`user_ev:0`), and Deepray strips every
trailing `0` before the `:0` (`user_ev/part_0` is written `user_ev/part_:0`,
TF's `rstrip(":0")`). A partitioned EV is one EV per part,
`<ev>/part_<k>`. Optimizer slots are EVs named `<ev>/<Optimizer>`,
`<ev>/<Optimizer>_1`, ... in slot-creation order (DeepRec, TF1
slot_creator) or `<Optimizer>/<ev>/<slot>:0` (Deepray, Keras `add_slot`).

Here an EV is one table holding keys, values, freqs, versions and every
slot, so a restore merges the parts and the slot EVs into it through the
storage's import op (the path `tf.train.Checkpoint` restores take).
"""

import logging
import re
from typing import Any
from typing import Dict
from typing import List
from typing import Mapping
from typing import Optional
from typing import Sequence
from typing import Set
from typing import Tuple
from typing import Union

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.training import saver as saver_lib

from group_embedding import model_parallel
from group_embedding.embedding_variable.keras_variable import (
    embedding_variable_of,
)
from group_embedding.embedding_variable.options import CBFFilter
from group_embedding.embedding_variable.options import CounterFilter
from group_embedding.embedding_variable.variable import is_embedding_variable
from group_embedding.ops import op_names

_logger = logging.getLogger(__name__)

# Our slot name -> (Deepray's slot name, index among the optimizer's slot
# EVs in DeepRec's creation order: `<ev>/<Opt>`, `<ev>/<Opt>_1`, ...;
# the optimizer's default name, which scopes its slots in both).
# Adagrad: "accumulator"; Adam: "m", "v"; FTRL: "accum" (Deepray
# "accumulator"), "linear".
SLOT_LAYOUTS = {
    "adagrad/accumulator": ("accumulator", 0, "Adagrad"),
    "adam/m": ("m", 0, "Adam"),
    "adam/v": ("v", 1, "Adam"),
    "adam_async/m": ("m", 0, "AdamAsync"),
    "adam_async/v": ("v", 1, "AdamAsync"),
    "ftrl/accumulator": ("accumulator", 0, "Ftrl"),
    "ftrl/linear": ("linear", 1, "Ftrl"),
}

# Where the global step is, tried in order: DeepRec's TF1 variable, and a
# Deepray `tf.train.Checkpoint(optimizer=...)`'s Keras iteration count.
GLOBAL_STEP_TENSORS = ("global_step",
                       "optimizer/iter/.ATTRIBUTES/VARIABLE_VALUE")

_PART = re.compile(r"part_\d+$")

EmbeddingVariables = Union[Sequence, Mapping[str, object]]


class _Checkpoint:
    """Typed, validated reads of one checkpoint's tensors."""

    def __init__(self, path: str):
        self.path = path
        self.reader = tf.train.load_checkpoint(path)
        self.shapes = self.reader.get_variable_to_shape_map()
        self.dtypes = self.reader.get_variable_to_dtype_map()
        # Names of every EV-like object: X with an X-keys tensor.
        self.tables = {n[:-len("-keys")] for n in self.shapes
                       if n.endswith("-keys")}

    def has(self, name: str) -> bool:
        return name in self.shapes

    def read(self, name: str, what: str, rank: int, dtypes,
             length: Optional[int] = None) -> np.ndarray:
        """The tensor `name`, checked for rank, dtype and first dim."""
        if name not in self.shapes:
            raise ValueError(f"{what}: the checkpoint {self.path} has no "
                             f"tensor '{name}'.")
        shape, dtype = self.shapes[name], self.dtypes[name]
        if len(shape) != rank:
            raise ValueError(f"{what}: tensor '{name}' of {self.path} has "
                             f"shape {shape}, expected rank {rank}.")
        if dtype not in dtypes:
            raise ValueError(
                f"{what}: tensor '{name}' of {self.path} has dtype "
                f"{dtype.name}, expected "
                f"{' or '.join(d.name for d in dtypes)}.")
        if length is not None and shape[0] != length:
            raise ValueError(
                f"{what}: tensor '{name}' of {self.path} has {shape[0]} "
                f"entries but its EV has {length} keys (inconsistent "
                "checkpoint).")
        return self.reader.get_tensor(name)


_INTS = (tf.int64, tf.int32)
# The op type of an optimizer's slot creation on an EV (and its
# pre-rename alias, in graphs imported from before the rename).
_ENSURE_SLOT_OPS = op_names.with_alias("GroupEmbeddingEVEnsureSlot")


class _Table:
    """One DeepRec EV (or slot EV, or part) read from a checkpoint."""

    def __init__(self, ckpt: _Checkpoint, prefix: str, what: str,
                 dim: Optional[int]):
        def read(suffix, rank, dtypes, length=None):
            return ckpt.read(f"{prefix}-{suffix}", what, rank, dtypes,
                             length)

        self.prefix = prefix
        self.keys = read("keys", 1, _INTS).astype(np.int64)
        n = len(self.keys)
        self.values = read("values", 2, (tf.float32,), n)
        if dim is not None and self.values.shape[1] != dim:
            raise ValueError(
                f"{what}: tensor '{prefix}-values' of {ckpt.path} has "
                f"shape {list(self.values.shape)}, rows of "
                f"{self.values.shape[1]} but the EmbeddingVariable has "
                f"embedding_dim {dim}.")
        self.freqs = read("freqs", 1, _INTS, n).astype(np.int64)
        self.versions = read("versions", 1, _INTS, n).astype(np.int64)
        self._check_offsets(ckpt, f"{prefix}-partition_offset", what, n)
        filtered = f"{prefix}-keys_filtered"
        if ckpt.has(filtered):
            self.filtered_keys = read("keys_filtered", 1, _INTS).astype(
                np.int64)
            m = len(self.filtered_keys)
            self.filtered_freqs = read("freqs_filtered", 1, _INTS,
                                       m).astype(np.int64)
            self.filtered_versions = read("versions_filtered", 1, _INTS,
                                          m).astype(np.int64)
            self._check_offsets(
                ckpt, f"{prefix}-partition_filter_offset", what, m)
        else:  # older DeepRec, or TF_EV_SAVE_FILTERED_FEATURES off
            self.filtered_keys = np.zeros([0], np.int64)
            self.filtered_freqs = np.zeros([0], np.int64)
            self.filtered_versions = np.zeros([0], np.int64)

    @staticmethod
    def _check_offsets(ckpt, name, what, n):
        """Partition offsets (start of each hash partition's keys; the
        last is the key count) must agree with the keys they index."""
        if not ckpt.has(name):
            return
        off = ckpt.read(name, what, 1, _INTS).astype(np.int64)
        if (len(off) < 2 or off[0] != 0 or off[-1] != n
                or np.any(np.diff(off) < 0)):
            raise ValueError(
                f"{what}: tensor '{name}' of {ckpt.path} is not a partition "
                f"offset table for {n} keys (it must start at 0, never "
                f"decrease and end at {n}; it ends at "
                f"{int(off[-1]) if len(off) else 'nothing'}): inconsistent "
                "checkpoint.")


def _prefixes(name: str) -> List[str]:
    """Tensor prefixes an EV named `name` may have been written under:
    DeepRec's bare name, Deepray's `name:0`, and Deepray's `name:0` after
    TF's `rstrip(":0")` took trailing '0's (`part_0` -> `part_:0`)."""
    out = [name, name + ":0"]
    stripped = name.rstrip(":0")
    if stripped != name and stripped:
        out.append(stripped + ":0")
    return out


def _find(ckpt: _Checkpoint, name: str) -> Optional[str]:
    found = [p for p in _prefixes(name) if p in ckpt.tables]
    return found[0] if found else None


def _parts(ckpt: _Checkpoint, name: str, what: str) -> List[Tuple[str, str]]:
    """(part name, tensor prefix) of the EV `name`: itself, or its parts
    `name/part_0`, `name/part_1`, ... (a partitioned EV)."""
    whole = _find(ckpt, name)
    parts = []
    k = 0
    while True:
        part = f"{name}/part_{k}"
        prefix = _find(ckpt, part)
        if prefix is None:
            break
        parts.append((part, prefix))
        k += 1
    if whole is not None and parts:
        raise ValueError(
            f"{what}: the checkpoint {ckpt.path} holds both an EV "
            f"'{whole}' and parts of one ('{parts[0][1]}'); restore them "
            "into EVs of their own names.")
    if whole is not None:
        return [(name, whole)]
    if not parts:
        raise ValueError(
            f"{what}: the checkpoint {ckpt.path} has no tensor "
            f"'{name}-keys' (nor '{name}:0-keys' as Deepray writes it, nor "
            f"the parts '{name}/part_0-keys', ... of a partitioned EV). "
            "Pass a dict {checkpoint name: EV} if the names differ.")
    return parts


def _slot_prefix(ckpt: _Checkpoint, part: str, prefix: str, slot: str,
                 optimizer_name: Optional[str], what: str) -> str:
    """The tensor prefix of our slot `slot` of the EV (part) `part`."""
    deepray_slot, index, default_name = SLOT_LAYOUTS[slot]
    bases = {part, prefix[:-2] if prefix.endswith(":0") else prefix}
    found: Dict[str, Set[str]] = {}
    for table in ckpt.tables:
        for base in bases:
            tail = f"/{base}/{deepray_slot}:0"
            if table.endswith(tail) and len(table) > len(tail):
                found.setdefault(table[:-len(tail)], set()).add(table)
            head = base + "/"
            rest = table[len(head):]
            if not table.startswith(head) or "/" in rest \
                    or _PART.match(rest):
                continue
            m = re.fullmatch(r"(.+?)(?:_(\d+))?", rest)
            assert m is not None  # the pattern matches any non-empty name
            if int(m.group(2) or 0) == index:
                found.setdefault(m.group(1), set()).add(table)
    # Only the optimizer's own slots: a DeepRec `<ev>/Adagrad` is no Adam
    # `m`, however its index fits.
    name = optimizer_name or default_name
    others = sorted(k for k in found if k != name)
    mine = found.get(name, set())
    if len(mine) > 1:
        raise ValueError(
            f"{what}: the checkpoint {ckpt.path} holds the slot "
            f"'{deepray_slot}' of '{part}' twice: "
            f"{', '.join(sorted(mine))}.")
    if not mine:
        looked = (f"'<optimizer>/{part}/{deepray_slot}:0-keys' (Deepray) or "
                  f"'{part}/<optimizer>{'_%d' % index if index else ''}"
                  "-keys' (DeepRec)")
        raise ValueError(
            f"{what}: the checkpoint {ckpt.path} has no optimizer slot "
            f"'{deepray_slot}' for '{part}' (looked for {looked}"
            f" with optimizer name '{name}'"
            + (f"; found slots of {', '.join(others)}: pass "
               "optimizer_name= if one of them is this optimizer"
               if others else "") + "). Pass optimizer=None to restore "
            "without the optimizer state (slots start at their initial "
            "values).")
    return mine.pop()


def _optimizer_slots(optimizer) -> List[Tuple[str, float]]:
    if optimizer is None:
        return []
    slots = getattr(optimizer, "_ev_slots", None)
    if slots is None:
        raise TypeError(
            f"optimizer must be a ge.optimizers or ge.train optimizer, got "
            f"{type(optimizer).__name__}.")
    slots = list(slots())
    unknown = [n for n, _ in slots if n not in SLOT_LAYOUTS]
    if unknown:
        raise NotImplementedError(
            f"{type(optimizer).__name__}: restoring its slots {unknown} from "
            "a DeepRec checkpoint is not supported (Adagrad, Adam, "
            "AdamAsync and FTRL are).")
    return slots


def _align(keys: np.ndarray, table: _Table, init: float, what: str,
           dim: int) -> np.ndarray:
    """The slot table's rows in the order of `keys`; keys it lacks get
    `init` (DeepRec saves slots at another moment than values)."""
    out = np.full([len(keys), dim], init, np.float32)
    order = np.argsort(table.keys, kind="stable")
    sorted_keys = table.keys[order]
    pos = np.searchsorted(sorted_keys, keys)
    pos_c = np.minimum(pos, max(len(sorted_keys) - 1, 0))
    hit = (pos < len(sorted_keys)) & (sorted_keys[pos_c] == keys) \
        if len(sorted_keys) else np.zeros(len(keys), bool)
    out[hit] = table.values[order[pos_c[hit]]]
    missing = int(len(keys) - hit.sum())
    extra = int(len(table.keys) - hit.sum())
    if missing or extra:
        _logger.warning(
            "%s: slot '%s' holds %d keys the EV lacks (dropped) and lacks "
            "%d of its keys (set to %s).", what, table.prefix, max(extra, 0),
            missing, init)
    return out


class _Restore:
    """The merged content of one of our EVs, ready for the import op."""

    def __init__(self, ckpt, name, ev, slots, optimizer_name):
        what = f"EmbeddingVariable '{ev.name}' (checkpoint '{name}')"
        dim = ev.embedding_dim
        keys, values, freqs, versions, slot_rows = [], [], [], [], []
        f_keys, f_freqs, f_versions = [], [], []
        self.tensors = []
        for part, prefix in _parts(ckpt, name, what):
            table = _Table(ckpt, prefix, what, dim)
            self.tensors.append(prefix)
            keys.append(table.keys)
            values.append(table.values)
            freqs.append(table.freqs)
            versions.append(table.versions)
            f_keys.append(table.filtered_keys)
            f_freqs.append(table.filtered_freqs)
            f_versions.append(table.filtered_versions)
            rows = []
            for slot, init in slots:
                sp = _slot_prefix(ckpt, part, prefix, slot, optimizer_name,
                                  what)
                self.tensors.append(sp)
                rows.append(_align(table.keys, _Table(ckpt, sp, what, dim),
                                   init, what, dim))
            slot_rows.append(rows)
        part_keys = keys
        keys = np.concatenate(keys)
        f_keys = np.concatenate(f_keys)
        both = np.concatenate([keys, f_keys])
        uniq, counts = np.unique(both, return_counts=True)
        if np.any(counts > 1):
            raise ValueError(
                f"{what}: the checkpoint {ckpt.path} holds key "
                f"{int(uniq[counts > 1][0])} more than once (in two parts, "
                "or both admitted and filtered): inconsistent checkpoint.")
        filt = ev.ev_option.filter_option
        f_freqs = np.concatenate(f_freqs)
        f_versions = np.concatenate(f_versions)
        freqs = np.concatenate(freqs)
        if isinstance(filt, CounterFilter):
            # An admitted key stays admitted (DeepRec saves freq 0 without
            # TF_RECORD_FREQ, and a lower count would hide its row).
            freqs = np.maximum(freqs, filt.filter_freq)
        if isinstance(filt, CBFFilter) and len(f_keys):
            # Our CBFFilter does not store keys before admission, and its
            # counts are not checkpointed (see the README).
            _logger.warning(
                "%s: %d keys not admitted yet are dropped: a CBFFilter "
                "here does not store them.", what, len(f_keys))
            f_keys = f_keys[:0]
            f_freqs, f_versions = f_freqs[:0], f_versions[:0]
        self.ev = ev
        self.name = name
        self.num_admitted = len(keys)
        self.num_filtered = len(f_keys)
        self.keys = np.concatenate([keys, f_keys])
        self.freqs = np.concatenate([freqs, f_freqs])
        self.versions = np.concatenate(
            [np.concatenate(versions), f_versions])
        self._values = np.concatenate(values) if values else \
            np.zeros([0, dim], np.float32)
        self.slot_names = [n for n, _ in slots]
        self.slot_inits = np.array([i for _, i in slots], np.float32)
        admitted_slots = np.concatenate(
            [np.concatenate(rows, axis=1) if rows
             else np.zeros([len(k), 0], np.float32)
             for rows, k in zip(slot_rows, part_keys)])
        filtered_slots = np.tile(np.repeat(self.slot_inits, dim),
                                 [len(f_keys), 1])
        self.slots = np.concatenate([admitted_slots, filtered_slots]) \
            .astype(np.float32)
        self._keep_owned_keys()

    def _keep_owned_keys(self):
        """In collective mode, the keys this worker owns (key mod N ==
        rank): every worker restores its share of the same checkpoint."""
        rank, size = model_parallel.world()
        if size == 1:
            return
        mine = model_parallel.key_owner(self.keys, size) == rank
        admitted = mine[:self.num_admitted]
        self._values = self._values[admitted]
        self.num_admitted = int(admitted.sum())
        self.num_filtered = int(mine[len(admitted):].sum())
        self.keys, self.freqs = self.keys[mine], self.freqs[mine]
        self.versions, self.slots = self.versions[mine], self.slots[mine]

    def values(self, defaults: np.ndarray) -> np.ndarray:
        """Admitted rows, then the filtered keys' rows: the EV's default
        rows (`defaults`), what a key gets when it is first stored and
        starts from once admitted."""
        rows = defaults[np.mod(self.keys[self.num_admitted:],
                               len(defaults))]
        return np.concatenate([self._values, rows]).astype(np.float32)


def _checkpoint_path(path: str) -> str:
    if tf.io.gfile.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"No checkpoint in directory {path}.")
        return latest
    return path


def _named(variables, what: str) -> Dict[str, object]:
    """{checkpoint name: variable} from a dict or a list (names from the
    variables: an EV's name, a variable's name without ':0')."""
    if variables is None:
        return {}
    if isinstance(variables, Mapping):
        return dict(variables)
    if not isinstance(variables, (list, tuple)):
        variables = [variables]
    out = {}
    for v in variables:
        if isinstance(v, (list, tuple)) and len(v) == 1:
            v = v[0]   # get_embedding_variable(partitioner=...)
        ev = embedding_variable_of(v)
        name = ev.name if ev is not None else _variable_name(v)
        if name in out:
            raise ValueError(f"{what}: two variables named '{name}'; pass "
                             "a dict {checkpoint name: variable}.")
        out[name] = v
    return out


def _variable_name(v) -> str:
    name = getattr(v, "_shared_name", None) or v.name
    return name[:-2] if name.endswith(":0") else name


def _global_step(ckpt: _Checkpoint, name) -> Optional[int]:
    names = GLOBAL_STEP_TENSORS if name == "auto" else \
        () if name is None else (name,)
    for n in names:
        if ckpt.has(n):
            step = ckpt.read(n, "global step", 0, _INTS)
            return int(step)
    if name not in ("auto", None):
        raise ValueError(f"global step: the checkpoint {ckpt.path} has no "
                         f"tensor '{name}'.")
    return None


def _check_dense(ckpt: _Checkpoint, name: str, var) -> None:
    what = f"variable '{_variable_name(var)}'"
    shape = list(var.shape)
    ckpt.read(name, what, len(shape), (tf.as_dtype(var.dtype),))
    if ckpt.shapes[name] != shape:
        raise ValueError(f"{what}: tensor '{name}' of {ckpt.path} has shape "
                         f"{ckpt.shapes[name]}, the variable {shape}.")


class _GraphRunner:
    """Graph mode: feeds the arrays through placeholders into ops run in
    `sess`, so that no table is copied into the GraphDef. A finalized
    graph (MonitoredTrainingSession) is reopened for these few ops."""

    def __init__(self, sess):
        self.sess = sess
        self.ops, self.feed = [], {}

    def feed_of(self, array, dtype):
        ph = tf.compat.v1.placeholder(dtype, [None] * array.ndim)
        self.feed[ph] = array
        return ph

    def run(self):
        self.sess.run(self.ops, feed_dict=self.feed)


def restore_deeprec_checkpoint(
        path: str, embedding_variables: EmbeddingVariables,
        optimizer=None,
        dense_variables: Optional[Union[Sequence, Mapping[str, object]]]
        = None,
        *, optimizer_name: Optional[str] = None,
        global_step: Optional[str] = "auto", sess=None) -> Dict[str, dict]:
    """Restores EVs, their optimizer slots and variables from a checkpoint
    written by DeepRec (TF 1.15) or Deepray (TF 2.15).

    Each EV gets its keys, rows, frequencies and versions, the keys its
    filter has not admitted yet with their counts (so a `CounterFilter`
    admits them when DeepRec would), and every slot of `optimizer`; its
    previous content is replaced. Names are resolved as DeepRec and Deepray
    write them (see the module docstring): `<ev>-keys` or `<ev>:0-keys`, a
    partitioned EV's parts `<ev>/part_<k>` merged into one table, slots
    `<ev>/<Optimizer>[_i]` or `<Optimizer>/<ev>/<slot>:0`. Every tensor
    is checked (present, rank, dtype, lengths, partition offsets) before
    anything is written.

    Example (Deepray's `tf.train.Checkpoint(user_ev=..., optimizer=...)`)::

        ev = ge.get_embedding_variable("user_ev", 16, ev_option=...)
        opt = ge.optimizers.Adagrad(0.1, epsilon=0.0)
        ge.restore_deeprec_checkpoint("ckpt/model", [ev], opt)

    Args:
        path: checkpoint prefix, or a directory (its latest checkpoint).
        embedding_variables: EVs (or `KerasEmbeddingVariable`s, or the
            one-element lists `get_embedding_variable(partitioner=...)`
            returns), restored from the EV of their own name; or a dict
            `{name in the checkpoint: EV}`. A DeepRec partitioned EV is
            restored into one EV. Create them as DeepRec did (same
            `embedding_dim`, filter, default rows): keys not admitted yet
            have no saved row and start from the EV's default row.
        optimizer: the `ge.optimizers` (Keras) or `ge.train` (TF1)
            optimizer that will continue training (Adagrad, Adam,
            AdamAsync, FTRL), or None to leave the slots out (they then
            start at their initial values). Its slots must be in the
            checkpoint. A Keras optimizer's `iterations` is set to the
            global step (Adam's bias correction and the keys' versions
            continue from it); a TF1 optimizer's global step is a
            variable: list it in `dense_variables`.
        dense_variables: plain variables to restore, as a dict
            `{tensor name: variable}` (a Deepray `tf.train.Checkpoint`
            names them by object path, e.g.
            `"model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE"`)
            or a list (TF1 names: the variable's name without ':0').
        optimizer_name: the optimizer's name in the checkpoint, which
            scopes its slot EVs; default: DeepRec's and Deepray's default
            name of `optimizer`'s kind ("Adagrad", "Adam", "AdamAsync",
            "Ftrl"). Slots of other optimizers are never taken.
        global_step: tensor holding the global step: "auto" (DeepRec's
            `global_step`, else Deepray's `optimizer/iter/...`), a name,
            or None. It becomes the EVs' current step and a Keras
            optimizer's `iterations`.
        sess: graph mode only: the session holding the variables (default:
            the default session).

    In collective mode (`ge.enable_distributed_strategy("collective")`)
    each worker restores the keys it owns (key mod N == rank): call it on
    every worker with the same checkpoint.

    Returns:
        `{checkpoint name: {"keys": admitted keys, "filtered_keys": keys
        not admitted yet, "tensors": tensor prefixes read}}` per EV.

    Raises:
        ValueError: a tensor missing, of the wrong rank, dtype or shape
            (another embedding_dim), lengths that disagree, partition
            offsets that do not fit the keys, a key saved twice; the
            message names the EV and the tensor.
        TypeError, NotImplementedError: an optimizer that is not ours or
            whose slots have no DeepRec layout here.
    """
    slots = _optimizer_slots(optimizer)
    entries = []
    for name, v in _named(embedding_variables, "embedding_variables").items():
        if isinstance(v, (list, tuple)) and len(v) == 1:
            v = v[0]   # get_embedding_variable(partitioner=...)
        ev = embedding_variable_of(v)
        if ev is None:
            raise TypeError(f"embedding_variables['{name}'] is not an "
                            f"EmbeddingVariable: {type(v).__name__}.")
        entries.append((name, ev, slots, optimizer_name))
    keras_optimizer = optimizer if isinstance(
        optimizer, keras.optimizers.Optimizer) else None
    return _restore(_Checkpoint(_checkpoint_path(path)), entries,
                    _named(dense_variables, "dense_variables"),
                    keras_optimizer, global_step, sess)


def _restore(ckpt, entries, dense, keras_optimizer, global_step, sess):
    """Restores `entries` (checkpoint name, EV, [(slot, initial value)],
    optimizer name) and `dense`, checking everything first."""
    plans = [_Restore(ckpt, *entry) for entry in entries]
    owners = {}
    for plan in plans:
        for prefix in plan.tensors:
            if prefix in owners:
                raise ValueError(
                    f"EVs '{owners[prefix]}' and '{plan.name}' resolve to "
                    f"the same tensors '{prefix}-*' of {ckpt.path} (Deepray "
                    "strips trailing '0's: 'part_10' is written 'part_1:0')"
                    "; pass a dict {checkpoint name: EV}.")
            owners[prefix] = plan.name
    for name, var in dense.items():
        _check_dense(ckpt, name, var)
    step = _global_step(ckpt, global_step)
    keras_iterations = None
    if step is not None and keras_optimizer is not None:
        keras_iterations = keras_optimizer.iterations
    if step is None:   # the last step any key was seen
        step = max([int(p.versions.max()) for p in plans if len(p.keys)],
                   default=0)

    if tf.executing_eagerly():
        for plan in plans:
            plan.ev._check_restored_keys(plan.keys)  # pylint: disable=protected-access
        for plan in plans:
            ev = plan.ev
            # The EV's own storage: DRAM / SSD tier or an HBM table.
            ev.storage.import_(
                ev.handle, plan.keys, plan.values(ev.default_values.numpy()),
                plan.freqs, plan.versions, plan.slot_names, plan.slot_inits,
                plan.slots, step)
        for name, var in dense.items():
            var.assign(ckpt.reader.get_tensor(name))
        if keras_iterations is not None:
            keras_iterations.assign(step)
    else:
        sess = sess or tf.compat.v1.get_default_session()
        if sess is None:
            raise ValueError("restore_deeprec_checkpoint in graph mode needs "
                             "`sess` (or a default session).")
        _run_in_graph(sess, ckpt, plans, dense, step, keras_iterations)
    return {p.name: {"keys": p.num_admitted, "filtered_keys": p.num_filtered,
                     "tensors": p.tensors} for p in plans}


def _run_in_graph(sess, ckpt, plans, dense, step, keras_iterations):
    graph = sess.graph
    finalized = graph.finalized
    if finalized:
        graph._unsafe_unfinalize()  # pylint: disable=protected-access
    try:
        with graph.as_default():
            run = _GraphRunner(sess)
            # DeepRec checkpoints hold no default matrix: a restore before
            # the initializers (MonitoredTrainingSession's) initializes it
            # (the initializer assigns only once, see EmbeddingVariable).
            sess.run([p.ev.default_values.initializer for p in plans])
            defaults = sess.run([p.ev.default_values for p in plans])
            for plan, dflt in zip(plans, defaults):
                ev = plan.ev
                keys = run.feed_of(plan.keys, tf.int64)
                checks = ev._check_restored_keys(keys)  # pylint: disable=protected-access
                with tf.control_dependencies(checks):
                    run.ops.append(ev.storage.import_(
                        ev.handle, keys,
                        run.feed_of(plan.values(dflt), tf.float32),
                        run.feed_of(plan.freqs, tf.int64),
                        run.feed_of(plan.versions, tf.int64),
                        tf.constant(plan.slot_names, tf.string),
                        tf.constant(plan.slot_inits, tf.float32),
                        run.feed_of(plan.slots, tf.float32),
                        tf.constant(step, tf.int64)))
            for name, var in dense.items():
                value = ckpt.reader.get_tensor(name)
                run.ops.append(var.assign(
                    run.feed_of(np.asarray(value), var.dtype.base_dtype)))
            if keras_iterations is not None:
                run.ops.append(keras_iterations.assign(step))
            run.run()
    finally:
        if finalized:
            graph.finalize()


def is_deeprec_checkpoint(path: str, names: Sequence[str]) -> bool:
    """True when `path` holds the EVs `names` in DeepRec's layout (their
    keys, without the slot tensors this library's saver writes)."""
    ckpt = _Checkpoint(_checkpoint_path(path))
    for name in names:
        if ckpt.has(f"{name}-slot_names"):
            return False
    return any(_find(ckpt, n) is not None or
               _find(ckpt, f"{n}/part_0") is not None for n in names)


class Saver(saver_lib.Saver):
    """`tf.compat.v1.train.Saver` that also restores DeepRec checkpoints
    (what `import group_embedding.compat` installs as `tf.train.Saver`).

    `restore(sess, path)` of a checkpoint whose EVs are in DeepRec's layout
    (`<ev>-keys` without this library's `<ev>-slot_names`) restores each
    EV of the Saver's list with `restore_deeprec_checkpoint`, its slots
    for the optimizer whose ops update it in the graph, and every other
    variable by its Saver name (EVs' default matrices, absent from DeepRec
    checkpoints, keep their initialized values). Anything else is the
    stock restore.
    """

    def restore(self, sess, save_path):
        evs, dense = self._split_var_list()
        try:
            deeprec = bool(evs) and save_path is not None and \
                is_deeprec_checkpoint(save_path, list(evs))
        except (tf.errors.OpError, ValueError):
            deeprec = False   # the stock restore says what is wrong
        if not deeprec:
            return super().restore(sess, save_path)
        ckpt = _Checkpoint(_checkpoint_path(save_path))
        # Each EV with the slots the graph's optimizer ops ensure on it,
        # under that optimizer's name; the global step is a variable here.
        entries = [(name, ev, *_graph_slots(sess.graph, ev))
                   for name, ev in evs.items()]
        _restore(ckpt, entries, _deeprec_dense_names(ckpt, dense), None,
                 None, sess)
        return None

    def _split_var_list(self):
        var_list = self._var_list
        if var_list is None:
            var_list = (tf.compat.v1.global_variables()
                        + tf.compat.v1.get_collection(
                            tf.compat.v1.GraphKeys.SAVEABLE_OBJECTS))
        if isinstance(var_list, Mapping):
            items = list(var_list.items())
        else:
            items = [(None, v) for v in var_list]
        evs, dense = {}, {}
        handles = set()
        for key, v in items:
            if is_embedding_variable(v):
                if v.handle.name not in handles:
                    handles.add(v.handle.name)
                    evs[v.name] = v
            elif isinstance(v, tf.Variable):
                dense[key or _variable_name(v)] = v
        defaults = {_variable_name(ev.default_values) for ev in evs.values()}
        dense = {k: v for k, v in dense.items()
                 if _variable_name(v) not in defaults}
        return evs, dense


def _deeprec_dense_names(ckpt: _Checkpoint, dense: Dict[str, object]):
    """`dense` with TF1 Adam's beta powers under DeepRec's names: stock
    TF1 creates `beta1_power` / `beta2_power` outside the optimizer's name
    scope, `ge.train.AdamOptimizer` on EVs inside it (`Adam/beta1_power`)."""
    out = {}
    for name, var in dense.items():
        base = name.rsplit("/", 1)[-1]
        if not ckpt.has(name) and base in ("beta1_power", "beta2_power") \
                and ckpt.has(base):
            name = base
        out[name] = var
    return out


def _graph_slots(graph, ev) -> Tuple[List[Tuple[str, float]],
                                     Optional[str]]:
    """(slot, initial value) of the slots the graph's optimizers ensure on
    `ev` (its `GroupEmbeddingEVEnsureSlot` ops, in creation order), and the
    optimizer's name: the name scope of those ops, which also scopes DeepRec's
    slots (`<ev>/<name>`)."""
    out: Dict[Any, Any] = {}
    names: Set[str] = set()
    for op in graph.get_operations():
        if (op.type in _ENSURE_SLOT_OPS
                and op.inputs[0] is ev.handle):
            out.setdefault(op.get_attr("slot_name").decode(),
                           op.get_attr("initial_value"))
            scope = op.name.rsplit("/", 2)
            if len(scope) > 1:
                names.add(scope[-2])
    unknown = [n for n in out if n not in SLOT_LAYOUTS]
    if unknown:
        raise NotImplementedError(
            f"EmbeddingVariable '{ev.name}': restoring its slots {unknown} "
            "from a DeepRec checkpoint is not supported (Adagrad, Adam, "
            "AdamAsync and FTRL are).")
    # A second minimize() call scopes its ops `<name>_1`.
    names = {n for n in names if re.sub(r"_\d+$", "", n) not in names
             or re.sub(r"_\d+$", "", n) == n}
    return list(out.items()), names.pop() if len(names) == 1 else None
