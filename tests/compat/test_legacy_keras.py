"""Keras 2 scripts (`tf.layers.dense`) with TF_USE_LEGACY_KERAS=1 and
tf-keras (`pip install -e .[tf1]`), and the error they get without it."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                       "legacy_keras_script.py")


def run(legacy):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    return subprocess.run([sys.executable, _SCRIPT], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="tf-keras not installed: pip install -e .[tf1]")
def test_tf1_script_trains_with_legacy_keras():
    result = run(legacy=True)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"losses ([\d.]+) -> ([\d.]+) in (\d+) steps",
                      result.stdout)
    assert match, result.stdout[-2000:]
    first, last, steps = float(match[1]), float(match[2]), int(match[3])
    assert steps == 64  # 256 rows x 16 epochs / 64: input exhausted
    assert last < 0.5 * first  # learnt the parity of the user id


def test_tf1_script_without_legacy_keras_names_the_fix():
    result = run(legacy=False)
    assert result.returncode != 0
    assert "`dense` is not available with Keras 3" in result.stderr, \
        result.stderr[-3000:]
