"""EmbeddingVariable semantics that follow DeepRec (issue 9): admission
timing, versions of keys seen but not admitted, the L2 eviction rule,
export order, initializer precedence, seeded default initializers,
optimizer argument casting, CBFFilter, AdagradDecay on EVs, the row limit
and the "kernels unavailable" error.

Oracles: DeepRec's documented / tested numbers (Feature-Filter.md, its
`embedding_variable_ops_test.py`), stock TF optimizers on a plain
variable, and closed forms.
"""

import logging
import math

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.embedding_variable.variable import EmbeddingVariable
from group_embedding.ops import ev_storage
from group_embedding.ops import kernel_library

import ev_cases

v1 = tf.compat.v1


def _option(filter_option=None, evict_option=None, no_permission=0.0,
            rows=ev_cases.DEFAULT_ROWS, initializer=None):
    return ge.EmbeddingVariableOption(
        filter_option=filter_option, evict_option=evict_option,
        init_option=ge.InitializerOption(
            initializer=initializer, default_value_dim=rows,
            default_value_no_permission=no_permission))


def _step(ev, opt, keys):
    """One eager training step on `sum(emb^2)`; returns the rows read."""
    with tf.GradientTape() as tape:
        rows = ev.lookup_rows(tf.constant(keys, tf.int64))
        loss = tf.reduce_sum(rows * rows)
    opt.apply_gradients([(tape.gradient(loss, ev), ev)])
    return rows.numpy()


class TestCounterFilter:

    def test_duplicates_in_a_batch_read_the_same_value(self):
        # Occurrences are counted after the lookup read: three copies of
        # a new key in one batch all read the no-permission value, even
        # though the batch brings its count past filter_freq = 2.
        ev = ev_cases.make_ev("dups", ev_option=_option(
            ge.CounterFilter(filter_freq=2), no_permission=0.25))
        opt = ge.optimizers.SGD(0.1)
        np.testing.assert_allclose(_step(ev, opt, [4, 4, 4]),
                                   np.full([3, 4], 0.25))
        np.testing.assert_array_equal(ev.get_frequency([4]), [3])
        # Admitted at the end of that step: its three gradients (2 * 0.25
        # each) were applied to the real row, which the next lookup reads.
        init = ev_cases.initial_rows(ev, np.array([4]))[0]
        np.testing.assert_allclose(_step(ev, opt, [4])[0],
                                   init - 0.1 * 3 * 0.5, rtol=1e-6)

    def test_first_n_lookups_read_no_permission(self):
        # Feature-Filter.md: with filter_freq=N a key takes part in
        # training from its (N+1)-th lookup; before, the default.
        n = 3
        ev = ev_cases.make_ev("first_n", ev_option=_option(
            ge.CounterFilter(filter_freq=n), no_permission=-1.0))
        opt = ge.optimizers.SGD(0.0)
        reads = [_step(ev, opt, [9])[0] for _ in range(n + 1)]
        for got in reads[:n]:
            np.testing.assert_array_equal(got, np.full(4, -1.0))
        np.testing.assert_allclose(
            reads[n], ev_cases.initial_rows(ev, np.array([9]))[0])


class TestVersions:

    def test_deeprec_frequency_and_version(self):
        # DeepRec's testEmbeddingVariableForGetFrequencyAndVersion: steps
        # 0, 1, 2 look up [1,2,3], [1,3,5], [1,5,7] under CounterFilter(3);
        # every key seen (admitted or not) has the step it was last seen.
        ev = ev_cases.make_ev("fv", ev_option=_option(
            ge.CounterFilter(filter_freq=3), ge.GlobalStepEvict(2)))
        opt = ge.optimizers.Adagrad(0.1)
        for keys in ([1, 2, 3], [1, 3, 5], [1, 5, 7]):
            _step(ev, opt, keys)
        probe = [1, 2, 3, 4, 5, 6, 7]
        np.testing.assert_array_equal(ev.total_count(), [5, 4])
        np.testing.assert_array_equal(ev.get_frequency(probe),
                                      [3, 1, 2, 0, 2, 0, 1])
        np.testing.assert_array_equal(ev.get_version(probe),
                                      [2, 0, 1, -1, 2, -1, 2])

    def test_global_step_evict_keeps_keys_still_counting(self):
        # Key 7 is seen every step but never admitted; key 8 only at
        # step 0. At step 5 with steps_to_live=2 only key 8 is stale
        # (before issue 9 key 7 kept version 0 and was evicted with it).
        ev = ev_cases.make_ev("counting", ev_option=_option(
            ge.CounterFilter(filter_freq=100), ge.GlobalStepEvict(2)))
        opt = ge.optimizers.SGD(0.1)
        _step(ev, opt, [7, 8])
        for _ in range(5):
            _step(ev, opt, [7])
        np.testing.assert_array_equal(ev.get_version([7, 8]), [5, 0])
        assert int(ev.evict()) == 1
        keys, _, freqs, _ = ev_cases.export_sorted(ev)
        np.testing.assert_array_equal(keys, [7])
        np.testing.assert_array_equal(freqs, [6])


class TestL2WeightEvict:

    def test_half_squared_norm_rule(self):
        # Threshold 0.9: 0.5 * 3 * 0.7^2 = 0.735 is evicted, 0.5 * 3 *
        # 0.8^2 = 0.96 kept (the L2 norms, 1.21 and 1.39, would keep both).
        def init(shape, dtype=tf.float32):
            return tf.constant([[0.7] * 3, [0.8] * 3], dtype)

        ev = ge.get_embedding_variable("l2rule", 3, ev_option=_option(
            evict_option=ge.L2WeightEvict(0.9), rows=2, initializer=init))
        ev.lookup_rows(tf.constant([0, 1], tf.int64))
        assert int(ev.evict()) == 1
        keys, _, _, _ = ev_cases.export_sorted(ev)
        np.testing.assert_array_equal(keys, [1])


class TestExport:

    def test_order_is_keys_values_versions_freqs(self):
        ev = ev_cases.make_ev("export_order")
        opt = ge.optimizers.SGD(0.0)
        _step(ev, opt, [1, 1, 1, 2])  # step 0
        _step(ev, opt, [2])           # step 1
        keys, values, versions, freqs = (x.numpy() for x in ev.export())
        order = np.argsort(keys)
        np.testing.assert_array_equal(keys[order], [1, 2])
        np.testing.assert_array_equal(versions[order], [0, 1])
        np.testing.assert_array_equal(freqs[order], [3, 2])
        np.testing.assert_allclose(values[order], ev_cases.initial_rows(
            ev, np.array([1, 2])))


class TestInitializers:

    def test_initializer_option_wins_with_a_warning(self, caplog):
        option = _option(initializer=tf.keras.initializers.Constant(2.0))
        with caplog.at_level(logging.WARNING):
            ev = ge.get_embedding_variable(
                "both_inits", 3,
                initializer=tf.keras.initializers.Constant(1.0),
                ev_option=option)
        assert "both_inits" in caplog.text
        assert "InitializerOption" in caplog.text
        np.testing.assert_array_equal(ev.lookup_rows([5]), [[2.0] * 3])

    def _draw(self, name, seed):
        if seed is not None:
            tf.random.set_seed(seed)
        ev = ge.get_embedding_variable(name, 4, ev_option=_option())
        return ev.default_values.numpy()

    def test_default_initializer_follows_global_seed_eagerly(self):
        a, b = self._draw("seed_a", 11), self._draw("seed_b", 11)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, self._draw("seed_c", 12))
        # Truncated normal with stddev 1/sqrt(4), like before.
        assert np.abs(a).max() <= 2 * 0.5 + 1e-6
        assert 0.3 < a.std() < 0.6

    def test_default_initializer_follows_graph_seed(self):
        def run(seed):
            with tf.Graph().as_default():
                v1.set_random_seed(seed)
                dense = v1.get_variable("d", [2, 2])
                ev = ge.get_embedding_variable("g", 4, ev_option=_option())
                with v1.Session() as sess:
                    sess.run(v1.global_variables_initializer())
                    return sess.run(ev.default_values), sess.run(dense)

        (ev_a, dense_a), (ev_b, dense_b) = run(3), run(3)
        np.testing.assert_array_equal(ev_a, ev_b)
        np.testing.assert_array_equal(dense_a, dense_b)  # stock does too
        assert not np.array_equal(ev_a, run(4)[0])

    def test_seeded_training_repeats_its_losses(self):
        # Issue 9: a seeded TF1 script (EV with the default initializer,
        # lookup, optimizer) gives the same losses on every run. The only
        # random values are the EV's, so a run that ignored the seed would
        # differ between the two seed-5 runs, and one that ignored its
        # value would not differ for seed 6.
        def losses(seed):
            with tf.Graph().as_default():
                v1.set_random_seed(seed)
                ev = ge.get_embedding_variable("seeded_train", 4)
                ids = tf.constant([3, 7, 3, 11, 12345], tf.int64)
                w = v1.get_variable("w", [4, 1],
                                    initializer=v1.ones_initializer())
                logits = tf.matmul(ge.embedding_lookup(ev, ids), w)[:, 0]
                loss = tf.reduce_mean(tf.square(logits - 1.0))
                train = ge.train.AdagradOptimizer(0.1).minimize(loss)
                with v1.Session() as sess:
                    sess.run(v1.global_variables_initializer())
                    return [float(sess.run([loss, train])[0])
                            for _ in range(4)]

        first = losses(5)
        assert losses(5) == first  # bit for bit
        assert losses(6) != first
        assert first[-1] < first[0]  # it trained

    def test_unseeded_draws_differ(self):
        tf.random.set_seed(None)
        with tf.Graph().as_default():
            a = ge.get_embedding_variable("u1", 4, ev_option=_option())
            b = ge.get_embedding_variable("u2", 4, ev_option=_option())
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                assert not np.array_equal(*sess.run(
                    [a.default_values, b.default_values]))


def test_adam_with_int64_beta1_matches_stock():
    # DeepRec's testEmbeddingVariableForAdamFilter passes the global step
    # (an int64 tensor) as beta1; stock Adam casts it. The EV (one key)
    # must end where stock Adam leaves a one-row variable.
    with tf.Graph().as_default():
        ones = tf.keras.initializers.Constant(1.0)
        ev = ge.get_embedding_variable("adam_int", 3, initializer=ones)
        var = v1.get_variable("adam_ref", [1, 3],
                              initializer=v1.ones_initializer())
        gs = v1.train.get_or_create_global_step()
        emb = ev.lookup_rows(tf.constant([5], tf.int64))
        ref = tf.nn.embedding_lookup(var, tf.constant([0]))
        train = ge.train.AdamOptimizer(0.1, gs).minimize(
            tf.reduce_sum(emb * emb))
        ref_train = v1.train.AdamOptimizer(0.1, gs).minimize(
            tf.reduce_sum(ref * ref))
        step = v1.assign_add(gs, 1)
        with v1.Session() as sess:
            # The beta powers start from gs, initialised in parallel.
            sess.run(v1.global_variables_initializer())
            for _ in range(3):
                sess.run([train, ref_train])
                sess.run(step)
            keys, values, _, _ = sess.run(ev.export())
            want = sess.run(var)
    np.testing.assert_array_equal(keys, [5])
    assert not np.allclose(want, 1.0)
    np.testing.assert_allclose(values, want, rtol=1e-6)


class TestCBFFilter:

    def test_sizing(self):
        # m = ceil(-n ln p / (ln 2)^2), k = ceil(-log2 p).
        f = ge.CBFFilter(filter_freq=3, max_element_size=10,
                         false_positive_probability=0.01)
        assert f.num_counters == math.ceil(10 * math.log(100)
                                           / math.log(2) ** 2) == 96
        assert f.num_hashes == 7
        assert f.counter_bytes == 8
        assert ge.CBFFilter(2, 10, 0.01, tf.uint8).counter_bytes == 1

    def test_round_trip_and_errors(self):
        option = ge.EmbeddingVariableOption(filter_option=ge.CBFFilter(
            3, 1000, 0.05, counter_type=tf.uint16))
        again = ge.EmbeddingVariableOption.from_config(option.get_config())
        assert again.filter_option == option.filter_option
        with pytest.raises(ValueError, match="filter_freq"):
            ge.CBFFilter(255, 10, 0.01, tf.uint8)
        with pytest.raises(ValueError, match="max_element_size"):
            ge.CBFFilter(2, 0, 0.01)
        with pytest.raises(ValueError, match="false_positive_probability"):
            ge.CBFFilter(2, 10, 1.5)
        with pytest.raises(ValueError, match="counter_type"):
            ge.CBFFilter(2, 10, 0.01, tf.float32)

    def test_deeprec_zoo_size_keeps_only_touched_counters(self):
        # DeepRec's model zoo asks for max_element_size=2**30 at p=0.01:
        # about 10**10 uint64 counters (82 GB). Only the counters keys
        # touch are kept, so the table is cheap and counts as usual.
        f = ge.CBFFilter(3, 2 ** 30, 0.01, counter_type=tf.int64)
        assert f.num_counters * f.counter_bytes > 80 * 10 ** 9
        ev = ev_cases.make_ev("cbf_zoo", ev_option=_option(
            f, no_permission=0.5))
        opt = ge.optimizers.SGD(0.0)
        keys = [3, 2 ** 40, -7]
        for _ in range(3):
            np.testing.assert_array_equal(_step(ev, opt, keys),
                                          [[0.5] * 4] * 3)
        assert int(ev.size()) == 3  # admitted by the third lookup
        np.testing.assert_allclose(
            _step(ev, opt, keys),
            ev_cases.initial_rows(ev, np.array(keys)))
        # Seven hashes per key, a few dozen bytes each: far from 82 GB.
        assert int(ev_storage.size(ev.handle)[1]) < 2 ** 20

    def test_sparse_counters_admit_as_the_array(self):
        # The same filter size with uint8 counters is one array (50 MB),
        # with uint64 counters a map of the touched ones (the array would
        # be 400 MB): same counters and hashes, so the same keys must be
        # admitted at the same lookups.
        def admitted_after_each_lookup(counter_type):
            ev = ge.get_embedding_variable(
                f"cbf_{counter_type}", 2, ev_option=_option(
                    ge.CBFFilter(3, 5 * 10 ** 6, 0.01, counter_type)))
            rng = np.random.default_rng(0)
            sizes = []
            for _ in range(6):
                ev.lookup_rows(tf.constant(rng.integers(0, 3000, 2000),
                                           tf.int64))
                sizes.append(sorted(ev.export()[0].numpy().tolist()))
            return sizes

        dense, sparse = (admitted_after_each_lookup(t)
                         for t in (tf.uint8, tf.uint64))
        assert len(dense[-1]) > 1000  # most keys were admitted in the end
        assert dense == sparse

    @pytest.mark.parametrize("dtype", [tf.int64, tf.int32, "int8"])
    def test_signed_counter_type_counts_in_uint64(self, dtype):
        # DeepRec's model zoo passes counter_type=tf.int64; DeepRec counts
        # in uint64 for every type but the unsigned ones.
        f = ge.CBFFilter(3, 2 ** 10, 0.01, counter_type=dtype)
        assert f.counter_type == "uint64" and f.counter_bytes == 8

    def test_admission_and_no_memory_before(self):
        # DeepRec's testEVInitializerWithBloomFeatureFilter: filter_freq=3,
        # three lookups read the default, the fourth the real row. Keys
        # not admitted are not stored.
        ev = ev_cases.make_ev("cbf", ev_option=_option(
            ge.CBFFilter(3, 10, 0.01), no_permission=0.5))
        opt = ge.optimizers.SGD(0.0)
        bytes0 = int(ev_storage.size(ev.handle)[1])
        for _ in range(2):
            np.testing.assert_array_equal(_step(ev, opt, [3]), [[0.5] * 4])
        assert int(ev.size()) == 0
        assert int(ev_storage.size(ev.handle)[1]) == bytes0
        np.testing.assert_array_equal(_step(ev, opt, [3]), [[0.5] * 4])
        assert int(ev.size()) == 1  # admitted by the third lookup
        np.testing.assert_allclose(
            _step(ev, opt, [3]), ev_cases.initial_rows(ev, np.array([3])))
        np.testing.assert_array_equal(ev.get_frequency([3]), [4])

    def test_false_positives_follow_the_sizing(self):
        # 1000 keys counted to 2 fill a filter sized for 1000 keys at
        # p = 0.05; of 500 new keys counted once, those admitted at once
        # are false positives: about p at first, rising to about 0.17 as
        # the new keys load the filter (1500 keys). A filter sized for
        # 10**6 keys holds the same keys with (almost) none.
        def first_sight_admitted(max_elements):
            ev = ge.get_embedding_variable(
                f"cbf_fp_{max_elements}", 2, ev_option=_option(
                    ge.CBFFilter(2, max_elements, 0.05)))
            old = tf.constant(np.arange(1000), tf.int64)
            ev.lookup_rows(old)
            ev.lookup_rows(old)
            assert int(ev.size()) == 1000
            ev.lookup_rows(tf.constant(np.arange(10**6, 10**6 + 500),
                                       tf.int64))
            return int(ev.size()) - 1000

        fp = first_sight_admitted(1000)
        assert 0.02 * 500 < fp < 0.25 * 500
        assert first_sight_admitted(10**6) <= 1


class TestAdagradDecayOnEV:

    def test_matches_plain_variable(self):
        # Same optimizer, same rule: the EV's key k must follow row k of a
        # plain variable, with keys skipping steps (per-key decay power).
        init = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 + 0.5
        feeds = [[0, 1], [1, 2], [0, 3], [3], [0, 1, 2, 3], [2]]
        with tf.Graph().as_default():
            ev = ge.get_embedding_variable("decay_ev", 3, ev_option=_option(
                rows=4, initializer=lambda shape, dtype: tf.constant(init)))
            var = tf.Variable(init, name="decay_ref")
            gs = v1.train.get_or_create_global_step()
            ids = v1.placeholder(tf.int64, [None])
            emb = ev.lookup_rows(ids)
            ref = tf.nn.embedding_lookup(var, ids)

            def make():
                return ge.train.AdagradDecayOptimizer(
                    0.1, gs, initial_accumulator_value=0.2,
                    accumulator_decay_step=2, accumulator_decay_rate=0.5)

            train = make().minimize(tf.reduce_sum(emb * emb), var_list=[ev])
            ref_train = make().minimize(tf.reduce_sum(ref * ref),
                                        var_list=[var])
            tick = v1.assign_add(gs, 1)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for keys in feeds:
                    sess.run([train, ref_train], {ids: keys})
                    sess.run(tick)
                keys, values, _, _ = sess.run(ev.export())
                want = sess.run(var)
        order = np.argsort(keys)
        np.testing.assert_array_equal(keys[order], [0, 1, 2, 3])
        np.testing.assert_allclose(values[order], want, rtol=1e-5)
        np.testing.assert_allclose(want, _adagrad_decay_oracle(init, feeds),
                                   rtol=1e-5)


def _adagrad_decay_oracle(init, feeds, lr=0.1, floor=0.2, period=2,
                          rate=0.5):
    """DeepRec's AdagradDecay in numpy on `sum(emb^2)`, step t = 0, 1, ..."""
    value = init.copy()
    acc = np.full_like(init, floor)
    power = np.zeros(len(init), np.int64)
    for t, keys in enumerate(feeds):
        g = np.zeros_like(init)
        for k in keys:
            g[k] += 2 * value[k]
        for k in sorted(set(keys)):
            if (t + 1) // period > power[k]:
                acc[k] = np.maximum(acc[k] * rate, floor)
                power[k] += 1
            acc[k] += g[k] ** 2
            value[k] -= lr * g[k] / np.sqrt(acc[k])
    return value


class TestRowLimit:

    def test_full_table_fails_naming_the_variable(self, monkeypatch):
        # The real limit (2**32 - 2 rows, uint32 indices) is out of reach
        # in a test; the same check runs with a lower cap.
        monkeypatch.setattr(EmbeddingVariable, "_max_rows_for_testing", 4)
        ev = ge.get_embedding_variable("tiny", 2, ev_option=_option(
            evict_option=ge.GlobalStepEvict(1)))
        ev.lookup_rows(tf.constant([1, 2, 3, 4], tf.int64))
        with pytest.raises(tf.errors.ResourceExhaustedError,
                           match="tiny.*full.*4 rows"):
            ev.lookup_rows(tf.constant([5], tf.int64))
        assert int(ev.size()) == 4
        # Rows freed by eviction are reused, within the cap.
        opt = ge.optimizers.SGD(0.0)
        for _ in range(3):
            _step(ev, opt, [1])
        assert int(ev.evict()) == 3
        ev.lookup_rows(tf.constant([5, 6, 7], tf.int64))
        assert int(ev.size()) == 4


def test_unavailable_kernels_error_says_why(monkeypatch):
    monkeypatch.setattr(kernel_library, "library", lambda: None)
    monkeypatch.setattr(kernel_library, "unavailable_reason",
                        lambda: "g++: internal compiler error (test)")
    with pytest.raises(RuntimeError, match="internal compiler error"):
        ev_storage.library()
