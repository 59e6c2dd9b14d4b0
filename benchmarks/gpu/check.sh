#!/usr/bin/env bash
# The GPU check of the CUDA core, in one run on the GPU machine (CUDA 13,
# CuPy, torch, compute-sanitizer; no TensorFlow, no network):
#   1. records the device, driver and toolchain;
#   2. builds the core with the machine's nvcc;
#   3. runs every parity case (tests/ops/cuda_parity.py) against the numpy
#      oracle: the machine's build through CuPy pointers, and the build
#      made on the CPU machine with PyPI's nvcc (build/gpu/libge_cuda.so,
#      when carried) through torch pointers;
#   4. runs the quick parity cases under compute-sanitizer memcheck and
#      racecheck (exit code 9 on any finding);
#   5. benchmarks the criteo-like step against torch (benchmarks/gpu/bench.py);
#   6. the GPU EV table: its parity cases against the numpy model of the
#      CPU EV (tests/ops/ev_table_parity.py, both builds, and the quick
#      ones under both sanitizers), then its speed against HierarchicalKV
#      in the same run (HKV's driver shared/gpu/hkv_anchor.cu: the carried
#      build/gpu/hkv_anchor, else built from a carried build/hkv/include;
#      benchmarks/gpu/ev_table_bench.py), the criteo-like step on EV
#      tables against plain ones (benchmarks/gpu/ev_step_bench.py) and,
#      where ncu is installed, the table's kernels one by one
#      (benchmarks/gpu/ev_table_phases.py) and the plain fused step's
#      (benchmarks/gpu/step_phases.py).
# Writes everything under $OUT (default benchmarks/results/gpu): the logs,
# parity_*.json, bench.json, ev_table_*.json, hkv_anchor.jsonl and
# summary.json (commit id from GE_COMMIT). SKIP="bench ev_bench" (names of
# steps) leaves steps out. CORE=build/gpu/libge_cuda.so checks the carried
# build alone (no build here, no machine-build parity): for a short lease.
# Exit status: 0 only if every step passed.
#
# Usage (from the repository root):
#   GE_COMMIT=$(git rev-parse HEAD) bash benchmarks/gpu/check.sh [OUT]
set -uo pipefail
OUT=${1:-${OUT:-benchmarks/results/gpu}}
BUILD=${BUILD:-/tmp/ge_gpu_build}
mkdir -p "$OUT" "$BUILD"
exec > >(tee "$OUT/check.log") 2>&1
PY=${PYTHON:-python3}
STEPS_FAILED=()
step() {  # step NAME TIMEOUT CMD...: runs and records a step
    local name=$1 limit=$2
    shift 2
    case " ${SKIP:-} " in *" $name "*) echo "=== $name: skipped"; return;; esac
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0)) s"
    [ "$rc" = 0 ] || STEPS_FAILED+=("$name($rc)")
}

# 1. Where this ran.
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
SANITIZER=$(command -v compute-sanitizer ||
            echo "$(dirname "$NVCC")/compute-sanitizer")
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
ARCH=sm_${CAP/./}
nvidia-smi
"$NVCC" --version
"$PY" - "$OUT/environment.json" "$NVCC" <<'EOF'
import json, subprocess, sys
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception as e:  # recorded, not fatal
        return f"unavailable: {e}"
env = {
    "gpu": run(["nvidia-smi", "--query-gpu=name,driver_version,"
                "memory.total,compute_cap", "--format=csv,noheader"]),
    "nvcc": run([sys.argv[2], "--version"]).splitlines()[-1:],
}
for mod in ("cupy", "torch"):
    try:
        env[mod] = __import__(mod).__version__
    except Exception as e:
        env[mod] = f"unavailable: {e}"
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(env)
EOF

# 2. The core, built here (unless CORE names a carried build).
if [ -n "${CORE:-}" ]; then
    SKIP="${SKIP:-} build parity_machine_build ev_table_parity_machine_build"
fi
CORE=${CORE:-$BUILD/libge_cuda.so}
step build 300 "$NVCC" -O3 -std=c++17 -arch="$ARCH" \
    -Xcompiler -fPIC,-fvisibility=hidden -shared -o "$CORE" \
    ops/cuda/lookup_kernels.cu ops/cuda/backward_kernels.cu \
    ops/cuda/ev_table_kernels.cu

# 3. Parity: this machine's build (CuPy) and the carried one (torch).
step parity_machine_build 120 "$PY" tests/ops/cuda_parity.py \
    --core "$CORE" --memory cupy --json "$OUT/parity_machine_build.json"
if [ -f build/gpu/libge_cuda.so ]; then
    step parity_carried_build 120 "$PY" tests/ops/cuda_parity.py \
        --core build/gpu/libge_cuda.so --memory torch \
        --json "$OUT/parity_carried_build.json"
else
    echo "no carried build (build/gpu/libge_cuda.so): skipped"
    STEPS_FAILED+=("parity_carried_build(missing)")
fi

step ev_table_parity_machine_build 150 "$PY" tests/ops/ev_table_parity.py \
    --core "$CORE" --memory cupy --json "$OUT/ev_table_parity_machine_build.json"
if [ -f build/gpu/libge_cuda.so ]; then
    step ev_table_parity_carried_build 150 "$PY" \
        tests/ops/ev_table_parity.py --core build/gpu/libge_cuda.so \
        --memory torch --json "$OUT/ev_table_parity_carried_build.json"
fi

# 4. compute-sanitizer on the quick cases.
for tool in memcheck racecheck; do
    step "sanitizer_$tool" 150 "$SANITIZER" --tool "$tool" \
        --error-exitcode 9 --log-file "$OUT/sanitizer_$tool.log" \
        "$PY" tests/ops/cuda_parity.py --core "$CORE" --memory cupy \
        --quick --json "$OUT/sanitizer_${tool}_parity.json"
    tail -5 "$OUT/sanitizer_$tool.log"
    step "ev_table_sanitizer_$tool" 150 "$SANITIZER" --tool "$tool" \
        --error-exitcode 9 --log-file "$OUT/ev_table_sanitizer_$tool.log" \
        "$PY" tests/ops/ev_table_parity.py --core "$CORE" --memory cupy \
        --quick --json "$OUT/ev_table_sanitizer_${tool}_parity.json"
    tail -5 "$OUT/ev_table_sanitizer_$tool.log"
done

# 5. Speed against torch.
step bench 180 "$PY" benchmarks/gpu/bench.py --core "$CORE" \
    --json "$OUT/bench.json"

# 6. The EV table against HierarchicalKV, same run.
HKV=build/gpu/hkv_anchor
if [ ! -x "$HKV" ] && [ -d build/hkv/include ]; then
    HKV="$BUILD/hkv_anchor"
    step hkv_build 300 "$NVCC" -O3 -std=c++17 -arch="$ARCH" \
        --expt-relaxed-constexpr --expt-extended-lambda -I build/hkv/include \
        -o "$HKV" build/hkv/hkv_anchor.cu
fi
if [ -x "$HKV" ]; then
    step hkv_anchor 120 bash -c "'$HKV' > '$OUT/hkv_anchor.jsonl'"
    cat "$OUT/hkv_anchor.jsonl"
else
    echo "no HierarchicalKV driver (carry build/gpu/hkv_anchor or build/hkv/include)"
    STEPS_FAILED+=("hkv_anchor(missing)")
fi
step ev_bench 240 "$PY" benchmarks/gpu/ev_table_bench.py --core "$CORE" \
    --hkv "$OUT/hkv_anchor.jsonl" --json "$OUT/ev_table_bench.json"
# The criteo-like step on EV tables against plain tables.
step ev_step 150 "$PY" benchmarks/gpu/ev_step_bench.py --core "$CORE" \
    --json "$OUT/ev_step_bench.json"
# Kernel by kernel (Nsight Compute), where it is installed.
NCU=$(command -v ncu || echo "$(dirname "$NVCC")/ncu")
if [ -x "$NCU" ]; then
    step ev_phases 100 bash -c "'$NCU' --profile-from-start off \
        --metrics gpu__time_duration.sum,dram__bytes.sum '$PY' \
        benchmarks/gpu/ev_table_phases.py '$CORE' > '$OUT/ev_table_phases.txt' 2>&1"
    # The plain fused step (forward + backward-apply) the same way.
    step step_phases 150 bash -c "'$NCU' --profile-from-start off \
        --metrics gpu__time_duration.sum,dram__bytes.sum '$PY' \
        benchmarks/gpu/step_phases.py '$CORE' > '$OUT/step_phases.txt' 2>&1"
fi

"$PY" - "$OUT" "${GE_COMMIT:-unknown}" "${STEPS_FAILED[*]:-}" <<'EOF'
import json, os, sys
out, commit, failed = sys.argv[1], sys.argv[2], sys.argv[3].split()
summary = {"commit": commit, "failed_steps": failed}
for name in ("environment", "parity_machine_build", "parity_carried_build",
             "sanitizer_memcheck_parity", "sanitizer_racecheck_parity",
             "bench", "ev_table_parity_machine_build",
             "ev_table_parity_carried_build",
             "ev_table_sanitizer_memcheck_parity",
             "ev_table_sanitizer_racecheck_parity", "ev_table_bench",
             "ev_step_bench"):
    path = os.path.join(out, name + ".json")
    if os.path.exists(path):
        data = json.load(open(path))
        if "cases" in data:  # keep the counts, the cases stay in the file
            data = {k: v for k, v in data.items() if k != "cases"}
        summary[name] = data
for log in ("sanitizer_memcheck", "sanitizer_racecheck",
            "ev_table_sanitizer_memcheck", "ev_table_sanitizer_racecheck"):
    path = os.path.join(out, log + ".log")
    if os.path.exists(path):
        summary[log + "_summary"] = open(path).read().strip(
            ).splitlines()[-1:]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(summary, indent=1))
EOF
if [ ${#STEPS_FAILED[@]} -ne 0 ]; then
    echo "FAILED: ${STEPS_FAILED[*]}"
    exit 1
fi
echo "all GPU checks passed"
