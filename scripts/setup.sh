#!/usr/bin/env bash
# Sets up everything on a fresh machine, idempotently: .venv with
# TensorFlow 2.21 (CPU), this package (editable) with its test and demo
# extras, the C++ kernels compiled against that TensorFlow, and Horovod
# built from source (skip it with WITH_HOROVOD=0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test,demo]"
# Compile the kernels now rather than at the first lookup.
echo "setup: kernels at $(.venv/bin/python -m group_embedding.ops.kernel_library 2>/dev/null)"
if [ "${WITH_HOROVOD:-1}" = 1 ]; then
    bash scripts/build_horovod.sh .venv/bin/python
fi
