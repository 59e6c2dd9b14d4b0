"""Checkpoints across worker counts, failed saves, and failing workers.

The checks run inside the scripts on every worker (see their docstrings);
horovodrun exits non-zero if any fails.
"""

import time

import pytest
from test_collective_training import run_workers


@pytest.mark.parametrize("save_at,restore_at,tier", [
    (2, 1, False), (1, 2, False), (2, 3, False),
    # The EV's keys mostly on disk (DRAM_SSDHASH) when saved and restored.
    (2, 3, True)], ids=lambda n: str(n))
def test_checkpoint_restores_at_other_worker_count(tmp_path, save_at,
                                                   restore_at, tier):
    args = ["--dir", str(tmp_path)] + (["--tier"] if tier else [])
    saved = run_workers(save_at, "collective_checkpoint.py", "--phase",
                        "save", "--fail-save", *args)
    out = saved.stdout + saved.stderr
    assert saved.returncode == 0, out[-4000:]
    assert out.count("failed save raised") == save_at, out[-4000:]
    restored = run_workers(restore_at, "collective_checkpoint.py",
                           "--phase", "restore", *args)
    out = restored.stdout + restored.stderr
    assert restored.returncode == 0, out[-4000:]
    assert out.count("probe lookups equal") == restore_at, out[-4000:]


@pytest.mark.parametrize("save_at,restore_at,kinds", [
    (2, 3, ("hbm", "hbm")), (2, 1, ("hbm", "dram")),
    (1, 2, ("dram", "hbm"))], ids=lambda n: str(n))
def test_hbm_ev_checkpoint_restores_at_other_worker_count(
        tmp_path, save_at, restore_at, kinds):
    """An HBM EV's collective checkpoint (on the host stand-in) restores
    at another worker count, into HBM or DRAM EVs, and a DRAM EV's into
    HBM EVs: the same files."""
    env = {"GROUP_EMBEDDING_HBM_ON_HOST": "1"}
    flags = [["--hbm"] if kind == "hbm" else [] for kind in kinds]
    saved = run_workers(save_at, "collective_checkpoint.py", "--phase",
                        "save", "--fail-save", "--dir", str(tmp_path),
                        *flags[0], env=env)
    out = saved.stdout + saved.stderr
    assert saved.returncode == 0, out[-4000:]
    assert out.count("failed save raised") == save_at, out[-4000:]
    restored = run_workers(restore_at, "collective_checkpoint.py",
                           "--phase", "restore", "--dir", str(tmp_path),
                           *flags[1], env=env)
    out = restored.stdout + restored.stderr
    assert restored.returncode == 0, out[-4000:]
    assert out.count("probe lookups equal") == restore_at, out[-4000:]
    assert out.count("(HBM EV)") == (
        restore_at if kinds[1] == "hbm" else 0), out[-4000:]


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_failing_worker_stops_the_others(mode):
    start = time.monotonic()
    result = run_workers(3, "collective_fault.py", "--mode", mode,
                         timeout=120)
    elapsed = time.monotonic() - start
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-4000:]
    assert "worker 1 fails at step 3" in out, out[-4000:]
    # Startup (~10-20 s on 2 cores) + the stop, well under a minute.
    assert elapsed < 75, f"took {elapsed:.0f}s"
    assert "Terminating remaining workers" in out or "exited with non-zero" \
        in out, out[-4000:]
