"""Builds and loads the GPU kernels: the CUDA core of `ops/cuda/` and its
TensorFlow adaptor, linked into one library (`_group_embedding_gpu_ops`).

The library is built with a CUDA toolchain (PyPI's `nvidia-cuda-nvcc`, or
`nvcc` on the PATH / in /usr/local/cuda; `GROUP_EMBEDDING_NVCC` names one)
into the user cache of `kernel_library`, at install time (`pip install`)
or on first use, and only where it can run: a TensorFlow built with CUDA
that sees a GPU. It registers DEVICE_GPU kernels for the fused lookups and
their gradients, whose ops the C++ CPU library defines (loaded first).

Which lookups use it (`GROUP_EMBEDDING_KERNELS`, decided once in
`capabilities.current()`):

* `auto` (default): on a GPU, the GPU kernels when this library loads,
  else the pure-TF path; without a GPU, the C++ CPU kernels;
* `cuda`: the GPU kernels, or an error saying why they cannot be had;
* `custom`: the C++ CPU kernels (on a GPU machine: the pure-TF path);
* `tf`: the pure-TF path everywhere.

`python -m group_embedding` shows the status of both libraries.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any
from typing import Dict
from typing import List
from typing import Optional

import tensorflow as tf

from group_embedding.ops import config
from group_embedding.ops import kernel_library

CUDA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
CORE_SOURCES = ("lookup_kernels.cu", "backward_kernels.cu",
                "ev_table_kernels.cu")
# The TF adaptor: the plain-variable lookups, the HBM EV table.
ADAPTOR_SOURCES = ("tf_gpu_kernels.cc", "tf_ev_table_kernels.cc")
HOST_CORE_SOURCES = ("host_core.cc", "ev_table_host.cc")
# Compute capabilities of the fat binary (CUDA 13's lowest is 7.5), plus
# PTX of the last for newer GPUs. GROUP_EMBEDDING_CUDA_ARCHS overrides,
# e.g. "90" to build for H100 / H200 alone.
DEFAULT_ARCHS = config.DEFAULT_CUDA_ARCHS
_NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden")
_CXX_FLAGS = ("-O2", "-fPIC", "-w", "-DNDEBUG")
_PREFIX = "_group_embedding_gpu_ops_"
# Whether `auto` picks the GPU kernels: True since the core passed the GPU
# check (benchmarks/gpu/check.sh at fe7148a on an H200: every parity case,
# compute-sanitizer memcheck and racecheck clean; benchmarks/results/gpu/).
# An edit of ops/cuda/ should be checked there again before it ships.
GPU_KERNELS_BY_DEFAULT = True
_state: Dict[str, Any] = {"tried": False, "module": None, "error": None,
                          "path": None}
# The adaptor built against the host stand-in (tests): loaded once per
# process, since two copies would register the same ops twice.
_host_state: Dict[str, Any] = {"module": None, "path": None}
_gpus: List[bool] = []


def find_nvcc():
    """Path of a CUDA compiler, or None.

    Looks at `GROUP_EMBEDDING_NVCC`, PyPI's `nvidia-cuda-nvcc` (CUDA 13,
    in this Python's site-packages), the PATH and /usr/local/cuda.
    """
    explicit = config.nvcc()
    if explicit:
        return explicit
    for base in sys.path:
        candidate = os.path.join(base, "nvidia", "cu13", "bin", "nvcc")
        if os.path.isfile(candidate):
            return candidate
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.isfile(default) else None


def _cuda_lib_dir(nvcc):
    # PyPI's wheel has lib/, a CUDA install lib64/.
    root = os.path.dirname(os.path.dirname(os.path.abspath(nvcc)))
    for name in ("lib64", "lib"):
        path = os.path.join(root, name)
        if os.path.isfile(os.path.join(path, "libcudart_static.a")):
            return path
    return os.path.join(root, "lib")


def archs():
    """The compute capabilities to build for (`config.cuda_archs()`)."""
    return config.cuda_archs()


def _gencode(capabilities):
    flags = []
    for a in capabilities:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    last = capabilities[-1]
    return flags + ["-gencode", f"arch=compute_{last},code=compute_{last}"]


def sources_digest(capabilities=None):
    """sha256 (16 hex) of the CUDA folder's sources, flags and archs."""
    digest = hashlib.sha256()
    digest.update(" ".join(_NVCC_FLAGS + _CXX_FLAGS).encode())
    digest.update(",".join(capabilities or archs()).encode())
    for name in sorted(os.listdir(CUDA_DIR)):
        with open(os.path.join(CUDA_DIR, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    # The CPU kernels' headers the adaptor and the core include.
    for name in ("pooling.h", "table_access.h", "op_checks.h",
                 "hash_mix.h", "combiner_math.h"):
        with open(os.path.join(kernel_library._KERNEL_DIR, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def _run(cmd, what, verbose):
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              check=False)
    except FileNotFoundError as e:
        raise RuntimeError(f"{what}: {cmd[0]} not found") from e
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n"
                           + (proc.stdout + proc.stderr)[-4000:])


def compile_core_objects(objdir, nvcc=None, capabilities=None,
                         verbose=False):
    """Compiles the CUDA core's sources with nvcc; returns the objects.

    Raises:
        RuntimeError: no CUDA compiler, or a compilation failed.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError(
            "no CUDA compiler found: `pip install nvidia-cuda-nvcc==13.0.88 "
            "nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 "
            "nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88` (or set "
            "GROUP_EMBEDDING_NVCC)")
    gencode = _gencode(capabilities or archs())
    objects = []
    for src in CORE_SOURCES:
        obj = os.path.join(objdir, src + ".o")
        _run([nvcc, "-c"] + list(_NVCC_FLAGS) + gencode
             + [os.path.join(CUDA_DIR, src), "-o", obj],
             f"compiling {src}", verbose)
        objects.append(obj)
    return objects


def compile_core(path, nvcc=None, capabilities=None, verbose=False):
    """The core alone as a shared library with its C interface (what the
    ctypes bindings, `ops/cuda_core.py`, load)."""
    nvcc = nvcc or find_nvcc()
    with tempfile.TemporaryDirectory(prefix="ge_cuda_") as objdir:
        objects = compile_core_objects(objdir, nvcc, capabilities, verbose)
        tmp = f"{path}.tmp{os.getpid()}"
        _run([nvcc, "-shared"] + _gencode(capabilities or archs()) + objects
             + ["-L" + _cuda_lib_dir(nvcc), "-o", tmp], "linking the core",
             verbose)
        os.replace(tmp, path)
    return path


def compile_host_core(path, verbose=False):
    """The core's host stand-in as a shared library (g++)."""
    compiler = os.environ.get("CXX", "g++")
    tmp = f"{path}.tmp{os.getpid()}"
    _run([compiler, "-shared", "-std=c++17", "-fvisibility=hidden"]
         + list(_CXX_FLAGS)
         + [os.path.join(CUDA_DIR, src) for src in HOST_CORE_SOURCES]
         + ["-o", tmp],
         "compiling the host stand-in", verbose)
    os.replace(tmp, path)
    return path


def compile_tf_library(path, on_host=False, nvcc=None, capabilities=None,
                       verbose=False):
    """The TF adaptor linked with the core into one op library.

    Args:
        path: the library to write.
        on_host: build the test variant instead: the adaptor registered on
            DEVICE_CPU under the kernel label "ge_host_core", linked with
            the host stand-in (no CUDA needed).
        nvcc, capabilities: the CUDA compiler and archs (defaults above).
        verbose: print the commands.

    The link uses `--no-undefined` against this TensorFlow's framework
    library: a reference to a symbol it lacks (e.g. one that only the GPU
    build of TF exports) fails the build here instead of at load time.
    """
    compiler = os.environ.get("CXX", "g++")
    compile_flags = tf.sysconfig.get_compile_flags()
    with tempfile.TemporaryDirectory(prefix="ge_cuda_tf_") as objdir:
        adaptors = []
        for src in ADAPTOR_SOURCES:
            adaptors.append(os.path.join(objdir, src + ".o"))
            _run([compiler, "-c"] + list(_CXX_FLAGS)
                 + (["-DGE_ADAPTOR_ON_HOST"] if on_host else [])
                 + [os.path.join(CUDA_DIR, src), "-o", adaptors[-1]]
                 + compile_flags, f"compiling the TF adaptor ({src})",
                 verbose)
        if on_host:
            objects, runtime = [], []
            for src in HOST_CORE_SOURCES:
                objects.append(os.path.join(objdir, src + ".o"))
                _run([compiler, "-c", "-std=c++17", "-fvisibility=hidden"]
                     + list(_CXX_FLAGS)
                     + [os.path.join(CUDA_DIR, src), "-o", objects[-1]],
                     "compiling the host stand-in", verbose)
        else:
            nvcc = nvcc or find_nvcc()
            objects = compile_core_objects(objdir, nvcc, capabilities,
                                           verbose)
            # The static CUDA runtime: nothing to find at load time.
            runtime = ["-L" + _cuda_lib_dir(nvcc), "-l:libcudart_static.a",
                       "-ldl", "-lrt", "-lpthread"]
        tmp = f"{path}.tmp{os.getpid()}"
        _run([compiler, "-shared"] + adaptors + objects + ["-o", tmp]
             + tf.sysconfig.get_link_flags() + runtime
             + ["-Wl,--no-undefined"], "linking the GPU op library",
             verbose)
        os.replace(tmp, path)
    return path


def gpu_present() -> bool:
    """Whether TF sees a GPU; probed once per process.

    Logical devices, as placement sees them: a GPU hidden with
    `tf.config.set_visible_devices` does not count.
    """
    if not _gpus:
        _gpus.append(bool(tf.config.list_logical_devices("GPU")))
    return _gpus[0]


def can_run():
    """Why the GPU kernels cannot run here, or None if they can."""
    if not tf.test.is_built_with_cuda():
        return "this TensorFlow is not built with CUDA"
    if not gpu_present():
        return "TensorFlow sees no GPU"
    return None


def build(verbose=False):
    """Builds the library into the user cache (if not there); its path.

    Raises:
        RuntimeError: no CUDA compiler, or the build failed.
    """
    folder = config.cache_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{_PREFIX}tf{tf.__version__}_"
                                f"{sources_digest()}.so")
    if not os.path.exists(path):
        compile_tf_library(path, verbose=verbose)
    return path


def library() -> Any:
    """The loaded GPU op library, or None (and why: `unavailable_reason`).

    Loaded at most once per process, after the C++ CPU library (which
    defines the ops); never where `can_run()` says no.
    """
    if not _state["tried"]:
        _state["tried"] = True
        reason = can_run()
        if reason is None and kernel_library.library() is None:
            reason = ("the C++ kernels, which define the ops, are "
                      "unavailable")
        if reason is None:
            try:
                _state["path"] = build()
                _state["module"] = tf.load_op_library(_state["path"])
            except Exception as e:  # noqa: BLE001 - any failure: fall back
                reason = str(e)
                warnings.warn(
                    "group-embedding GPU kernels unavailable; GPU lookups "
                    f"run the pure-TF path. Reason: {e}", RuntimeWarning,
                    stacklevel=2)
        _state["error"] = reason
    return _state["module"]


def unavailable_reason() -> Optional[str]:
    """Why the GPU library is not loaded, or None."""
    return _state["error"]


def status():
    """The GPU library's state, as a dict (loaded, path, error, nvcc)."""
    module = library()
    return {"loaded": module is not None, "path": _state["path"],
            "error": _state["error"], "nvcc": find_nvcc(),
            "built_with_cuda": tf.test.is_built_with_cuda()}


def host_stand_in_library(verbose=False) -> Any:
    """The TF adaptor built against the core's host stand-in
    (`compile_tf_library(on_host=True)`), cached and loaded once per
    process; what CPU-only CI runs the GPU ops through (the plain
    lookups under the kernel label "ge_host_core", the HBM EV ops on
    DEVICE_CPU). Its path is `host_stand_in_path()`.

    Raises:
        RuntimeError: the C++ CPU kernels (which define the shared ops)
            or the build failed.
    """
    if _host_state["module"] is None:
        if kernel_library.library() is None:
            raise RuntimeError(
                "the C++ kernels, which define the ops, are unavailable: "
                f"{kernel_library.unavailable_reason()}")
        folder = config.cache_dir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{_PREFIX}host_tf{tf.__version__}_"
                                    f"{sources_digest(['host'])}.so")
        if not os.path.exists(path):
            compile_tf_library(path, on_host=True, verbose=verbose)
        _host_state["module"] = tf.load_op_library(path)
        _host_state["path"] = path
    return _host_state["module"]


def host_stand_in_path() -> Optional[str]:
    """Where the loaded host stand-in library is, or None."""
    return _host_state["path"]


def host_stand_in_waits() -> int:
    """How many times the loaded host stand-in has synchronised a stream
    so far (what a GPU op waits for; tests count the waits of a step).

    Raises:
        RuntimeError: no host stand-in is loaded.
    """
    path = host_stand_in_path()
    if path is None:
        raise RuntimeError("no host stand-in is loaded.")
    lib = ctypes.CDLL(path)
    lib.ge_host_synchronize_calls.restype = ctypes.c_longlong
    return int(lib.ge_host_synchronize_calls())


def build_at_install(verbose=False):
    """What `pip install` runs: builds the library where it can run and a
    CUDA compiler is found; returns a line saying what happened."""
    reason = None if tf.test.is_built_with_cuda() else \
        "this TensorFlow is not built with CUDA"
    if reason is None and find_nvcc() is None:
        reason = "no CUDA compiler found"
    if reason is not None:
        return f"GPU kernels not built: {reason}"
    try:
        return f"GPU kernels: {build(verbose)}"
    except RuntimeError as e:
        return f"WARNING: GPU kernels not built now ({e}); tried on use."


def _main(argv):
    print(build_at_install(verbose="-v" in argv))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
