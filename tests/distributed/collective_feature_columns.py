"""Feature columns in a scope, trained in collective mode (Keras or TF1).

Each worker trains on its slice of every global batch and writes what it
holds (shard rows with their global ids, replicated tables, dense weights)
to `OUT.rank-R.npz`. test_collective_feature_columns.py runs this at -np 1
(the single-process run) and -np 2 and compares the merged results.

    horovodrun -np 2 python collective_feature_columns.py --api keras --out F

`--plan` (Keras) declares the tables to `enable_distributed_strategy`
(`table_sizes`, by the layer's table names): the planner puts `b` whole on
one worker and row-shards `a`.

Column `d` is an EmbeddingVariable column (`categorical_column_with_
embedding`): worker `key mod N` owns a key; the dump holds each worker's
keys as its rows. `--ev-storage hbm` puts its table in GPU memory
(StorageType.HBM, on the host stand-in: the test sets
GROUP_EMBEDDING_HBM_ON_HOST=1).
"""

import argparse
import importlib
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.embedding_variable.variable import is_embedding_variable  # noqa: E402

fc = ge.feature_column
GLOBAL_BATCH = 16
STEPS = 10
# (key, buckets, dim, combiner): the first two are big enough to be
# sharded, the last stays replicated.
COLUMNS = [("a", 12000, 8, "sum"), ("b", 9000, 8, "mean"),
           ("c", 50, 4, "sqrtn")]
# The EV column: ids drawn from EV_KEYS arbitrary int64 keys.
EV_COLUMN = ("d", 8, "mean")
EV_KEYS = 300


def make_columns(ev_storage="dram"):
    storage = (ge.StorageOption(ge.StorageType.HBM) if ev_storage == "hbm"
               else ge.StorageOption())
    key, dim, combiner = EV_COLUMN
    with fc.group_embedding_column_scope("ctr"):
        columns = [fc.embedding_column(
                       tf.feature_column.categorical_column_with_identity(
                           key, buckets),
                       dim, combiner=combiner)
                   for key, buckets, dim, combiner in COLUMNS]
        columns.append(fc.embedding_column(
            fc.categorical_column_with_embedding(
                key, dtype=tf.int64, ev_option=ge.EmbeddingVariableOption(
                    storage_option=storage)),
            # Seeded: the -np 1 and -np 2 runs (other processes) must
            # start from the same default rows.
            dim, combiner=combiner,
            initializer=tf.compat.v1.random_uniform_initializer(
                -0.5, 0.5, seed=3)))
        return columns


def global_data():
    rng = np.random.default_rng(0)
    n = GLOBAL_BATCH * STEPS
    feats = {}
    for key, buckets, _, _ in COLUMNS:
        ids = rng.integers(0, buckets, (n, 3))
        ids[rng.random((n, 3)) < 0.3] = -1  # missing, as stock treats -1
        feats[key] = ids
    keys = rng.integers(-2 ** 62, 2 ** 62, EV_KEYS)
    feats[EV_COLUMN[0]] = keys[rng.integers(0, EV_KEYS, (n, 2))]
    label = rng.normal(size=(n, 1)).astype(np.float32)
    return feats, label


def local_slices(rank, size):
    """Rows of every global batch that this worker trains on."""
    per = GLOBAL_BATCH // size
    feats, label = global_data()
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * per,
                                     s * GLOBAL_BATCH + (rank + 1) * per)
                           for s in range(STEPS)])
    return {k: v[rows] for k, v in feats.items()}, label[rows], per


def dump(path, rank, tables, dense):
    """Writes name -> (global rows, values) of what this worker holds."""
    arrays = {}
    for name, (rows, values) in tables.items():
        if rows is not None or rank == 0:  # replicated: written once
            arrays[f"{name}/rows"] = (np.arange(len(values)) if rows is None
                                      else rows)
            arrays[f"{name}/values"] = np.asarray(values)
    for i, d in enumerate(dense):
        arrays[f"dense{i}"] = np.asarray(d)
    np.savez(f"{path}.rank-{rank}.npz", **arrays)


def held(tables, values=None):
    """name -> (global rows or None if replicated, values); an EV's rows
    are its keys (`values[name]`: its keys, values and default rows)."""
    out = {}
    for name, t in tables.items():
        if is_embedding_variable(t):
            keys, rows, defaults = (
                values[name] if values is not None
                else [x.numpy() for x in t.export()[:2]] +
                [t.default_values.numpy()])
            # Trained: a row still equal to a default row was not updated.
            untouched = np.all(np.asarray(rows)[:, None, :] ==
                               np.asarray(defaults)[None, :, :], -1).any(1)
            assert len(keys) > 0 and not untouched.any(), (
                f"{name}: {untouched.sum()} of {len(keys)} EV rows were "
                "never updated")
            out[name] = (np.asarray(keys), np.asarray(rows))
            continue
        sharded = isinstance(t, ge.ShardedVariable)
        value = (values[name] if values is not None
                 else t.shard if sharded else t)
        out[name] = (t.global_rows() if sharded else None, np.asarray(value))
    return out


# The plan of --plan: tables are named `layer name/table name`; with
# fraction 1 a table up to (384000 + 288000 bytes) / N is placed whole.
PLAN = {"table_wise_fraction": 1.0,
        "table_sizes": {f"features/{key}_embedding": (buckets, dim)
                        for key, buckets, dim, _ in COLUMNS}}


def run_keras(rank, size, out, plan=False, ev_storage="dram"):
    feats, label, per = local_slices(rank, size)
    features = fc.GroupEmbeddingFeatures(
        make_columns(ev_storage), **({"name": "features"} if plan else {}))

    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.features = features
            self.head = keras.layers.Dense(
                1, kernel_initializer=keras.initializers.Constant(0.1))

        def call(self, x):
            return self.head(self.features(x))

    model = Model()
    model({k: v[:per] for k, v in feats.items()})  # build
    if plan and size > 1:
        tables = features.tables
        assert tables["b_embedding"].placement == "table", tables
        assert tables["a_embedding"].placement == "row", tables
        assert not isinstance(tables["c_embedding"], ge.ShardedVariable)
    ge.broadcast_variables(model.variables)
    model.compile(optimizer=ge.DistributedOptimizer(
        ge.optimizers.Adagrad(0.1)), loss="mse")
    data = tf.data.Dataset.from_tensor_slices((feats, label)).batch(per)
    model.fit(data, epochs=1, shuffle=False, verbose=0)
    dump(out, rank, held(features.tables),
         [model.head.kernel, model.head.bias])


def run_tf1(rank, size, out, ev_storage="dram"):
    feats, label, per = local_slices(rank, size)
    with tf.Graph().as_default():
        data = tf.compat.v1.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensor_slices((feats, label)).batch(per))
        x, y = data.get_next()
        embedded = fc.input_layer(x, make_columns(ev_storage))
        w = tf.compat.v1.get_variable(
            "w", [embedded.shape[1], 1],
            initializer=tf.compat.v1.constant_initializer(0.1),
            use_resource=True)
        loss = tf.reduce_mean(tf.square(tf.matmul(embedded, w) - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = ge.DistributedOptimizer(
            ge.train.AdagradOptimizer(0.1))
        train_op = opt.minimize(loss, global_step=step)
        graph = tf.compat.v1.get_default_graph()
        tables = importlib.import_module(
            "group_embedding.feature_column.input_layer").graph_tables(graph)
        # Built before the session finalizes the graph.
        fetches = {n: (list(t.export()[:2]) + [t.default_values]
                       if is_embedding_variable(t)
                       else t.shard if isinstance(t, ge.ShardedVariable)
                       else t) for n, t in tables.items()}
        hooks = [ge.BroadcastVariablesHook(0)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as s:
            for _ in range(STEPS):
                s.run(train_op)
            values = s.run(fetches)
            dense = s.run([w])
    dump(out, rank, held(tables, values), dense)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["keras", "tf1"])
    parser.add_argument("--out")
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--ev-storage", default="dram",
                        choices=["dram", "hbm"])
    args = parser.parse_args()
    hvd = ge.enable_distributed_strategy(
        "collective", **(PLAN if args.plan else {}))
    if args.api == "keras":
        run_keras(hvd.rank(), hvd.size(), args.out, args.plan,
                  args.ev_storage)
    else:
        run_tf1(hvd.rank(), hvd.size(), args.out, args.ev_storage)
    print(f"worker {hvd.rank()}/{hvd.size()}: trained {args.api}", flush=True)


if __name__ == "__main__":
    main()
