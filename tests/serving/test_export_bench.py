"""benchmarks/export_bench.py at a tiny size: its own check (the exported
SavedModel, loaded by plain TF, serves the EV's rows) passes and it
writes its JSON. Timings are meaningless at this size and not checked."""

import json
import os
import subprocess
import sys

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      os.pardir, os.pardir, "benchmarks", "export_bench.py")


def test_export_bench_runs(tmp_path):
    out = str(tmp_path / "bench.json")
    proc = subprocess.run(
        [sys.executable, _BENCH, "--keys", "20000", "--dim", "4", "--out",
         out], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        result = json.load(f)
    assert result["ge_export"]["served_max_abs_diff"] <= 1e-5
    assert result["keys"] == 20000
