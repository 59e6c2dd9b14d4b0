#!/usr/bin/env bash
# The GPU EV table's device check alone, on a core built on the CPU
# machine and carried (build/gpu/libge_cuda.so) with HierarchicalKV's
# driver (build/gpu/hkv_anchor): for a session with little device time
# left (about 2.5 minutes here; check.sh builds and checks everything).
#   parity (torch memory), memcheck and racecheck over the quick cases
#   (CuPy), HKV's Config B then ours (ev_table_bench.py), the criteo-like
#   EV step (ev_step_bench.py) and the kernels one by one under ncu.
# Usage: bash benchmarks/gpu/ev_check.sh OUT   (everything under OUT)
set -uo pipefail
OUT=${1:?output folder}
CORE=${CORE:-build/gpu/libge_cuda.so}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
TOOLS=$(dirname "$NVCC")
SAN=$(command -v compute-sanitizer || echo "$TOOLS/compute-sanitizer")
NCU=$(command -v ncu || echo "$TOOLS/ncu")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader \
    > "$OUT/environment.txt"
echo "commit ${GE_COMMIT:-unknown}" >> "$OUT/environment.txt"
run() {  # run NAME LIMIT CMD...: output in OUT/NAME.log, status recorded
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?" | tee -a "$OUT/status.txt"
}
run parity 90 "$PY" tests/ops/ev_table_parity.py --core "$CORE" \
    --memory torch --json "$OUT/parity.json"
for tool in memcheck racecheck; do
    run "$tool" 90 "$SAN" --tool "$tool" --error-exitcode 9 \
        --log-file "$OUT/$tool.sanitizer.log" "$PY" \
        tests/ops/ev_table_parity.py --core "$CORE" --memory cupy --quick
done
run hkv_anchor 90 bash -c "build/gpu/hkv_anchor > '$OUT/hkv_anchor.jsonl'"
run ev_bench 150 "$PY" benchmarks/gpu/ev_table_bench.py --core "$CORE" \
    --hkv "$OUT/hkv_anchor.jsonl" --json "$OUT/ev_table_bench.json"
run ev_step 120 "$PY" benchmarks/gpu/ev_step_bench.py --core "$CORE" \
    --json "$OUT/ev_step_bench.json"
if [ -x "$NCU" ]; then
    run phases 60 "$NCU" --profile-from-start off \
        --metrics gpu__time_duration.sum,dram__bytes.sum "$PY" \
        benchmarks/gpu/ev_table_phases.py "$CORE"
fi
cat "$OUT/status.txt"
