"""The benchmarks' own correctness checks run in CI, at tiny sizes.

`benchmarks/lookup_bench.py` trains every variant of a family on the same
batches and raises when their losses differ (stock TF vs this library,
forward, backward and update over the warmup steps). Here it runs a few
families for two steps on small tables (about 20 s); the timings it
prints are meaningless at this size and are not checked.
"""

import os
import subprocess
import sys

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      os.pardir, "benchmarks", "lookup_bench.py")
# One stock baseline and this library's variants per family; the EV
# families are not cross-checked by the benchmark (their rows start from
# the EV's own initializer).
VARIANTS = ("stock_raw_adagrad,ge,ge_pure_tf,ge_packed,stock_weighted,"
            "ge_weighted,stock_seq,ge_seq,stock_tf1,ge_tf1")
FAMILIES = ("pooled", "weighted", "seq", "tf1")


def test_lookup_bench_losses_agree_with_stock(tmp_path):
    out = str(tmp_path / "bench.json")
    proc = subprocess.run(
        [sys.executable, _BENCH, "--quick", "--batch", "64", "--cap",
         "1000", "--rounds", "1", "--steps-per-round", "1", "--warmup", "2",
         "--variants", VARIANTS, "--out", out],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    text = proc.stdout + proc.stderr
    # A loss mismatch is an AssertionError, hence a non-zero exit.
    assert proc.returncode == 0, text[-4000:]
    for family in FAMILIES:
        assert f"correctness [{family}]: losses of " in proc.stdout, (
            family, proc.stdout[-3000:])
    assert os.path.getsize(out) > 0


_TIER_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           os.pardir, "benchmarks", "ev_tier_bench.py")


def test_ev_tier_bench_quick_runs(tmp_path):
    """benchmarks/ev_tier_bench.py at tiny sizes: the tiered EV and the
    all-DRAM EV train on the same ids and the script checks their rows
    are bitwise equal; both modes write their JSON and clean the tier
    folder."""
    import json
    for extra in ([], ["--scale", "--keys", "30000", "--dram-gib",
                       "0.001"]):
        out = str(tmp_path / "tier.json")
        folder = str(tmp_path / "tier_dir")
        proc = subprocess.run(
            [sys.executable, _TIER_BENCH, "--quick", "--out", out,
             "--storage-path", folder] + extra,
            capture_output=True, text=True, timeout=600,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        with open(out) as f:
            result = json.load(f)
        assert not os.path.exists(folder)
        stats = result["tier_stats"]
        if extra:
            assert result["keys_inserted"] == 20000  # --quick caps keys
            assert stats["dram_keys"] + stats["disk_keys"] == 20000
            assert stats["disk_keys"] > 0
        else:
            assert result["rows_bitwise_equal_sample"] is True
            assert stats["spills"] > 0 and stats["promotions"] > 0
