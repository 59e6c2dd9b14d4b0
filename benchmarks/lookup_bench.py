"""Benchmark of grouped lookups on the criteo-like workload, every path.

Pooled training step = lookup of the 26 features, concat, loss = mean of
squares, backward, sparse Adagrad (lr 0.01, initial accumulator 0.1).
Variants come in families; each `ge` variant is compared with the stock-TF
variant of its family measured in the same run (see benchmarks/README.md):

* pooled: stock_keras, stock_raw_adagrad, ge, ge_pure_tf; with ids packed
  by `ge.pack_ids` once per batch outside the step (as an input pipeline
  does, and as FBGEMM gets its ids): stock_packed, ge_packed,
  ge_packed_pure_tf;
* seq (`is_sequence=True`): stock_seq, ge_seq, ge_seq_pure_tf;
* max_norm: stock_max_norm, ge_max_norm (C++ optimizer, TF lookup),
  ge_max_norm_pure_tf;
* weighted multi-hot: stock_weighted, ge_weighted, ge_weighted_pure_tf;
* ev (EmbeddingVariable tables, pooled and sequence): stock_ev (a plain
  tf.Variable of the same size), ge_ev, stock_ev_seq, ge_ev_seq;
* infer (`training=False`, forward only): stock_infer, ge_infer,
  ge_infer_pure_tf, and packed: stock_infer_packed, ge_infer_packed,
  ge_infer_packed_pure_tf;
* tf1 (graph, feature columns, `MonitoredTrainingSession`): stock_tf1,
  ge_tf1;
* peers (`--peers`): fbgemm_tbe, FBGEMM TBE with exact Adagrad.

Every training variant owns freshly initialised, identical tables (the
forward-only ones share one set) and runs inside
`tf.function` (no XLA) or its own graph. Variants are timed round-robin
(a few steps of each, several rounds) so that load changes on a shared
machine hit all of them alike; the median step time per variant is
reported.

Usage::

    python benchmarks/lookup_bench.py --quick        # smoke test
    python benchmarks/lookup_bench.py --dim 64
    python benchmarks/lookup_bench.py --variants ge,stock_raw_adagrad
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

import group_embedding as ge

# criteo_like is the sibling script module: `python
# benchmarks/lookup_bench.py` puts this folder first on sys.path.
import criteo_like

LEARNING_RATE = 0.01
INITIAL_ACCUMULATOR = 0.1
EPSILON = 1e-7
NUM_BATCHES = 8
LOSS_RTOL = 1e-4
MAX_NORM = 0.05
QUICK = {"cap": 20000, "batch": 512, "rounds": 2}
DEFAULTS = {"cap": 200000, "batch": 4096, "rounds": 5}
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "results")
PURE_TF = {"GROUP_EMBEDDING_KERNELS": "tf"}


def _stock_lookup(tables, batch, weighted=False, max_norm=None):
    weights = batch["weights"] if weighted else [None] * len(tables)
    return [tf.nn.embedding_lookup_sparse(t, sp, w, combiner="sum",
                                          max_norm=max_norm)
            for t, sp, w in zip(tables, batch["ids"], weights)]


def _stock_packed_lookup(tables, batch):
    """Stock lookups of `ge.pack_ids` ids: each feature's slices of the
    packed buffers as a RaggedTensor, which `embedding_lookup_sparse`
    reads."""
    p = batch["ids"]
    outs = []
    for f, t in enumerate(tables):
        splits = p.row_splits[f, :p.batch + 1]
        ids = tf.slice(p.values, p.offsets[f:f + 1], splits[-1:])
        outs.append(tf.nn.embedding_lookup_sparse(
            t, tf.RaggedTensor.from_row_splits(ids, splits, validate=False),
            None, combiner="sum"))
    return outs


def _stock_sequence(tables, batch):
    """Per table: rows of the distinct ids, scattered to `[B, T, D]`.

    Gathering distinct ids (as `embedding_lookup_sparse` does) gives a
    gradient with unique indices, which sparse Adagrad needs.
    """
    out = []
    for t, sp in zip(tables, batch["ids"]):
        uniq, slot = tf.unique(sp.values)
        rows = tf.gather(tf.nn.embedding_lookup(t, uniq), slot)
        shape = tf.concat([sp.dense_shape, [t.shape[1]]], 0)
        out.append(tf.scatter_nd(sp.indices, rows, shape))
    return out


def _ge_lookup(tables, batch, weighted=False, max_norm=None,
               is_sequence=False, training=True):
    # Pooled outputs come concatenated, as the step (and a dense layer)
    # wants them: the fused kernel writes them in place.
    return ge.group_embedding_lookup_sparse(
        tables, batch["ids"], "sum",
        sp_weights=batch["weights"] if weighted else None,
        is_sequence=is_sequence, max_norm=max_norm, training=training,
        concat_outputs=not is_sequence)


def _concat(outputs):
    """The step's `[B, sum D]` input: the lookup's own concatenated output,
    or the concat of its per-table outputs (axis 1)."""
    if isinstance(outputs, (list, tuple)):
        return tf.concat(outputs, axis=1)
    return outputs


def _optimizer_update(optimizer_cls) -> Callable:
    """Update factory applying the gradients with a Keras-3 optimizer."""
    def make(tables):
        opt = optimizer_cls(LEARNING_RATE,
                            initial_accumulator_value=INITIAL_ACCUMULATOR,
                            epsilon=EPSILON)
        # Build eagerly: slot variables must not be created while tracing.
        opt.build(tables)
        return lambda grads: opt.apply_gradients(zip(grads, tables))
    return make


def _raw_adagrad_update(tables):
    """Update factory for the raw sparse Adagrad op, one call per table.

    The tape's gradient of `embedding_lookup_sparse` is IndexedSlices whose
    indices are already unique (SparseSegmentSumGrad sums duplicates), so
    applying it as is matches dense Adagrad; no dedup is needed.
    """
    accums = [tf.Variable(tf.fill(t.shape, INITIAL_ACCUMULATOR))
              for t in tables]

    def update(grads):
        for t, acc, g in zip(tables, accums, grads):
            tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=t.handle, accum=acc.handle, lr=LEARNING_RATE,
                epsilon=EPSILON, grad=g.values, indices=g.indices)
    return update


_GE_ADAGRAD = _optimizer_update(ge.optimizers.Adagrad)
_RAW = _raw_adagrad_update
_p = functools.partial


@dataclasses.dataclass
class Setup:
    """How a variant runs: its family, lookup, update and environment.

    `update` None means forward only (inference); `tables` is "variable"
    or "ev"; `stock` marks the stock-TF baselines of the family.
    """

    family: str
    lookup: Callable = None
    update: Optional[Callable] = None
    env: dict = dataclasses.field(default_factory=dict)
    tables: str = "variable"
    stock: bool = False
    kind: str = "tf2"
    # Ids packed once per batch by `ge.pack_ids` outside the step, as a
    # tf.data pipeline does (and as the FBGEMM peer gets its ids).
    packed: bool = False


SETUPS = {
    "stock_keras": Setup("pooled", _stock_lookup,
                         _optimizer_update(keras.optimizers.Adagrad),
                         stock=True),
    "stock_raw_adagrad": Setup("pooled", _stock_lookup, _RAW, stock=True),
    "ge": Setup("pooled", _ge_lookup, _GE_ADAGRAD),
    "ge_pure_tf": Setup("pooled", _ge_lookup, _GE_ADAGRAD, PURE_TF),
    "stock_packed": Setup("pooled", _stock_packed_lookup, _RAW, stock=True,
                          packed=True),
    "ge_packed": Setup("pooled", _ge_lookup, _GE_ADAGRAD, packed=True),
    "ge_packed_pure_tf": Setup("pooled", _ge_lookup, _GE_ADAGRAD, PURE_TF,
                               packed=True),
    "stock_seq": Setup("seq", _stock_sequence, _RAW, stock=True),
    "ge_seq": Setup("seq", _p(_ge_lookup, is_sequence=True), _GE_ADAGRAD),
    "ge_seq_pure_tf": Setup("seq", _p(_ge_lookup, is_sequence=True),
                            _GE_ADAGRAD, PURE_TF),
    "stock_max_norm": Setup("max_norm", _p(_stock_lookup, max_norm=MAX_NORM),
                            _RAW, stock=True),
    "ge_max_norm": Setup("max_norm", _p(_ge_lookup, max_norm=MAX_NORM),
                         _GE_ADAGRAD),
    "ge_max_norm_pure_tf": Setup("max_norm",
                                 _p(_ge_lookup, max_norm=MAX_NORM),
                                 _GE_ADAGRAD, PURE_TF),
    "stock_weighted": Setup("weighted", _p(_stock_lookup, weighted=True),
                            _RAW, stock=True),
    "ge_weighted": Setup("weighted", _p(_ge_lookup, weighted=True),
                         _GE_ADAGRAD),
    "ge_weighted_pure_tf": Setup("weighted", _p(_ge_lookup, weighted=True),
                                 _GE_ADAGRAD, PURE_TF),
    "stock_ev": Setup("ev", _stock_lookup, _RAW, stock=True),
    "ge_ev": Setup("ev", _ge_lookup, _GE_ADAGRAD, tables="ev"),
    "stock_ev_seq": Setup("ev_seq", _stock_sequence, _RAW, stock=True),
    "ge_ev_seq": Setup("ev_seq", _p(_ge_lookup, is_sequence=True),
                       _GE_ADAGRAD, tables="ev"),
    "stock_infer": Setup("infer", _stock_lookup, stock=True),
    "ge_infer": Setup("infer", _p(_ge_lookup, training=False)),
    "ge_infer_pure_tf": Setup("infer", _p(_ge_lookup, training=False),
                              env=PURE_TF),
    "stock_infer_packed": Setup("infer", _stock_packed_lookup, stock=True,
                                packed=True),
    "ge_infer_packed": Setup("infer", _p(_ge_lookup, training=False),
                             packed=True),
    "ge_infer_packed_pure_tf": Setup("infer", _p(_ge_lookup, training=False),
                                     env=PURE_TF, packed=True),
    "stock_tf1": Setup("tf1", stock=True, kind="tf1"),
    "ge_tf1": Setup("tf1", kind="tf1"),
    "fbgemm_tbe": Setup("pooled", stock=False, kind="peer"),
}
VARIANTS = tuple(n for n in SETUPS if n != "fbgemm_tbe")
# Families whose losses cannot agree with stock: EVs create rows on first
# sight with their own initializer.
UNCHECKED_FAMILIES = ("ev", "ev_seq")


@contextlib.contextmanager
def _environ(overrides: dict[str, str]):
    """Sets environment variables for the block, then restores them."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ev_tables(name, dim, seed):
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=seed)
    return [ge.get_embedding_variable(f"{name}_ev{i}", dim,
                                      initializer=init)
            for i in range(len(criteo_like.CARDINALITIES))]


# Tables of the forward-only variants, per initial values.
_READ_ONLY_TABLES: dict[int, list] = {}


class Variant:
    """One way to run the step (TF2 `tf.function`), on its own tables
    (forward-only variants share theirs)."""

    def __init__(self, name: str, initial: list[np.ndarray], seed: int):
        setup = SETUPS[name]
        self.name, self.family, self.env = name, setup.family, setup.env
        self.stock = setup.stock
        # Only the weighted family reads the weights: the others are not
        # given them, so that no variant pays for flattening 26 unused
        # SparseTensors at every call (~1.2 ms here).
        self.weighted = setup.family == "weighted"
        self.packed = setup.packed
        self._packed = {}
        if setup.tables == "ev":
            self.tables = _ev_tables(name, initial[0].shape[1], seed)
        elif setup.update is None:
            # Forward-only variants never write: they share one set of
            # tables (at dim 64 a set is ~0.6 GB; the run must fit 24 GiB).
            key = id(initial)
            if key not in _READ_ONLY_TABLES:
                _READ_ONLY_TABLES[key] = [
                    tf.Variable(x, name=f"infer_table{i}")
                    for i, x in enumerate(initial)]
            self.tables = _READ_ONLY_TABLES[key]
        else:
            self.tables = [tf.Variable(x, name=f"{name}_table{i}")
                           for i, x in enumerate(initial)]
        update = setup.update(self.tables) if setup.update else None
        lookup = setup.lookup
        self.steps_done = 0
        tables = self.tables

        @tf.function(jit_compile=False)
        def step(batch):
            if update is None:
                emb = _concat(lookup(tables, batch))
                return tf.reduce_mean(tf.square(emb))
            with tf.GradientTape() as tape:
                emb = _concat(lookup(tables, batch))
                loss = tf.reduce_mean(tf.square(emb))
            update(tape.gradient(loss, tables))
            return loss

        self.step_fn = step

    def run(self, batches) -> float:
        """Runs one step on the next batch of the cycle; returns the loss.

        Call inside `self.environ()`. Fetching the loss waits for the step.
        """
        batch = batches[self.steps_done % len(batches)]
        self.steps_done += 1
        return float(self.step_fn(self._inputs(batch)).numpy())

    def environ(self):
        return _environ(self.env)

    def custom_op_count(self, batch) -> int:
        """Number of group-embedding C++ ops in the traced step graph."""
        with self.environ():
            graph = self.step_fn.get_concrete_function(
                self._inputs(batch)).graph
        return sum(op.type.startswith(("Group", "EV"))
                   for op in graph.get_operations())

    def traces(self) -> int:
        return self.step_fn.experimental_get_tracing_count()

    def _inputs(self, batch):
        if self.packed:
            if id(batch) not in self._packed:
                self._packed[id(batch)] = {"ids": ge.pack_ids(batch["ids"])}
            return self._packed[id(batch)]
        return batch if self.weighted else {"ids": batch["ids"]}


class TF1Variant:
    """The TF1 graph path: feature columns + v1 Adagrad, monitored session.

    Both variants read the same pre-built batches from a tf.data pipeline
    in their own graph, and initialise their tables with the same seeded
    v1 initializer, so their losses agree.
    """

    def __init__(self, name: str, batches, cap: int, dim: int, seed: int):
        from group_embedding import feature_column as ge_fc
        v1 = tf.compat.v1
        self.name, self.family, self.env = name, "tf1", {}
        self.stock = SETUPS[name].stock
        self.steps_done = 0
        use_ge = not self.stock
        keys = [f"f{i:02d}" for i in range(len(batches[0]["ids"]))]
        self.graph = tf.Graph()
        with self.graph.as_default():
            v1.set_random_seed(seed)
            data = None
            for b in batches:
                feats = {k: tf.SparseTensor(sp.indices.numpy(),
                                            sp.values.numpy(),
                                            sp.dense_shape.numpy())
                         for k, sp in zip(keys, b["ids"])}
                ds = tf.data.Dataset.from_tensors(feats)
                data = ds if data is None else data.concatenate(ds)
            features = v1.data.make_one_shot_iterator(
                data.repeat()).get_next()
            columns = []
            # The library's TF1 path: the 26 columns in one scope, one
            # fused lookup (outside a scope each column is looked up
            # alone, as stock does).
            with (ge_fc.group_embedding_column_scope("criteo") if use_ge
                  else contextlib.nullcontext()):
                for i, (k, vocab) in enumerate(zip(
                        keys, criteo_like.vocab_sizes(cap))):
                    cat = tf.feature_column.categorical_column_with_identity(
                        k, vocab)
                    init = v1.random_uniform_initializer(-0.05, 0.05,
                                                         seed=seed + i)
                    columns.append(
                        ge_fc.embedding_column(cat, dim, "sum",
                                               initializer=init)
                        if use_ge else tf.feature_column.embedding_column(
                            cat, dim, combiner="sum", initializer=init))
            if use_ge:
                x = ge_fc.input_layer(features, columns)
                opt = ge.train.AdagradOptimizer(
                    LEARNING_RATE,
                    initial_accumulator_value=INITIAL_ACCUMULATOR)
            else:
                x = v1.feature_column.input_layer(features, columns)
                opt = v1.train.AdagradOptimizer(
                    LEARNING_RATE,
                    initial_accumulator_value=INITIAL_ACCUMULATOR)
            self.loss = tf.reduce_mean(tf.square(x))
            self.train_op = opt.minimize(
                self.loss, global_step=v1.train.get_or_create_global_step())
            self.sess = v1.train.MonitoredTrainingSession(
                save_checkpoint_steps=None, save_checkpoint_secs=None,
                save_summaries_steps=None, save_summaries_secs=None,
                log_step_count_steps=None)

    def run(self, batches) -> float:
        self.steps_done += 1
        return float(self.sess.run([self.loss, self.train_op])[0])

    def environ(self):
        return _environ({})

    def custom_op_count(self, batch) -> int:
        return sum(op.type.startswith(("Group", "EV"))
                   for op in self.graph.get_operations())

    def traces(self) -> int:
        return 1


class TBEVariant:
    """FBGEMM TBE (CPU) with exact row-wise-free Adagrad, same tables."""

    def __init__(self, initial, batches):
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            EmbeddingLocation,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
            PoolingMode,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
        )
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        self.name, self.family, self.env, self.stock = (
            "fbgemm_tbe", "pooled", {}, False)
        self.steps_done = 0
        self._torch = torch
        dim = initial[0].shape[1]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(x.shape[0], dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
             for x in initial],
            optimizer=EmbOptimType.EXACT_ADAGRAD, learning_rate=LEARNING_RATE,
            eps=EPSILON, pooling_mode=PoolingMode.SUM)
        with torch.no_grad():
            for w, x in zip(self.tbe.split_embedding_weights(), initial):
                w.copy_(torch.from_numpy(x))
        self.inputs = []
        for b in batches:
            lengths = [np.diff(np.searchsorted(
                sp.indices.numpy()[:, 0],
                np.arange(sp.dense_shape.numpy()[0] + 1))) for sp in b["ids"]]
            ids = np.concatenate([sp.values.numpy() for sp in b["ids"]])
            offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
            self.inputs.append((torch.from_numpy(ids),
                                torch.from_numpy(offsets.astype(np.int64))))

    def run(self, batches) -> float:
        ids, offsets = self.inputs[self.steps_done % len(self.inputs)]
        self.steps_done += 1
        out = self.tbe(ids, offsets)
        loss = (out * out).mean()
        loss.backward()
        return float(loss)

    def environ(self):
        return _environ({})

    def custom_op_count(self, batch) -> int:
        return 0

    def traces(self) -> int:
        return 1


def _check_losses(variants, losses: dict[str, list[float]],
                 warmup: int) -> float:
    """Asserts each family's variants saw the same losses; max rel diff.

    Warmup steps cycle the same batches in the same order for every
    variant, so equal losses at every step also check backward + update.
    EV families and FBGEMM (other initial rows / accumulators) are only
    reported.
    """
    worst = 0.0
    by_family = {}
    for v in variants:
        by_family.setdefault(v.family, []).append(v)
    for family, members in by_family.items():
        checked = [v for v in members if v.name != "fbgemm_tbe"]
        if family in UNCHECKED_FAMILIES or len(checked) < 2:
            continue
        ref_name = checked[0].name
        ref = np.asarray(losses[ref_name])
        for v in checked[1:]:
            got = np.asarray(losses[v.name])
            rel = np.abs(got - ref) / np.abs(ref)
            worst = max(worst, float(rel.max()))
            if not np.allclose(got, ref, rtol=LOSS_RTOL, atol=0):
                raise AssertionError(
                    f"Loss mismatch {v.name} vs {ref_name} (rtol "
                    f"{LOSS_RTOL}): {got.tolist()} vs {ref.tolist()}")
        print(f"correctness [{family}]: losses of "
              f"{', '.join(v.name for v in checked)} agree (rtol "
              f"{LOSS_RTOL}) on the first step and after {warmup} warmup "
              "steps")
    return worst


def _best_time(fn, repeats: int = 5) -> float:
    """The shortest of `repeats` timed calls of `fn`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _random_gather_bandwidth(dim: int, rows: int = 2_000_000,
                             take: int = 1_000_000) -> float:
    """Bytes/s of a numpy gather of uniformly random rows (read + write
    counted): the worst case, no row reused from the caches."""
    rng = np.random.default_rng(0)
    # One opaque item per row: np.take then copies whole rows (memcpy)
    # instead of looping over the elements of each row.
    table = rng.random((rows, dim), dtype=np.float32).view(
        f"V{4 * dim}").ravel()
    idx = rng.integers(0, rows, take)
    return 2 * take * dim * 4 / _best_time(lambda: np.take(table, idx), 3)


def _memory_floor(batches, initial) -> dict:
    """What the pooled step must move, and how fast this machine moves it.

    Forward reads one row per id; the optimizer reads and writes each
    distinct row and its accumulator once. The floor times one numpy
    (single-thread memcpy) gather of the same rows from the step's own
    tables: every id's row for the forward, every distinct row twice for
    the optimizer's four row transfers (a gather moves two: read, write).
    Zipf ids reuse hot rows from the caches, as the step does, so this is
    well below bytes / `_random_gather_bandwidth`, which is reported too.
    """
    dim = initial[0].shape[1]
    # One opaque item per row (a view, no copy): np.take then copies
    # whole rows.
    tables = [t.view(f"V{4 * dim}").ravel() for t in initial]
    step_bytes, floor_s = 0.0, 0.0
    for b in batches:
        ids = [sp.values.numpy() for sp in b["ids"]]
        distinct = [np.unique(i) for i in ids]
        step_bytes += sum(len(i) + 4 * len(u)
                          for i, u in zip(ids, distinct)) * dim * 4

        def gather(which):
            for t, i in zip(tables, which):
                np.take(t, i)

        floor_s += (_best_time(lambda: gather(ids))
                    + 2 * _best_time(lambda: gather(distinct)))
    step_bytes /= len(batches)
    floor_s /= len(batches)
    random_bw = _random_gather_bandwidth(dim)
    return {"step_bytes": step_bytes,
            "floor_step_s": floor_s,
            "gather_bandwidth_bytes_per_s": step_bytes / floor_s,
            "random_gather_bandwidth_bytes_per_s": random_bw,
            "random_rows_floor_step_s": step_bytes / random_bw}


def _with_weights(batches, seed):
    """Adds per-id float weights in [0.5, 1.5) to every batch."""
    rng = np.random.default_rng(seed + 2)
    out = []
    for ids in batches:
        weights = [tf.SparseTensor(sp.indices, rng.uniform(
            0.5, 1.5, sp.values.shape[0]).astype(np.float32),
            sp.dense_shape) for sp in ids]
        out.append({"ids": ids, "weights": weights})
    return out


def _time_rounds(variants: list[Variant], batches, rounds: int,
                 steps: int) -> dict[str, list[list[float]]]:
    """Round-robin timing: `steps` timed steps of each variant per round.

    The starting variant rotates every round so none always runs right
    after the same neighbour (caches, turbo, other tenants).
    """
    times = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            round_times = []
            with v.environ():
                for _ in range(steps):
                    start = time.perf_counter()
                    v.run(batches)
                    round_times.append(time.perf_counter() - start)
            times[v.name].append(round_times)
        summary = "  ".join(
            f"{n}={1e3 * statistics.median(t[-1]):.1f}ms"
            for n, t in times.items())
        print(f"round {r + 1}/{rounds}: {summary}", flush=True)
    return times


def _plot(path: str, ratios: dict[str, float], title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(ratios)
    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(names)), 4.5))
    bars = ax.bar(names, [ratios[n] for n in names],
                  color=["#7f7f7f" if n.startswith("fbgemm") else
                         "#1f77b4" if "pure_tf" in n else "#d62728"
                         for n in names])
    ax.bar_label(bars, fmt="%.2f")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.margins(y=0.12)  # Room for the labels above the tallest bar.
    ax.set_ylabel("speedup over the family's best stock TF")
    ax.set_title(title, fontsize=9)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, help="default 4096 (quick: 512)")
    p.add_argument("--cap", type=int,
                   help="max rows per table, default 200000 (quick: 20000)")
    p.add_argument("--rounds", type=int, help="default 5 (quick: 2)")
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--peers", action="store_true",
                   help="add FBGEMM TBE (pip install -e .[bench]) to the "
                        "pooled family, skipped with a reason if missing")
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke-test sizes (explicit flags still win)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/"
                                 "lookup_bench_dim{D}[_quick].json)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or not args.variants:
        p.error(f"unknown variants {sorted(unknown)}; use {VARIANTS}")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the loss check needs one step)")
    if args.out is None:
        suffix = "_quick" if args.quick else ""
        args.out = os.path.join(RESULTS_DIR,
                                f"lookup_bench_dim{args.dim}{suffix}.json")
    return args


def _make_variants(args, batches, initial):
    variants = []
    for n in args.variants:
        if SETUPS[n].kind == "tf1":
            variants.append(TF1Variant(n, batches, args.cap, args.dim,
                                       args.seed))
        else:
            variants.append(Variant(n, initial, args.seed))
    if args.peers:
        try:
            variants.append(TBEVariant(initial, batches))
        except Exception as e:  # noqa: BLE001 - any failure skips the peer
            print(f"--peers: FBGEMM TBE skipped: {type(e).__name__}: {e}")
    return variants


def _family_ratios(variants, results):
    """Per non-stock variant: best stock median of its family / its own."""
    ratios = {}
    for v in variants:
        if v.stock:
            continue
        stock = [results[s.name]["median_step_s"] for s in variants
                 if s.stock and s.family == v.family]
        if stock:
            ratios[v.name] = min(stock) / results[v.name]["median_step_s"]
    return ratios


def main(argv=None):
    args = parse_args(argv)
    config = {k: getattr(args, k) for k in (
        "dim", "batch", "cap", "rounds", "steps_per_round", "warmup",
        "variants", "quick", "seed", "peers")}
    print(f"config: {config}")
    started = time.perf_counter()
    batches = _with_weights(criteo_like.make_batches(
        args.cap, args.batch, NUM_BATCHES, args.seed), args.seed)
    initial = criteo_like.initial_tables(args.cap, args.dim, args.seed)
    variants = _make_variants(args, batches, initial)

    # Warmup traces each step function and runs a few untimed steps; one
    # more step then gives every variant's loss on the same batch.
    losses = {}
    for v in variants:
        with v.environ():
            losses[v.name] = [v.run(batches) for _ in range(args.warmup + 1)]
    checked = {n: [ls[0], ls[-1]] for n, ls in losses.items()}
    max_rel_diff = _check_losses(variants, checked, args.warmup)
    custom_ops = {v.name: v.custom_op_count(batches[0]) for v in variants}
    print(f"group-embedding C++ ops per step graph: {custom_ops}")
    for v in variants:
        if v.env.get("GROUP_EMBEDDING_KERNELS") == "tf" and \
                custom_ops[v.name]:
            raise AssertionError(f"{v.name} traced C++ kernels; the "
                                 "GROUP_EMBEDDING_KERNELS override failed.")

    times = _time_rounds(variants, batches, args.rounds,
                         args.steps_per_round)
    results = {}
    for v in variants:
        flat = [t for r in times[v.name] for t in r]
        median = statistics.median(flat)
        results[v.name] = {
            "family": v.family,
            "stock": v.stock,
            "step_times_s": times[v.name],
            "median_step_s": median,
            "samples_per_s": args.batch / median,
            "traces": v.traces(),
        }
    ratios = _family_ratios(variants, results)
    ratios.update({f"ge_over_{base}": results[base]["median_step_s"]
                   / results["ge"]["median_step_s"]
                   for base in ("stock_keras", "stock_raw_adagrad")
                   if "ge" in results and base in results})
    for ours in ("ge", "ge_packed"):
        if ours in results and "fbgemm_tbe" in results:
            ratios[f"{ours}_over_fbgemm_tbe"] = (
                results["fbgemm_tbe"]["median_step_s"]
                / results[ours]["median_step_s"])

    memory_floor = _memory_floor(batches, initial)
    floor_s = memory_floor["floor_step_s"]
    for ours in ("ge", "ge_packed"):
        if ours in results:
            memory_floor[f"{ours}_step_over_floor"] = (
                results[ours]["median_step_s"] / floor_s)
    # ru_maxrss is in KiB on Linux: the whole run's peak, all variants.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    print(f"\nmedian over {args.rounds} rounds x {args.steps_per_round} "
          f"steps (dim {args.dim}, batch {args.batch}, cap {args.cap}):")
    for name, r in results.items():
        ratio = ratios.get(name)
        tag = "stock" if r["stock"] else (
            f"{ratio:.2f}x stock" if ratio else "")
        print(f"  {r['family']:9s} {name:20s} "
              f"{1e3 * r['median_step_s']:9.2f} ms/step "
              f"{r['samples_per_s']:10.0f} samples/s  {tag}")
    for name, ratio in ratios.items():
        if "_over_" in name:
            print(f"  speedup {name}: {ratio:.2f}x")
    print(f"memory floor: the pooled step moves "
          f"{memory_floor['step_bytes'] / 1e6:.1f} MB; a numpy gather of "
          f"its rows takes {1e3 * floor_s:.2f} ms "
          f"({memory_floor['gather_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
          f"uniformly random rows: "
          f"{memory_floor['random_gather_bandwidth_bytes_per_s'] / 1e9:.1f}"
          f" GB/s, {1e3 * memory_floor['random_rows_floor_step_s']:.2f} ms)"
          + "".join(f"; {ours} takes {memory_floor[key]:.1f}x the floor"
                    for ours in ("ge", "ge_packed")
                    if (key := f"{ours}_step_over_floor") in memory_floor))
    print(f"peak RSS of the run: {peak_rss / 2**20:.0f} MiB")
    elapsed = time.perf_counter() - started

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    report = {
        "config": config,
        "tf_version": tf.__version__,
        "keras_version": keras.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "elapsed_s": elapsed,
        "losses": losses,
        "max_loss_rel_diff": max_rel_diff,
        "custom_ops": custom_ops,
        "results": results,
        "ratios_over_best_stock": ratios,
        "memory_floor": memory_floor,
        "peak_rss_bytes": peak_rss,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    _plot(png, {n: r for n, r in ratios.items() if "_over_" not in n},
          f"criteo-like, dim {args.dim}, batch {args.batch}, cap "
          f"{args.cap} (TF {tf.__version__}, {os.cpu_count()} CPUs)")
    print(f"wrote {args.out} and {png} ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()
