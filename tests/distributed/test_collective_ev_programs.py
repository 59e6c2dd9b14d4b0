"""Random EV programs in collective mode equal one process, op by op.

collective_ev_programs.py draws, per seed, a program of training steps
(groups of features over two EVs with drawn filters, eviction,
combiners, weights, eager or traced), lookups, `evict()`, incremental
saves and rewinds; it runs once in one process (DRAM EVs) and once
under horovodrun, where each worker owns the keys k mod N. After every
op, the workers' parts of each EV, merged, must hold exactly the single
process's keys, frequencies and versions, and its values and slots to
float rounding (the workers sum a key's gradient parts in another
order); the losses and lookup rows likewise. One configuration
restores, at each rewind, the single process's checkpoint of that op
instead of its own (resharded from one worker to three); the others
keep the workers' EVs on a disk tier (one storage_path for all), in
HBM, and in HBM over host memory (600 keys, more than the GPU tables
hold). CI runs 3 seeds of each; 22 more seeds passed by hand in 3 to
7 configurations.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from test_collective_training import run_workers

_HERE = os.path.dirname(os.path.abspath(__file__))
SEEDS = "0,1,2"


def _single(out, keys):
    result = subprocess.run(
        [sys.executable, os.path.join(_HERE, "collective_ev_programs.py"),
         "--mode", "single", "--seeds", SEEDS, "--out", str(out),
         "--keys", str(keys)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return dict(np.load(out / "single-0.npz"))


def _merged(parts, name):
    """The workers' parts of one EV state (`name` = prefix/evK), sorted
    by key."""
    keys = np.concatenate([p[f"{name}/keys"] for p in parts])
    order = np.argsort(keys, kind="stable")
    return {f: np.concatenate([p[f"{name}/{f}"] for p in parts])[order]
            for f in ("keys", "values", "slots", "freqs", "versions")}


def _assert_programs_equal(single, parts, workers):
    seeds = [int(s) for s in SEEDS.split(",")]
    for seed in seeds:
        ops = single[f"s{seed}/ops"]
        for i, kind in enumerate(ops):
            prefix = f"s{seed}/op{i}"
            where = f"seed {seed} op {i} ({kind}) at N={workers}"
            for key in single:
                if key.startswith(prefix + "/") and \
                        key.rsplit("/", 1)[1].startswith(("loss", "rows")):
                    # Global outputs: every worker holds them whole.
                    for p in parts:
                        np.testing.assert_allclose(
                            p[key], single[key], rtol=1e-4, atol=1e-5,
                            err_msg=f"{where}: {key}")
            for e in range(2):
                name = f"{prefix}/ev{e}"
                want = {f: single[f"{name}/{f}"] for f in
                        ("keys", "values", "slots", "freqs", "versions")}
                order = np.argsort(want["keys"], kind="stable")
                want = {f: v[order] for f, v in want.items()}
                got = _merged(parts, name)
                for rank, p in enumerate(parts):
                    assert np.all(np.mod(p[f"{name}/keys"], workers) ==
                                  rank), f"{where}: worker {rank} holds " \
                                         "keys it does not own"
                for f in ("keys", "freqs", "versions"):
                    np.testing.assert_array_equal(
                        got[f], want[f], err_msg=f"{where}: ev{e} {f}")
                for f in ("values", "slots"):
                    np.testing.assert_allclose(
                        got[f], want[f], rtol=1e-4, atol=1e-5,
                        err_msg=f"{where}: ev{e} {f}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """keys -> (folder, results) of the single-process run over that
    many keys, run when first asked."""
    runs = {}

    def run(keys):
        if keys not in runs:
            folder = tmp_path_factory.mktemp(f"single{keys}")
            runs[keys] = folder, _single(folder, keys)
        return runs[keys]
    return run


# reshard: DRAM EVs whose restores read the single process's
# checkpoints (one process's save restored over N workers). hbm_dram:
# 600 keys, more than the two workers' GPU tables of 128 hold.
@pytest.mark.parametrize("workers,storage,keys", [
    pytest.param(3, "reshard", 50, id="np3-dram-reshard"),
    pytest.param(2, "ssd", 50, id="np2-ssd"),
    pytest.param(2, "hbm", 50, id="np2-hbm"),
    pytest.param(2, "hbm_dram", 600, id="np2-hbm_dram"),
])
def test_collective_programs_equal_one_process(single, tmp_path, workers,
                                               storage, keys):
    folder, want = single(keys)
    extra = (["--storage", "dram", "--restore-from", str(folder)]
             if storage == "reshard" else ["--storage", storage])
    result = run_workers(
        workers, "collective_ev_programs.py", "--mode", "collective",
        "--seeds", SEEDS, "--out", str(tmp_path), "--keys", str(keys),
        *extra, timeout=600, env={"GROUP_EMBEDDING_HBM_ON_HOST": "1"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    parts = [dict(np.load(tmp_path / f"collective-{r}.npz"))
             for r in range(workers)]
    _assert_programs_equal(want, parts, workers)
    if storage in ("ssd", "hbm_dram"):
        # Keys were in the second tier (disk, host memory) at the end of
        # some programs.
        assert sum(p[f"s{s}/second_tier"].sum() for p in parts
                   for s in SEEDS.split(",")) > 0
