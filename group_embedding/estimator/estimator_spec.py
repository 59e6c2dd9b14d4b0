"""`EstimatorSpec`: what a `model_fn` returns."""

import collections
from typing import Any
from typing import Dict

import tensorflow as tf

from group_embedding.estimator.mode_keys import SUPPORTED_MODES
from group_embedding.estimator.mode_keys import ModeKeys

_FIELDS = ("mode", "predictions", "loss", "train_op", "eval_metric_ops",
           "export_outputs", "training_chief_hooks", "training_hooks",
           "scaffold", "evaluation_hooks", "prediction_hooks")


def _check_hooks(name: str, hooks) -> tuple:
    hooks = tuple(hooks or ())
    for h in hooks:
        if not isinstance(h, tf.compat.v1.train.SessionRunHook):
            raise TypeError(f"`{name}` must hold SessionRunHooks, got "
                            f"{type(h).__name__}.")
    return hooks


def _check_metrics(metrics) -> Dict[str, Any]:
    metrics = dict(metrics or {})
    for key, value in metrics.items():
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise TypeError(
                f"`eval_metric_ops['{key}']` must be a (value_op, "
                "update_op) pair as returned by tf.compat.v1.metrics.*, "
                f"got {type(value).__name__}.")
    return metrics


class EstimatorSpec(collections.namedtuple("EstimatorSpec", [
        "mode", "predictions", "loss", "train_op", "eval_metric_ops",
        "export_outputs", "training_chief_hooks", "training_hooks",
        "scaffold", "evaluation_hooks", "prediction_hooks"])):
    """The ops and objects of a model in one mode (stock fields).

    Args:
        mode: a `ModeKeys` value, the mode `model_fn` was called in.
        predictions: a Tensor or dict of Tensors with batch dimension
            first; required in PREDICT mode.
        loss: scalar float Tensor; required in TRAIN and EVAL mode.
        train_op: the op that runs one training step (it must increment
            the global step, e.g. `optimizer.minimize(loss,
            global_step=tf.compat.v1.train.get_global_step())`); required
            in TRAIN mode.
        eval_metric_ops: dict name -> (value_op, update_op), e.g.
            `{"auc": tf.compat.v1.metrics.auc(labels, probs)}`; `loss` is
            reserved (evaluate adds the mean loss under that name).
        export_outputs: dict signature name -> `export.PredictOutput`;
            default: one `serving_default` signature of `predictions`.
        training_chief_hooks: hooks run by the chief (worker 0) in TRAIN.
        training_hooks: hooks run by every worker in TRAIN.
        scaffold: a `tf.compat.v1.train.Scaffold`; its saver, if set, is
            used for checkpoints.
        evaluation_hooks: hooks run in EVAL.
        prediction_hooks: hooks run in PREDICT.

    Raises:
        ValueError: unknown `mode`, or a field the mode requires is None.
        TypeError: a field of the wrong type.
    """

    def __new__(cls, mode, predictions=None, loss=None, train_op=None,
                eval_metric_ops=None, export_outputs=None,
                training_chief_hooks=None, training_hooks=None,
                scaffold=None, evaluation_hooks=None,
                prediction_hooks=None):
        if mode not in SUPPORTED_MODES:
            raise ValueError(f"Invalid `mode`: {mode!r}, use one of "
                             f"{', '.join(SUPPORTED_MODES)}.")
        if mode == ModeKeys.TRAIN and (loss is None or train_op is None):
            raise ValueError("EstimatorSpec in TRAIN mode needs `loss` and "
                             "`train_op`.")
        if mode == ModeKeys.EVAL and loss is None:
            raise ValueError("EstimatorSpec in EVAL mode needs `loss`.")
        if mode == ModeKeys.PREDICT and predictions is None:
            raise ValueError("EstimatorSpec in PREDICT mode needs "
                             "`predictions`.")
        if loss is not None:
            loss = tf.convert_to_tensor(loss)
            if loss.shape.rank not in (None, 0):
                raise ValueError("`loss` must be a scalar, got shape "
                                 f"{loss.shape}.")
        if scaffold is not None and not isinstance(
                scaffold, tf.compat.v1.train.Scaffold):
            raise TypeError("`scaffold` must be a tf.compat.v1.train."
                            f"Scaffold, got {type(scaffold).__name__}.")
        if export_outputs is not None and not isinstance(export_outputs,
                                                         dict):
            raise TypeError("`export_outputs` must be a dict, got "
                            f"{type(export_outputs).__name__}.")
        return super().__new__(
            cls, mode, predictions, loss, train_op,
            _check_metrics(eval_metric_ops), export_outputs,
            _check_hooks("training_chief_hooks", training_chief_hooks),
            _check_hooks("training_hooks", training_hooks), scaffold,
            _check_hooks("evaluation_hooks", evaluation_hooks),
            _check_hooks("prediction_hooks", prediction_hooks))
