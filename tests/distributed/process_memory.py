"""A process's own memory figures, for the scripts that bound what a
stranger or a hostile peer can make a worker allocate."""


def status_bytes(field):
    """`field` of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")
