"""TF1 Saver checkpoints in collective mode with one checkpoint directory
for all workers (see `collective_tf1_saver.py`): each worker restores
exactly its own rows, refuses another worker's EV keys, and refuses a
checkpoint that not every worker completed."""

import os
import subprocess
import sys

import pytest
from test_collective_training import run_workers


def _run(phase, directory):
    result = run_workers(2, "collective_tf1_saver.py", "--phase", phase,
                         "--dir", directory)
    out = result.stdout + result.stderr
    # Keep the whole log: a failing worker's cause comes before the other
    # worker's (longer) stack trace of the exchange it was waiting on.
    assert result.returncode == 0, out[-30000:]
    assert out.count("ok: ") == 2, out[-4000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("shared") / "ckpt")
    os.makedirs(directory)
    _run("train", directory)
    # Worker 0 keeps the directory, worker 1 its worker-1 subdirectory.
    assert os.path.exists(os.path.join(directory, "checkpoint"))
    assert os.path.exists(os.path.join(directory, "worker-1", "checkpoint"))
    return directory


def test_each_worker_restores_its_own_rows(trained):
    _run("restore", trained)


def test_another_workers_ev_keys_are_refused(trained):
    _run("foreign", trained)


def test_a_checkpoint_not_every_worker_saved_is_refused(trained):
    # Last: worker 1's checkpoint state goes, as if its save had failed.
    os.remove(os.path.join(trained, "worker-1", "checkpoint"))
    _run("torn", trained)


_JOIN_PROBE = """
import time
import horovod.tensorflow as hvd
import group_embedding as ge
from group_embedding.distributed import worker_checkpoints
entered = []
init = hvd.init
def timed_init(*args, **kwargs):
    entered.append(time.time_ns())
    return init(*args, **kwargs)
hvd.init = timed_init
ge.enable_distributed_strategy("collective")
print("joined", worker_checkpoints._joined_ns[0], "init", entered[0])
"""


def test_the_job_start_precedes_every_workers_start_barrier():
    # A worker's checkpoint written after another worker's join instant
    # is taken for this run's; if a worker took that instant after the
    # start barrier, a faster worker's first save could predate it and the
    # slower one would refuse a fresh start (seen once in 3 runs under
    # load). The instant must be taken before hvd.init, the barrier.
    result = subprocess.run([sys.executable, "-c", _JOIN_PROBE],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-4000:]
    words = result.stdout.split()
    joined, entered = int(words[words.index("joined") + 1]), \
        int(words[words.index("init") + 1])
    assert 0 < joined <= entered
