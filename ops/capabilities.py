"""What this process can run, decided once: a frozen `Capabilities`.

Whether the C++ kernels are loaded, whether TF sees a GPU, whether the GPU
kernels are loaded and which ops they have kernels for, whether a
SavedModel is being saved, which op families a (possibly older, cached)
kernel library holds: each is asked here, once per process and per
(kernel mode, save context), and the answer is carried as a value. The
lookup plan (`group_embedding/lookup_plan.py`) reads it to pick each
group's backend; the id conversion, the sparse updates and the collective
layer read the same snapshot instead of probing again.

`current()` keys the snapshot on `GROUP_EMBEDDING_KERNELS` (read through
`config`, which tests and users switch between lookups) and on whether a
SavedModel save is in progress (a SavedModel holds stock ops only, so
inside a save the kernels count as absent). Everything else is a fact of
the process: the libraries load at most once, and the GPU is probed once.

Why in `ops/` (installed as `group_embedding.ops`): the snapshot is built
from the kernel libraries of `ops/` and read by `ops/` itself, by the
lookup core and by `group_embedding/distributed/`; the lowest layer is the
one all of them may import without a cycle.

New backends add their question here (see `gpu_ev_ops`): a field filled
in `_probe` and read where the plan decides.
"""

import dataclasses
from typing import Any
from typing import Callable
from typing import Dict
from typing import FrozenSet
from typing import List
from typing import Optional
from typing import Sequence
from typing import Set
from typing import Tuple
from typing import TypeVar
from typing import cast

import tensorflow as tf
from tensorflow.python.framework import kernels as tf_kernels
from tensorflow.python.saved_model import save_context

from group_embedding.ops import config
from group_embedding.ops import gpu_kernel_library
from group_embedding.ops import kernel_library
from group_embedding.ops import op_names
from group_embedding.ops.config import KernelMode

# Ops whose presence marks an op family; a kernel library compiled before
# the family existed (an old cached build) lacks them.
ROUTING_OP = "GroupEmbeddingCollectiveRouteIds"
PEER_EXCHANGE_OP = "GroupEmbeddingPeerAllToAll"
# The HBM EmbeddingVariable's fused lookup (ops/cuda/tf_ev_table_kernels.cc):
# its kernel marks a GPU library that serves HBM EVs.
GPU_EV_OP = "GroupEmbeddingHbmEVLookup"
HBM_EV_PREFIX = "GroupEmbeddingHbmEV"


@dataclasses.dataclass(frozen=True)
class HbmEvSupport:
    """What serves `StorageType.HBM` EmbeddingVariables in this process.

    Attributes:
        module: the op module with the HBM EV ops (the GPU library where
            TF sees a GPU; the adaptor built against the core's host
            stand-in under `GROUP_EMBEDDING_HBM_ON_HOST=1`, tests only),
            or None.
        on_host: `module` is the host stand-in.
        error: why there is no module, or None.
    """

    module: Any
    on_host: bool
    error: Optional[str]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """One frozen answer to "what can run here".

    Attributes:
        mode: the `GROUP_EMBEDDING_KERNELS` mode it was made for.
        in_save: made inside a SavedModel save (kernels count as absent).
        kernels: the C++ kernel module that new ops are built with, or None
            for the pure-TF path (mode `tf`, inside a save, or the library
            could not be built).
        gpu: TF sees a GPU (logical devices: a hidden one does not count).
        gpu_kernels: the GPU kernel module, or None: no GPU, a mode that
            does not use them (`tf`, `custom`), or it could not be loaded.
        gpu_kernels_error: why a GPU that the mode would use has no GPU
            kernels, or None.
        kernel_ops: the library's op names that have a CPU kernel (empty
            without `kernels`).
        gpu_ops: the library's op names that have a GPU kernel (empty
            without `gpu_kernels`).
        hbm_ev: what serves HBM EVs (`hbm_ev_support()`), or None while
            no HBM EV was created in this process (nothing probed).
    """

    mode: KernelMode
    in_save: bool
    kernels: Any
    gpu: bool
    gpu_kernels: Any
    gpu_kernels_error: Optional[str]
    kernel_ops: FrozenSet[str]
    gpu_ops: FrozenSet[str]
    hbm_ev: Optional[HbmEvSupport] = None

    @property
    def collective_routing(self) -> bool:
        """The kernels hold the collective routing ops
        (`ops/collective_routing.py`)."""
        return ROUTING_OP in self.kernel_ops

    @property
    def peer_exchange(self) -> bool:
        """The kernels hold the peer transport's exchange op
        (`ops/peer_exchange.py`)."""
        return PEER_EXCHANGE_OP in self.kernel_ops

    @property
    def gpu_ev_ops(self) -> bool:
        """The GPU kernels serve HBM EmbeddingVariable lookups."""
        return GPU_EV_OP in self.gpu_ops

    def hbm_ev_module(self, names: Sequence[str]) -> Any:
        """The op module that serves the HBM EVs `names` (how errors
        name them).

        Raises:
            RuntimeError: none here, naming the EVs and why.
        """
        support = self.hbm_ev or hbm_ev_support()
        if support.module is None:
            raise RuntimeError(
                f"{', '.join(names)}: StorageType.HBM needs the GPU "
                f"kernels: {support.error}")
        return support.module

    def use_gpu_kernels(self) -> bool:
        """Whether GPU lookups of plain variables go to the GPU kernels.

        Raises:
            RuntimeError: `GROUP_EMBEDDING_KERNELS=cuda` on a GPU but the
                GPU kernels cannot be had (with the reason).
        """
        if (self.mode == KernelMode.CUDA and self.gpu
                and self.gpu_kernels is None):
            raise RuntimeError("GROUP_EMBEDDING_KERNELS=cuda but the GPU "
                               "kernels cannot be used: "
                               f"{self.gpu_kernels_error}")
        return self.gpu_kernels is not None


_F = TypeVar("_F", bound=Callable[..., Any])


def not_converted(function: _F) -> _F:
    """`tf.autograph.experimental.do_not_convert`, typed for mypy.

    For plain Python called on every traced lookup: autograph converting
    it (and what it calls) cost ~25% of a lookup's tracing time for
    nothing.
    """
    return cast(_F, tf.autograph.experimental.do_not_convert(function))


_snapshots: Dict[Tuple[KernelMode, bool, bool], Capabilities] = {}
_library_ops: List[FrozenSet[str]] = []
# GROUP_EMBEDDING_HBM_ON_HOST -> what serves HBM EVs, probed on the first
# HBM EV (so that processes without one never build the GPU library).
_hbm_support: Dict[bool, HbmEvSupport] = {}


@not_converted
def current() -> Capabilities:
    """The snapshot for the current kernel mode and save context.

    Made on first use for that pair, then reused.

    Raises:
        ValueError: an invalid `GROUP_EMBEDDING_KERNELS`.
        RuntimeError: `GROUP_EMBEDDING_KERNELS` is `custom` or `cuda` but
            the C++ kernels could not be built (outside a save; nothing is
            kept, so every call says so).
    """
    key = (config.kernel_mode(), save_context.in_save_context(),
           config.hbm_on_host())
    snapshot = _snapshots.get(key)
    if snapshot is None:
        snapshot = _snapshots[key] = _probe(*key)
    return snapshot


def hbm_ev_support() -> HbmEvSupport:
    """What serves HBM EmbeddingVariables here, probed once per process
    (and per `GROUP_EMBEDDING_HBM_ON_HOST`): the GPU library where TF sees
    a GPU, whatever `GROUP_EMBEDDING_KERNELS` says (an HBM table has no
    other path); else, with `GROUP_EMBEDDING_HBM_ON_HOST=1`, the adaptor
    built against the host stand-in; else nothing, and why. Snapshots
    made before the probe are dropped, so the next `current()` holds it.
    """
    on_host = config.hbm_on_host()
    found = _hbm_support.get(on_host)
    if found is not None:
        return found
    module, error, stand_in = None, None, False
    if gpu_kernel_library.gpu_present():
        module = gpu_kernel_library.library()
        if module is None:
            error = gpu_kernel_library.unavailable_reason()
        elif GPU_EV_OP not in _registered_ops()[1]:
            module, error = None, ("the loaded GPU kernel library has no "
                                   "HBM EV ops (an older build)")
    elif on_host:
        stand_in = True
        try:
            module = gpu_kernel_library.host_stand_in_library()
        except RuntimeError as e:
            error = f"the host stand-in could not be built: {e}"
    else:
        error = ("TensorFlow sees no GPU, and an HBM table has no CPU "
                 "fallback; use StorageType.DRAM on this machine (tests "
                 f"set {config.HBM_ON_HOST}=1 to run HBM EVs on the CUDA "
                 "core's host stand-in)")
    found = _hbm_support[on_host] = HbmEvSupport(module, stand_in, error)
    _snapshots.clear()
    return found


def _probe(mode: KernelMode, in_save: bool,
           hbm_on_host: bool = False) -> Capabilities:
    kernels = None
    if mode != KernelMode.TF and not in_save:
        kernels = kernel_library.library()
        if kernels is None and mode in (KernelMode.CUSTOM, KernelMode.CUDA):
            raise RuntimeError(
                f"GROUP_EMBEDDING_KERNELS={mode} but the C++ kernels could "
                f"not be built: {kernel_library.unavailable_reason()}")
    gpu = gpu_kernel_library.gpu_present()
    gpu_kernels, gpu_error = None, None
    if gpu and (mode == KernelMode.CUDA or (
            mode == KernelMode.AUTO
            and gpu_kernel_library.GPU_KERNELS_BY_DEFAULT)):
        gpu_kernels = gpu_kernel_library.library()
        if gpu_kernels is None:
            gpu_error = gpu_kernel_library.unavailable_reason()
    return Capabilities(
        mode=mode, in_save=in_save, kernels=kernels, gpu=gpu,
        gpu_kernels=gpu_kernels, gpu_kernels_error=gpu_error,
        kernel_ops=library_ops() if kernels is not None else frozenset(),
        gpu_ops=(_registered_ops()[1] if gpu_kernels is not None
                 else frozenset()),
        hbm_ev=_hbm_support.get(hbm_on_host))


def _registered_ops() -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """This library's op names with a CPU kernel, and with a GPU kernel,
    as TF's kernel registry lists them (what the loaded libraries
    registered: an older build lacks its newer ops)."""
    cpu: Set[str] = set()
    gpu: Set[str] = set()
    for k in tf_kernels.get_all_registered_kernels().kernel:
        if not k.op.startswith(op_names.PREFIX):
            continue
        if k.device_type == "CPU" and k.op.startswith(HBM_EV_PREFIX):
            # The GPU library's HBM EV ops, registered on the CPU by its
            # host stand-in (tests): not the C++ CPU library's.
            continue
        if k.device_type == "CPU":
            cpu.add(k.op)
        elif k.device_type == "GPU":
            gpu.add(k.op)
    return frozenset(cpu), frozenset(gpu)


def library_ops() -> FrozenSet[str]:
    """The op names the C++ kernel library registered CPU kernels for,
    whatever the kernel mode (gradients of ops that already ran use the
    library in any mode); empty when it cannot be loaded. Found once per
    process."""
    if not _library_ops:
        loaded = kernel_library.library() is not None
        _library_ops.append(_registered_ops()[0] if loaded else frozenset())
    return _library_ops[0]
