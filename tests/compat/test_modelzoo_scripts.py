"""DeepRec's model zoo scripts (DLRM, DeepFM, DCNv2; our compact versions
in `modelzoo/`) with their DeepRec embedding flags reach the AUC of the same
script run as the stock-TF baseline (`--tf`).

Each script runs in a subprocess on a generated Criteo CSV (30k rows,
`tutorials/data.py`), `TF_USE_LEGACY_KERAS=1` for `tf.layers`; with
`--group_embedding collective` under `horovodrun -np 2`, every worker given
the same `--checkpoint` directory as in the zoo. The stock AUC of each
script is computed once per session. Thresholds: ours reaches stock within
`AUC_TOLERANCE` (at least stock - 0.02, the issue's "Done when"; the EV
runs may do better: unadmitted rare keys read zeros, not random rows), and
lies above what the same script reaches when every embedding reads zero
(`ZERO_EMBEDDING_AUC`), so that a run that learned nothing from its tables
fails. The tables are checked against counts of the training data
(pandas): without eviction the restored EVs hold one key per distinct
value; under the CBFFilter the keys held before the final eviction are
the values seen often enough to be admitted.

Also the regressions found on the way: AdamAsync / AdagradDecay on TF1
reference variables, and `tf.feature_column.input_layer` called twice
making two sets of tables as stock does.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import tensorflow as tf

_HERE = os.path.dirname(os.path.abspath(__file__))
_ZOO = os.path.join(_HERE, "modelzoo")
sys.path.insert(0, _ZOO)
import common  # noqa: E402

AUC_TOLERANCE = 0.02
# What each script reaches on this data (30k rows, seed 0) when every
# embedding reads zero, measured two ways; the larger is kept:
#   * zero throughout: a filter that never admits (planted in the kernels,
#     CounterFilter and CBFFilter alike): the dense features alone
#     (DLRM 0.558, DeepFM 0.545, DCNv2 0.568);
#   * trained, then all evicted before evaluation (stock with
#     `--stock_l2_evict 1e9`): DLRM 0.548, DeepFM 0.523, DCNv2 0.561.
ZERO_EMBEDDING_AUC = {"dlrm": 0.558, "deepfm": 0.545, "dcnv2": 0.568}
# The floor of the runs without eviction lies this far above them (they
# reach 0.64-0.77, stock 0.62-0.77): a run whose tables teach the model
# nothing cannot pass.
FLOOR_MARGIN = 0.03
# EV sets per script: DeepFM's wide and deep `input_layer` calls make
# their own tables (as stock does).
TABLE_SETS = {"dlrm": 1, "deepfm": 2, "dcnv2": 1}
BATCH_SIZE = 512  # the scripts' default
CBF_FILTER_FREQ = 3  # modelzoo/common.py's CBFFilter
V1 = tf.compat.v1

# Per script: extra flags of every run (stock included), so that a run
# learns within seconds: a fixed step count, and for DCNv2 a larger
# Adagrad rate than DeepRec's 0.01 (which barely moves in 150 steps).
SCRIPT_FLAGS = {
    "dlrm": [],                       # one epoch, DeepRec's defaults
    "deepfm": ["--steps", "150"],
    "dcnv2": ["--steps", "150", "--learning_rate", "0.3"],
}
DEEPREC_DEFAULTS = ["--ev", "True", "--ev_filter", "counter",
                    "--ev_elimination", "gstep",
                    "--group_embedding", "localized"]
# The model zoo's CBFFilter(max_element_size=2**30) as it is: 10**10
# counters per column (82 GB of uint64 as an array), of which only those
# the keys touch are kept.
CBF_L2 = ["--ev", "True", "--ev_filter", "cbf", "--ev_elimination", "l2",
          "--group_embedding", "localized"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("criteo"))
    common.write_criteo_csv(directory, rows=30000, seed=0)
    return directory


def run_script(model, data_dir, flags, tmp_path_factory, workers=None):
    """Runs a zoo script (under horovodrun with `workers`); returns the
    result line of each process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               TF_USE_LEGACY_KERAS="1")
    checkpoint = str(tmp_path_factory.mktemp("ckpt_" + model))
    launcher = [] if workers is None else [
        os.path.join(os.path.dirname(sys.executable), "horovodrun"),
        "-np", str(workers), "--gloo"]
    proc = subprocess.run(
        launcher + [sys.executable, "-W", "ignore",
                    os.path.join(_ZOO, model + "_script.py"),
                    "--data_location", data_dir, "--checkpoint", checkpoint]
        + SCRIPT_FLAGS[model] + flags,
        capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (model, flags, out[-4000:])
    # horovodrun prefixes each worker's lines with "[rank]<stdout>:".
    results = [json.loads(line[line.index("{"):])
               for line in proc.stdout.splitlines() if '{"model"' in line]
    assert len(results) == (workers or 1), out[-4000:]
    return results


@pytest.fixture(scope="module")
def stock_auc(data_dir, tmp_path_factory):
    cache = {}

    def get(model, l2_evict=None):
        key = (model, l2_evict)
        if key not in cache:
            flags = ["--tf"] + ([] if l2_evict is None else
                                ["--stock_l2_evict", str(l2_evict)])
            result, = run_script(model, data_dir, flags, tmp_path_factory)
            assert result["stock"] and result["last_loss"] < \
                result["first_loss"], result
            cache[key] = result["auc"]
        return cache[key]

    return get


# The model zoo's L2WeightEvict(l2_weight_threshold=1.0) runs when the
# final checkpoint is saved, before evaluation restores it: a dim-16 row of
# a short run has 0.5 * |v|^2 of about 0.4 < 1.0, so most rows are evicted
# and evaluation reads zeros (DeepRec's rule and timing, DeepRec loses the
# same rows). The oracle of those runs is therefore the stock script with
# the same rule applied to its tables at the same save
# (`--stock_l2_evict`): measured stock 0.57 / 0.53 / 0.56 (DLRM / DeepFM /
# DCNv2), ours 0.69 / 0.64 / 0.58 (our filtered keys read zeros in
# training too, stock trains on random rows it then zeroes). DeepFM and
# DCNv2 lose every key, DLRM keeps 5.
ZOO_L2_THRESHOLD = 1.0


def training_value_counts(data_dir):
    """Occurrences of each value of each of the 26 categorical columns in
    the training CSV (pandas; a missing value is the parser's default
    " "), one array per column."""
    frame = pd.read_csv(os.path.join(data_dir, "train.csv"), header=None,
                        dtype=str, keep_default_na=False)
    values = frame.iloc[:, 1 + len(common.CONTINUOUS_COLUMNS):]
    assert values.shape[1] == len(common.CATEGORICAL_COLUMNS)
    return [values[c].replace("", " ").value_counts().to_numpy()
            for c in values.columns]


def assert_tables_as_trained(results, model, l2, data_dir):
    """The keys the EVs held, against counts of the training data.

    Without eviction (GlobalStepEvict(4000) outlives the run) the tables
    restored for evaluation hold one key per distinct training value:
    a CounterFilter stores keys on first sight, admitted or not. With the
    CBFFilter (keys stored once seen `CBF_FILTER_FREQ` times) the keys at
    the last step, before the final save evicts, are the values seen that
    often in the epochs read: at least those of the full epochs (less
    5%: a key may reach its count in the last batch, after the count),
    at most those of the epochs begun, plus 2% of all values (its false
    positives, p = 0.01). Collective workers each count their own keys.
    """
    counts = training_value_counts(data_dir)
    sets = TABLE_SETS[model]
    distinct = sets * sum(len(c) for c in counts)
    if not l2:
        assert sum(r["embedding_rows"] for r in results) == distinct, (
            results, distinct)
        return
    trained = sum(r["trained_rows"] for r in results)
    if len(results) > 1:  # workers' counts of one key may differ
        assert 0 < trained <= distinct, (results, distinct)
        return
    rows = int(counts[0].sum())
    read = (results[0]["steps"] * BATCH_SIZE / rows
            if "--steps" in SCRIPT_FLAGS[model] else 1.0)

    def admitted(epochs):
        return sets * sum(int((c * epochs >= CBF_FILTER_FREQ).sum())
                          for c in counts)

    low, high = admitted(math.floor(read)), admitted(math.ceil(read))
    assert 0.95 * low <= trained <= high + 0.02 * distinct, (
        results, low, high)


def assert_reaches_stock(results, stock, model, l2, data_dir):
    """Every process's AUC is the same (collective workers evaluate the
    whole eval set) and at least stock - tolerance, above what a run
    whose embeddings all read zero reaches, and the tables are those of
    the training data (`assert_tables_as_trained`)."""
    ours = results[0]
    assert not ours["stock"] and ours["ev"], ours
    assert len({r["auc"] for r in results}) == 1, results
    assert ours["auc"] >= stock - AUC_TOLERANCE, (ours, stock)
    # After an L2 eviction most rows are gone (see above) and even stock
    # evaluates near the zero-embedding AUC: no margin there, the tables
    # are what tells a learning run from a broken one.
    assert_tables_as_trained(results, model, l2, data_dir)
    margin = 0.0 if l2 else FLOOR_MARGIN
    assert ours["auc"] > ZERO_EMBEDDING_AUC[model] + margin, (ours, stock)


@pytest.mark.parametrize("model,flags", [
    ("dlrm", DEEPREC_DEFAULTS),
    ("dlrm", CBF_L2),
    ("deepfm", DEEPREC_DEFAULTS),
    ("deepfm", CBF_L2),
    ("dcnv2", DEEPREC_DEFAULTS),
    ("dcnv2", CBF_L2),
    ("dcnv2", DEEPREC_DEFAULTS + ["--use_feature_columns"]),
], ids=["dlrm-counter-gstep", "dlrm-cbf-l2", "deepfm-counter-gstep",
        "deepfm-cbf-l2", "dcnv2-counter-gstep", "dcnv2-cbf-l2",
        "dcnv2-feature-columns"])
def test_deeprec_flags_reach_stock_auc(model, flags, data_dir, stock_auc,
                                       tmp_path_factory):
    l2 = flags is CBF_L2
    assert_reaches_stock(
        run_script(model, data_dir, flags, tmp_path_factory),
        stock_auc(model, ZOO_L2_THRESHOLD if l2 else None), model, l2,
        data_dir)


@pytest.mark.parametrize("model,flags", [
    ("dlrm", DEEPREC_DEFAULTS), ("deepfm", DEEPREC_DEFAULTS),
    ("dcnv2", DEEPREC_DEFAULTS), ("dlrm", CBF_L2)],
    ids=["dlrm-counter-gstep", "deepfm-counter-gstep",
         "dcnv2-counter-gstep", "dlrm-cbf-l2"])
def test_collective_under_horovodrun_reaches_stock_auc(
        model, flags, data_dir, stock_auc, tmp_path_factory):
    # Two workers, one checkpoint directory for both (the zoo's setup):
    # before the per-worker Saver files, each worker's final save
    # overwrote the other's shard and DLRM evaluated at 0.732 (stock
    # 0.767). Each worker's EVs count and evict the keys it owns.
    l2 = flags is CBF_L2
    flags = [f if f != "localized" else "collective" for f in flags]
    results = run_script(model, data_dir, flags, tmp_path_factory,
                         workers=2)
    assert {r["group_embedding"] for r in results} == {"collective"}
    assert_reaches_stock(
        results, stock_auc(model, ZOO_L2_THRESHOLD if l2 else None), model,
        l2, data_dir)


# --- regressions ---------------------------------------------------------


@pytest.mark.parametrize("name", ["AdamAsyncOptimizer",
                                  "AdagradDecayOptimizer"])
def test_deeprec_optimizers_train_reference_variables(name):
    # DeepRec scripts run `disable_v2_behavior()`: plain variables are
    # RefVariables, which the TF1 base class updates through `_apply_dense`
    # / `_apply_sparse` (NotImplementedError before). Same numbers as on
    # resource variables.
    import group_embedding as ge
    results = []
    for use_resource in (False, True):
        with tf.Graph().as_default():
            dense = V1.get_variable("dense", initializer=[[1.0, 2.0]],
                                    use_resource=use_resource)
            table = V1.get_variable("table", initializer=np.arange(
                12, dtype=np.float32).reshape(4, 3),
                use_resource=use_resource)
            assert (dense.op.type == "VarHandleOp") == use_resource
            emb = tf.gather(table, [0, 2, 2])
            loss = tf.reduce_sum(emb * emb) + tf.reduce_sum(dense * dense)
            step = V1.train.get_or_create_global_step()
            opt = (ge.train.AdamAsyncOptimizer(0.1)
                   if name == "AdamAsyncOptimizer"
                   else ge.train.AdagradDecayOptimizer(0.1, step))
            train = opt.minimize(loss, global_step=step)
            with V1.Session() as sess:
                sess.run(V1.global_variables_initializer())
                for _ in range(3):
                    sess.run(train)
                results.append(sess.run([dense, table]))
    (ref_dense, ref_table), (res_dense, res_table) = results
    np.testing.assert_allclose(ref_dense, res_dense, rtol=1e-6)
    np.testing.assert_allclose(ref_table, res_table, rtol=1e-6)
    assert not np.allclose(ref_table[2], np.arange(6, 9))  # it trained
    np.testing.assert_array_equal(ref_table[1], np.arange(3, 6))


def _embedding_tables(columns_fn, calls):
    with tf.Graph().as_default():
        features = {"a": tf.constant([["x"], ["y"]])}
        columns = columns_fn()
        for scope in calls:
            if scope is None:
                V1.feature_column.input_layer(features, columns)
            else:
                with V1.variable_scope(scope, reuse=V1.AUTO_REUSE):
                    V1.feature_column.input_layer(features, columns)
        return sorted(v.name for v in V1.global_variables())


def _columns():
    return [V1.feature_column.embedding_column(
        V1.feature_column.categorical_column_with_hash_bucket("a", 10), 4)]


def test_input_layer_twice_makes_tables_as_stock(compat):
    # DeepRec's DeepFM builds its wide and deep inputs with two
    # input_layer calls: stock (and DeepRec) give each call its own
    # tables, input_layer/ and input_layer_1/; re-entering a named scope
    # shares them (the TF1 idiom for train / eval towers).
    for calls in ([None, None], ["model", "model"]):
        ours = _embedding_tables(_columns, calls)
        compat.uninstall()
        stock = _embedding_tables(_columns, calls)
        compat.install()
        assert ours == stock, (calls, ours, stock)
    assert len(_embedding_tables(_columns, [None, None])) == 2
    assert len(_embedding_tables(_columns, ["model", "model"])) == 1


def test_input_layer_twice_makes_two_evs(compat):
    def ev_columns():
        with V1.feature_column.group_embedding_column_scope(name="g"):
            return [V1.feature_column.embedding_column(
                V1.feature_column.categorical_column_with_embedding(
                    "a", dtype=tf.string), 4)]

    # The module (the package re-exports the function under its name).
    il = sys.modules["group_embedding.feature_column.input_layer"]
    with tf.Graph().as_default() as graph:
        features = {"a": tf.constant([["x"], ["y"]])}
        columns = ev_columns()
        V1.feature_column.input_layer(features, columns)
        V1.feature_column.input_layer(features, columns)
        evs = il._graph_state(graph).evs
    assert len(evs) == 2, sorted(evs)
    assert sorted(evs) == ["input_layer/a_embedding/embedding_weights",
                           "input_layer_1/a_embedding/embedding_weights"]
