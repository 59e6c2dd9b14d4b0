"""Collective training under horovodrun equals the single-process run.

collective_train.py checks, on every worker, the global loss of each of 20
steps and every shard row, replicated table and dense weight against a
single-process reference trained on the whole batch; any mismatch makes
horovodrun exit non-zero.
"""

import os
import subprocess
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [
    pytest.param(2, "mod", "adagrad", False, id="np2-mod-adagrad"),
    pytest.param(2, "div", "adam", False, id="np2-div-adam"),
    pytest.param(3, "mod", "adam", True, id="np3-mod-adam-uneven"),
    pytest.param(3, "div", "adagrad", True, id="np3-div-adagrad-uneven"),
]
# ge.distributed.exchange_ids pipelining: the next batch's ids travel
# during the step; every number must stay the same.
PIPELINE_CASES = [
    pytest.param(2, "mod", "adagrad", False, id="np2-mod-adagrad-pipeline"),
    pytest.param(3, "div", "adam", True, id="np3-div-adam-uneven-pipeline"),
]
# Sharding choices (collective_train.py --placement): every table whole on
# one worker, and the planner's mix (replicated, table-wise, row-sharded).
# GROUP_EMBEDDING_KERNELS=tf runs the pure-TF routing instead of the C++.
PLACEMENT_CASES = [
    pytest.param(2, "table", "mod", "adagrad", False, "auto",
                 id="np2-table-adagrad"),
    pytest.param(3, "table", "div", "adam", True, "auto",
                 id="np3-table-adam-uneven"),
    pytest.param(3, "plan", "mod", "adam", True, "auto",
                 id="np3-plan-adam-uneven"),
    pytest.param(2, "plan", "div", "adagrad", False, "tf",
                 id="np2-plan-adagrad-tf-kernels"),
]


def run_workers(workers, script, *args, timeout=300, env=None):
    """Runs `script` under horovodrun; returns the CompletedProcess.

    `env`: extra environment variables for the workers."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return subprocess.run(
        [horovodrun, "-np", str(workers), "--gloo", sys.executable,
         os.path.join(_HERE, script), *args],
        capture_output=True, text=True, timeout=timeout,
        env=None if env is None else {**os.environ, **env})


def assert_equals_single_process(workers, partition, optimizer, uneven,
                                 *extra, transport="sockets", env=None):
    """collective_train.py on `workers` passes its parity checks, with
    its exchanges over `transport` ("sockets" or "horovod") and `env`
    (extra environment variables)."""
    args = ["--partition", partition, "--optimizer", optimizer, *extra]
    if uneven:
        args.append("--uneven")
    env = dict(env or {})
    if transport == "horovod":
        env["GROUP_EMBEDDING_TRANSPORT"] = "horovod"
    result = run_workers(workers, "collective_train.py", *args,
                         env=env or None)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count("equal the single-process run") == workers, out[-4000:]
    assert out.count(f"transport: {transport}") == workers, out[-4000:]


@pytest.mark.parametrize("workers,partition,optimizer,uneven", CASES)
def test_equals_single_process(workers, partition, optimizer, uneven):
    assert_equals_single_process(workers, partition, optimizer, uneven)


@pytest.mark.parametrize("workers,uneven", [(2, False), (3, True)])
def test_horovod_transport_equals_single_process(workers, uneven):
    # The default exchanges go over peer sockets (transport.py); Horovod's
    # alltoall stays available and must give the same numbers.
    assert_equals_single_process(workers, "mod", "adagrad", uneven,
                                 transport="horovod")


@pytest.mark.parametrize("workers,partition,optimizer,uneven",
                         PIPELINE_CASES)
def test_pipelined_equals_single_process(workers, partition, optimizer,
                                         uneven):
    assert_equals_single_process(workers, partition, optimizer, uneven,
                                 "--pipeline")


@pytest.mark.parametrize("workers,placement,partition,optimizer,uneven,"
                         "kernels", PLACEMENT_CASES)
def test_placements_equal_single_process(workers, placement, partition,
                                         optimizer, uneven, kernels):
    # The peer sockets are a C++ op too: without kernels, Horovod. The
    # planner's mix also runs with `concat_outputs=True` (replicated
    # tables concatenated by the kernel, sharded ones by tf.concat).
    extra = ("--concat",) if placement == "plan" else ()
    assert_equals_single_process(
        workers, partition, optimizer, uneven, "--placement", placement,
        *extra, transport="horovod" if kernels == "tf" else "sockets",
        env={"GROUP_EMBEDDING_KERNELS": kernels})


# The EV's table in GPU memory (StorageType.HBM, on the CUDA core's host
# stand-in here): the owner of a key looks it up and updates it with the
# HBM ops; every number equals the single-process run's.
# hbm_dram: a 128-key GPU table per worker over 2000 ids, so that keys
# move to the host tier and back.
HBM_CASES = [
    pytest.param(2, "mod", "adagrad", False, "hbm", id="np2-mod-adagrad-hbm"),
    pytest.param(3, "div", "adam", True, "hbm", id="np3-div-adam-uneven-hbm"),
    pytest.param(2, "mod", "adagrad", False, "hbm_dram",
                 id="np2-mod-adagrad-hbm-dram"),
]


@pytest.mark.parametrize("workers,partition,optimizer,uneven,storage",
                         HBM_CASES)
def test_hbm_ev_equals_single_process(workers, partition, optimizer, uneven,
                                      storage):
    args = ["--partition", partition, "--optimizer", optimizer,
            "--ev-storage", storage] + (["--uneven"] if uneven else [])
    if storage == "hbm_dram":
        args += ["--ev-vocab", "2000"]
    result = run_workers(workers, "collective_train.py", *args,
                         env={"GROUP_EMBEDDING_HBM_ON_HOST": "1"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count("equal the single-process run") == workers, out[-4000:]
    assert out.count(f"{storage} EV)") == workers, out[-4000:]
