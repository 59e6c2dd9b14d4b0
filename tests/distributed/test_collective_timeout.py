"""Collective timeout: a stuck worker stops every worker, naming it.

The end-to-end cases run `collective_stuck.py` under horovodrun with a 3 s
timeout (see its docstring); the others check the argument, the verdict and
the watchdog's rounds in-process, without Horovod.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import group_embedding as ge
from group_embedding.distributed import strategy as distributed_strategy
from group_embedding.distributed import watchdog

_HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 3
# Startup of 2 TF workers on 2 busy cores can take a minute; the bound
# that matters is from the stall to the stop (asserted below).
HANG_AFTER = 150


def run_stuck(*args, env_timeout=None):
    """Runs collective_stuck.py on 2 workers; returns (output, returncode,
    wall time at exit). A hang fails the test instead of blocking it."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop(watchdog.ENV_TIMEOUT, None)
    if env_timeout is not None:
        env[watchdog.ENV_TIMEOUT] = str(env_timeout)
    # Own session: on a hang we kill horovodrun and its workers together.
    proc = subprocess.Popen(
        [horovodrun, "-np", "2", "--gloo", sys.executable,
         os.path.join(_HERE, "collective_stuck.py"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HANG_AFTER)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"workers still running after {HANG_AFTER} s (hung):\n"
                    f"{out[-3000:]}")
    return out, proc.returncode, time.time()


@pytest.mark.parametrize("stuck,where,function,via_env", [
    ("input", "inside", False, True),
    ("frozen", "before", False, False),
    ("input", "inside", True, False),
], ids=["input-backward-eager-env", "frozen-forward-eager",
        "input-backward-function"])
def test_stuck_worker_stops_every_worker_naming_it(stuck, where, function,
                                                   via_env):
    args = ["--stuck", stuck, "--where", where]
    args += ["--function"] if function else []
    args += [] if via_env else ["--timeout", str(TIMEOUT)]
    out, returncode, ended = run_stuck(
        *args, env_timeout=TIMEOUT if via_env else None)
    assert returncode != 0, out[-4000:]
    stalled = re.search(r"worker 1 stuck at step 3 \(\w+\) at ([\d.]+)",
                        out)
    assert stalled, out[-4000:]
    # Worker 0 waits inside a collective and names rank 1.
    verdict = (r"collective timeout: rank 0 waited [\d.]+ s "
               rf"\(> collective_timeout={TIMEOUT} s\) in collective \d+ "
               r"for rank 1\. Stuck: rank 1 \(")
    assert re.search(r"\[0\]<stderr>:\[group_embedding\] rank 0: " +
                     verdict, out), out[-4000:]
    if stuck == "input":
        # The stuck worker's own watchdog still runs: it says so too.
        assert re.search(r"\[1\]<stderr>:\[group_embedding\] rank 1 stops: "
                         + verdict, out), out[-4000:]
        assert "waiting on input" in out, out[-4000:]
    else:
        assert "silent for" in out or "outside any collective" in out, \
            out[-4000:]
    assert "finished" not in out, out[-4000:]
    # Timeout, a round of checks, two rounds of grace, and horovodrun's
    # stop; not a hang.
    assert ended - float(stalled.group(1)) < TIMEOUT + 25, out[-4000:]


def test_hostile_records_in_the_real_store():
    # Someone posts an unsigned abort to horovodrun's key-value store: the
    # job ignores it (before, every worker stopped with its message).
    out, returncode, _ = run_stuck("--stuck", "none", "--function",
                                   "--timeout", str(TIMEOUT),
                                   "--hostile-record", "unsigned")
    assert "posted a unsigned abort record" in out, out[-4000:]
    assert returncode == 0, out[-4000:]
    assert out.count("finished") == 2, out[-4000:]
    assert "stops: forged stop" not in out, out[-4000:]
    assert "the collective watchdog ignores the record 'abort'" in out, \
        out[-4000:]
    # A malformed one, then a real stall: still detected (before, the
    # record ended every watchdog thread and the stall hung the job).
    out, returncode, ended = run_stuck("--stuck", "input", "--where",
                                       "inside", "--timeout", str(TIMEOUT),
                                       "--hostile-record", "malformed")
    assert "posted a malformed abort record" in out, out[-4000:]
    assert returncode != 0, out[-4000:]
    assert "ignores the record 'abort'" in out, out[-4000:]
    assert re.search(r"\[0\]<stderr>:\[group_embedding\] rank 0: collective "
                     r"timeout: rank 0 waited .* for rank 1\.", out), \
        out[-4000:]


def _post(url, value):
    try:
        _put(url, value)
    except (OSError, urllib.error.URLError):
        pass  # e.g. the server cut a huge one short: tried, as a stranger


def _set_phase(folder, phase):
    (folder / "phase.tmp").write_text(phase)
    os.rename(folder / "phase.tmp", folder / "phase")


def _post_interleaved(folder, address, signed):
    """The issue's records, then 1,200 random and mutated ones, each block
    posted under a scope nobody reads (phase `control`), then under the
    watchdog's (`attack`): both phases see the same traffic and, block by
    block, the same load from the rest of the host."""
    issue = [[json.dumps({"body": "x", "mac": "\ud800"}).encode()],
             [b"[" * 100000], [b"x" * (1 << 30)]]
    fuzz = _fuzz(3700, 1200, signed)
    blocks = issue + [fuzz[i:i + 100] for i in range(0, len(fuzz), 100)]
    keys = ["abort"] * 4 + ["rank_0", "rank_1"]
    phases = [("control", "stranger_control"),
              ("attack", "group_embedding_watchdog")]
    for n, block in enumerate(blocks):
        # Either phase first, in turn: neither gets the start of a block.
        for phase, scope in phases[::1 if n % 2 else -1]:
            _set_phase(folder, phase)
            for i, raw in enumerate(block):
                key = "abort" if len(block) == 1 else keys[i % len(keys)]
                _post(f"http://{address}/{scope}/{key}", raw)
                time.sleep(0.004)
            if len(block) == 1:
                time.sleep(1.5)  # several rounds of every watchdog


def test_stranger_records_in_a_real_job(tmp_path):
    # A 2-worker job trains; a stranger (no secret) posts the issue's
    # records to its store (a lone surrogate, '[' x 100000, 1 GiB), then
    # 1,200 random and mutated ones. Before, the first two stopped every
    # worker within ~1 s and the third cost each worker +2 GB and 2.3x
    # slower steps. Now: every round of the watchdog stays cheap, nothing
    # is read whole, the steps are as fast as under the same traffic to
    # keys nobody reads (the control: the poster and the server share the
    # cores), and the watchdogs still stop the job, naming the worker,
    # when one gets stuck at the end (not blinded).
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", FUZZ_DIR=str(tmp_path))
    env[watchdog.ENV_TIMEOUT] = str(TIMEOUT)
    proc = subprocess.Popen(
        [horovodrun, "-np", "2", "--gloo", sys.executable,
         os.path.join(_HERE, "collective_store_fuzz.py")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, start_new_session=True)
    try:
        store_file = tmp_path / "store"
        deadline = time.monotonic() + HANG_AFTER
        while not store_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, \
                "the job never started training"
            time.sleep(0.2)
        address = store_file.read_text()
        signed = None
        while signed is None:
            try:
                with urllib.request.urlopen(
                        f"http://{address}/group_embedding_watchdog/"
                        f"rank_0", timeout=5) as r:
                    signed = r.read()
            except urllib.error.HTTPError:
                time.sleep(0.1)
        _post_interleaved(tmp_path, address, signed)
        _set_phase(tmp_path, "stop")
        out, _ = proc.communicate(timeout=HANG_AFTER)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        print(proc.communicate()[0][-6000:])
        raise
    ended = time.time()
    assert "the collective watchdog failed" not in out, out[-4000:]
    assert "stops: " not in out.split("worker 1 stuck at")[0], out[-4000:]
    for rank in (0, 1):
        stats = {}
        for phase in ("control", "attack"):
            m = re.search(
                rf"worker {rank} {phase}: steps (\d+) median ([\d.]+) s cpu "
                rf"([\d.]+) s; "
                rf"watchdog rounds (\d+) cpu mean ([\d.]+) max ([\d.]+) "
                rf"wall max ([\d.]+) interval ([\d.]+)", out)
            assert m, out[-4000:]
            stats[phase] = [float(x) for x in m.groups()]
        steps, median, step_cpu, rounds, cpu, _, wall, interval = \
            stats["attack"]
        assert rounds >= 10 and steps >= 20, stats
        # The watchdog thread's cost per round, against its interval: the
        # most it can take from the job (1 GiB read whole: seconds).
        assert cpu <= 0.1 * interval, stats
        assert wall < interval, stats
        # Attacked vs under the same traffic to keys nobody reads: the
        # process's CPU time per step (the watchdog thread's work lands
        # there) within 10%; the wall-clock median, which on a shared
        # 2-core machine swings with other processes (up to 3x from one
        # second to the next was seen), only against a gross stall, such
        # as a step waiting for a round that reads a whole record.
        assert step_cpu <= 1.1 * stats["control"][2], stats
        assert median <= 1.5 * stats["control"][1], stats
        growth = int(re.search(rf"worker {rank} attack rss growth (\d+)",
                               out).group(1))
        print(f"worker {rank}: {stats}, attack rss growth {growth}")
        assert growth < 64 << 20, growth
        # Each of the issue's records: ignored with a line.
        for why in ("not a signed record", "RecursionError",
                    "1073741824 bytes, more than"):
            assert re.search(
                rf"\[{rank}\]<stderr>:\[group_embedding\] rank {rank}: the "
                rf"collective watchdog ignores the record 'abort' of the "
                rf"key-value store: .*{why}", out), (why, out[-4000:])
    # Not blinded: worker 1 stuck after all this is found and named.
    stalled = re.search(r"worker 1 stuck at ([\d.]+)", out)
    assert stalled, out[-4000:]
    assert re.search(r"\[0\]<stderr>:\[group_embedding\] rank 0: collective "
                     r"timeout: rank 0 waited [\d.]+ s .* for rank 1\.",
                     out), out[-4000:]
    assert proc.returncode != 0 and "finished" not in out, out[-4000:]
    assert ended - float(stalled.group(1)) < TIMEOUT + 25, out[-4000:]


def test_idle_and_lagging_workers_do_not_time_out():
    # Idle 2x the timeout outside collectives, a laggard at half of it.
    out, returncode, _ = run_stuck("--stuck", "none", "--function",
                                   "--timeout", str(TIMEOUT))
    assert returncode == 0, out[-4000:]
    assert out.count("finished") == 2, out[-4000:]
    assert "collective timeout" not in out, out[-4000:]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf")])
def test_bad_timeout_fails_before_starting_horovod(value):
    with pytest.raises(ValueError, match=r"Invalid `collective_timeout`: "):
        ge.enable_distributed_strategy("collective",
                                       collective_timeout=value)
    with pytest.raises(TypeError, match=r"`collective_timeout` must be a "
                                        r"number of seconds, but got str"):
        ge.enable_distributed_strategy("collective",
                                       collective_timeout="300")
    assert not distributed_strategy.is_collective()


def test_bad_timeout_environment_variable_fails(monkeypatch):
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "5min")
    with pytest.raises(ValueError, match=r"Invalid GROUP_EMBEDDING_"
                                         r"COLLECTIVE_TIMEOUT: '5min'"):
        ge.enable_distributed_strategy("collective")
    assert not distributed_strategy.is_collective()


def test_timeout_resolution(monkeypatch):
    monkeypatch.delenv(watchdog.ENV_TIMEOUT, raising=False)
    assert watchdog.resolve_timeout(None) == 300
    monkeypatch.setenv(watchdog.ENV_TIMEOUT, "2.5")
    assert watchdog.resolve_timeout(None) == 2.5
    assert watchdog.resolve_timeout(0) == 0  # the argument wins


def test_find_stuck_names_ranks_behind_silent_or_missing():
    beat = {"entered": 7, "exited": 6, "time": 100.0}
    heartbeats = {
        1: dict(beat),                                   # in it too
        2: {"entered": 6, "exited": 6, "time": 100.0},   # never came
        3: {"entered": 7, "exited": 6, "time": 10.0},    # silent
        4: None,                                         # never reported
        5: {"entered": 5, "exited": 4, "time": 100.0},   # an earlier one
    }
    reasons = watchdog.find_stuck(0, 6, 6, heartbeats, now=101.0,
                                  stale_after=30)
    assert [r.split(" (")[0] for r in reasons] == [
        "rank 2", "rank 3", "rank 4", "rank 5"]
    assert "outside any collective" in reasons[0]
    assert "silent for 91 s" in reasons[1]
    assert "never reported" in reasons[2]
    assert "blocked in collective 5" in reasons[3]
    assert watchdog.find_stuck(0, 2, 6, {1: beat}, 101.0, 30) == []


class _Store:
    def __init__(self):
        self.data = {}

    def put(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data.get(key)


class _Counters:
    def __init__(self):
        self.entered = self.exited = 0

    def read(self):
        return self.entered, self.exited


SECRET = b"s" * 32


def _watchdog(rank, store, counters, exits, secret=SECRET):
    return watchdog.Watchdog(rank, 2, 1.0, counters, store, interval=0.01,
                             exit_fn=exits.append, secret=secret)


def _body(store, key):
    return watchdog.decode_record(SECRET, key, store.data[key], 2)


def test_watchdog_rounds_blocked_worker_stops_both():
    store, exits = _Store(), []
    c0, c1 = _Counters(), _Counters()
    w0, w1 = (_watchdog(0, store, c0, exits),
              _watchdog(1, store, c1, exits))
    c0.entered, c0.exited = 4, 3  # rank 0 waits in collective 4...
    c1.entered = c1.exited = 3    # ...that rank 1 never reaches
    w0.check()
    w1.check()
    assert exits == []  # not yet longer than the timeout
    w0._blocked_since -= 2.0
    w1.check()
    w0.check()
    assert len(exits) == 1, exits
    assert "rank 0: collective timeout: rank 0 waited 2.0 s" in exits[0]
    assert "in collective 4 for rank 1. Stuck: rank 1 (entered 3 " \
        "collectives, now outside any collective" in exits[0]
    w1.check()
    assert exits[1].startswith("[group_embedding] rank 1 stops: collective "
                               "timeout: rank 0 waited")
    assert _body(store, "abort")["message"] in exits[1]


def test_watchdog_progress_resets_the_clock():
    store, exits, c = _Store(), [], _Counters()
    w = _watchdog(0, store, c, exits)
    c.entered, c.exited = 5, 4
    w.check()
    w._blocked_since -= 2.0
    c.exited, c.entered = 5, 6  # completed one, now in the next
    w.check()
    assert exits == []
    assert _body(store, "rank_0")["blocked_for"] < 1.0


# Records anyone who reaches horovodrun's key-value store can post: JSON of
# the wrong shape, wrong types, and aborts without the job's signature
# (the old format, a forged MAC, a MAC of another key or secret).
_HOSTILE_ABORTS = [
    b"not json",
    b"[1, 2]",
    json.dumps({"exit_at": 0}).encode(),                    # no message
    json.dumps({"message": None, "exit_at": "x"}).encode(),
    json.dumps({"message": "stop", "exit_at": 0}).encode(),  # unsigned
    json.dumps({"body": json.dumps({"message": "stop", "exit_at": 0,
                                    "rank": 1}),
                "mac": "00" * 32}).encode(),                # forged MAC
    watchdog.encode_record(b"x" * 32, "abort", {         # other secret
        "message": "stop", "exit_at": 0, "rank": 1}),
    watchdog.encode_record(SECRET, "rank_1", {          # another key's
        "message": "stop", "exit_at": 0, "rank": 1}),
    watchdog.encode_record(SECRET, "abort", {           # signed, bad
        "message": "stop", "exit_at": float("nan"), "rank": 1}),
    watchdog.encode_record(SECRET, "abort", {
        "message": "stop", "exit_at": 0, "rank": 7}),
    # Issue 37: a lone surrogate (UnicodeEncodeError in .encode() before,
    # outside the decoder's error handling) and nesting past the recursion
    # limit (RecursionError): both stopped every worker.
    json.dumps({"body": "x", "mac": "\ud800"}).encode(),
    json.dumps({"body": "\udfff", "mac": "0" * 64}).encode(),
    b"[" * 100000,
    b'{"body": ' + b"[" * 100000 + b"]" * 100000 + b', "mac": "00"}',
    b"\xff\xfe not UTF-8",
    # Signed, with what only the job could put there: still no crash.
    watchdog.encode_record(SECRET, "abort", {
        "message": "stop", "exit_at": 10**400, "rank": 1}),
    watchdog.encode_record(SECRET, "abort", {
        "message": "stop", "exit_at": 0, "rank": 10**400}),
    watchdog.encode_record(SECRET, "abort", {
        "message": "x" * 65537, "exit_at": 0, "rank": 1}),
]


@pytest.mark.parametrize("raw", _HOSTILE_ABORTS)
def test_malformed_or_unsigned_abort_is_ignored_with_a_line(raw, capsys):
    # Before, a record missing a field raised KeyError in the thread (its
    # end, silently), and an unsigned abort stopped every worker.
    store, exits, c = _Store(), [], _Counters()
    w = _watchdog(0, store, c, exits)
    store.data["abort"] = raw
    w.check()
    w.check()
    assert exits == []
    err = capsys.readouterr().err
    assert err.count("the collective watchdog ignores the record "
                     "'abort'") == 1, err  # once, not every round
    # A signed abort is still obeyed.
    store.data["abort"] = watchdog.encode_record(SECRET, "abort", {
        "message": "stop now", "exit_at": 0, "rank": 1})
    w.check()
    assert exits == ["[group_embedding] rank 0 stops: stop now"]


@pytest.mark.parametrize("heartbeat", [
    b"{}", json.dumps({"entered": 4, "exited": 3}).encode(),
    watchdog.encode_record(SECRET, "rank_1", {
        "entered": "4", "exited": 3, "blocked_for": 0, "time": 0}),
    watchdog.encode_record(SECRET, "rank_1", {
        "entered": 3, "exited": 4, "blocked_for": 0, "time": 0}),
    watchdog.encode_record(b"x" * 32, "rank_1", {
        "entered": 9, "exited": 9, "blocked_for": 0, "time": 1e12}),
])
def test_invalid_heartbeat_counts_as_missing(heartbeat, capsys):
    # A forged heartbeat cannot make a stuck worker look alive, and a
    # malformed one (KeyError/TypeError before) does not end the check.
    store, exits, c = _Store(), [], _Counters()
    w = _watchdog(0, store, c, exits)
    c.entered, c.exited = 4, 3
    store.data["rank_1"] = heartbeat
    w.check()
    w._blocked_since -= 2.0
    w.check()
    assert len(exits) == 1, exits
    assert "Stuck: rank 1 (never reported, or no valid record" in exits[0]
    assert "ignores the record 'rank_1'" in capsys.readouterr().err
    assert _body(store, "abort")["rank"] == 0


def _fuzz(seed, count, signed):
    """`count` records a stranger could post: random bytes, and mutations
    of `signed` (a real record, which anyone can read from the store)."""
    rng = random.Random(seed)
    pieces = [b"[", b"{", b'"', b"\\ud800", b"\\udc00", b"\xff", b"\x00",
              b"1" * 5000, b"1e999", b"NaN", b"-Infinity", b'"body"',
              b'"mac"', b":", b",", b"}", b"]", b"\\", b"\n"]
    out = []
    for i in range(count):
        kind = i % 6
        raw = bytearray(signed)
        if kind == 0:
            out.append(bytes(rng.getrandbits(8)
                             for _ in range(rng.randrange(0, 300))))
            continue
        if kind == 1:  # flipped bytes
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.getrandbits(8)
        elif kind == 2:  # cut, or a slice repeated
            a, b = sorted(rng.randrange(len(raw) + 1) for _ in range(2))
            raw = raw[:a] if rng.random() < 0.5 else raw[:b] + raw[a:]
        elif kind == 3:  # JSON pieces spliced in
            for _ in range(rng.randrange(1, 5)):
                at = rng.randrange(len(raw) + 1)
                raw[at:at] = rng.choice(pieces) * rng.choice((1, 2, 3000))
        elif kind == 4:  # nested
            depth = rng.choice((10, 1000, 50000))
            raw = (b"[" * depth + raw + b"]" * depth
                   if rng.random() < 0.5 else b'{"a":' * depth + raw)
        else:  # a digit of the signed body changed
            digits = [j for j, c in enumerate(raw) if 48 <= c <= 57]
            raw[rng.choice(digits)] = rng.choice(b"0123456789")
        out.append(bytes(raw))
    return out


def test_fuzzed_records_are_ignored_with_a_line_each(capsys):
    # Every decoding failure is "ignored, one line on stderr", whatever
    # the bytes; a valid abort is still obeyed afterwards.
    store, exits, c = _Store(), [], _Counters()
    w = _watchdog(0, store, c, exits)
    w.check()
    records = _fuzz(37, 3000, store.data["rank_0"])
    for raw in records:
        store.data["abort"] = raw
        w.check()
    assert exits == []
    lines = capsys.readouterr().err.splitlines()
    distinct = {r for r in records if r != store.data["rank_0"]}
    assert len(lines) == min(len(distinct), 1001), lines[-3:]
    assert all("the collective watchdog ignores the record 'abort'" in line
               or "ignores the next ones without a line" in line
               for line in lines), [x for x in lines if "ignores" not in x]
    assert all(len(line) < 500 for line in lines)
    store.data["abort"] = watchdog.encode_record(SECRET, "abort", {
        "message": "stop now", "exit_at": 0, "rank": 1})
    w.check()
    assert exits == ["[group_embedding] rank 0 stops: stop now"]


def _kv_server():
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer()
    return server, server.start()


def _put(url, value):
    request = urllib.request.Request(url, data=value, method="PUT")
    urllib.request.urlopen(request, timeout=60).close()


def test_store_reads_at_most_the_record_cap():
    # Against horovodrun's own server: a record past the cap is refused
    # on its announced length, unread; one at the cap is read.
    server, port = _kv_server()
    try:
        store = watchdog.RendezvousStore("127.0.0.1", str(port))
        url = f"http://127.0.0.1:{port}/group_embedding_watchdog/abort"
        cap = watchdog.MAX_RECORD_BYTES
        _put(url, b"x" * cap)
        assert store.get("abort") == b"x" * cap
        _put(url, b"x" * (cap + 1))
        with pytest.raises(watchdog.InvalidRecord,
                           match=rf"{cap + 1} bytes, more than {cap}: not "
                                 r"read"):
            store.get("abort")
        _put(url, b"x" * (256 << 20))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        start = time.monotonic()
        for _ in range(10):
            with pytest.raises(watchdog.InvalidRecord, match="not read"):
                store.get("abort")
        # Before: each read took the whole record (+2 GB at 1 GiB).
        assert time.monotonic() - start < 5
        assert _status("VmHWM") - before < 16 << 20
        assert store.get("missing") is None
    finally:
        server.stop()


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_watchdog_thread_survives_hostile_records_and_still_stops(capsys):
    # The thread itself, with garbage in the store from the start: it must
    # still stop the worker when it is blocked past the timeout (before,
    # the first malformed abort ended the thread without a word).
    store, c = _Store(), _Counters()
    stopped = threading.Event()
    w = watchdog.Watchdog(0, 2, 0.2, c, store, interval=0.02,
                          exit_fn=lambda m: stopped.set(), secret=SECRET)
    store.data["abort"] = json.dumps({"exit_at": 0}).encode()
    store.data["rank_1"] = json.dumps({"entered": "x"}).encode()
    c.entered, c.exited = 2, 1
    w.start()
    assert stopped.wait(10), capsys.readouterr().err
    err = capsys.readouterr().err
    assert "rank 0: collective timeout" in err, err


def test_unexpected_exception_in_the_thread_stops_the_worker(capsys):
    # Not a store error: a bug. The thread reports it and stops the
    # worker instead of ending quietly.
    class BrokenCounters(_Counters):
        def read(self):
            raise RuntimeError("counter read failed")

    stopped = []
    w = watchdog.Watchdog(0, 2, 1.0, BrokenCounters(), _Store(),
                          interval=0.01, exit_fn=stopped.append,
                          secret=SECRET)
    w.start()
    w._thread.join(10)
    assert not w._thread.is_alive()
    assert len(stopped) == 1
    err = capsys.readouterr().err
    assert "the collective watchdog failed, so this worker stops" in err
    assert "RuntimeError: counter read failed" in err


def test_store_errors_are_retried_not_fatal():
    class FlakyStore(_Store):
        calls = 0

        def put(self, key, value):
            self.calls += 1
            if self.calls < 3:
                raise OSError("connection refused")
            super().put(key, value)

    store, stopped = FlakyStore(), []
    w = watchdog.Watchdog(0, 2, 1.0, _Counters(), store, interval=0.01,
                          exit_fn=stopped.append, secret=SECRET)
    w.start()
    deadline = time.time() + 10
    while "rank_0" not in store.data and time.time() < deadline:
        time.sleep(0.01)
    assert "rank_0" in store.data and stopped == []
    assert w._thread.is_alive()


def test_no_secret_yet_means_no_round():
    # Before the workers connect nothing is watched and nothing can be
    # signed: the round does nothing (and does not fail).
    store, exits, c = _Store(), [], _Counters()
    w = _watchdog(0, store, c, exits, secret=lambda: None)
    store.data["abort"] = b"garbage"
    w.check()
    assert exits == [] and "rank_0" not in store.data
