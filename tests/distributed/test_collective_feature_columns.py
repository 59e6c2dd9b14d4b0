"""Scoped feature columns trained in collective mode (Keras model.fit and
TF1 MonitoredTrainingSession) equal the single-process (-np 1) run: three
dense tables and an EmbeddingVariable column (in DRAM, or its table in
GPU memory on the host stand-in)."""

import glob

import numpy as np
import pytest
from test_collective_training import run_workers


def merged(prefix):
    """name -> full array, from every worker's dump."""
    rows, values, out = {}, {}, {}
    for path in sorted(glob.glob(f"{prefix}.rank-*.npz")):
        for key, value in np.load(path).items():
            name, _, field = key.rpartition("/")
            if field == "rows":
                rows.setdefault(name, []).append(value)
            elif field == "values":
                values.setdefault(name, []).append(value)
            else:
                out[key] = value
    for name in rows:
        r = np.concatenate(rows[name])
        v = np.concatenate(values[name])
        assert len(np.unique(r)) == len(r), f"{name}: a row held twice"
        out[name] = v[np.argsort(r)]
    return out


# hbm: the EV column's table in GPU memory (the host stand-in here).
@pytest.mark.parametrize("api", ["keras", "tf1", "keras-plan", "keras-hbm",
                                 "tf1-hbm"])
def test_two_workers_equal_one(tmp_path, api):
    # keras-plan: the planner places table b whole on one worker.
    plan = api.endswith("-plan")
    ev_storage = "hbm" if api.endswith("-hbm") else "dram"
    api = api.replace("-plan", "").replace("-hbm", "")
    results = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"np{workers}")
        run = run_workers(workers, "collective_feature_columns.py",
                          "--api", api, "--out", prefix,
                          "--ev-storage", ev_storage,
                          *(["--plan"] if plan else []),
                          env={"GROUP_EMBEDDING_HBM_ON_HOST": "1"})
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        results[workers] = merged(prefix)
    single, double = results[1], results[2]
    assert sorted(single) == sorted(double)
    assert len(single) == 4 + (2 if api == "keras" else 1)  # tables+dense
    # The two big tables really were split: worker 0 held half the rows
    # (with the plan: all of b, worker 1 none); each EV key sits on
    # worker key mod 2.
    dumps = [np.load(str(tmp_path / f"np2.rank-{r}.npz")) for r in (0, 1)]
    held = [{k.rpartition("/")[0]: len(v) for k, v in d.items()
             if k.endswith("/rows") and not k.startswith("d_")}
            for d in dumps]
    b_rows = (9000, 0) if plan else (4500, 4500)
    assert held == [{"a_embedding": 6000, "b_embedding": b_rows[0],
                     "c_embedding": 50},
                    {"a_embedding": 6000, "b_embedding": b_rows[1]}], held
    for r, d in enumerate(dumps):
        keys = d["d_embedding/rows"]
        assert len(keys) > 0 and np.all(np.mod(keys, 2) == r), r
    for name in single:
        np.testing.assert_allclose(double[name], single[name], rtol=1e-5,
                                   atol=1e-6, err_msg=name)
