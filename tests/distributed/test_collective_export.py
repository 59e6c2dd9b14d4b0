"""A model trained in collective mode (2 workers) becomes ONE SavedModel:
its checkpoint restored at one plain process and exported with
`ge.export_saved_model` (issue 26.1). Served by plain TF in a process that
cannot import group_embedding, it predicts what the 2 workers predicted
(and what the single process predicts from the restored tables)."""

import os
import subprocess
import sys

import collective_checkpoint as cc
import numpy as np
import pytest
from test_collective_training import run_workers

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "serving"))

from test_keras_export import serve  # noqa: E402


def test_two_workers_export_one_servable(tmp_path):
    folder = str(tmp_path / "ckpt")
    run = run_workers(2, "collective_checkpoint.py", "--phase", "save",
                      "--dir", folder)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = str(tmp_path / "export")
    export = subprocess.run(
        [sys.executable, os.path.join(_HERE, "collective_export.py"),
         "--dir", folder, "--out", out],
        capture_output=True, text=True, timeout=300, cwd=_HERE)
    assert export.returncode == 0, (export.stdout + export.stderr)[-4000:]
    assert "single process equals the collective run" in export.stdout
    want = np.load(os.path.join(folder, "expected.npy"))
    got = serve(out, cc.batch(7), "serve", tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_export_from_checkpoint_refuses_collective_mode(monkeypatch,
                                                        tmp_path):
    # A worker holds only its shards: exporting there would lose rows.
    import group_embedding as ge
    from group_embedding.distributed import strategy
    monkeypatch.setattr(strategy, "is_collective", lambda: True)
    with pytest.raises(RuntimeError, match="one plain process"):
        ge.export_from_checkpoint(str(tmp_path), {}, None,
                                  str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
