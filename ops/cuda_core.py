"""ctypes bindings of the CUDA core (`ops/cuda/group_embedding_cuda.h`).

Framework-neutral on purpose: it imports only ctypes and numpy, so that the
GPU machine (CUDA, CuPy and torch, no TensorFlow) loads it by path and
drives the core with CuPy or torch device pointers, and CPU-only CI drives
the host stand-in (`ops/cuda/host_core.cc`) with numpy arrays through the
very same code.

* `Core(path)`: a loaded core library (the CUDA one or the host stand-in),
  its functions typed, its ABI version checked.
* `HostMemory`, `CupyMemory`, `TorchMemory`: where arrays live, with the
  few operations the calls need (copy in, copy out, allocate, pointer,
  stream, synchronise).
* `TableBatch` and `GroupCall`: one table and its ragged ids; the calls of
  the core on a group of them, returning numpy results.
"""

import ctypes
import dataclasses
from typing import Any
from typing import List
from typing import Optional

import numpy as np

ABI_VERSION = 4
ROWS_BY_POSITION = 1  # GeTable.flags
COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}
OPTIMIZERS = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 3,
              "adagrad_decay": 4}
SLOTS = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 2, "adagrad_decay": 2}
BAD_IDS = 0
BAD_LAYOUT = 1
_STATUS = {-1: "bad argument", -2: "scratch too small",
           -3: "too large (dim > 1024 or > 2^31 - 1 ids)"}


class GeTable(ctypes.Structure):
    """`GeTable` of the C header, field for field."""
    _fields_ = [
        ("table", ctypes.c_void_p),
        ("vocab", ctypes.c_int64),
        ("ids", ctypes.c_void_p),
        ("splits", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("nnz", ctypes.c_int64),
        ("batch", ctypes.c_int64),
        ("seq_len", ctypes.c_int64),
        ("combiner", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("out", ctypes.c_void_p),
        ("out_stride", ctypes.c_int64),
        ("grad", ctypes.c_void_p),
        ("grad_stride", ctypes.c_int64),
        ("pooled", ctypes.c_void_p),
        ("weight_grad", ctypes.c_void_p),
        ("slot0", ctypes.c_void_p),
        ("slot1", ctypes.c_void_p),
    ]


class GeOptimizerConfig(ctypes.Structure):
    """`GeOptimizerConfig` of the C header."""
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("lr", ctypes.c_float),
        ("epsilon", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("l1", ctypes.c_float),
        ("l2", ctypes.c_float),
        ("l2_shrinkage", ctypes.c_float),
        ("lr_power", ctypes.c_float),
    ]


def load_sibling(filename: str):
    """Another framework-neutral module of `ops/` (e.g. `ev_table_core.py`)
    loaded by path, as this one is on the GPU machine (no TF there, so the
    `group_embedding` package cannot be imported); loaded once."""
    import importlib.util
    import os
    import sys
    name = "_ge_" + os.path.splitext(filename)[0]
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            filename)
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:  # not a Python source
            raise ImportError(f"Cannot load {path} as a module.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class CoreError(RuntimeError):
    """A core call refused its arguments or failed to launch."""


class Core:
    """A loaded core library: the CUDA core or its host stand-in.

    Args:
        path: the shared library.

    Raises:
        OSError: it cannot be loaded.
        CoreError: its ABI version is not this module's.
    """

    def __init__(self, path: str):
        self.path = path
        lib = ctypes.CDLL(path)
        tables = ctypes.POINTER(GeTable)
        vp, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        c_int = ctypes.c_int
        lib.ge_abi_version.restype = c_int
        lib.ge_backend_name.restype = ctypes.c_char_p
        lib.ge_lookup_scratch_bytes.restype = ctypes.c_size_t
        lib.ge_lookup_scratch_bytes.argtypes = [c_int]
        lib.ge_backward_scratch_bytes.restype = ctypes.c_size_t
        lib.ge_backward_scratch_bytes.argtypes = [tables, c_int, i64]
        common: List[Any] = [tables, c_int, i64, f32]
        size = ctypes.c_size_t
        for name in ("ge_lookup_pooled", "ge_lookup_sequence",
                     "ge_weight_grads", "ge_clip_grads"):
            getattr(lib, name).restype = c_int
            getattr(lib, name).argtypes = common + [vp, size, vp, vp]
        for name in ("ge_backward", "ge_backward_padded"):
            getattr(lib, name).restype = c_int
            getattr(lib, name).argtypes = common + [vp, size, vp, vp, vp, vp,
                                                    vp]
        lib.ge_check_ids.restype = c_int
        lib.ge_check_ids.argtypes = [tables, c_int, vp, size, vp, vp]
        lib.ge_backward_apply.restype = c_int
        lib.ge_backward_apply.argtypes = common + [
            ctypes.POINTER(GeOptimizerConfig), vp, size, vp, vp]
        self.lib = lib
        version = lib.ge_abi_version()
        if version != ABI_VERSION:
            raise CoreError(f"{path}: ABI version {version}, expected "
                            f"{ABI_VERSION}; rebuild the core.")
        self.backend = lib.ge_backend_name().decode()

    def check(self, name: str, status: int):
        """Raises CoreError for a non-zero status of call `name`."""
        if status != 0:
            why = _STATUS.get(status, f"CUDA error {status}")
            raise CoreError(f"{name} failed: {why} ({status}).")


class HostMemory:
    """Arrays in host memory (numpy): for the host stand-in."""

    name = "host"
    stream = None

    def put(self, a):
        return np.ascontiguousarray(a)

    def get(self, a):
        return np.array(a)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def ptr(self, a):
        return a.ctypes.data if a is not None and a.size else None

    def count(self, a):
        return a.size

    def sync(self):
        pass


class CupyMemory:
    """Arrays in GPU memory through CuPy, on its current stream."""

    name = "cupy"

    def __init__(self):
        import cupy
        self.cp = cupy
        self.stream = cupy.cuda.get_current_stream().ptr

    def put(self, a):
        return self.cp.asarray(np.ascontiguousarray(a))

    def get(self, a):
        return self.cp.asnumpy(a)

    def empty(self, shape, dtype):
        return self.cp.empty(shape, dtype)

    def zeros(self, shape, dtype):
        return self.cp.zeros(shape, dtype)

    def ptr(self, a):
        return a.data.ptr if a is not None and a.size else None

    def count(self, a):
        return a.size

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()


class TorchMemory:
    """Arrays in GPU memory through torch, on its current stream."""

    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self.stream = torch.cuda.current_stream().cuda_stream

    def put(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).cuda()

    def get(self, a):
        return a.cpu().numpy()

    def _dtype(self, dtype):
        # torch's uint64 has few kernels; the counters only need 64 bits.
        name = np.dtype(dtype).name
        return getattr(self.torch, "int64" if name == "uint64" else name)

    def empty(self, shape, dtype):
        return self.torch.empty(shape, dtype=self._dtype(dtype),
                                device="cuda")

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=self._dtype(dtype),
                                device="cuda")

    def ptr(self, a):
        return a.data_ptr() if a is not None and a.numel() else None

    def count(self, a):
        return a.numel()

    def sync(self):
        self.torch.cuda.synchronize()


@dataclasses.dataclass
class TableBatch:
    """One table of a group and its batch of ragged ids (numpy arrays).

    Args:
        table: `[vocab, dim]` float32 rows.
        ids: `[nnz]` int64 ids.
        splits: `[batch + 1]` int64 row splits, or None: one id per row.
        weights: `[nnz]` float32 per-id weights, or None.
        combiner: "sum", "mean" or "sqrtn" (pooled lookups).
        positions: `[nnz]` int64 column of each id (sequence lookups).
        seq_len: T of the `[batch, T, dim]` sequence output.
        slots: optimizer slots, `[vocab, dim]` float32 each.
    """
    table: np.ndarray
    ids: np.ndarray
    splits: Optional[np.ndarray] = None
    weights: Optional[np.ndarray] = None
    combiner: str = "sum"
    positions: Optional[np.ndarray] = None
    seq_len: int = 0
    slots: List[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def batch(self) -> int:
        return len(self.ids) if self.splits is None else len(self.splits) - 1


class GroupCall:
    """The core's calls on one group of tables, numpy in and out.

    Device copies of every input are made once (`put`) and kept, so a
    benchmark can time the calls alone (`launch_*` enqueue only).

    Args:
        core: a `Core`.
        memory: `HostMemory()` for the host stand-in, `CupyMemory()` or
            `TorchMemory()` for the CUDA core.
        tables: the group's `TableBatch`es; one `dim` for all.
        max_norm: clip rows to this L2 norm before pooling (< 0: off).
        concat: pooled output as one `[B, K * dim]` block (all batches
            equal) instead of one `[B, dim]` output per table.
    """

    def __init__(self, core, memory, tables, max_norm=-1.0, concat=False):
        self.core, self.mem = core, memory
        self.tables = tables
        self.dim = int(tables[0].table.shape[1])
        self.max_norm = float(max_norm)
        self.concat = concat
        self.sequence = tables[0].positions is not None
        m = memory
        self.dev = []
        for x in tables:
            self.dev.append({
                "table": m.put(x.table.astype(np.float32)),
                "ids": m.put(x.ids.astype(np.int64)),
                "splits": (None if x.splits is None
                           else m.put(x.splits.astype(np.int64))),
                "weights": (None if x.weights is None
                            else m.put(x.weights.astype(np.float32))),
                "positions": (None if x.positions is None
                              else m.put(x.positions.astype(np.int64))),
                "slots": [m.put(s.astype(np.float32)) for s in x.slots],
            })
        self.errors = m.zeros((2,), np.uint64)
        k, d = len(tables), self.dim
        if concat:
            self.out = m.zeros((tables[0].batch, k * d), np.float32)
        else:
            self.out = [m.zeros(self._block_shape(x), np.float32)
                        for x in tables]
        self.descs = (GeTable * k)()
        for t in range(k):
            self._describe(t)
        self.lookup_scratch = m.empty(
            (max(core.lib.ge_lookup_scratch_bytes(k), 1),), np.uint8)

    def _block_shape(self, x):
        if self.sequence:
            return (x.batch, x.seq_len, self.dim)
        return (x.batch, self.dim)

    def _out_block(self, t):
        """(pointer, row stride in floats) of table t's output block."""
        m, d = self.mem, self.dim
        if self.concat:
            base = m.ptr(self.out)
            return (base + 4 * t * d if base else None,
                    len(self.tables) * d)
        x = self.tables[t]
        stride = x.seq_len * d if self.sequence else d
        return m.ptr(self.out[t]), stride

    def _describe(self, t):
        x, dv, m, desc = self.tables[t], self.dev[t], self.mem, self.descs[t]
        desc.table = m.ptr(dv["table"])
        desc.vocab = x.table.shape[0]
        desc.ids = m.ptr(dv["ids"])
        desc.splits = m.ptr(dv["splits"])
        desc.weights = m.ptr(dv["weights"])
        desc.positions = m.ptr(dv["positions"])
        desc.nnz = len(x.ids)
        desc.batch = x.batch
        desc.seq_len = x.seq_len
        desc.combiner = COMBINERS[x.combiner]
        desc.out, desc.out_stride = self._out_block(t)
        slots = dv["slots"] + [None, None]
        desc.slot0 = m.ptr(slots[0])
        desc.slot1 = m.ptr(slots[1])

    def _check(self, name, status):
        self.core.check(name, status)

    def error_counts(self):
        """(bad ids, bad layout) counted by the calls so far."""
        e = self.mem.get(self.errors)
        return int(e[BAD_IDS]), int(e[BAD_LAYOUT])

    def clear_errors(self):
        self.errors = self.mem.zeros((2,), np.uint64)

    # -- forward -----------------------------------------------------------
    def launch_lookup(self):
        """Enqueues the lookup (pooled or sequence, as the tables are)."""
        fn = (self.core.lib.ge_lookup_sequence if self.sequence
              else self.core.lib.ge_lookup_pooled)
        self._check("lookup", fn(
            self.descs, len(self.tables), self.dim, self.max_norm,
            self.mem.ptr(self.lookup_scratch),
            self.mem.count(self.lookup_scratch),
            self.mem.ptr(self.errors), self.mem.stream))

    def lookup(self):
        """Runs the lookup; the outputs as numpy arrays."""
        self.launch_lookup()
        self.mem.sync()
        if self.concat:
            return self.mem.get(self.out)
        return [self.mem.get(o) for o in self.out]

    def check_ids(self):
        """Runs ge_check_ids on the group's ids (nothing else is read);
        the (bad ids, bad layout) counts it added."""
        before = self.error_counts()
        self._check("check_ids", self.core.lib.ge_check_ids(
            self.descs, len(self.tables), self.mem.ptr(self.lookup_scratch),
            self.mem.count(self.lookup_scratch), self.mem.ptr(self.errors),
            self.mem.stream))
        self.mem.sync()
        after = self.error_counts()
        return after[0] - before[0], after[1] - before[1]

    # -- backward ----------------------------------------------------------
    def set_grads(self, grads):
        """Device copies of the output gradients, laid out as the output
        (one array, or one per table); the descriptors point at them."""
        m, d, k = self.mem, self.dim, len(self.tables)
        if self.concat:
            self.grad_dev = m.put(np.asarray(grads, np.float32))
            base = m.ptr(self.grad_dev)
            for t in range(k):
                self.descs[t].grad = base + 4 * t * d if base else None
                self.descs[t].grad_stride = k * d
            return
        self.grad_dev = [m.put(np.asarray(g, np.float32)) for g in grads]
        for t, x in enumerate(self.tables):
            self.descs[t].grad = m.ptr(self.grad_dev[t])
            self.descs[t].grad_stride = (x.seq_len * d if self.sequence
                                         else d)

    def _backward_scratch(self):
        k = len(self.tables)
        size = self.core.lib.ge_backward_scratch_bytes(self.descs, k,
                                                       self.dim)
        if size == 0:
            raise CoreError("ge_backward_scratch_bytes refused the tables.")
        if getattr(self, "_bwd_scratch", None) is None or \
                self.mem.count(self._bwd_scratch) < size:
            self._bwd_scratch = self.mem.empty((size,), np.uint8)
        return self._bwd_scratch

    def _run_backward(self, name, uids, ugrads):
        """Calls ge_backward or ge_backward_padded (`name`) into the
        device arrays `uids` and `ugrads`; (offsets, ids, grads), numpy."""
        m, k = self.mem, len(self.tables)
        offsets = m.empty((k + 1,), np.int64)
        scratch = self._backward_scratch()
        self._check(name, getattr(self.core.lib, "ge_" + name)(
            self.descs, k, self.dim, self.max_norm, m.ptr(scratch),
            m.count(scratch), m.ptr(uids), m.ptr(ugrads), m.ptr(offsets),
            m.ptr(self.errors), m.stream))
        m.sync()
        return m.get(offsets), m.get(uids), m.get(ugrads)

    def backward(self):
        """Distinct ids and summed gradients per table:
        a list of (ids [u], grads [u, dim]) numpy pairs."""
        m = self.mem
        total = max(sum(len(x.ids) for x in self.tables), 1)
        off, ids, grads = self._run_backward(
            "backward", m.empty((total,), np.int64),
            m.empty((total, self.dim), np.float32))
        return [(ids[off[t]:off[t + 1]], grads[off[t]:off[t + 1]])
                for t in range(len(self.tables))]

    def backward_padded(self, fill_id=-7, fill_grad=123.0):
        """ge_backward_padded into outputs filled with `fill_id` and
        `fill_grad` first: per table (block ids [nnz], block grads
        [nnz, dim], distinct id count u), numpy."""
        m = self.mem
        sizes = [len(x.ids) for x in self.tables]
        total = max(sum(sizes), 1)
        off, ids, grads = self._run_backward(
            "backward_padded", m.put(np.full((total,), fill_id, np.int64)),
            m.put(np.full((total, self.dim), fill_grad, np.float32)))
        start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return [(ids[start[t]:start[t + 1]], grads[start[t]:start[t + 1]],
                 int(off[t + 1] - off[t])) for t in range(len(sizes))]

    def optimizer_config(self, name, **hyper):
        """A `GeOptimizerConfig` for optimizer `name` (sgd, adagrad, adam,
        ftrl) and its hyper-parameters (lr, epsilon, beta1, beta2, l1, l2,
        l2_shrinkage, lr_power)."""
        cfg = GeOptimizerConfig()
        cfg.kind = OPTIMIZERS[name]
        for key, value in hyper.items():
            setattr(cfg, key, float(value))
        return cfg

    def launch_backward_apply(self, config):
        """Enqueues the fused backward + sparse update (`config`: a
        `GeOptimizerConfig`) of the tables and slots in place."""
        m, k = self.mem, len(self.tables)
        scratch = self._backward_scratch()
        self._check("backward_apply", self.core.lib.ge_backward_apply(
            self.descs, k, self.dim, self.max_norm, ctypes.byref(config),
            m.ptr(scratch), m.count(scratch), m.ptr(self.errors), m.stream))

    def backward_apply(self, config):
        """Runs it; the updated (table, slots) of each table, numpy."""
        self.launch_backward_apply(config)
        self.mem.sync()
        return [(self.mem.get(dv["table"]),
                 [self.mem.get(s) for s in dv["slots"]]) for dv in self.dev]

    def weight_grads(self, pooled=None, by_position=False):
        """d loss / d weights of the weighted tables (None for others);
        `pooled`: the forward outputs (pooled mean / sqrtn tables);
        `by_position`: give the core each id's row, row j for id j (a
        snapshot of the rows, GE_ROWS_BY_POSITION) instead of the table."""
        m, k = self.mem, len(self.tables)
        outs = []
        keep = []
        for t, x in enumerate(self.tables):
            out = None
            if by_position:
                rows = m.put(x.table[np.clip(x.ids, 0, None)]
                             .astype(np.float32))
                keep.append(rows)
                self.descs[t].table = m.ptr(rows)
                self.descs[t].vocab = len(x.ids)
                self.descs[t].flags = ROWS_BY_POSITION
            if x.weights is not None:
                out = m.zeros((len(x.ids),), np.float32)
                self.descs[t].weight_grad = m.ptr(out)
                if pooled is not None and not self.sequence:
                    p = m.put(np.asarray(pooled[t], np.float32))
                    keep.append(p)
                    self.descs[t].pooled = m.ptr(p)
            outs.append(out)
        try:
            self._check("weight_grads", self.core.lib.ge_weight_grads(
                self.descs, k, self.dim, self.max_norm,
                m.ptr(self.lookup_scratch), m.count(self.lookup_scratch),
                m.ptr(self.errors), m.stream))
            m.sync()
        finally:
            if by_position:
                for t in range(k):
                    self._describe(t)
                    self.descs[t].flags = 0
        return [None if o is None else m.get(o) for o in outs]

    def clip_grads(self, unique_ids, grads, in_place=False):
        """The max_norm clip's backward of per-id gradient rows
        (`ge_clip_grads`): per table, `unique_ids[t]` ([u]) and their
        summed gradients `grads[t]` ([u, dim]), against the call's tables
        and `max_norm`; the clipped rows per table, numpy. `in_place`:
        the core writes over its input rows."""
        m, k, d = self.mem, len(self.tables), self.dim
        descs = (GeTable * k)()
        keep = []
        outs = []
        for t in range(k):
            ids = m.put(np.asarray(unique_ids[t], np.int64))
            # A copy: in place, the host stand-in would write the caller's.
            g = m.put(np.array(grads[t], np.float32).reshape(-1, d))
            out = g if in_place else m.zeros(g.shape, np.float32)
            keep += [ids, g]
            outs.append(out)
            desc = descs[t]
            desc.table = m.ptr(self.dev[t]["table"])
            desc.vocab = self.tables[t].table.shape[0]
            desc.ids = m.ptr(ids)
            desc.nnz = desc.batch = len(unique_ids[t])
            desc.grad, desc.grad_stride = m.ptr(g), d
            desc.out, desc.out_stride = m.ptr(out), d
        self._check("clip_grads", self.core.lib.ge_clip_grads(
            descs, k, d, self.max_norm, m.ptr(self.lookup_scratch),
            m.count(self.lookup_scratch), m.ptr(self.errors), m.stream))
        m.sync()
        return [m.get(o) for o in outs]
