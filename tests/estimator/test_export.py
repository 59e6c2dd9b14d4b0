"""export_saved_model: the SavedModel, served by plain TF in a process
that never imports group_embedding, predicts what Estimator.predict
predicts (EV tables snapshotted into stock lookup tables)."""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from group_embedding import estimator as ge_estimator  # noqa: E402

import estimator_cases as cases  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
export = ge_estimator.export


def requests():
    """Rows with known ids, ids still under the CounterFilter, unseen ids
    and missing items."""
    features, labels = cases.make_data(48, seed=2)
    features["user"][:3] = [[999], [-5], [2 ** 40]]
    features["item"][:3] = [["never", ""], ["", ""], ["i1", "unseen"]]
    return features, labels


def serialized(features):
    out = []
    for i in range(len(features["user"])):
        feature = {
            "user": tf.train.Feature(int64_list=tf.train.Int64List(
                value=features["user"][i])),
            "cat": tf.train.Feature(int64_list=tf.train.Int64List(
                value=features["cat"][i])),
            "x": tf.train.Feature(float_list=tf.train.FloatList(
                value=features["x"][i])),
            "item": tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[s.encode() for s in features["item"][i] if s]))}
        out.append(tf.train.Example(features=tf.train.Features(
            feature=feature)).SerializeToString())
    return np.array(out, dtype=object)


def test_export_served_by_plain_tf(tmp_path):
    features, labels = cases.make_data(96)
    est = ge_estimator.Estimator(
        cases.model_fn, str(tmp_path / "model"),
        ge_estimator.RunConfig(log_step_count_steps=None), {"lr": 0.2})
    est.train(cases.input_fn(features, labels))
    request, request_labels = requests()
    expected = np.array([r["probability"] for r in est.predict(
        cases.input_fn(request, request_labels))])

    base = str(tmp_path / "export")
    raw_dir = est.export_saved_model(
        base, export.build_raw_serving_input_receiver_fn(
            {k: tf.constant(v[:1]) for k, v in request.items()}))
    parsing_dir = est.export_saved_model(
        base, export.build_parsing_serving_input_receiver_fn({
            "user": tf.io.FixedLenFeature([1], tf.int64),
            "cat": tf.io.FixedLenFeature([1], tf.int64),
            "x": tf.io.FixedLenFeature([2], tf.float32),
            "item": tf.io.VarLenFeature(tf.string)}))
    assert raw_dir != parsing_dir
    assert sorted(os.listdir(base)) == sorted(
        os.path.basename(d.decode()) for d in (raw_dir, parsing_dir))
    assert os.path.exists(os.path.join(raw_dir.decode(), "saved_model.pb"))

    # Hex: numpy's bytes dtype would drop the protos' trailing zero bytes.
    np.savez(tmp_path / "requests.npz", examples=np.array(
        [e.hex() for e in serialized(request)]), **request)
    out = tmp_path / "served.npz"
    env = dict(os.environ, PYTHONPATH="")  # plain TF only
    run = subprocess.run(
        [sys.executable, os.path.join(_HERE, "serve_plain_tf.py"),
         str(tmp_path / "requests.npz"), str(out),
         f"{raw_dir.decode()}:raw", f"{parsing_dir.decode()}:parsing"],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    served = np.load(out)
    np.testing.assert_allclose(served["raw"], expected, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(served["parsing"], expected, rtol=1e-5,
                               atol=1e-6)
    # The unseen ids really took the default path: predictions differ
    # from those of the same rows with known ids.
    assert len(np.unique(np.round(expected, 6))) > 40


def test_export_errors(tmp_path):
    est = ge_estimator.Estimator(cases.model_fn, str(tmp_path))
    with pytest.raises(ValueError, match="Could not find a trained model"):
        est.export_saved_model(str(tmp_path / "e"), lambda: None)
    with pytest.raises(NotImplementedError, match="assets_extra"):
        est.export_saved_model(str(tmp_path / "e"), lambda: None,
                               assets_extra={"a": "b"})
    with pytest.raises(TypeError, match="must be a dense Tensor"):
        export.build_raw_serving_input_receiver_fn(
            {"item": tf.sparse.from_dense([["a"]])})
    with pytest.raises(NotImplementedError,
                       match="receiver_tensors_alternatives"):
        export.ServingInputReceiver({}, {}, {"alt": {}})
