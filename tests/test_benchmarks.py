"""The benchmarks' own correctness checks run in CI, at tiny sizes.

`benchmarks/lookup_bench.py` trains every variant of a family on the same
batches and raises when their losses differ (stock TF vs this library,
forward, backward and update over the warmup steps). Here it runs a few
families for two steps on small tables (about 20 s); the timings it
prints are meaningless at this size and are not checked. So does
`benchmarks/ev_step_vs_deepray.py`, with its Deepray side only where a
Deepray venv is named by $DEEPRAY_PYTHON.
"""

import json
import os
import subprocess
import sys

import pytest

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


_EV_VS_DEEPRAY = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              os.pardir, "benchmarks",
                              "ev_step_vs_deepray.py")
_TINY = ["--quick", "--batch", "64", "--cap", "500", "--rounds", "2",
         "--steps", "2", "--num-batches", "2", "--lookup-keys", "3000",
         "--lookup-rows", "500", "--lookup-reps", "1"]


def _run_ev_vs_deepray(tmp_path, env):
    out = str(tmp_path / "bench.json")
    proc = subprocess.run([sys.executable, _EV_VS_DEEPRAY, *_TINY,
                           "--out", out], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(out) as f:
        return json.load(f)


def test_ev_step_vs_deepray_our_side(tmp_path):
    # Our EV step and the training=False lookup vs tf.gather; without a
    # Deepray venv the benchmark says so instead of a ratio.
    env = {k: v for k, v in os.environ.items() if k != "DEEPRAY_PYTHON"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    result = _run_ev_vs_deepray(tmp_path, env)
    assert result["step"]["ours_live_keys"] > 0
    assert result["step"]["ev_step_over_plain_step"] > 0
    # The step without its embeddings, and the rest of ours.
    step = result["step"]
    assert step["ours_dense_only_ms"] > 0
    assert step["ours_embedding_part_ms"] == pytest.approx(
        step["ours_step_ms"] - step["ours_dense_only_ms"])
    assert "not run" in result["step"]["deepray"]
    assert result["lookup"]["lookup_rows"] == 500


def test_ev_step_vs_deepray_both_sides(tmp_path):
    # Only where a Deepray venv was made (../shared/peers/deepray/setup.sh)
    # and named by $DEEPRAY_PYTHON: both sides train on the same ids, so
    # they store the same keys (the benchmark raises otherwise).
    python = os.environ.get("DEEPRAY_PYTHON")
    if not python or not os.path.exists(python):
        pytest.skip("no Deepray venv ($DEEPRAY_PYTHON)")
    result = _run_ev_vs_deepray(tmp_path, dict(os.environ,
                                               TF_CPP_MIN_LOG_LEVEL="2"))
    step = result["step"]
    assert step["speedup_over_deepray"] > 0
    assert step["deepray_dense_only_ms"] > 0
    assert step["embedding_part_speedup_over_deepray"] == pytest.approx(
        (step["deepray_step_ms"] - step["deepray_dense_only_ms"]) /
        (step["ours_step_ms"] - step["ours_dense_only_ms"]))


_TIER_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           os.pardir, "benchmarks", "ev_tier_bench.py")


def test_ev_tier_bench_quick_runs(tmp_path):
    """benchmarks/ev_tier_bench.py at tiny sizes: the tiered EV and the
    all-DRAM EV train on the same ids and the script checks their rows
    are bitwise equal; both modes write their JSON and clean the tier
    folder."""
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
            rounds = result["tier_step_ms_rounds"]
            assert result["tier_step_ms_mean"] == pytest.approx(
                sum(rounds) / len(rounds))
            assert 0 <= result["oracle_hit_rate_distinct_keys"] <= 1
            # The bare I/O ran on the tier file (its header read: dim 16
            # and Adagrad's one slot make 156-byte records); g++ is one of
            # the project's requirements, so it must have been measured.
            floor = result["io_floor_of_oracle_misses"]
            assert "not_measured" not in floor, floor
            assert floor["record_bytes"] == 24 + 4 * (16 + 16) + 4
            assert floor["reads"] == max(
                1, int(result["oracle_misses_per_step"]))
            assert floor["pread_ms"] > 0 and floor["append_ms"] > 0
            assert result["ratio_tier_over_dram_mean"] == pytest.approx(
                result["tier_step_ms_mean"] / result["dram_step_ms_mean"])
