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
