"""Runs hvd_smoke.py under horovodrun: Horovod's collectives work here.

The numbers are checked inside hvd_smoke.py on every worker; a wrong value
or a hang fails this test (timeout).
"""

import os
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("workers", [2, 3])
def test_collectives_under_horovodrun(workers):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    result = subprocess.run(
        [horovodrun, "-np", str(workers), "--gloo", sys.executable,
         os.path.join(_HERE, "hvd_smoke.py")],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
