"""DLRM as in DeepRec's `modelzoo/dlrm/train.py`, on stock TF 2.21.

The DeepRec script with `import group_embedding.compat` added: embedding
columns (EV columns with `--ev True`, admission filter and eviction from
`--ev_filter` / `--ev_elimination`) in a `group_embedding_column_scope`
with `--group_embedding`, numeric columns under the model zoo's
`min_max_variable_partitioner`, `tf.layers` MLPs with batch norm,
`tf.train.AdamAsyncOptimizer` (the default `--optimizer`),
MonitoredTrainingSession, then the AUC on `eval.csv` from the checkpoint.
`--tf` is the stock baseline. Prints one JSON line (see common.report).

    python dlrm_script.py --data_location DIR --ev True --ev_filter counter \
        --group_embedding localized
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


class DLRM:
    """Bottom MLP over the numeric features, interaction with the
    embeddings (`cat` or `dot`), top MLP, sigmoid."""

    def __init__(self, tf, args, dense_column, sparse_column, inputs,
                 input_layer_partitioner, dense_layer_partitioner,
                 mlp_bot=(64, 32, 16), mlp_top=(128, 64),
                 interaction_op="cat"):
        self.tf = tf
        self._args = args
        self._feature, self._label = inputs
        self._dense_column = dense_column
        self._sparse_column = sparse_column
        self._input_layer_partitioner = input_layer_partitioner
        self._dense_layer_partitioner = dense_layer_partitioner
        self._mlp_bot = mlp_bot
        self._mlp_top = mlp_top
        self.interaction_op = interaction_op
        self._create_model()
        with tf.name_scope("head"):
            self._create_loss()
            self._create_optimizer()
            self._create_metrics()

    def _dot_op(self, features):
        tf = self.tf
        batch_size = tf.shape(features)[0]
        matrixdot = tf.matmul(features, features, transpose_b=True)
        feature_dim = matrixdot.shape[-1]
        ones = tf.ones_like(matrixdot)
        lower = tf.cast(ones - tf.linalg.band_part(ones, 0, -1), tf.bool)
        result = tf.boolean_mask(matrixdot, lower)
        return tf.reshape(result,
                          (batch_size, feature_dim * (feature_dim - 1) // 2))

    def _mlp(self, net, units, scope):
        tf = self.tf
        with tf.variable_scope(scope, partitioner=self._dense_layer_partitioner,
                               reuse=tf.AUTO_REUSE):
            for layer_id, num_hidden_units in enumerate(units):
                with tf.variable_scope("%s_hiddenlayer_%d" % (scope, layer_id),
                                       reuse=tf.AUTO_REUSE) as layer_scope:
                    net = tf.layers.dense(net, units=num_hidden_units,
                                          activation=tf.nn.relu,
                                          name=layer_scope)
                    if scope == "mlp_bot_layer":
                        net = tf.layers.batch_normalization(
                            net, training=True, trainable=True)
                    tf.summary.scalar(
                        "%s/fraction_of_zero_values" % layer_scope.name,
                        tf.nn.zero_fraction(net))
        return net

    def _create_model(self):
        tf = self.tf
        with tf.variable_scope("input_layer", reuse=tf.AUTO_REUSE):
            with tf.variable_scope("dense_input_layer",
                                   partitioner=self._input_layer_partitioner,
                                   reuse=tf.AUTO_REUSE):
                dense_inputs = tf.feature_column.input_layer(
                    self._feature, self._dense_column)
            with tf.variable_scope("sparse_input_layer", reuse=tf.AUTO_REUSE):
                column_tensors = {}
                sparse_inputs = tf.feature_column.input_layer(
                    features=self._feature,
                    feature_columns=self._sparse_column,
                    cols_to_output_tensors=column_tensors)
        dense_inputs = self._mlp(dense_inputs, self._mlp_bot, "mlp_bot_layer")
        if self.interaction_op == "dot":
            with tf.variable_scope("Op_dot_layer", reuse=tf.AUTO_REUSE):
                stacked = tf.stack(
                    [dense_inputs] + [column_tensors[c]
                                      for c in self._sparse_column], axis=1)
                mlp_input = tf.concat(
                    [dense_inputs, self._dot_op(stacked)], 1)
        else:
            mlp_input = tf.concat([dense_inputs, sparse_inputs], 1)
        mlp_logits = self._mlp(mlp_input, self._mlp_top, "mlp_top_layer")
        with tf.variable_scope("logits", reuse=tf.AUTO_REUSE) as logits_scope:
            self._logits = tf.layers.dense(mlp_logits, units=1,
                                           activation=None, name=logits_scope)
            self.probability = tf.math.sigmoid(self._logits)
            tf.summary.histogram("%s/activation" % logits_scope.name,
                                 self.probability)

    def _create_loss(self):
        tf = self.tf
        loss_func = tf.keras.losses.BinaryCrossentropy()
        predict = tf.squeeze(self.probability)
        self.loss = tf.math.reduce_mean(loss_func(self._label, predict))
        tf.summary.scalar("loss", self.loss)

    def _create_optimizer(self):
        tf = self.tf
        self.global_step = tf.train.get_or_create_global_step()
        optimizer = common.create_optimizer(tf, self._args, self.global_step)
        self.train_op = optimizer.minimize(self.loss,
                                           global_step=self.global_step)

    def _create_metrics(self):
        tf = self.tf
        self.auc, self.auc_op = tf.metrics.auc(
            labels=self._label, predictions=self.probability,
            num_thresholds=1000)
        tf.summary.scalar("eval_auc", self.auc)


def main():
    """Trains and evaluates DLRM; prints the JSON result line."""
    parser = common.get_arg_parser(optimizer="adamasync", learning_rate=0.01)
    parser.add_argument("--interaction_op", choices=["dot", "cat"],
                        default="cat")
    args = parser.parse_args()
    tf = common.import_tf(args)
    if not args.tf:
        common.set_env_for_deeprec(args, tf)
    tf.set_random_seed(args.seed)
    checkpoint_dir = args.checkpoint or tempfile.mkdtemp(
        prefix="model_DLRM_", dir=None)
    (next_element, train_init_op, test_init_op, train_steps,
     test_steps) = common.iterator_for(tf, args)
    dense_column, sparse_column = common.build_feature_columns(tf, args)
    input_layer_partitioner, dense_layer_partitioner = common.partitioners(
        tf, args)
    sess_config = common.session_config(tf, args)
    model = DLRM(tf, args, dense_column, sparse_column, next_element,
                 input_layer_partitioner, dense_layer_partitioner,
                 interaction_op=args.interaction_op)
    training = common.train(
        tf, args, sess_config, model.loss, model.train_op, model.global_step,
        train_init_op, train_steps, checkpoint_dir)
    evaluation = common.evaluate(tf, sess_config, model.auc_op,
                                 test_init_op, test_steps, checkpoint_dir)
    common.report(args, "dlrm", evaluation, training)


if __name__ == "__main__":
    main()
