"""The peer-socket transport of collective mode (transport.py +
PeerAllToAll): results equal Horovod's collectives, and a worker at the
wrong collective, with other row sizes or dead gives a clear error on every
other worker instead of a hang or mixed-up rows."""

import os
import socket

import numpy as np
import pytest
import tensorflow as tf

from group_embedding.distributed import horovod_settings
from group_embedding.distributed import transport
from group_embedding.ops import kernel_library
from tests.distributed.test_collective_training import run_workers


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
        transport.same_host_link()
    monkeypatch.setenv("GROUP_EMBEDDING_TRANSPORT_SAME_HOST", "TCP")
    assert transport.same_host_link() == "tcp"


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
    lib = kernel_library.load()
    assert lib is not None, (
        f"C++ kernels not loaded: run `{kernel_library.DIAGNOSE_COMMAND}`")
    return lib.peer_all_to_all


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
])
def test_bad_inputs_are_refused_before_any_io(splits, fds, shm, message):
    op = _op()
    if shm is None:
        shm = [[-1, 0]] * len(fds)
    fd = None
    if shm == "small memfd":
        fd = os.memfd_create("too_small")
        os.ftruncate(fd, 96)
        shm = [[-1, 0], [fd, 64]]
    try:
        with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                           match=message.replace("[", r"\[")
                           .replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            op(tf.zeros([3, 2]), tf.constant(splits, tf.int32),
               tf.constant(fds, tf.int64),
               tf.reshape(tf.constant(shm, tf.int64), [-1, 2]), tag=1)
    finally:
        if fd is not None:
            os.close(fd)


def test_single_worker_exchange_is_a_copy():
    op = _op()
    data = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    got, got_splits = op(data, tf.constant([4], tf.int32),
                         tf.constant([-1], tf.int64),
                         tf.constant([[-1, 0]], tf.int64), tag=7)
    np.testing.assert_array_equal(got.numpy(), data.numpy())
    assert got_splits.numpy().tolist() == [4]
