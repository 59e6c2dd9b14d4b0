"""Builds and loads the C++ kernels of `ops/kernels/`.

The kernels are compiled against the installed TensorFlow with the flags of
`tf.sysconfig`, once: by `scripts/setup.sh` (or `python -m
group_embedding.ops.kernel_library`) at install time, else on first use.
When no compiler is available or the build fails, `load()` returns None and
the lookup runs its pure-TF path, which is always correct (and is the path
used on GPU).

Set `GROUP_EMBEDDING_KERNELS=tf` to force the pure-TF path, `=custom` to
require the C++ kernels (an error instead of the fallback).
"""

import fcntl
import hashlib
import os
import subprocess
import sys
import warnings

import tensorflow as tf

KERNEL_MODES = ("auto", "custom", "tf")
_SOURCES = ("group_embedding_ops.cc", "embedding_variable_ops.cc",
            "ev_apply_ops.cc", "ev_lookup_ops.cc")
_HEADERS = ("pooling.h", "ev_storage.h")
_KERNEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "kernels")
_state = {"loaded": False, "module": None, "error": None}


def kernel_mode():
    """Returns the kernel mode from `GROUP_EMBEDDING_KERNELS` (auto)."""
    mode = os.environ.get("GROUP_EMBEDDING_KERNELS", "auto").lower()
    if mode not in KERNEL_MODES:
        raise ValueError(
            f"Invalid `GROUP_EMBEDDING_KERNELS`: {mode!r}, use one of "
            f"{', '.join(KERNEL_MODES)}.")
    return mode


def _library_path():
    # The name carries a hash of the sources and TF version, so an upgrade
    # of either triggers a rebuild instead of loading a stale binary.
    digest = hashlib.sha1(tf.__version__.encode())
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_KERNEL_DIR, name), "rb") as f:
            digest.update(f.read())
    name = f"_group_embedding_ops_{digest.hexdigest()[:12]}.so"
    if os.access(_KERNEL_DIR, os.W_OK):
        return os.path.join(_KERNEL_DIR, name)
    cache = os.path.join(os.path.expanduser("~"), ".cache",
                         "group_embedding")
    os.makedirs(cache, exist_ok=True)
    return os.path.join(cache, name)


@tf.autograph.experimental.do_not_convert
def build(verbose=False):
    """Compiles the kernels if needed and returns the library path."""
    path = _library_path()
    with open(path + ".lock", "w") as lock:
        # Several processes (horovodrun workers) may start at once.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        cmd = (["g++", "-O3", "-march=native", "-shared", "-fPIC", "-w"]
               + [os.path.join(_KERNEL_DIR, s) for s in _SOURCES]
               + ["-o", path + ".tmp"]
               + tf.sysconfig.get_compile_flags()
               + tf.sysconfig.get_link_flags())
        if verbose:
            print(" ".join(cmd), file=sys.stderr)
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError("Building the group-embedding kernels failed:\n"
                               + result.stderr[-4000:])
        os.replace(path + ".tmp", path)
        _remove_stale(path)
    return path


def _remove_stale(current):
    # Builds of older sources are never loaded again.
    folder = os.path.dirname(current)
    for name in os.listdir(folder):
        full = os.path.join(folder, name)
        if (name.startswith("_group_embedding_ops_") and full != current
                and not full.startswith(current)):
            try:
                os.remove(full)
            except OSError:
                pass


@tf.autograph.experimental.do_not_convert
def library():
    """The kernel module whatever the mode, or None if it cannot be built.

    Gradients of ops that already ran with the kernels use this, so that
    switching the mode between forward and backward cannot break them.
    """
    if not _state["loaded"]:
        _state["loaded"] = True
        try:
            _state["module"] = tf.load_op_library(build())
        except Exception as e:  # noqa: BLE001 - any failure means fallback
            _state["error"] = e
            warnings.warn(f"group-embedding C++ kernels unavailable, using "
                          f"the pure-TF path: {e}")
    return _state["module"]


@tf.autograph.experimental.do_not_convert
def load():
    """Returns the loaded kernel module, or None for the pure-TF path.

    The mode is read on every call, so tests (and users) can switch paths
    by setting `GROUP_EMBEDDING_KERNELS` between lookups.
    """
    mode = kernel_mode()
    if mode == "tf":
        return None
    module = library()
    if module is None and mode == "custom":
        raise RuntimeError("GROUP_EMBEDDING_KERNELS=custom but the C++ "
                           f"kernels could not be built: {_state['error']}")
    return module


if __name__ == "__main__":
    print(build(verbose="-v" in sys.argv))
