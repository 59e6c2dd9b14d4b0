"""Collective timeout: a stuck worker fails every worker, naming it.

Horovod never times out a collective, and its stall inspector cannot stand
in under Gloo (it looks for missing ranks in `global_ranks_`, which the
Gloo controller fills with `reserve` instead of `resize`, so the list it
walks is empty: no warning, no shutdown). So without this module a worker
that stays alive but stuck (deadlocked, or waiting on input) hangs the
others forever.

How it works, per worker:

- `TrackedHorovod` wraps the collectives that group_embedding issues
  (lookup all-to-alls forward and backward, gradient allreduce, broadcasts,
  checkpoint barriers) between two increments of counters, `entered` and
  `exited`: Python ints in eager code, `tf.Variable`s inside `tf.function`
  (Keras `fit`); inside a TF1 graph nothing is tracked.
- `Watchdog`, a daemon thread, reads the counters every `interval`. It is
  *blocked* while `entered > exited` and `exited` does not move. It
  publishes a heartbeat (counters, how long it has been blocked, wall time)
  to the key-value server that horovodrun already runs for Gloo's
  rendezvous, so no collective is needed to exchange it.
- A worker blocked longer than `timeout` reads every heartbeat. Every
  worker issues the same collectives in the same order, so the ranks that
  have entered no more collectives than this one has exited never reached
  the one it waits in: those are stuck (also any rank whose heartbeat is
  missing or older than `stale_after`, e.g. frozen while holding the GIL).
  It prints the verdict and posts it under an `abort` key; every other
  worker, the stuck one included, sees the key within an interval and
  prints it too; all exit two intervals after the verdict.

The hot path pays two counter increments per collective, and an identity
op on each side of an all-to-all while a tape records (the watchdog's reads
and HTTP calls run on its own thread, every `interval`).

The key-value server answers anyone who can reach it, so every record is
signed with the job secret (HMAC-SHA256 over its key and body, see
peer_auth.py) and checked field by field when read: an unsigned, forged
or malformed record is ignored with a line on stderr (a heartbeat that
does not verify counts as missing), never obeyed and never fatal to the
thread. A record is read only up to `MAX_RECORD_BYTES` (asked of the
server, checked on its announced length, and bounded in the read): a
larger one is ignored unread. Decoding maps every failure a stranger's
bytes can cause (not UTF-8 or ASCII, JSON nested too deep, numbers too
large, wrong types) to "ignored". Any other exception in the thread stops
the worker with the traceback: a worker never goes on without its hang
detection.
"""

import hashlib
import http.client
import json
import math
import os
import re
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from typing import Any
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Union

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import gen_array_ops

from group_embedding.distributed import peer_auth
from group_embedding.ops import config

ENV_TIMEOUT = config.COLLECTIVE_TIMEOUT
DEFAULT_TIMEOUT_SECONDS = config.DEFAULT_COLLECTIVE_TIMEOUT_SECONDS
# Exit status of a worker stopped by the timeout (as coreutils `timeout`).
EXIT_CODE = 124
# Our keys on horovodrun's rendezvous server; Horovod's own scopes are
# `global`, `local_*`, `cross_*` and per process set.
_SCOPE = "group_embedding_watchdog"
_HTTP_TIMEOUT_SECONDS = 5.0
# Longest verdict message accepted from the store (ours are cut to it).
_MAX_MESSAGE_CHARS = 65536
# Largest record read from the store: a verdict of _MAX_MESSAGE_CHARS
# ASCII characters, JSON-escaped twice (body in record), with room to
# spare. Anything larger is not read at all.
MAX_RECORD_BYTES = 8 * _MAX_MESSAGE_CHARS + 4096
# Distinct invalid records reported on stderr (then silently ignored).
_MAX_REPORTED = 1000
_MAC = re.compile(r"[0-9a-f]{64}")
# What a stranger's bytes can make decoding raise: not JSON, not UTF-8
# (ValueError), nested too deep (RecursionError), a number too large for
# a float (OverflowError), a value of another type (TypeError).
_DECODE_ERRORS = (ValueError, RecursionError, OverflowError, TypeError)
# Errors of the store itself (gone, slow, cut short): try next round.
_STORE_ERRORS = (OSError, urllib.error.URLError, http.client.HTTPException)


def resolve_timeout(collective_timeout: Optional[float]) -> float:
    """The collective timeout in seconds: the argument, else the
    environment variable, else the default; 0 disables it.

    Raises:
        ValueError: a negative, NaN or infinite value, or an environment
            variable that is not a number.
        TypeError: `collective_timeout` is not a number.
    """
    if collective_timeout is None:
        return config.collective_timeout()
    if isinstance(collective_timeout, bool) or not isinstance(
            collective_timeout, (int, float)):
        raise TypeError(f"`collective_timeout` must be a number of seconds, "
                        f"but got {type(collective_timeout).__name__}.")
    if not collective_timeout >= 0 or math.isinf(collective_timeout):
        raise ValueError(f"Invalid `collective_timeout`: "
                         f"{collective_timeout!r}, use seconds >= 0 (0 "
                         f"disables it).")
    return float(collective_timeout)


def can_track() -> bool:
    """False inside a TF1 graph, which cannot use eager variables."""
    if tf.executing_eagerly():
        return True
    with tf.init_scope():
        return tf.executing_eagerly()


class CollectiveCounters:
    """How many tracked collectives this worker has entered and exited.

    Eager code counts in Python ints (free); `tf.function`s count in two
    int64 variables, since their Python runs only while tracing. A
    collective's gradient (the backward all-to-all) counts as one more,
    through marks whose gradient functions increment the counters.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._eager = [0, 0]  # entered, exited
        with tf.init_scope(), tf.device("/CPU:0"):
            self._graph = [
                tf.Variable(0, dtype=tf.int64, trainable=False,
                            name=f"ge_collectives_{n}")
                for n in ("entered", "exited")]
        self._graph_marks = [_graph_backward_mark(v) for v in self._graph]

    def read(self):
        """(entered, exited); `exited` first so that entered >= exited."""
        exited = self._eager[_EXITED] + int(self._graph[_EXITED].value())
        entered = self._eager[_ENTERED] + int(self._graph[_ENTERED].value())
        return entered, exited

    def can_track(self) -> bool:
        return can_track()

    def track(self, run: Callable[[Any], Any], inputs,
              differentiable: bool = False):
        """`run(inputs)` counted as one collective.

        Args:
            run: issues the collective on `inputs`.
            inputs: tensors, variables or nests of them.
            differentiable: `inputs` is one tensor and `run` returns a
                tuple whose first item is its differentiable output; the
                gradient of that output is counted as a collective too.
        """
        marked = differentiable and _is_float_tensor(inputs)
        if tf.executing_eagerly():
            # Eager ops run in program order: no dependencies needed.
            if marked:
                inputs = self._eager_backward_mark(inputs, _EXITED)
            self._bump(_ENTERED)
            result = run(inputs)
            self._bump(_EXITED)
            if marked:
                result = (self._eager_backward_mark(result[0], _ENTERED),
                          *result[1:])
            return result
        entered, exited = self._graph
        if marked:
            inputs = self._graph_marks[_EXITED](inputs)
        with tf.control_dependencies(_tensors(inputs)):
            done = entered.assign_add(1, read_value=False)
        with tf.control_dependencies([done]):
            result = run(inputs)
        # Stateful: tf.function runs it though nothing reads it.
        with tf.control_dependencies(_tensors(result)):
            exited.assign_add(1, read_value=False)
        if marked:
            result = (self._graph_marks[_ENTERED](result[0]), *result[1:])
        return result

    def _bump(self, which: int) -> None:
        with self._lock:
            self._eager[which] += 1

    def _eager_backward_mark(self, tensor, which: int):
        """Identity whose gradient bumps counter `which` when the tape
        reaches it (the tape runs gradients in order, synchronously)."""
        if not record.could_possibly_record():
            return tensor
        out = gen_array_ops.identity(tensor)

        def grad(dy):
            self._bump(which)
            return [dy]

        record.record_operation("GroupEmbeddingCollectiveMark", [out],
                                [tensor], grad)
        return out


_ENTERED, _EXITED = 0, 1


def _graph_backward_mark(counter):
    """Identity whose gradient increments `counter` before passing on."""

    @tf.custom_gradient
    def mark(x):
        def grad(dy):
            parts = _tensors(dy)
            with tf.control_dependencies(parts):
                done = counter.assign_add(1, read_value=False)
            with tf.control_dependencies([done]):
                if isinstance(dy, tf.IndexedSlices):
                    return tf.IndexedSlices(tf.identity(dy.values),
                                            dy.indices, dy.dense_shape)
                return tf.identity(dy)
        return x, grad

    return mark


def _is_float_tensor(x) -> bool:
    return isinstance(x, tf.Tensor) and x.dtype.is_floating


def _tensors(nest):
    return [t for t in tf.nest.flatten(nest, expand_composites=True)
            if isinstance(t, (tf.Tensor, tf.Operation))]


class TrackedHorovod:
    """`horovod.tensorflow` whose collectives count in `counters`.

    Only the collectives group_embedding calls are wrapped; every other
    attribute is Horovod's own.
    """

    def __init__(self, hvd, counters: CollectiveCounters):
        self._hvd = hvd
        self._counters = counters

    def __getattr__(self, name):
        return getattr(self._hvd, name)

    def alltoall(self, tensor, *args, **kwargs):
        return self._track("alltoall", tensor, args, kwargs, True)

    def allreduce(self, tensor, *args, **kwargs):
        return self._track("allreduce", tensor, args, kwargs)

    def grouped_allreduce(self, tensors, *args, **kwargs):
        return self._track("grouped_allreduce", tensors, args, kwargs)

    def allgather(self, tensor, *args, **kwargs):
        return self._track("allgather", tensor, args, kwargs)

    def broadcast(self, tensor, *args, **kwargs):
        return self._track("broadcast", tensor, args, kwargs)

    def broadcast_variables(self, variables, *args, **kwargs):
        return self._track("broadcast_variables", variables, args, kwargs)

    def track(self, fn, inputs, differentiable=False):
        """Runs `fn(inputs)`, a collective of group_embedding's own (the
        peer-socket exchanges of transport.py), counted like Horovod's."""
        if not self._counters.can_track():
            return fn(inputs)
        return self._counters.track(fn, inputs, differentiable)

    def _track(self, name, inputs, args, kwargs, differentiable=False):
        fn = getattr(self._hvd, name)
        return self.track(lambda x: fn(x, *args, **kwargs), inputs,
                          differentiable)


class InvalidRecord(ValueError):
    """A record of the store that is malformed or not signed by the job."""


class RendezvousStore:
    """Keys on horovodrun's rendezvous HTTP server (PUT/GET of bytes)."""

    def __init__(self, addr: str, port: str):
        self._url = f"http://{addr}:{port}/{_SCOPE}/"

    @classmethod
    def from_env(cls) -> Optional["RendezvousStore"]:
        addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        return cls(addr, port) if addr and port else None

    def put(self, key: str, value: bytes) -> None:
        request = urllib.request.Request(self._url + key, data=value,
                                         method="PUT")
        with urllib.request.urlopen(request,
                                    timeout=_HTTP_TIMEOUT_SECONDS):
            pass

    def get(self, key: str) -> Optional[bytes]:
        """The value under `key` (None: absent).

        Raises:
            InvalidRecord: larger than `MAX_RECORD_BYTES`; not read (the
                connection is closed on the announced length).
        """
        # Only the first MAX_RECORD_BYTES + 1 are asked for (horovodrun's
        # server ignores the range and sends all: the length decides).
        request = urllib.request.Request(
            self._url + key,
            headers={"Range": f"bytes=0-{MAX_RECORD_BYTES}"})
        try:
            with urllib.request.urlopen(
                    request, timeout=_HTTP_TIMEOUT_SECONDS) as r:
                announced = r.headers.get("Content-Length")
                if (announced is not None and announced.isdigit()
                        and int(announced) > MAX_RECORD_BYTES):
                    raise InvalidRecord(
                        f"{announced} bytes, more than {MAX_RECORD_BYTES}: "
                        f"not read")
                value = r.read(MAX_RECORD_BYTES + 1)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
        if len(value) > MAX_RECORD_BYTES:
            raise InvalidRecord(f"more than {MAX_RECORD_BYTES} bytes: not "
                                f"read")
        return value


def encode_record(secret: bytes, key: str, body: Dict[str, Any]) -> bytes:
    """`body` as stored under `key`: its JSON and the HMAC of it."""
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": text, "mac": peer_auth.sign(
        secret, key, text.encode())}).encode()


def _number(body, field, low=-math.inf, integer=False):
    value = body.get(field)
    kinds = (int,) if integer else (int, float)
    if (isinstance(value, bool) or not isinstance(value, kinds)
            or not math.isfinite(value) or value < low):
        raise InvalidRecord(f"field {field!r} is {value!r}, not a "
                            f"{'n integer' if integer else ' number'} "
                            f">= {low:g}")
    return value


def _heartbeat_fields(body: Dict[str, Any]) -> None:
    entered = _number(body, "entered", 0, integer=True)
    exited = _number(body, "exited", 0, integer=True)
    if exited > entered:
        raise InvalidRecord(f"exited {exited} > entered {entered}")
    _number(body, "blocked_for", 0)
    _number(body, "time")


def _abort_fields(body: Dict[str, Any], size: int) -> None:
    message = body.get("message")
    if not isinstance(message, str) or len(message) > _MAX_MESSAGE_CHARS:
        raise InvalidRecord("field 'message' is not a string of at most "
                            f"{_MAX_MESSAGE_CHARS} characters")
    _number(body, "exit_at")
    rank = _number(body, "rank", 0, integer=True)
    if rank >= size:
        raise InvalidRecord(f"rank {rank} is not a worker of {size}")


def decode_record(secret: bytes, key: str, raw: bytes,
                  size: int) -> Dict[str, Any]:
    """The body of a record read under `key` (`rank_<r>`: a heartbeat,
    `abort`: a verdict), verified and checked field by field.

    Raises:
        InvalidRecord: larger than `MAX_RECORD_BYTES`, not ASCII JSON of
            the expected shape (whatever the bytes: any decoding error is
            this one), not signed with `secret` for this key, or a field
            of the wrong type or range.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise InvalidRecord(f"{len(raw)} bytes, more than "
                            f"{MAX_RECORD_BYTES}")
    try:
        return _decode(secret, key, raw, size)
    except InvalidRecord:
        raise
    except _DECODE_ERRORS as e:
        raise InvalidRecord(f"undecodable ({type(e).__name__}: {e})") \
            from e


def _decode(secret: bytes, key: str, raw: bytes,
            size: int) -> Dict[str, Any]:
    # Ours are ASCII (json.dumps escapes the rest): no surrogates or
    # other encoding surprises get past this.
    if not raw.isascii():
        raise InvalidRecord("not ASCII")
    record = json.loads(raw)
    if (not isinstance(record, dict) or set(record) != {"body", "mac"}
            or not isinstance(record["body"], str)
            or not isinstance(record["mac"], str)
            or not record["body"].isascii()
            or not _MAC.fullmatch(record["mac"])):
        raise InvalidRecord("not a signed record ({'body': ASCII str, "
                            "'mac': 64 hex digits})")
    if not peer_auth.verify(secret, key, record["body"].encode(),
                            record["mac"]):
        raise InvalidRecord("its signature does not verify with the job "
                            "secret")
    body = json.loads(record["body"])
    if not isinstance(body, dict):
        raise InvalidRecord("body is not a JSON object")
    if key == "abort":
        _abort_fields(body, size)
    else:
        _heartbeat_fields(body)
    return body


def _one_line(text: str, limit: int = 300) -> str:
    """`text` as one short printable line (it may quote a stranger)."""
    line = text.encode("ascii", "backslashreplace").decode()
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    return line if len(line) <= limit else line[:limit] + "..."


def find_stuck(rank: int, size: int, exited: int,
               heartbeats: Dict[int, Optional[dict]], now: float,
               stale_after: float) -> List[str]:
    """Why each other rank is stuck, for a worker blocked in collective
    number `exited + 1`; empty if every rank has reached it.

    Args:
        rank, size: this worker and the world size.
        exited: collectives this worker has completed.
        heartbeats: rank -> its last heartbeat (None: never published).
        now: wall time, comparable with the heartbeats' `time`.
        stale_after: a heartbeat older than this is a frozen worker.
    """
    reasons = []
    for r in range(size):
        if r == rank:
            continue
        beat = heartbeats.get(r)
        if beat is None:
            reasons.append(f"rank {r} (never reported, or no valid "
                           f"record: not started, or frozen since "
                           f"startup)")
        elif now - beat["time"] > stale_after:
            reasons.append(
                f"rank {r} (silent for {now - beat['time']:.0f} s: frozen "
                f"holding the GIL, or gone; last at collective "
                f"{beat['entered']})")
        elif beat["entered"] <= exited:
            where = (f"blocked in collective {beat['exited'] + 1}"
                     if beat["entered"] > beat["exited"] else
                     "outside any collective: deadlocked, or waiting on "
                     "input")
            reasons.append(f"rank {r} (entered {beat['entered']} "
                           f"collectives, now {where})")
    return reasons


class Watchdog:
    """Fails every worker when one has waited in a collective > timeout.

    Args:
        rank, size: this worker and the world size.
        timeout: seconds a worker may wait inside one collective.
        counters: this worker's `CollectiveCounters`.
        store: where heartbeats are exchanged (`RendezvousStore`).
        interval: seconds between checks; default timeout / 10, clamped
            to [0.1, 10].
        exit_fn: called with the message (already on stderr) to stop the
            process; default `os._exit(EXIT_CODE)`: the main thread is
            blocked in Horovod's C++ and cannot be interrupted.
        secret: the job secret that signs the records, or a function
            returning it (None while not known yet: the round is skipped);
            default `transport.job_secret`, shared when the workers
            connect, before any watched collective.
    """

    def __init__(self, rank: int, size: int, timeout: float,
                 counters: CollectiveCounters, store,
                 interval: Optional[float] = None,
                 exit_fn: Optional[Callable[[str], None]] = None,
                 secret: Union[bytes, Callable[[], Optional[bytes]],
                               None] = None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self._counters = counters
        self._store = store
        if secret is None:
            from group_embedding.distributed import transport
            secret = transport.job_secret
        self._secret = secret if callable(secret) else (lambda: secret)
        self._ignored: set = set()
        self._stopped = False
        self.interval = (interval if interval is not None
                         else min(max(timeout / 10, 0.1), 10.0))
        self.stale_after = max(timeout, 3 * self.interval)
        self._exit = exit_fn or _exit_process
        self._blocked_since: Optional[float] = None
        self._last_exited = -1
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="ge-collective-watchdog")
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped:
            time.sleep(self.interval)
            try:
                self.check()
            except _STORE_ERRORS as e:
                # The server is gone or slow: horovodrun is stopping the
                # job, or will answer next time; unless this worker is cut
                # off.
                self._check_cut_off(e)
            except BaseException:  # noqa: B036 - nothing may end it quietly
                self._fail(traceback.format_exc())
                return

    def _check_cut_off(self, error: Exception) -> None:
        """Stops a worker blocked longer than the timeout that cannot
        reach the store: its host is cut off (link down, packets lost or
        delayed), so no verdict can reach it and nobody sees its
        heartbeat; without this it would wait for the transport's
        backstop."""
        since = self._blocked_since
        if since is None or time.monotonic() - since <= self.timeout:
            return
        exited = self._counters.read()[1]
        self._stop(
            f"[group_embedding] rank {self.rank}: collective timeout: "
            f"rank {self.rank} waited {time.monotonic() - since:.1f} s (> "
            f"collective_timeout={self.timeout:g} s) in collective "
            f"{exited + 1} and cannot reach the job's key-value server "
            f"({error}): this worker's host is cut off from the others "
            f"(link down, or packets lost or delayed). It stops.",
            time.time())

    def _fail(self, trace: str) -> None:
        """Stops the worker: without its watchdog a hang would go
        unnoticed."""
        message = (f"[group_embedding] rank {self.rank}: the collective "
                   f"watchdog failed, so this worker stops rather than run "
                   f"without hang detection:\n{trace}")
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        self._exit(message)

    def _read(self, key: str) -> Optional[Dict[str, Any]]:
        """The verified body under `key`; None if absent or invalid (an
        invalid one is reported once)."""
        raw = None
        try:
            raw = self._store.get(key)
            if raw is None:
                return None
            return decode_record(self._job_secret(), key, raw, self.size)
        except InvalidRecord as e:
            self._report(key, raw, str(e))
            return None

    def _report(self, key: str, raw: Optional[bytes], why: str) -> None:
        """One line on stderr per distinct invalid record (up to
        _MAX_REPORTED of them)."""
        seen = (key, why if raw is None else hashlib.sha256(raw).digest())
        if seen in self._ignored or len(self._ignored) > _MAX_REPORTED:
            return
        self._ignored.add(seen)
        line = (f"the collective watchdog ignores the record {key!r} of "
                f"the key-value store: {_one_line(why)}")
        if len(self._ignored) > _MAX_REPORTED:
            line = (f"more than {_MAX_REPORTED} invalid records: the "
                    f"collective watchdog ignores the next ones without a "
                    f"line")
        sys.stderr.write(f"[group_embedding] rank {self.rank}: {line}\n")
        sys.stderr.flush()

    def _job_secret(self) -> bytes:
        secret = self._secret()
        # `check` returns before any read or write while there is none.
        assert secret is not None
        return secret

    def _write(self, key: str, body: Dict[str, Any]) -> None:
        self._store.put(key, encode_record(self._job_secret(), key, body))

    def check(self) -> None:
        """One round: publish the heartbeat, obey or raise an abort."""
        if self._secret() is None:
            return  # not connected yet: nothing is watched so far
        entered, exited = self._counters.read()
        now = time.monotonic()
        if entered > exited:
            if self._blocked_since is None or exited != self._last_exited:
                self._blocked_since = now
        else:
            self._blocked_since = None
        self._last_exited = exited
        blocked_for = (now - self._blocked_since
                       if self._blocked_since is not None else 0.0)
        self._write(f"rank_{self.rank}",
                    {"entered": entered, "exited": exited,
                     "blocked_for": blocked_for, "time": time.time()})
        verdict = self._read("abort")
        if verdict is not None:
            self._stop(f"[group_embedding] rank {self.rank} stops: "
                       f"{verdict['message']}", verdict["exit_at"])
            return
        if blocked_for > self.timeout:
            self._diagnose(exited, blocked_for)

    def _diagnose(self, exited: int, blocked_for: float) -> None:
        heartbeats: Dict[int, Any] = {}
        for r in range(self.size):
            if r != self.rank:
                heartbeats[r] = self._read(f"rank_{r}")
        if self._counters.read()[1] != exited:
            return  # it completed while we looked
        reasons = find_stuck(self.rank, self.size, exited, heartbeats,
                             time.time(), self.stale_after)
        if reasons:
            stuck = ", ".join(reasons)
            names = ", ".join(r.split(" (")[0] for r in reasons)
            verdict = (
                f"collective timeout: rank {self.rank} waited "
                f"{blocked_for:.1f} s (> collective_timeout="
                f"{self.timeout:g} s) in collective {exited + 1} for "
                f"{names}. Stuck: {stuck}. All workers stop; raise "
                f"`collective_timeout` (or {ENV_TIMEOUT}) if a worker may "
                f"legitimately lag this long.")
        else:
            counts = ", ".join(
                f"rank {r}: entered {b['entered']}, exited {b['exited']}"
                for r, b in sorted(heartbeats.items()))
            verdict = (
                f"collective timeout: rank {self.rank} waited "
                f"{blocked_for:.1f} s (> collective_timeout="
                f"{self.timeout:g} s) in collective {exited + 1}, which "
                f"every rank has entered but that does not complete: "
                f"workers issue different collectives ({counts}; rank "
                f"{self.rank}: exited {exited}). All workers stop.")
        # Everyone exits at `exit_at`: two rounds for the others (the stuck
        # one too, if its watchdog runs) to read and print the verdict
        # before a first exit breaks their collectives.
        exit_at = time.time() + 2 * self.interval
        # The others accept at most _MAX_MESSAGE_CHARS (many stuck ranks).
        if len(verdict) > _MAX_MESSAGE_CHARS:
            verdict = verdict[:_MAX_MESSAGE_CHARS - 3] + "..."
        self._write("abort", {"message": verdict, "exit_at": exit_at,
                              "rank": self.rank})
        self._stop(f"[group_embedding] rank {self.rank}: {verdict}",
                   exit_at)

    def _stop(self, message: str, exit_at: float) -> None:
        self._stopped = True
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(max(0.0, min(exit_at - time.time(), 2 * self.interval)))
        self._exit(message)


def _exit_process(message: str) -> None:
    del message  # already on stderr
    os._exit(EXIT_CODE)
