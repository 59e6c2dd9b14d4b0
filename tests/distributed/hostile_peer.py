"""A stranger on the host trying to join a starting collective job.

Standard library only: test_peer_transport.py runs it as `nobody` (with
setpriv) under the system Python. It does what any local user can: list
the abstract Unix sockets in /proc/net/unix, connect to every one that
looks like a group_embedding worker's, and claim to be worker 0: with the
old greeting (the job token that the old socket names carried, then the
rank) and with the new one (magic, a guessed job id, ranks, a nonce).
For each socket it prints one JSON line: the name, whether the connection
was made, and the bytes the worker answered before closing (none: it
refused the stranger before saying anything).

Two more strangers, for test_two_hosts.py (a worker's slots):
  --trickle HOST:PORT  holds `--count` TCP connections to a worker's
      listener, each sending one byte every 6 s, and opens a new one for
      each that is dropped, for `--seconds`;
  --flood NAME         keeps opening connections to the abstract Unix
      socket NAME (up to `--count` open) for `--seconds`.
Each prints one JSON line at the end: connections made and dropped.
"""

import argparse
import json
import os
import select
import socket
import struct
import sys
import time


def worker_sockets():
    """Abstract names of listening group_embedding sockets."""
    names = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            # Flags 00010000: a listening socket.
            if len(fields) >= 8 and fields[3] == "00010000" and \
                    fields[7].startswith("@group_embedding/"):
                names.append("\0" + fields[7][1:])
    return sorted(set(names))


def greetings(name):
    parts = name[1:].split("/")
    token = b"\0" * 16
    if len(parts) == 3:  # the old names: group_embedding/<token>/<rank>
        try:
            token = bytes.fromhex(parts[1])
        except ValueError:
            pass
    old = struct.pack("!16sq", token, 0)
    new = struct.pack("!8s16sqq32s", b"GEPEER2\0", os.urandom(16), 0, 1,
                      os.urandom(32))
    return [("old", old), ("new", new)]


def attack(name, kind, hello):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    result = {"name": name[1:], "greeting": kind, "uid": os.getuid()}
    try:
        s.connect(name)
    except OSError as e:
        result.update(connected=False, error=str(e))
        return result
    result["connected"] = True
    answer = b""
    try:
        s.sendall(hello)
        # The old worker answered nothing and waited for the memfd
        # exchange; offer to go on, then read what comes.
        while len(answer) < 4096:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        result["closed"] = True
    except socket.timeout:
        result["closed"] = False  # still open: it took us in
    except OSError as e:
        result["closed"] = True
        result["error"] = str(e)
    finally:
        s.close()
    result["answered"] = len(answer)
    return result


def _open(family, address):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(address)
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s


def hold(family, address, count, seconds, trickle):
    """Keeps `count` connections to `address` open for `seconds`, a new
    one for each dropped; with `trickle`, one byte each every 6 s."""
    made = dropped = 0
    held = []
    end = time.monotonic() + seconds
    next_byte = time.monotonic() + 6
    while time.monotonic() < end:
        while len(held) < count:
            s = _open(family, address)
            if s is None:
                break
            made += 1
            held.append(s)
        if trickle and time.monotonic() >= next_byte:
            next_byte += 6
            for s in held:
                try:
                    s.send(b"G")
                except OSError:
                    pass
        ready = select.select(held, [], [], 0.05)[0] if held else []
        for s in ready:
            try:
                gone = s.recv(4096) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                dropped += 1
                held.remove(s)
                s.close()
        if not held:
            time.sleep(0.01)
    for s in held:
        s.close()
    print(json.dumps({"uid": os.getuid(), "made": made,
                      "dropped": dropped}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trickle")
    parser.add_argument("--flood")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30)
    args = parser.parse_args()
    if args.trickle:
        host, port = args.trickle.rsplit(":", 1)
        hold(socket.AF_INET, (host, int(port)), args.count, args.seconds,
             True)
        return
    if args.flood:
        hold(socket.AF_UNIX, "\0" + args.flood, args.count, args.seconds,
             False)
        return
    names = worker_sockets()
    if not names:
        print(json.dumps({"error": "no group_embedding socket listed"}))
        sys.exit(2)
    for name in names:
        for kind, hello in greetings(name):
            print(json.dumps(attack(name, kind, hello)), flush=True)


if __name__ == "__main__":
    main()
