"""Random programs in TF1 graphs: a DRAM_SSDHASH EV (4 DRAM rows of 60
keys, keys moving to and from the file at every step) against an
all-DRAM EV, each in its own graph and session, trained by every
`ge.train` optimizer through `minimize` with a dense weight, with a
`tf.compat.v1.train.Saver` saving and rewinding to older checkpoints
between steps. After every op, the losses and every key's row, slots,
freq and version must be equal BIT FOR BIT (as
test_ev_tier_random_programs.py does for TF2 code).
"""

import os

import numpy as np
import pytest
import tensorflow as tf
from test_ev_ssd_storage import _assert_same
from test_ev_ssd_storage import _option
from test_ev_ssd_storage import _sorted_export
from test_ev_ssd_storage import _ssd

import group_embedding as ge
from group_embedding.ops import ev_storage

v1 = tf.compat.v1
OPTIMIZERS = {
    "sgd": lambda step: ge.train.GradientDescentOptimizer(0.2),
    "adagrad": lambda step: ge.train.AdagradOptimizer(0.1),
    "adagrad_decay": lambda step: ge.train.AdagradDecayOptimizer(
        0.1, global_step=step),
    "adam": lambda step: ge.train.AdamOptimizer(0.05),
    "adam_async": lambda step: ge.train.AdamAsyncOptimizer(0.05),
    "ftrl": lambda step: ge.train.FtrlOptimizer(0.2),
}
KEYS = np.arange(60, dtype=np.int64) * 7919 - 200000
BATCH = 6


class _Graph:
    """One side: its graph, session, EV, feed and ops."""

    def __init__(self, storage, options, optimizer):
        self.graph = tf.Graph()
        with self.graph.as_default():
            step = v1.train.get_or_create_global_step()
            self.ev = ge.get_embedding_variable(
                "ev", 4,
                initializer=tf.keras.initializers.RandomUniform(-1, 1, seed=3),
                ev_option=_option(storage, **options))
            self.ids = v1.sparse_placeholder(tf.int64, name="ids")
            w = v1.get_variable("w", [4, 1], use_resource=True,
                                initializer=tf.constant_initializer(0.5))
            emb = ge.embedding_lookup_sparse(self.ev, self.ids, None,
                                             combiner="mean")
            self.loss = tf.reduce_sum(tf.square(tf.matmul(emb, w) - 1.0))
            self.train = OPTIMIZERS[optimizer](step).minimize(
                self.loss, global_step=step)
            self.saver = v1.train.Saver(max_to_keep=None)
            self.sess = v1.Session(graph=self.graph)
            self.sess.run(v1.global_variables_initializer())

    def snapshot(self):
        with self.graph.as_default():
            return _sorted_export(self.sess.run(list(
                self.ev.storage.export(self.ev.handle, 4))))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_tf1_program_matches_dram_bitwise(tmp_path, optimizer, seed):
    rng = np.random.default_rng(seed)
    options = {
        "filter_option": [None, ge.CounterFilter(2)][rng.integers(2)],
        "evict_option": [None, ge.GlobalStepEvict(steps_to_live=4)][
            rng.integers(2)]}
    sides = [_Graph(None, options, optimizer),
             _Graph(_ssd(tmp_path / "tier"), options, optimizer)]
    program = ["train"] * 24 + ["save", "rewind"] * 3
    rng.shuffle(program)
    program.insert(0, "save")
    saved = []
    for step, op in enumerate(program):
        context = f"seed {seed}, {optimizer}, step {step} ({op})"
        if op == "train":
            rows = [rng.choice(KEYS, size=rng.integers(1, 5))
                    for _ in range(BATCH)]
            feed = v1.SparseTensorValue(
                [[r, c] for r, row in enumerate(rows)
                 for c in range(len(row))],
                np.concatenate(rows), [BATCH, 4])
            losses = [s.sess.run([s.train, s.loss], {s.ids: feed})[1]
                      for s in sides]
            assert np.float32(losses[0]).tobytes() == \
                np.float32(losses[1]).tobytes(), (context, losses)
        elif op == "save":
            saved.append([])
            for i, s in enumerate(sides):
                with s.graph.as_default():
                    saved[-1].append(s.saver.save(
                        s.sess, os.path.join(tmp_path, f"s{i}_{step}", "m")))
        else:
            paths = saved[rng.integers(len(saved))]
            for s, path in zip(sides, paths):
                with s.graph.as_default():
                    s.saver.restore(s.sess, path)
        try:
            _assert_same(sides[1].snapshot(), sides[0].snapshot())
        except AssertionError as e:
            raise AssertionError(f"{context}: {e}") from None
    tier = sides[1]
    with tier.graph.as_default():
        promoted, spilled = tier.sess.run(
            ev_storage.tier_stats(tier.ev.handle))[2:4]
    assert promoted > 0 and spilled > 0  # keys did move between tiers
