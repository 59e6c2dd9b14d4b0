"""The criteo-like step without its embeddings, for
`ev_step_vs_deepray.py` and its Deepray worker (`deepray_ev_step.py`,
which runs in Deepray's TF 2.15 venv: this module imports only
TensorFlow)."""

import tensorflow as tf


def make_dense_only_step(batch, dim, num_tables):
    """The step without its embeddings: the same signature (the
    SparseTensors, ignored), `num_tables` `[batch, dim]` variables
    standing for the pooled outputs, the same concat and loss (mean of
    squares), their gradient and an SGD assign (else the gradient would
    be pruned): TF's call overhead and the model's dense work."""
    outs = [tf.Variable(tf.zeros([batch, dim])) for _ in range(num_tables)]

    @tf.function
    def step(sp_ids):
        del sp_ids
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.concat(outs, 1)))
        for v, g in zip(outs, tape.gradient(loss, outs)):
            v.assign_sub(0.01 * g)
        return loss
    return step
