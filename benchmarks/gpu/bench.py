"""GPU benchmark of the CUDA core on the criteo-like workload (torch anchors).

Runs on the GPU machine (CUDA, torch; no TensorFlow): the 26 Criteo
tables capped at 10M rows, batch 65536, ids from `criteo_like` (13 one-hot
features, 13 multi-hot with 1-10 ids, Zipf), every table pooled with sum.
Per dim it measures, on one stream with CUDA events (median of the timed
steps after warm-up):

* `ge_forward`: the fused lookup of all 26 tables, ONE launch, into one
  `[B, 26 * dim]` output;
* `ge_step`: forward + backward + Adagrad (the core's fused backward-apply:
  one sort for the group, sums in registers, update in place);
* `ge_backward_slices`: the backward alone, to IndexedSlices;
* `torch_per_table`: 26 x `F.embedding_bag(sparse=True)`, `torch.cat`,
  backward, `torch.optim.Adagrad` (sparse);
* `torch_concat`: ONE `embedding_bag` over the concatenated tables (ids
  shifted by each table's first row; the TorchRec / SOK layout), backward,
  sparse Adagrad;
* `torch_competent`: the step a torch engineer writes by hand (issue
  35.4's anchor): one `embedding_bag` over the concatenated tables, the
  backward by `torch.unique` + `index_add_`, Adagrad on the distinct rows
  only;
* `ge_step_floor_fraction`: the step's memory-traffic floor (ids, each
  id's row, outputs, their gradients, each distinct row's value and
  accumulator read and written, at the copy's bandwidth) over its time;
* `copy`: a 1 GiB device-to-device copy (bytes read + written per second).

Before timing it checks the core against torch on the same tables: the
forward equals the per-table `embedding_bag`, and one fused step leaves
the rows that Adagrad (Keras' rule) gives from torch autograd's gradient.

Writes JSON (`--json`): ms per step, GB/s, the ratios, the checks.
"""

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_REPO, "benchmarks"))

import criteo_like  # noqa: E402
from bindings import cc  # noqa: E402

LR = 0.01
EPS = 1e-10


class Device:
    """Where the benchmark runs: "cuda" (the CUDA core, events on the
    current stream) or "cpu" (the host stand-in at tiny sizes: how CPU
    CI checks this script before it ever reaches a GPU)."""

    def __init__(self, torch, name):
        self.torch, self.name = torch, name
        self.cuda = name == "cuda"
        self.stream = (torch.cuda.current_stream().cuda_stream
                       if self.cuda else None)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def empty_cache(self):
        if self.cuda:
            self.torch.cuda.empty_cache()

    def timed(self, fn, warmup, steps):
        """(median, min) ms of `fn(i)` over `steps` runs."""
        for _ in range(warmup):
            fn(0)
        self.sync()
        times = []
        for i in range(steps):
            if self.cuda:
                start = self.torch.cuda.Event(enable_timing=True)
                end = self.torch.cuda.Event(enable_timing=True)
                start.record()
                fn(i + 1)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(i + 1)
                times.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(times)), float(np.min(times))


class Batch:
    """One batch on the device: per table ids / splits, and the
    concatenated example-major layout for `torch_concat`."""

    def __init__(self, torch, features, row_base, dev):
        self.ids, self.splits, self.offsets = [], [], []
        for ids, lengths, _ in features:
            splits = np.concatenate([[0], np.cumsum(lengths)])
            self.ids.append(torch.from_numpy(ids).to(dev))
            self.splits.append(torch.from_numpy(splits).to(dev))
            self.offsets.append(torch.from_numpy(splits[:-1]).to(dev))
        self.nnz = sum(len(f[0]) for f in features)
        # Example-major bags (b, t) so that the output reshapes to
        # [B, 26 * dim] without a copy.
        batch = len(features[0][1])
        k = len(features)
        ids = np.concatenate([f[0] + row_base[t]
                              for t, f in enumerate(features)])
        bag = np.concatenate([
            np.repeat(np.arange(batch, dtype=np.int64) * k + t, f[1])
            for t, f in enumerate(features)])
        order = np.argsort(bag, kind="stable")
        cat_ids = ids[order].astype(np.int64)
        counts = np.bincount(bag, minlength=batch * k)
        cat_offsets = np.concatenate([[0], np.cumsum(counts)])
        self.cat_ids = torch.from_numpy(cat_ids).to(dev)
        self.cat_offsets = torch.from_numpy(cat_offsets[:-1]).to(dev)
        # The bag of each concatenated id (what a torch backward gathers
        # its gradient row by), and the distinct rows of the step.
        self.cat_bags = torch.from_numpy(bag[order]).to(dev)
        self.distinct = int(np.unique(cat_ids).size)


def describe(torch, tables, accums, batch, out, grad, dim):
    """GeTable descriptors of the 26 tables for one batch (concat output,
    concat gradient)."""
    k = len(tables)
    descs = (cc.GeTable * k)()
    for t in range(k):
        d = descs[t]
        d.table = tables[t].data_ptr()
        d.vocab = tables[t].shape[0]
        d.ids = batch.ids[t].data_ptr()
        d.splits = batch.splits[t].data_ptr()
        d.nnz = batch.ids[t].numel()
        d.batch = batch.splits[t].numel() - 1
        d.combiner = cc.COMBINERS["sum"]
        d.out = out.data_ptr() + 4 * t * dim
        d.out_stride = k * dim
        d.grad = grad.data_ptr() + 4 * t * dim
        d.grad_stride = k * dim
        d.slot0 = accums[t].data_ptr() if accums is not None else None
    return descs


def copy_bandwidth(dev, steps):
    """GB/s of a 1 GiB device-to-device copy, bytes read + written (as
    CUDA's bandwidthTest counts them)."""
    src = dev.torch.empty(1 << 28, device=dev.name)
    dst = dev.torch.empty_like(src)
    copy_ms = dev.timed(lambda i: dst.copy_(src), 3, steps)[0]
    return 2 * src.numel() * 4 / copy_ms / 1e6


def forward_bandwidth(result, nnz, dim, batch_size, k, copy_gbs):
    """The forward's GB/s (rows alone; all it reads and writes) and its
    ratio to the copy's."""
    fwd_ms = result["ge_forward_ms"][0]
    row_bytes = nnz * dim * 4
    all_bytes = row_bytes + nnz * 8 + (batch_size + 1) * 8 * k + \
        batch_size * k * dim * 4
    result.update({
        "copy_gbs": copy_gbs,
        "ge_forward_row_gbs": row_bytes / fwd_ms / 1e6,
        "ge_forward_all_gbs": all_bytes / fwd_ms / 1e6,
        "forward_vs_copy": all_bytes / fwd_ms / 1e6 / copy_gbs,
    })


def fused_step(core, descs, k, dim, optimizer, lookup_scratch, scratch,
               errors, stream):
    """The fused training step of `k` described tables (`describe`): one
    pooled lookup (`ge_lookup_pooled`) and one fused backward-apply with
    `optimizer` (a `GeOptimizerConfig`). The scratches and the error
    counters are device tensors; `stream` a CUDA stream handle (None on
    the host stand-in)."""
    core.check("lookup", core.lib.ge_lookup_pooled(
        descs, k, dim, -1.0, lookup_scratch.data_ptr(),
        lookup_scratch.numel(), errors.data_ptr(), stream))
    core.check("backward_apply", core.lib.ge_backward_apply(
        descs, k, dim, -1.0, ctypes.byref(optimizer), scratch.data_ptr(),
        scratch.numel(), errors.data_ptr(), stream))


def run_dim(dev, core, dim, batch_size, cap, steps, id_batches,
            forward_only=False):
    torch = dev.torch
    import torch.nn.functional as F
    vocabs = criteo_like.vocab_sizes(cap)
    row_base = np.concatenate([[0], np.cumsum(vocabs)]).astype(np.int64)
    k = len(vocabs)
    stream = dev.stream
    on = dev.name
    gen = torch.Generator(device=on).manual_seed(dim)
    base = [(torch.rand((v, dim), device=on, generator=gen) - 0.5) * 0.1
            for v in vocabs]
    batches = [Batch(torch, f, row_base, on) for f in id_batches]
    grad = torch.randn((batch_size, k * dim), device=on, generator=gen)
    out = torch.empty((batch_size, k * dim), device=on)
    errors = torch.zeros(2, dtype=torch.int64, device=on)
    result = {"dim": dim, "batch": batch_size, "tables": k,
              "rows": int(row_base[-1]), "nnz_per_step": batches[0].nnz}

    # -- ours ---------------------------------------------------------------
    ours = [b.clone() for b in base]
    accums = [torch.zeros_like(b) for b in base]
    descs = [describe(torch, ours, accums, b, out, grad, dim)
             for b in batches]
    lookup_scratch = torch.empty(core.lib.ge_lookup_scratch_bytes(k),
                                 dtype=torch.uint8, device=on)
    bwd_bytes = max(core.lib.ge_backward_scratch_bytes(d, k, dim)
                    for d in descs)
    scratch = torch.empty(bwd_bytes, dtype=torch.uint8, device=on)
    adagrad = cc.GeOptimizerConfig()
    adagrad.kind = cc.OPTIMIZERS["adagrad"]
    adagrad.lr, adagrad.epsilon = LR, EPS
    total = max(b.nnz for b in batches)
    uids = torch.empty(total, dtype=torch.int64, device=on)
    ugrads = torch.empty((total, dim), device=on)
    offsets = torch.empty(k + 1, dtype=torch.int64, device=on)

    def forward(i):
        core.check("lookup", core.lib.ge_lookup_pooled(
            descs[i % 2], k, dim, -1.0, lookup_scratch.data_ptr(),
            lookup_scratch.numel(), errors.data_ptr(), stream))

    def step(i):
        fused_step(core, descs[i % 2], k, dim, adagrad, lookup_scratch,
                   scratch, errors, stream)

    def backward_slices(i):
        core.check("backward", core.lib.ge_backward(
            descs[i % 2], k, dim, -1.0, scratch.data_ptr(), scratch.numel(),
            uids.data_ptr(), ugrads.data_ptr(), offsets.data_ptr(),
            errors.data_ptr(), stream))

    # Checks against torch on batch 0, before anything is timed.
    forward(0)
    dev.sync()
    per_table = [torch.nn.Parameter(b) for b in base]
    want = torch.cat([
        F.embedding_bag(batches[0].ids[t], per_table[t],
                        batches[0].offsets[t], mode="sum")
        for t in range(k)], dim=1)
    result["check_forward_max_abs_diff"] = float((out - want).abs().max())
    if forward_only:
        result["ge_forward_ms"] = dev.timed(forward, 3, steps)
        result["check_error_counts"] = [int(v) for v in errors.cpu()]
        forward_bandwidth(result, batches[0].nnz, dim, batch_size, k,
                          copy_bandwidth(dev, steps))
        return result
    opt = torch.optim.Adagrad(per_table, lr=LR, eps=EPS, foreach=False)

    def torch_step(i, update=True):
        b = batches[i % 2]
        opt.zero_grad(set_to_none=True)
        y = torch.cat([
            F.embedding_bag(b.ids[t], per_table[t], b.offsets[t],
                            mode="sum", sparse=True)
            for t in range(k)], dim=1)
        y.backward(grad)
        if update:
            opt.step()

    # The backward (distinct ids, summed gradients) against torch
    # autograd's gradient of the same step, then one fused step against
    # Adagrad (our rule: epsilon inside the root) applied to that
    # gradient. The step is compared where |g| > 1e-3 only: near g = 0,
    # g / sqrt(g^2 + eps) turns float32 summation order into big changes.
    torch_step(0, update=False)
    backward_slices(0)
    dev.sync()
    off = offsets.cpu().numpy()
    worst_grad = worst = 0.0
    for t in range(k):
        g = per_table[t].grad.coalesce()
        rows, g = g.indices()[0], g.values()
        if not torch.equal(uids[off[t]:off[t + 1]], rows):
            worst_grad = float("inf")
            continue
        scale = float(g.abs().max()) + 1e-6
        worst_grad = max(worst_grad, float(
            (ugrads[off[t]:off[t + 1]] - g).abs().max()) / scale)
    step(0)
    dev.sync()
    ref = []  # per table: rows and their gradient, for the anchor
    for t in range(k):
        g = per_table[t].grad.coalesce()
        rows, g = g.indices()[0][:4096], g.values()[:4096]
        ref.append((rows, g))
        want = base[t][rows] - LR * g / torch.sqrt(g * g + EPS)
        diff = ((ours[t][rows] - want).abs() / (want.abs() + 1e-3))
        worst = max(worst, float(diff[g.abs() > 1e-3].max()))
    result["check_backward_max_scaled_diff"] = worst_grad
    result["check_adagrad_step_max_rel_diff"] = worst
    result["check_error_counts"] = [int(v) for v in errors.cpu()]

    result["ge_forward_ms"] = dev.timed(forward, 3, steps)
    result["ge_step_ms"] = dev.timed(step, 3, steps)
    result["ge_backward_slices_ms"] = dev.timed(backward_slices, 3, steps)
    result["torch_per_table_ms"] = dev.timed(torch_step, 3, steps)
    # Freed for the next variant (rebound, not deleted: closures use them).
    ours = accums = opt = per_table = uids = ugrads = scratch = None
    dev.empty_cache()

    # -- torch, one concatenated table ----------------------------------------
    cat = torch.nn.Parameter(torch.cat(base, dim=0))
    base = None
    dev.empty_cache()
    cat_opt = torch.optim.Adagrad([cat], lr=LR, eps=EPS, foreach=False)

    def torch_concat_step(i):
        b = batches[i % 2]
        cat_opt.zero_grad(set_to_none=True)
        y = F.embedding_bag(b.cat_ids, cat, b.cat_offsets, mode="sum",
                            sparse=True).reshape(batch_size, k * dim)
        y.backward(grad)
        cat_opt.step()

    result["torch_concat_ms"] = dev.timed(torch_concat_step, 3, steps)
    cat_opt = None

    # -- torch, written by hand (issue 35.4's anchor) ------------------------
    # What a torch engineer writes without autograd: one embedding_bag over
    # the concatenated tables; backward: each id's gradient row gathered by
    # its bag, `torch.unique` + `index_add_` to sum them per distinct row;
    # Adagrad (our rule) on the distinct rows only.
    table = cat.detach()
    cat = None
    accum = torch.zeros_like(table)
    flat_grad = grad.reshape(batch_size * k, dim)

    def torch_competent_step(i):
        b = batches[i % 2]
        F.embedding_bag(b.cat_ids, table, b.cat_offsets, mode="sum")
        rows, inverse = torch.unique(b.cat_ids, return_inverse=True)
        g = torch.zeros((rows.numel(), dim), device=on).index_add_(
            0, inverse, flat_grad.index_select(0, b.cat_bags))
        a = accum.index_select(0, rows).addcmul_(g, g)
        accum.index_copy_(0, rows, a)
        table.index_copy_(0, rows, table.index_select(0, rows).addcdiv_(
            g, torch.sqrt(a + EPS), value=-LR))

    # Checked first: its first step (fresh accumulators) equals the fused
    # step's rule applied to autograd's gradient of batch 0 (`ref`, kept
    # from above), from the rows the table holds now.
    starts = [table[int(row_base[t]) + rows].clone()
              for t, (rows, _) in enumerate(ref)]
    torch_competent_step(0)
    dev.sync()
    worst = 0.0
    for t, ((rows, g), start) in enumerate(zip(ref, starts)):
        want = start - LR * g / torch.sqrt(g * g + EPS)
        got = table[int(row_base[t]) + rows]
        diff = (got - want).abs() / (want.abs() + 1e-3)
        worst = max(worst, float(diff[g.abs() > 1e-3].max()))
    result["check_torch_competent_step_max_rel_diff"] = worst
    result["torch_competent_ms"] = dev.timed(torch_competent_step, 3, steps)
    table = accum = None
    dev.empty_cache()

    # -- bandwidth -----------------------------------------------------------
    forward_bandwidth(result, batches[0].nnz, dim, batch_size, k,
                      copy_bandwidth(dev, steps))
    step_floor(result, batches[0], dim, batch_size, k)
    result.update({
        "step_vs_torch_per_table":
            result["torch_per_table_ms"][0] / result["ge_step_ms"][0],
        "step_vs_torch_concat":
            result["torch_concat_ms"][0] / result["ge_step_ms"][0],
        "step_vs_torch_competent":
            result["torch_competent_ms"][0] / result["ge_step_ms"][0],
    })
    return result


def step_floor(result, batch, dim, batch_size, k):
    """The training step's memory-traffic floor (issue 35.4) and the
    fraction of it the fused step reaches: the ids, each id's row read,
    the outputs written, their gradients read, and each distinct row's
    value and accumulator read and written, at the copy's bandwidth."""
    floor_bytes = (batch.nnz * 8 + batch.nnz * dim * 4
                   + 2 * batch_size * k * dim * 4
                   + 4 * batch.distinct * dim * 4)
    floor_ms = floor_bytes / result["copy_gbs"] / 1e6
    result.update({
        "distinct_rows_per_step": batch.distinct,
        "step_floor_bytes": floor_bytes,
        "step_floor_ms": floor_ms,
        "ge_step_gbs": floor_bytes / result["ge_step_ms"][0] / 1e6,
        "ge_step_floor_fraction": floor_ms / result["ge_step_ms"][0],
    })


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--core", required=True)
    parser.add_argument("--dims", default="16,64")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--cap", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward alone (kernel tuning)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torch
    dev = Device(torch, args.device)
    core = cc.Core(args.core)
    start = time.time()
    id_batches = criteo_like.make_id_batches(args.cap, args.batch, 2)
    print(f"ids generated in {time.time() - start:.1f} s", flush=True)
    results = {"device": (torch.cuda.get_device_name() if dev.cuda
                          else "cpu (host stand-in)"),
               "torch": torch.__version__, "core": args.core,
               "backend": core.backend, "runs": []}
    for dim in (int(d) for d in args.dims.split(",")):
        r = run_dim(dev, core, dim, args.batch, args.cap, args.steps,
                    id_batches, args.forward_only)
        results["runs"].append(r)
        print(json.dumps(r), flush=True)
        dev.empty_cache()
    # The checks against torch gate the exit status (the timings do not).
    failed = [f"dim {r['dim']}" for r in results["runs"]
              if r["check_forward_max_abs_diff"] > 1e-4
              or r.get("check_adagrad_step_max_rel_diff", 0) > 1e-4
              or r.get("check_backward_max_scaled_diff", 0) > 1e-4
              or r.get("check_torch_competent_step_max_rel_diff", 0) > 1e-4
              or r["check_error_counts"] != [0, 0]]
    results["checks_passed"] = not failed
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if failed:
        print(f"checks against torch FAILED: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
