#!/usr/bin/env bash
# Sets up everything on a fresh machine, idempotently: .venv with
# TensorFlow 2.21 (CPU), this package (editable) with its test, demo and
# cuda-build (PyPI's nvcc) extras and tf-keras (the tf1 extra), the C++
# kernels compiled against that TensorFlow into the user cache
# (~/.cache/group_embedding or $GROUP_EMBEDDING_CACHE), the GPU kernels
# where TF is a CUDA build, and Horovod built from source (skip it with
# WITH_HOROVOD=0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# pyproject.toml's build requirements, installed here so that the editable
# install can build without isolation against this very TensorFlow (an
# isolated build would install TF a second time, into a throwaway env).
.venv/bin/python -m pip install -q "setuptools>=64" wheel "tensorflow-cpu==2.21.0"
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test,demo,cuda-build]"
# The tf1 extra, without its dependency on the `tensorflow` distribution,
# which pip would install over tensorflow-cpu.
.venv/bin/python -m pip install -q --no-deps "tf-keras==2.21.0"
# The editable install compiled the kernels already; this prints where
# (and compiles them if that failed, showing why).
echo "setup: kernels at $(TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python -c \
    'from group_embedding.ops import kernel_library as k; print(k.build())')"
# The GPU kernels, where TF is a CUDA build (here it says why not).
echo "setup: $(TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python -c \
    'from group_embedding.ops import gpu_kernel_library as g
print(g.build_at_install())')"
if [ "${WITH_HOROVOD:-1}" = 1 ]; then
    bash scripts/build_horovod.sh .venv/bin/python
fi
