"""Worker-to-worker exchange for collective mode, without negotiation.

Collective mode's step is a chain of exchanges (ids out, rows back,
gradients out, dense gradients averaged). Horovod negotiates every one of
them through rank 0 on a background thread that wakes once per cycle, and
its alltoall sends the split sizes in a round of their own: measured on
the scaling benchmark that latency, not the bytes, was most of the step.

Here the workers open one TCP connection per pair once, in
`enable_distributed_strategy` (addresses found through Horovod), and every
exchange is the C++ op `GroupEmbeddingPeerAllToAll` (`ops/peer_exchange.py`,
kernel in `ops/kernels/peer_exchange_ops.cc`) over those sockets: each
worker runs the same exchanges in the same order (chained with control
dependencies within a graph), and each message carries a tag that the
receiver checks, so a mismatch is an error rather than mixed-up data. A
worker that dies closes its sockets: the others fail at once with its
rank.

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

Who may connect (see peer_auth.py): every connection is authenticated by
a challenge-response over the job secret before anything else is read
from it, and on a Unix socket the peer must run as this worker's uid.
The Unix sockets' names are random per worker (nothing secret), the TCP
listener binds only the address the peers are told, and the shared
memfd is sealed against shrinking and growing (checked on receipt, and
again by the op). While the workers connect, a stranger's connection
(a port scan, garbage, a wrong proof, silence, a byte at a time) is
dropped within `HANDSHAKE_SECONDS` of its accept (one deadline for the
whole handshake) on its own thread, with a warning, while the listener
keeps accepting until the setup deadline. A Unix peer of another uid is
dropped at accept; the others hold one of a few slots of their origin
(TCP address, Unix uid), and a new connection past them drops the oldest
of its origin that has not greeted: a stranger only crowds out itself.
Exchanges then carry no per-message authentication (no cost per step).
`GROUP_EMBEDDING_TRANSPORT_MAX_BYTES` caps the bytes a peer may make
this worker allocate with one exchange whose counts the receiver cannot
know (default 4 GiB): the message and the rows its ids turn into on the
owner (`derived_bytes_per_row`), checked on the header before anything is
allocated; where the receiver knows the count (gradients, averages, rows
coming back), a different count is an error.
"""

import fcntl
import logging
import os
import secrets
import select
import socket
import threading
import time
import zlib
from typing import Any
from typing import Dict
from typing import List
from typing import Optional
from typing import Sequence

import tensorflow as tf

from group_embedding.distributed import peer_auth
from group_embedding.ops import capabilities
from group_embedding.ops import config
from group_embedding.ops import kernel_library
from group_embedding.ops import peer_exchange

# Bytes of each of the four shared buffers of a pair of workers (two each
# way, see peer_exchange_ops.cc); pages are only backed once written.
# Larger blocks go on the socket. GROUP_EMBEDDING_TRANSPORT_SHM_BYTES
# overrides it (tests use a tiny one to mix both paths in one exchange).
SHM_BUFFER_BYTES = config.DEFAULT_SHM_BYTES
# Seals of a shared region: its size can never change (a peer that shrank
# it would make the next copy fault with SIGBUS).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# A connection must complete its whole handshake within this from its
# accept (one deadline, not one per read); the whole setup within
# SETUP_SECONDS.
HANDSHAKE_SECONDS = 10.0
SETUP_SECONDS = 120.0
# Handshakes in progress at once, in all and per origin (a TCP peer's
# address, a Unix peer's uid): a new connection past either makes room by
# dropping the oldest of its origin (or of the busiest one) that has not
# greeted yet, so a stranger's connections only ever crowd out its own.
_MAX_PENDING = 64
_MAX_PENDING_PER_ORIGIN = 4
# Dropped connections reported per origin (warnings,
# `dropped_connections`); the rest are only counted.
_MAX_DROP_MESSAGES = 200
MAX_BYTES_PER_PEER = config.DEFAULT_MAX_BYTES_PER_PEER
_log = logging.getLogger(__name__)
_state: Dict[str, Any] = {
    "fds": None, "sockets": [], "links": [], "rank": 0, "size": 1,
    "timeout": 600.0, "shm": None, "max_bytes": MAX_BYTES_PER_PEER}


def expects_sockets() -> bool:
    """Whether `connect` will use the peer sockets (with more than one
    worker): known before Horovod starts."""
    return (config.transport() != config.Transport.HOROVOD
            and capabilities.current().peer_exchange)


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


def _open_unix_listener():
    """This worker's Unix listener, or None where there is none to be had
    (then its peers connect over TCP)."""
    if (config.same_host_link() == config.SameHostLink.TCP
            or _host_identity() is None):
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Abstract namespace (leading NUL): no file to clean up. The name
        # is random (everyone can list it, nobody can guess it ahead to
        # take it first); peers learn it through Horovod.
        listener.bind(f"\0group_embedding/{secrets.token_hex(16)}")
        listener.listen(_MAX_PENDING)
    except OSError:
        listener.close()
        return None
    return listener


def _open_tcp_listener(host: str):
    """A TCP listener on `host`'s address only (the one the peers are
    told), on a free port."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(
            f"group_embedding: cannot resolve this worker's address "
            f"{host!r} ({e}); set GROUP_EMBEDDING_TRANSPORT_HOST to an "
            f"address of this host that the other workers can reach.") from e
    try:
        listener.bind(address)
        listener.listen(_MAX_PENDING)
    except OSError as e:
        listener.close()
        raise RuntimeError(
            f"group_embedding: cannot listen on {address[0]} ({e}), the "
            f"address the other workers would use; set "
            f"GROUP_EMBEDDING_TRANSPORT_HOST to an address of this host.") \
            from e
    return listener


def _connect_to(address, unix_name: Optional[str]) -> socket.socket:
    """A connection to a peer: over its Unix socket when `unix_name` is
    given and reachable, else over TCP."""
    if unix_name is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(HANDSHAKE_SECONDS)
        try:
            s.connect(unix_name)
            return s
        except OSError:
            s.close()  # e.g. another network namespace after all
    return socket.create_connection(address, timeout=HANDSHAKE_SECONDS)


def _connect_peer(address, unix_name, keys, rank: int, peer: int,
                  deadline: float) -> socket.socket:
    """An authenticated connection to worker `peer`, retried (a busy peer
    may turn a connection down) until `deadline`.

    Raises:
        peer_auth.HandshakeError: the process at the peer's address does
            not hold the job secret (an impostor).
        OSError: no connection before the deadline.
    """
    while True:
        s = None
        try:
            s = _connect_to(address, unix_name)
            peer_auth.connecting(s, keys, rank, peer,
                                 time.monotonic() + HANDSHAKE_SECONDS)
            return s
        except peer_auth.HandshakeError:
            if s is not None:
                s.close()
            raise
        except OSError as e:
            if s is not None:
                s.close()
            failure = e
        if time.monotonic() + 0.2 > deadline:
            raise OSError(f"no authenticated connection to worker {peer} "
                          f"within {SETUP_SECONDS:g} s ({failure})")
        time.sleep(0.2)


class _Pending:
    """A handshake in progress: its socket, origin and progress."""

    def __init__(self, sock: socket.socket, origin):
        self.sock, self.origin = sock, origin
        self.greeted = False
        self.evicted: Optional[str] = None


class _Acceptor:
    """Accepts the lower ranks' connections in the background: each one
    authenticated on its own thread within HANDSHAKE_SECONDS of its
    accept, so that a stranger (silent, trickling, closing, sending
    garbage or a wrong proof) holds nothing but its own thread for a
    bounded time and is dropped with a warning. A Unix peer of another
    uid is dropped at accept, before it takes a slot; the others take a
    slot of their origin (see `_MAX_PENDING_PER_ORIGIN`)."""

    def __init__(self, listeners, keys, rank: int):
        self._listeners = listeners
        self._keys, self._rank = keys, rank
        self._lock = threading.Lock()
        self._peers: Dict[int, socket.socket] = {}
        # Oldest first, per origin.
        self._pending: Dict[Any, List[_Pending]] = {}
        self._closed = False
        self._complete = threading.Event()
        self.dropped: List[str] = []
        self.dropped_count = 0
        self._drops_by_origin: Dict[str, int] = {}
        if rank == 0:
            self._complete.set()
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name="ge-transport-accept")
        self._thread.start()

    def _serve(self) -> None:
        while not self._complete.is_set():
            try:
                ready = select.select(self._listeners, [], [], 0.1)[0]
            except (OSError, ValueError):
                return  # listeners closed: setup is over
            for ln in ready:
                try:
                    s, _ = ln.accept()
                except OSError:
                    continue  # e.g. reset before it was accepted
                self._admit(s)

    def _admit(self, s: socket.socket) -> None:
        accepted = time.monotonic()
        try:
            uid = peer_auth.peer_uid(s)
            origin = ("uid", uid) if uid is not None else (
                "address", s.getpeername()[0])
        except OSError as e:
            self._drop(s, f"{type(e).__name__}: {e}")
            return
        if uid is not None and uid != os.geteuid():
            # Told by the kernel: no slot, no thread.
            self._drop(s, f"the process at the other end runs as uid "
                          f"{uid}, not this worker's {os.geteuid()}")
            return
        entry = _Pending(s, origin)
        with self._lock:
            victim = self._make_room(origin)
            self._pending.setdefault(origin, []).append(entry)
        if victim is not None:
            # Its thread sees the connection end and drops it.
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        threading.Thread(target=self._handshake, args=(entry, accepted),
                         daemon=True).start()

    def _make_room(self, origin) -> Optional[_Pending]:
        """Under the lock: the handshake to give up for one more from
        `origin`, if the slots are full (marked, taken off the list)."""
        mine = self._pending.get(origin, [])
        total = sum(len(v) for v in self._pending.values())
        if len(mine) >= _MAX_PENDING_PER_ORIGIN:
            pool, why = mine, (f"{len(mine)} handshakes in progress from "
                               f"its origin already")
        elif total >= _MAX_PENDING:
            pool = max(self._pending.values(), key=len)
            why = f"{total} handshakes in progress already"
        else:
            return None
        # The oldest that has not greeted: a real peer greets at once.
        victim = next((p for p in pool if not p.greeted), pool[0])
        pool.remove(victim)
        victim.evicted = f"dropped to make room ({why})"
        return victim

    def _drop(self, s: socket.socket, why: str) -> None:
        try:
            origin = s.getpeername() or "a local process"
        except OSError:
            origin = "a closed connection"
        s.close()
        message = (f"group_embedding: worker {self._rank} dropped a "
                   f"connection from {origin} while connecting to its "
                   f"peers: {why}")
        # A flood would otherwise grow the list and the log without bound:
        # per origin (TCP address, or any Unix peer) the first ones only.
        where = origin[0] if isinstance(origin, tuple) else "unix"
        with self._lock:
            self.dropped_count += 1
            n = self._drops_by_origin.get(where, 0) + 1
            if n > _MAX_DROP_MESSAGES or (
                    n == 1 and len(self._drops_by_origin) >= 1000):
                return
            self._drops_by_origin[where] = n
            if n == _MAX_DROP_MESSAGES:
                message += (f" (the last of {n} messages about {where}; "
                            f"its further drops are not reported)")
            self.dropped.append(message)
        _log.warning(message)

    def _greeted(self, entry: _Pending) -> None:
        with self._lock:
            entry.greeted = True

    def _handshake(self, entry: _Pending, accepted: float) -> None:
        s = entry.sock
        try:
            who = peer_auth.accepting(
                s, self._keys, self._rank,
                deadline=accepted + HANDSHAKE_SECONDS,
                on_greeting=lambda: self._greeted(entry))
            if entry.evicted:
                raise ConnectionError("evicted")
        except Exception as e:  # anything a stranger causes: drop it
            self._drop(s, entry.evicted or f"{type(e).__name__}: {e}")
            return
        finally:
            with self._lock:
                pool = self._pending.get(entry.origin, [])
                if entry in pool:
                    pool.remove(entry)
                if not pool:
                    self._pending.pop(entry.origin, None)
        old: Optional[socket.socket]
        with self._lock:
            if self._closed:
                old = s  # setup is over: not wanted
            else:
                # A retried connection of the same worker replaces the
                # one it gave up on.
                old = self._peers.get(who)
                self._peers[who] = s
                if len(self._peers) == self._rank:
                    self._complete.set()
        if old is not None:
            old.close()

    def wait(self, deadline: float) -> Dict[int, socket.socket]:
        """The authenticated peers by rank (all lower ranks, unless the
        deadline passed); stops accepting."""
        self._complete.wait(max(deadline - time.monotonic(), 0))
        with self._lock:
            self._closed = True
            self._complete.set()
            peers = dict(self._peers)
        self._thread.join()
        return peers


def max_ids_per_peer(derived_bytes_per_id: int = 0) -> int:
    """int64 ids one peer may send in an exchange whose counts this
    worker cannot know, when each id makes this worker allocate
    `derived_bytes_per_id` more (its rows):
    `GROUP_EMBEDDING_TRANSPORT_MAX_BYTES` / (8 + that)."""
    return _state["max_bytes"] // (8 + max(0, int(derived_bytes_per_id)))


def max_bytes_per_peer() -> int:
    """`GROUP_EMBEDDING_TRANSPORT_MAX_BYTES` as `connect` read it: the
    most one peer may make this worker allocate in one exchange."""
    return _state["max_bytes"]


def job_secret() -> Optional[bytes]:
    """The job secret once `connect` has shared it (None before, or with
    one worker)."""
    keys = _state.get("keys")
    return None if keys is None else keys.secret


def dropped_connections() -> List[str]:
    """Why each stranger's connection was dropped while this worker
    connected to its peers (also logged as warnings)."""
    return list(_state.get("dropped", []))


def links() -> List[str]:
    """Per worker rank: "self", "shm", "unix" or "tcp" (empty before
    `connect` or with Horovod's transport)."""
    return list(_state["links"])


def _sealed_region(size: int) -> int:
    """A memfd of `size` bytes whose size can never change."""
    fd = os.memfd_create("group_embedding_peer",
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def check_region(fd: int, size: int, peer: int) -> None:
    """Refuses a shared region from worker `peer` that is not a memfd of
    exactly `size` bytes sealed against shrinking, growing and further
    seals (a peer could otherwise shrink it under our mapping: SIGBUS).

    Raises:
        OSError: naming the peer and what is wrong.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise OSError(f"worker {peer} sent a descriptor that is not a "
                      f"sealable memfd ({e})") from e
    if seals & _SEALS != _SEALS:
        raise OSError(f"worker {peer} sent shared memory without the seals "
                      f"against shrinking and growing (seals {seals:#x})")
    actual = os.fstat(fd).st_size
    if actual != size:
        raise OSError(f"worker {peer} sent shared memory of {actual} "
                      f"bytes, expected {size}")


def _share_memory(peers, rank: int) -> List[List[int]]:
    """Creates one shared region per Unix-linked peer (the lower rank
    makes a sealed memfd and passes it over the authenticated socket);
    returns the `shm` rows of `GroupEmbeddingPeerAllToAll`: (memfd or -1,
    bytes per buffer). The descriptors stay open for the life of the
    process (the op maps them)."""
    rows = [[-1, 0] for _ in peers]
    cap = config.transport_shm_bytes()
    # Lower ranks send first and receive after: no two workers wait on
    # each other.
    order = ([j for j in range(rank + 1, len(peers))]
             + [j for j in range(rank)])
    for j in order:
        s = peers[j]
        if s is None or s.family != socket.AF_UNIX:
            continue
        if j > rank:
            fd = _sealed_region(4 * cap)  # two buffers each way
            socket.send_fds(s, [b"m"], [fd])
        else:
            message, fds, flags, _ = socket.recv_fds(s, 1, 1)
            if message != b"m" or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                for fd in fds:
                    os.close(fd)
                raise OSError(f"worker {j} sent no shared memory")
            fd = fds[0]
            try:
                check_region(fd, 4 * cap, j)
            except OSError:
                os.close(fd)
                raise
        rows[j] = [fd, cap]
    return rows


def _own_host() -> str:
    explicit = config.transport_host()
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


def share_keys(hvd) -> peer_auth.JobKeys:
    """The job's secret and id: drawn by rank 0, broadcast over Horovod's
    own collective (a collective: every worker calls it)."""
    # Every rank passes a draw of the same type (Horovod names the
    # collective after it); rank 0's is the one everybody keeps.
    return peer_auth.checked_keys(_object_collective(
        hvd.broadcast_object, tuple(peer_auth.draw_keys())))


def connect(hvd, timeout: float,
            keys: Optional[peer_auth.JobKeys] = None) -> bool:
    """Shares the job secret (see peer_auth.py) and opens this worker's
    authenticated connections to every other worker.

    Called once by `enable_distributed_strategy`, on every worker.

    Args:
        hvd: the initialised `horovod.tensorflow` module (used to find the
            peers' addresses).
        timeout: the collective timeout (0: none). An exchange fails after
            2 x timeout + 10 s without a byte from a peer (a day when 0),
            a backstop behind the watchdog.
        keys: the job's `peer_auth.JobKeys` (`share_keys`); None: shared
            here (a collective).

    Returns:
        True when the socket transport is in use, False for Horovod's.

    Raises:
        RuntimeError: `GROUP_EMBEDDING_TRANSPORT=sockets` and the kernels
            are not loaded, a peer cannot be reached, or the process at a
            peer's address does not hold the job secret.
    """
    mode = config.transport()
    config.same_host_link()  # a bad value fails here, before any collective
    _state["max_bytes"] = config.transport_max_bytes()
    _state["rank"], _state["size"] = hvd.rank(), hvd.size()
    # A backstop behind the collective watchdog, which stops every worker
    # and names the stuck one: it must fire first.
    _state["timeout"] = 2.0 * timeout + 10.0 if timeout else 86400.0
    if hvd.size() == 1:
        return False
    # Shared whatever the transport: the watchdog signs its records too.
    _state["keys"] = keys = keys or share_keys(hvd)
    if mode == config.Transport.HOROVOD:
        return False
    if not capabilities.current().peer_exchange:
        if mode == config.Transport.SOCKETS:
            raise RuntimeError(
                "GROUP_EMBEDDING_TRANSPORT=sockets needs the C++ kernels; "
                f"run `{kernel_library.DIAGNOSE_COMMAND}`.")
        return False
    rank, size = hvd.rank(), hvd.size()
    listener = _open_tcp_listener(_own_host())
    unix_listener = _open_unix_listener()
    identity = _host_identity() if unix_listener is not None else None
    addresses = _object_collective(
        hvd.allgather_object,
        (listener.getsockname()[:2], identity,
         unix_listener.getsockname() if unix_listener else None))
    peers: List[Optional[socket.socket]] = [None] * size
    listeners = [listener] + ([unix_listener] if unix_listener else [])
    deadline = time.monotonic() + SETUP_SECONDS
    acceptor = _Acceptor(listeners, keys, rank)
    try:
        # The lower rank connects, the higher accepts: one socket a pair.
        for j in range(rank + 1, size):
            address, theirs, unix_name = addresses[j]
            same_host = identity is not None and theirs == identity
            peers[j] = _connect_peer(
                tuple(address), unix_name if same_host else None, keys,
                rank, j, deadline)
        for who, s in acceptor.wait(deadline).items():
            peers[who] = s
        missing = [j for j in range(rank) if peers[j] is None]
        if missing:
            raise socket.timeout(
                f"worker(s) {missing} did not connect within "
                f"{SETUP_SECONDS:g} s")
    except (OSError, peer_auth.HandshakeError) as e:
        for s in acceptor.wait(0).values():
            s.close()
        _close_all(peers)
        raise RuntimeError(
            f"group_embedding: worker {rank} could not connect to its "
            f"peers at {[a[0] for a in addresses]} ({e}); set "
            "GROUP_EMBEDDING_TRANSPORT_HOST to an address the other "
            "workers can reach, or GROUP_EMBEDDING_TRANSPORT=horovod.") from e
    finally:
        for ln in listeners:
            ln.close()
    for peer in peers:
        if peer is not None:
            # Authenticated: the memfd exchange waits for slower peers to
            # finish connecting, which may take longer than a handshake.
            peer.settimeout(SETUP_SECONDS)
    shm = [[-1, 0] for _ in peers]
    if config.same_host_link() == config.SameHostLink.SHM:
        try:
            shm = _share_memory(peers, rank)
        except (OSError, ValueError) as e:
            _close_all(peers)
            raise RuntimeError(
                f"group_embedding: worker {rank} could not share memory "
                f"with its peers on this host ({e}); set "
                "GROUP_EMBEDDING_TRANSPORT_SAME_HOST=unix.") from e
    kinds = []
    for peer, row in zip(peers, shm):
        if peer is None:
            kinds.append("self")
            continue
        if peer.family == socket.AF_UNIX:
            kinds.append("shm" if row[0] >= 0 else "unix")
        else:
            peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            kinds.append("tcp")
        peer.setblocking(False)
    _state["sockets"] = peers
    _state["links"] = kinds
    _state["shm"] = shm
    _state["fds"] = [-1 if s is None else s.fileno() for s in peers]
    _state["dropped"] = acceptor.dropped  # late drops still come in
    return True


def _close_all(peers) -> None:
    for s in peers:
        if s is not None:
            s.close()


def active() -> bool:
    """True when exchanges go over the peer sockets."""
    return _state["fds"] is not None


def world_size() -> int:
    """Workers connected by `connect` (1 before it)."""
    return _state["size"]


def _tag(name: str) -> int:
    # The same on every worker (unlike Python's salted hash()).
    return zlib.crc32(name.encode()) | (len(name) << 32)


def tracked(hvd, fn, inputs, differentiable=False):
    """`fn(inputs)` counted by the collective watchdog when `hvd` (the
    strategy's collectives object) is the tracked Horovod."""
    track = getattr(hvd, "track", None)
    if track is None:
        return fn(inputs)
    return track(fn, inputs, differentiable)


def alltoall(data: tf.Tensor, splits: tf.Tensor, name: str,
             expected_splits=None, derived_bytes_per_row: int = 0):
    """Sends block p of `data` (rows `splits[p]`) to worker p.

    Args:
        data: `[n, ...]` rows grouped by destination (float32/64,
            int32/64).
        splits: int32 `[N]`, rows for each worker; sums to n.
        name: names the exchange; the same on every worker, unique among
            the exchanges of one step.
        expected_splits: `[N]`, the rows each worker must send here, where
            this worker knows them (another count is an error); None:
            any count whose rows, each with `derived_bytes_per_row`, fit
            in `GROUP_EMBEDDING_TRANSPORT_MAX_BYTES` a peer.
        derived_bytes_per_row: bytes this worker allocates later for each
            row received (an id's embedding rows), counted against the
            cap before anything is allocated (default 0).

    Returns:
        (received rows by source worker, int32 `[N]` rows from each).
        Differentiable in `data`: the gradient goes back to the senders.
    """
    fds = tf.constant(_state["fds"], tf.int64)
    shm = tf.constant(_state["shm"], tf.int64, shape=[len(_state["fds"]), 2])
    expected = (tf.fill([len(_state["fds"])], tf.constant(-1, tf.int64))
                if expected_splits is None
                else tf.cast(expected_splits, tf.int64))
    return peer_exchange.peer_all_to_all(
        data, tf.cast(splits, tf.int32), fds, shm, expected, tag=_tag(name),
        timeout_seconds=_state["timeout"],
        max_bytes_per_peer=_state["max_bytes"],
        derived_bytes_per_row=int(derived_bytes_per_row))


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
        ones = tf.ones([size], tf.int32)
        copies, _ = alltoall(tf.tile(flat[None], [size, 1]), ones,
                             f"{name}/all_to_all", expected_splits=ones)
        summed = copies[0]
        for p in range(1, size):
            summed = summed + copies[p]
        return _unflatten(summed / size, tensors)
    total = tf.size(flat)
    chunk = (total + size - 1) // size
    padded = tf.pad(flat, [[0, chunk * size - total]])
    ones = tf.ones([size], tf.int32)
    mine, _ = alltoall(tf.reshape(padded, [size, chunk]), ones,
                       f"{name}/reduce_scatter", expected_splits=ones)
    summed = tf.reduce_sum(mine, 0, keepdims=True) / size
    everyone, _ = alltoall(tf.tile(summed, [size, 1]), ones,
                           f"{name}/all_gather", expected_splits=ones)
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
