"""EV lookups whose keys resolve on several threads (issue 36.5).

A variable with more than 4096 keys in a batch has its keys split over
the intra-op threads: ranges of keys without training; with training,
when the group has too few variables to keep the threads busy, parts by
key hash (each counts its own keys), then the missing keys are inserted
in group order on one thread. These batches are big enough for every
split, and the oracle is numpy: what each occurrence reads (the value
stored before the batch, the default row of a new key, the filter's
constant), occurrence counts, versions and the keys stored.
"""

import numpy as np
import tensorflow as tf

import group_embedding as ge

import ev_cases

N = 30000  # occurrences per batch: > 4096 per part on any thread count


def _keys(rng, n, pool):
    # Zipf-like repeats over `pool`: hot keys in many parts' hands.
    return pool[np.minimum(rng.zipf(1.3, n) - 1, len(pool) - 1)]


def _stored(ev):
    keys, values, freqs, versions = ev_cases.export_sorted(ev)
    return {int(k): (v, f, ver)
            for k, v, f, ver in zip(keys, values, freqs, versions)}


def test_training_reads_counts_and_inserts_as_numpy():
    rng = np.random.default_rng(0)
    pool = rng.permutation(np.arange(-9000, 9000, 3, dtype=np.int64))
    ev = ev_cases.make_ev("par_train")
    first = _keys(rng, N, pool[:3000])
    ev.lookup_rows(tf.constant(first)).numpy()
    before = _stored(ev)
    # Half of the next batch's keys are new.
    second = _keys(rng, N, pool)
    got = ev.lookup_rows(tf.constant(second)).numpy()
    want = np.stack([before[int(k)][0] if int(k) in before
                     else ev_cases.initial_rows(ev, np.array([k]))[0]
                     for k in second])
    np.testing.assert_array_equal(got, want)
    after = _stored(ev)
    uniq, counts = np.unique(np.concatenate([first, second]),
                             return_counts=True)
    assert sorted(after) == uniq.tolist()
    np.testing.assert_array_equal([after[int(k)][1] for k in uniq], counts)


def test_reads_split_in_ranges_match_training_rows():
    rng = np.random.default_rng(1)
    ev = ev_cases.make_ev("par_read")
    known = rng.permutation(np.arange(20000, dtype=np.int64) * 7 - 5000)
    ev.lookup_rows(tf.constant(known)).numpy()
    stored = _stored(ev)
    unknown = np.arange(1, 5001, dtype=np.int64) * 7 + 10**9
    query = rng.permutation(np.concatenate([known, known[:5000], unknown]))
    got = ev.lookup_rows(tf.constant(query), training=False).numpy()
    want = np.stack([stored[int(k)][0] if int(k) in stored
                     else ev_cases.initial_rows(ev, np.array([k]))[0]
                     for k in query])
    np.testing.assert_array_equal(got, want)
    assert int(ev.size()) == len(known)  # nothing inserted, nothing counted
    np.testing.assert_array_equal(
        ev.get_frequency(known[:100]).numpy(), np.ones(100, np.int64))


def test_counter_filter_reads_before_counting():
    # CounterFilter(3): a key reads its row only once counted 3 times
    # BEFORE this batch; every occurrence of the batch reads the same.
    rng = np.random.default_rng(2)
    opt = ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=3),
        init_option=ge.InitializerOption(
            default_value_dim=ev_cases.DEFAULT_ROWS,
            default_value_no_permission=-2.0))
    ev = ev_cases.make_ev("par_filter", ev_option=opt)
    pool = np.arange(6000, dtype=np.int64) * 11
    counts = {}
    for _ in range(3):
        keys = _keys(rng, N, pool)
        got = ev.lookup_rows(tf.constant(keys)).numpy()
        admitted = np.array([counts.get(int(k), 0) >= 3 for k in keys])
        assert np.all(got[~admitted] == -2.0)
        np.testing.assert_array_equal(
            got[admitted], ev_cases.initial_rows(ev, keys[admitted]))
        for k in keys:
            counts[int(k)] = counts.get(int(k), 0) + 1
        probe = np.array(sorted(counts), np.int64)
        np.testing.assert_array_equal(ev.get_frequency(probe).numpy(),
                                      [counts[int(k)] for k in probe])


def test_tables_sharing_a_variable_count_in_group_order():
    # Two tables of one group read one variable: new keys of both are
    # inserted once, counted over both, and every occurrence reads the
    # row (or default) it would have read table after table.
    rng = np.random.default_rng(3)
    ev = ev_cases.make_ev("par_shared")
    pool = np.arange(8000, dtype=np.int64) * 13
    # No key 0, which from_dense would drop.
    ids = [_keys(rng, N, pool) + 1, _keys(rng, N // 2, pool[::-1]) + 1]
    # One batch of 3000 rows: 10 and 5 keys a row.
    widths = [10, 5]
    sp = [tf.sparse.from_dense(tf.constant(k.reshape(-1, w)))
          for k, w in zip(ids, widths)]
    out = ge.group_embedding_lookup_sparse([ev, ev], sp, "sum")
    for o, k, w in zip(out, ids, widths):
        rows = ev_cases.initial_rows(ev, k).reshape(-1, w, 4)
        np.testing.assert_allclose(o.numpy(), rows.sum(1), rtol=1e-5,
                                   atol=1e-5)
    uniq, counts = np.unique(np.concatenate(ids), return_counts=True)
    np.testing.assert_array_equal(ev.get_frequency(uniq).numpy(), counts)
    assert int(ev.size()) == len(uniq)
