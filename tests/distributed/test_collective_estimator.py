"""Estimator in collective mode under horovodrun: 2 workers, each on half
of every batch, train (with a resume), checkpoint and evaluate like the
single-worker run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def run(workers, tmp_path):
    out = tmp_path / f"np{workers}.json"
    model_dir = tmp_path / f"model{workers}"
    result = subprocess.run(
        [_HOROVODRUN, "-np", str(workers), "--gloo", sys.executable,
         os.path.join(_HERE, "collective_estimator.py"),
         "--model-dir", str(model_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    with open(out) as f:
        return json.load(f), model_dir


@pytest.mark.skipif(not os.path.exists(_HOROVODRUN),
                    reason="horovodrun not installed")
def test_two_workers_equal_one(tmp_path):
    single, _ = run(1, tmp_path)
    double, model_dir = run(2, tmp_path)
    assert single["metrics"]["global_step"] == 5  # 2, then a full pass of 3
    assert double["metrics"]["global_step"] == 5  # 2, then a full pass of 3
    for key in ("loss", "accuracy", "auc"):
        np.testing.assert_allclose(double["metrics"][key],
                                   single["metrics"][key], rtol=1e-4,
                                   atol=1e-5, err_msg=key)
    np.testing.assert_allclose(double["w"], single["w"], rtol=1e-4,
                               atol=1e-5)
    # Worker 1 kept its own EV keys beside worker 0's checkpoint.
    assert os.path.exists(model_dir / "worker-1" / "checkpoint")
