"""Horovod settings that collective mode picks when the user has not.

A collective-mode step issues a short chain of small, dependent
collectives (ids alltoall -> rows alltoall forward; gradient alltoall and
dense allreduce backward). Horovod's background thread only starts a
negotiation once per cycle (`HOROVOD_CYCLE_TIME`, default 1 ms), so every
link of the chain waits on average half a cycle plus the negotiation
itself. But every cycle, even an idle one, coordinates all ranks (a Gloo
allreduce of the response-cache bits), and that thread runs on the
worker's own core: measured with `benchmarks/alltoall_floor.py` (2
workers, one core each), a 0.5 ms cycle made a worker's plain TF compute
~20% slower than without Horovod and did not shorten the bare collective
chain of a step; 2 ms cost ~0-5% and gave the shortest chain (10 ms was
slower again). Those runs shared the machine with other jobs: re-check
with `HOROVOD_CYCLE_TIME=... python benchmarks/scaling_bench.py`.

With the peer-socket transport (transport.py, the default) no step
exchange goes through Horovod any more; its background thread still
coordinates every cycle, idle or not, on the worker's own core. There the
default cycle is 20 ms: 10x fewer of those rounds, and only Horovod's own
collectives (start-up broadcasts, checkpoint barriers) wait up to a cycle
longer.

`enable_distributed_strategy` calls `apply_defaults()` before
`hvd.init()`; variables already in the environment (set by the user or
horovodrun) win. Horovod reads them only at init, so they cannot be
changed later in the process.
"""

import os
from typing import Dict

# See the module docstring and benchmarks/README.md ("Scaling"). The
# response cache (HOROVOD_CACHE_CAPACITY) and fusion threshold keep
# Horovod's defaults: the lookup's all-to-alls change shape every step (no
# cache hits) and a step has one dense allreduce request (nothing to fuse).
DEFAULTS: Dict[str, str] = {
    "HOROVOD_CYCLE_TIME": "2",
}
# The same when the step's exchanges go over the peer sockets.
SOCKET_TRANSPORT_DEFAULTS: Dict[str, str] = {
    "HOROVOD_CYCLE_TIME": "20",
}


def apply_defaults(socket_transport: bool = False) -> Dict[str, str]:
    """Sets each of the defaults that the environment does not set.

    Args:
        socket_transport: whether the step's exchanges will go over the
            peer sockets (`SOCKET_TRANSPORT_DEFAULTS`) rather than Horovod
            (`DEFAULTS`).

    Returns:
        The variables this call set (name -> value).
    """
    applied = {}
    chosen = SOCKET_TRANSPORT_DEFAULTS if socket_transport else DEFAULTS
    for name, value in chosen.items():
        if name not in os.environ:
            os.environ[name] = value
            applied[name] = value
    return applied
