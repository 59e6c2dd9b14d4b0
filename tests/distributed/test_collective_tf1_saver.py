"""TF1 Saver checkpoints in collective mode with one checkpoint directory
for all workers (see `collective_tf1_saver.py`): each worker restores
exactly its own rows, refuses another worker's EV keys, and refuses a
checkpoint that not every worker completed."""

import os

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
