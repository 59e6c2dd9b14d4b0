"""The collective routing kernels (`ops/collective_routing.py`) in one process.

N workers are simulated in one process: the alltoalls are `tf.split` +
`tf.concat` (differentiable like Horovod's), each worker's shard is a
`tf.Variable` of its rows. Oracles: a numpy reference of the router's
buffers, and stock `tf.nn.embedding_lookup_sparse` on the whole tables for
the pooled outputs and every gradient (shard rows and weights).
"""

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.distributed.sharded_variable import shard_rows
from group_embedding.ops import collective_routing
from group_embedding.ops.ragged_ids import FeatureIds

pytestmark = pytest.mark.skipif(
    collective_routing.library() is None,
    reason="collective routing kernels not built")

# Three tables of different dims and partitions, so offsets mix widths.
VOCABS = [50, 7, 1000]
DIMS = [4, 8, 2]
PARTITIONS = ["mod", "div", "mod"]
# Table-wise placement of t0 and t2 at 3 workers (worker 1 owns neither:
# zero-row shards) beside a row-sharded t1.
TABLE_WISE = ["table:2", "div", "table:0"]
COMBINERS = ["sum", "mean", "sqrtn"]
NAMES = ["t0", "t1", "t2"]


def owner_and_local(ids, vocab, partition, workers):
    """Numpy version of ShardedVariable.owner / local_row."""
    if partition.startswith("table:"):
        return np.full_like(ids, int(partition[6:])), ids
    if partition == "mod":
        return ids % workers, ids // workers
    per = -(-vocab // workers)
    return ids // per, ids - (ids // per) * per


def reference_route(ids, workers, partitions=PARTITIONS):
    """(send buffer, splits, row offsets) the router must produce."""
    buckets = {}  # (owner, table) -> local rows, first-occurrence order
    where = []    # per table: distinct id -> (owner, position)
    for t, x in enumerate(ids):
        _, first = np.unique(x, return_index=True)
        distinct = x[np.sort(first)]
        owner, local = owner_and_local(distinct, VOCABS[t], partitions[t],
                                       workers)
        pos = {}
        for d, o, r in zip(distinct, owner, local):
            bucket = buckets.setdefault((o, t), [])
            pos[d] = (o, len(bucket))
            bucket.append(r)
        where.append(pos)
    send, splits, elem_at, elems = [], [], {}, 0
    for o in range(workers):
        counts = [len(buckets.get((o, t), [])) for t in range(len(ids))]
        send += counts
        for t in range(len(ids)):
            send += buckets.get((o, t), [])
            elem_at[(o, t)] = elems
            elems += counts[t] * DIMS[t]
        splits.append(len(ids) + sum(counts))
    offsets = []
    for t, x in enumerate(ids):
        offsets.append(np.array(
            [elem_at[(where[t][v][0], t)] + where[t][v][1] * DIMS[t]
             for v in x], np.int64))
    return np.array(send, np.int64), np.array(splits, np.int32), offsets


def random_batches(workers, batch=6, seed=0):
    """Per worker, per table: (ids, row_splits, weights) with empty rows
    and duplicate ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(workers):
        feats = []
        for vocab in VOCABS:
            lengths = rng.integers(0, 4, batch)
            ids = rng.integers(0, min(vocab, 12), lengths.sum())
            weights = rng.uniform(0.5, 2.0, lengths.sum()).astype(np.float32)
            splits = np.concatenate([[0], np.cumsum(lengths)])
            feats.append((ids.astype(np.int64), splits.astype(np.int64),
                          weights))
        out.append(feats)
    return out


def alltoall(buffers, splits):
    """Simulated alltoall: worker w receives every worker's w-th piece."""
    pieces = [tf.split(b, s, num=len(buffers)) for b, s in
              zip(buffers, splits)]
    received = [tf.concat([p[w] for p in pieces], 0)
                for w in range(len(buffers))]
    received_splits = [tf.stack([tf.cast(s[w], tf.int32) for s in splits])
                       for w in range(len(buffers))]
    return received, received_splits


class CollectiveRoutingTest(tf.test.TestCase):

    def _check_route(self, workers, partitions):
        feats = random_batches(1, batch=20, seed=workers)[0]
        ids = [f[0] for f in feats]
        send, splits, offsets = collective_routing.route_ids(
            [tf.constant(x) for x in ids], VOCABS, DIMS, partitions,
            workers, NAMES)
        want_send, want_splits, want_offsets = reference_route(
            ids, workers, partitions)
        np.testing.assert_array_equal(send.numpy(), want_send)
        np.testing.assert_array_equal(splits.numpy(), want_splits)
        for got, want in zip(offsets, want_offsets):
            np.testing.assert_array_equal(got.numpy(), want)

    def test_route_matches_numpy_reference(self):
        for workers in (1, 2, 3):
            self._check_route(workers, PARTITIONS)

    def test_table_wise_route_matches_numpy_reference(self):
        for workers in (1, 2, 3):
            # Owners of t0 and t2 at the last and first rank.
            self._check_route(workers, [f"table:{workers - 1}", "mod",
                                        "table:0"])

    def test_round_trip_equals_stock_lookup(self):
        self._check_round_trip(PARTITIONS)

    def test_table_wise_round_trip_equals_stock_lookup(self):
        self._check_round_trip(TABLE_WISE)

    def _check_round_trip(self, partitions):
        workers = 3
        rng = np.random.default_rng(5)
        tables = [rng.normal(size=(v, d)).astype(np.float32)
                  for v, d in zip(VOCABS, DIMS)]
        shards = [[tf.Variable(tables[t][shard_rows(VOCABS[t], partitions[t],
                                                    workers, w)])
                   for t in range(3)] for w in range(workers)]
        batches = random_batches(workers)
        weights = [[tf.Variable(f[2]) for f in feats] for feats in batches]
        upstream = [[rng.normal(size=(len(f[1]) - 1, DIMS[t]))
                     .astype(np.float32) for t, f in enumerate(feats)]
                    for feats in batches]
        with tf.GradientTape(persistent=True) as tape:
            sends, send_splits, offsets = [], [], []
            for feats in batches:
                s, sp, off = collective_routing.route_ids(
                    [tf.constant(f[0]) for f in feats], VOCABS, DIMS,
                    partitions, workers, NAMES)
                sends.append(s)
                send_splits.append(sp)
                offsets.append(off)
            received, received_splits = alltoall(sends, send_splits)
            rows, row_splits = [], []
            for w in range(workers):
                r, rs = collective_routing.owner_gather(
                    shards[w], received[w], received_splits[w], DIMS, NAMES)
                rows.append(r)
                row_splits.append(rs)
            returned, _ = alltoall(rows, row_splits)
            losses, pooled = [], []
            for w, feats in enumerate(batches):
                fids = [FeatureIds(tf.constant(f[0]), tf.constant(f[1]),
                                   weights[w][t].read_value(), None, None,
                                   NAMES[t])
                        for t, f in enumerate(feats)]
                out = collective_routing.pool(returned[w], offsets[w], fids,
                                              COMBINERS, DIMS)
                pooled.append(out)
                losses.append(sum(tf.reduce_sum(o * u) for o, u in
                                  zip(out, upstream[w])))
            loss = tf.add_n(losses)
        # Oracle: stock lookups on the whole tables, per worker.
        full = [tf.Variable(x) for x in tables]
        with tf.GradientTape(persistent=True) as ref_tape:
            ref_losses = []
            for w, feats in enumerate(batches):
                for t, f in enumerate(feats):
                    ids = tf.RaggedTensor.from_row_splits(f[0], f[1])
                    wts = tf.RaggedTensor.from_row_splits(
                        weights[w][t].read_value(), f[1])
                    got = tf.nn.embedding_lookup_sparse(
                        full[t], ids.to_sparse(), wts.to_sparse(),
                        combiner=COMBINERS[t])
                    # Stock drops trailing empty rows: pad to the batch.
                    got = tf.pad(got, [[0, len(f[1]) - 1 - tf.shape(got)[0]],
                                       [0, 0]])
                    self.assertAllClose(pooled[w][t], got, rtol=1e-5,
                                        atol=1e-6)
                    ref_losses.append(tf.reduce_sum(got * upstream[w][t]))
            ref_loss = tf.add_n(ref_losses)
        for t in range(3):
            want = tf.convert_to_tensor(ref_tape.gradient(ref_loss, full[t]))
            for w in range(workers):
                g = tape.gradient(loss, shards[w][t])
                self.assertIsInstance(g, tf.IndexedSlices)
                # Distinct rows per shard: the optimizer sees no duplicate.
                idx = g.indices.numpy()
                self.assertEqual(len(np.unique(idx)), len(idx))
                rows_of_w = shard_rows(VOCABS[t], partitions[t], workers, w)
                self.assertAllClose(tf.convert_to_tensor(g),
                                    tf.gather(want, rows_of_w), rtol=1e-5,
                                    atol=1e-5)
            for w in range(workers):
                self.assertAllClose(
                    tape.gradient(loss, weights[w][t]),
                    ref_tape.gradient(ref_loss, weights[w][t]),
                    rtol=1e-4, atol=1e-5)

    def test_id_out_of_range_names_the_table(self):
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"t1: id 7 is out of range \[0, 7\)"):
            collective_routing.route_ids(
                [tf.constant([1], tf.int64), tf.constant([3, 7], tf.int64),
                 tf.constant([], tf.int64)], VOCABS, DIMS, PARTITIONS, 2,
                NAMES)

    def test_bad_partition_names_the_table(self):
        ids = [tf.constant([1], tf.int64)] * 3
        cases = [
            ("table:2", r"Invalid partition 'table:2' for t1: rank 2 is "
                        r"not in \[0, 2\)"),
            ("table:-1", r"Invalid partition 'table:-1' for t1, use mod, "
                         r"div or table:<rank>"),
            ("table:", r"Invalid partition 'table:' for t1"),
            ("table:99999999999", r"Invalid partition 'table:99999999999' "
                                  r"for t1"),
            ("hash", r"Invalid partition 'hash' for t1"),
        ]
        for bad, message in cases:
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                        message):
                collective_routing.route_ids(
                    ids, VOCABS, DIMS, ["mod", bad, "div"], 2, NAMES)

    def test_bad_received_counts_fail(self):
        shards = [tf.Variable(tf.zeros([v, d])) for v, d in zip(VOCABS, DIMS)]
        # Source 0 announces 5 ids of table 0 but sends 1.
        received = tf.constant([5, 0, 0, 1], tf.int64)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "announces 5 ids"):
            collective_routing.owner_gather(
                shards, received, tf.constant([4], tf.int32), DIMS, NAMES)
        # A local row outside the shard.
        received = tf.constant([1, 0, 0, 50], tf.int64)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "t0: worker 0 asks for local row 50"):
            collective_routing.owner_gather(
                shards, received, tf.constant([4], tf.int32), DIMS, NAMES)

    def test_shard_rows_built_in_are_checked_and_spare_shape_reads(self):
        shards = [tf.Variable(tf.zeros([v, d])) for v, d in zip(VOCABS, DIMS)]
        received = tf.constant([1, 0, 0, 2], tf.int64)
        splits = tf.constant([4], tf.int32)
        lib = collective_routing.library()
        # A shard that no longer has the rows the lookup was built for.
        rows = list(VOCABS)
        rows[1] += 1
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "t1: the shard has 7 rows, but the "
                                    "lookup was built for 8"):
            lib.group_embedding_collective_owner_gather(
                shards=[s.handle for s in shards], received_ids=received,
                received_splits=splits, dims=DIMS, table_names=NAMES,
                shard_rows=rows)

        # Static shards: the gradient reads no shard shape, and equals the
        # one built from the shapes read at run time (no built-in rows).
        def grads(built_in):
            @tf.function
            def f():
                with tf.GradientTape() as tape:
                    if built_in:
                        rows, _ = collective_routing.owner_gather(
                            shards, received, splits, DIMS, NAMES)
                    else:
                        for s in shards:
                            tape.watch(s)
                        rows, _ = lib.group_embedding_collective_owner_gather(
                            shards=[s.handle for s in shards],
                            received_ids=received, received_splits=splits,
                            dims=DIMS, table_names=NAMES)
                    loss = tf.reduce_sum(rows * tf.range(
                        tf.size(rows), dtype=tf.float32))
                g = tape.gradient(loss, shards)
                return [(x.indices, x.values, x.dense_shape) for x in g]
            ops = {o.type for o in f.get_concrete_function().graph
                   .get_operations()}
            return f(), ops
        built, built_ops = grads(True)
        read, read_ops = grads(False)
        self.assertNotIn("VariableShape", built_ops)
        self.assertIn("VariableShape", read_ops)
        for a, b in zip(built, read):
            for x, y in zip(a, b):
                self.assertAllEqual(x, y)

    def test_shard_gradients_scaled_inside_the_merge(self):
        # allreduce_gradients' 1/N: the merge is built again with the
        # scale (one op for every shard), equal to a multiply after it.
        shards = [tf.Variable(tf.zeros([v, d])) for v, d in zip(VOCABS, DIMS)]
        # Per source: 3 counts, then its rows of t0, t1, t2 (row 3 of t0
        # from both).
        received = tf.constant([2, 1, 1, 3, 5, 0, 2, 2, 1, 1, 3, 6, 4, 1],
                               tf.int64)
        splits = tf.constant([7, 7], tf.int32)

        @tf.function
        def f():
            with tf.GradientTape() as tape:
                rows, _ = collective_routing.owner_gather(
                    shards, received, splits, DIMS, NAMES)
                loss = tf.reduce_sum(rows * tf.sin(tf.range(
                    tf.size(rows), dtype=tf.float32)))
            grads = tape.gradient(loss, shards)
            scaled = [collective_routing.scaled_shard_gradient(g, 1 / 3)
                      for g in grads]
            # One scaled merge serves every shard.
            self.assertEqual(len({s.values.op.name for s in scaled}), 1)
            self.assertAlmostEqual(
                scaled[0].values.op.get_attr("scale"), 1 / 3)
            return [(g.indices, g.values * (1 / 3), s.indices, s.values)
                    for g, s in zip(grads, scaled)]

        for indices, expected, got_indices, got in f():
            self.assertAllEqual(got_indices, indices)
            self.assertAllEqual(got, expected)
        # Not the merge's output (eager, a plain tensor): left to the
        # caller.
        self.assertIsNone(collective_routing.scaled_shard_gradient(
            tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0], tf.int64)),
            0.5))

    def test_owner_gather_grad_row_outside_the_shard_fails(self):
        # Local row 2**63 - 1 once overflowed `id + 1` in the kernel's
        # dedup map and crashed the process (issue 25.7).
        lib = collective_routing.library()
        for bad in (2**63 - 1, 7, -1):
            with self.assertRaisesRegex(
                    tf.errors.InvalidArgumentError,
                    rf"GroupEmbeddingCollectiveOwnerGatherGrad: t0: worker 0 "
                    rf"sent a gradient for local row {bad} outside this "
                    rf"shard's \[0, 7\)"):
                lib.group_embedding_collective_owner_gather_grad(
                    grad=tf.zeros([8]),
                    received_ids=tf.constant([2, 1, bad], tf.int64),
                    received_splits=tf.constant([3], tf.int32),
                    shard_rows=tf.constant([7], tf.int64), num_tables=1,
                    dims=[4], table_names=["t0"])
        # The row count bounds the merge's id map: a negative one (which
        # every row would pass as unsigned) is refused first.
        with self.assertRaisesRegex(
                tf.errors.InvalidArgumentError,
                "t0: shard_rows is -1, not a row count"):
            lib.group_embedding_collective_owner_gather_grad(
                grad=tf.zeros([8]),
                received_ids=tf.constant([2, 1, 5], tf.int64),
                received_splits=tf.constant([3], tf.int32),
                shard_rows=tf.constant([-1], tf.int64), num_tables=1,
                dims=[4], table_names=["t0"])

    def test_div_route_of_a_vocab_near_int64_max(self):
        # ceil(V / N) as (V + N - 1) / N overflowed here and wrote the
        # counts of owner -1, aborting the process (issue 25.7).
        send, splits, _ = collective_routing.route_ids(
            [tf.constant([5, 2**62 + 1], tf.int64)], [2**63 - 1], [4],
            ["div"], 2, ["big"])
        # Blocks of 2**62 rows: id 5 is row 5 of worker 0, 2**62 + 1 row 1
        # of worker 1.
        np.testing.assert_array_equal(send.numpy(), [1, 5, 1, 1])
        np.testing.assert_array_equal(splits.numpy(), [2, 2])

    def test_dims_past_an_int32_split_fail(self):
        # Such dims made count * dim sums overflow into negative buffer
        # sizes that passed the split check.
        lib = collective_routing.library()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"`dims` must be in \[0, 2147483647\], "
                                    r"got 4611686018427387904"):
            lib.group_embedding_collective_owner_gather_grad(
                grad=tf.zeros([0]),
                received_ids=tf.constant([1, 1, 0, 0], tf.int64),
                received_splits=tf.constant([4], tf.int32),
                shard_rows=tf.constant([7, 7], tf.int64), num_tables=2,
                dims=[2**62, 2**62])

    def test_offsets_outside_the_rows_fail(self):
        feat = FeatureIds(tf.constant([0], tf.int64),
                          tf.constant([0, 1], tf.int64), None, None, None,
                          "f")
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "row offset 4 does not address"):
            collective_routing.pool(tf.zeros([6]), [tf.constant([4],
                                                                tf.int64)],
                                    [feat], ["sum"], [4])

    def test_bad_offsets_fail_in_pool_and_its_gradient(self):
        # The pooling checks each offset as it reads it, the gradient
        # before it scatters: negative, past the end, and so large that
        # `offset + dim` would wrap.
        lib = collective_routing.library()
        feats = [FeatureIds(tf.constant([0, 0], tf.int64),
                            tf.constant([0, 1, 2], tf.int64), None, None,
                            None, f"f{t}") for t in range(2)]
        for bad in (-1, 7, 2**63 - 2):
            offsets = [tf.constant([0, 2], tf.int64),
                       tf.constant([4, bad], tf.int64)]
            message = f"table 1: row offset {bad} does not address"
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                        message):
                collective_routing.pool(tf.zeros([8]), offsets, feats,
                                        ["sum", "sum"], [2, 2])
            with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                        message):
                lib.group_embedding_collective_pool_grad(
                    grads=[tf.ones([2, 2])] * 2, row_offsets=offsets,
                    row_splits=[f.row_splits for f in feats],
                    weights=[tf.zeros([0])] * 2,
                    num_elements=tf.constant(8, tf.int64),
                    combiners=["sum", "sum"], dims=[2, 2])
        # The last whole row (offset elems - dim) is inside.
        offsets = [tf.constant([0, 2], tf.int64), tf.constant([4, 6],
                                                             tf.int64)]
        pooled = collective_routing.pool(tf.range(8, dtype=tf.float32),
                                         offsets, feats, ["sum", "sum"],
                                         [2, 2])
        self.assertAllEqual(pooled[1], [[4, 5], [6, 7]])


if __name__ == "__main__":
    tf.test.main()
