"""A DeepRec-style TF1 script using `tf.layers.dense` (Keras 2 layers):
EV feature columns in a scope, `input_layer`, `tf.train.AdagradOptimizer`
(a ge.train optimizer after `import group_embedding.compat`),
MonitoredTrainingSession. Prints the first and last loss.

Needs `TF_USE_LEGACY_KERAS=1` and tf-keras: with Keras 3,
`tf.compat.v1.layers.dense` raises AttributeError.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

import group_embedding.compat  # noqa: E402,F401

tf.disable_eager_execution()
# Seeded, so the test's loss bound cannot fail by chance: EV rows honour
# the graph seed; tf-keras' legacy dense layers do not, so their
# initializers get their own seeds.
tf.set_random_seed(1)
rng = np.random.default_rng(0)
users = rng.integers(0, 50, (256, 1)).astype(np.int64)
labels = (users[:, 0] % 2).astype(np.float32)
features, label = tf.data.make_one_shot_iterator(
    tf.data.Dataset.from_tensor_slices(({"user": users}, labels))
    .repeat(16).batch(64)).get_next()
option = tf.EmbeddingVariableOption(
    filter_option=tf.CounterFilter(filter_freq=1))
with tf.feature_column.group_embedding_column_scope(name="ctr"):
    columns = [tf.feature_column.embedding_column(
        tf.feature_column.categorical_column_with_embedding(
            "user", dtype=tf.int64, ev_option=option), 8)]
net = tf.feature_column.input_layer(features, columns)
net = tf.layers.dense(net, 16, activation=tf.nn.relu,
                      kernel_initializer=tf.glorot_uniform_initializer(seed=2))
logits = tf.layers.dense(
    net, 1, kernel_initializer=tf.glorot_uniform_initializer(seed=3))[:, 0]
loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
    labels=label, logits=logits))
step = tf.train.get_or_create_global_step()
train_op = tf.train.AdagradOptimizer(0.3).minimize(loss, global_step=step)
losses = []
with tf.train.MonitoredTrainingSession(save_summaries_steps=None,
                                       log_step_count_steps=None) as sess:
    while not sess.should_stop():
        losses.append(sess.run([loss, train_op])[0])
version = getattr(tf.keras, "__version__", "?")
print(f"keras {version}"
      f" losses {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
