"""The sharding planner and table-wise shards, in one process (no Horovod).

Oracles: the planner's rule worked by hand on small inputs, an
independent brute-force check of its balance, and stock Keras optimizers
on whole tables for the updates of table-wise shards (a zero-row shard
included).
"""

import numpy as np
import pytest
import tensorflow as tf

import group_embedding as ge
from group_embedding import model_parallel
from group_embedding.distributed import sharding_plan
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed.sharded_variable import ShardedVariable
from group_embedding.distributed.sharded_variable import resolve_partition
from group_embedding.distributed.sharded_variable import shard_rows

KIB = 1024
MIB = 1024 * KIB


class PlanPlacementsTest(tf.test.TestCase):

    def test_docstring_example(self):
        plan = ge.distributed.plan_placements(
            {"ads": 10 * MIB, "users": 400 * MIB, "site": 4 * KIB,
             "city": (50_000, 16)}, 4)
        self.assertEqual(plan, {"ads": "table:0", "users": "row",
                                "site": "replicate", "city": "table:1"})

    def test_replicate_below_bytes(self):
        sizes = {"a": 256 * KIB - 1, "b": 256 * KIB, "c": (10, 4)}
        plan = sharding_plan.plan_placements(sizes, 2,
                                             table_wise_fraction=0.0)
        self.assertEqual(plan, {"a": "replicate", "b": "row",
                                "c": "replicate"})
        # 0 replicates nothing; a larger bound replicates more.
        plan = sharding_plan.plan_placements(
            sizes, 2, replicate_below_bytes=0, table_wise_fraction=0.0)
        self.assertEqual(set(plan.values()), {"row"})
        plan = sharding_plan.plan_placements(
            sizes, 2, replicate_below_bytes=MIB)
        self.assertEqual(set(plan.values()), {"replicate"})

    def test_table_wise_limit_is_fraction_of_fair_share(self):
        # Sharded bytes S = 100 MiB over N = 2: the fair share is 50 MiB,
        # so with fraction 0.5 tables up to 25 MiB are placed whole.
        sizes = {"big": 55 * MIB, "edge": 25 * MIB, "small": 20 * MIB}
        plan = sharding_plan.plan_placements(sizes, 2)
        self.assertEqual(plan, {"big": "row", "edge": "table:0",
                                "small": "table:1"})
        # Fraction 0.4: up to 20 MiB.
        plan = sharding_plan.plan_placements(sizes, 2,
                                             table_wise_fraction=0.4)
        self.assertEqual(plan, {"big": "row", "edge": "row",
                                "small": "table:0"})
        plan = sharding_plan.plan_placements(sizes, 2,
                                             table_wise_fraction=0.0)
        self.assertEqual(set(plan.values()), {"row"})

    def test_largest_first_onto_least_loaded(self):
        # Fraction 1, N = 3, S = 24: every table is at most 8 = S / N.
        sizes = {"a": 5, "b": 4, "c": 3, "d": 3, "e": 3, "f": 3, "g": 3}
        plan = sharding_plan.plan_placements(
            sizes, 3, replicate_below_bytes=0, table_wise_fraction=1.0)
        # a->0 (5), b->1 (4), c->2 (3), d->2 (6), e->1 (7), f->0 (8),
        # g->2 (9): ties by name, then by the lowest rank.
        self.assertEqual(plan, {"a": "table:0", "b": "table:1",
                                "c": "table:2", "d": "table:2",
                                "e": "table:1", "f": "table:0",
                                "g": "table:2"})

    def test_balance_against_brute_force(self):
        # Greedy largest-first is within the largest table of the best
        # split (LPT bound), checked against every assignment.
        rng = np.random.default_rng(0)
        for trial in range(20):
            sizes = {f"t{i}": int(b) for i, b in
                     enumerate(rng.integers(1, 100, 6))}
            n = int(rng.integers(2, 4))
            plan = sharding_plan.plan_placements(
                sizes, n, replicate_below_bytes=0, table_wise_fraction=1.0)
            loads = np.zeros(n, np.int64)
            for name, p in plan.items():
                if p != "row":
                    loads[sharding_plan.table_owner(p)] += sizes[name]
            placed = [sizes[k] for k, p in plan.items() if p != "row"]
            best = min(
                max(np.bincount(a, weights=placed, minlength=n))
                for a in np.ndindex(*([n] * len(placed))))
            self.assertLessEqual(loads.max(), best + max(placed, default=0))

    def test_deterministic_and_order_independent(self):
        sizes = {f"t{i}": (1000 * (i % 4 + 1), 16) for i in range(9)}
        plan = sharding_plan.plan_placements(sizes, 3,
                                             replicate_below_bytes=0)
        reverse = dict(reversed(list(sizes.items())))
        self.assertEqual(sharding_plan.plan_placements(
            reverse, 3, replicate_below_bytes=0), plan)
        self.assertEqual(list(plan), list(sizes))  # the input's order

    def test_single_worker_keeps_tables_whole(self):
        plan = sharding_plan.plan_placements({"a": 10 * MIB, "b": KIB}, 1)
        self.assertEqual(plan, {"a": "table:0", "b": "replicate"})

    def test_dtype_counts_in_bytes(self):
        plan = sharding_plan.plan_placements(
            {"f64": (100, 8, tf.float64), "f32": (100, 8)}, 2,
            replicate_below_bytes=5000)
        self.assertEqual(plan["f64"], "row")  # 6400 bytes
        self.assertEqual(plan["f32"], "replicate")  # 3200 bytes

    def test_bad_arguments_fail(self):
        with self.assertRaisesRegex(ValueError, r"`num_workers` must be "
                                                r">= 1, got 0"):
            sharding_plan.plan_placements({"a": 1}, 0)
        with self.assertRaisesRegex(ValueError, r"`table_wise_fraction` "
                                                r"must be in \[0, 1\], got 2"):
            sharding_plan.plan_placements({"a": 1}, 2,
                                          table_wise_fraction=2)
        with self.assertRaisesRegex(ValueError, r"`replicate_below_bytes` "
                                                r"must be >= 0, got -1"):
            sharding_plan.plan_placements({"a": 1}, 2,
                                          replicate_below_bytes=-1)
        with self.assertRaisesRegex(ValueError, r"Table 'a': a size must "
                                                r"be bytes or"):
            sharding_plan.plan_placements({"a": "big"}, 2)


class PlacementArgumentTest(tf.test.TestCase):

    def test_bad_placement_fails(self):
        cases = [
            ({"placement": "rows"}, ValueError,
             r"Invalid `placement` for table 't': 'rows', use one of "
             r"replicate, row, table"),
            ({"placement": 1}, TypeError,
             r"Table 't': `placement` must be a string"),
            # One worker outside collective mode: rank 1 does not exist.
            ({"placement": "table:1"}, ValueError,
             r"Table 't': `placement` 'table:1' names rank 1, but there "
             r"are 1 workers"),
            ({"replicate": True, "placement": "table"}, ValueError,
             r"Table 't': `replicate=True` contradicts "),
        ]
        for kwargs, error, message in cases:
            with self.assertRaisesRegex(error, message):
                ge.get_embedding_table("t", 10, 4, **kwargs)

    def test_single_worker_tables_are_whole_variables(self):
        for placement in (None, "replicate", "row", "table", "table:0"):
            table = ge.get_embedding_table("t", 10, 4, placement=placement)
            self.assertNotIsInstance(table, ge.ShardedVariable)
            self.assertEqual(table.shape, (10, 4))

    def test_resolve_precedence(self):
        # The plan and the size rule, without Horovod: fake a 3-worker
        # world and a plan, as enable_distributed_strategy would set.
        settings = distributed_strategy.placement_settings(
            3, 500, {"planned": (50, 4), "big": (1000, 4), "small": (5, 4)},
            1.0)
        saved = dict(distributed_strategy._state)
        world = model_parallel.world
        distributed_strategy._state["placement"] = settings
        model_parallel.world = lambda: (0, 3)
        distributed_strategy.table_wise_loads(3)[:] = [0, 0, 0]
        try:
            self.assertEqual(settings["plan"]["planned"], ("table:0", 800))
            self.assertEqual(resolve_partition("planned", 50, 4),
                             "table:0")
            self.assertIsNone(resolve_partition("small", 5, 4))
            self.assertEqual(resolve_partition("big", 1000, 4), "mod")
            # Unplanned names: the size rule (500 bytes), row layout.
            self.assertIsNone(resolve_partition("x", 10, 4))
            self.assertEqual(resolve_partition("x", 100, 4, tf.float32,
                                               "div"), "div")
            # Forced placements win over the plan and the size rule.
            self.assertEqual(resolve_partition("planned", 50, 4,
                                               placement="row"), "mod")
            self.assertIsNone(resolve_partition("x", 100, 4,
                                                replicate=True))
            # "table": the least-loaded worker (planned: 800 bytes on 0).
            self.assertEqual(resolve_partition("y", 10, 4,
                                               placement="table"), "table:1")
            self.assertEqual(resolve_partition("z", 10, 4,
                                               placement="table"), "table:2")
            self.assertEqual(resolve_partition("w", 10, 4,
                                               placement="table"), "table:1")
            with self.assertRaisesRegex(ValueError, r"Table 'planned' was "
                                                    r"planned with 800 bytes"
                                                    r".* created with 1600"):
                resolve_partition("planned", 100, 4)
            with self.assertRaisesRegex(ValueError, r"'table:3' names rank "
                                                    r"3, but there are 3"):
                resolve_partition("x", 10, 4, placement="table:3")
        finally:
            model_parallel.world = world
            distributed_strategy._state.update(saved)

    def test_strategy_arguments_fail_before_horovod(self):
        with self.assertRaisesRegex(ValueError, r"`table_wise_fraction` "
                                                r"needs `table_sizes`"):
            ge.enable_distributed_strategy("collective",
                                           table_wise_fraction=0.5)
        with self.assertRaisesRegex(ValueError, r"`replicate_below_bytes` "
                                                r"must be >= 0"):
            ge.enable_distributed_strategy("collective",
                                           replicate_below_bytes=-5)
        self.assertFalse(distributed_strategy.is_collective())


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "ftrl",
                                       "tf1-sgd", "tf1-adagrad", "tf1-adam"])
def test_table_wise_shards_train_like_the_whole_table(optimizer):
    """Every worker's shard of a table-wise table, after sparse updates,
    equals its rows of the whole table updated by the same optimizer: the
    owner all rows, the others a [0, D] shard (empty update, empty
    slots)."""
    make = {"sgd": lambda: ge.optimizers.SGD(0.1),
            "adagrad": lambda: ge.optimizers.Adagrad(0.1),
            "adam": lambda: ge.optimizers.Adam(0.01),
            "ftrl": lambda: ge.optimizers.Ftrl(0.1),
            "tf1-sgd": lambda: ge.train.GradientDescentOptimizer(0.1),
            "tf1-adagrad": lambda: ge.train.AdagradOptimizer(0.1),
            "tf1-adam": lambda: ge.train.AdamOptimizer(0.01)}[optimizer]
    rng = np.random.default_rng(1)
    vocab, dim, workers = 9, 3, 3
    value = rng.normal(size=(vocab, dim)).astype(np.float32)
    shards = [ShardedVariable("tw", vocab, dim, "table:1", workers, w,
                              value[shard_rows(vocab, "table:1", workers, w)])
              for w in range(workers)]
    assert [s.shard.shape[0] for s in shards] == [0, vocab, 0]
    assert shards[0].placement == "table" and shards[0].owner_rank == 1
    ids = tf.constant([4, 0, 4, 8], tf.int64)
    np.testing.assert_array_equal(shards[2].owner(ids), [1, 1, 1, 1])
    np.testing.assert_array_equal(shards[2].local_row(ids), ids)
    whole = tf.Variable(value)
    ref_opt = make()
    opts = [make() for _ in range(workers)]
    for step in range(3):
        grad_rows = rng.normal(size=(4, dim)).astype(np.float32)
        ref_opt.apply_gradients([(tf.IndexedSlices(
            tf.constant(grad_rows), ids, tf.constant([vocab, dim],
                                                     tf.int64)), whole)])
        for w, s in enumerate(shards):
            mine = shards[w].owner(ids).numpy() == w
            g = tf.IndexedSlices(tf.constant(grad_rows[mine]),
                                 tf.constant(ids.numpy()[mine]),
                                 tf.constant([s.shard.shape[0], dim],
                                             tf.int64))
            opts[w].apply_gradients([(g, s.shard)])
    for w, s in enumerate(shards):
        np.testing.assert_allclose(
            s.shard.numpy(), whole.numpy()[s.global_rows()], rtol=1e-6)


def test_bad_table_wise_shard_fails():
    with pytest.raises(ValueError, match=r"Table 'tw': `placement` "
                                         r"'table:2' names rank 2, but there"
                                         r" are 2 workers"):
        ShardedVariable("tw", 4, 2, "table:2", 2, 0, np.zeros((0, 2)))
    with pytest.raises(ValueError, match=r"Invalid `partition_strategy` "
                                         r"for table 'tw': 'table:x'"):
        ShardedVariable("tw", 4, 2, "table:x", 2, 0, np.zeros((0, 2)))
