"""Collective training equals the single-process run (run under horovodrun).

Every worker trains the model-parallel model on its slice of each global
batch and, in the same process, a single-process reference (plain
tf.Variables built from the same initial values) on the whole batch. After
the steps, the global loss of every step, every row of this worker's
shards, every replicated table and every dense weight must equal the
reference. Any mismatch raises, so horovodrun exits non-zero.

    horovodrun -np 2 python collective_train.py --partition mod \
        --optimizer adagrad

`--placement table` places tables 0-2 whole on one worker each (explicit
ranks, and "table" for the least-loaded one); `--placement plan` lets the
planner of `enable_distributed_strategy(table_sizes=...)` choose: table 3
replicated, 0 and 2 table-wise, 1 row-sharded.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import group_embedding as ge  # noqa: E402
from group_embedding.distributed import sharded_variable  # noqa: E402
from group_embedding.ops import gpu_kernel_library  # noqa: E402

# Tables 0-2: sharded tf.Variables; 3: replicated (tiny); 4: an
# EmbeddingVariable whose ids are mapped to arbitrary int64 keys.
VOCABS = [97, 300, 41, 5, 60]
DIMS = [8, 8, 4, 4, 8]
COMBINERS = ["sum", "mean", "sqrtn", "mean", "mean"]
EV_TABLE = 4


def ev_keys(ids):
    """Row id -> EV key: negative and huge keys, spread over workers."""
    return ids * 7_919_000_003 - 3_000_000_000
GLOBAL_BATCH = 12
STEPS = 20


def make_batches(seed, steps, workers):
    """Global batches: multi-hot rows, weights, empty rows; per-worker
    slices of uneven size (and an empty slice when workers > rows)."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        feats = []
        for vocab in VOCABS:
            lengths = rng.integers(0, 4, GLOBAL_BATCH)
            values = rng.integers(0, vocab, lengths.sum())
            weights = rng.uniform(0.5, 2.0, lengths.sum()).astype(np.float32)
            feats.append((lengths, values, weights))
        dense = rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32)
        label = rng.normal(size=(GLOBAL_BATCH, 1)).astype(np.float32)
        batches.append((feats, dense, label))
    return batches


def rows_of(batch, lo, hi):
    """Ragged ids/weights, dense and labels of global rows [lo, hi)."""
    feats, dense, label = batch
    ids, weights = [], []
    for lengths, values, w in feats:
        splits = np.concatenate([[0], np.cumsum(lengths)])
        part = slice(splits[lo], splits[hi])
        row_splits = splits[lo:hi + 1] - splits[lo]
        ids.append(tf.RaggedTensor.from_row_splits(values[part], row_splits))
        weights.append(tf.RaggedTensor.from_row_splits(w[part], row_splits))
    return ids, weights, dense[lo:hi], label[lo:hi]


def table_placements(placement, size):
    """`get_embedding_table` arguments of tables 0-3 per `--placement`."""
    if placement == "table":
        # t0 on the last rank, t1 on rank 0, t2 on the least loaded one.
        return [{"placement": f"table:{size - 1}"},
                {"placement": "table:0"}, {"placement": "table"}, {}]
    if placement == "plan":
        return [{}, {}, {}, {}]  # the plan of enable_distributed_strategy
    # Tables 0-2 sharded although small; table 3 left to the size rule.
    return [{"replicate": False}] * 3 + [{}]


# The plan of `--placement plan`: 100 bytes replicates t3 (80 bytes);
# fraction 1 puts t0 (3104 bytes) and t2 (656) whole, but not t1 (9600 >
# 13360 / N at N = 2 or 3).
PLAN = {"replicate_below_bytes": 100, "table_wise_fraction": 1.0,
        "table_sizes": {f"t{i}": (v, d) for i, (v, d)
                        in enumerate(zip(VOCABS[:EV_TABLE],
                                         DIMS[:EV_TABLE]))}}


def check_placements(tables, placement, size):
    """The placement each table got, as `--placement` asked."""
    if size == 1:
        return
    got = [t.placement if isinstance(t, ge.ShardedVariable) else
           "replicate" for t in tables[:EV_TABLE]]
    want = {"table": ["table"] * 3 + ["replicate"],
            "plan": ["table", "row", "table", "replicate"]}.get(
                placement, ["row"] * 3 + ["replicate"])
    assert got == want, (got, want)
    if placement == "table":
        owners = [t.owner_rank for t in tables[:3]]
        # Least loaded after t0 (3104 bytes) and t1 (9600): rank 1.
        assert owners == [size - 1, 0, 1], owners


def make_optimizer(name):
    if name == "adagrad":
        return ge.optimizers.Adagrad(0.1, initial_accumulator_value=0.1)
    # Lazy (row-wise) Adam, the one EVs use; also on the reference's plain
    # variables, so both runs apply the same rule. The workers sum gradient
    # parts in another order than one process does; with Adam's default
    # epsilon (1e-7) a row whose gradient nearly cancels turns that float
    # rounding into a step of up to lr (CI saw 9e-6 on one element). An
    # epsilon of 1e-3 bounds that amplification and still tests the rule.
    return ge.optimizers.Adam(0.01, epsilon=1e-3)


class Model:
    """Grouped lookup -> concat with dense input -> linear layer."""

    def __init__(self, tables, dense_w, concat=False):
        self.tables = tables
        self.dense_w = dense_w
        # One [B, sum D] lookup output (concat_outputs) instead of a list.
        self.concat = concat

    def loss(self, ids, weights, dense, label, partition, exchanged=None):
        if not isinstance(self.tables[EV_TABLE], tf.Variable):
            ids = list(ids)
            ids[EV_TABLE] = tf.ragged.map_flat_values(ev_keys, ids[EV_TABLE])
        with ge.distributed.use_exchanged_ids(exchanged or {}):
            embedded = ge.group_embedding_lookup_sparse(
                self.tables, ids, COMBINERS, sp_weights=weights,
                partition_strategy=partition, concat_outputs=self.concat)
        x = tf.concat([embedded, dense] if self.concat
                      else embedded + [dense], 1)
        pred = tf.matmul(x, self.dense_w)
        return tf.reduce_mean(tf.square(pred - label))

    def variables(self):
        out = []
        for t in self.tables:
            out.append(t.shard if isinstance(t, ge.ShardedVariable) else t)
        return out + [self.dense_w]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--partition", default="mod")
    parser.add_argument("--optimizer", default="adagrad")
    parser.add_argument("--uneven", action="store_true")
    # The next batch's ids go out during the step (ge.distributed
    # .exchange_ids), which must not change any number.
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--placement", default="row",
                        choices=["row", "table", "plan"])
    # The workers' lookup returns one concatenated output (the reference
    # keeps per-table outputs).
    parser.add_argument("--concat", action="store_true")
    # The EV's storage: hbm runs its table on the HBM ops (the host
    # stand-in: the test sets GROUP_EMBEDDING_HBM_ON_HOST=1); hbm_dram
    # gives it a GPU table of 128 keys and a host-memory tier.
    parser.add_argument("--ev-storage", default="dram",
                        choices=["dram", "hbm", "hbm_dram"])
    # The EV's id space (more keys than a worker's 128-key GPU table).
    parser.add_argument("--ev-vocab", type=int, default=VOCABS[EV_TABLE])
    args = parser.parse_args()
    VOCABS[EV_TABLE] = args.ev_vocab

    hvd = ge.enable_distributed_strategy(
        "collective", **(PLAN if args.placement == "plan" else {}))
    # Idempotent: a second call returns the same initialised module.
    assert ge.enable_distributed_strategy("collective") is hvd
    from group_embedding.distributed import transport
    # Per peer rank: self, shm, unix or tcp (two_hosts tests check it).
    print(f"transport: {'sockets' if transport.active() else 'horovod'} "
          f"links {transport.links()}", flush=True)
    rank, size = hvd.rank(), hvd.size()
    width = sum(DIMS) + 3
    dense_init = np.random.default_rng(7).normal(
        size=(width, 1)).astype(np.float32) * 0.1

    tables = [ge.get_embedding_table(f"t{i}", v, d,
                                     partition_strategy=args.partition, **kw)
              for i, (v, d, kw) in enumerate(zip(
                  VOCABS[:EV_TABLE], DIMS[:EV_TABLE],
                  table_placements(args.placement, size)))]
    check_placements(tables, args.placement, size)
    storage = {"dram": ge.StorageOption(),
               "hbm": ge.StorageOption(ge.StorageType.HBM),
               "hbm_dram": ge.StorageOption(ge.StorageType.HBM_DRAM,
                                            storage_size=[1])}[args.ev_storage]
    ev = ge.get_embedding_variable(
        "ev4", DIMS[EV_TABLE],
        ev_option=ge.EmbeddingVariableOption(storage_option=storage))
    assert ev.ge_table_kind == ("ev" if args.ev_storage == "dram"
                                else "hbm_ev")
    # New keys start from the default rows: make every worker's equal.
    ge.broadcast_variables([ev])
    tables.append(ev)
    assert isinstance(tables[0], ge.ShardedVariable) or size == 1
    assert not isinstance(tables[3], ge.ShardedVariable)  # replicated
    # Rank 0's dense init must win: give the others garbage first.
    dense = tf.Variable(dense_init if rank == 0 else dense_init + 1.0)
    ge.broadcast_variables([dense])
    model = Model(tables, dense, concat=args.concat)

    # The single-process values of every row, as one process would draw.
    ref_tables = [tf.Variable(sharded_variable.initial_rows(
        f"t{i}", v, d, np.arange(v)))
        for i, (v, d) in enumerate(zip(VOCABS[:EV_TABLE], DIMS[:EV_TABLE]))]
    defaults = ev.default_values.numpy()
    ev_rows = ev_keys(np.arange(VOCABS[EV_TABLE])) % len(defaults)
    ref_tables.append(tf.Variable(defaults[ev_rows]))
    ref = Model(ref_tables, tf.Variable(dense_init))

    opt = make_optimizer(args.optimizer)
    ref_opt = make_optimizer(args.optimizer)
    # Uneven slices: worker w gets rows [cut[w], cut[w+1]).
    cuts = np.linspace(0, GLOBAL_BATCH, size + 1).astype(int)
    if args.uneven and size > 1:
        cuts[1:-1] += 1
        cuts[1] = 0  # worker 0 gets an empty slice
    

    def exchange(ids):
        return ge.distributed.exchange_ids(
            model.tables, ids, partition_strategy=args.partition)

    @tf.function(reduce_retracing=True)
    def step(ids, weights, d, y, share, exchanged, next_ids):
        with tf.GradientTape() as tape:
            loss = model.loss(ids, weights, d, y, args.partition, exchanged)
            # Gradients are averaged over workers (Horovod's convention):
            # weigh this slice's mean loss by its share of the global batch
            # so that uneven slices still give the global-batch gradient.
            scaled = loss * share
        variables = model.variables()
        grads = ge.DistributedGradientTape(tape).gradient(scaled, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss, (exchange(next_ids) if args.pipeline else {})

    @tf.function(reduce_retracing=True)
    def ref_step(ids, weights, d, y):
        with tf.GradientTape() as tape:
            loss = ref.loss(ids, weights, d, y, args.partition)
        variables = ref.variables()
        ref_opt.apply_gradients(zip(tape.gradient(loss, variables),
                                    variables))
        return loss

    batches = make_batches(3, STEPS, size)
    locals_ = [rows_of(b, cuts[rank], cuts[rank + 1]) for b in batches]
    exchanged = exchange(locals_[0][0]) if args.pipeline else {}
    if args.pipeline and size > 1:
        assert len(exchanged) == 2, exchanged.keys()  # dims 8 and 4
    waits = (gpu_kernel_library.host_stand_in_waits
             if args.ev_storage != "dram" else None)
    step_waits = []
    for i, batch in enumerate(batches):
        local = locals_[i]
        n = cuts[rank + 1] - cuts[rank]
        before = waits() if waits else 0
        loss, exchanged = step(
            *local, tf.constant(n * size / GLOBAL_BATCH, tf.float32),
            exchanged, locals_[(i + 1) % len(locals_)][0])
        loss.numpy()
        if waits:
            step_waits.append(waits() - before)
        loss = tf.where(n > 0, loss, 0.0)  # an empty slice's mean is NaN
        global_loss = hvd.allreduce(loss * n, op=hvd.Sum) / GLOBAL_BATCH
        ref_loss = ref_step(*rows_of(batch, 0, GLOBAL_BATCH))
        np.testing.assert_allclose(global_loss.numpy(), ref_loss.numpy(),
                                   rtol=2e-5)

    if waits:
        print(f"worker {rank}: stream waits per step {step_waits}",
              flush=True)
    if args.ev_storage == "hbm":
        # As in one process: the lookup's one wait, the update (its
        # gradient averaged over the workers) fused, without one.
        assert step_waits == [1] * len(batches), step_waits
    if args.ev_storage == "hbm_dram":
        # More keys than the GPU table holds: some went to host memory.
        in_gpu, in_host = ev.storage.tier_sizes(ev.handle).numpy()
        assert in_gpu <= 128 and in_host > 0, (in_gpu, in_host)
    for t, r in zip(tables, ref_tables):
        if t is ev:
            keys, values, _, _ = (x.numpy() for x in ev.export())
            assert np.all(keys % size == rank), "EV holds keys it does not own"
            ids = (keys + 3_000_000_000) // 7_919_000_003
            np.testing.assert_array_equal(ev_keys(ids), keys)
            want, got = r.numpy()[ids], values
        elif isinstance(t, ge.ShardedVariable):
            want = r.numpy()[t.global_rows()]
            got = t.shard.numpy()
        else:
            want, got = r.numpy(), t.numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(dense.numpy(), ref.dense_w.numpy(),
                               rtol=2e-5, atol=2e-6)
    print(f"worker {rank}/{size}: {STEPS} steps equal the single-process "
          f"run ({args.partition}, {args.optimizer}, {args.placement}"
          f"{', pipelined' if args.pipeline else ''}, {args.ev_storage} "
          f"EV)", flush=True)


if __name__ == "__main__":
    main()
