"""Parity cases of the CUDA core against a numpy oracle.

The same cases run in two places:

* here, in CPU-only CI, through the host stand-in of the core
  (`tests/ops/test_cuda_core.py`, numpy memory);
* on the GPU machine, through the CUDA core with CuPy or torch device
  pointers (`benchmarks/gpu/check.sh` runs this file as a script).

The oracle is written independently of both implementations: float64
numpy loops over the definitions (stock TF's `embedding_lookup_sparse`
semantics, the optimizers' textbook rules).

Usage as a script:
    python tests/ops/cuda_parity.py --core build/libge_cuda.so \\
        --memory cupy [--quick] [--json results.json]
"""

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))


def load_cuda_core():
    """`ops/cuda_core.py`, loaded by path (the GPU machine has no TF, so
    the `group_embedding` package cannot be imported there)."""
    path = os.path.join(_REPO, "ops", "cuda_core.py")
    spec = importlib.util.spec_from_file_location("_ge_cuda_core", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cc = load_cuda_core()
RTOL = 1e-5
ATOL = 1e-5


# -- inputs -----------------------------------------------------------------
def ragged(rng, batch, vocab, max_len=6, empty=0.2, bad=0):
    """Row splits and ids: some empty rows, repeated ids; `bad` ids out of
    range (negative or >= vocab) at random places."""
    lengths = rng.integers(1, max_len + 1, size=batch)
    lengths[rng.random(batch) < empty] = 0
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    nnz = int(splits[-1])
    # A small hot set makes duplicates within and across rows likely.
    hot = rng.integers(0, vocab, size=max(2, vocab // 4))
    ids = np.where(rng.random(nnz) < 0.5, rng.choice(hot, nnz),
                   rng.integers(0, vocab, nnz)).astype(np.int64)
    if bad and nnz:
        at = rng.choice(nnz, size=min(bad, nnz), replace=False)
        ids[at] = np.where(rng.random(len(at)) < 0.5, -1 - at, vocab + at)
    return splits, ids


def make_tables(rng, specs, dim, weighted=False, sequence=False, slots=0):
    """TableBatches from (vocab, batch, combiner) specs."""
    out = []
    for vocab, batch, combiner in specs:
        splits, ids = ragged(rng, batch, vocab)
        x = cc.TableBatch(
            table=rng.normal(size=(vocab, dim)).astype(np.float32),
            ids=ids, splits=splits, combiner=combiner,
            weights=(rng.uniform(0.1, 2.0, len(ids)).astype(np.float32)
                     if weighted else None),
            slots=[rng.uniform(0.1, 1.0, (vocab, dim)).astype(np.float32)
                   for _ in range(slots)])
        if sequence:
            # Column of each id within its row; a row of a sequence may
            # repeat a position (its ids then add up).
            pos = np.zeros(len(ids), np.int64)
            for b in range(batch):
                lo, hi = splits[b], splits[b + 1]
                pos[lo:hi] = np.arange(hi - lo)
            if len(ids) > 3:
                pos[2] = pos[1] if splits[1] > 2 else pos[2]
            x.positions = pos
            x.seq_len = int(max(1, (np.diff(splits).max() if batch else 1)))
        out.append(x)
    return out


# -- oracle -----------------------------------------------------------------
def _scale(x, lo, hi):
    if x.combiner == "sum" or hi == lo:
        return 1.0
    w = (np.ones(hi - lo) if x.weights is None
         else x.weights[lo:hi].astype(np.float64))
    s = w.sum() if x.combiner == "mean" else np.sqrt((w * w).sum())
    return 0.0 if s == 0 else 1.0 / s


def _clip(e, max_norm):
    if max_norm < 0:
        return 1.0
    return max_norm / max(np.linalg.norm(e), max_norm)


def _rows(x):
    splits = (np.arange(len(x.ids) + 1) if x.splits is None else x.splits)
    return [(b, splits[b], splits[b + 1]) for b in range(len(splits) - 1)]


def _good(x, i):
    return 0 <= i < x.table.shape[0]


def oracle_lookup(x, max_norm):
    d = x.table.shape[1]
    table = x.table.astype(np.float64)
    if x.positions is not None:
        out = np.zeros((x.batch, x.seq_len, d))
    else:
        out = np.zeros((x.batch, d))
    for b, lo, hi in _rows(x):
        for j in range(lo, hi):
            if not _good(x, x.ids[j]):
                continue
            e = table[x.ids[j]]
            w = 1.0 if x.weights is None else float(x.weights[j])
            v = w * _clip(e, max_norm) * e
            if x.positions is not None:
                out[b, x.positions[j]] += v
            else:
                out[b] += v
        if x.positions is None:
            out[b] *= _scale(x, lo, hi)
    return out


def oracle_grad_sums(x, grad, max_norm):
    """{id: summed gradient} (clip backward applied)."""
    sums = {}
    for b, lo, hi in _rows(x):
        for j in range(lo, hi):
            i = int(x.ids[j])
            if not _good(x, i):
                continue
            w = 1.0 if x.weights is None else float(x.weights[j])
            if x.positions is not None:
                g = grad[b, x.positions[j]] * w
            else:
                g = grad[b] * w * _scale(x, lo, hi)
            sums[i] = sums.get(i, 0.0) + g.astype(np.float64)
    return {i: oracle_clip_grad(x.table[i], g, max_norm)
            for i, g in sums.items()}


def oracle_clip_grad(e, g, max_norm):
    """The gradient g of clip(e) taken back to e (stock's: the identity
    below the norm)."""
    e = e.astype(np.float64)
    n = np.linalg.norm(e)
    if max_norm < 0 or n < max_norm or n == 0:
        return g
    return (max_norm / n) * (g - e * (e @ g) / (n * n))


def oracle_weight_grads(x, grad, max_norm):
    """d/dw_j of sum(output * grad)."""
    out = np.zeros(len(x.ids))
    pooled = oracle_lookup(x, max_norm)
    for b, lo, hi in _rows(x):
        s = _scale(x, lo, hi)
        for j in range(lo, hi):
            if not _good(x, x.ids[j]):
                continue
            e = x.table[x.ids[j]].astype(np.float64)
            ce = _clip(e, max_norm) * e
            if x.positions is not None:
                out[j] = ce @ grad[b, x.positions[j]]
                continue
            eg, pg, w = ce @ grad[b], pooled[b] @ grad[b], x.weights[j]
            if x.combiner == "sum":
                out[j] = eg
            elif x.combiner == "mean":
                out[j] = (eg - pg) * s
            else:
                out[j] = (eg - pg * w * s) * s
    return out


def oracle_apply(name, hyper, value, slots, g):
    """The optimizer's rule on one row (float64)."""
    v = value.astype(np.float64)
    s = [a.astype(np.float64) for a in slots]
    lr = hyper.get("lr", 0.0)
    if name == "sgd":
        v = v - lr * g
    elif name == "adagrad":
        s[0] = s[0] + g * g
        v = v - lr * g / np.sqrt(s[0] + hyper["epsilon"])
    elif name == "adam":
        s[0] = s[0] + (g - s[0]) * (1 - hyper["beta1"])
        s[1] = s[1] + (g * g - s[1]) * (1 - hyper["beta2"])
        v = v - lr * s[0] / (np.sqrt(s[1]) + hyper["epsilon"])
    elif name == "ftrl":
        p = -hyper["lr_power"]
        acc, lin = s
        gs = g + 2 * hyper["l2_shrinkage"] * v
        na = acc + g * g
        lin = lin + gs - (na ** p - acc ** p) / lr * v
        quad = na ** p / lr + 2 * hyper["l2"]
        v = (np.clip(lin, -hyper["l1"], hyper["l1"]) - lin) / quad
        s = [na, lin]
    elif name == "adagrad_decay":
        # beta1: decay rate, beta2: floor, l1: period; the power is
        # element 0 of the second slot's row.
        acc, power = s
        if hyper["l1"] > power[0]:
            acc = np.maximum(acc * hyper["beta1"], hyper["beta2"])
            power = power.copy()
            power[0] += 1
        acc = acc + g * g
        v = v - lr * g / np.sqrt(acc)
        s = [acc, power]
    return v, s


# -- cases ------------------------------------------------------------------
class Failure(AssertionError):
    pass


def close(name, got, want, rtol=RTOL, atol=ATOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise Failure(f"{name}: shape {got.shape} != {want.shape}")
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        err = np.max(np.abs(got - want) / (atol + rtol * np.abs(want)))
        raise Failure(f"{name}: max scaled error {err:.3g}")


def equal(name, got, want):
    if got != want:
        raise Failure(f"{name}: {got} != {want}")


SPECS = [(50, 40, "sum"), (7, 33, "mean"), (300, 50, "sqrtn"),
         (1, 9, "mean"), (120, 0, "sum"), (64, 40, "sum")]
SEQ_SPECS = [(50, 20, "sum"), (9, 17, "sum"), (200, 0, "sum")]
DIMS = (16, 64, 3, 7, 200, 1024)
OPT_HYPER = {
    "sgd": {"lr": 0.1},
    "adagrad": {"lr": 0.1, "epsilon": 1e-7},
    "adam": {"lr": 0.01, "epsilon": 1e-7, "beta1": 0.9, "beta2": 0.999},
    "ftrl": {"lr": 0.1, "l1": 0.01, "l2": 0.02, "l2_shrinkage": 0.03,
             "lr_power": -0.5},
    # Slots start in [0.1, 1): period 0.5 decays about half the rows.
    "adagrad_decay": {"lr": 0.1, "beta1": 0.9, "beta2": 0.3, "l1": 0.5},
}


def _grads_like(rng, outs):
    return [rng.normal(size=o.shape).astype(np.float32) for o in outs]


def case_pooled(ctx, dim, weighted, max_norm, concat):
    rng = np.random.default_rng(dim * 7 + weighted * 3 + concat)
    specs = SPECS if not concat else [(v, 40, c) for v, _, c in SPECS]
    tables = make_tables(rng, specs, dim, weighted=weighted)
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm,
                        concat=concat)
    got = call.lookup()
    want = [oracle_lookup(x, max_norm) for x in tables]
    if concat:
        want = np.concatenate(want, axis=1)
    close("pooled output", np.asarray(got) if concat else
          np.concatenate([g.reshape(-1) for g in got]),
          want if concat else
          np.concatenate([w.reshape(-1) for w in want]))
    equal("error counts", call.error_counts(), (0, 0))
    # Backward on the same call.
    if concat:
        grad = rng.normal(size=want.shape).astype(np.float32)
        per_table = np.split(grad, len(tables), axis=1)
    else:
        per_table = _grads_like(rng, want)
        grad = per_table
    call.set_grads(grad)
    for t, (ids, g) in enumerate(call.backward()):
        want_sums = oracle_grad_sums(tables[t], per_table[t], max_norm)
        equal(f"table {t} distinct ids", list(ids), sorted(want_sums))
        if len(ids):
            close(f"table {t} gradient sums", g,
                  np.stack([want_sums[i] for i in ids]))
    if weighted and not concat:
        pooled = [o.astype(np.float32) for o in got]
        for t, dw in enumerate(call.weight_grads(pooled)):
            close(f"table {t} weight grads", dw,
                  oracle_weight_grads(tables[t], per_table[t], max_norm),
                  rtol=1e-4, atol=1e-4)


def case_sequence(ctx, dim, weighted, max_norm):
    rng = np.random.default_rng(100 + dim + weighted)
    tables = make_tables(rng, SEQ_SPECS, dim, weighted=weighted,
                         sequence=True)
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    got = call.lookup()
    for t, x in enumerate(tables):
        close(f"table {t} sequence", got[t], oracle_lookup(x, max_norm))
    grads = _grads_like(rng, got)
    call.set_grads(grads)
    for t, (ids, g) in enumerate(call.backward()):
        want = oracle_grad_sums(tables[t], grads[t], max_norm)
        equal(f"table {t} distinct ids", list(ids), sorted(want))
        if len(ids):
            close(f"table {t} gradient sums", g,
                  np.stack([want[i] for i in ids]))
    if weighted:
        for t, dw in enumerate(call.weight_grads()):
            close(f"table {t} weight grads", dw,
                  oracle_weight_grads(tables[t], grads[t], max_norm),
                  rtol=1e-4, atol=1e-4)
    equal("error counts", call.error_counts(), (0, 0))


def case_weight_grads_by_position(ctx, dim, sequence, max_norm):
    """ge_weight_grads reading a snapshot of the ids' rows (row j for id
    j, GE_ROWS_BY_POSITION) gives what it gives reading the table."""
    rng = np.random.default_rng(150 + dim + 2 * sequence)
    tables = make_tables(rng, SEQ_SPECS if sequence else SPECS, dim,
                         weighted=True, sequence=sequence)
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    got = call.lookup()
    grads = _grads_like(rng, got)
    call.set_grads(grads)
    pooled = None if sequence else [o.astype(np.float32) for o in got]
    for t, dw in enumerate(call.weight_grads(pooled, by_position=True)):
        close(f"table {t} weight grads by position", dw,
              oracle_weight_grads(tables[t], grads[t], max_norm),
              rtol=1e-4, atol=1e-4)
    # The descriptors read the tables again afterwards.
    for t, dw in enumerate(call.weight_grads(pooled)):
        close(f"table {t} weight grads", dw,
              oracle_weight_grads(tables[t], grads[t], max_norm),
              rtol=1e-4, atol=1e-4)
    equal("error counts", call.error_counts(), (0, 0))


def case_clip_grads(ctx, dim, in_place):
    """ge_clip_grads: per-id gradient rows through the clip's backward,
    rows above and below the norm, a zero row, and bad ids (counted,
    zeros)."""
    rng = np.random.default_rng(170 + dim + in_place)
    max_norm = 2.0
    tables = []
    ids, grads = [], []
    for vocab, n in ((40, 25), (5, 5), (300, 0), (64, 30)):
        table = rng.normal(size=(vocab, dim)).astype(np.float32)
        # Norms around the bound: some rows clip, some do not.
        table *= rng.uniform(0.2, 3.0, (vocab, 1)).astype(np.float32) \
            * max_norm / np.sqrt(dim)
        table[0] = 0.0
        tables.append(cc.TableBatch(table=table,
                                    ids=np.zeros(0, np.int64)))
        u = rng.permutation(vocab)[:n].astype(np.int64)
        ids.append(u)
        grads.append(rng.normal(size=(len(u), dim)).astype(np.float32))
    ids[0][:2] = [-3, 40]  # bad ids
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    got = call.clip_grads(ids, grads, in_place=in_place)
    for t, x in enumerate(tables):
        want = np.zeros((len(ids[t]), dim))
        for j, i in enumerate(ids[t]):
            if 0 <= i < x.table.shape[0]:
                want[j] = oracle_clip_grad(x.table[i], grads[t][j].astype(
                    np.float64), max_norm)
        close(f"table {t} clipped gradients", got[t], want)
    equal("error counts", call.error_counts(), (2, 0))


def case_optimizer(ctx, name, dim, max_norm):
    rng = np.random.default_rng(200 + dim + len(name))
    tables = make_tables(rng, SPECS, dim, weighted=True,
                         slots=cc.SLOTS[name])
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    outs = call.lookup()
    grads = _grads_like(rng, outs)
    call.set_grads(grads)
    hyper = OPT_HYPER[name]
    result = call.backward_apply(call.optimizer_config(name, **hyper))
    for t, (value, slots) in enumerate(result):
        x = tables[t]
        want_v = x.table.astype(np.float64).copy()
        want_s = [s.astype(np.float64).copy() for s in x.slots]
        for i, g in oracle_grad_sums(x, grads[t], max_norm).items():
            v, s = oracle_apply(name, hyper, x.table[i],
                                [a[i] for a in x.slots], g)
            want_v[i] = v
            for k, a in enumerate(s):
                want_s[k][i] = a
        close(f"table {t} values after {name}", value, want_v,
              rtol=1e-4, atol=1e-5)
        for k, (got_s, ws) in enumerate(zip(slots, want_s)):
            close(f"table {t} slot {k} after {name}", got_s, ws,
                  rtol=1e-4, atol=1e-5)


def case_sparse_apply_duplicates(ctx, dim):
    """splits = None: a plain sparse apply; duplicate indices summed."""
    rng = np.random.default_rng(300 + dim)
    vocab, n = 40, 90
    x = cc.TableBatch(
        table=rng.normal(size=(vocab, dim)).astype(np.float32),
        ids=rng.integers(0, vocab // 2, n).astype(np.int64),
        slots=[rng.uniform(0.1, 1.0, (vocab, dim)).astype(np.float32)])
    call = cc.GroupCall(ctx.core, ctx.mem, [x])
    grad = rng.normal(size=(n, dim)).astype(np.float32)
    call.set_grads([grad])
    hyper = OPT_HYPER["adagrad"]
    (value, (acc,)), = call.backward_apply(
        call.optimizer_config("adagrad", **hyper))
    want_v = x.table.astype(np.float64).copy()
    want_a = x.slots[0].astype(np.float64).copy()
    for i in np.unique(x.ids):
        g = grad[x.ids == i].astype(np.float64).sum(axis=0)
        v, (a,) = oracle_apply("adagrad", hyper, x.table[i],
                               [x.slots[0][i]], g)
        want_v[i], want_a[i] = v, a
    close("values", value, want_v, rtol=1e-4)
    close("accumulator", acc, want_a, rtol=1e-4)


def case_bad_ids(ctx, dim):
    """Out-of-range ids are counted (forward and backward), contribute
    nothing, and the other rows stay right."""
    rng = np.random.default_rng(400 + dim)
    tables = []
    bad_total = 0
    for vocab, batch, combiner in SPECS[:3]:
        splits, ids = ragged(rng, batch, vocab, bad=5)
        bad_total += int(((ids < 0) | (ids >= vocab)).sum())
        tables.append(cc.TableBatch(
            table=rng.normal(size=(vocab, dim)).astype(np.float32),
            ids=ids, splits=splits, combiner=combiner))
    call = cc.GroupCall(ctx.core, ctx.mem, tables)
    got = call.lookup()
    for t, x in enumerate(tables):
        close(f"table {t} output", got[t], oracle_lookup(x, -1))
    equal("bad ids counted by the lookup", call.error_counts(),
          (bad_total, 0))
    call.clear_errors()
    grads = _grads_like(rng, got)
    call.set_grads(grads)
    for t, (ids, g) in enumerate(call.backward()):
        want = oracle_grad_sums(tables[t], grads[t], -1)
        equal(f"table {t} distinct ids", list(ids), sorted(want))
    equal("bad ids counted by the backward", call.error_counts(),
          (bad_total, 0))


def case_bad_layout(ctx, dim):
    """row_splits that do not describe 0..nnz, and positions past T, are
    counted and never read through."""
    rng = np.random.default_rng(500 + dim)
    table = rng.normal(size=(20, dim)).astype(np.float32)
    ids = rng.integers(0, 20, 8).astype(np.int64)
    for splits in ([0, 3, 2, 8], [1, 3, 8], [0, 3, 9], [0, 3, 7]):
        x = cc.TableBatch(table=table, ids=ids,
                          splits=np.array(splits, np.int64))
        call = cc.GroupCall(ctx.core, ctx.mem, [x])
        call.lookup()
        if call.error_counts()[1] == 0:
            raise Failure(f"row_splits {splits}: no layout error counted")
    x = cc.TableBatch(table=table, ids=ids,
                      splits=np.array([0, 4, 8], np.int64),
                      positions=np.array([0, 1, 2, 5, 0, 1, -1, 3]),
                      seq_len=4)
    call = cc.GroupCall(ctx.core, ctx.mem, [x])
    out = call.lookup()
    equal("bad positions counted", call.error_counts(), (0, 2))
    good = x.positions.copy()
    keep = (good >= 0) & (good < 4)
    ref = cc.TableBatch(table=table, ids=ids[keep],
                        splits=np.array([0, 3, 6], np.int64),
                        positions=good[keep], seq_len=4)
    close("sequence with bad positions", out[0], oracle_lookup(ref, -1))


def case_check_ids(ctx, dim):
    """ge_check_ids (issue 35.3: one check of a step's ids for all its
    groups) counts what the lookups count, over every kind of table at
    once, and nothing on good ids."""
    rng = np.random.default_rng(700 + dim)

    def tables_of(bad):
        out, n_bad = [], 0
        for vocab, batch, combiner in SPECS:
            splits, ids = ragged(rng, batch, vocab, bad=bad)
            n_bad += int(((ids < 0) | (ids >= vocab)).sum())
            out.append(cc.TableBatch(
                table=rng.normal(size=(vocab, dim)).astype(np.float32),
                ids=ids, splits=splits, combiner=combiner))
        return out, n_bad

    good, _ = tables_of(0)
    equal("good ids", cc.GroupCall(ctx.core, ctx.mem, good).check_ids(),
          (0, 0))
    bad, n_bad = tables_of(4)
    if n_bad == 0:
        raise Failure("the case made no bad id")
    call = cc.GroupCall(ctx.core, ctx.mem, bad)
    equal("bad ids counted by the check", call.check_ids(), (n_bad, 0))
    call.clear_errors()
    call.lookup()
    equal("the lookup counts the same", call.error_counts(), (n_bad, 0))
    table = rng.normal(size=(20, dim)).astype(np.float32)
    ids = rng.integers(0, 20, 8).astype(np.int64)
    for splits in ([0, 3, 2, 8], [1, 3, 8], [0, 3, 9], [0, 3, 7]):
        x = cc.TableBatch(table=table, ids=ids,
                          splits=np.array(splits, np.int64))
        got = cc.GroupCall(ctx.core, ctx.mem, good[:2] + [x]).check_ids()
        if got[0] != 0 or got[1] == 0:
            raise Failure(f"row_splits {splits}: counted {got}")
    x = cc.TableBatch(table=table, ids=ids,
                      splits=np.array([0, 4, 8], np.int64),
                      positions=np.array([0, 1, 2, 5, 0, 1, -1, 3]),
                      seq_len=4)
    equal("positions past T", cc.GroupCall(ctx.core, ctx.mem, [x])
          .check_ids(), (0, 2))


def case_arguments(ctx):
    """Bad host arguments are refused before anything is enqueued."""
    rng = np.random.default_rng(600)
    tables = make_tables(rng, SPECS[:2], 8)
    call = cc.GroupCall(ctx.core, ctx.mem, tables)
    lib = ctx.core.lib
    m = ctx.mem
    cases = {
        "scratch too small": lambda: lib.ge_lookup_pooled(
            call.descs, 2, 8, -1.0, m.ptr(call.lookup_scratch), 1,
            m.ptr(call.errors), m.stream),
        "dim too large": lambda: lib.ge_lookup_pooled(
            call.descs, 2, 2048, -1.0, m.ptr(call.lookup_scratch),
            m.count(call.lookup_scratch), m.ptr(call.errors), m.stream),
        "no tables": lambda: lib.ge_lookup_pooled(
            call.descs, 0, 8, -1.0, m.ptr(call.lookup_scratch),
            m.count(call.lookup_scratch), m.ptr(call.errors), m.stream),
        "no error counters": lambda: lib.ge_lookup_pooled(
            call.descs, 2, 8, -1.0, m.ptr(call.lookup_scratch),
            m.count(call.lookup_scratch), None, m.stream),
    }
    want = {"scratch too small": -2, "dim too large": -3,
            "no tables": -1, "no error counters": -1}
    for name, fn in cases.items():
        equal(name, fn(), want[name])
    bad = cc.GeTable.from_buffer_copy(call.descs[0])
    bad.flags = cc.ROWS_BY_POSITION  # only ge_weight_grads reads it
    one = (cc.GeTable * 1)(bad)
    equal("rows by position in a lookup", lib.ge_lookup_pooled(
        one, 1, 8, -1.0, m.ptr(call.lookup_scratch),
        m.count(call.lookup_scratch), m.ptr(call.errors), m.stream), -1)
    bad = cc.GeTable.from_buffer_copy(call.descs[0])
    bad.grad, bad.grad_stride = bad.out, bad.out_stride
    one = (cc.GeTable * 1)(bad)
    equal("clip grads with row_splits", lib.ge_clip_grads(
        one, 1, 8, 0.5, m.ptr(call.lookup_scratch),
        m.count(call.lookup_scratch), m.ptr(call.errors), m.stream), -1)
    bad = cc.GeTable.from_buffer_copy(call.descs[0])
    bad.combiner = 7
    one = (cc.GeTable * 1)(bad)
    equal("bad combiner", lib.ge_lookup_pooled(
        one, 1, 8, -1.0, m.ptr(call.lookup_scratch),
        m.count(call.lookup_scratch), m.ptr(call.errors), m.stream), -1)
    bad = cc.GeTable.from_buffer_copy(call.descs[0])
    bad.batch = bad.batch + 1  # splits then promise more rows than given
    bad.splits = None
    one = (cc.GeTable * 1)(bad)
    equal("splits = NULL with batch != nnz", lib.ge_lookup_pooled(
        one, 1, 8, -1.0, m.ptr(call.lookup_scratch),
        m.count(call.lookup_scratch), m.ptr(call.errors), m.stream), -1)


def case_many_rows(ctx, dim):
    """Enough rows for thousands of warps and many duplicate ids."""
    rng = np.random.default_rng(700 + dim)
    specs = [(5000, 3000, "sum"), (100, 3000, "mean"),
             (20000, 3000, "sqrtn"), (3, 3000, "sum")]
    tables = make_tables(rng, specs, dim, weighted=True)
    call = cc.GroupCall(ctx.core, ctx.mem, tables, concat=True)
    got = call.lookup()
    close("concat output", got,
          np.concatenate([oracle_lookup(x, -1) for x in tables], axis=1))
    grad = rng.normal(size=got.shape).astype(np.float32)
    call.set_grads(grad)
    per_table = np.split(grad, len(tables), axis=1)
    for t, (ids, g) in enumerate(call.backward()):
        want = oracle_grad_sums(tables[t], per_table[t], -1)
        equal(f"table {t} distinct ids", list(ids), sorted(want))
        # Thousands of float32 adds per id (values ~1e2): ~1e-4 abs off.
        close(f"table {t} gradient sums", g,
              np.stack([want[i] for i in ids]), rtol=1e-4, atol=1e-2)


def case_long_runs(ctx, dim, max_norm):
    """Ids with more occurrences than one group sums alone (the CUDA
    core's long runs: > 32, cut into chunks of 32), around the cut:
    31, 32, 33, 64, 65 occurrences, and hundreds."""
    rng = np.random.default_rng(800 + dim)
    counts = {3: 31, 4: 32, 5: 33, 6: 64, 7: 65, 8: 1}
    ids = np.concatenate([np.full(c, i) for i, c in counts.items()])
    ids = rng.permutation(ids).astype(np.int64)
    lengths = rng.integers(0, 4, size=200)
    lengths[-1] += len(ids) - lengths.sum() if lengths.sum() < len(ids) \
        else 0
    splits = np.minimum(np.concatenate([[0], np.cumsum(lengths)]),
                        len(ids)).astype(np.int64)
    hot_splits, hot_ids = ragged(rng, 300, 2, max_len=6)
    tables = [
        cc.TableBatch(table=rng.normal(size=(10, dim)).astype(np.float32),
                      ids=ids, splits=splits, combiner="mean",
                      weights=rng.uniform(0.5, 2, len(ids)).astype(
                          np.float32)),
        cc.TableBatch(table=rng.normal(size=(2, dim)).astype(np.float32),
                      ids=hot_ids, splits=hot_splits, combiner="sqrtn"),
    ]
    for x in tables:
        x.slots = [rng.uniform(0.1, 1, x.table.shape).astype(np.float32)]
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    grads = _grads_like(rng, call.lookup())
    call.set_grads(grads)
    for t, (got_ids, g) in enumerate(call.backward()):
        want = oracle_grad_sums(tables[t], grads[t], max_norm)
        equal(f"table {t} distinct ids", list(got_ids), sorted(want))
        close(f"table {t} gradient sums", g,
              np.stack([want[i] for i in got_ids]), rtol=1e-4, atol=1e-4)
    hyper = OPT_HYPER["adagrad"]
    result = call.backward_apply(call.optimizer_config("adagrad", **hyper))
    for t, (value, (acc,)) in enumerate(result):
        x = tables[t]
        want_v = x.table.astype(np.float64).copy()
        want_a = x.slots[0].astype(np.float64).copy()
        for i, g in oracle_grad_sums(x, grads[t], max_norm).items():
            v, (a,) = oracle_apply("adagrad", hyper, x.table[i],
                                   [x.slots[0][i]], g)
            want_v[i], want_a[i] = v, a
        close(f"table {t} values", value, want_v, rtol=1e-4, atol=1e-5)
        close(f"table {t} accumulator", acc, want_a, rtol=1e-4, atol=1e-4)


def case_backward_padded(ctx, dim, max_norm):
    """ge_backward_padded: each table's distinct ids and sums (as
    ge_backward's, oracle) at the start of the block of its occurrences,
    the block's other rows untouched (the caller's fill), an empty table's
    block empty; tables with long runs and with every id distinct."""
    rng = np.random.default_rng(900 + dim)
    tables = make_tables(rng, SPECS, dim, weighted=True)
    counts = {3: 40, 4: 1, 5: 33}
    ids = rng.permutation(np.concatenate(
        [np.full(c, i) for i, c in counts.items()])).astype(np.int64)
    splits = np.array([0, 30, 30, len(ids)], np.int64)
    tables.append(cc.TableBatch(
        table=rng.normal(size=(9, dim)).astype(np.float32), ids=ids,
        splits=splits, combiner="mean"))
    tables.append(cc.TableBatch(
        table=rng.normal(size=(50, dim)).astype(np.float32),
        ids=rng.permutation(50)[:20].astype(np.int64),
        splits=np.arange(21, dtype=np.int64), combiner="sum"))
    tables.append(cc.TableBatch(
        table=rng.normal(size=(4, dim)).astype(np.float32),
        ids=np.zeros(0, np.int64), splits=np.zeros(3, np.int64),
        combiner="sum"))
    call = cc.GroupCall(ctx.core, ctx.mem, tables, max_norm=max_norm)
    grads = _grads_like(rng, call.lookup())
    call.set_grads(grads)
    for t, (got_ids, g, u) in enumerate(call.backward_padded()):
        want = oracle_grad_sums(tables[t], grads[t], max_norm)
        n = len(tables[t].ids)
        equal(f"table {t} block rows", (len(got_ids), len(g)), (n, n))
        equal(f"table {t} distinct id count", u, len(want))
        equal(f"table {t} distinct ids", list(got_ids[:u]), sorted(want))
        if u:
            close(f"table {t} gradient sums", g[:u],
                  np.stack([want[i] for i in got_ids[:u]]), rtol=1e-4,
                  atol=1e-4)
        equal(f"table {t} fill ids kept", list(got_ids[u:]), [-7] * (n - u))
        equal(f"table {t} fill grads kept", bool(np.all(g[u:] == 123.0)),
              True)
    equal("error counts", call.error_counts(), (0, 0))


def all_cases(quick=False):
    """(name, fn(ctx)) of every case; `quick`: a small subset (the
    sanitizer runs)."""
    dims = (16, 7) if quick else DIMS
    cases = []
    for dim in dims:
        for weighted in (False, True):
            for max_norm in ((-1.0, 0.8) if not quick else (0.8,)):
                for concat in (False, True):
                    cases.append((
                        f"pooled_d{dim}_w{int(weighted)}_mn{max_norm}"
                        f"_{'concat' if concat else 'split'}",
                        lambda c, d=dim, w=weighted, m=max_norm, k=concat:
                        case_pooled(c, d, w, m, k)))
                cases.append((
                    f"sequence_d{dim}_w{int(weighted)}_mn{max_norm}",
                    lambda c, d=dim, w=weighted, m=max_norm:
                    case_sequence(c, d, w, m)))
        for name in OPT_HYPER:
            cases.append((f"optimizer_{name}_d{dim}",
                          lambda c, n=name, d=dim:
                          case_optimizer(c, n, d, -1.0)))
        cases.append((f"optimizer_adagrad_maxnorm_d{dim}",
                      lambda c, d=dim: case_optimizer(c, "adagrad", d, 0.8)))
        cases.append((f"sparse_apply_duplicates_d{dim}",
                      lambda c, d=dim: case_sparse_apply_duplicates(c, d)))
        cases.append((f"bad_ids_d{dim}", lambda c, d=dim: case_bad_ids(c, d)))
        for sequence in (False, True):
            cases.append((f"weight_grads_by_position_d{dim}"
                          f"_{'sequence' if sequence else 'pooled'}",
                          lambda c, d=dim, q=sequence:
                          case_weight_grads_by_position(c, d, q, 0.8)))
        for in_place in (False, True):
            cases.append((f"clip_grads_d{dim}"
                          f"_{'in_place' if in_place else 'copy'}",
                          lambda c, d=dim, p=in_place:
                          case_clip_grads(c, d, p)))
        cases.append((f"bad_layout_d{dim}",
                      lambda c, d=dim: case_bad_layout(c, d)))
        cases.append((f"check_ids_d{dim}",
                      lambda c, d=dim: case_check_ids(c, d)))
        for max_norm in (-1.0, 0.8):
            cases.append((f"backward_padded_d{dim}_mn{max_norm}",
                          lambda c, d=dim, m=max_norm:
                          case_backward_padded(c, d, m)))
    for dim in ((16, 7) if quick else (16, 64, 3, 200)):
        for max_norm in (-1.0, 0.8):
            cases.append((f"long_runs_d{dim}_mn{max_norm}",
                          lambda c, d=dim, m=max_norm:
                          case_long_runs(c, d, m)))
    cases.append(("arguments", case_arguments))
    if not quick:
        for dim in (16, 64):
            cases.append((f"many_rows_d{dim}",
                          lambda c, d=dim: case_many_rows(c, d)))
    return cases


class Context:
    """A core and the memory its pointers live in."""

    def __init__(self, core, memory):
        self.core, self.mem = core, memory


def make_memory(name):
    return {"host": cc.HostMemory, "cupy": cc.CupyMemory,
            "torch": cc.TorchMemory}[name]()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--core", required=True)
    parser.add_argument("--memory", default="cupy",
                        choices=("host", "cupy", "torch"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    ctx = Context(cc.Core(args.core), make_memory(args.memory))
    results = []
    for name, fn in all_cases(args.quick):
        start = time.time()
        try:
            fn(ctx)
            status, why = "pass", ""
        except Failure as e:
            status, why = "FAIL", str(e)
        except Exception as e:  # a crash of one case is reported, not fatal
            status, why = "ERROR", f"{type(e).__name__}: {e}"
        results.append({"case": name, "status": status, "detail": why,
                        "seconds": round(time.time() - start, 3)})
        print(f"{status:5s} {name} {why}", flush=True)
    failed = [r for r in results if r["status"] != "pass"]
    print(f"{len(results) - len(failed)}/{len(results)} parity cases "
          f"passed ({ctx.core.backend} core, {ctx.mem.name} memory)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"core": args.core, "backend": ctx.core.backend,
                       "memory": ctx.mem.name, "quick": args.quick,
                       "passed": len(results) - len(failed),
                       "total": len(results), "cases": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
