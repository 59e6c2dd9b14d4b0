"""The tutorials run end to end at tiny size and do what they claim.

Each runs in-process through its `main(argv)` (one TF import for all),
except the SavedModel checks, which serve from a fresh process by design.
Data is generated with a fixed seed, so the AUC thresholds are stable.
"""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

_TUTORIALS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                          "tutorials")
sys.path.insert(0, os.path.abspath(_TUTORIALS))

import data  # noqa: E402
import deepfm_keras  # noqa: E402
import deepfm_tf1  # noqa: E402
import serving  # noqa: E402


@pytest.fixture(scope="module")
def keras_run(tmp_path_factory):
    """deepfm_keras.py on 6000 rows, 2 epochs (shared by the serving test).
    """
    out = str(tmp_path_factory.mktemp("deepfm_keras"))
    # --filter-freq 3 with 2 epochs: an id seen once in the training data
    # is counted twice and never admitted (with the default 2, its second
    # lookup already admits it, so no id would stay out).
    return deepfm_keras.main(["--rows", "6000", "--epochs", "2", "--batch",
                              "256", "--dim", "4", "--hidden", "32",
                              "--filter-freq", "3",
                              "--out-dir", out, "--verbose", "0"])


def test_csv_round_trip_feeds_the_same_batches(tmp_path):
    frame, bayes_auc = data.generate(200, seed=5)
    path = str(tmp_path / "d.csv")
    data.write_csv(frame, path)
    from_csv = next(iter(data.to_dataset(path, 200)))
    from_frame = next(iter(data.to_dataset(frame, 200)))
    np.testing.assert_array_equal(from_csv[1], from_frame[1])
    np.testing.assert_array_equal(from_csv[0]["dense"],
                                  from_frame[0]["dense"])
    for col in data.SPARSE_COLUMNS:
        assert from_csv[0][col].to_list() == from_frame[0][col].to_list()
    # Integer ids stay text ("17", not "17.0"); missing values are empty.
    tokens = from_csv[0]["C2"].flat_values.numpy()
    assert all(t.isdigit() for t in tokens)
    assert min(from_csv[0]["C1"].row_lengths()) == 0
    assert 0.5 < bayes_auc <= 1.0


def test_deepfm_keras_learns_checkpoints_and_plots(keras_run):
    history = keras_run["history"]
    assert keras_run["val_auc"] > 0.65  # chance is 0.5
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert os.path.getsize(keras_run["plot"]) > 10_000
    with open(keras_run["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.exists(keras_run["checkpoint"] + ".index")


def _training_token_counts(out_dir, column):
    """Occurrences of each token of `column` in the training CSV, counted
    with numpy on the parsed batches (the oracle of the EV's counts)."""
    ds = data.to_dataset(os.path.join(out_dir, "train.csv"), 1024)
    tokens = np.concatenate([f[column].flat_values.numpy() for f, _ in ds])
    return np.unique(tokens, return_counts=True)[1]


def test_deepfm_keras_counter_filter_holds_rare_ids_back(keras_run):
    """The CounterFilter (filter_freq 3) kept ids seen once out of the
    tables: each stored key was counted once per training occurrence
    (2 epochs), keys counted fewer than 3 times still hold their initial
    row (never admitted, never updated), and every admitted key trained."""
    epochs, filter_freq = 2, keras_run["config"]["filter_freq"]
    assert filter_freq == 3
    evs = {ev.name.split("/")[-1]: ev
           for ev in keras_run["model"].embedding_variables()}
    for column in ("C1", "C2"):
        ev = evs[f"{column}_embedding"]
        keys, values, _, freqs = (x.numpy() for x in ev.export())
        counts = _training_token_counts(keras_run["out_dir"], column)
        # One stored key per distinct training token, counted per lookup.
        np.testing.assert_array_equal(np.sort(freqs),
                                      np.sort(epochs * counts))
        defaults = ev.default_values.numpy()
        initial = defaults[np.mod(keys, defaults.shape[0])]
        moved = np.any(values != initial, axis=1)
        held = freqs < filter_freq
        assert held.sum() > 0 and (~held).sum() > 0
        assert not moved[held].any()
        assert moved[~held].all()


def test_deepfm_tf1_learns(tmp_path):
    result = deepfm_tf1.main(["--rows", "8000", "--epochs", "3", "--batch",
                              "256", "--dim", "4", "--hidden", "32",
                              "--model_dir", str(tmp_path),
                              "--log-every", "0"])
    assert result["auc"] > 0.65
    assert abs(result["metric_auc"] - result["auc"]) < 0.01
    losses = result["losses"]
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05


def test_saved_model_serves_without_group_embedding(keras_run, tmp_path):
    rows = 300
    result = serving.main(["--model-dir", keras_run["out_dir"],
                           "--export-dir", str(tmp_path / "export"),
                           "--rows", str(rows)])
    served, expected = result["served"], result["expected"]
    # The fresh process (no group_embedding import) predicts what the
    # restored model predicts, unseen ids included (the last 4 rows)...
    assert served.shape == (rows + 4,)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    # ...which is what the model predicted before it was checkpointed.
    np.testing.assert_allclose(served[:rows], keras_run["probs"][:rows],
                               rtol=1e-5, atol=1e-6)
    # A row of only unseen ids differs from the known row it came from.
    assert abs(served[rows] - served[0]) > 1e-4


class _ResumeProbe(tf.compat.v1.train.SessionRunHook):
    """Records, as a training session starts, its global step and whether
    every variable of `checkpoint` (if any) came back with its saved
    value."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self.restored = {}

    def after_create_session(self, session, coord):
        self.start_step = int(session.run(
            tf.compat.v1.train.get_global_step()))
        if self.checkpoint is None:
            return
        saved = dict(tf.train.list_variables(self.checkpoint))
        variables = [v for v in tf.compat.v1.global_variables()
                     if v.op.name in saved]
        values = session.run(variables)
        self.restored = {v.op.name: np.array_equal(
            value, tf.train.load_variable(self.checkpoint, v.op.name))
            for v, value in zip(variables, values)}


def test_deepfm_estimator_learns_resumes_and_serves(compat, monkeypatch,
                                                    tmp_path):
    # Imported here: the compat fixture installs `tf.estimator` for this
    # test only (the module's own `import group_embedding.compat` is then
    # a no-op) and uninstalls it afterwards.
    import deepfm_estimator

    from group_embedding import estimator as ge_estimator

    # Each of the tutorial's train() calls gets a probe of how it starts.
    probes = []
    train = ge_estimator.Estimator.train

    def probed_train(self, input_fn, hooks=None, **kwargs):
        probes.append(_ResumeProbe(self.latest_checkpoint()))
        return train(self, input_fn, hooks=list(hooks or []) + probes[-1:],
                     **kwargs)

    monkeypatch.setattr(ge_estimator.Estimator, "train", probed_train)
    result = deepfm_estimator.main([
        "--rows", "6000", "--epochs", "2", "--batch", "256", "--dim", "4",
        "--hidden", "32", "--model_dir", str(tmp_path)])
    total = result["total_steps"]
    assert total == 2 * -(-4800 // 256)  # 80% of the rows, 2 epochs
    assert result["first"]["global_step"] == total // 2
    assert result["final"]["global_step"] == total
    # The second call resumed at the saved step, with every saved
    # variable (dense weights, EV defaults, slots) restored.
    assert [p.start_step for p in probes] == [0, total // 2]
    assert len(probes[1].restored) >= 5 and all(
        probes[1].restored.values()), probes[1].restored
    assert result["final"]["auc"] > 0.65  # chance is 0.5
    # Served from a fresh process by plain TF, no group_embedding.
    served, predicted = result["served"], result["predicted"]
    assert served.shape == predicted.shape == (500,)
    np.testing.assert_allclose(served, predicted, rtol=1e-5, atol=1e-6)
    assert predicted.std() > 0.01  # not a constant model
