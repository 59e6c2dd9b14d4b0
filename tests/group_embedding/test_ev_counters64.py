"""EV frequencies and versions are 64-bit end to end.

Versions are steps: past step 2**32 (or with timestamp steps) they must
keep ordering, or GlobalStepEvict removes keys updated in the current
step. Frequencies must saturate instead of wrapping, or a hot key loses
CounterFilter admission. The states start from checkpoints "near the
limit", restored through tf.train.Checkpoint.
"""

import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import ev_storage

DIM = 3
INT64_MAX = 2**63 - 1


def _ev(name, steps_to_live=None, filter_freq=None):
    option = ge.EmbeddingVariableOption(
        evict_option=(None if steps_to_live is None
                      else ge.GlobalStepEvict(steps_to_live=steps_to_live)),
        filter_option=(None if filter_freq is None
                       else ge.CounterFilter(filter_freq=filter_freq)))
    return ge.get_embedding_variable(
        name, DIM, initializer=tf.keras.initializers.Zeros(),
        ev_option=option)


def _import(ev, keys, values, freqs, versions, step):
    ev_storage.import_(ev.handle, tf.constant(keys, tf.int64),
                       tf.constant(values, tf.float32), freqs, versions,
                       tf.constant([], tf.string), tf.zeros([0]),
                       tf.zeros([len(keys), 0]), step)


def _state(ev):
    keys, values, versions, freqs = (x.numpy() for x in ev.export())
    order = np.argsort(keys)
    return keys[order], values[order], freqs[order], versions[order]


def _restored_copy(ev, name, tmp_path, **option):
    """A fresh EV restored from a checkpoint of `ev`."""
    path = tf.train.Checkpoint(ev=ev).write(str(tmp_path / name))
    copy = _ev(name, **option)
    tf.train.Checkpoint(ev=copy).read(path).assert_consumed()
    return copy


def test_checkpoint_keeps_64bit_freqs_and_versions(tmp_path):
    ev = _ev("c64_src")
    keys = [1, 2, 3]
    freqs = np.array([1, 2**32 - 1, INT64_MAX], np.int64)
    versions = np.array([5, 2**32 + 5, 2**40], np.int64)
    _import(ev, keys, np.ones([3, DIM]), freqs, versions, 2**40)
    copy = _restored_copy(ev, "c64_dst", tmp_path)
    k, _, f, v = _state(copy)
    np.testing.assert_array_equal(k, keys)
    np.testing.assert_array_equal(f, freqs)
    np.testing.assert_array_equal(v, versions)


def test_update_after_step_2_32_is_not_evicted(kernel_mode, tmp_path):
    ev = _ev(f"c64_evict_src_{kernel_mode}", steps_to_live=10)
    # Both keys are fresh at the save (ages 5 and 0), past step 2**32.
    _import(ev, [1, 2], np.full([2, DIM], 0.5), np.array([1, 1], np.int64),
            np.array([2**32, 2**32 + 5], np.int64), 2**32 + 5)
    ev = _restored_copy(ev, f"c64_evict_{kernel_mode}", tmp_path,
                        steps_to_live=10)
    opt = ge.optimizers.SGD(0.5)
    step = 2**32 + 100
    opt.iterations.assign(step)
    ids = tf.ragged.constant([[2], [2, 4]], dtype=tf.int64)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(
            ge.group_embedding_lookup_sparse([ev], [ids], "sum")[0])
    opt.apply_gradients(zip(tape.gradient(loss, [ev]), [ev]))
    keys, values, _, versions = _state(ev)
    np.testing.assert_array_equal(keys, [1, 2, 4])
    # The step's updates stamp the step itself.
    np.testing.assert_array_equal(versions[1:], [step, step])
    np.testing.assert_allclose(values[1:], [[-0.5] * DIM, [-0.5] * DIM])
    # Only key 1 (age 100 > 10) goes; the keys of this step stay.
    assert int(ev.evict()) == 1
    np.testing.assert_array_equal(_state(ev)[0], [2, 4])


def test_hot_key_keeps_admission_past_2_32(kernel_mode, tmp_path):
    ev = _ev(f"c64_filter_src_{kernel_mode}", filter_freq=3)
    _import(ev, [7, 8], np.full([2, DIM], 0.25),
            np.array([2**32 - 1, INT64_MAX], np.int64),
            np.array([1, 1], np.int64), 1)
    ev = _restored_copy(ev, f"c64_filter_{kernel_mode}", tmp_path,
                        filter_freq=3)
    ids = tf.ragged.constant([[7], [8]], dtype=tf.int64)
    for _ in range(2):
        out = ge.group_embedding_lookup_sparse([ev], [ids], "sum")[0]
        # Admitted keys read their value, not the filter's 0.
        np.testing.assert_array_equal(out.numpy(), np.full([2, DIM], 0.25))
    _, _, freqs, _ = _state(ev)
    # One count per occurrence, saturating at the int64 maximum.
    np.testing.assert_array_equal(freqs, [2**32 + 1, INT64_MAX])


def test_import_accepts_32bit_counter_arrays():
    ev = _ev("c64_narrow")
    freqs = np.array([3, 2**32 - 1], np.uint32)
    versions = np.array([9, 2**31 - 1], np.int32)
    _import(ev, [4, 5], np.zeros([2, DIM]), freqs, versions, np.int32(12))
    _, _, f, v = _state(ev)
    np.testing.assert_array_equal(f, freqs.astype(np.int64))
    np.testing.assert_array_equal(v, versions.astype(np.int64))
