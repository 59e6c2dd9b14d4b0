"""DeepRec feature-column usages beyond plain `input_layer` (issue 9.3):

* a partitioned `variable_scope` (DeepRec's model zoo
  `--input_layer_partitioner`): tables become PartitionedVariables; output,
  gradients and one training step equal stock `input_layer` under the same
  partitioner, inside and outside group scopes;
* `weighted_categorical_column` over `categorical_column_with_embedding`,
  against a stock weighted identity column whose table holds the EV's rows
  (TF1 `input_layer` and the Keras layer);
* `embedding_column(..., do_fusion=...)`;
* sequence columns and `sequence_input_layer` against stock's sequence
  embedding on the same table.

An EV starts key k from row `k mod default_value_dim` of its default
matrix; with `default_value_dim` = vocabulary size V and a constant
initializer M, key k < V starts as M[k], the row k of a stock table
initialised with M.
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.feature_column import feature_column as fc_old
from tensorflow.python.feature_column import feature_column_v2 as fc_v2

import group_embedding as ge
from group_embedding import feature_column as ge_fc

import fc_cases
from testing import COMBINERS
from testing import assert_close
from testing import op_counts

FC = tf.feature_column
V1 = tf.compat.v1
DIM = fc_cases.DIM
PARTITIONERS = {
    # 10 rows -> shards of 4, 3, 3 (uneven, as "div" lays them out).
    "fixed_size": lambda: V1.fixed_size_partitioner(3),
    # The model zoo's partitioner; a tiny min_slice_size so that these
    # small tables get several shards (160 bytes per 10 x 4 table).
    "min_max": lambda: V1.min_max_variable_partitioner(
        max_partitions=8, min_slice_size=48),
    # The model zoo's own call without parameter servers: one shard.
    "one_shard": lambda: V1.min_max_variable_partitioner(
        max_partitions=0, min_slice_size=8 << 20),
}


def _ev_option(rows: np.ndarray) -> ge.EmbeddingVariableOption:
    """EV option whose key k < len(rows) starts as rows[k]."""
    return ge.EmbeddingVariableOption(init_option=ge.InitializerOption(
        initializer=V1.constant_initializer(rows),
        default_value_dim=rows.shape[0]))


def _stock_features(features):
    return {k: v.to_sparse() if isinstance(v, tf.RaggedTensor) else v
            for k, v in features.items()}


def _tables_by_name(cols_to_vars):
    return {c.name: list(v) for c, v in cols_to_vars.items() if v}


# --- (a) partitioned variable_scope --------------------------------------

def _partition_columns(scoped: bool):
    cats = [FC.categorical_column_with_identity("uid", 10),
            FC.categorical_column_with_hash_bucket("tag", 20),
            FC.weighted_categorical_column(
                FC.categorical_column_with_identity("wid", 8), "wid_w"),
            FC.categorical_column_with_vocabulary_list("city",
                                                       ["sf", "ny", "la"])]
    combiners = ["sum", "mean", "sqrtn", "mean"]
    stock = [FC.embedding_column(c, DIM, m) for c, m in zip(cats, combiners)]
    if not scoped:
        return [ge_fc.embedding_column(c, DIM, m)
                for c, m in zip(cats, combiners)], stock
    with ge_fc.group_embedding_column_scope(fc_cases.unique_name("part")):
        ours = [ge_fc.embedding_column(c, DIM, m)
                for c, m in zip(cats[:3], combiners[:3])]
    # One column outside the scope: looked up alone in the same call.
    ours.append(ge_fc.embedding_column(cats[3], DIM, combiners[3]))
    return ours, stock


# Unscoped columns take stock's own lookup: one partitioner suffices.
@pytest.mark.parametrize("partitioner,scoped", [
    ("fixed_size", True), ("min_max", True), ("min_max", False),
    ("one_shard", True)], ids=["fixed_size-scoped", "min_max-scoped",
                               "min_max-unscoped", "one_shard-scoped"])
def test_partitioned_scope_matches_stock(kernel_mode, partitioner, scoped):
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features("sparse")
        ours_cols, stock_cols = _partition_columns(scoped)
        ours_vars, stock_vars = {}, {}
        # DeepRec's model zoo: the input layer under a partitioned scope.
        with V1.variable_scope("input_layer",
                               partitioner=PARTITIONERS[partitioner]()):
            ours = ge_fc.input_layer(features, ours_cols,
                                     cols_to_vars=ours_vars, scope="ge")
            stock = V1.feature_column.input_layer(features, stock_cols,
                                                  cols_to_vars=stock_vars)
        ours_t, stock_t = (_tables_by_name(ours_vars),
                           _tables_by_name(stock_vars))
        assert sorted(ours_t) == sorted(stock_t)
        for name in ours_t:
            assert [v.shape for v in ours_t[name]] == \
                [v.shape for v in stock_t[name]]
        shards = len(ours_t["uid_embedding"])
        assert shards == 1 if partitioner == "one_shard" else shards > 1
        names = sorted(ours_t)
        ours_flat = [v for n in names for v in ours_t[n]]
        stock_flat = [v for n in names for v in stock_t[n]]
        copy = [s.assign(o) for o, s in zip(ours_flat, stock_flat)]
        up = tf.constant(fc_cases.random_weights([fc_cases.BATCH, 4 * DIM]))
        g_ours = tf.gradients(tf.reduce_sum(ours * up), ours_flat)
        g_stock = tf.gradients(tf.reduce_sum(stock * up), stock_flat)
        o, s, go, gs = fc_cases.run_graph(
            graph, [ours, stock, [tf.convert_to_tensor(g) for g in g_ours],
                    [tf.convert_to_tensor(g) for g in g_stock]], copy)
    assert_close(o, s)
    for a, b in zip(go, gs):
        assert_close(a, b)


@pytest.mark.parametrize("scoped", [True, False], ids=["scoped",
                                                       "unscoped"])
def test_partitioned_scope_trains_like_stock_with_ev_unpartitioned(scoped):
    """One Adagrad step under a partitioned scope: stock table shards and
    EV rows (an EV is one hash table: never partitioned) end where stock
    Adagrad puts the same rows of a partitioned stock table."""
    rows = fc_cases.random_weights([8, DIM], seed=3)
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features("ragged", ["uid", "wid"])
        name = fc_cases.unique_name("pt")
        with ge_fc.group_embedding_column_scope(name) if scoped else \
                contextlib.nullcontext():
            ours_cols = [
                ge_fc.embedding_column(
                    FC.categorical_column_with_identity("uid", 10), DIM,
                    "sum"),
                ge_fc.embedding_column(
                    ge_fc.categorical_column_with_embedding(
                        "wid", tf.int64, ev_option=_ev_option(rows)),
                    DIM, "mean")]
        stock_cols = [
            FC.embedding_column(FC.categorical_column_with_identity(
                "uid", 10), DIM, "sum"),
            FC.embedding_column(FC.categorical_column_with_identity(
                "wid", 8), DIM, "mean")]
        ours_vars, stock_vars = {}, {}
        with V1.variable_scope("input_layer",
                               partitioner=V1.fixed_size_partitioner(3)):
            ours = ge_fc.input_layer(features, ours_cols,
                                     cols_to_vars=ours_vars, scope="ge")
            stock = V1.feature_column.input_layer(
                _stock_features(features), stock_cols,
                cols_to_vars=stock_vars)
        ours_t, stock_t = (_tables_by_name(ours_vars),
                           _tables_by_name(stock_vars))
        (ev,) = ours_t["wid_embedding"]
        assert isinstance(ev, ge.EmbeddingVariable)
        assert len(stock_t["wid_embedding"]) == 3
        copy = [s.assign(o) for o, s in zip(ours_t["uid_embedding"],
                                            stock_t["uid_embedding"])]
        copy += [s.assign(rows[a:a + int(s.shape[0])]) for s, a in zip(
            stock_t["wid_embedding"], (0, 3, 6))]
        up = tf.constant(fc_cases.random_weights([fc_cases.BATCH, 2 * DIM]))
        train = [ge.train.AdagradOptimizer(0.5).minimize(
                     tf.reduce_sum(ours * up)),
                 V1.train.AdagradOptimizer(0.5).minimize(
                     tf.reduce_sum(stock * up))]
        keys = tf.range(6, dtype=tf.int64)  # the keys "wid" holds
        after = [tf.concat(ours_t["uid_embedding"], 0),
                 tf.concat(stock_t["uid_embedding"], 0),
                 ev.lookup_rows(keys, training=False),
                 tf.gather(tf.concat(stock_t["wid_embedding"], 0), keys)]
        with V1.Session(graph=graph) as sess:
            sess.run(V1.global_variables_initializer())
            sess.run(copy)
            o, s = sess.run([ours, stock])
            sess.run(train)
            ours_uid, stock_uid, ev_rows, stock_wid = sess.run(after)
    assert_close(o, s)
    assert_close(ours_uid, stock_uid)
    assert_close(ev_rows, stock_wid)
    assert not np.allclose(ev_rows, rows[:6])  # the step moved them


def test_partitioned_tables_share_one_fused_lookup(monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", "custom")
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features("sparse", ["uid", "uid2"])
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("po")):
            cols = [ge_fc.embedding_column(
                FC.categorical_column_with_identity(k, 10), DIM)
                for k in ("uid", "uid2")]
        with V1.variable_scope("x", partitioner=V1.fixed_size_partitioner(
                2)):
            ge_fc.input_layer(features, cols)
    # Two tables of two shards each: one fused op for all four shards.
    assert op_counts(graph)["GroupEmbeddingPooledLookup"] == 1


def test_embedding_dim_partitioning_is_rejected():
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features("sparse", ["uid"])
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("ax")):
            col = ge_fc.embedding_column(
                FC.categorical_column_with_identity("uid", 10), DIM)
        with V1.variable_scope("x", partitioner=V1.fixed_size_partitioner(
                2, axis=1)):
            with pytest.raises(NotImplementedError,
                               match="uid_embedding.*partitioned"):
                ge_fc.input_layer(features, [col])


# --- (b) weighted_categorical_column over an EV column -------------------

def _weighted_columns(combiner, scoped, rows):
    weighted_ev = FC.weighted_categorical_column(
        ge_fc.categorical_column_with_embedding(
            "wid", tf.int64, ev_option=_ev_option(rows)), "wid_w")
    if scoped:
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("w")):
            ours = ge_fc.embedding_column(weighted_ev, DIM, combiner)
    else:
        ours = ge_fc.embedding_column(weighted_ev, DIM, combiner)
    stock = FC.embedding_column(
        FC.weighted_categorical_column(
            FC.categorical_column_with_identity("wid", 8), "wid_w"),
        DIM, combiner, initializer=V1.constant_initializer(rows))
    return ours, stock


@pytest.mark.parametrize("scoped", [True, False], ids=["scoped",
                                                       "unscoped"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_weighted_ev_column_matches_stock_input_layer(combiner, scoped):
    rows = fc_cases.random_weights([8, DIM], seed=5)
    graph = tf.Graph()
    with graph.as_default():
        features = fc_cases.make_features("sparse", ["wid", "wid_w"])
        ours_col, stock_col = _weighted_columns(combiner, scoped, rows)
        assert ours_col.name == stock_col.name
        ours_vars, stock_vars = {}, {}
        ours = ge_fc.input_layer(features, [ours_col],
                                 cols_to_vars=ours_vars)
        stock = V1.feature_column.input_layer(features, [stock_col],
                                              cols_to_vars=stock_vars)
        (ev,), (table,) = ours_vars[ours_col], stock_vars[stock_col]
        up = tf.constant(fc_cases.random_weights([fc_cases.BATCH, DIM]))
        train = [ge.train.GradientDescentOptimizer(0.5).minimize(
                     tf.reduce_sum(ours * up)),
                 V1.train.GradientDescentOptimizer(0.5).minimize(
                     tf.reduce_sum(stock * up))]
        keys = tf.range(6, dtype=tf.int64)
        with V1.Session(graph=graph) as sess:
            sess.run(V1.global_variables_initializer())
            o, s = sess.run([ours, stock])
            sess.run(train)
            ev_rows, stock_rows = sess.run(
                [ev.lookup_rows(keys, training=False),
                 tf.gather(table, keys)])
    assert_close(o, s)
    # rows - lr * gradient on both sides: the gradients are equal.
    assert_close(ev_rows, stock_rows)
    assert not np.allclose(ev_rows, rows[:6])


@pytest.mark.parametrize("scoped", [True, False], ids=["scoped",
                                                       "unscoped"])
@pytest.mark.parametrize("combiner,kind", [("sum", "ragged"),
                                           ("mean", "sparse"),
                                           ("sqrtn", "dense")])
def test_weighted_ev_column_in_keras_layer(combiner, kind, scoped):
    rows = fc_cases.random_weights([8, DIM], seed=7)
    ours_col, _ = _weighted_columns(combiner, scoped, rows)
    layer = ge_fc.GroupEmbeddingFeatures([ours_col])
    features = fc_cases.make_features(kind, ["wid", "wid_w"])
    up = fc_cases.random_weights([fc_cases.BATCH, DIM])
    with tf.GradientTape() as tape:
        out = layer(features, training=True)
        loss = tf.reduce_sum(out * up)
    (ev,) = layer.embedding_variables
    ge.optimizers.SGD(0.5).apply_gradients(
        [(tape.gradient(loss, ev), ev)])
    # Oracle: stock safe lookup on a plain variable holding the same rows.
    sparse = _stock_features(fc_cases.make_features("sparse",
                                                    ["wid", "wid_w"]))
    table = tf.Variable(rows)
    with tf.GradientTape() as tape:
        want = tf.nn.safe_embedding_lookup_sparse(
            table, sparse["wid"], sparse["wid_w"], combiner=combiner)
        want_loss = tf.reduce_sum(want * up)
    want_rows = rows - 0.5 * tf.convert_to_tensor(
        tape.gradient(want_loss, table)).numpy()
    assert_close(out, want)
    keys = tf.range(6, dtype=tf.int64)
    assert_close(ev.lookup_rows(keys, training=False), want_rows[:6])


def test_weighted_ev_column_config_round_trip():
    ours_col, _ = _weighted_columns("mean", True,
                                    np.zeros([8, DIM], np.float32))
    plain = ge_fc.embedding_column(FC.weighted_categorical_column(
        ge_fc.categorical_column_with_embedding("wid", tf.int64),
        "wid_w"), DIM)
    back = type(plain).from_config(plain.get_config())
    assert back == plain and back.is_ev
    assert back.keys == ["wid", "wid_w"]
    # The EV option (with its initializer) survives too.
    assert type(ours_col).from_config(ours_col.get_config()).ev_option \
        .init_option.default_value_dim == 8


# --- (d) do_fusion ----------------------------------------------------------

def test_do_fusion_is_accepted_and_changes_nothing():
    cat = FC.categorical_column_with_identity("uid", 10)
    with ge_fc.group_embedding_column_scope(fc_cases.unique_name("f")) as s:
        plain = ge_fc.embedding_column(cat, DIM)
        for value in (True, False, None, "v2"):
            assert ge_fc.embedding_column(cat, DIM, do_fusion=value) == \
                plain
    assert plain.scope == s
    with pytest.raises(TypeError, match="uid.*do_fusion.*int"):
        ge_fc.embedding_column(cat, DIM, do_fusion=3)


# --- (c) sequence columns ---------------------------------------------------

# Same lengths in every feature (stock asserts it); "xx" / "oov" are out of
# vocabulary: zeros at their position, still counted in the length.
SEQ_ROWS = {
    "s_uid": [[1, 3, 3], [], [9, 2], [0, 2, 5]],
    "s_tag": [["a", "b", "c"], [], ["x", "y"], ["q", "a", "zz"]],
    "s_city": [["sf", "xx", "la"], [], ["ny", "la"], ["la", "sf", "oov"]],
}
SEQ_BATCH = 4


def _seq_features(kind):
    return {k: fc_cases.make_feature(
                v, tf.string if k != "s_uid" else tf.int64, kind)
            for k, v in SEQ_ROWS.items()}


def _seq_categoricals(ev_rows=None):
    sfc = FC
    uid = sfc.sequence_categorical_column_with_identity("s_uid", 10)
    return [
        uid if ev_rows is None else
        ge_fc.sequence_categorical_column_with_embedding(
            "s_uid", tf.int64, ev_option=_ev_option(ev_rows)),
        sfc.sequence_categorical_column_with_hash_bucket("s_tag", 20),
        sfc.sequence_categorical_column_with_vocabulary_list(
            "s_city", ["sf", "ny", "la"]),
    ]


def _stock_sequence(features, columns):
    """Stock's sequence embedding (what TF 1.15's sequence_input_layer and
    Keras 2's SequenceFeatures concatenate), column by column."""
    builder = fc_old._LazyBuilder(_stock_features(features))  # noqa
    dense, lengths, tables = [], [], {}
    with V1.variable_scope("stock_seq"):
        for c in sorted(columns, key=lambda c: c.name):
            with V1.variable_scope(None, default_name=c.name) as vs:
                d, n = c._get_sequence_dense_tensor(builder)  # noqa
                tables[c.name] = V1.get_collection(
                    V1.GraphKeys.GLOBAL_VARIABLES, scope=vs.name)[0]
            dense.append(d)
            lengths.append(n)
    return tf.concat(dense, -1), lengths, tables


@pytest.mark.parametrize("scoped,kind", [(True, "sparse"), (True, "dense"),
                                         (False, "ragged")])
def test_sequence_input_layer_matches_stock(scoped, kind):
    graph = tf.Graph()
    with graph.as_default():
        features = _seq_features(kind)
        cats = _seq_categoricals()
        if scoped:
            with ge_fc.group_embedding_column_scope(
                    fc_cases.unique_name("seq")):
                ours_cols = [ge_fc.embedding_column(c, DIM) for c in cats]
        else:
            ours_cols = [ge_fc.embedding_column(c, DIM) for c in cats]
        ours, length = ge_fc.sequence_input_layer(features, ours_cols)
        stock, stock_lengths, stock_tables = _stock_sequence(
            features, [FC.embedding_column(c, DIM) for c in cats])
        ours_tables = {c.name: V1.get_collection(
            V1.GraphKeys.GLOBAL_VARIABLES,
            scope=f"sequence_input_layer/{c.name}/")[0] for c in ours_cols}
        names = sorted(ours_tables)
        copy = [stock_tables[n].assign(ours_tables[n]) for n in names]
        up = tf.constant(np.random.default_rng(0).normal(
            size=[SEQ_BATCH, 3, 3 * DIM]).astype(np.float32))
        g_ours = tf.gradients(tf.reduce_sum(ours * up),
                              [ours_tables[n] for n in names])
        g_stock = tf.gradients(tf.reduce_sum(stock * up),
                               [stock_tables[n] for n in names])
        fetch = [ours, stock, length, stock_lengths,
                 [tf.convert_to_tensor(g) for g in g_ours],
                 [tf.convert_to_tensor(g) for g in g_stock]]
        o, s, n, sn, go, gs = fc_cases.run_graph(graph, fetch, copy)
    assert o.shape == (SEQ_BATCH, 3, 3 * DIM)
    assert_close(o, s)
    for stock_n in sn:
        np.testing.assert_array_equal(n, stock_n)
    np.testing.assert_array_equal(n, [3, 0, 2, 3])
    for a, b in zip(go, gs):
        assert_close(a, b)
    # One unpooled lookup per scope, else per column: the C++ sequence op,
    # or the one segment sum of the pure-TF path (sorted or unsorted ids).
    fused = ("GroupEmbeddingSequenceLookup", "UnsortedSegmentSum",
             "SparseSegmentSumWithNumSegments")
    ours_sums = [op for op in graph.get_operations()
                 if op.type in fused
                 and op.name.startswith("sequence_input_layer/")]
    assert len(ours_sums) == (1 if scoped else 3)


@pytest.mark.parametrize("partitioned", [False, True],
                         ids=["plain", "partitioned"])
def test_sequence_ev_column_matches_stock(partitioned):
    rows = fc_cases.random_weights([10, DIM], seed=11)
    graph = tf.Graph()
    with graph.as_default():
        features = _seq_features("sparse")
        with ge_fc.group_embedding_column_scope(fc_cases.unique_name("sq")):
            ours_cols = [ge_fc.embedding_column(c, DIM)
                         for c in _seq_categoricals(rows)]
        partitioner = V1.fixed_size_partitioner(3) if partitioned else None
        with V1.variable_scope("outer", partitioner=partitioner):
            ours, length = ge_fc.sequence_input_layer(features, ours_cols)
        stock_cols = [FC.embedding_column(c, DIM)
                      for c in _seq_categoricals()]
        stock, _, stock_tables = _stock_sequence(features, stock_cols)
        prefix = "outer/sequence_input_layer"
        copy = [stock_tables["s_uid_embedding"].assign(rows)]
        for name in ("s_city_embedding", "s_tag_embedding"):
            shards = V1.get_collection(V1.GraphKeys.GLOBAL_VARIABLES,
                                       scope=f"{prefix}/{name}/")
            assert len(shards) == (3 if partitioned else 1)
            copy.append(stock_tables[name].assign(tf.concat(shards, 0)))
        o, s, n = fc_cases.run_graph(graph, [ours, stock, length], copy)
    assert_close(o, s)
    np.testing.assert_array_equal(n, [3, 0, 2, 3])


def test_sequence_columns_go_to_sequence_input_layer_only():
    graph = tf.Graph()
    with graph.as_default():
        features = _seq_features("sparse")
        seq = ge_fc.embedding_column(_seq_categoricals()[0], DIM)
        flat = ge_fc.embedding_column(
            FC.categorical_column_with_identity("s_uid", 10), DIM)
        with pytest.raises(TypeError, match="s_uid_embedding.*sequence_"
                                            "input_layer"):
            ge_fc.input_layer(features, [seq])
        with pytest.raises(TypeError, match="s_uid_embedding.*not an "
                                            "embedding of a sequence"):
            ge_fc.sequence_input_layer(features, [flat])
    # Weights of a sequence column are not offered (see columns.py).
    with pytest.raises(TypeError, match="s_uid_weighted_by_w.*cannot be "
                                        "embedded"):
        ge_fc.embedding_column(FC.sequence_categorical_column_with_identity(
            "s_uid", 10).__class__(FC.weighted_categorical_column(
                FC.categorical_column_with_identity("s_uid", 10), "w")),
            DIM)
    with pytest.raises(TypeError, match="sequence_input_layer"):
        ge_fc.GroupEmbeddingFeatures([seq])


def test_sequence_ev_column_is_deeprecs_wrapper():
    col = ge_fc.sequence_categorical_column_with_embedding("hist")
    assert isinstance(col, FC.sequence_categorical_column_with_identity(
        "x", 2).__class__)
    assert col.categorical_column.dtype == tf.int64  # DeepRec's default
    assert col.name == "hist"
    emb = ge_fc.embedding_column(col, DIM)
    assert emb.is_sequence and emb.is_ev
    assert type(emb).from_config(emb.get_config()) == emb


# --- DeepRec names through `group_embedding.compat` -------------------------

def test_compat_runs_deeprecs_sequence_script_lines(compat):
    """BST-style lines: stock and EV sequence columns in one scope, read
    by `tf.contrib.feature_column.sequence_input_layer`; the stock column's
    part equals stock's sequence embedding on the same table."""
    rows = fc_cases.random_weights([10, DIM], seed=13)
    graph = tf.Graph()
    with graph.as_default():
        features = _seq_features("sparse")
        with V1.feature_column.group_embedding_column_scope(
                name=fc_cases.unique_name("bst")):
            fc = V1.feature_column
            tag = fc.sequence_categorical_column_with_hash_bucket(
                "s_tag", hash_bucket_size=20, dtype=tf.string)
            hist = fc.sequence_categorical_column_with_embedding(
                "s_uid", dtype=tf.int64, ev_option=_ev_option(rows))
            cols = [V1.feature_column.embedding_column(
                        tag, dimension=DIM, combiner="mean", do_fusion=True),
                    V1.feature_column.embedding_column(hist, dimension=DIM)]
        emb, length = V1.contrib.feature_column.sequence_input_layer(
            features, cols)
        # fc_v2's function: compat routes tf.feature_column to ours.
        stock, _, stock_tables = _stock_sequence(features, [
            fc_v2.embedding_column(c, DIM) for c in _seq_categoricals()[:2]])
        ours_tag = V1.get_collection(
            V1.GraphKeys.GLOBAL_VARIABLES,
            scope="sequence_input_layer/s_tag_embedding/")[0]
        copy = [stock_tables["s_tag_embedding"].assign(ours_tag),
                stock_tables["s_uid_embedding"].assign(rows)]
        o, s, n = fc_cases.run_graph(graph, [emb, stock, length], copy)
    # Sorted by name: s_tag, then s_uid (the EV); stock sorts the same.
    assert_close(o, s)
    np.testing.assert_array_equal(n, [3, 0, 2, 3])
    compat.uninstall()
    assert not hasattr(V1, "contrib")
    assert not hasattr(V1.feature_column,
                       "sequence_categorical_column_with_embedding")
    compat.install()


def test_compat_weighted_ev_column_and_do_fusion(compat):
    cat = V1.feature_column.weighted_categorical_column(
        V1.feature_column.categorical_column_with_embedding(
            "wid", dtype=tf.int64), "wid_w")
    col = V1.feature_column.embedding_column(cat, DIM, do_fusion="v2")
    assert col == ge_fc.embedding_column(cat, DIM)
    assert col.is_ev and col.keys == ["wid", "wid_w"]
