"""`RunConfig`: where and how often an Estimator checkpoints."""

import dataclasses
from typing import Any
from typing import Optional

from group_embedding import model_parallel

DEFAULT_SAVE_CHECKPOINTS_SECS = 600


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The stock `tf.estimator.RunConfig` fields that apply to one process
    (or one Horovod worker).

    Args:
        model_dir: checkpoint directory (default None: the Estimator's).
        tf_random_seed: graph-level seed set in every graph (default None).
        save_summary_steps: write summaries every N steps (default 100;
            None or 0 disables them). Worker 0 only.
        save_checkpoints_steps: checkpoint every N steps (default None).
        save_checkpoints_secs: checkpoint every N seconds (default 600 when
            `save_checkpoints_steps` is None too; set only one). A final
            checkpoint is always written when `train` returns.
        session_config: a `tf.compat.v1.ConfigProto` for the sessions.
        keep_checkpoint_max: newest checkpoints kept (default 5).
        keep_checkpoint_every_n_hours: also keep one per N hours (default
            10000, i.e. never).
        log_step_count_steps: log loss and step every N steps (default
            100; None disables).

    Raises:
        ValueError: both checkpoint intervals set, or a negative value.

    Note: distribution fields (`train_distribute`, cluster specs) are not
    provided: collective training is Horovod's, see `Estimator`.
    """

    model_dir: Optional[str] = None
    tf_random_seed: Optional[int] = None
    save_summary_steps: Optional[int] = 100
    save_checkpoints_steps: Optional[int] = None
    save_checkpoints_secs: Optional[int] = None
    session_config: Any = None
    keep_checkpoint_max: int = 5
    keep_checkpoint_every_n_hours: float = 10000
    log_step_count_steps: Optional[int] = 100

    def __post_init__(self):
        if (self.save_checkpoints_steps is not None
                and self.save_checkpoints_secs is not None):
            raise ValueError(
                "Set only one of `save_checkpoints_steps` "
                f"({self.save_checkpoints_steps}) and "
                f"`save_checkpoints_secs` ({self.save_checkpoints_secs}).")
        if self.save_checkpoints_steps is None and \
                self.save_checkpoints_secs is None:
            object.__setattr__(self, "save_checkpoints_secs",
                               DEFAULT_SAVE_CHECKPOINTS_SECS)
        for name in ("save_summary_steps", "save_checkpoints_steps",
                     "save_checkpoints_secs", "log_step_count_steps",
                     "keep_checkpoint_max"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"`{name}` must be >= 0, got {value}.")

    def replace(self, **kwargs) -> "RunConfig":
        """A copy with the given fields changed (stock `replace`).

        Setting one checkpoint interval clears the other.
        """
        if "save_checkpoints_steps" in kwargs:
            kwargs.setdefault("save_checkpoints_secs", None)
        elif "save_checkpoints_secs" in kwargs:
            kwargs.setdefault("save_checkpoints_steps", None)
        return dataclasses.replace(self, **kwargs)

    @property
    def is_chief(self) -> bool:
        """True on Horovod worker 0 (and outside collective mode)."""
        return model_parallel.world()[0] == 0

    @property
    def task_id(self) -> int:
        """This worker's Horovod rank (0 outside collective mode)."""
        return model_parallel.world()[0]

    @property
    def num_worker_replicas(self) -> int:
        """The number of Horovod workers (1 outside collective mode)."""
        return model_parallel.world()[1]
