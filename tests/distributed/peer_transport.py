"""Worker script: the peer-socket exchanges against Horovod's collectives.

Run by test_peer_transport.py under `horovodrun -np N`. Modes:
  parity    alltoall (several dtypes, row shapes, empty blocks; eager and
            tf.function), its gradient, allgather and allreduce_mean equal
            Horovod's alltoall / allgather / allreduce(Average);
  mismatch  the workers run differently named exchanges: every worker
            fails (the first to notice names both collectives and shuts
            its connections down), no hang;
  rowshape  the workers send rows of different sizes: a clear error, and
            every later exchange fails too (the streams are out of step);
  dead      the last worker exits before the exchange: the others fail at
            once, at least one naming it;
  hostile   parity, but worker 0 holds its first connection until the
            test has attacked the listeners (see test_peer_transport.py:
            $HOSTILE_DIR/ready, then .../done); the last worker then
            prints why it dropped each stranger's connection;
  amplify   worker 1 is a hostile peer of a lookup of a dim-64 table:
            its ids message to worker 0 asks for one row many times
            over. First as many as the byte cap allows (worker 0 must
            serve it), then as many ids as the cap's bytes hold (8 each:
            rows of 32x the cap, which worker 0 must refuse before
            allocating). Worker 0 prints its peak RSS growth for each
            ("amplify legal|attack growth <bytes> ...").
Prints "<mode> ok" per worker on success, and "<mode> named by worker R"
when worker R's error names the real problem (not only a peer that
closed its connection).
"""

import argparse
import json
import os
import re
import time

import numpy as np
import tensorflow as tf

import group_embedding as ge
from group_embedding.distributed import transport

from process_memory import status_bytes


def check_parity(hvd):
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.default_rng(100 + rank)
    for dtype, row_shape in ((tf.float32, [3]), (tf.int64, []),
                             (tf.float64, [2, 2]), (tf.int32, [1])):
        splits = rng.integers(0, 5, size).astype(np.int32)
        splits[rank % size] = 0  # an empty block, to self
        n = int(splits.sum())
        data = tf.cast(rng.normal(size=[n] + row_shape) * 100, dtype)
        got, got_splits = transport.alltoall(data, splits, f"p/{dtype.name}")
        want, want_splits = hvd.alltoall(data, splits=splits)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
        np.testing.assert_array_equal(got_splits.numpy(), want_splits.numpy())

    splits = rng.integers(1, 6, size).astype(np.int32)
    x = tf.constant(rng.normal(size=[int(splits.sum()), 4]), tf.float32)

    def grads(exchange):
        return tf.function(lambda x: _grads(exchange, x))(x)

    def _grads(exchange, x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            got, _ = exchange(x)
            w = tf.cast(tf.range(tf.shape(got)[0]) + 1 + rank, tf.float32)
            loss = tf.reduce_sum(got * w[:, None] ** 2)
        return got, tape.gradient(loss, x)

    got, g_ours = grads(lambda t: transport.alltoall(t, splits, "p/grad"))
    want, g_hvd = grads(lambda t: hvd.alltoall(t, splits=splits))
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_allclose(g_ours.numpy(), g_hvd.numpy(), rtol=1e-6)

    rows = tf.constant(rng.normal(size=[rank + 1, 3]), tf.float32)
    np.testing.assert_array_equal(
        transport.allgather(rows, "p/gather").numpy(),
        hvd.allgather(rows).numpy())

    dense = [tf.constant(rng.normal(size=[7]), tf.float32),
             tf.constant(rng.normal(size=[2, 3]), tf.float32),
             tf.constant(rng.normal(size=[]), tf.float32),
             tf.constant(rng.normal(size=[5]) * 1e-9 + 1, tf.float64)]
    # Small buffers: one exchange; 80 KB at N=3: reduce-scatter +
    # all-gather (N=2 always one exchange).
    big = [tf.constant(rng.normal(size=[20000]), tf.float32),
           tf.constant(rng.normal(size=[3, 4]), tf.float32)]
    for label, tensors in (("small", dense), ("big", big)):
        ours = transport.allreduce_mean(tensors, f"p/mean_{label}")
        theirs = [hvd.allreduce(t, op=hvd.Average) for t in tensors]
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
            # float64 stays float64: 1e-9 differences survive.
            tol = 1e-15 if a.dtype == tf.float64 else 1e-6
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=tol,
                                       atol=tol / 10)
            # Bit-identical on every worker: replicas never drift.
            every = hvd.allgather(tf.reshape(a, [1, -1])).numpy()
            assert (every == every[0]).all(), (label, every)


def check_error(run, expect, rank, size, peer_may_close=True):
    """Runs `run`, which must fail within 30 s; returns whether its error
    names `expect` (the real problem).

    The first worker to see the problem shuts its connections down, so
    another may only see that: with `peer_may_close` such a message is
    accepted when it names a live peer (not itself, not past the last
    rank). The test then checks that some worker named the real problem,
    so that a bare "closed its connection" on every worker fails.
    """
    start = time.monotonic()
    try:
        run()
    except tf.errors.OpError as e:
        took = time.monotonic() - start
        assert took < 30, f"the error took {took:.1f} s"
        if expect in e.message:
            return True
        closed = re.search(r"worker (\d+) closed its connection",
                           e.message)
        assert peer_may_close and closed, (expect, e.message)
        peer = int(closed.group(1))
        assert peer != rank and 0 <= peer < size, e.message
        return False
    raise AssertionError("the exchange did not fail")


def hold_first_connection():
    """On worker 0: the first connection to a peer waits until the test
    is done attacking (the peers' listeners are up meanwhile)."""
    if os.environ.get("HOROVOD_RANK") != "0":
        return
    folder = os.environ["HOSTILE_DIR"]
    connect_to = transport._connect_to
    held = []

    def held_connect(*args, **kwargs):
        if not held:
            held.append(True)
            keys = transport._state.get("keys")
            with open(os.path.join(folder, "ready.tmp"), "w") as f:
                f.write(keys.job_id.hex() if keys else "")
            os.rename(os.path.join(folder, "ready.tmp"),
                      os.path.join(folder, "ready"))
            deadline = time.monotonic() + 100
            while not os.path.exists(os.path.join(folder, "done")):
                assert time.monotonic() < deadline, "no 'done' from the test"
                time.sleep(0.1)
        return connect_to(*args, **kwargs)

    transport._connect_to = held_connect


def publish_listeners():
    """Writes this worker's listener addresses to
    $HOSTILE_DIR/listeners-<rank> (JSON: tcp [host, port], unix name):
    where a port scan would find them (test_two_hosts.py's strangers, in
    other network namespaces, cannot list this one's sockets)."""
    folder = os.environ["HOSTILE_DIR"]
    rank = os.environ.get("HOROVOD_RANK")
    found = {}
    open_tcp, open_unix = (transport._open_tcp_listener,
                           transport._open_unix_listener)

    def write():
        path = os.path.join(folder, f"listeners-{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump(found, f)
        os.rename(path + ".tmp", path)

    def tcp(host):
        listener = open_tcp(host)
        found["tcp"] = list(listener.getsockname()[:2])
        return listener

    def unix():
        listener = open_unix()
        found["unix"] = (None if listener is None
                         else listener.getsockname()[1:].decode())
        write()
        return listener

    transport._open_tcp_listener = tcp
    transport._open_unix_listener = unix


def report_dropped():
    """Prints why each stranger was dropped, once the silent ones have
    timed out too."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(
            "timed out" in d for d in transport.dropped_connections()) < 2:
        time.sleep(0.2)
    for line in transport.dropped_connections():
        print(f"dropped: {line}", flush=True)


def _peak_growth(run):
    """(peak RSS growth in bytes while `run()` ran, its error or None)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status_bytes("VmRSS")
    error = None
    try:
        run()
    except tf.errors.OpError as e:
        error = e
    return status_bytes("VmHWM") - before, error


def amplify(hvd):
    """See the module docstring; worker 0 owns ids 0, 2, 4, ... (mod)."""
    from group_embedding.distributed import collective_lookup
    rank = hvd.rank()
    cap = transport.max_bytes_per_peer()
    table = ge.get_embedding_table("amp", 1000, 64, replicate=False)
    ids = tf.RaggedTensor.from_row_lengths(
        tf.constant([0, 2, 4, 1], tf.int64), [2, 2])

    def lookup():
        ge.group_embedding_lookup_sparse([table], [ids], "sum")[0].numpy()

    lookup()  # warm-up: both honest
    honest = transport.alltoall
    copies = {}

    def crafted(data, splits, name, *args, **kwargs):
        # Block 0 (to worker 0) becomes [count, row 0 x count].
        n = copies.get(name[:4], 0)
        if n and rank == 1:
            block0 = int(splits[0])
            data = tf.concat([tf.constant([n] + [0] * n, tf.int64),
                              data[block0:]], 0)
            splits = tf.concat([[n + 1], splits[1:]], 0)
        return honest(data, splits, name, *args, **kwargs)

    transport.alltoall = crafted
    per_id = collective_lookup.owner_bytes_per_id([table])
    # The largest message the cap allows: (1 + n) ids with their rows.
    copies["ids:"] = cap // (8 + per_id) - 1
    growth, error = _peak_growth(lookup)
    if rank == 0:
        assert error is None, error
        print(f"amplify legal growth {growth} cap {cap} copies "
              f"{copies['ids:']}", flush=True)
    # The message: as many ids as fit in the cap's bytes.
    copies["ids:"] = cap // 8 - 2
    growth, error = _peak_growth(lookup)
    if rank == 0:
        assert error is not None, "the amplifying message was accepted"
        print(f"amplify attack growth {growth} cap {cap} copies "
              f"{copies['ids:']} error {error.message}", flush=True)
        if "worker 1 announced" in error.message:
            print("amplify named by worker 0", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("parity", "mismatch", "rowshape",
                                         "dead", "hostile", "amplify"))
    args = parser.parse_args()
    if args.mode == "hostile":
        hold_first_connection()
        publish_listeners()
    hvd = ge.enable_distributed_strategy("collective")
    assert transport.active(), "the peer sockets are not connected"
    rank, size = hvd.rank(), hvd.size()
    ones = np.ones(size, np.int32)
    if args.mode in ("parity", "hostile"):
        print(f"links: {','.join(transport.links())}", flush=True)
        print(f"cycle: {os.environ.get('HOROVOD_CYCLE_TIME')}", flush=True)
        check_parity(hvd)
        if args.mode == "hostile" and rank == size - 1:
            report_dropped()
    elif args.mode == "mismatch":
        named = check_error(
            lambda: transport.alltoall(tf.zeros([size, 2]), ones,
                                       f"lookup-{rank}"),
            "different graphs", rank, size)
    elif args.mode == "rowshape":
        named = check_error(
            lambda: transport.alltoall(tf.zeros([size, 2 + rank]), ones,
                                       "rows"),
            "row shapes or dtypes differ", rank, size)
        # The streams now hold unread rows: a valid exchange must not read
        # them as its data.
        check_error(
            lambda: transport.alltoall(tf.zeros([size, 2]), ones, "next"),
            "an earlier exchange failed", rank, size)
    elif args.mode == "amplify":
        amplify(hvd)  # prints whether it was named itself
        named = False
    elif args.mode == "dead":
        if rank == size - 1:
            print("dead ok", flush=True)
            os._exit(0)  # dies without a word to anyone
        # A survivor may see the other survivor shut down first; the
        # test checks that one of them named the dead worker.
        named = check_error(
            lambda: transport.alltoall(tf.zeros([size, 2]), ones, "rows"),
            f"worker {size - 1} closed its connection", rank, size)
    if args.mode not in ("parity", "hostile") and named:
        print(f"{args.mode} named by worker {rank}", flush=True)
    print(f"{args.mode} ok", flush=True)
    # Wait until every worker has checked its error: closing a socket that
    # still holds unread bytes resets it, which a slower peer would see
    # instead of its own error. Horovod still works (it has its own
    # connections) unless a worker died.
    if args.mode in ("dead", "amplify"):
        time.sleep(3)
    else:
        hvd.allreduce(tf.constant(1.0), name="done").numpy()
    # Skip Horovod's shutdown: after the failures above a peer may be gone.
    os._exit(0)


if __name__ == "__main__":
    main()
