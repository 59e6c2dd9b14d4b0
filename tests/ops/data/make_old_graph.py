"""Writes `old_op_names.meta`: a TF1 training graph with the op names of
before the rename to the `GroupEmbedding` prefix (test_op_names.py).

It was run once, at the commit before the rename (issue 23.3, the commit
"Kernels: no copies left of the pooling loop, ..."), with
`python tests/ops/data/make_old_graph.py`; run now, it would write the new
names, so do not regenerate the file. `build()` is also what
test_op_names.py builds with the new names: the same graph, the same seeds,
so both must give equal numbers.

The graph: a grouped lookup of SparseTensor ids (-> GroupSparseToRagged)
over two tf.Variables and an EmbeddingVariable (pooled, one weighted
feature), a concatenated lookup, a sequence lookup with max_norm, their
gradients and one Adagrad step (sparse applies on variables and the EV).
"""

import os
import sys

import numpy as np
import tensorflow as tf

import group_embedding as ge

V1 = tf.compat.v1
HERE = os.path.dirname(os.path.abspath(__file__))
META = os.path.join(HERE, "old_op_names.meta")
# Tensors and ops the test fetches by name.
FETCHES = ("pooled_0:0", "pooled_1:0", "pooled_2:0", "concat:0",
           "sequence:0", "loss:0")
TRAIN_OP = "train_step"
TABLES = ("table_0:0", "table_1:0", "table_2:0")


def _sparse(rows, dense_shape):
    indices, values = [], []
    for r, ids in enumerate(rows):
        for c, i in enumerate(ids):
            indices.append([r, c])
            values.append(i)
    return tf.SparseTensor(np.array(indices, np.int64).reshape(-1, 2),
                           np.array(values, np.int64), dense_shape)


def build():
    """Builds the model into the current (v1) graph; returns the train op."""
    rng = np.random.default_rng(23)
    tables = [V1.get_variable(
        f"t{i}", initializer=rng.standard_normal((12, 4)).astype(np.float32))
        for i in range(3)]
    ev = ge.get_embedding_variable(
        "ev", 4, initializer=V1.random_uniform_initializer(-1, 1, seed=3))
    ids = [_sparse([[1, 3], [], [3, 3, 7]], [3, 4]),
           _sparse([[2], [5, 11], [0]], [3, 4]),
           _sparse([[10**9, 5], [7], []], [3, 4])]
    weights = tf.SparseTensor(ids[1].indices,
                              tf.constant([0.5, 2.0, -1.0, 1.5]),
                              ids[1].dense_shape)
    pooled = ge.group_embedding_lookup_sparse(
        [tables[0], tables[1], ev], ids, ["mean", "sum", "sqrtn"],
        sp_weights=[None, weights, None])
    concat = ge.group_embedding_lookup_sparse(
        tables[:2], ids[:2], ["sqrtn", "mean"], concat_outputs=True)
    (sequence,) = ge.group_embedding_lookup_sparse(
        [tables[2]], [ids[0]], ["sum"], is_sequence=True, max_norm=1.5)
    outs = [tf.identity(p, name=f"pooled_{i}") for i, p in enumerate(pooled)]
    outs.append(tf.identity(concat, name="concat"))
    outs.append(tf.identity(sequence, name="sequence"))
    # The sequence's T is known only at run time: weigh its sum over T.
    flat = outs[:-1] + [tf.reduce_sum(outs[-1], axis=1)]
    scale = [tf.constant(rng.standard_normal((3, o.shape[1])).astype(
        np.float32)) for o in flat]
    loss = tf.add_n([tf.reduce_sum(o * s) for o, s in zip(flat, scale)],
                    name="loss")
    for i, t in enumerate(tables):
        tf.identity(t, name=f"table_{i}")
    opt = ge.train.AdagradOptimizer(0.1)
    return tf.group(opt.minimize(loss), name=TRAIN_OP)


def main():
    with tf.Graph().as_default():
        V1.set_random_seed(1)
        build()
        V1.train.export_meta_graph(filename=META, clear_devices=True)
    print("wrote", META, os.path.getsize(META), "bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
