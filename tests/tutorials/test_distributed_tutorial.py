"""Tutorial (c) trains DeepFM on 2 workers under horovodrun and learns."""

import os
import re
import subprocess
import sys

_TUTORIAL = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                         "tutorials", "distributed_train.py")


def test_distributed_deepfm_learns_on_two_workers():
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    result = subprocess.run(
        [horovodrun, "-np", "2", "--gloo", sys.executable, _TUTORIAL,
         "--rows", "16000", "--epochs", "2"],
        capture_output=True, text=True, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    aucs = re.findall(r"worker (\d)/2: validation AUC ([0-9.]+)", out)
    assert sorted(w for w, _ in aucs) == ["0", "1"], out[-4000:]
    # Both workers evaluate the same model (lookups go to the owners).
    assert aucs[0][1] == aucs[1][1]
    assert float(aucs[0][1]) > 0.6, out[-4000:]
