"""Who may join a job: the job secret, the peer handshake, signed records.

Collective mode's workers open their own connections (transport.py) and
post records to horovodrun's key-value store (watchdog.py). Both are
reachable by other users of the host (abstract Unix socket names are
listed in /proc/net/unix, TCP ports and the store answer anyone), so
both are authenticated with a secret that only the job's workers hold:

- Rank 0 draws 32 random bytes and broadcasts them over Horovod's own
  collective (Gloo or MPI), once, at `enable_distributed_strategy`. That
  channel is Horovod's trust domain: whoever can read or inject into the
  job's Gloo/MPI traffic or rewrite its rendezvous can already run
  anything in the job. The secret is never in a socket name, a command
  line, an environment variable or a file.
- Every connection between workers starts with a challenge-response
  (`connecting` / `accepting`): each side sends a fresh 32-byte nonce and
  proves it holds the secret with HMAC-SHA256 over both nonces, both
  ranks, the job id and its role, compared in constant time. No data and
  no file descriptor is read from a connection before both proofs pass.
  On a Unix socket the peer's uid (SO_PEERCRED) must also be this
  worker's own.
- Records that can stop the job (watchdog heartbeats and aborts) carry an
  HMAC of their key and body (`sign` / `verify`).

The job id names the job's sockets and appears in the handshake: random,
not secret.
"""

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from typing import Callable
from typing import NamedTuple
from typing import Optional

SECRET_BYTES = 32
NONCE_BYTES = 32
JOB_ID_BYTES = 16
_MAC_BYTES = hashlib.sha256().digest_size
_MAGIC = b"GEPEER2\0"
# magic, job id, connecting rank, accepting rank, connector's nonce
_HELLO = struct.Struct(f"!8s{JOB_ID_BYTES}sqq{NONCE_BYTES}s")
# acceptor's nonce, its proof
_REPLY = struct.Struct(f"!{NONCE_BYTES}s{_MAC_BYTES}s")
_ACCEPTED = b"\x01"
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class HandshakeError(Exception):
    """The other end is not an authenticated worker of this job."""


class JobKeys(NamedTuple):
    """The job's shared secret and its (public) id."""
    secret: bytes
    job_id: bytes


def draw_keys() -> JobKeys:
    """Fresh keys (rank 0 draws them; the others receive its copy)."""
    return JobKeys(secrets.token_bytes(SECRET_BYTES),
                   secrets.token_bytes(JOB_ID_BYTES))


def checked_keys(received) -> JobKeys:
    """`received` (what the broadcast delivered) as `JobKeys`, checked.

    Raises:
        RuntimeError: not two byte strings of the expected lengths.
    """
    if (not isinstance(received, tuple) or len(received) != 2
            or not isinstance(received[0], bytes)
            or not isinstance(received[1], bytes)
            or len(received[0]) != SECRET_BYTES
            or len(received[1]) != JOB_ID_BYTES):
        raise RuntimeError("group_embedding: the job secret broadcast by "
                           "rank 0 is malformed.")
    return JobKeys(*received)


def peer_uid(sock: socket.socket) -> Optional[int]:
    """The uid of the process at the other end of a Unix socket (None for
    other families)."""
    if sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                          _PEERCRED.size)
    return _PEERCRED.unpack(raw)[1]


def _check_uid(sock: socket.socket) -> None:
    uid = peer_uid(sock)
    if uid is not None and uid != os.geteuid():
        raise HandshakeError(f"the process at the other end runs as uid "
                             f"{uid}, not this worker's {os.geteuid()}")


def _proof(keys: JobKeys, role: bytes, connector: int, acceptor: int,
           own_nonce: bytes, other_nonce: bytes) -> bytes:
    # The role keeps one side's proof from being replayed as the other's;
    # the ranks and the job id bind it to this pair of this job.
    message = b"".join([role, keys.job_id,
                        struct.pack("!qq", connector, acceptor),
                        own_nonce, other_nonce])
    return hmac.new(keys.secret, message, hashlib.sha256).digest()


def _left(deadline: Optional[float]) -> Optional[float]:
    """Seconds to `deadline` (time.monotonic), for a socket timeout.

    Raises:
        socket.timeout: the deadline has passed.
    """
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("timed out: the handshake did not complete "
                             "within its deadline")
    return left


def _send(sock: socket.socket, data: bytes,
          deadline: Optional[float]) -> None:
    if deadline is not None:
        sock.settimeout(_left(deadline))
    sock.sendall(data)


def _recv_exactly(sock: socket.socket, n: int,
                  deadline: Optional[float] = None) -> bytes:
    """`n` bytes, all before `deadline` (one bound for the whole
    handshake: a peer trickling a byte at a time cannot stretch it)."""
    data = b""
    while len(data) < n:
        if deadline is not None:
            sock.settimeout(_left(deadline))
        chunk = sock.recv(n - len(data))
        if not chunk:
            # Not a proof of anything: a busy acceptor turns connections
            # down by closing them, and the connector retries.
            raise ConnectionError("the connection closed during the "
                                  "handshake")
        data += chunk
    return data


def connecting(sock: socket.socket, keys: JobKeys, rank: int,
               peer: int, deadline: Optional[float] = None) -> None:
    """This worker (`rank`) authenticates the worker `peer` it connected
    to, and proves itself; returns once `peer` accepted the connection.

    `deadline` (time.monotonic), if given, bounds the whole handshake.

    Raises:
        HandshakeError: the other end did not prove it holds the secret
            or runs as another uid.
        OSError: the connection failed or closed (e.g. a socket timeout,
            or the peer turned it down): worth retrying.
    """
    _check_uid(sock)
    nonce = secrets.token_bytes(NONCE_BYTES)
    _send(sock, _HELLO.pack(_MAGIC, keys.job_id, rank, peer, nonce),
          deadline)
    their_nonce, their_proof = _REPLY.unpack(
        _recv_exactly(sock, _REPLY.size, deadline))
    if not hmac.compare_digest(
            their_proof,
            _proof(keys, b"accept", rank, peer, their_nonce, nonce)):
        raise HandshakeError(f"the process listening as worker {peer} "
                             f"does not hold this job's secret")
    _send(sock, _proof(keys, b"connect", rank, peer, nonce, their_nonce),
          deadline)
    if _recv_exactly(sock, 1, deadline) != _ACCEPTED:
        raise HandshakeError(f"worker {peer} answered the handshake with "
                             f"garbage")


def accepting(sock: socket.socket, keys: JobKeys, rank: int,
              deadline: Optional[float] = None,
              on_greeting: Optional[Callable[[], None]] = None) -> int:
    """This worker (`rank`) authenticates a connection it accepted and
    proves itself; returns the connecting worker's rank (lower than
    `rank`).

    `deadline` (time.monotonic), if given, bounds the whole handshake;
    `on_greeting` is called once a well-formed greeting of this job has
    arrived (the acceptor then prefers to drop other connections).

    Raises:
        HandshakeError: not a worker of this job (wrong format, job, rank
            or proof, or another uid).
        OSError: the connection failed (e.g. a socket timeout).
    """
    _check_uid(sock)
    magic, job_id, who, me, nonce = _HELLO.unpack(
        _recv_exactly(sock, _HELLO.size, deadline))
    if magic != _MAGIC:
        raise HandshakeError("not a group_embedding worker (bad greeting)")
    if not hmac.compare_digest(job_id, keys.job_id):
        raise HandshakeError("a worker of another job")
    if me != rank or not 0 <= who < rank:
        raise HandshakeError(f"claims to be worker {who} connecting to "
                             f"worker {me}")
    if on_greeting is not None:
        on_greeting()
    own = secrets.token_bytes(NONCE_BYTES)
    _send(sock, _REPLY.pack(own, _proof(keys, b"accept", who, rank, own,
                                        nonce)), deadline)
    proof = _recv_exactly(sock, _MAC_BYTES, deadline)
    if not hmac.compare_digest(
            proof, _proof(keys, b"connect", who, rank, nonce, own)):
        raise HandshakeError(f"claims to be worker {who} but does not hold "
                             f"this job's secret")
    _send(sock, _ACCEPTED, deadline)
    return who


def sign(secret: bytes, key: str, body: bytes) -> str:
    """HMAC-SHA256 (hex) of a record `body` stored under `key`."""
    return hmac.new(secret, key.encode() + b"\0" + body,
                    hashlib.sha256).hexdigest()


def verify(secret: bytes, key: str, body: bytes, mac: str) -> bool:
    """Whether `mac` is `sign(secret, key, body)` (constant time)."""
    return hmac.compare_digest(mac.encode(), sign(secret, key, body)
                               .encode())
