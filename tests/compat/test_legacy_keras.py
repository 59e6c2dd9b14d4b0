"""Keras 2 scripts (`tf.layers.dense`) with TF_USE_LEGACY_KERAS=1 and
tf-keras (`pip install -e .[tf1]`), and the error they get without it;
a TF1 script without `tf.layers` learns in both Keras modes."""

import importlib.util
import json
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


# A TF1 script without tf.layers (DeepRec names, dense layers from
# get_variable) must not depend on the Keras mode.
_DEEPREC_SCRIPT = os.path.join(os.path.dirname(_SCRIPT),
                               "deeprec_style_script.py")
# Runs the script, then names the package behind tf.keras, to show which
# Keras the run had.
_RUN_AND_NAME_KERAS = (
    "import runpy, sys; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__'); "
    "import tensorflow as tf; "
    "print('keras package', tf.keras.layers.Dense.__module__.split('.')[0])")


@pytest.fixture(scope="module")
def criteo_like_csvs(tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(_SCRIPT), os.pardir,
                                    os.pardir, "tutorials"))
    import data

    frame, _ = data.generate(6000, seed=3)
    folder = tmp_path_factory.mktemp("deeprec_style")
    paths = str(folder / "train.csv"), str(folder / "eval.csv")
    data.write_csv(frame[:5000], paths[0])
    data.write_csv(frame[5000:], paths[1])
    return paths


@pytest.mark.parametrize("legacy", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        importlib.util.find_spec("tf_keras") is None,
        reason="tf-keras not installed: pip install -e .[tf1]"))],
    ids=["keras3", "legacy_keras"])
def test_tf1_script_without_layers_learns_in_both_modes(legacy, tmp_path,
                                                        criteo_like_csvs):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
    train_csv, eval_csv = criteo_like_csvs
    result = subprocess.run(
        [sys.executable, "-c", _RUN_AND_NAME_KERAS, _DEEPREC_SCRIPT,
         "--train", train_csv, "--eval", eval_csv,
         "--checkpoint_dir", str(tmp_path / "ckpt"), "--steps", "100"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "keras package " + ("tf_keras" if legacy
                                            else "keras"), lines[-2:]
    summary = json.loads(next(line for line in lines if line[:1] == "{"))
    assert summary["steps"] == 100
    assert summary["last_loss"] < summary["first_loss"] - 0.05, summary
    assert summary["auc"] > 0.6, summary
