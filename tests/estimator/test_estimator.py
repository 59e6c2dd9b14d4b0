"""Estimator train / evaluate / predict / resume against a hand-written
MonitoredTrainingSession loop on the same model_fn and batches."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from group_embedding import estimator as ge_estimator  # noqa: E402

import estimator_cases as cases  # noqa: E402

Estimator = ge_estimator.Estimator
RunConfig = ge_estimator.RunConfig
PARAMS = {"lr": 0.2}


def eval_data():
    """Held-out rows plus ids never seen in training (user 999, item
    'never'), which read the defaults."""
    features, labels = cases.make_data(64, seed=1)
    features["user"][:4] = 999
    features["item"][:4, 0] = "never"
    return features, labels


def log_loss(labels, probs):
    probs = np.clip(probs, 1e-7, 1 - 1e-7)
    return -(labels * np.log(probs) + (1 - labels) * np.log(1 - probs))


def exact_auc(labels, scores):
    pos, neg = scores[labels == 1], scores[labels == 0]
    greater = (pos[:, None] > neg[None, :]).mean()
    ties = (pos[:, None] == neg[None, :]).mean()
    return greater + 0.5 * ties


def stock_auc(labels, probs):
    """Stock `tf.compat.v1.metrics.auc` (200 thresholds, as the model_fn)
    over all predictions: the streaming metric's exact value, since its
    confusion counts add up the same batch by batch."""
    with tf.Graph().as_default():
        value, update = tf.compat.v1.metrics.auc(
            tf.constant(labels), tf.constant(probs), num_thresholds=200)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.local_variables_initializer())
            sess.run(update)
            return sess.run(value)


def assert_metrics_equal(result, labels, probs):
    """Loss (the mean of per-batch means), accuracy and AUC of an
    evaluation over `probs` (the reference's predictions)."""
    batch_losses = [log_loss(labels[i:i + cases.BATCH],
                             probs[i:i + cases.BATCH]).mean()
                    for i in range(0, len(labels), cases.BATCH)]
    np.testing.assert_allclose(result["loss"], np.mean(batch_losses),
                               rtol=1e-5)
    np.testing.assert_allclose(result["accuracy"],
                               np.mean(np.round(probs) == labels),
                               rtol=1e-6)
    np.testing.assert_allclose(result["auc"], stock_auc(labels, probs),
                               rtol=1e-6)
    # The bucketed AUC is near the exact rank statistic (a sanity check
    # of the oracle itself).
    np.testing.assert_allclose(result["auc"], exact_auc(labels, probs),
                               atol=0.02)


def assert_state_equal(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        if isinstance(value, tuple):  # EV: same keys, same rows
            np.testing.assert_array_equal(actual[name][0], value[0], name)
            np.testing.assert_allclose(actual[name][1], value[1], rtol=1e-5,
                                       atol=1e-6, err_msg=name)
        else:
            np.testing.assert_allclose(actual[name], value, rtol=1e-5,
                                       atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An Estimator trained for one epoch, and the reference run."""
    features, labels = cases.make_data()
    test_features, test_labels = eval_data()
    model_dir = str(tmp_path_factory.mktemp("model"))
    est = Estimator(cases.model_fn, model_dir, RunConfig(
        save_checkpoints_steps=4, log_step_count_steps=None), PARAMS)
    est.train(cases.input_fn(features, labels))
    state, probs, steps = cases.reference_run(features, labels,
                                              test_features, PARAMS)
    return est, state, probs, steps, (test_features, test_labels)



def test_train_equals_reference_loop(trained):
    est, state, _, steps, _ = trained
    latest = est.latest_checkpoint()
    assert latest.endswith(f"model.ckpt-{steps}")  # ran to input's end
    assert_state_equal(cases.checkpoint_state(latest), state)
    # The EVs were really trained and saved: keys beyond the initial ones.
    assert len(state[cases.EV_NAMES[1]][0]) > 20


def test_evaluate_equals_reference(trained):
    est, _, probs, steps, (features, labels) = trained
    result = est.evaluate(cases.input_fn(features, labels))
    assert result["global_step"] == steps
    assert_metrics_equal(result, labels, probs)
    partial = est.evaluate(cases.input_fn(features, labels), steps=1)
    first = log_loss(labels[:cases.BATCH], probs[:cases.BATCH]).mean()
    np.testing.assert_allclose(partial["loss"], first, rtol=1e-5)


def test_predict_equals_reference(trained):
    est, _, probs, _, (features, labels) = trained
    rows = list(est.predict(cases.input_fn(features, labels)))
    assert len(rows) == len(labels)
    assert sorted(rows[0]) == ["logit", "probability"]
    np.testing.assert_allclose([r["probability"] for r in rows], probs,
                               rtol=1e-5, atol=1e-6)
    batches = list(est.predict(cases.input_fn(features, labels),
                               predict_keys=["probability"],
                               yield_single_examples=False))
    assert [sorted(b) for b in batches] == [["probability"]] * 2
    np.testing.assert_allclose(
        np.concatenate([b["probability"] for b in batches]), probs,
        rtol=1e-5, atol=1e-6)


def test_resume_matches_uninterrupted(tmp_path):
    features, labels = cases.make_data(96)  # 3 batches
    config = RunConfig(save_checkpoints_steps=100, log_step_count_steps=None)
    resumed = Estimator(cases.model_fn, str(tmp_path / "resumed"), config,
                        PARAMS)
    resumed.train(cases.input_fn(features, labels), steps=2)
    assert resumed.latest_checkpoint().endswith("model.ckpt-2")
    # A fresh graph restores step 2, EV keys, counts and slots; its
    # input restarts, as stock's does: batches 1, 2 again, then 3.
    resumed.train(cases.input_fn(features, labels), max_steps=5)
    assert resumed.latest_checkpoint().endswith("model.ckpt-5")
    resumed.train(cases.input_fn(features, labels), max_steps=5)  # no-op
    assert resumed.latest_checkpoint().endswith("model.ckpt-5")

    order = np.concatenate([np.arange(64), np.arange(96)])
    once = Estimator(cases.model_fn, str(tmp_path / "once"), config, PARAMS)
    once.train(cases.input_fn({k: v[order] for k, v in features.items()},
                              labels[order]))
    assert once.latest_checkpoint().endswith("model.ckpt-5")
    assert_state_equal(cases.checkpoint_state(resumed.latest_checkpoint()),
                       cases.checkpoint_state(once.latest_checkpoint()))


class _CountingHook(tf.compat.v1.train.SessionRunHook):
    """Counts every SessionRunHook call and fetches the loss (found by
    name, as LoggingTensorHook does) through SessionRunArgs."""

    def __init__(self, loss_name):
        self.loss_name = loss_name
        self.calls = dict.fromkeys(
            ["begin", "after_create_session", "before_run", "after_run",
             "end"], 0)
        self.losses = []
        self.end_step = None

    def begin(self):
        self.calls["begin"] += 1
        graph = tf.compat.v1.get_default_graph()
        self._loss = graph.get_tensor_by_name(self.loss_name)
        self._step = tf.compat.v1.train.get_global_step()

    def after_create_session(self, session, coord):
        self.calls["after_create_session"] += 1

    def before_run(self, run_context):
        self.calls["before_run"] += 1
        return tf.compat.v1.train.SessionRunArgs(self._loss)

    def after_run(self, run_context, run_values):
        self.calls["after_run"] += 1
        self.losses.append(float(run_values.results))

    def end(self, session):
        self.calls["end"] += 1
        self.end_step = int(session.run(self._step))


def _named_loss_model_fn(features, labels, mode, params):
    spec = cases.model_fn(features, labels, mode, params)
    if mode != ge_estimator.ModeKeys.TRAIN:
        return spec
    return ge_estimator.EstimatorSpec(
        mode, loss=tf.identity(spec.loss, name="hooked_loss"),
        train_op=spec.train_op)


def _reference_losses(features, labels, steps):
    """The loss of each of the first `steps` steps of a hand-written
    MonitoredTrainingSession loop over the same model_fn and batches."""
    with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        batch = tf.compat.v1.data.make_one_shot_iterator(
            cases.input_fn(features, labels)()).get_next()
        spec = cases.model_fn(batch[0], batch[1],
                               ge_estimator.ModeKeys.TRAIN, PARAMS)
        with tf.compat.v1.train.MonitoredTrainingSession(
                save_summaries_steps=None, save_checkpoint_secs=None,
                log_step_count_steps=None) as session:
            return [float(session.run([spec.loss, spec.train_op])[0])
                    for _ in range(steps)]


def test_train_runs_hooks(tmp_path):
    features, labels = cases.make_data(160)  # 5 batches, 3 steps run
    hook = _CountingHook("hooked_loss:0")
    est = Estimator(_named_loss_model_fn, str(tmp_path), RunConfig(
        log_step_count_steps=None), PARAMS)
    est.train(cases.input_fn(features, labels), hooks=[hook], steps=3)
    assert hook.calls == {"begin": 1, "after_create_session": 1,
                          "before_run": 3, "after_run": 3, "end": 1}
    assert hook.end_step == 3
    np.testing.assert_allclose(
        hook.losses, _reference_losses(features, labels, 3), rtol=1e-5)
    # Without `steps`, training runs until the input ends: 5 steps, and
    # (as in stock MonitoredSession) one more before_run for the run that
    # hits the end of the input, which gets no after_run.
    more = _CountingHook("hooked_loss:0")
    est.train(cases.input_fn(features, labels), hooks=[more])
    assert more.calls["after_run"] == len(more.losses) == 5
    assert more.calls["before_run"] == 6
    assert more.calls["end"] == 1 and more.end_step == 8


def test_keep_checkpoint_max(tmp_path):
    features, labels = cases.make_data(96)
    est = Estimator(cases.model_fn, str(tmp_path), RunConfig(
        save_checkpoints_steps=1, keep_checkpoint_max=2,
        log_step_count_steps=None), PARAMS)
    est.train(cases.input_fn(features, labels))
    kept = sorted(f[:-len(".index")] for f in os.listdir(tmp_path)
                  if f.endswith(".index"))
    assert kept == ["model.ckpt-2", "model.ckpt-3"]


def test_train_and_evaluate_returns_final_metrics(tmp_path):
    features, labels = cases.make_data(96)
    test_features, test_labels = eval_data()
    est = Estimator(cases.model_fn, str(tmp_path), RunConfig(
        save_checkpoints_steps=2, log_step_count_steps=None), PARAMS)
    result, exports = ge_estimator.train_and_evaluate(
        est,
        ge_estimator.TrainSpec(cases.input_fn(features, labels, epochs=2),
                               max_steps=5),
        ge_estimator.EvalSpec(cases.input_fn(test_features, test_labels),
                              steps=None, throttle_secs=0))
    assert exports == []
    assert result["global_step"] == 5
    assert set(result) == {"auc", "accuracy", "loss", "global_step"}
    # Oracle: the hand-written loop trained for the same 5 steps; its
    # predictions give the metrics, its state the checkpoint.
    state, probs, _ = cases.reference_run(
        features, labels, test_features, PARAMS, epochs=2, steps=5)
    assert_metrics_equal(result, test_labels, probs)
    assert_state_equal(cases.checkpoint_state(est.latest_checkpoint()),
                       state)


def test_errors(tmp_path):
    features, labels = cases.make_data(32)
    est = Estimator(cases.model_fn, str(tmp_path), params=PARAMS)
    fn = cases.input_fn(features, labels)
    with pytest.raises(ValueError, match="Could not find a trained model"):
        est.evaluate(fn)
    with pytest.raises(ValueError, match="Set only one of `steps`"):
        est.train(fn, steps=1, max_steps=2)
    with pytest.raises(ValueError, match="`steps` must be > 0, got 0"):
        est.train(fn, steps=0)
    with pytest.raises(ValueError, match="save_checkpoints_steps"):
        RunConfig(save_checkpoints_steps=1, save_checkpoints_secs=1)
    with pytest.raises(ValueError, match="differs from `config.model_dir`"):
        Estimator(cases.model_fn, "/a", RunConfig(model_dir="/b"))
    with pytest.raises(TypeError, match="`features` argument"):
        Estimator(lambda x, labels, mode: None)
    with pytest.raises(ValueError, match="TRAIN mode needs `loss` and"):
        ge_estimator.EstimatorSpec("train", loss=tf.constant(1.0))
    with pytest.raises(ValueError, match="Invalid `mode`: 'fit'"):
        ge_estimator.EstimatorSpec("fit")
    with pytest.raises(TypeError, match="eval_metric_ops\\['auc'\\]"):
        ge_estimator.EstimatorSpec("eval", loss=tf.constant(1.0),
                                   eval_metric_ops={"auc": 1.0})

    def bad_model_fn(features, labels, mode):
        return cases.model_fn(features, labels, "eval", PARAMS)

    with pytest.raises(ValueError, match="called in mode 'train' but"):
        Estimator(bad_model_fn, str(tmp_path / "bad")).train(fn)


def test_compat_installs_estimator():
    import group_embedding.compat as compat

    compat.install()
    try:
        assert tf.estimator is ge_estimator
        assert tf.compat.v1.estimator.Estimator is Estimator
        assert tf.estimator.export.ServingInputReceiver is \
            ge_estimator.export.ServingInputReceiver
    finally:
        # Later test files compare against stock tf.feature_column.
        compat.uninstall()
    assert not hasattr(tf, "estimator")
