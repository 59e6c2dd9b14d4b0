"""One set of TF1 checkpoint files per worker in collective mode.

Every worker holds different rows (its shards, the EV keys it owns), yet a
script written for one process, or DeepRec's model zoo under `horovodrun`,
gives every worker the same `checkpoint_dir`. Left alone, every worker's
`Saver` writes its own shard to the same files: the last writer wins, and
at restore a worker silently loads another worker's shard.

Once `enable_distributed_strategy("collective")` runs with N > 1 workers,
`install()` makes `tf.compat.v1.train.Saver` and the checkpoint-state
lookups (`tf.train.latest_checkpoint`, `get_checkpoint_state`, hence
`MonitoredTrainingSession` and `ge.estimator`) keep worker R > 0's files in
`<dir>/worker-R/`; worker 0 keeps `<dir>`. A restore then checks the layout
and refuses, naming the directories, what it cannot restore exactly:

- a worker with no checkpoint of its own while another worker has one;
- workers whose latest checkpoints differ (a save that did not complete on
  every worker), comparing the checkpoint states that predate this run;
- `worker-R` directories of more workers than are running (use
  `ge.save_tables` / `ge.restore_tables` to change the worker count).

EmbeddingVariables also refuse, at restore, keys another worker owns
(`EmbeddingVariable._check_restored_keys`), whatever saved them.
"""

import os
import re
from typing import Any
from typing import Dict
from typing import List
from typing import Optional

from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.platform import gfile
from tensorflow.python.training import saver as saver_lib

from group_embedding import model_parallel

WORKER_DIR = "worker-{}"
_WORKER_DIR_RE = re.compile(r"worker-(\d+)")
# Workers start and save at different moments: at a fresh start one may
# have saved its first checkpoint before another looks. Only checkpoint
# states older than the job's start (see `install`) are compared.
_originals: Dict[str, Any] = {}
_joined_ns = [0]


def worker_dir(directory: str, rank: int) -> str:
    """Where worker `rank` keeps its checkpoints of `directory`: the
    directory itself for worker 0, `directory/worker-R` otherwise."""
    if rank == 0 or _is_worker_dir(directory, rank):
        return directory
    return os.path.join(directory, WORKER_DIR.format(rank))


def _is_worker_dir(directory: str, rank: int) -> bool:
    # Paths already inside this worker's directory (ge.estimator passes
    # them) are not moved a second time.
    return os.path.basename(os.path.normpath(directory)) == \
        WORKER_DIR.format(rank)


def _chief_dir(directory: str, rank: int) -> str:
    return (os.path.dirname(os.path.normpath(directory))
            if rank > 0 and _is_worker_dir(directory, rank) else directory)


def _latest(directory: str) -> Optional[str]:
    state = _originals["get_checkpoint_state"](directory)
    return state.model_checkpoint_path if state else None


def _worker_dirs(chief_dir: str) -> List[int]:
    if not gfile.IsDirectory(chief_dir):
        return []
    return sorted(int(m.group(1)) for m in map(
        _WORKER_DIR_RE.fullmatch, gfile.ListDirectory(chief_dir)) if m)


def check_layout(directory: str) -> None:
    """Refuses a collective restore from `directory` (the chief's
    directory or a worker's) that could not be exact.

    Raises:
        ValueError: naming the directories, when workers' latest
            checkpoints differ, a worker lacks one the chief has, or the
            directory holds checkpoints of more workers than are running.
    """
    rank, size = model_parallel.world()
    if size == 1:
        return
    chief = _chief_dir(directory, rank)
    extra = [r for r in _worker_dirs(chief) if r >= size]
    if extra and _latest(chief) is not None:
        raise ValueError(
            f"Checkpoint directory {chief} holds checkpoints of "
            f"{max(extra) + 1} or more workers "
            f"({', '.join(WORKER_DIR.format(r) for r in extra)}) but "
            f"{size} are running: resume with the worker count that wrote "
            "it, or change the count with ge.save_tables / "
            "ge.restore_tables.")
    names = _latest_names(chief, size)
    if len(set(names.values())) > 1:
        listing = ", ".join(f"worker {r}: {n or 'none'}"
                            for r, n in names.items())
        raise ValueError(
            f"Worker {rank} of {size}: the workers' latest checkpoints in "
            f"{chief} differ ({listing}); a save did not complete on "
            "every worker, or the directory holds a single-process "
            "checkpoint. Restore every worker from a checkpoint they all "
            "have (Saver.restore with its path), or start afresh.")


def _latest_names(chief: str, size: int) -> Dict[int, Optional[str]]:
    """Worker -> basename of its latest checkpoint (None: none), for the
    workers whose checkpoint state predates this worker's joining."""
    names = {}
    for r in range(size):
        directory = worker_dir(chief, r)
        state = os.path.join(directory, "checkpoint")
        # gfile's mtime has whole seconds (st_mtime * 1e9 on local
        # files): a state written within a second after the start reads
        # as older, hence the second of slack.
        if gfile.Exists(state) and \
                gfile.Stat(state).mtime_nsec >= _joined_ns[0] - 10 ** 9:
            continue  # written during this run
        path = _latest(directory)
        names[r] = os.path.basename(path) if path else None
    return names


def _get_checkpoint_state(checkpoint_dir, latest_filename=None):
    rank, size = model_parallel.world()
    if size > 1:
        check_layout(checkpoint_dir)
        checkpoint_dir = worker_dir(checkpoint_dir, rank)
    return _originals["get_checkpoint_state"](checkpoint_dir,
                                              latest_filename)


def _save(self, sess, save_path, *args, **kwargs):
    rank, size = model_parallel.world()
    if size > 1 and save_path:
        directory = worker_dir(os.path.dirname(save_path) or ".", rank)
        gfile.MakeDirs(directory)
        save_path = os.path.join(directory, os.path.basename(save_path))
    return _originals["save"](self, sess, save_path, *args, **kwargs)


def _restore(self, sess, save_path):
    rank, size = model_parallel.world()
    if size > 1 and save_path:
        directory = os.path.dirname(save_path) or "."
        mine = os.path.join(worker_dir(directory, rank),
                            os.path.basename(save_path))
        # A path of the chief's directory means this worker's copy of
        # that checkpoint; other paths (a single-process checkpoint to
        # warm-start from) are read as given, and EVs refuse keys that
        # this worker does not own.
        if mine != save_path and (
                checkpoint_management.checkpoint_exists_internal(mine)
                or _worker_dirs(directory)):
            if not checkpoint_management.checkpoint_exists_internal(mine):
                raise ValueError(
                    f"Worker {rank} of {size} has no checkpoint {mine} "
                    f"for {save_path}: every worker saves its own shard "
                    f"into {WORKER_DIR.format('R')}; restore with the "
                    "worker count that wrote it.")
            save_path = mine
    return _originals["restore"](self, sess, save_path)


def install(joined_ns: int) -> None:
    """Routes TF1 Saver files and checkpoint lookups per worker (see the
    module docstring). Idempotent; a no-op outside collective mode.

    Args:
        joined_ns: `time.time_ns()` taken before the job's start barrier
            (`hvd.init()`), so that it precedes every save of this job on
            every worker: checkpoint states written later belong to this
            run and are not compared. (A worker that takes it after the
            barrier may already find the first checkpoint of a faster
            worker, and refuse it as a save this worker did not make.)
    """
    if _originals:
        return
    _joined_ns[0] = joined_ns
    _originals["get_checkpoint_state"] = \
        checkpoint_management.get_checkpoint_state
    _originals["save"] = saver_lib.Saver.save
    _originals["restore"] = saver_lib.Saver.restore
    # `latest_checkpoint` and the session manager look the function up in
    # the module at call time.
    checkpoint_management.get_checkpoint_state = _get_checkpoint_state
    saver_lib.get_checkpoint_state = _get_checkpoint_state
    saver_lib.Saver.save = _save
    saver_lib.Saver.restore = _restore
