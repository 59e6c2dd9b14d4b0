"""Where a GPU EV table call spends its time, kernel by kernel.

Run under Nsight Compute on the GPU machine (check.sh does, when `ncu` is
there), which times every kernel of the profiled range:

    ncu --profile-from-start off --metrics gpu__time_duration.sum,\\
        dram__bytes.sum python benchmarks/gpu/ev_table_phases.py CORE

The table: 2^17 buckets (16M slots), dim 32, LRU, filled with 8M keys
(load factor 0.5); the profiled range is one `find` of 1M stored keys,
one `find_or_insert` of the same keys, and one of 60% stored and 40% new
keys (HKV's Config B mix, at a smaller capacity).
"""

import sys

import numpy as np

from bindings import cc
from bindings import et


def main():
    import cupy as cp
    core = cc.Core(sys.argv[1])
    table = et.EvTable(core, cc.CupyMemory(), 1 << 17, 32,
                       np.zeros((1, 32), np.float32))
    batch, filled = 1 << 20, 1 << 23
    for step, lo in enumerate(range(1, filled, batch), 1):
        table.launch_find_or_insert(
            cp.arange(lo, lo + batch, dtype=cp.int64), None, None, step)
    cp.random.seed(5)
    hits = cp.random.randint(1, filled, batch, dtype=cp.int64)
    new = filled * 2 + cp.random.randint(0, filled * 8, batch,
                                         dtype=cp.int64)
    mixed = cp.where(cp.random.random(batch) < 0.6, hits, new)
    out = cp.empty((batch, 32), cp.float32)
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.profilerStart()
    table.launch_find(hits, out, None)
    table.launch_find_or_insert(hits, out, None, 100)
    table.launch_find_or_insert(mixed, out, None, 101)
    cp.cuda.runtime.deviceSynchronize()
    cp.cuda.runtime.profilerStop()


if __name__ == "__main__":
    main()
