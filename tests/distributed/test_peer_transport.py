"""The peer-socket transport of collective mode (transport.py +
GroupEmbeddingPeerAllToAll): results equal Horovod's collectives, and a worker
at the wrong collective, with other row sizes or dead gives a clear error on
every other worker instead of a hang or mixed-up rows."""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.distributed import horovod_settings
from group_embedding.distributed import peer_auth
from group_embedding.distributed import transport
from group_embedding.ops import config
from group_embedding.ops import kernel_library
from group_embedding.ops import peer_exchange

from tests.distributed.test_collective_training import run_workers

_HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("workers,link,shm_bytes", [
    (2, "shm", None), (3, "shm", None), (3, "shm", 40), (2, "unix", None),
    (3, "tcp", None)])
def test_exchanges_equal_horovod(workers, link, shm_bytes):
    # Workers on one host share memory over Unix sockets unless told to
    # use the sockets alone or TCP; every link must carry the same bytes.
    # With 40-byte shared buffers, small blocks of an exchange go through
    # memory and larger ones on the socket.
    env = {"GROUP_EMBEDDING_TRANSPORT_SAME_HOST": link}
    if shm_bytes:
        env["GROUP_EMBEDDING_TRANSPORT_SHM_BYTES"] = str(shm_bytes)
    result = run_workers(workers, "peer_transport.py", "parity", env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count("parity ok") == workers, out[-4000:]
    for rank in range(workers):
        kinds = ["self" if p == rank else link for p in range(workers)]
        assert f"links: {','.join(kinds)}" in out, out[-4000:]
    # No step exchange goes through Horovod: its idle cycle is long.
    assert out.count("cycle: 20") == workers, out[-4000:]


def test_horovod_cycle_default_follows_the_transport(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    assert horovod_settings.apply_defaults(True) == {
        "HOROVOD_CYCLE_TIME": "20"}
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    assert horovod_settings.apply_defaults(False) == {
        "HOROVOD_CYCLE_TIME": "2"}
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")  # the user's wins
    assert horovod_settings.apply_defaults(True) == {}
    assert os.environ["HOROVOD_CYCLE_TIME"] == "5"
    monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT", "horovod")
    assert not transport.expects_sockets()
    monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT", "auto")
    assert transport.expects_sockets()  # the kernels are loaded here


def test_same_host_link_setting_is_checked(monkeypatch):
    monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT_SAME_HOST", "rdma")
    with pytest.raises(ValueError, match="GROUP_EMBEDDING_TRANSPORT_SAME"
                                         "_HOST.*'rdma'.*shm, unix, tcp"):
        config.same_host_link()
    monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT_SAME_HOST", "TCP")
    assert config.same_host_link() == "tcp"


def test_unreachable_unix_socket_falls_back_to_tcp():
    # A peer whose Unix socket cannot be reached (another network
    # namespace after all) is connected over TCP.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        s = transport._connect_to(listener.getsockname(),
                                  "\0group_embedding/no-such-job/1")
        peer, _ = listener.accept()
        assert s.family == socket.AF_INET
        s.sendall(b"x")
        assert peer.recv(1) == b"x"
        s.close()
        peer.close()
    finally:
        listener.close()


@pytest.mark.parametrize("mode,workers", [("mismatch", 2), ("rowshape", 2),
                                          ("dead", 3)])
def test_errors_instead_of_hangs(mode, workers):
    result = run_workers(workers, "peer_transport.py", mode, timeout=180)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count(f"{mode} ok") == workers, out[-4000:]
    # The worker that noticed names the problem (the dead rank for
    # "dead"); the others may only see it close its connection. Before,
    # every worker could pass on "closed its connection" alone.
    assert out.count(f"{mode} named by worker") >= 1, out[-4000:]


def _op():
    # The transport needs the kernels; their absence is a failure here.
    assert peer_exchange.library() is not None, (
        f"C++ kernels not loaded: run `{kernel_library.DIAGNOSE_COMMAND}`")
    return peer_exchange.peer_all_to_all


@pytest.mark.parametrize("splits,fds,shm,message", [
    ([2, 2], [-1, 5], None, "splits sum to 4 but data has 3 rows"),
    ([3, -0], [7, 5], None, "no fd is -1"),
    ([3, 0], [-1, -1], None, "more than one fd is -1"),
    ([4, -1], [-1, 5], None, "splits[1] = -1 < 0"),
    ([3], [-1, 5], None, "one entry per worker"),
    ([3, 0], [-1, 5], [[-1, 0]], "shm must be [workers, 2]"),
    ([3, 0], [-1, 5], [[-1, 0], [-1, 64]], "a capacity needs a memfd"),
    ([3, 0], [-1, 5], [[-1, 0], [7, 0]], "a memfd needs a capacity"),
    ([3, 0], [-1, 5], [[-1, 0], [7, -1]], "shm row 1 = (7, -1)"),
    ([3, 0], [-1, 5], [[-1, 0], [987654, 8]], "fd 987654 of worker 1 is "
                                               "not open"),
    ([3, 0], [-1, 5], "small memfd", "holds 96 bytes, less than 4 buffers"
                                     " of 64"),
    # Unsealed, a peer could shrink it under the mapping (SIGBUS).
    ([3, 0], [-1, 5], "unsealed memfd", "fd \\d+ of worker 1 is not sealed "
                                        "against shrinking and growing"),
])
def test_bad_inputs_are_refused_before_any_io(splits, fds, shm, message):
    op = _op()
    if shm is None:
        shm = [[-1, 0]] * len(fds)
    fd = None
    if shm in ("small memfd", "unsealed memfd"):
        fd = os.memfd_create("test_region")
        os.ftruncate(fd, 96 if shm == "small memfd" else 4 * 64)
        shm = [[-1, 0], [fd, 64]]
    try:
        pattern = message if "\\d" in message else (
            message.replace("[", r"\[").replace("]", r"\]")
            .replace("(", r"\(").replace(")", r"\)"))
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                           match=pattern):
            op(tf.zeros([3, 2]), tf.constant(splits, tf.int32),
               tf.constant(fds, tf.int64),
               tf.reshape(tf.constant(shm, tf.int64), [-1, 2]),
               tf.fill([len(fds)], tf.constant(-1, tf.int64)), tag=1)
    finally:
        if fd is not None:
            os.close(fd)


def test_single_worker_exchange_is_a_copy():
    op = _op()
    data = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    got, got_splits = op(data, tf.constant([4], tf.int32),
                         tf.constant([-1], tf.int64),
                         tf.constant([[-1, 0]], tf.int64),
                         tf.constant([-1], tf.int64), tag=7)
    np.testing.assert_array_equal(got.numpy(), data.numpy())
    assert got_splits.numpy().tolist() == [4]


# --- Strangers and impostors -------------------------------------------

_KEYS = peer_auth.JobKeys(b"k" * 32, b"j" * 16)


def _handshake(acceptor_keys, connector_keys, rank=1, claimed=0):
    """Runs both sides over a socketpair; returns (acceptor's result or
    exception, connector's)."""
    a, c = socket.socketpair()
    a.settimeout(5)
    c.settimeout(5)
    results = {}

    def accept():
        try:
            results["a"] = peer_auth.accepting(a, acceptor_keys, rank)
        except Exception as e:  # reported to the test
            results["a"] = e
        a.close()

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        peer_auth.connecting(c, connector_keys, claimed, rank)
        results["c"] = "ok"
    except Exception as e:
        results["c"] = e
    c.close()
    thread.join(10)
    return results["a"], results["c"]


def test_handshake_proves_the_secret_both_ways():
    assert _handshake(_KEYS, _KEYS) == (0, "ok")
    other_secret = peer_auth.JobKeys(b"x" * 32, _KEYS.job_id)
    # An impostor connecting with the job id but not the secret: it cannot
    # prove itself, and it cannot get a proof it could replay either (the
    # acceptor's proof is of another role).
    acceptor, connector = _handshake(_KEYS, other_secret)
    assert isinstance(connector, peer_auth.HandshakeError)
    assert "does not hold this job's secret" in str(connector)
    assert isinstance(acceptor, OSError)  # it hung up: nothing accepted
    # An impostor listening: the real worker refuses it.
    acceptor, connector = _handshake(other_secret, _KEYS)
    assert "does not hold this job's secret" in str(connector)
    # A rank the acceptor does not expect from (not lower than its own).
    acceptor, _ = _handshake(_KEYS, _KEYS, rank=1, claimed=1)
    assert "claims to be worker 1 connecting to worker 1" in str(acceptor)


def test_handshake_refuses_a_proof_for_the_wrong_nonce():
    # Someone who saw an old handshake replays its proof: the acceptor's
    # fresh nonce makes it wrong.
    a, c = socket.socketpair()
    a.settimeout(5)
    c.settimeout(5)
    result = {}

    def accept():
        result["a"] = _catch(lambda: peer_auth.accepting(a, _KEYS, 1))
        a.close()

    thread = threading.Thread(target=accept)
    thread.start()
    nonce = b"n" * 32
    c.sendall(struct.pack("!8s16sqq32s", b"GEPEER2\0", _KEYS.job_id, 0, 1,
                          nonce))
    reply = c.recv(64)
    assert len(reply) == 64
    stale = peer_auth._proof(_KEYS, b"connect", 0, 1, nonce, b"o" * 32)
    c.sendall(stale)
    thread.join(10)
    assert "does not hold this job's secret" in str(result["a"])
    assert c.recv(1) == b""  # closed, never accepted
    c.close()


def test_handshake_has_one_deadline_a_trickle_cannot_stretch():
    # A byte every 0.2 s: each read would finish within any per-read
    # limit (before: 10 s per recv, so 80 bytes held a slot ~8 minutes at
    # one byte every 6 s). One deadline 1 s from the start ends it.
    a, c = socket.socketpair()
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.2):
            try:
                c.send(b"G")
            except OSError:
                return

    thread = threading.Thread(target=trickle)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(socket.timeout, match="timed out"):
            peer_auth.accepting(a, _KEYS, 1, deadline=start + 1.0)
        assert time.monotonic() - start < 1.5
    finally:
        stop.set()
        thread.join()
        a.close()
        c.close()


def _catch(fn):
    try:
        return fn()
    except Exception as e:
        return e


def _as_nobody(*command):
    return ["setpriv", "--reuid=nobody", "--regid=nogroup",
            "--clear-groups", *command]


def test_unix_peer_running_as_another_user_is_refused():
    # SO_PEERCRED: even holding the secret, a process of another uid is
    # not a worker of this job (here: nobody, which never saw a byte of
    # the handshake: the acceptor refuses before reading).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0group_embedding_test/{os.getpid()}"
    listener.bind(name)
    listener.listen(1)
    listener.settimeout(30)
    script = ("import socket,sys; s=socket.socket(socket.AF_UNIX)\n"
              "s.settimeout(10); s.connect('\\0' + sys.argv[1])\n"
              "got = b''\n"
              "try:\n s.sendall(b'x' * 96); got = s.recv(100)\n"
              "except OSError: pass\n"
              "print(len(got))")
    child = subprocess.Popen(_as_nobody("/usr/bin/python3", "-c", script,
                                        name[1:]),
                             stdout=subprocess.PIPE, text=True)
    try:
        s, _ = listener.accept()
        s.settimeout(5)
        assert peer_auth.peer_uid(s) == 65534
        with pytest.raises(peer_auth.HandshakeError,
                           match="runs as uid 65534, not this worker's"):
            peer_auth.accepting(s, _KEYS, 1)
        s.close()
        out, _ = child.communicate(timeout=30)
        assert out.strip() == "0"  # nothing was said to it
    finally:
        listener.close()
        if child.poll() is None:
            child.kill()


def test_shared_memory_is_sealed_and_checked_on_receipt():
    fd = transport._sealed_region(4096)
    try:
        # A peer holding it can neither shrink nor grow it.
        for size in (0, 1024, 8192):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        transport.check_region(fd, 4096, 0)
        with pytest.raises(OSError, match="worker 0 sent shared memory of "
                                          "4096 bytes, expected 8192"):
            transport.check_region(fd, 8192, 0)
    finally:
        os.close(fd)
    # Before, the region was a plain memfd: shrunk after the first
    # mapping, the next copy died of SIGBUS.
    loose = os.memfd_create("loose", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(loose, 4096)
        with pytest.raises(OSError, match="worker 3 sent shared memory "
                                          "without the seals"):
            transport.check_region(loose, 4096, 3)
    finally:
        os.close(loose)
    r, w = os.pipe()
    try:
        with pytest.raises(OSError, match="not a sealable memfd"):
            transport.check_region(r, 4096, 1)
    finally:
        os.close(r)
        os.close(w)


# The header: magic, tag, rows, row bytes, shared-memory offset.
_MAGIC = 0x47455045455231


@pytest.mark.parametrize("rows,expected,cap,message", [
    # 100M rows of 8 bytes (800 MB) against a 1 KiB cap: refused before
    # any allocation (before, anything up to 1 TiB was allocated).
    (100_000_000, -1, 1024, "announced 100000000 rows of 8 bytes; this "
                            "worker expects at most 128 .1024 bytes"),
    (2**40, -1, 4 << 30, "announced 1099511627776 rows"),
    (-3, -1, 1024, "announced -3 rows"),
    (6, 5, 1024, "announced 6 rows of 8 bytes; this worker expects "
                 "exactly 5 from it"),
])
def test_announced_rows_are_bounded_by_what_the_receiver_expects(
        rows, expected, cap, message):
    # In a process of its own: a failed exchange marks the streams out of
    # step for every later exchange of the process.
    script = f"""
import socket, struct
import tensorflow as tf
from group_embedding.ops import peer_exchange
op = peer_exchange.peer_all_to_all
mine, theirs = socket.socketpair()
theirs.sendall(struct.pack("=Qqqqq", {_MAGIC}, 9, {rows}, 8, -1))
try:
    op(tf.zeros([0, 2]), tf.constant([0, 0], tf.int32),
       tf.constant([-1, mine.fileno()], tf.int64),
       tf.constant([[-1, 0], [-1, 0]], tf.int64),
       tf.constant([-1, {expected}], tf.int64), tag=9,
       timeout_seconds=5, max_bytes_per_peer={cap})
    print("no error")
except tf.errors.OpError as e:
    print(type(e).__name__, e.message)
"""
    result = subprocess.run([sys.executable, "-c", script],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("DataLossError"), result.stdout
    assert re.search(message, result.stdout), result.stdout


def _descendants(root):
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _listeners(pids):
    """("tcp", (host, port)) and ("unix", name) of every listening socket
    the processes `pids` hold: what a port scan of the job finds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ip, port = fields[1].split(":")
                host = socket.inet_ntoa(struct.pack("<I", int(ip, 16)))
                found.append(("tcp", (host, int(port, 16))))
    with open("/proc/net/unix") as f:
        for line in list(f)[1:]:
            fields = line.split()
            if (len(fields) >= 8 and fields[3] == "00010000"
                    and fields[6] in inodes and fields[7].startswith("@")):
                found.append(("unix", "\0" + fields[7][1:]))
    return found


def _open(kind, address):
    s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET)
    s.settimeout(5)
    s.connect(address)
    return s


def _attack(listeners, job_id, silent):
    """Every stranger of the issue, at every listener: a port scan
    (connect, close), garbage then close, garbage then silence, silence,
    another job's greeting, and this job's greeting without the secret.
    Silent sockets go to `silent` (closed after the job)."""
    for kind, address in listeners:
        try:
            _open(kind, address).close()
            s = _open(kind, address)
            s.sendall(b"0123456789")
            s.close()
            s = _open(kind, address)
            s.sendall(os.urandom(200))
            silent.append(s)
            silent.append(_open(kind, address))
            s = _open(kind, address)
            s.sendall(struct.pack("!8s16sqq32s", b"GEPEER2\0",
                                  os.urandom(16), 0, 1, os.urandom(32)))
            silent.append(s)
            s = _open(kind, address)
            s.sendall(struct.pack("!8s16sqq32s", b"GEPEER2\0", job_id, 0, 1,
                                  os.urandom(32)))
            try:
                if len(s.recv(64)) == 64:  # nonce + proof: prove ourselves
                    s.sendall(os.urandom(32))
            except OSError:
                pass
            silent.append(s)
        except OSError:
            continue  # e.g. a listener that closed meanwhile


def test_strangers_and_impostors_change_nothing(tmp_path):
    # A job starts while its listeners are scanned, sent garbage, held
    # silent, greeted with another job's id and with this job's id but no
    # secret, and `nobody` reads /proc/net/unix and claims to be worker 0
    # on every worker socket. The job starts normally and its exchanges
    # equal Horovod's. Before: the first port-scan connection made
    # enable_distributed_strategy raise, a silent one held the worker for
    # 60 s, and nobody was accepted as worker 0.
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, HOSTILE_DIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(
        [horovodrun, "-np", "2", "--gloo", sys.executable,
         os.path.join(_HERE, "peer_transport.py"), "hostile"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, start_new_session=True)
    silent = []
    out = ""
    try:
        ready = tmp_path / "ready"
        deadline = time.monotonic() + 200
        while not ready.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "worker 0 never got ready"
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        job_id = bytes.fromhex(ready.read_text())
        listeners = _listeners(_descendants(proc.pid))
        assert any(k == "unix" for k, _ in listeners), listeners
        assert any(k == "tcp" for k, _ in listeners), listeners
        _attack(listeners, job_id, silent)
        nobody = subprocess.run(
            _as_nobody("/usr/bin/python3",
                       os.path.join(_HERE, "hostile_peer.py")),
            capture_output=True, text=True, timeout=120)
        tries = [json.loads(line) for line in nobody.stdout.splitlines()]
        (tmp_path / "done").write_text("")
        out, _ = proc.communicate(timeout=240)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        out += proc.communicate()[0]
        print(out[-6000:])
        raise
    finally:
        for s in silent:
            s.close()
    assert proc.returncode == 0, out[-6000:]
    assert out.count("hostile ok") == 2, out[-6000:]
    assert "links: self,shm" in out and "links: shm,self" in out, \
        out[-6000:]
    # nobody reached the sockets but was told nothing and taken in nowhere:
    # worker 1 hung up on it (worker 0, which accepts nobody, left it
    # waiting in its backlog).
    assert tries and all(t.get("uid") == 65534 for t in tries), tries
    assert all(t["connected"] and t["answered"] == 0 for t in tries), tries
    assert sum(t["closed"] for t in tries) >= 2, tries
    # Worker 1 dropped each kind of stranger, for the right reason.
    dropped = [line for line in out.splitlines() if "dropped: " in line]
    for reason in ("runs as uid 65534", "closed during the handshake",
                   "bad greeting", "a worker of another job",
                   "does not hold this job's secret", "timed out"):
        assert any(reason in line for line in dropped), (reason, out[-6000:])


def test_byte_cap_bounds_the_rows_an_ids_message_turns_into():
    # A hostile worker (authenticated) asks worker 0 for one row of a
    # dim-64 table 8,388,606 times: 64 MiB of ids, legal under a 64 MiB
    # cap, but 2 GiB of rows on the owner. Before, worker 0's peak RSS grew
    # by 2.3 GB (36x the cap) before the job failed. Now the header is
    # refused, naming the sender, before anything is allocated; and the
    # largest message the cap allows (ids and their rows) grows it by at
    # most 1.2x the cap.
    cap = 64 << 20
    result = run_workers(2, "peer_transport.py", "amplify", timeout=240,
                         env={"GROUP_EMBEDDING_TRANSPORT_MAX_BYTES":
                              str(cap)})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert out.count("amplify ok") == 2, out[-4000:]
    legal = re.search(r"amplify legal growth (\d+) cap (\d+) copies (\d+)",
                      out)
    attack = re.search(r"amplify attack growth (\d+) cap (\d+) copies "
                       r"(\d+) error (.*)", out)
    assert legal and attack, out[-4000:]
    assert int(attack.group(3)) == 8_388_606
    assert int(attack.group(1)) <= 1.2 * cap, attack.group(0)
    assert ("worker 1 announced 8388607 rows of 8 bytes, each turning "
            "into 512 bytes more here; this worker expects at most 129055 "
            f"({cap} bytes") in attack.group(4), attack.group(4)
    assert "amplify named by worker 0" in out, out[-4000:]
    print(legal.group(0), "\n", attack.group(0)[:300])
    # What the cap allows is served, within it.
    assert int(legal.group(3)) == cap // (8 + 512) - 1
    assert int(legal.group(1)) <= 1.2 * cap, legal.group(0)


def test_max_bytes_setting_is_checked(monkeypatch):
    monkeypatch.delenv("GROUP_EMBEDDING_TRANSPORT_MAX_BYTES", raising=False)
    assert config.transport_max_bytes() == 4 << 30
    monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT_MAX_BYTES", "1024")
    assert config.transport_max_bytes() == 1024
    for bad in ("0", "-5", "4GiB"):
        monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT_MAX_BYTES", bad)
        with pytest.raises(ValueError, match="Invalid GROUP_EMBEDDING_"
                                             "TRANSPORT_MAX_BYTES"):
            config.transport_max_bytes()


def test_listener_binds_only_the_told_address(monkeypatch):
    # Not every interface: a TCP listener on 127.0.0.2 is not reachable
    # at 127.0.0.1 (before, the listener bound 0.0.0.0).
    listener = transport._open_tcp_listener("127.0.0.2")
    try:
        host, port = listener.getsockname()[:2]
        assert host == "127.0.0.2"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        listener.close()
    with pytest.raises(RuntimeError, match="cannot listen on 192.0.2.77"):
        transport._open_tcp_listener("192.0.2.77")  # not this host's
