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
"""

import json
import os
import socket
import struct
import sys


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


def main():
    names = worker_sockets()
    if not names:
        print(json.dumps({"error": "no group_embedding socket listed"}))
        sys.exit(2)
    for name in names:
        for kind, hello in greetings(name):
            print(json.dumps(attack(name, kind, hello)), flush=True)


if __name__ == "__main__":
    main()
