"""Worker-to-worker exchange for collective mode, without negotiation.

Collective mode's step is a chain of exchanges (ids out, rows back,
gradients out, dense gradients averaged). Horovod negotiates every one of
them through rank 0 on a background thread that wakes once per cycle, and
its alltoall sends the split sizes in a round of their own: measured on
the scaling benchmark that latency, not the bytes, was most of the step.

Here the workers open one TCP connection per pair once, in
`enable_distributed_strategy` (addresses found through Horovod), and every
exchange is the C++ op `PeerAllToAll` (`ops/kernels/peer_exchange_ops.cc`)
over those sockets: each worker runs the same exchanges in the same order
(chained with control dependencies within a graph), and each message
carries a tag that the receiver checks, so a mismatch is an error rather
than mixed-up data. A worker that dies closes its sockets: the others fail
at once with its rank.

`GROUP_EMBEDDING_TRANSPORT` picks the transport: `auto` (default: the
sockets when the C++ kernels are loaded, else Horovod), `sockets`
(required: an error if they cannot be set up) or `horovod`.
`GROUP_EMBEDDING_TRANSPORT_HOST` sets the address peers use to reach this
worker (default: the address of `HOROVOD_HOSTNAME`, the host name that
horovodrun gives each worker).

Workers on the same host (the same kernel and network namespace) connect
over Unix-domain sockets instead of TCP loopback, and each such pair
shares a memory region (a memfd, passed over the socket) through which
blocks of up to `SHM_BUFFER_BYTES` travel: the socket then carries only
the header. `GROUP_EMBEDDING_TRANSPORT_SAME_HOST` picks `shm` (default),
`unix` (Unix sockets, payloads on the socket) or `tcp`. A Unix connection
that cannot be made falls back to TCP.
"""

import os
import secrets
import select
import socket
import struct
import time
import weakref
import zlib
from typing import List, Optional, Sequence

import tensorflow as tf

from group_embedding.ops import kernel_library

TRANSPORTS = ("auto", "sockets", "horovod")
SAME_HOST_LINKS = ("shm", "unix", "tcp")
# Bytes of each of the four shared buffers of a pair of workers (two each
# way, see peer_exchange_ops.cc); pages are only backed once written.
# Larger blocks go on the socket. GROUP_EMBEDDING_TRANSPORT_SHM_BYTES
# overrides it (tests use a tiny one to mix both paths in one exchange).
SHM_BUFFER_BYTES = 64 << 20
_HELLO = struct.Struct("!16sq")  # job token, rank of the connecting worker
_state = {"fds": None, "sockets": [], "links": [], "rank": 0, "size": 1,
          "timeout": 600.0, "shm": None}
# Per graph, the last exchange created: the next one runs after it, so
# every worker runs its exchanges in program order.
_last_in_graph: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def transport_mode() -> str:
    """`GROUP_EMBEDDING_TRANSPORT`, checked (default "auto")."""
    mode = os.environ.get("GROUP_EMBEDDING_TRANSPORT", "auto").lower()
    if mode not in TRANSPORTS:
        raise ValueError(
            f"Invalid `GROUP_EMBEDDING_TRANSPORT`: {mode!r}, use one of "
            f"{', '.join(TRANSPORTS)}.")
    return mode


def expects_sockets() -> bool:
    """Whether `connect` will use the peer sockets (with more than one
    worker): known before Horovod starts."""
    return transport_mode() != "horovod" and _library() is not None


def _library():
    lib = kernel_library.load()
    if lib is None or not hasattr(lib, "peer_all_to_all"):
        return None
    return lib


def same_host_link() -> str:
    """`GROUP_EMBEDDING_TRANSPORT_SAME_HOST`, checked (default "shm"):
    how workers on one host connect."""
    link = os.environ.get("GROUP_EMBEDDING_TRANSPORT_SAME_HOST",
                          "shm").lower()
    if link not in SAME_HOST_LINKS:
        raise ValueError(
            f"Invalid `GROUP_EMBEDDING_TRANSPORT_SAME_HOST`: {link!r}, use "
            f"one of {', '.join(SAME_HOST_LINKS)}.")
    return link


def _host_identity() -> Optional[str]:
    """Equal for two processes that can reach each other's abstract Unix
    sockets: one kernel (boot id) and one network namespace (whose
    abstract socket names they share); None where that cannot be told."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return None
    return f"{boot}/{netns}"


def _unix_name(token: bytes, rank: int) -> str:
    # Abstract namespace (leading NUL): no file to clean up, and the job
    # token keeps two jobs on one host apart.
    return f"\0group_embedding/{token.hex()}/{rank}"


def _open_unix_listener(token: bytes, rank: int, size: int):
    """This worker's Unix listener, or None where there is none to be had
    (then its peers connect over TCP)."""
    if same_host_link() == "tcp" or _host_identity() is None:
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(_unix_name(token, rank))
        listener.listen(size)
    except OSError:
        listener.close()
        return None
    return listener


def _connect_to(address, unix_name: Optional[str]) -> socket.socket:
    """A connection to a peer: over its Unix socket when `unix_name` is
    given and reachable, else over TCP."""
    if unix_name is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(60)
        try:
            s.connect(unix_name)
            return s
        except OSError:
            s.close()  # e.g. another network namespace after all
    return socket.create_connection(address, timeout=60)


def links() -> List[str]:
    """Per worker rank: "self", "shm", "unix" or "tcp" (empty before
    `connect` or with Horovod's transport)."""
    return list(_state["links"])


def _share_memory(peers, rank: int) -> List[List[int]]:
    """Creates one shared region per Unix-linked peer (the lower rank
    makes a memfd and passes it over the socket); returns the `shm` rows
    of `PeerAllToAll`: (memfd or -1, bytes per buffer). The descriptors
    stay open for the life of the process (the op maps them)."""
    rows = [[-1, 0] for _ in peers]
    cap = int(os.environ.get("GROUP_EMBEDDING_TRANSPORT_SHM_BYTES",
                             SHM_BUFFER_BYTES))
    if cap < 1:
        raise ValueError("GROUP_EMBEDDING_TRANSPORT_SHM_BYTES must be >= 1, "
                         f"got {cap}.")
    # Lower ranks send first and receive after: no two workers wait on
    # each other.
    order = ([j for j in range(rank + 1, len(peers))]
             + [j for j in range(rank)])
    for j in order:
        s = peers[j]
        if s is None or s.family != socket.AF_UNIX:
            continue
        if j > rank:
            fd = os.memfd_create("group_embedding_peer", os.MFD_CLOEXEC)
            os.ftruncate(fd, 4 * cap)  # two buffers each way
            socket.send_fds(s, [b"m"], [fd])
        else:
            _, fds, _, _ = socket.recv_fds(s, 1, 1)
            if len(fds) != 1:
                raise OSError(f"worker {j} sent no shared memory")
            fd = fds[0]
        rows[j] = [fd, cap]
    return rows


def _own_host() -> str:
    explicit = os.environ.get("GROUP_EMBEDDING_TRANSPORT_HOST")
    if explicit:
        return explicit
    name = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def _object_collective(fn, obj):
    # Horovod's object collectives run TF ops; a throwaway graph and
    # session make them work whether or not eager execution is on.
    with tf.Graph().as_default():
        with tf.compat.v1.Session() as session:
            return fn(obj, session=session)


def connect(hvd, timeout: float) -> bool:
    """Opens this worker's connections to every other worker.

    Called once by `enable_distributed_strategy`, on every worker.

    Args:
        hvd: the initialised `horovod.tensorflow` module (used to find the
            peers' addresses).
        timeout: the collective timeout (0: none). An exchange fails after
            2 x timeout + 10 s without a byte from a peer (a day when 0),
            a backstop behind the watchdog.

    Returns:
        True when the socket transport is in use, False for Horovod's.

    Raises:
        RuntimeError: `GROUP_EMBEDDING_TRANSPORT=sockets` and the kernels
            are not loaded or a peer cannot be reached.
    """
    mode = transport_mode()
    same_host_link()  # a bad value fails here, before any collective
    _state["rank"], _state["size"] = hvd.rank(), hvd.size()
    # A backstop behind the collective watchdog, which stops every worker
    # and names the stuck one: it must fire first.
    _state["timeout"] = 2.0 * timeout + 10.0 if timeout else 86400.0
    if mode == "horovod" or hvd.size() == 1:
        return False
    if _library() is None:
        if mode == "sockets":
            raise RuntimeError(
                "GROUP_EMBEDDING_TRANSPORT=sockets needs the C++ kernels; "
                f"run `{kernel_library.DIAGNOSE_COMMAND}`.")
        return False
    rank, size = hvd.rank(), hvd.size()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", 0))
    listener.listen(size)
    token = _object_collective(hvd.broadcast_object,
                               secrets.token_bytes(16))
    unix_listener = _open_unix_listener(token, rank, size)
    identity = _host_identity() if unix_listener is not None else None
    addresses = _object_collective(
        hvd.allgather_object,
        (_own_host(), listener.getsockname()[1], identity))
    peers: List[Optional[socket.socket]] = [None] * size
    listeners = [listener] + ([unix_listener] if unix_listener else [])
    try:
        # The lower rank connects, the higher accepts: one socket a pair.
        for j in range(rank + 1, size):
            host, port, theirs = addresses[j]
            same_host = identity is not None and theirs == identity
            s = _connect_to((host, port),
                            _unix_name(token, j) if same_host else None)
            s.sendall(_HELLO.pack(token, rank))
            peers[j] = s
        deadline = time.monotonic() + 120
        while sum(p is not None for p in peers[:rank]) < rank:
            left = deadline - time.monotonic()
            ready = select.select(listeners, [], [], max(left, 0))[0]
            if not ready:
                raise socket.timeout(
                    f"{rank - sum(p is not None for p in peers[:rank])} "
                    "lower-rank worker(s) did not connect within 120 s")
            for ln in ready:
                s, _ = ln.accept()
                s.settimeout(60)
                got, who = _HELLO.unpack(_recv_exactly(s, _HELLO.size))
                if (got != token or not 0 <= who < rank
                        or peers[who] is not None):
                    s.close()  # not one of this job's workers
                    continue
                peers[who] = s
    except OSError as e:
        _close_all(peers)
        raise RuntimeError(
            f"group_embedding: worker {rank} could not connect to its "
            f"peers at {[a[:2] for a in addresses]} ({e}); set "
            "GROUP_EMBEDDING_TRANSPORT_HOST to an address the other "
            "workers can reach, or GROUP_EMBEDDING_TRANSPORT=horovod.") from e
    finally:
        for ln in listeners:
            ln.close()
    shm = [[-1, 0] for _ in peers]
    if same_host_link() == "shm":
        try:
            shm = _share_memory(peers, rank)
        except (OSError, ValueError) as e:
            _close_all(peers)
            raise RuntimeError(
                f"group_embedding: worker {rank} could not share memory "
                f"with its peers on this host ({e}); set "
                "GROUP_EMBEDDING_TRANSPORT_SAME_HOST=unix.") from e
    kinds = []
    for s, row in zip(peers, shm):
        if s is None:
            kinds.append("self")
            continue
        if s.family == socket.AF_UNIX:
            kinds.append("shm" if row[0] >= 0 else "unix")
        else:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kinds.append("tcp")
        s.setblocking(False)
    _state["sockets"] = peers
    _state["links"] = kinds
    _state["shm"] = shm
    _state["fds"] = [-1 if s is None else s.fileno() for s in peers]
    return True


def _close_all(peers) -> None:
    for s in peers:
        if s is not None:
            s.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise OSError("peer closed the connection during the handshake")
        data += chunk
    return data


def active() -> bool:
    """True when exchanges go over the peer sockets."""
    return _state["fds"] is not None


def world_size() -> int:
    """Workers connected by `connect` (1 before it)."""
    return _state["size"]


def _tag(name: str) -> int:
    # The same on every worker (unlike Python's salted hash()).
    return zlib.crc32(name.encode()) | (len(name) << 32)


def _chained(build):
    graph = tf.compat.v1.get_default_graph()
    previous = None if tf.executing_eagerly() else _last_in_graph.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = build()
    if not tf.executing_eagerly():
        _last_in_graph[graph] = out[0].op
    return out


def tracked(hvd, fn, inputs, differentiable=False):
    """`fn(inputs)` counted by the collective watchdog when `hvd` (the
    strategy's collectives object) is the tracked Horovod."""
    track = getattr(hvd, "track", None)
    if track is None:
        return fn(inputs)
    return track(fn, inputs, differentiable)


def alltoall(data: tf.Tensor, splits: tf.Tensor, name: str):
    """Sends block p of `data` (rows `splits[p]`) to worker p.

    Args:
        data: `[n, ...]` rows grouped by destination (float32/64,
            int32/64).
        splits: int32 `[N]`, rows for each worker; sums to n.
        name: names the exchange; the same on every worker, unique among
            the exchanges of one step.

    Returns:
        (received rows by source worker, int32 `[N]` rows from each).
        Differentiable in `data`: the gradient goes back to the senders.
    """
    lib = _library()
    fds = tf.constant(_state["fds"], tf.int64)
    shm = tf.constant(_state["shm"], tf.int64, shape=[len(_state["fds"]), 2])
    return _chained(lambda: lib.peer_all_to_all(
        data, tf.cast(splits, tf.int32), fds, shm, tag=_tag(name),
        timeout_seconds=_state["timeout"]))


@tf.RegisterGradient("PeerAllToAll")
def _peer_all_to_all_grad(op, grad, _):
    # Rows came from worker p in block p: send their gradients back.
    lib = _library()
    back, _ = _chained(lambda: lib.peer_all_to_all(
        grad, op.outputs[1], op.inputs[2], op.inputs[3],
        tag=(op.get_attr("tag") ^ 0x5A5A5A5A) + 1,
        timeout_seconds=op.get_attr("timeout_seconds")))
    return back, None, None, None


# Buffers up to this size (per worker) are averaged in ONE exchange.
_ONE_ROUND_BYTES = 64 * 1024


def allreduce_mean(tensors: Sequence[tf.Tensor], name: str) -> List[tf.Tensor]:
    """Averages float tensors over the workers: one or two exchanges.

    With 2 workers, or a buffer of at most 64 KiB: every worker sends its
    whole flattened buffer to every other and sums the N copies in rank
    order itself (the same adds in the same order on every worker, so the
    replicas stay identical): one round instead of two, the same bytes at
    N=2. Otherwise reduce-scatter then all-gather, each one alltoall:
    worker p sums chunk p of everyone's buffer, then sends the sum to
    all; bytes per worker 2 x 4 x size x (N - 1) / N, as a ring allreduce.

    Args:
        tensors: float tensors (any shapes); the same list on every worker.
        name: names the two exchanges (see `alltoall`).

    Returns:
        The averages, with the shapes and dtypes of `tensors`.
    """
    size = _state["size"]
    # One buffer for all; float64 gradients keep their precision.
    wide = (tf.float64 if any(t.dtype == tf.float64 for t in tensors)
            else tf.float32)
    flat = tf.concat([tf.reshape(tf.cast(t, wide), [-1])
                      for t in tensors], 0)
    static_total = flat.shape[0]
    if static_total is not None and (
            size == 2 or static_total * flat.dtype.size <= _ONE_ROUND_BYTES):
        copies, _ = alltoall(tf.tile(flat[None], [size, 1]),
                             tf.ones([size], tf.int32), f"{name}/all_to_all")
        summed = copies[0]
        for p in range(1, size):
            summed = summed + copies[p]
        return _unflatten(summed / size, tensors)
    total = tf.size(flat)
    chunk = (total + size - 1) // size
    padded = tf.pad(flat, [[0, chunk * size - total]])
    ones = tf.ones([size], tf.int32)
    mine, _ = alltoall(tf.reshape(padded, [size, chunk]), ones,
                       f"{name}/reduce_scatter")
    summed = tf.reduce_sum(mine, 0, keepdims=True) / size
    everyone, _ = alltoall(tf.tile(summed, [size, 1]), ones,
                           f"{name}/all_gather")
    return _unflatten(tf.reshape(everyone, [-1])[:total], tensors)


def _unflatten(flat, tensors):
    """`flat` cut back into the shapes and dtypes of `tensors`."""
    pieces = tf.split(flat, tf.stack([tf.size(t) for t in tensors]),
                      num=len(tensors))
    return [tf.cast(tf.reshape(p, tf.shape(t)), t.dtype)
            for p, t in zip(pieces, tensors)]


def allgather(tensor: tf.Tensor, name: str) -> tf.Tensor:
    """Every worker's `tensor` (`[n_p, ...]`), concatenated by rank."""
    size = _state["size"]
    n = tf.shape(tensor, out_type=tf.int32)[0]
    tiled = tf.tile(tensor, tf.concat([[size], tf.ones(
        [tf.rank(tensor) - 1], tf.int32)], 0))
    received, _ = alltoall(tiled, tf.fill([size], n), name)
    return received
