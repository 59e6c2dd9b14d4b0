"""DCNv2 as in DeepRec's `modelzoo/features/group_embedding/dcnv2/train.py`,
on stock TF 2.21.

The DeepRec script with `import group_embedding.compat` added: ids hashed
with `tf.strings.to_hash_bucket_fast`, one `tf.get_embedding_variable` per
column and ONE `tf.nn.group_embedding_lookup_sparse` over RaggedTensor ids
(or, with `--use_feature_columns`, EV columns in a
`group_embedding_column_scope` and `input_layer`), a cross layer and an
MLP, `tf.train.AdagradOptimizer(0.01)`. DeepRec's script always runs
collective under horovodrun; here `--group_embedding collective` does that
(`enable_distributed_strategy("collective")` first, loss allreduced) and
the default runs localized in one process. The EV flags of the other model
zoo scripts apply to the tables. `--tf` is the stock baseline: hash-bucket
`tf.get_variable` tables and `tf.nn.embedding_lookup_sparse` per column.
Embedding dims and MLP are 1/8 and 1/4 of DeepRec's so that a run takes
seconds on 2 cores. Prints one JSON line.
"""

import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CATEGORICAL_COLUMNS = common.CATEGORICAL_COLUMNS
CONTINUOUS_COLUMNS = common.CONTINUOUS_COLUMNS
# DeepRec's 64 / 128, divided by 8.
EMBEDDING_DIMENSIONS = {
    c: 16 if c in ("C3", "C4", "C10", "C12", "C16", "C21", "C24", "C26")
    else 8 for c in CATEGORICAL_COLUMNS}
BUCKETS = 10000  # stock baseline only


def transform_numeric(tf, features):
    """log1p of the counts (the generated data are not Criteo's ranges,
    so DeepRec's min-max constants do not apply)."""
    return [tf.reshape(tf.math.log1p(tf.maximum(features[c], 0.0)), [-1, 1])
            for c in CONTINUOUS_COLUMNS]


def transform_categorical(tf, args, features):
    """One table per column, all looked up in one grouped op (stock: one
    `embedding_lookup_sparse` per column)."""
    ids, tables, combiners = [], [], []
    for column_name in CATEGORICAL_COLUMNS:
        dim = EMBEDDING_DIMENSIONS[column_name]
        init = tf.random_normal_initializer(mean=0.0, stddev=0.05)
        if args.tf:
            category = tf.strings.to_hash_bucket_fast(features[column_name],
                                                      BUCKETS)
            tables.append(tf.get_variable("%s_weight" % column_name,
                                          [BUCKETS, dim], initializer=init))
        else:
            category = tf.strings.to_hash_bucket_fast(
                features[column_name], 2 ** 63 - 1)
            tables.append(tf.get_embedding_variable(
                "%s_weight" % column_name, embedding_dim=dim,
                initializer=init, ev_option=common.ev_option(tf, args)))
        ids.append(tf.RaggedTensor.from_row_lengths(
            values=category, row_lengths=tf.ones_like(category)))
        combiners.append("sum")
    if args.tf:
        return [tf.nn.embedding_lookup_sparse(t, i.to_sparse(), None,
                                              combiner="sum")
                for t, i in zip(tables, ids)]
    return tf.nn.group_embedding_lookup_sparse(tables, ids, combiners)


def feature_column_inputs(tf, args, features):
    """`--use_feature_columns`: numeric columns plus EV columns in one
    group scope (stock: hash-bucket columns), through `input_layer`."""
    columns = [tf.feature_column.numeric_column(
        c, normalizer_fn=lambda x: tf.math.log1p(tf.maximum(x, 0.0)))
        for c in CONTINUOUS_COLUMNS]

    def embedding(column_name):
        if args.tf:
            cat = tf.feature_column.categorical_column_with_hash_bucket(
                column_name, BUCKETS, dtype=tf.string)
        else:
            cat = tf.feature_column.categorical_column_with_embedding(
                key=column_name, dtype=tf.string,
                ev_option=common.ev_option(tf, args))
        return tf.feature_column.embedding_column(
            categorical_column=cat,
            dimension=EMBEDDING_DIMENSIONS[column_name],
            initializer=tf.random_normal_initializer(stddev=0.05))

    if args.tf:
        columns += [embedding(c) for c in CATEGORICAL_COLUMNS]
    else:
        with tf.feature_column.group_embedding_column_scope(
                name="categorical"):
            columns += [embedding(c) for c in CATEGORICAL_COLUMNS]
    return tf.feature_column.input_layer(features, columns)


def stacked_dcn_v2(tf, features, mlp_dims):
    """One DCNv2 cross layer (x * relu(W x + b) + x), then the MLP."""
    if isinstance(features, list):
        features = tf.concat(features, axis=-1)
    width = int(features.shape[-1])
    with tf.name_scope("cross"):
        cross = tf.layers.dense(
            features, width, activation=tf.nn.relu,
            kernel_initializer=tf.truncated_normal_initializer(
                stddev=1.0 / math.sqrt(width)))
        net = features * cross + features
    prev_dim = width
    for i, d in enumerate(mlp_dims[:-1]):
        net = tf.layers.dense(
            net, d, activation=tf.nn.relu,
            kernel_initializer=tf.random_normal_initializer(
                stddev=math.sqrt(2.0 / (prev_dim + d))), name="mlp_%d" % i)
        prev_dim = d
    return tf.layers.dense(net, mlp_dims[-1], activation=tf.nn.sigmoid,
                           name="mlp_%d" % (len(mlp_dims) - 1))


def main():
    """Trains and evaluates DCNv2; prints the JSON result line."""
    parser = common.get_arg_parser(optimizer="adagrad", learning_rate=0.01,
                                   optimizers=("adagrad",))
    parser.add_argument("--use_feature_columns", action="store_true")
    args = parser.parse_args()
    tf = common.import_tf(args)
    hvd = None
    if not args.tf and args.group_embedding == "collective":
        import horovod.tensorflow as hvd
        common.set_env_for_deeprec(args, tf)
    tf.set_random_seed(args.seed)
    checkpoint_dir = args.checkpoint or tempfile.mkdtemp(
        prefix="model_DCNv2_")
    (next_element, train_init_op, test_init_op, train_steps,
     test_steps) = common.iterator_for(tf, args)
    features, labels = next_element
    if args.use_feature_columns:
        inputs = feature_column_inputs(tf, args, features)
    else:
        inputs = transform_categorical(tf, args, features) + \
            transform_numeric(tf, features)
    probability = stacked_dcn_v2(tf, inputs, mlp_dims=[256, 128, 64, 1])
    labels = tf.reshape(labels, (-1, 1))
    loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(
        tf.cast(labels, tf.float32), probability))
    if hvd is not None:
        loss = hvd.allreduce(loss, op=hvd.Average)
    step = tf.train.get_or_create_global_step()
    opt = tf.train.AdagradOptimizer(learning_rate=args.learning_rate)
    train_op = opt.minimize(loss, global_step=step)
    _, auc_op = tf.metrics.auc(labels=labels, predictions=probability,
                               num_thresholds=1000)
    sess_config = common.session_config(tf, args)
    training = common.train(tf, args, sess_config, loss, train_op, step,
                            train_init_op, train_steps, checkpoint_dir)
    evaluation = common.evaluate(tf, sess_config, auc_op, test_init_op,
                                 test_steps, checkpoint_dir)
    common.report(args, "dcnv2", evaluation, training, "adagrad")


if __name__ == "__main__":
    main()
