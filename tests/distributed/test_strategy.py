"""Argument checks of enable_distributed_strategy (no Horovod started).

The collective behaviour itself is tested under horovodrun by the
collective_* scripts beside this file.
"""

import pytest

import group_embedding as ge
from group_embedding import model_parallel
from group_embedding.distributed import strategy as distributed_strategy


@pytest.mark.parametrize("strategy", ["ps", "Collective", "", None])
def test_unknown_strategy_fails_before_starting_horovod(strategy):
    with pytest.raises(ValueError, match=r"Invalid `strategy`: .* use one "
                                         r"of collective"):
        ge.enable_distributed_strategy(strategy)
    assert not distributed_strategy.is_collective()


def test_outside_collective_mode_is_single_worker():
    assert model_parallel.world() == (0, 1)
    with pytest.raises(RuntimeError, match="enable_distributed_strategy"):
        distributed_strategy.horovod()
    # Without collective mode tables are plain, whole variables.
    table = ge.get_embedding_table("t", 10, 4)
    assert not isinstance(table, ge.ShardedVariable)
    assert table.shape == (10, 4)


def test_bad_table_arguments_fail():
    with pytest.raises(ValueError, match=r"`partition_strategy` for table "
                                         r"'t': 'range'"):
        ge.get_embedding_table("t", 10, 4, partition_strategy="range")
    with pytest.raises(ValueError, match=r"Table 't'.* >= 1"):
        ge.get_embedding_table("t", 0, 4)


def _tf1_ev_loss():
    """A TF1 graph's loss over an EV column and a dense weight `w`."""
    import tensorflow as tf
    fc = ge.feature_column
    col = fc.embedding_column(
        fc.categorical_column_with_embedding("d", dtype=tf.int64), 4)
    emb = fc.input_layer({"d": tf.constant([[1, 2], [3, 4]], tf.int64)},
                         [col])
    w = tf.compat.v1.get_variable("w", [4, 1], use_resource=True)
    return tf.reduce_mean(tf.square(tf.matmul(emb, w) - 1.0)), w


def test_a_stock_tf1_optimizer_that_would_skip_an_ev_is_refused():
    """`minimize(loss)` of every variable through a stock TF1 optimizer
    would train the dense weights and silently leave out the EV (not in
    TRAINABLE_VARIABLES): an error naming the EV. A ge.train optimizer, or
    an explicit `var_list`, is accepted."""
    import tensorflow as tf
    with tf.Graph().as_default():
        loss, _ = _tf1_ev_loss()
        opt = ge.DistributedOptimizer(
            tf.compat.v1.train.AdagradOptimizer(0.1))
        with pytest.raises(TypeError, match=r"EmbeddingVariable "
                                            r"'.*d_embedding.*' is read by the "
                                            r"loss, but a stock"):
            opt.minimize(loss)
    with tf.Graph().as_default():
        loss, w = _tf1_ev_loss()
        opt = ge.DistributedOptimizer(
            tf.compat.v1.train.AdagradOptimizer(0.1))
        opt.minimize(loss, var_list=[w])  # the user said which
    with tf.Graph().as_default():
        loss, _ = _tf1_ev_loss()
        train_op = ge.DistributedOptimizer(
            ge.train.AdagradOptimizer(0.1)).minimize(loss)
        assert train_op is not None
