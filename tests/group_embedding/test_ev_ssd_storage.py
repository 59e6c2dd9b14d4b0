"""EmbeddingVariables with a disk tier (StorageType.DRAM_SSDHASH, SSDHASH).

The reference is an all-DRAM EV trained on the same ids: an EV whose DRAM
tier holds a few rows (most keys on disk, moved back and forth every
step) must end bitwise equal to it in rows, slots, frequencies, versions
and size, through SGD and Adagrad, filters, eviction, checkpoints both
ways and incremental exports. Bad storage options are errors naming the
EV; a corrupted tier file is an error naming the EV and the file.
"""

import gc
import os
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding.ops import ev_storage

import ev_cases

DIM = 4
NUM_KEYS = 40
# One DRAM row with one optimizer slot (Adagrad): 24 bytes of key, freq
# and version, 29 of bucket, marks and spill candidate, the value and
# the slot.
ROW_BYTES = 24 + 29 + 4 * DIM * 2
# The disk tier's index while it holds at most 51 keys: 64 slots of 12
# bytes. The DRAM budget pays for it first.
INDEX_BYTES = 64 * 12


# The other process of test_processes_sharing_a_path_keep_their_own_rows:
# an EV of the same name on the same folder, its own rows (a constant),
# trained on the keys that process trained. Prints the folder's files
# while it holds its file, and its keys on disk.
_SHARING_PROCESS = """
import os, sys
import numpy as np
import tensorflow as tf
import group_embedding as ge
from group_embedding.ops import ev_storage
folder, budget = sys.argv[1], int(sys.argv[2])
ev = ge.get_embedding_variable(
    "e_shared", 4, initializer=tf.keras.initializers.Constant(7.0),
    ev_option=ge.EmbeddingVariableOption(storage_option=ge.StorageOption(
        ge.StorageType.DRAM_SSDHASH, storage_path=folder,
        storage_size=[budget])))
keys = np.arange(40, dtype=np.int64) * 7 - 50
ids = tf.RaggedTensor.from_uniform_row_length(keys, 1)
ge.group_embedding_lookup_sparse([ev], [ids], "sum")
ge.group_embedding_lookup_sparse([ev], [ids[:1]], "sum")  # spills
print(sorted(os.listdir(folder)))
print(int(ev_storage.tier_stats(ev.handle)[1]))
(rows,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum",
                                           training=False)
assert np.all(rows.numpy() == 7.0), rows
"""


def _option(storage=None, **kwargs):
    return ge.EmbeddingVariableOption(
        init_option=ge.InitializerOption(
            default_value_dim=ev_cases.DEFAULT_ROWS),
        storage_option=storage or ge.StorageOption(), **kwargs)


def _ssd(path, rows=4, strategy=None, kind=None):
    if kind == ge.StorageType.SSDHASH:
        return ge.StorageOption(ge.StorageType.SSDHASH,
                                storage_path=str(path))
    return ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                            storage_path=str(path),
                            storage_size=[INDEX_BYTES + rows * ROW_BYTES],
                            cache_strategy=strategy)


def _batches(seed, steps, batch=8, num_keys=NUM_KEYS):
    """Ragged batches of random keys with duplicates (negative keys too)."""
    rng = np.random.default_rng(seed)
    keys = np.arange(num_keys, dtype=np.int64) * 7 - 50
    out = []
    for _ in range(steps):
        rows = [list(rng.choice(keys, size=rng.integers(0, 5)))
                for _ in range(batch)]
        out.append(tf.ragged.constant(rows, dtype=tf.int64,
                                      row_splits_dtype=tf.int64))
    return out


def _train(ev, opt, batches):
    for ids in batches:
        with tf.GradientTape() as tape:
            (emb,) = ge.group_embedding_lookup_sparse([ev], [ids], "sum")
            loss = tf.reduce_sum(tf.square(emb - 0.5))
        opt.apply_gradients([(tape.gradient(loss, ev), ev)])


def _snapshot(ev):
    """Every output of the EV's export, rows sorted by key, as numpy."""
    return _sorted_export([x.numpy() for x in ev.storage.export(
        ev.handle, ev.embedding_dim)])


def _sorted_export(arrays):
    """An export's numpy arrays by name, rows sorted by key."""
    keys, values, freqs, versions, names, inits, slots, step = arrays
    order = np.argsort(keys)
    return {"keys": keys[order], "values": values[order],
            "freqs": freqs[order], "versions": versions[order],
            "slot_names": names, "slot_inits": inits,
            "slots": slots[order], "step": step}


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        # Bitwise: compare the bytes, not the float values.
        np.testing.assert_array_equal(
            np.asarray(got[name]).view(np.uint8)
            if np.asarray(got[name]).dtype == np.float32
            else got[name],
            np.asarray(want[name]).view(np.uint8)
            if np.asarray(want[name]).dtype == np.float32
            else want[name], err_msg=name)


def _pair(tmp_path, name, storage_kwargs=None, **option_kwargs):
    """(all-DRAM EV, tiered EV) with the same default matrix."""
    dram = ev_cases.make_ev(f"{name}_dram", DIM,
                            ev_option=_option(**option_kwargs))
    ssd = ev_cases.make_ev(
        f"{name}_ssd", DIM,
        ev_option=_option(_ssd(tmp_path / name, **(storage_kwargs or {})),
                          **option_kwargs))
    return dram, ssd


OPTIMIZERS = {"sgd": lambda: ge.optimizers.SGD(0.1),
              "adagrad": lambda: ge.optimizers.Adagrad(0.1),
              "adam": lambda: ge.optimizers.Adam(0.05),
              "ftrl": lambda: ge.optimizers.Ftrl(
                  0.2, l1_regularization_strength=0.01,
                  l2_regularization_strength=0.02, beta=0.1)}
STRATEGIES = {"lfu": ge.CacheStrategy.LFU, "lru": ge.CacheStrategy.LRU}


class TestTieredTraining:

    @pytest.mark.parametrize("strategy", sorted(STRATEGIES))
    @pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
    def test_matches_dram_bitwise(self, tmp_path, optimizer, strategy):
        dram, ssd = _pair(tmp_path, f"t_{optimizer}_{strategy}",
                          {"strategy": STRATEGIES[strategy]})
        batches = _batches(1, 12)
        _train(dram, OPTIMIZERS[optimizer](), batches)
        _train(ssd, OPTIMIZERS[optimizer](), batches)
        want = _snapshot(dram)
        assert int(ssd.size()) == int(dram.size()) == len(want["keys"])
        # Most keys are on disk: the DRAM tier holds the rows its budget
        # pays for (4 with one slot) and the last op's keys.
        in_dram, on_disk, promoted, spilled, index = (
            int(x) for x in ev_storage.tier_stats(ssd.handle)[:5])
        assert in_dram + on_disk == len(want["keys"])
        slots = len(want["slot_names"])
        keep = 4 * ROW_BYTES // (24 + 29 + 4 * DIM * (1 + slots))
        last = len(np.unique(batches[-1].values.numpy()))
        assert keep <= in_dram <= keep + last
        assert promoted > 0 and spilled > 0 and index == INDEX_BYTES
        _assert_same(_snapshot(ssd), want)
        # Lookups outside training read the same rows (promoting them).
        ids = batches[0]
        (a,) = ge.group_embedding_lookup_sparse([dram], [ids], "sum",
                                                training=False)
        (b,) = ge.group_embedding_lookup_sparse([ssd], [ids], "sum",
                                                training=False)
        np.testing.assert_array_equal(a.numpy(), b.numpy())
        keys = tf.constant(want["keys"][::-1])
        np.testing.assert_array_equal(
            ssd.lookup_rows(keys, training=False).numpy(),
            dram.lookup_rows(keys, training=False).numpy())
        _assert_same(_snapshot(ssd), want)

    def test_ssdhash_matches_dram_bitwise(self, tmp_path):
        dram, ssd = _pair(tmp_path, "t_ssdhash",
                          {"kind": ge.StorageType.SSDHASH})
        batches = _batches(2, 8)
        _train(dram, ge.optimizers.Adagrad(0.1), batches)
        _train(ssd, ge.optimizers.Adagrad(0.1), batches)
        _assert_same(_snapshot(ssd), _snapshot(dram))
        assert int(ssd.size()) == int(dram.size())
        # Between ops only the last op's keys are in DRAM.
        in_dram = int(ev_storage.tier_stats(ssd.handle)[0])
        assert in_dram <= len(np.unique(batches[-1].values.numpy()))

    def test_counter_filter_over_cold_keys(self, tmp_path):
        dram, ssd = _pair(tmp_path, "t_filter",
                          filter_option=ge.CounterFilter(filter_freq=3))
        batches = _batches(3, 12)
        _train(dram, ge.optimizers.Adagrad(0.1), batches)
        _train(ssd, ge.optimizers.Adagrad(0.1), batches)
        _assert_same(_snapshot(ssd), _snapshot(dram))

    @pytest.mark.parametrize("evict", ["global_step", "l2"])
    def test_eviction_over_both_tiers(self, tmp_path, evict):
        policy = (ge.GlobalStepEvict(steps_to_live=3)
                  if evict == "global_step"
                  else ge.L2WeightEvict(l2_weight_threshold=0.3))
        dram, ssd = _pair(tmp_path, f"t_evict_{evict}", evict_option=policy)
        # Early batches use keys the late ones never see again.
        batches = _batches(4, 6) + _batches(5, 6, num_keys=8)
        _train(dram, ge.optimizers.SGD(0.1), batches)
        _train(ssd, ge.optimizers.SGD(0.1), batches)
        n = int(dram.evict())
        assert n > 0
        assert int(ssd.evict()) == n
        _assert_same(_snapshot(ssd), _snapshot(dram))
        assert int(ssd.size()) == int(dram.size())


    def test_large_batch_promotion_matches_dram(self, tmp_path):
        """One batch of 20000 keys on disk (promotion batches of 2048
        records, read in file order, each while the one before is
        inserted), each key twice, between keys in DRAM and new keys."""
        dram, ssd = _pair(tmp_path, "t_big")
        rng = np.random.default_rng(11)
        old = rng.choice(2**40, size=20000, replace=False) - 2**39
        opt_a, opt_b = ge.optimizers.Adagrad(0.1), ge.optimizers.Adagrad(0.1)
        first = tf.RaggedTensor.from_uniform_row_length(
            tf.constant(old), 10)
        # A step on another key spills the first batch's rows (an update
        # right after its lookup does not).
        other = tf.ragged.constant([[2**41]], tf.int64)
        _train(dram, opt_a, [first])
        _train(ssd, opt_b, [first])
        held = float(ssd.bytes_per_key()) * int(ssd.size())
        _train(dram, opt_a, [other])
        _train(ssd, opt_b, [other])
        in_dram, on_disk = (int(x) for x in
                            ev_storage.tier_stats(ssd.handle)[:2])
        assert on_disk >= 20000 - 4 and in_dram <= 4 + 1
        # The spilled rows' memory went back (PackRows), not only to the
        # free list: the 20000 rows' bytes (key, counters, value, slot) are
        # gone.
        rows_bytes = 20000 * (24 + 4 * DIM * 2)
        assert float(ssd.bytes_per_key()) * int(ssd.size()) < held - (
            rows_bytes // 2)
        keys = np.concatenate([old, old[::-1], [2**41],
                               2**40 + np.arange(300, dtype=np.int64)])
        rng.shuffle(keys)
        second = tf.RaggedTensor.from_row_splits(
            tf.constant(keys), np.r_[np.arange(0, len(keys), 8), len(keys)])
        before = int(ev_storage.tier_stats(ssd.handle)[2])
        _train(dram, opt_a, [second])
        _train(ssd, opt_b, [second])
        promoted = int(ev_storage.tier_stats(ssd.handle)[2]) - before
        # Every key on disk came back once, duplicates or not (and the
        # few the lookup's spill moved out just before).
        assert on_disk <= promoted <= on_disk + in_dram
        _assert_same(_snapshot(ssd), _snapshot(dram))

    def test_update_of_keys_on_disk_matches_dram(self, tmp_path):
        """An optimizer update of keys that no lookup brought back (they
        are on disk when the update runs) promotes and updates them."""
        dram, ssd = _pair(tmp_path, "t_update")
        batches = _batches(12, 6)
        opt_a, opt_b = ge.optimizers.Adagrad(0.1), ge.optimizers.Adagrad(0.1)
        # The last step (one key) spills the others' rows.
        batches.append(tf.ragged.constant([[-50]], tf.int64))
        _train(dram, opt_a, batches)
        _train(ssd, opt_b, batches)
        keys = _snapshot(dram)["keys"]
        on_disk = int(ev_storage.tier_stats(ssd.handle)[1])
        assert on_disk > len(keys) // 2
        # Keys on disk and in DRAM, repeated, and one never stored.
        picked = np.concatenate([keys, keys[:5], [10**12]])
        grad_rows = np.random.default_rng(13).standard_normal(
            (len(picked), DIM)).astype(np.float32)
        for ev, opt in ((dram, opt_a), (ssd, opt_b)):
            grad = tf.IndexedSlices(tf.constant(grad_rows),
                                    tf.constant(picked))
            opt.apply_gradients([(grad, ev)])
        assert int(ev_storage.tier_stats(ssd.handle)[2]) > 0
        _assert_same(_snapshot(ssd), _snapshot(dram))
        assert int(ssd.size()) == int(dram.size()) == len(keys)


    @pytest.mark.parametrize("strategy,step_gap", [
        ("lfu", 0), ("lru", 0),
        # Versions more than 2**32 apart: the spill's wide candidates.
        ("lfu", 2**33), ("lru", 2**33)])
    def test_spill_keeps_the_hottest_rows(self, tmp_path, strategy,
                                          step_gap):
        """A spill moves the coldest DRAM rows out (LFU: least freq; LRU:
        oldest last step seen; ties: the least key first): what stays
        reads without a promotion, the next one out is promoted."""
        ev = ev_cases.make_ev(
            f"spill_{strategy}_{step_gap}", DIM, ev_option=_option(_ssd(
                tmp_path / "spill", rows=12,
                strategy=STRATEGIES[strategy])))
        opt = ge.optimizers.Adagrad(0.1)

        def one_row(keys):
            return tf.RaggedTensor.from_uniform_row_length(
                tf.constant(np.asarray(keys, np.int64)), len(keys))

        cold, hot, new = (np.arange(200, 205), np.arange(5),
                          np.arange(100, 130))
        # Nothing spills before the last step: 10 rows fit, and the new
        # keys' own lookup and update do not spill (ev_storage.h).
        _train(ev, opt, [one_row(cold)])
        opt.iterations.assign_add(step_gap)
        _train(ev, opt, [one_row(hot)] * 3)
        _train(ev, opt, [one_row(new)])
        assert int(ev_storage.tier_stats(ev.handle)[3]) == 0  # spills
        # The model: a lookup stamps the step of the last update before
        # it, so cold keys read 0, hot ones at most 2 + gap, new 3 + gap.
        freq = {**{k: 1 for k in cold}, **{k: 3 for k in hot},
                **{k: 1 for k in new}}
        last = {**{k: 0 for k in cold}, **{k: 2 + step_gap for k in hot},
                **{k: 3 + step_gap for k in new}}
        score = freq if strategy == "lfu" else last
        hottest_first = sorted(score, key=lambda k: (score[k], k),
                               reverse=True)
        _train(ev, opt, [one_row([10**6])])  # spills before its insert
        kept = int(ev_storage.tier_stats(ev.handle)[0]) - 1
        assert 0 < kept < len(hottest_first)

        def promotions_reading(keys):
            before = int(ev_storage.tier_stats(ev.handle)[2])
            ev.lookup_rows(tf.constant(keys, tf.int64), training=False)
            return int(ev_storage.tier_stats(ev.handle)[2]) - before

        assert promotions_reading(hottest_first[:kept]) == 0
        assert promotions_reading(hottest_first[kept:kept + 1]) == 1

class TestTieredCheckpoints:

    def test_round_trip_both_ways(self, tmp_path):
        dram, ssd = _pair(tmp_path, "c_rt")
        batches = _batches(6, 10)
        _train(ssd, ge.optimizers.Adagrad(0.1), batches)
        want = _snapshot(ssd)
        path = tf.train.Checkpoint(ev=ssd).write(str(tmp_path / "ckpt_a"))
        tf.train.Checkpoint(ev=dram).read(path).assert_consumed()
        _assert_same(_snapshot(dram), want)
        # And back: a fresh tiered EV restores the DRAM EV's checkpoint.
        path = tf.train.Checkpoint(ev=dram).write(str(tmp_path / "ckpt_b"))
        back = ev_cases.make_ev(
            "c_rt_back", DIM, ev_option=_option(_ssd(tmp_path / "back")))
        tf.train.Checkpoint(ev=back).read(path).assert_consumed()
        _assert_same(_snapshot(back), want)
        assert int(back.size()) == len(want["keys"])
        # The restored tiered EV keeps training like the DRAM one.
        more = _batches(7, 6)
        opt_a, opt_b = ge.optimizers.Adagrad(0.1), ge.optimizers.Adagrad(0.1)
        _train(dram, opt_a, more)
        _train(back, opt_b, more)
        _assert_same(_snapshot(back), _snapshot(dram))

    def test_incremental_export_matches_dram(self, tmp_path):
        dram, ssd = _pair(tmp_path, "c_inc")
        opt_a, opt_b = ge.optimizers.Adagrad(0.1), ge.optimizers.Adagrad(0.1)
        _train(dram, opt_a, _batches(8, 6))
        _train(ssd, opt_b, _batches(8, 6))
        covered = []
        for ev in (dram, ssd):
            out = ev_storage.export_changes(ev.handle, DIM, 0)
            covered.append(int(out[-1]))
            ev_storage.confirm_save(ev.handle, out[-1])
        more = _batches(9, 3, num_keys=NUM_KEYS // 2)
        _train(dram, opt_a, more)
        _train(ssd, opt_b, more)
        deltas = []
        for ev, since in zip((dram, ssd), covered):
            keys, values, freqs, versions, _, _, slots, _, removed, _ = (
                x.numpy() for x in ev_storage.export_changes(
                    ev.handle, DIM, since))
            order = np.argsort(keys)
            deltas.append({"keys": keys[order], "values": values[order],
                           "freqs": freqs[order],
                           "versions": versions[order],
                           "slots": slots[order], "removed": removed})
        assert 0 < len(deltas[0]["keys"]) < int(dram.size())
        _assert_same(deltas[1], deltas[0])


def _dense_batches(seed, steps):
    rng = np.random.default_rng(seed)
    return [rng.integers(-20, 20, size=(8, 3)) for _ in range(steps)]


def _graph_run(storage, name, batches, restore_from=None, save_to=None):
    """Trains a fresh EV in a TF1 graph (ge.train Adagrad, a Saver) and
    returns its snapshot; restores `restore_from` first, saves to
    `save_to` last."""
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        ev = ev_cases.make_ev(name, DIM, ev_option=_option(storage))
        ids = v1.placeholder(tf.int64, [None, 3])
        (emb,) = ge.group_embedding_lookup([ev], [ids])
        loss = tf.reduce_sum(tf.square(emb - 0.5))
        step = v1.train.create_global_step()
        train = ge.train.AdagradOptimizer(0.1).minimize(loss,
                                                        global_step=step)
        export = ev_storage.export(ev.handle, DIM)
        saver = v1.train.Saver()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            if restore_from:
                saver.restore(sess, restore_from)
            for batch in batches:
                sess.run(train, {ids: batch})
            if save_to:
                saver.save(sess, save_to)
            keys, values, freqs, versions, names, inits, slots, st = (
                sess.run(export))
    order = np.argsort(keys)
    return {"keys": keys[order], "values": values[order],
            "freqs": freqs[order], "versions": versions[order],
            "slot_names": names, "slot_inits": inits,
            "slots": slots[order], "step": st}


def test_graph_mode_saver_round_trip(tmp_path):
    batches = _dense_batches(12, 8)
    dram = _graph_run(None, "g_ev", batches)
    ssd = _graph_run(_ssd(tmp_path / "g1"), "g_ev", batches,
                     save_to=str(tmp_path / "ckpt" / "model"))
    _assert_same(ssd, dram)
    # The tiered EV's checkpoint restores into a DRAM EV and into a
    # fresh tiered one, and training goes on alike in both.
    more = _dense_batches(13, 4)
    a = _graph_run(None, "g_ev", more,
                   restore_from=str(tmp_path / "ckpt" / "model"))
    b = _graph_run(_ssd(tmp_path / "g2"), "g_ev", more,
                   restore_from=str(tmp_path / "ckpt" / "model"))
    _assert_same(b, a)


class TestTieredWeightedAndMaxNorm:

    def test_weighted_max_norm_matches_dram_bitwise(self, tmp_path):
        # The weighted and max_norm lookups read and clip rows through
        # their own kernels (weight gradients, clip gradients): each must
        # see the disk tier's keys as DRAM rows.
        dram, ssd = _pair(tmp_path, "t_weighted")
        for ev in (dram, ssd):
            opt = ge.optimizers.Adagrad(0.1)
            for ids in _batches(3, 10):
                n = int(ids.values.shape[0])
                weights = tf.RaggedTensor.from_row_splits(tf.constant(
                    np.random.default_rng(n).uniform(0.5, 2.0, n),
                    tf.float32), ids.row_splits)
                with tf.GradientTape() as tape:
                    (emb,) = ge.group_embedding_lookup_sparse(
                        [ev], [ids], "sqrtn", sp_weights=[weights],
                        max_norm=0.3)
                    loss = tf.reduce_sum(tf.square(emb - 0.5))
                opt.apply_gradients([(tape.gradient(loss, ev), ev)])
        want = _snapshot(dram)
        assert int(ev_storage.tier_stats(ssd.handle)[1]) > 0
        _assert_same(_snapshot(ssd), want)


class TestTieredErrors:

    def test_shared_path_fails(self, tmp_path):
        first = ev_cases.make_ev(
            "e_first", DIM, ev_option=_option(_ssd(tmp_path / "one")))
        with pytest.raises(ValueError, match="e_second.*already used by "
                           "EmbeddingVariable 'e_first'"):
            ev_cases.make_ev(
                "e_second", DIM, ev_option=_option(_ssd(tmp_path / "one")))
        del first

    def test_shared_path_fails_when_a_graph_is_built(self, tmp_path):
        # In a graph the kernels' own claim only runs with the graph: the
        # second EV is refused when it is built, before any session.
        with tf.Graph().as_default():
            ge.get_embedding_variable(
                "g_first", DIM, ev_option=_option(_ssd(tmp_path / "g")))
            with pytest.raises(ValueError, match="g_second.*already used "
                               "by EmbeddingVariable 'g_first'"):
                ge.get_embedding_variable(
                    "g_second", DIM,
                    ev_option=_option(_ssd(tmp_path / "g" / ".")))
        # Another graph may use the folder (each graph's EVs are built
        # anew there).
        with tf.Graph().as_default():
            ge.get_embedding_variable(
                "g_second", DIM, ev_option=_option(_ssd(tmp_path / "g")))

    def test_path_free_again_after_the_ev_is_gone(self, tmp_path):
        ev = ev_cases.make_ev(
            "e_gone", DIM, ev_option=_option(_ssd(tmp_path / "gone")))
        _train(ev, ge.optimizers.SGD(0.1), _batches(0, 2))
        assert (tmp_path / "gone" / "e_gone.tier").exists()
        del ev
        gc.collect()
        # The file (a cache of that EV only) is deleted, the folder free.
        assert not (tmp_path / "gone" / "e_gone.tier").exists()
        ev_cases.make_ev(
            "e_gone_2", DIM, ev_option=_option(_ssd(tmp_path / "gone")))

    def test_processes_sharing_a_path_keep_their_own_rows(self, tmp_path):
        # Two processes (workers of one host, or two jobs) with the same
        # folder and EV name: each takes its own tier file. With one file
        # for both, the second truncated the first's records and wrote
        # its own at their offsets (the same keys, valid checksums): the
        # first then read the second's rows, with no error.
        folder = tmp_path / "shared"
        ev = ev_cases.make_ev("e_shared", DIM, seed=1,
                              ev_option=_option(_ssd(folder)))
        batches = _batches(30, 3, batch=20)
        _train(ev, ge.optimizers.SGD(0.1), batches)
        assert int(ev_storage.tier_stats(ev.handle)[1]) >= 10
        want = _snapshot(ev)
        child = subprocess.run(
            [sys.executable, "-c", _SHARING_PROCESS, str(folder),
             str(INDEX_BYTES + 4 * ROW_BYTES)],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert child.returncode == 0, child.stderr[-3000:]
        # Every row, slot, freq and version of this process's EV is its
        # own: the export and a lookup read through its file.
        _assert_same(_snapshot(ev), want)
        keys = want["keys"]
        (got,) = ge.group_embedding_lookup_sparse(
            [ev], [tf.RaggedTensor.from_uniform_row_length(keys, 1)], "sum",
            training=False)
        np.testing.assert_array_equal(got.numpy(), want["values"])
        # The child trained the same keys, with rows of its own, into
        # e_shared.1.tier (deleted when it ended), mostly on disk.
        lines = child.stdout.splitlines()
        assert lines[0] == "['e_shared.1.tier', 'e_shared.tier']", lines
        assert int(lines[1]) >= 10, lines
        assert sorted(os.listdir(folder)) == ["e_shared.tier"]

    def test_a_file_no_process_holds_is_reused(self, tmp_path):
        # A file left by a process that is gone (a crash: no EV deleted
        # it) is not locked: the next EV of that name truncates it.
        (tmp_path / "e_stale").mkdir()
        stale = tmp_path / "e_stale" / "e_stale_ssd.tier"
        stale.write_bytes(b"left by a crashed process" * 100)
        dram, ssd = _pair(tmp_path, "e_stale")
        batches = _batches(31, 6)
        _train(dram, ge.optimizers.Adagrad(0.1), batches)
        _train(ssd, ge.optimizers.Adagrad(0.1), batches)
        assert os.listdir(tmp_path / "e_stale") == ["e_stale_ssd.tier"]
        assert int(ev_storage.tier_stats(ssd.handle)[1]) > 0
        _assert_same(_snapshot(ssd), _snapshot(dram))

    def test_a_long_name_gets_a_short_file_name(self, tmp_path):
        # An EV name of deep scopes longer than a file name may be (255
        # bytes) was "File name too long"; the file now keeps the name's
        # first characters and a hash of the whole.
        name = "/".join(f"scope_{i:02d}_of_a_deep_model" for i in range(12))
        assert len(name) > 255
        dram = ev_cases.make_ev(name + "_dram", DIM, ev_option=_option())
        ssd = ev_cases.make_ev(name, DIM,
                               ev_option=_option(_ssd(tmp_path / "long")))
        batches = _batches(32, 6)
        _train(dram, ge.optimizers.Adagrad(0.1), batches)
        _train(ssd, ge.optimizers.Adagrad(0.1), batches)
        (file,) = os.listdir(tmp_path / "long")
        assert len(file) < 255 and file.startswith("scope_00_of_a_deep")
        assert int(ev_storage.tier_stats(ssd.handle)[1]) > 0
        _assert_same(_snapshot(ssd), _snapshot(dram))

    def test_unwritable_path_fails(self, tmp_path):
        blocker = tmp_path / "a_file"
        blocker.write_text("not a folder")
        with pytest.raises(ValueError, match="e_unwritable.*cannot create"):
            ev_cases.make_ev("e_unwritable", DIM, ev_option=_option(
                _ssd(blocker / "tier")))

    def test_storage_size_too_small_fails(self, tmp_path):
        with pytest.raises(ValueError, match="e_small.*storage_size"):
            ev_cases.make_ev("e_small", DIM, ev_option=_option(
                ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                                 storage_path=str(tmp_path / "s"),
                                 storage_size=[10])))

    def test_storage_size_too_small_for_slots_fails(self, tmp_path):
        # One row fits, not one row with Adagrad's accumulator.
        ev = ev_cases.make_ev("e_slots", DIM, ev_option=_option(
            ge.StorageOption(ge.StorageType.DRAM_SSDHASH,
                             storage_path=str(tmp_path / "s"),
                             storage_size=[ROW_BYTES - 4 * DIM])))
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="e_slots.*storage_size"):
            _train(ev, ge.optimizers.Adagrad(0.1), _batches(0, 1))

    @pytest.mark.parametrize("bad", [
        dict(storage_type=ge.StorageType.DRAM_SSDHASH),
        dict(storage_type=ge.StorageType.DRAM_SSDHASH, storage_path="x",
             storage_size=[0]),
        dict(storage_type=ge.StorageType.DRAM_SSDHASH, storage_path="x",
             cache_strategy="fifo"),
    ])
    def test_bad_option_fails(self, bad):
        with pytest.raises(ValueError):
            ge.StorageOption(**bad)

    def test_option_round_trip(self, tmp_path):
        opt = _ssd(tmp_path, strategy=ge.CacheStrategy.LRU)
        again = ge.StorageOption.from_config(opt.get_config())
        assert again == opt

    def test_corrupted_tier_file_fails(self, tmp_path):
        ev = ev_cases.make_ev("e_corrupt", DIM,
                              ev_option=_option(_ssd(tmp_path / "c")))
        batches = _batches(10, 6)
        _train(ev, ge.optimizers.SGD(0.1), batches)
        tier = tmp_path / "c" / "e_corrupt.tier"
        data = bytearray(tier.read_bytes())
        for i in range(40, len(data), 7):  # past the header, in records
            data[i] ^= 0x5A
        tier.write_bytes(bytes(data))
        with pytest.raises(tf.errors.InternalError,
                           match="e_corrupt.*checksum.*e_corrupt.tier"):
            _train(ev, ge.optimizers.SGD(0.1), batches)

    def test_full_disk_loses_nothing(self, tmp_path):
        dram, ssd = _pair(tmp_path, "e_full")
        batches = _batches(11, 12)
        opt_a, opt_b = ge.optimizers.SGD(0.1), ge.optimizers.SGD(0.1)
        _train(dram, opt_a, batches[:4])
        _train(ssd, opt_b, batches[:4])
        tier = tmp_path / "e_full" / "e_full_ssd.tier"
        # The file size limit stands in for a full disk (EFBIG, not a
        # signal, once SIGXFSZ is ignored).
        old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (os.path.getsize(tier), old_limit[1]))
        try:
            with pytest.raises(tf.errors.InternalError,
                               match="e_full_ssd.*cannot write"):
                _train(ssd, opt_b, batches[4:])
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        # Nothing stored was lost: the failed step changed nothing.
        _assert_same(_snapshot(ssd), _snapshot(dram))


def _import_rows(ev, keys, values):
    n = len(keys)
    ev_storage.import_(ev.handle, tf.constant(keys, tf.int64),
                       tf.constant(values, tf.float32),
                       np.ones(n, np.int64), np.zeros(n, np.int64),
                       tf.constant([], tf.string), tf.zeros([0]),
                       tf.zeros([n, 0]), 0)


def _exported(ev):
    keys, values = (x.numpy() for x in ev.export()[:2])
    order = np.argsort(keys)
    return keys[order], values[order]


# A spill is written in chunks of 4 MiB (ev_storage.h SpillToBudget), each
# chunk's write overlapping the indexing of the one before. The import
# spills as it goes (every 4096 rows), so rows of 4 KiB (dim 1024, no
# slot) make each spill four chunks; the DRAM tier holds 16 rows.
_WIDE = 1024
_MANY = 12_000


@pytest.mark.parametrize("fail", [False, True])
def test_spill_in_chunks_loses_nothing(fail, tmp_path):
    rng = np.random.default_rng(12)
    keys = rng.permutation(np.arange(_MANY, dtype=np.int64) * 3 - 1000)
    values = rng.normal(size=[_MANY, _WIDE]).astype(np.float32)
    storage = ge.StorageOption(
        ge.StorageType.DRAM_SSDHASH, storage_path=str(tmp_path / "k"),
        storage_size=[INDEX_BYTES + 16 * (24 + 29 + 4 * _WIDE)])
    ev = ev_cases.make_ev(f"e_chunks_{int(fail)}", _WIDE,
                          ev_option=_option(storage))
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if fail:
        # Room for the first chunk and half of the second.
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (int(1.5 * (4 << 20)), old_limit[1]))
    try:
        if fail:
            with pytest.raises(tf.errors.InternalError,
                               match="e_chunks_1.*cannot write"):
                _import_rows(ev, keys, values)
        else:
            _import_rows(ev, keys, values)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    stats = ev_storage.tier_stats(ev.handle).numpy()
    got_keys, got_values = _exported(ev)
    assert len(got_keys) == stats[0] + stats[1]
    if fail:
        # The import stops at the failed spill: it stored a prefix of its
        # keys, the first chunk of the spill on disk, the failed chunks'
        # rows still in DRAM. A lost chunk would be a hole in the prefix.
        assert 0 < stats[1] < len(got_keys) < _MANY
        keys, values = keys[:len(got_keys)], values[:len(got_keys)]
    else:
        assert stats[1] >= _MANY - 16
    order = np.argsort(keys)
    np.testing.assert_array_equal(got_keys, keys[order])
    np.testing.assert_array_equal(got_values, values[order])
    pick = rng.choice(len(keys), 100)
    np.testing.assert_array_equal(
        ev.lookup_rows(tf.constant(keys[pick]), training=False).numpy(),
        values[pick])


def test_promotion_in_batches_stops_at_a_bad_record(tmp_path):
    """A promotion of 6000 records reads them in batches of 2048 (in file
    order; each batch read while the one before is inserted). A corrupted
    record in the third batch fails the lookup naming the EV and the
    file, after the first two batches came back whole; the bad batch
    stays on disk, and once the byte is repaired every row reads as
    imported: nothing was lost."""
    n = 6000
    rng = np.random.default_rng(5)
    keys = rng.permutation(np.arange(n, dtype=np.int64) * 7 + 3)
    values = rng.normal(size=[n, DIM]).astype(np.float32)
    storage = ge.StorageOption(
        ge.StorageType.DRAM_SSDHASH, storage_path=str(tmp_path / "b"),
        storage_size=[INDEX_BYTES + 16 * (24 + 29 + 4 * DIM)])
    ev = ev_cases.make_ev("e_batches", DIM, ev_option=_option(storage))
    _import_rows(ev, keys, values)
    promotions, on_disk = (int(ev_storage.tier_stats(ev.handle)[i])
                           for i in (2, 1))
    assert on_disk >= n - 16
    # Record 5000 (header 16 bytes; key, freq, version, value, crc).
    record = 24 + 4 * DIM + 4
    tier = tmp_path / "b" / "e_batches.tier"
    at = 16 + 5000 * record + 24
    data = bytearray(tier.read_bytes())
    data[at] ^= 0x5A
    tier.write_bytes(bytes(data))
    with pytest.raises(tf.errors.InternalError,
                       match="e_batches.*checksum.*e_batches.tier"):
        ev.lookup_rows(tf.constant(keys), training=False)
    stats = ev_storage.tier_stats(ev.handle).numpy()
    assert stats[2] - promotions == 4096
    assert stats[0] >= 4096 and stats[0] + stats[1] == n
    data[at] ^= 0x5A
    tier.write_bytes(bytes(data))
    got_keys, got_values = _exported(ev)
    order = np.argsort(keys)
    np.testing.assert_array_equal(got_keys, keys[order])
    np.testing.assert_array_equal(got_values, values[order])
    np.testing.assert_array_equal(
        ev.lookup_rows(tf.constant(keys), training=False).numpy(), values)
