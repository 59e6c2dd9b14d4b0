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


_RESUME = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                       "tutorials", "distributed_resume.py")


def _final_tables(folder):
    """name -> {key or row: values} of the latest checkpoint in `folder`,
    read from its shard files with numpy (all shards merged)."""
    import glob

    import numpy as np

    with open(os.path.join(folder, "latest")) as f:
        path = os.path.join(folder, f.read().strip())
    tables = {}
    for shard in sorted(glob.glob(os.path.join(path, "shard-*.npz"))):
        arrays = np.load(shard)
        for key in arrays.files:
            name, _, field = key.partition("/")
            ids = {"values": "keys", "slots": "keys"}.get(field)
            if field == "values" and f"{name}/rows" in arrays.files:
                ids = "rows"
            if ids is None or f"{name}/{ids}" not in arrays.files:
                continue
            rows = tables.setdefault(f"{name}/{field}", {})
            for i, v in zip(arrays[f"{name}/{ids}"], arrays[key]):
                assert int(i) not in rows, f"{name}: {i} saved twice"
                rows[int(i)] = v
    return tables


def _run_resume(workers, folder, crash_at=None):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ)
    env.pop("DEMO_CRASH_AT_STEP", None)
    if crash_at is not None:
        env["DEMO_CRASH_AT_STEP"] = str(crash_at)
    result = subprocess.run(
        [horovodrun, "-np", str(workers), "--gloo", sys.executable, _RESUME,
         "--checkpoint-dir", str(folder), "--steps", "12", "--save-every",
         "4", "--batch", "96"],
        capture_output=True, text=True, timeout=400, env=env)
    out = result.stdout + result.stderr
    losses = {int(s): float(v) for s, v in
              re.findall(r"\[0\]<stdout>:step (\d+) loss (\S+)", out)}
    return result.returncode, out, losses


def test_killed_run_resumes_at_another_worker_count_as_uninterrupted(
        tmp_path):
    import numpy as np

    # The oracle: 12 steps on 2 workers without a failure.
    code, out, want = _run_resume(2, tmp_path / "whole")
    assert code == 0, out[-4000:]
    assert sorted(want) == list(range(12)), out[-4000:]
    # The same command, but worker 1 dies after step 5 (checkpoints at
    # steps 4 and 8 of 12: the last good one is step 4's).
    folder = tmp_path / "resumed"
    code, out, _ = _run_resume(2, folder, crash_at=5)
    assert code != 0, out[-4000:]
    assert "worker 1 crashes after step 5" in out, out[-4000:]
    # Relaunched as is, on 3 workers: resumes from step 4.
    code, out, got = _run_resume(3, folder)
    assert code == 0, out[-4000:]
    assert re.search(r"resumed from \S+ckpt-4-\w+ at step 4 on 3 workers",
                     out), out[-4000:]
    assert sorted(got) == list(range(4, 12)), out[-4000:]
    np.testing.assert_allclose([got[s] for s in range(4, 12)],
                               [want[s] for s in range(4, 12)], rtol=2e-5)
    whole, resumed = (_final_tables(tmp_path / "whole"),
                      _final_tables(folder))
    assert sorted(whole) == sorted(resumed)
    assert any(k.endswith("/slots") for k in whole), sorted(whole)
    for name in whole:
        assert sorted(whole[name]) == sorted(resumed[name]), name
        for key, value in whole[name].items():
            np.testing.assert_allclose(resumed[name][key], value,
                                       rtol=2e-5, atol=2e-6,
                                       err_msg=f"{name} {key}")
