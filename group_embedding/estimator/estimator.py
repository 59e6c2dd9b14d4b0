"""`Estimator`: stock tf.estimator's train / evaluate / predict / export
loop for TF 2.21, which no longer ships `tf.estimator`.

Each call builds a fresh TF1 graph, calls `model_fn`, and runs it with
`tf.compat.v1.train.MonitoredTrainingSession` (train) or `MonitoredSession`
(evaluate, predict), restoring the latest checkpoint of `model_dir`.
EmbeddingVariables are in the graph's SAVEABLE_OBJECTS, so the checkpoints
hold their keys, values, frequencies and optimizer slots.
"""

import inspect
import os
import tempfile
from typing import Any
from typing import Dict
from typing import Iterator
from typing import Optional

import numpy as np
import tensorflow as tf
import tensorflow.compat.v1 as _v1

from group_embedding import model_parallel
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed import worker_checkpoints
from group_embedding.distributed.training import BroadcastVariablesHook
from group_embedding.estimator.estimator_spec import EstimatorSpec
from group_embedding.estimator.export import PredictOutput
from group_embedding.estimator.export import ServingInputReceiver
from group_embedding.estimator.mode_keys import ModeKeys
from group_embedding.estimator.run_config import RunConfig
from group_embedding.export import frozen_graph

LOSS_METRIC_KEY = "loss"
GLOBAL_STEP_KEY = "global_step"


class _IteratorInitHook(_v1.train.SessionRunHook):
    """Initialises the input iterator once the session exists."""

    def __init__(self, iterator):
        self._iterator = iterator

    def after_create_session(self, session, coord):
        del coord
        session.run(self._iterator.initializer)


class _FinalValuesHook(_v1.train.SessionRunHook):
    """Reads the metric values when evaluation ends (input exhausted or
    `steps` done), after summing metric state over workers if needed."""

    def __init__(self, values, sync_op):
        self._values = values
        self._sync_op = sync_op
        self.result = None

    def end(self, session):
        if self._sync_op is not None:
            session.run(self._sync_op)
        self.result = session.run(self._values)


def _sum_metric_state_over_workers():
    """Collective mode: every worker evaluated its slice; summing the
    metric variables (counts, sums, confusion matrices) makes every
    worker's values those of the whole input."""
    if not distributed_strategy.is_collective():
        return None
    hvd = distributed_strategy.horovod()
    assigns = []
    for i, v in enumerate(_v1.get_collection(
            _v1.GraphKeys.METRIC_VARIABLES)):
        total = hvd.allreduce(v.read_value() if hasattr(v, "read_value")
                              else tf.identity(v), op=hvd.Sum,
                              name=f"ge_eval_metric_{i}")
        assigns.append(_v1.assign(v, total))
    return tf.group(*assigns) if assigns else None


class Estimator:
    """Trains, evaluates, predicts with and exports a `model_fn` model.

    `model_fn(features, labels, mode, params, config)` (every argument but
    `features` optional, matched by name) builds the model in a TF1 graph
    and returns an `EstimatorSpec`. It may use `ge.feature_column.
    input_layer` with EmbeddingVariable columns and the `ge.train`
    optimizers (or, after `import group_embedding.compat`, the DeepRec
    names `tf.feature_column.*` and `tf.train.*Optimizer`).

    Example::

        def model_fn(features, labels, mode, params):
            x = ge.feature_column.input_layer(
                features, columns, training=mode == ModeKeys.TRAIN)
            logits = ...
            if mode == ModeKeys.PREDICT:
                return EstimatorSpec(mode, predictions={"p": probs})
            loss = ...
            if mode == ModeKeys.EVAL:
                return EstimatorSpec(mode, loss=loss, eval_metric_ops={
                    "auc": tf.compat.v1.metrics.auc(labels, probs)})
            step = tf.compat.v1.train.get_global_step()
            return EstimatorSpec(mode, loss=loss, train_op=ge.train.
                AdagradOptimizer(0.1).minimize(loss, global_step=step))

        est = Estimator(model_fn, "/tmp/model", params={})
        est.train(train_input_fn, max_steps=1000)
        est.evaluate(eval_input_fn)        # {"auc": ..., "loss": ..., ...}
        est.export_saved_model("/tmp/export", serving_input_receiver_fn)

    Args:
        model_fn: the model function (see above).
        model_dir: checkpoint directory; default `config.model_dir`, else
            a new temporary directory.
        config: a `RunConfig` (default `RunConfig()`).
        params: dict passed to `model_fn` as `params` (default {}).
        warm_start_from: must be None.

    Raises:
        TypeError: `model_fn` not callable, `config` not a RunConfig, or
            `model_fn` without a `features` argument.
        ValueError: `model_dir` differs from `config.model_dir`.
        NotImplementedError: `warm_start_from` given.

    Collective mode (Horovod):
        After `ge.enable_distributed_strategy("collective")`, run the
        same script on every worker (`horovodrun -np N`), each worker's
        input_fn giving its slice of every global batch, and wrap the
        optimizer in `ge.DistributedOptimizer` inside `model_fn`. `train`
        adds `ge.BroadcastVariablesHook`; `evaluate` sums the metric state
        over workers, so every worker returns the metrics of all the
        evaluation data. Every worker must run the same number of steps.

    Note: worker 0 writes `model_dir` (checkpoints, summaries); in
    collective mode each worker R > 0 also checkpoints its own table
    shards and EV keys into `model_dir/worker-R`, so resuming needs the
    same worker count. `export_saved_model` runs in a single process.

    Note: unlike stock, `evaluate` writes no eval summaries, and only
    `PredictOutput` export outputs are supported.
    """

    def __init__(self, model_fn, model_dir: Optional[str] = None,
                 config: Optional[RunConfig] = None,
                 params: Optional[Dict[str, Any]] = None,
                 warm_start_from=None):
        if not callable(model_fn):
            raise TypeError("`model_fn` must be callable, got "
                            f"{type(model_fn).__name__}.")
        self._model_fn_args = inspect.signature(model_fn).parameters
        if "features" not in self._model_fn_args:
            raise TypeError("`model_fn` must have a `features` argument; "
                            f"it has ({', '.join(self._model_fn_args)}).")
        if warm_start_from is not None:
            raise NotImplementedError(
                "`warm_start_from` is not supported; restore the tables "
                "from a checkpoint in model_fn instead.")
        config = RunConfig() if config is None else config
        if not isinstance(config, RunConfig):
            raise TypeError("`config` must be a ge.estimator.RunConfig, "
                            f"got {type(config).__name__}.")
        if model_dir is not None and config.model_dir is not None and \
                os.path.abspath(model_dir) != os.path.abspath(
                    config.model_dir):
            raise ValueError(f"`model_dir` {model_dir!r} differs from "
                             f"`config.model_dir` {config.model_dir!r}.")
        model_dir = model_dir or config.model_dir or tempfile.mkdtemp(
            prefix="ge_estimator_")
        self._model_fn = model_fn
        self._model_dir = model_dir
        self._config = config.replace(model_dir=model_dir)
        self._params = dict(params or {})

    @property
    def model_dir(self) -> str:
        """The checkpoint directory."""
        return self._model_dir

    @property
    def config(self) -> RunConfig:
        """The `RunConfig`, with `model_dir` set."""
        return self._config

    @property
    def params(self) -> Dict[str, Any]:
        """A copy of the `params` passed to `model_fn`."""
        return dict(self._params)

    def checkpoint_dir(self) -> str:
        """Where this worker's checkpoints go: `model_dir`, or
        `model_dir/worker-R` for collective worker R > 0."""
        rank, _ = model_parallel.world()
        return worker_checkpoints.worker_dir(self._model_dir, rank)

    def latest_checkpoint(self) -> Optional[str]:
        """Path of this worker's newest checkpoint, or None."""
        return tf.train.latest_checkpoint(self.checkpoint_dir())

    def get_variable_names(self):
        """Names of the variables in the latest checkpoint."""
        return [name for name, _ in
                tf.train.list_variables(self._require_checkpoint(None))]

    def get_variable_value(self, name: str) -> np.ndarray:
        """The value of checkpoint variable `name`."""
        return tf.train.load_variable(self._require_checkpoint(None), name)

    # --- graph building -------------------------------------------------
    def _require_checkpoint(self, checkpoint_path):
        path = checkpoint_path or self.latest_checkpoint()
        if path is None:
            raise ValueError(f"Could not find a trained model in "
                             f"{self.checkpoint_dir()}; train first or "
                             "pass `checkpoint_path`.")
        return path

    def _check_worker_layout(self):
        """Collective resume: every worker has the same latest checkpoint
        (see `worker_checkpoints.check_layout`)."""
        worker_checkpoints.check_layout(self._model_dir)

    def _call_input_fn(self, input_fn, mode):
        args = inspect.signature(input_fn).parameters
        kwargs = {}
        if "mode" in args:
            kwargs["mode"] = mode
        if "params" in args:
            kwargs["params"] = self.params
        if "config" in args:
            kwargs["config"] = self._config
        result = input_fn(**kwargs)
        hooks = []
        if isinstance(result, tf.data.Dataset):
            iterator = _v1.data.make_initializable_iterator(result)
            hooks.append(_IteratorInitHook(iterator))
            result = iterator.get_next()
        if isinstance(result, (tuple, list)):
            if len(result) != 2:
                raise ValueError(
                    "`input_fn` must return features, (features, labels) "
                    f"or a Dataset of them; got a {len(result)}-tuple.")
            return result[0], result[1], hooks
        return result, None, hooks

    def _call_model_fn(self, features, labels, mode) -> EstimatorSpec:
        kwargs = {}
        if "labels" in self._model_fn_args:
            kwargs["labels"] = labels
        elif labels is not None:
            raise ValueError("`input_fn` returned labels but `model_fn` "
                             "has no `labels` argument.")
        if "mode" in self._model_fn_args:
            kwargs["mode"] = mode
        if "params" in self._model_fn_args:
            kwargs["params"] = self.params
        if "config" in self._model_fn_args:
            kwargs["config"] = self._config
        spec = self._model_fn(features=features, **kwargs)
        if not isinstance(spec, EstimatorSpec):
            raise TypeError("`model_fn` must return an EstimatorSpec, got "
                            f"{type(spec).__name__}.")
        if spec.mode != mode:
            raise ValueError(f"`model_fn` was called in mode {mode!r} but "
                             f"returned an EstimatorSpec for {spec.mode!r}.")
        return spec

    def _new_graph(self) -> tf.Graph:
        graph = tf.Graph()
        with graph.as_default():
            if self._config.tf_random_seed is not None:
                _v1.set_random_seed(self._config.tf_random_seed)
            _v1.train.get_or_create_global_step()
        return graph

    def _saver(self, spec: EstimatorSpec):
        if spec.scaffold is not None and spec.scaffold.saver is not None:
            return spec.scaffold.saver
        # var_list=None: global variables plus SAVEABLE_OBJECTS (the EVs).
        return _v1.train.Saver(
            sharded=True, allow_empty=True, save_relative_paths=True,
            max_to_keep=self._config.keep_checkpoint_max,
            keep_checkpoint_every_n_hours=(
                self._config.keep_checkpoint_every_n_hours))

    def _scaffold(self, spec: EstimatorSpec):
        return _v1.train.Scaffold(saver=self._saver(spec),
                                  copy_from_scaffold=spec.scaffold)

    def _session_creator(self, spec, checkpoint_path):
        return _v1.train.ChiefSessionCreator(
            scaffold=self._scaffold(spec),
            checkpoint_filename_with_path=checkpoint_path,
            config=self._config.session_config)

    # --- public loop ----------------------------------------------------
    def train(self, input_fn, hooks=None, steps: Optional[int] = None,
              max_steps: Optional[int] = None, saving_listeners=None
              ) -> "Estimator":
        """Trains from the latest checkpoint (or from scratch).

        Args:
            input_fn: returns a `tf.data.Dataset` of (features, labels) or
                of features, or a (features, labels) pair of tensors;
                may take `mode`, `params`, `config` arguments.
            hooks: extra `SessionRunHook`s.
            steps: train this many more steps (default None).
            max_steps: train until the global step reaches this (default
                None); set at most one of `steps` and `max_steps`. With
                neither, train until `input_fn` is exhausted.
            saving_listeners: `CheckpointSaverListener`s (worker 0).

        Returns:
            self.

        Raises:
            ValueError: both `steps` and `max_steps`, a value <= 0, or
                (collective) checkpoints of another worker count.
        """
        if steps is not None and max_steps is not None:
            raise ValueError("Set only one of `steps` and `max_steps`, got "
                             f"steps={steps}, max_steps={max_steps}.")
        for name, value in (("steps", steps), ("max_steps", max_steps)):
            if value is not None and value <= 0:
                raise ValueError(f"`{name}` must be > 0, got {value}.")
        self._check_worker_layout()
        latest = self.latest_checkpoint()
        if max_steps is not None and latest is not None and \
                tf.train.load_variable(latest, GLOBAL_STEP_KEY) >= max_steps:
            return self  # stock: nothing to do
        config = self._config
        chief = config.is_chief
        with self._new_graph().as_default():
            features, labels, input_hooks = self._call_input_fn(
                input_fn, ModeKeys.TRAIN)
            spec = self._call_model_fn(features, labels, ModeKeys.TRAIN)
            step = _v1.train.get_global_step()
            all_hooks = list(input_hooks) + list(hooks or []) + list(
                spec.training_hooks) + [
                _v1.train.StopAtStepHook(num_steps=steps,
                                         last_step=max_steps)
                if steps or max_steps else None,
                _v1.train.NanTensorHook(spec.loss),
                _v1.train.LoggingTensorHook(
                    {"loss": spec.loss, "step": step},
                    every_n_iter=config.log_step_count_steps)
                if config.log_step_count_steps and chief else None]
            if distributed_strategy.is_collective():
                all_hooks.append(BroadcastVariablesHook(0))
            scaffold = self._scaffold(spec)
            # Worker R > 0 saves only into its own worker-R directory.
            saver_hooks = [_v1.train.CheckpointSaverHook(
                self.checkpoint_dir(),
                save_secs=config.save_checkpoints_secs,
                save_steps=config.save_checkpoints_steps,
                scaffold=scaffold,
                listeners=saving_listeners if chief else None)]
            chief_hooks = list(spec.training_chief_hooks) if chief else []
            with _v1.train.MonitoredTrainingSession(
                    checkpoint_dir=self.checkpoint_dir(), scaffold=scaffold,
                    hooks=[h for h in all_hooks if h is not None],
                    chief_only_hooks=chief_hooks + saver_hooks,
                    save_checkpoint_secs=None, save_checkpoint_steps=None,
                    save_summaries_steps=(config.save_summary_steps or None)
                    if chief else None,
                    save_summaries_secs=None, log_step_count_steps=None,
                    config=config.session_config) as session:
                while not session.should_stop():
                    session.run(spec.train_op)
        return self

    def evaluate(self, input_fn, steps: Optional[int] = None, hooks=None,
                 checkpoint_path: Optional[str] = None,
                 name: Optional[str] = None) -> Dict[str, Any]:
        """Evaluates the latest (or given) checkpoint.

        Args:
            input_fn: as for `train`.
            steps: evaluate this many batches (default None: until the
                input is exhausted).
            hooks: extra `SessionRunHook`s.
            checkpoint_path: checkpoint to evaluate (default: latest).
            name: accepted for stock compatibility; eval summaries are not
                written, so it has no effect on files.

        Returns:
            Dict with each `eval_metric_ops` value, `loss` (the mean of
            the batch losses) and `global_step`.

        Raises:
            ValueError: no checkpoint, `steps` <= 0, or `eval_metric_ops`
                uses the reserved key `loss`.
        """
        del name
        if steps is not None and steps <= 0:
            raise ValueError(f"`steps` must be > 0, got {steps}.")
        path = self._require_checkpoint(checkpoint_path)
        with self._new_graph().as_default():
            features, labels, input_hooks = self._call_input_fn(
                input_fn, ModeKeys.EVAL)
            spec = self._call_model_fn(features, labels, ModeKeys.EVAL)
            metrics = dict(spec.eval_metric_ops)
            if LOSS_METRIC_KEY in metrics:
                raise ValueError("`eval_metric_ops` may not use the key "
                                 f"'{LOSS_METRIC_KEY}' (evaluate adds the "
                                 "mean loss under it).")
            metrics[LOSS_METRIC_KEY] = _v1.metrics.mean(spec.loss)
            updates = [update for _, update in metrics.values()]
            values = {k: value for k, (value, _) in metrics.items()}
            values[GLOBAL_STEP_KEY] = _v1.train.get_global_step()
            final = _FinalValuesHook(values,
                                     _sum_metric_state_over_workers())
            with _v1.train.MonitoredSession(
                    session_creator=self._session_creator(spec, path),
                    hooks=list(input_hooks) + list(hooks or []) +
                    list(spec.evaluation_hooks) + [final]) as session:
                done = 0
                while not session.should_stop() and (
                        steps is None or done < steps):
                    session.run(updates)
                    done += 1
        return final.result

    def predict(self, input_fn, predict_keys=None, hooks=None,
                checkpoint_path: Optional[str] = None,
                yield_single_examples: bool = True) -> Iterator[Any]:
        """Yields predictions of the latest (or given) checkpoint.

        Args:
            input_fn: as for `train` (labels, if any, are ignored).
            predict_keys: None (all), or the keys of a dict `predictions`
                to return.
            hooks: extra `SessionRunHook`s.
            checkpoint_path: checkpoint to use (default: latest).
            yield_single_examples: True (default) yields one example at a
                time, False one batch at a time.

        Yields:
            Dicts of numpy values (or arrays, when `predictions` is a
            single tensor).

        Raises:
            ValueError: no checkpoint, or an unknown predict key.
        """
        path = self._require_checkpoint(checkpoint_path)
        with self._new_graph().as_default():
            features, _, input_hooks = self._call_input_fn(
                input_fn, ModeKeys.PREDICT)
            spec = self._call_model_fn(features, None, ModeKeys.PREDICT)
            predictions = spec.predictions
            if predict_keys is not None:
                if not isinstance(predictions, dict):
                    raise ValueError("`predict_keys` needs a dict of "
                                     "predictions.")
                missing = [k for k in predict_keys if k not in predictions]
                if missing:
                    raise ValueError(
                        f"`predict_keys` {missing} are not among the "
                        f"predictions {sorted(predictions)}.")
                predictions = {k: predictions[k] for k in predict_keys}
            with _v1.train.MonitoredSession(
                    session_creator=self._session_creator(spec, path),
                    hooks=list(input_hooks) + list(hooks or []) +
                    list(spec.prediction_hooks)) as session:
                while not session.should_stop():
                    batch = session.run(predictions)
                    if not yield_single_examples:
                        yield batch
                    elif isinstance(batch, dict):
                        size = len(next(iter(batch.values())))
                        for i in range(size):
                            yield {k: v[i] for k, v in batch.items()}
                    else:
                        yield from batch

    def export_saved_model(self, export_dir_base: str,
                           serving_input_receiver_fn, assets_extra=None,
                           as_text: bool = False,
                           checkpoint_path: Optional[str] = None,
                           experimental_mode: str = ModeKeys.PREDICT
                           ) -> bytes:
        """Exports the PREDICT graph as a SavedModel plain TF serves.

        EmbeddingVariables become stock `tf.lookup` tables holding the
        admitted keys (unknown keys read what a `training=False` lookup
        reads), and variables become constants, so the SavedModel loads
        with `tf.saved_model.load` in a process without this library.

        Args:
            export_dir_base: parent of the `<timestamp>` export folder.
            serving_input_receiver_fn: returns a `ServingInputReceiver`
                (see `export.build_raw_serving_input_receiver_fn` and
                `build_parsing_serving_input_receiver_fn`).
            assets_extra: must be None.
            as_text: write `saved_model.pbtxt` (default False).
            checkpoint_path: checkpoint to export (default: latest).
            experimental_mode: must be `ModeKeys.PREDICT`.

        Returns:
            The export directory (bytes, as stock).

        Raises:
            ValueError: no checkpoint.
            TypeError: the receiver fn returns no `ServingInputReceiver`.
            NotImplementedError: `assets_extra`, another mode, collective
                mode, or a graph still needing this library's ops.
        """
        if assets_extra is not None:
            raise NotImplementedError("`assets_extra` is not supported.")
        if experimental_mode != ModeKeys.PREDICT:
            raise NotImplementedError(
                f"`experimental_mode` {experimental_mode!r}: only "
                f"{ModeKeys.PREDICT!r} is exported.")
        if distributed_strategy.is_collective():
            raise NotImplementedError(
                "export_saved_model in collective mode: export from a "
                "single process (tables sharded over workers are not "
                "gathered).")
        path = self._require_checkpoint(checkpoint_path)
        graph = self._new_graph()
        with graph.as_default(), frozen_graph.pure_tf_lookups():
            receiver = serving_input_receiver_fn()
            if not isinstance(receiver, ServingInputReceiver):
                raise TypeError(
                    "`serving_input_receiver_fn` must return a "
                    "ServingInputReceiver, got "
                    f"{type(receiver).__name__}.")
            features = receiver.features
            if list(features) == ["feature"]:
                features = features["feature"]
            spec = self._call_model_fn(features, None, ModeKeys.PREDICT)
            outputs = _signature_outputs(
                spec.export_outputs, spec.predictions)
            saver = self._saver(spec)
            fetches = [t for outs in outputs.values() for t in outs.values()]
            with _v1.Session(config=self._config.session_config) as session:
                saver.restore(session, path)
                frozen = frozen_graph.freeze(graph, session, fetches)
            inits = [op.name for op in graph.get_collection(
                _v1.GraphKeys.TABLE_INITIALIZERS)]
        return frozen_graph.write(
            frozen, {k: t.name for k, t in receiver.receiver_tensors.items()},
            {name: {k: t.name for k, t in outs.items()}
             for name, outs in outputs.items()}, inits, export_dir_base,
            as_text)


def _signature_outputs(export_outputs, predictions
                       ) -> Dict[str, Dict[str, tf.Tensor]]:
    """Signature name -> output name -> tensor.

    Raises:
        TypeError: an export output is not a `PredictOutput`.
    """
    if not export_outputs:
        export_outputs = {frozen_graph.DEFAULT_SIGNATURE:
                          PredictOutput(predictions)}
    out = {}
    for name, output in export_outputs.items():
        if not isinstance(output, PredictOutput):
            raise TypeError(
                f"`export_outputs['{name}']` must be an "
                "estimator.export.PredictOutput, got "
                f"{type(output).__name__}.")
        out[name] = output.outputs
    return out
