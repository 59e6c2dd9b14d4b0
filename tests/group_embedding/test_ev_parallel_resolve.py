"""EV lookups whose keys resolve on several threads (issue 36.5).

A variable with more than 4096 keys in a batch has its keys split over
the intra-op threads: ranges of keys without training; with training,
when the group has too few variables to keep the threads busy, parts by
key hash (each counts its own keys), then the missing keys are inserted
in group order on one thread. A read-only gather copies each row where
its key is found, in those ranges. These batches are big enough for
every split, and the oracle is numpy: what each occurrence reads (the
value stored before the batch, the default row of a new key, the
filter's constant), occurrence counts, versions and the keys stored. A
split that dropped or repeated a range leaves rows unread or counts
doubled, which the oracles see.
"""

import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import ev_storage

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


def _filtered_ev(name, freq, no_permission):
    """An EV under CounterFilter(freq) reading `no_permission` until
    admitted."""
    opt = ge.EmbeddingVariableOption(
        filter_option=ge.CounterFilter(filter_freq=freq),
        init_option=ge.InitializerOption(
            default_value_dim=ev_cases.DEFAULT_ROWS,
            default_value_no_permission=no_permission))
    return ev_cases.make_ev(name, ev_option=opt)


def _check_filtered_batches(ev, rng, pool, no_permission, stores_unadmitted):
    """Three training batches over `pool` against a numpy count of every
    key (filter_freq 3): what each occurrence reads (its row only if
    counted 3 times BEFORE this batch, the same for every occurrence),
    the keys stored (on first sight, or once admitted) and their
    frequencies."""
    counts = {}
    for _ in range(3):
        keys = _keys(rng, N, pool)
        got = ev.lookup_rows(tf.constant(keys)).numpy()
        admitted = np.array([counts.get(int(k), 0) >= 3 for k in keys])
        assert np.all(got[~admitted] == no_permission)
        np.testing.assert_array_equal(
            got[admitted], ev_cases.initial_rows(ev, keys[admitted]))
        for k in keys:
            counts[int(k)] = counts.get(int(k), 0) + 1
        stored = sorted(k for k, c in counts.items()
                        if stores_unadmitted or c >= 3)
        assert sorted(_stored(ev)) == stored
        np.testing.assert_array_equal(
            ev.get_frequency(np.array(stored, np.int64)).numpy(),
            [counts[k] for k in stored])


def test_counter_filter_reads_before_counting():
    # CounterFilter(3): keys are stored on first sight.
    ev = _filtered_ev("par_filter", 3, -2.0)
    _check_filtered_batches(ev, np.random.default_rng(2),
                            np.arange(6000, dtype=np.int64) * 11, -2.0,
                            stores_unadmitted=True)


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


def _trained_ev(name, keys, ev_option=None):
    """An EV holding `keys`, each looked up once and moved by one SGD step
    whose gradient depends on the key, so that a stored row differs from
    every default row (a read of the wrong row, or of none, shows)."""
    ev = ev_cases.make_ev(name, ev_option=ev_option)
    ids = tf.RaggedTensor.from_uniform_row_length(tf.constant(keys), 1)
    scale = tf.constant(((keys % 97) + 1).astype(np.float32)[:, None])
    with tf.GradientTape() as tape:
        (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
        loss = tf.reduce_sum(emb * scale)
    ge.optimizers.SGD(0.01).apply_gradients([(tape.gradient(loss, ev), ev)])
    return ev


def _want_reads(ev, stored, query, no_permission=None, freq_needed=0):
    # What a read-only lookup of `query` gives: the stored row of an
    # admitted key, else the filter's constant (with a filter) or the
    # key's default row.
    rows = []
    for k in query:
        entry = stored.get(int(k))
        if entry is not None and entry[1] >= freq_needed:
            rows.append(entry[0])
        elif no_permission is not None:
            rows.append(np.full(4, no_permission, np.float32))
        else:
            rows.append(ev_cases.initial_rows(ev, np.array([k]))[0])
    return np.stack(rows)


def test_gather_copies_every_range_of_one_big_variable():
    # One variable, 40000 keys: split in ranges on every thread (up to
    # twice the threads), each copying its rows into the output. Stored
    # keys (trained), repeats of them and unknown keys, interleaved.
    rng = np.random.default_rng(4)
    known = rng.permutation(np.arange(25000, dtype=np.int64) * 5 - 60000)
    ev = _trained_ev("par_gather", known)
    stored = _stored(ev)
    unknown = np.arange(1, 5001, dtype=np.int64) * 5 + 7 + 10**12
    query = rng.permutation(np.concatenate([known, known[:10000], unknown]))
    got = ev.lookup_rows(tf.constant(query), training=False).numpy()
    np.testing.assert_array_equal(got, _want_reads(ev, stored, query))
    # Read only: nothing inserted, counted or stamped.
    after = _stored(ev)
    assert sorted(after) == sorted(stored)
    for k in known[:200]:
        assert after[int(k)][1:] == stored[int(k)][1:]


def test_gather_of_a_group_lays_out_each_table_at_its_offset():
    # Three tables over two variables (one twice), of sizes not multiples
    # of the part count, read-only and in one op.
    rng = np.random.default_rng(5)
    a_keys = np.arange(12000, dtype=np.int64) * 3 + 1
    b_keys = np.arange(9000, dtype=np.int64) * 7 - 4
    ev_a = _trained_ev("par_group_a", a_keys)
    ev_b = _trained_ev("par_group_b", b_keys)
    queries = [rng.choice(np.r_[a_keys, a_keys + 2], 17001),
               rng.choice(np.r_[b_keys, b_keys + 1], 8193),
               rng.choice(a_keys, 9999)]
    got = ev_storage.group_gather(
        [ev_a, ev_b, ev_a], [tf.constant(q) for q in queries],
        False).numpy()
    want = np.concatenate([
        _want_reads(ev, _stored(ev), q)
        for ev, q in zip([ev_a, ev_b, ev_a], queries)])
    np.testing.assert_array_equal(got, want)


def test_gather_with_counter_filter_reads_admitted_rows_only():
    # CounterFilter(2): keys seen twice read their row, keys seen once
    # and unknown keys the filter's constant, over every range.
    rng = np.random.default_rng(6)
    ev = _filtered_ev("par_gather_filter", 2, -3.0)
    twice = np.arange(12000, dtype=np.int64) * 11 + 3
    once = np.arange(12000, dtype=np.int64) * 11 + 5
    ev.lookup_rows(tf.constant(np.r_[twice, twice, once])).numpy()
    stored = _stored(ev)
    unknown = np.arange(3000, dtype=np.int64) * 11 + 9
    query = rng.permutation(np.r_[twice, once, unknown, twice[:4000]])
    got = ev.lookup_rows(tf.constant(query), training=False).numpy()
    want = _want_reads(ev, stored, query, no_permission=-3.0,
                       freq_needed=2)
    np.testing.assert_array_equal(got, want)
    assert np.sum(np.all(got == -3.0, axis=1)) == len(once) + len(unknown)


def test_gather_over_an_ssd_tier_matches_dram(tmp_path):
    # A tiered variable whose DRAM holds a few rows: the read-only
    # lookup promotes the keys on disk first (the rows it finds in DRAM
    # are taken as found), then reads on every thread; it reads what an
    # all-DRAM twin reads, bit for bit.
    rng = np.random.default_rng(7)
    keys = rng.permutation(np.arange(20000, dtype=np.int64) * 13 - 7)
    evs = []
    for name, storage in [
            ("dram", ge.StorageOption()),
            ("ssd", ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                                     storage_path=str(tmp_path / "t"),
                                     storage_size=[1 << 16]))]:
        opt = ge.EmbeddingVariableOption(
            init_option=ge.InitializerOption(
                default_value_dim=ev_cases.DEFAULT_ROWS),
            storage_option=storage)
        evs.append(_trained_ev(f"par_tier_{name}", keys, ev_option=opt))
    dram, ssd = evs
    # A step on other keys moves most rows to disk.
    ssd.lookup_rows(tf.constant(np.arange(2000, dtype=np.int64) + 10**9))
    assert int(ev_storage.tier_stats(ssd.handle)[1]) > 10000
    query = rng.permutation(np.r_[keys, keys[:5000],
                                  np.arange(3000, dtype=np.int64) + 10**10])
    got = ssd.lookup_rows(tf.constant(query), training=False).numpy()
    want = dram.lookup_rows(tf.constant(query), training=False).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(
        got, _want_reads(dram, _stored(dram), query))


def test_cbf_filter_counts_split_keys_and_admits_in_order():
    # CBFFilter(3), sized so that 6000 keys share no counters in practice
    # (false positives 1e-5 at 10**5 keys): a key is stored at its third
    # occurrence with freq 3, counted from then on, and reads its row
    # only if stored before the batch. Stored keys are counted by hash
    # parts, new ones in the Bloom filter in group order.
    opt = ge.EmbeddingVariableOption(
        filter_option=ge.CBFFilter(3, 100000, 1e-5, tf.uint8),
        init_option=ge.InitializerOption(
            default_value_dim=ev_cases.DEFAULT_ROWS,
            default_value_no_permission=-4.0))
    ev = ev_cases.make_ev("par_cbf", ev_option=opt)
    _check_filtered_batches(ev, np.random.default_rng(8),
                            np.arange(6000, dtype=np.int64) * 17 - 3, -4.0,
                            stores_unadmitted=False)
