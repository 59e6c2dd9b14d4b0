"""`TrainSpec`, `EvalSpec` and `train_and_evaluate` (stock local mode)."""

import dataclasses
import time
from typing import Any
from typing import Callable
from typing import Optional
from typing import Sequence

import tensorflow as tf

from group_embedding.distributed import strategy as distributed_strategy


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """What `train_and_evaluate` trains on.

    Args:
        input_fn: as for `Estimator.train`.
        max_steps: train until the global step reaches this (default None:
            until `input_fn` is exhausted).
        hooks: extra `SessionRunHook`s (default none).
        saving_listeners: extra `CheckpointSaverListener`s (default none).

    Raises:
        TypeError: `input_fn` not callable.
        ValueError: `max_steps` <= 0.
    """

    input_fn: Callable
    max_steps: Optional[int] = None
    hooks: Sequence[Any] = ()
    saving_listeners: Sequence[Any] = ()

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError("`input_fn` must be callable, got "
                            f"{type(self.input_fn).__name__}.")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ValueError(f"`max_steps` must be > 0, got "
                             f"{self.max_steps}.")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What `train_and_evaluate` evaluates on, and when.

    Args:
        input_fn: as for `Estimator.evaluate`.
        steps: batches per evaluation (default 100; None: until the input
            is exhausted).
        name: passed to `Estimator.evaluate` (default None).
        hooks: extra `SessionRunHook`s (default none).
        exporters: must be empty (call `export_saved_model` afterwards).
        start_delay_secs: accepted for compatibility (default 120); local
            evaluation follows checkpoints, not a clock.
        throttle_secs: evaluate after a checkpoint save only if this many
            seconds passed since the last evaluation (default 600).

    Raises:
        TypeError: `input_fn` not callable.
        ValueError: `steps` <= 0 or negative `throttle_secs`.
        NotImplementedError: `exporters` given.
    """

    input_fn: Callable
    steps: Optional[int] = 100
    name: Optional[str] = None
    hooks: Sequence[Any] = ()
    exporters: Sequence[Any] = ()
    start_delay_secs: int = 120
    throttle_secs: int = 600

    def __post_init__(self):
        if not callable(self.input_fn):
            raise TypeError("`input_fn` must be callable, got "
                            f"{type(self.input_fn).__name__}.")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"`steps` must be > 0, got {self.steps}.")
        if self.throttle_secs < 0:
            raise ValueError("`throttle_secs` must be >= 0, got "
                             f"{self.throttle_secs}.")
        if self.exporters:
            raise NotImplementedError(
                "`exporters` are not supported; call "
                "Estimator.export_saved_model after train_and_evaluate.")


class _EvaluateAfterSave(tf.compat.v1.train.CheckpointSaverListener):
    """Evaluates after a checkpoint save, at most once per throttle."""

    def __init__(self, estimator, eval_spec: EvalSpec):
        self._estimator = estimator
        self._spec = eval_spec
        self._last = None
        self.result = None

    def evaluate(self):
        spec = self._spec
        self.result = self._estimator.evaluate(
            spec.input_fn, steps=spec.steps, hooks=list(spec.hooks),
            name=spec.name)
        self._last = time.time()
        tf.compat.v1.logging.info("Evaluation at step %s: %s",
                                  self.result.get("global_step"),
                                  self.result)

    def after_save(self, session, global_step_value):
        del session, global_step_value
        if self._last is None or \
                time.time() - self._last >= self._spec.throttle_secs:
            self.evaluate()


def train_and_evaluate(estimator, train_spec: TrainSpec,
                       eval_spec: EvalSpec):
    """Trains `estimator`, evaluating as checkpoints are saved.

    Local mode of stock `tf.estimator.train_and_evaluate`: evaluation runs
    after a checkpoint save when `throttle_secs` have passed since the
    previous one, and always once at the end, on the final checkpoint.
    In collective mode evaluation runs only at the end (every worker must
    evaluate together).

    Args:
        estimator: a `ge.estimator.Estimator`.
        train_spec: a `TrainSpec`.
        eval_spec: an `EvalSpec`.

    Returns:
        (the final evaluation's metrics dict, [] export results).

    Raises:
        TypeError: wrong argument types.
    """
    if not isinstance(train_spec, TrainSpec):
        raise TypeError("`train_spec` must be a TrainSpec, got "
                        f"{type(train_spec).__name__}.")
    if not isinstance(eval_spec, EvalSpec):
        raise TypeError("`eval_spec` must be an EvalSpec, got "
                        f"{type(eval_spec).__name__}.")
    listener = _EvaluateAfterSave(estimator, eval_spec)
    listeners = list(train_spec.saving_listeners)
    if not distributed_strategy.is_collective():
        listeners.append(listener)
    estimator.train(train_spec.input_fn, hooks=list(train_spec.hooks),
                    max_steps=train_spec.max_steps,
                    saving_listeners=listeners)
    final_step = tf.train.load_variable(estimator.latest_checkpoint(),
                                        "global_step")
    if listener.result is None or \
            listener.result.get("global_step") != final_step:
        listener.evaluate()
    return listener.result, []
