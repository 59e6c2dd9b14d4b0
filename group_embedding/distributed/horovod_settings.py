"""Horovod settings that collective mode picks when the user has not.

A collective-mode step issues a short chain of small, dependent
collectives (ids alltoall -> rows alltoall forward; gradient alltoall and
dense allreduce backward). Horovod's background thread only starts a
negotiation once per cycle (`HOROVOD_CYCLE_TIME`, default 1 ms), so every
link of the chain waits on average half a cycle plus the negotiation
itself; with steps of tens of milliseconds that latency matters more
than bandwidth. A shorter cycle costs the background thread a little CPU
per cycle even when idle (each cycle coordinates all ranks).

`enable_distributed_strategy` calls `apply_defaults()` before
`hvd.init()`; variables already in the environment (set by the user or
horovodrun) win. Horovod reads them only at init, so they cannot be
changed later in the process.
"""

import os
from typing import Dict

# Values chosen with benchmarks/scaling_bench.py (see benchmarks/README.md,
# "Scaling"): the cycle time that gave the shortest N=2 step.
DEFAULTS: Dict[str, str] = {
    "HOROVOD_CYCLE_TIME": "0.5",
}


def apply_defaults() -> Dict[str, str]:
    """Sets each of `DEFAULTS` that the environment does not set.

    Returns:
        The variables this call set (name -> value).
    """
    applied = {}
    for name, value in DEFAULTS.items():
        if name not in os.environ:
            os.environ[name] = value
            applied[name] = value
    return applied
