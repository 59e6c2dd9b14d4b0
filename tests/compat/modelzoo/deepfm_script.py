"""DeepFM as in DeepRec's `modelzoo/deepfm/train.py`, on stock TF 2.21.

The DeepRec script with `import group_embedding.compat` added: the same
embedding columns feed the wide, FM and deep parts through two
`input_layer` calls (one grouped lookup per scope, cached across calls)
under the model zoo's partitioned `variable_scope("input_layer")`, so
hash-bucket tables are PartitionedVariables; MSE loss on the sigmoid,
`tf.train.AdamAsyncOptimizer` by default, batch-norm update ops as control
dependencies. `--tf` is the stock baseline. Prints one JSON line.

    python deepfm_script.py --data_location DIR --ev True \
        --ev_filter counter --group_embedding localized
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


class DeepFM:
    """Linear (sum of the wide inputs) + FM second order + DNN, then a
    final DNN and a sigmoid."""

    def __init__(self, tf, args, wide_column, fm_column, deep_column,
                 inputs, input_layer_partitioner, dense_layer_partitioner,
                 dnn_hidden_units=(128, 64, 32), final_hidden_units=(32, 16)):
        self.tf = tf
        self._args = args
        self._feature, self._label = inputs
        self._wide_column = wide_column
        self._fm_column = fm_column
        self._deep_column = deep_column
        self._input_layer_partitioner = input_layer_partitioner
        self._dense_layer_partitioner = dense_layer_partitioner
        self._dnn_hidden_units = dnn_hidden_units
        self._final_hidden_units = final_hidden_units
        self._create_model()
        with tf.name_scope("head"):
            self._create_loss()
            self._create_optimizer()
            self._create_metrics()

    def _dnn(self, net, units, layer_name):
        tf = self.tf
        for layer_id, num_hidden_units in enumerate(units):
            with tf.variable_scope("%s_%d" % (layer_name, layer_id),
                                   partitioner=self._dense_layer_partitioner,
                                   reuse=tf.AUTO_REUSE) as layer_scope:
                net = tf.layers.dense(net, units=num_hidden_units,
                                      activation=tf.nn.relu, name=layer_scope)
                net = tf.layers.batch_normalization(net, training=True,
                                                    trainable=True)
        return net

    def _create_model(self):
        tf = self.tf
        with tf.variable_scope("input_layer",
                               partitioner=self._input_layer_partitioner,
                               reuse=tf.AUTO_REUSE):
            fm_cols = {}
            dnn_input = tf.feature_column.input_layer(self._feature,
                                                      self._deep_column)
            wide_input = tf.feature_column.input_layer(
                self._feature, self._wide_column,
                cols_to_output_tensors=fm_cols)
            fm_input = tf.stack([fm_cols[c] for c in self._fm_column], 1)
        with tf.variable_scope("dnn"):
            dnn_output = self._dnn(dnn_input, self._dnn_hidden_units,
                                   "dnn_layer")
        with tf.variable_scope("linear", reuse=tf.AUTO_REUSE):
            linear_output = tf.reduce_sum(wide_input, axis=1, keepdims=True)
        with tf.variable_scope("fm", reuse=tf.AUTO_REUSE):
            sum_square = tf.square(tf.reduce_sum(fm_input, axis=1))
            square_sum = tf.reduce_sum(tf.square(fm_input), axis=1)
            fm_output = 0.5 * tf.subtract(sum_square, square_sum)
        all_input = tf.concat([dnn_output, linear_output, fm_output], 1)
        with tf.variable_scope("final_dnn"):
            dnn_logits = self._dnn(all_input, self._final_hidden_units,
                                   "final_dnn")
        self._logits = tf.layers.dense(dnn_logits, units=1)
        self.probability = tf.math.sigmoid(self._logits)

    def _create_loss(self):
        tf = self.tf
        predict = tf.squeeze(self.probability)
        self.loss = tf.math.reduce_mean(
            tf.losses.mean_squared_error(self._label, predict))
        tf.summary.scalar("loss", self.loss)

    def _create_optimizer(self):
        tf = self.tf
        self.global_step = tf.train.get_or_create_global_step()
        optimizer = common.create_optimizer(tf, self._args, self.global_step,
                                            adagrad_accumulator=1e-8)
        with tf.control_dependencies(
                tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
            self.train_op = optimizer.minimize(self.loss,
                                               global_step=self.global_step)

    def _create_metrics(self):
        tf = self.tf
        self.auc, self.auc_op = tf.metrics.auc(
            labels=self._label, predictions=self.probability,
            num_thresholds=1000)


def main():
    """Trains and evaluates DeepFM; prints the JSON result line."""
    parser = common.get_arg_parser(
        optimizer="adamasync", learning_rate=0.001,
        optimizers=("adam", "adamasync", "adagraddecay", "adagrad"))
    args = parser.parse_args()
    tf = common.import_tf(args)
    if not args.tf:
        common.set_env_for_deeprec(args, tf)
    tf.set_random_seed(args.seed)
    checkpoint_dir = args.checkpoint or tempfile.mkdtemp(
        prefix="model_DeepFM_")
    (next_element, train_init_op, test_init_op, train_steps,
     test_steps) = common.iterator_for(tf, args)
    dense_column, sparse_column = common.build_feature_columns(tf, args)
    wide_column = deep_column = dense_column + sparse_column
    input_layer_partitioner, dense_layer_partitioner = common.partitioners(
        tf, args)
    sess_config = common.session_config(tf, args)
    model = DeepFM(tf, args, wide_column, sparse_column, deep_column,
                   next_element, input_layer_partitioner,
                   dense_layer_partitioner)
    training = common.train(
        tf, args, sess_config, model.loss, model.train_op, model.global_step,
        train_init_op, train_steps, checkpoint_dir)
    evaluation = common.evaluate(tf, sess_config, model.auc_op,
                                 test_init_op, test_steps, checkpoint_dir)
    common.report(args, "deepfm", evaluation, training)


if __name__ == "__main__":
    main()
