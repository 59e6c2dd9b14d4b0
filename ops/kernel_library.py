"""Builds, verifies and loads the C++ kernels of `ops/kernels/`.

Where the kernel library comes from, first match wins:

1. The copy shipped in the package (`group_embedding/ops/
   _group_embedding_ops*.so` and its record `_group_embedding_ops.json`),
   compiled by `setup.py build_ext` when a wheel is built (`pip wheel .`,
   `pip install .`). It is used when its record names the running
   TensorFlow version and the shipped sources, and its size and sha256
   match the record.
2. The user cache (`config.cache_dir()`: `GROUP_EMBEDDING_CACHE` or else
   `$XDG_CACHE_HOME/group_embedding`, `~/.cache/group_embedding`): compiled
   there on first use (or by `python -m group_embedding.ops.kernel_library`)
   for a TensorFlow version the package was not built for, for an editable
   install (the repository; `pip install -e .` compiles it at install
   time) and after an edit of the C++ sources. Never next to the sources,
   which may sit in a read-only site-packages.

Every library is compiled to a temporary name, renamed into place, and
only then given its record (size + sha256); a library without a matching
record (a crashed build, a truncated file) is rebuilt, never loaded, since
`tf.load_op_library` on a truncated file dies of SIGBUS.

When the kernels cannot be had (no compiler, a failed build), `library()`
warns once with the reason and the command that shows the details;
lookups then run their pure-TF path (slow on CPU, the path used on GPU)
and EmbeddingVariables, which need the kernels, fail.

Set `GROUP_EMBEDDING_KERNELS=tf` to force the pure-TF path, `=custom` to
require the C++ kernels (an error instead of the fallback), `=cuda` to
require the GPU kernels on a GPU (see `gpu_kernel_library`). Which kernels
a lookup uses is decided by `capabilities.current()` from that mode and
`library()`; this module only builds and loads.
"""

import fcntl
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any
from typing import Dict
from typing import Optional

import tensorflow as tf

from group_embedding.ops import config

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_KERNEL_DIR = os.path.join(_PACKAGE_DIR, "kernels")
# Every source of the folder goes into the one library (a new kernel file
# needs no edit here); the wheel ships the same globs.
_SOURCES = tuple(sorted(n for n in os.listdir(_KERNEL_DIR)
                        if n.endswith(".cc")))
_HEADERS = tuple(sorted(n for n in os.listdir(_KERNEL_DIR)
                        if n.endswith(".h")))
# NDEBUG as in TF's own release build: without it, TF's and Eigen's debug
# checks stay in the inlined accessors of every hot loop.
_FLAGS = ("-O3", "-fPIC", "-w", "-DNDEBUG", "-fno-math-errno")
# Record of the library that `setup.py build_ext` puts into the package.
PACKAGED_RECORD = os.path.join(_PACKAGE_DIR, "_group_embedding_ops.json")
_PREFIX = "_group_embedding_ops_"
# Cached builds kept per cache folder: several checkouts (or TF versions)
# may share one cache without rebuilding each other's library every time.
_KEEP = 4
DIAGNOSE_COMMAND = "python -m group_embedding.ops.kernel_library -v"
_state: Dict[str, Any] = {"loaded": False, "module": None, "error": None,
                          "path": None}


def sources_digest():
    """sha256 (hex, 16 chars) of the kernel sources, headers and flags."""
    digest = hashlib.sha256()
    digest.update(" ".join(_FLAGS).encode() + b"\0")
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_KERNEL_DIR, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path, data):
    # Atomic too: a half-written record must not look like a valid one.
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _run_compiler(cmd, verbose):
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError as e:
        raise RuntimeError(
            f"no C++ compiler ({cmd[0]} not found); install one, e.g. "
            "`apt-get install g++`") from e


def _native_flags(compiler):
    """`-march=native`, without AVX512-FP16 where the compiler knows it.

    On a CPU with AVX512-FP16 (Sapphire Rapids), `-march=native` makes
    GCC 12 compile Eigen's FP16 packet math, which TF 2.21's Eigen headers
    fail to build ("expected initializer before '<'" in
    PacketMathFP16.h); the kernels use no FP16 arithmetic.
    """
    flags = ["-march=native"]
    try:
        probe = subprocess.run(
            [compiler, "-mno-avx512fp16", "-x", "c++", "-E", "-o",
             os.devnull, os.devnull], capture_output=True, check=False)
    except FileNotFoundError:
        return flags
    if probe.returncode == 0:
        flags.append("-mno-avx512fp16")
    return flags


def compile_library(path, record_path, native=True, verbose=False):
    """Compiles the kernels into `path` and writes its record.

    The objects are compiled in parallel in a temporary folder, linked to a
    temporary name next to `path` and renamed into place; the record
    (`record_path`: file name, size, sha256, TF version, sources digest)
    is written last, so an interrupted build leaves no valid-looking
    library behind.

    Args:
        path: the library to write.
        record_path: its JSON record.
        native: compile for this CPU (`-march=native`); False gives a
            portable library, as a wheel needs.
        verbose: print the compiler commands to stderr.

    Returns:
        The record (a dict).

    Raises:
        RuntimeError: no compiler, or the build failed (with its output).
    """
    compiler = os.environ.get("CXX", "g++")
    flags = list(_FLAGS) + (_native_flags(compiler) if native else [])
    compile_flags = tf.sysconfig.get_compile_flags()
    jobs = max(1, min(len(_SOURCES), len(os.sched_getaffinity(0))))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="ge_kernels_") as objdir:
        objects, pending = [], list(_SOURCES)
        running = []
        while pending or running:
            # At most `jobs` compilers at once: each takes ~1 GB of memory.
            while pending and len(running) < jobs:
                src = pending.pop(0)
                obj = os.path.join(objdir, src + ".o")
                objects.append(obj)
                cmd = ([compiler, "-c"] + flags
                       + [os.path.join(_KERNEL_DIR, src), "-o", obj]
                       + compile_flags)
                running.append((src, _run_compiler(cmd, verbose)))
            src, proc = running.pop(0)
            output = proc.communicate()[0]
            if proc.returncode != 0:
                for _, other in running:
                    other.kill()
                    other.wait()
                raise RuntimeError(f"compiling {src} failed:\n"
                                   + output[-4000:])
        cmd = ([compiler, "-shared"] + flags + objects + ["-o", tmp]
               + tf.sysconfig.get_link_flags())
        proc = _run_compiler(cmd, verbose)
        output = proc.communicate()[0]
        if proc.returncode != 0:
            _remove(tmp)
            raise RuntimeError("linking the kernels failed:\n"
                               + output[-4000:])
    record = {"file": os.path.basename(path),
              "size": os.path.getsize(tmp), "sha256": _sha256(tmp),
              "tensorflow": tf.__version__, "sources": sources_digest(),
              "native": bool(native)}
    os.replace(tmp, path)
    _write_json(record_path, record)
    return record


def verify(path, record_path):
    """Why the library at `path` must not be loaded, or None if it may.

    It may when `record_path` exists and names this file, the running
    TensorFlow version and the current sources, and the file's size and
    sha256 match it.
    """
    try:
        with open(record_path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return "no valid build record"
    if not os.path.exists(path):
        return f"{path} is missing"
    if record.get("file") != os.path.basename(path):
        return "the record names another file"
    if record.get("tensorflow") != tf.__version__:
        return (f"built for TensorFlow {record.get('tensorflow')}, running "
                f"{tf.__version__}")
    if record.get("sources") != sources_digest():
        return "built from other kernel sources"
    size = os.path.getsize(path)
    if size != record.get("size"):
        return f"size {size} != recorded {record.get('size')} (truncated?)"
    if _sha256(path) != record.get("sha256"):
        return "sha256 differs from the record (corrupt file)"
    return None


def _packaged():
    # (path, None) when the shipped library may be loaded, else (None, why).
    try:
        with open(PACKAGED_RECORD) as f:
            name = json.load(f).get("file", "")
    except (OSError, ValueError):
        return None, None  # editable install / repository: nothing shipped
    path = os.path.join(_PACKAGE_DIR, os.path.basename(name))
    problem = verify(path, PACKAGED_RECORD)
    if problem:
        return None, f"packaged kernels not usable: {problem}"
    return path, None


def cache_path():
    """The library's path in the user cache (it may not exist yet)."""
    name = f"{_PREFIX}tf{tf.__version__}_{sources_digest()[:12]}.so"
    return os.path.join(config.cache_dir(), name)


def _record_of(path):
    return path[:-len(".so")] + ".json"


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


@tf.autograph.experimental.do_not_convert
def build(verbose=False, use_packaged=True):
    """Returns the path of a verified kernel library, compiling if needed.

    The packaged library when it fits the running TensorFlow and sources;
    else the user-cache one, compiled (under a file lock: several
    processes, e.g. horovodrun workers, may start at once) when it is
    missing, stale or corrupt. `use_packaged=False` skips the packaged
    library (for one TensorFlow refuses to load).

    Raises:
        RuntimeError: the kernels cannot be compiled (the reason included).
    """
    path, why_not_packaged = _packaged() if use_packaged else (None, None)
    if path:
        return path
    if verbose and why_not_packaged:
        print(why_not_packaged, file=sys.stderr)
    path = cache_path()
    record = _record_of(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            problem = verify(path, record)
            if problem is None:
                return path
            if os.path.exists(path):
                # A truncated or foreign file: rebuild rather than load it.
                if verbose:
                    print(f"rebuilding {path}: {problem}", file=sys.stderr)
                _remove(record)
                _remove(path)
            compile_library(path, record, native=True, verbose=verbose)
            try:
                _remove_stale(path)
            except OSError:
                pass  # another process cleaning up at the same time
    except (OSError, RuntimeError) as e:
        prefix = f"{why_not_packaged}; " if why_not_packaged else ""
        raise RuntimeError(f"{prefix}building the kernels into {path} "
                           f"failed: {e}") from e
    return path


def _remove_stale(current):
    # Keeps the newest few builds (other checkouts may use them) and drops
    # temporaries of crashed builds.
    folder = os.path.dirname(current)
    builds = [p for p in glob.glob(os.path.join(folder, _PREFIX + "*.so"))
              if p != current]
    builds.sort(key=lambda p: os.path.getmtime(p), reverse=True)
    for old in builds[_KEEP - 1:]:
        for p in (old, _record_of(old), old + ".lock"):
            _remove(p)
    for tmp in glob.glob(os.path.join(folder, _PREFIX + "*.tmp*")):
        if time.time() - os.path.getmtime(tmp) > 3600:
            _remove(tmp)


@tf.autograph.experimental.do_not_convert
def library():
    """The kernel module whatever the mode, or None if it cannot be built.

    Gradients of ops that already ran with the kernels use this, so that
    switching the mode between forward and backward cannot break them.
    The first failure warns once with the reason.
    """
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            path = build()
            try:
                module = tf.load_op_library(path)
            except Exception:  # noqa: BLE001 - e.g. another TF build's ABI
                if os.path.dirname(path) != _PACKAGE_DIR:
                    raise
                path = build(use_packaged=False)
                module = tf.load_op_library(path)
            _state["module"], _state["path"] = module, path
        except Exception as e:  # noqa: BLE001 - any failure means fallback
            _state["error"] = str(e)
            warnings.warn(
                "group-embedding C++ kernels unavailable, so lookups run the "
                "slow pure-TF path and EmbeddingVariables cannot be used. "
                f"Reason: {e}\nRun `{DIAGNOSE_COMMAND}` to see the build.",
                RuntimeWarning, stacklevel=3)
    return _state["module"]


def unavailable_reason() -> Optional[str]:
    """Why the kernels could not be loaded, or None (loaded / not tried)."""
    return _state["error"]


def status():
    """Loads the kernels (if not done) and describes them, as a dict.

    Keys: mode, loaded (bool), path, origin ("package" / "cache" / None),
    built_for (TF version of the library), error (or None).
    """
    module = library()
    info = {"mode": config.kernel_mode(), "loaded": module is not None,
            "path": _state["path"], "origin": None, "built_for": None,
            "error": _state["error"]}
    if module is not None:
        packaged = os.path.dirname(_state["path"]) == _PACKAGE_DIR
        info["origin"] = "package" if packaged else "cache"
        record = PACKAGED_RECORD if packaged else _record_of(_state["path"])
        try:
            with open(record) as f:
                info["built_for"] = json.load(f).get("tensorflow")
        except (OSError, ValueError):
            pass
    return info


def _main(argv):
    try:
        print(build(verbose="-v" in argv))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
