#!/usr/bin/env bash
# Forward-kernel tuning on the GPU machine: builds the core with several
# (ids read ahead, minimum blocks per SM) settings of the pooled lookup
# and times the forward alone on the criteo-like batch (bench.py
# --forward-only) for each. Writes $OUT/tune_forward_<ahead>_<blocks>.json.
# Usage: bash benchmarks/gpu/tune_forward.sh OUT "4:1 4:4 2:5 2:6"
set -uo pipefail
OUT=$1
VARIANTS=${2:-"4:1 4:4 2:5 2:6"}
PY=${PYTHON:-python3}
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
BUILD=${BUILD:-/tmp/ge_tune_build}
mkdir -p "$OUT" "$BUILD"
# Built in parallel (nvcc takes ~30 s a build), then timed one by one.
for v in $VARIANTS; do
    ahead=${v%%:*}
    blocks=${v##*:}
    "$NVCC" -O3 -std=c++17 -arch="sm_${CAP/./}" -t 2 \
        -DGE_POOLED_IDS_AHEAD="$ahead" -DGE_POOLED_MIN_BLOCKS="$blocks" \
        -Xcompiler -fPIC,-fvisibility=hidden -shared \
        -o "$BUILD/libge_cuda_${ahead}_${blocks}.so" \
        ops/cuda/lookup_kernels.cu ops/cuda/backward_kernels.cu &
done
wait
for v in $VARIANTS; do
    ahead=${v%%:*}
    blocks=${v##*:}
    lib="$BUILD/libge_cuda_${ahead}_${blocks}.so"
    [ -f "$lib" ] || { echo "build $v failed"; continue; }
    timeout 200 "$PY" benchmarks/gpu/bench.py --core "$lib" --forward-only \
        --json "$OUT/tune_forward_${ahead}_${blocks}.json" |
        grep -o '"dim": [0-9]*\|"ge_forward_ms": \[[0-9.]*\|"forward_vs_copy": [0-9.]*' |
        paste - - - | sed "s/^/ahead $ahead blocks $blocks: /"
done
