"""Where the criteo-like fused step spends its time, kernel by kernel.

Run under Nsight Compute on the GPU machine (check.sh does, when `ncu` is
there), which times every kernel of the profiled range:

    ncu --profile-from-start off --metrics gpu__time_duration.sum,\\
        dram__bytes.sum python benchmarks/gpu/step_phases.py CORE [DIMS]

The workload is `bench.py`'s (26 tables capped at 10M rows, batch 65536,
sum pooling, Adagrad); per dim (default 16,64) the profiled range is one
forward (`ge_lookup_pooled`) and one fused backward-apply
(`ge_backward_apply`), after one warm-up step. Without a GPU it runs the
host stand-in on CPU torch (a dry run of the script itself).
"""

import sys

import numpy as np

import bench
import criteo_like
from bindings import cc


def profile_dim(torch, core, dim, id_batch, on, cap=10_000_000):
    """One warm-up step, then one forward and one backward-apply inside
    the profiler's range."""
    vocabs = criteo_like.vocab_sizes(cap)
    row_base = np.concatenate([[0], np.cumsum(vocabs)]).astype(np.int64)
    k = len(vocabs)
    batch_size = len(id_batch[0][1])
    batch = bench.Batch(torch, id_batch, row_base, on)
    tables = [torch.rand((v, dim), device=on) for v in vocabs]
    accums = [torch.zeros_like(t) for t in tables]
    out = torch.empty((batch_size, k * dim), device=on)
    grad = torch.randn((batch_size, k * dim), device=on)
    descs = bench.describe(torch, tables, accums, batch, out, grad, dim)
    errors = torch.zeros(2, dtype=torch.int64, device=on)
    lookup_scratch = torch.empty(core.lib.ge_lookup_scratch_bytes(k),
                                 dtype=torch.uint8, device=on)
    scratch = torch.empty(core.lib.ge_backward_scratch_bytes(descs, k, dim),
                          dtype=torch.uint8, device=on)
    adagrad = cc.GeOptimizerConfig()
    adagrad.kind = cc.OPTIMIZERS["adagrad"]
    adagrad.lr, adagrad.epsilon = bench.LR, bench.EPS
    gpu = on == "cuda"
    stream = torch.cuda.current_stream().cuda_stream if gpu else None

    def step():
        bench.fused_step(core, descs, k, dim, adagrad, lookup_scratch,
                         scratch, errors, stream)

    step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    print(f"dim {dim}: {batch.nnz} ids, errors {errors.tolist()}",
          flush=True)


def main():
    import torch
    core = cc.Core(sys.argv[1])
    dims = [int(d) for d in (sys.argv[2] if len(sys.argv) > 2
                             else "16,64").split(",")]
    on = "cuda" if torch.cuda.is_available() else "cpu"
    cap, batch = (10_000_000, 65536) if on == "cuda" else (1000, 256)
    id_batch = criteo_like.make_id_batches(cap, batch, 1)[0]
    for dim in dims:
        profile_dim(torch, core, dim, id_batch, on, cap)
        if on == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
