"""`benchmarks/incremental_checkpoint_bench.py` at a tiny size: its deltas
must be deltas and its restored chain bitwise equal to the live EV (the
benchmark raises otherwise). The timings at this size are not checked."""

import json
import os
import subprocess
import sys

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      os.pardir, "benchmarks",
                      "incremental_checkpoint_bench.py")


def test_incremental_checkpoint_bench_runs(tmp_path):
    out = str(tmp_path / "bench.json")
    proc = subprocess.run(
        [sys.executable, _BENCH, "--keys", "20000", "--rounds", "2",
         "--out", out], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        result = json.load(f)
    assert result["chain_restore_bitwise_equal"] is True
    # 1% of 20000 keys changed: their rows, not the table's.
    assert result["delta_over_full_bytes"] < 0.2
