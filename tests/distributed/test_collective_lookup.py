"""What an owner accepts from its peers in `collective_lookup.exchange_rows`.

One process plays worker 0 of 2: the id exchange is replaced by a buffer
that "worker 1" crafted (keys it does not own to worker 0, bad counts or
table slots). The owner must refuse it naming the table and the sender,
before inserting anything (issue 25.7: keys with key mod N != rank made
the checkpoint unrestorable).
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.distributed import collective_lookup
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed import transport
from group_embedding.ops.ragged_ids import FeatureIds


class _FakeHorovod:
    """Worker 0 of 2; the exchanges themselves are patched."""

    def size(self):
        return 2

    def rank(self):
        return 0


def _exchange(monkeypatch, received, received_splits):
    """Runs exchange_rows of key 4 on a fresh EV as worker 0 of 2, with
    `received` ([table slot, key, count] rows) as what the peers sent."""
    calls = []

    def fake_alltoall(hvd, data, splits, name, expected=None, derived=0):
        calls.append(name)
        if name.startswith("ids:"):
            return (tf.constant(received, tf.int64),
                    tf.constant(received_splits, tf.int32))
        return data, splits  # the rows go back unchanged

    monkeypatch.setattr(distributed_strategy, "horovod", _FakeHorovod)
    monkeypatch.setattr(collective_lookup, "_alltoall", fake_alltoall)
    ev = ge.get_embedding_variable(
        f"t_ev_{len(received)}_{abs(hash(str(received)))}", 3,
        initializer=tf.keras.initializers.Zeros())
    feat = FeatureIds(tf.constant([4], tf.int64),
                      tf.constant([0, 1], tf.int64), None, None, None, "f")
    try:
        return collective_lookup.exchange_rows([ev], [feat], ["t_ev"],
                                               training=True)
    finally:
        keys = np.sort(ev.export()[0].numpy())
        # Nothing another worker owns was inserted.
        assert np.all(np.mod(keys, 2) == 0), keys


def test_owned_keys_are_looked_up(monkeypatch):
    rows = _exchange(monkeypatch, [[0, 4, 1], [0, 6, 2]], [1, 1])
    assert rows.shape == (1, 3)


def test_key_of_another_worker_fails_naming_the_sender(monkeypatch):
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            r"t_ev: worker 1 sent key 3, owned by worker 1 \(key mod 2\), "
            r"not by this worker \(0\)")):
        _exchange(monkeypatch, [[0, 4, 1], [0, 3, 1]], [1, 1])


@pytest.mark.parametrize("count", [0, -1, 2**40])
def test_bad_count_fails_naming_the_sender(monkeypatch, count):
    # Counts go to tf.repeat: 2**40 would allocate 2**40 keys.
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            rf"t_ev: worker 1 sent key 6 with count {count}, outside "
            rf"\[1, 2147483647\]")):
        _exchange(monkeypatch, [[0, 4, 1], [0, 6, count]], [1, 1])


def test_counts_summing_past_the_cap_fail_naming_the_sender(monkeypatch):
    # Each count is in range, but their sum is what tf.repeat allocates,
    # with a dim-3 float32 row per key (two of them counted: the row, then
    # its gradient): 2 x 6 ids > 10 (a 320-byte cap, 32 bytes an id).
    # Before, 1M keys of count 2**31-1 asked tf.repeat for 2**51 ids, and
    # the cap counted 8 bytes an id, not the rows.
    monkeypatch.setitem(transport._state, "max_bytes", 320)
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            r"worker 1 sent EV keys of t_ev whose counts sum to 12, more "
            r"than 10 ids \(GROUP_EMBEDDING_TRANSPORT_MAX_BYTES over 32 "
            r"bytes an id and its rows\)")):
        _exchange(monkeypatch, [[0, 4, 1], [0, 6, 6], [0, 8, 6]], [1, 2])
    rows = _exchange(monkeypatch, [[0, 4, 1], [0, 6, 5], [0, 8, 5]],
                     [1, 2])  # 10: accepted
    assert rows.shape == (1, 3)


def test_bad_table_slot_fails_naming_the_sender(monkeypatch):
    with pytest.raises(tf.errors.InvalidArgumentError, match=(
            r"worker 1 sent an id of table slot 5, the group has 1 "
            r"table")):
        _exchange(monkeypatch, [[0, 4, 1], [5, 6, 1]], [1, 1])


def test_nothing_received_passes():
    # A step where no peer asks this owner for anything.
    ev = ge.get_embedding_variable("t_ev_empty", 3)
    collective_lookup._check_received(
        [ev], tf.zeros([0, 3], tf.int64), tf.constant([0, 0], tf.int32),
        ["t_ev"], 0, 2, True)
