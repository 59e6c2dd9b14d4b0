"""Two hosts on one machine: network namespaces joined by a veth pair.

`TwoHosts` makes two network namespaces, each a "host" with its own host
name (a UTS namespace per command), address (192.0.2.1 and 192.0.2.2,
TEST-NET-1, on an interface `ge0` in each) and `/etc/hosts` (`ip netns
exec` mounts `/etc/netns/NS/hosts` over it), joined by a veth pair. Nothing
in the root namespace can reach them (connections into a created namespace
are refused here), so horovodrun itself runs on host A, as a user logs in
to one node and launches from there:

    horovodrun -np 2 -H ge-host-a:1,ge-host-b:1 python script.py

horovodrun starts the workers of other hosts with `ssh HOST COMMAND`;
there is no sshd, so an `ssh` first on PATH maps the host name to its
namespace and runs the command there. Like `ssh` without a terminal, it
does not pass the launcher's signals on: when horovodrun stops the job,
a remote worker must end by itself (its peers' sockets, the collective
watchdog); this shim only stops waiting for it. A remote worker's output
(stdout and stderr together) is also kept in `remote_log(host)`.

Everything made here (namespaces, veth, /etc/netns/NS) is removed by
`close()`, also after a failure; `skip_reason()` says why the machine
cannot do it (not root, no `ip`, no network namespaces).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

ADDRESSES = ("192.0.2.1", "192.0.2.2")
HOSTS = ("ge-host-a", "ge-host-b")
INTERFACE = "ge0"
_SSH_SHIM = '''#!{python}
"""ssh HOST COMMAND for the test's namespaces (see two_hosts.py)."""
import json, os, signal, subprocess, sys
hosts = json.load(open({hosts!r}))
# Options may also follow the host (horovodrun puts -o there), as ssh
# allows; the command starts at the first word after the host.
args, host = [a for a in sys.argv[1:] if a], None
while args and (host is None or args[0].startswith("-")):
    if args[0] in ("-o", "-p", "-i", "-l"):
        args = args[2:]
    elif args[0].startswith("-"):
        args = args[1:]
    else:
        host, args = args[0], args[1:]
command = " ".join(args)
if host not in hosts:
    sys.exit(f"ssh: Could not resolve hostname {{host}}")
# A session of its own: horovodrun's signals to this "ssh" stay here.
# The output also goes to remote-HOST.log, which keeps what a worker says
# after the launcher has gone (tee -p goes on without its pipe).
log = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                   f"remote-{{host}}.log")
remote = subprocess.Popen(
    ["ip", "netns", "exec", hosts[host], "unshare", "--uts", "bash", "-c",
     'hostname "$1" && set -o pipefail && '
     '{{ bash -c "$2"; }} 2>&1 | tee -p -a "$3"', "bash", host, command,
     log], start_new_session=True, stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda *_: os._exit(255))
# Relayed here, as ssh does: when this "ssh" ends, the launcher's pipe
# closes, whatever the remote worker does.
while chunk := os.read(remote.stdout.fileno(), 65536):
    os.write(1, chunk)
sys.exit(remote.wait() % 256)
'''


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True,
                          check=check)


def skip_reason():
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    if shutil.which("unshare") is None:
        return "needs util-linux's `unshare`"
    if not os.path.exists("/proc/self/ns/net"):
        return "the kernel has no network namespaces"
    return None


class TwoHosts:
    """Two namespaced hosts; use as a context manager.

    Args:
        workdir: a folder for the ssh shim (and its host map).
    """

    def __init__(self, workdir):
        tag = f"ge{os.getpid() % 100000}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self._veth = (f"{tag}va", f"{tag}vb")
        self._bin = os.path.join(str(workdir), "bin")
        self._made = []

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make(self):
        hosts_file = "".join(f"{a} {h}\n" for a, h in zip(ADDRESSES, HOSTS))
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self._made.append(ns)
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n" + hosts_file)
        _ip("link", "add", self._veth[0], "type", "veth", "peer", "name",
            self._veth[1])
        for ns, veth, address in zip(self.namespaces, self._veth,
                                     ADDRESSES):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "link", "set", veth, "name", INTERFACE)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        os.makedirs(self._bin, exist_ok=True)
        host_map = os.path.join(self._bin, "hosts.json")
        with open(host_map, "w") as f:
            json.dump(dict(zip(HOSTS, self.namespaces)), f)
        ssh = os.path.join(self._bin, "ssh")
        with open(ssh, "w") as f:
            f.write(_SSH_SHIM.format(python=sys.executable, hosts=host_map))
        os.chmod(ssh, 0o755)

    def remote_log(self, host):
        """What the workers started over ssh on `host` (0 or 1) said."""
        try:
            with open(os.path.join(self._bin, os.pardir,
                                   f"remote-{HOSTS[host]}.log")) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def pids(self, host):
        """Processes in `host`'s namespace (0 or 1), their command lines."""
        got = _ip("netns", "pids", self.namespaces[host], check=False)
        out = {}
        for pid in got.stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read().replace(b"\0", b" ").decode()
            except OSError:
                pass
        return out

    def workers(self, script):
        """(host, pid) of every process running `script`, both hosts."""
        return [(h, pid) for h in (0, 1)
                for pid, cmd in self.pids(h).items()
                if script in cmd and "python" in cmd.split()[0]
                and "horovodrun" not in cmd]

    def launch(self, args, env=None, **popen_kwargs):
        """Runs `args` on host A (as its own session), with the ssh shim
        first on PATH; returns the Popen."""
        env = dict(os.environ if env is None else env)
        env["PATH"] = self._bin + os.pathsep + env.get("PATH", "")
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[0], "unshare", "--uts",
             "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh",
             HOSTS[0], *args],
            env=env, start_new_session=True, **popen_kwargs)

    def set_link(self, host, up):
        """Takes `host`'s end of the veth pair down (or up again)."""
        _ip("-n", self.namespaces[host], "link", "set", INTERFACE,
            "up" if up else "down")

    def delay(self, host, seconds):
        """Delays every packet `host` sends by `seconds`: netem where the
        kernel has it, else a token bucket at 8 bit/s whose queue holds a
        packet for minutes (one frame of 1500 bytes takes 1500 s).
        Returns the qdisc used."""
        tc = ["ip", "netns", "exec", self.namespaces[host], "tc", "qdisc",
              "add", "dev", INTERFACE, "root"]
        netem = subprocess.run(tc + ["netem", "delay", f"{seconds}s"],
                               capture_output=True, text=True)
        if netem.returncode == 0:
            return "netem"
        subprocess.run(tc + ["tbf", "rate", "8bit", "burst", "1600",
                             "latency", f"{max(seconds, 1)}s"],
                       capture_output=True, text=True, check=True)
        return "tbf"

    def close(self):
        """Ends what runs in the namespaces and removes them."""
        for i, ns in enumerate(self._made):
            for _ in range(50):
                pids = self.pids(i)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
        for ns in self._made:
            _ip("netns", "del", ns, check=False)  # its veth end goes too
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made = []
