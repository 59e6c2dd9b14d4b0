#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (TensorFlow + Gloo, CPU only, no MPI) into a venv.
# Usage: scripts/build_horovod.sh [PYTHON]   (default: $PYTHON or <repo>/.venv/bin/python)
# Idempotent: exits 0 at once if a working horovod 0.28.1 is already installed.
set -euo pipefail

HVD_VERSION=0.28.1
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-${PYTHON:-$REPO_ROOT/.venv/bin/python}}"
BUILD_ROOT="${HVD_BUILD_DIR:-/tmp/horovod-build}"   # sdist, patched sources and log live here
LOG="$BUILD_ROOT/build.log"

[ -x "$PY" ] || { echo "build_horovod: python '$PY' not found/executable" >&2; exit 2; }
# Make the venv's tools (pip, horovodrun) visible, but keep /usr/bin ahead of it so a
# pip-installed cmake 4.x in the venv cannot shadow the system one (cmake 4 rejects
# Gloo's old cmake_minimum_required).
PATH="/usr/bin:/bin:$(dirname "$PY"):$PATH"; export PATH

# Fast path: already installed and working.
if "$PY" -c "import horovod, horovod.tensorflow as hvd; hvd.init(); assert horovod.__version__ == '$HVD_VERSION'" >/dev/null 2>&1; then
    echo "build_horovod: horovod $HVD_VERSION already installed and working"; exit 0
fi

# System build tools; only touch apt when something is actually missing.
missing=()
command -v /usr/bin/cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
if [ ${#missing[@]} -gt 0 ]; then
    echo "build_horovod: installing ${missing[*]} via apt"
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

# setup.py imports packaging and needs wheel; the rest are horovod's runtime deps.
# Installing them first lets us use --no-build-isolation (build must see the installed TF).
"$PY" -m pip install -q packaging wheel setuptools cloudpickle psutil pyyaml cffi

# Fetch the sdist and patch it: the XLA ops guarded by this check include XLA headers
# that TF >= 2.16 no longer ships where horovod expects them; we don't need XLA ops.
rm -rf "$BUILD_ROOT"; mkdir -p "$BUILD_ROOT"
"$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$BUILD_ROOT"
tar -xzf "$BUILD_ROOT/horovod-$HVD_VERSION.tar.gz" -C "$BUILD_ROOT"
SRC="$BUILD_ROOT/horovod-$HVD_VERSION"
sed -i 's/^#if TENSORFLOW_VERSION >= 2006000000$/#if 0/' "$SRC/horovod/tensorflow/xla_mpi_ops.cc"
grep -q '^#if 0$' "$SRC/horovod/tensorflow/xla_mpi_ops.cc" || { echo "build_horovod: XLA patch did not apply" >&2; exit 1; }

# TF's headers include farmhash.h / highwayhash via paths that are not on TF's own -I list.
TF_INC="$("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())' 2>/dev/null)" \
    || { echo "build_horovod: ERROR: 'import tensorflow' fails in $PY; install TF first" >&2; exit 1; }
export CPATH="$TF_INC/external/farmhash_archive/src:$TF_INC/external/highwayhash${CPATH:+:$CPATH}"

export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
       HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
# CPU-only by default: GPU ops are compiled only if HOROVOD_GPU_* is set,
# so make sure none leaks in. For an NCCL/GPU build, run with HVD_GPU=1 and
# e.g. HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME=... in the environment.
if [ "${HVD_GPU:-0}" != 1 ]; then
    unset HOROVOD_GPU HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER \
          HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER HOROVOD_CUDA_HOME
fi
export HOROVOD_CMAKE=/usr/bin/cmake                    # setup.py would otherwise pick `cmake` from PATH
export MAKEFLAGS="-j${HVD_JOBS:-$(nproc 2>/dev/null || echo 2)}"  # setup.py defaults to -j8 unless MAKEFLAGS set (RAM)

echo "build_horovod: building horovod $HVD_VERSION (several minutes); log: $LOG"
start=$SECONDS
if ! "$PY" -m pip install -v --no-build-isolation --no-cache-dir "$SRC" >"$LOG" 2>&1; then
    # pip's trailer hides the real cause, so show the first compiler/cmake errors as well.
    echo "build_horovod: ERROR: horovod build/install failed. First errors in $LOG:" >&2
    grep -n -m 10 -E 'error:|CMake Error|fatal' "$LOG" >&2 || true
    echo "build_horovod: last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2
    exit 1
fi
echo "build_horovod: built in $((SECONDS - start))s"

# Verify the installed extension really loads against this TF.
if ! "$PY" -c "import horovod, horovod.tensorflow as hvd; hvd.init(); print('horovod', horovod.__version__, 'gloo', hvd.gloo_built(), 'mpi', hvd.mpi_built())"; then
    echo "build_horovod: ERROR: horovod installed but 'import horovod.tensorflow; hvd.init()' fails (log: $LOG)" >&2
    exit 1
fi
