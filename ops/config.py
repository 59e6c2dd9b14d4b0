"""The `GROUP_EMBEDDING_*` environment variables: read here, and only here.

Every setting the library takes from the environment is listed in
`VARIABLES` (name, values, default, what it changes) and read by one
function below, which checks the value and names the variable in its
error. Other modules ask these functions; none reads `os.environ` for a
`GROUP_EMBEDDING_*` name itself (tests/ops/test_config.py checks it).

Values are read on every call, not once: tests and users switch the kernel
mode between lookups (the capability snapshot of `capabilities.py` is
keyed on it), and the collective settings are read when collective mode
is enabled.

Why in `ops/` (installed as `group_embedding.ops`): every layer reads
settings, the kernel libraries of `ops/` included, and `ops/` is the
lowest layer; this module imports nothing of the package, so the lookup
core and `group_embedding/distributed/` can both import it without a
cycle (and the core still never imports `distributed/`).
"""

import contextlib
import dataclasses
import enum
import math
import os
from typing import Iterator
from typing import Optional
from typing import Tuple
from typing import TypeVar


class Choice(str, enum.Enum):
    """A closed choice whose members are their string values.

    `Choice` members compare equal to, hash like, print and format as their
    value ("auto" == KernelMode.AUTO), so that code and tests written
    against the strings keep working.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class KernelMode(Choice):
    """`GROUP_EMBEDDING_KERNELS`: which kernels the lookups use."""

    AUTO = "auto"
    CUSTOM = "custom"
    TF = "tf"
    CUDA = "cuda"


class Transport(Choice):
    """`GROUP_EMBEDDING_TRANSPORT`: how collective-mode workers exchange."""

    AUTO = "auto"
    SOCKETS = "sockets"
    HOROVOD = "horovod"


class SameHostLink(Choice):
    """`GROUP_EMBEDDING_TRANSPORT_SAME_HOST`: how workers on one host
    connect."""

    SHM = "shm"
    UNIX = "unix"
    TCP = "tcp"


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable, as documented.

    Attributes:
        name: the variable's name.
        values: what it may hold.
        default: what applies when it is unset.
        effect: what it changes.
    """

    name: str
    values: str
    default: str
    effect: str


KERNELS = "GROUP_EMBEDDING_KERNELS"
CACHE = "GROUP_EMBEDDING_CACHE"
NVCC = "GROUP_EMBEDDING_NVCC"
CUDA_ARCHS = "GROUP_EMBEDDING_CUDA_ARCHS"
COLLECTIVE_TIMEOUT = "GROUP_EMBEDDING_COLLECTIVE_TIMEOUT"
TRANSPORT = "GROUP_EMBEDDING_TRANSPORT"
TRANSPORT_HOST = "GROUP_EMBEDDING_TRANSPORT_HOST"
TRANSPORT_SAME_HOST = "GROUP_EMBEDDING_TRANSPORT_SAME_HOST"
TRANSPORT_SHM_BYTES = "GROUP_EMBEDDING_TRANSPORT_SHM_BYTES"
TRANSPORT_MAX_BYTES = "GROUP_EMBEDDING_TRANSPORT_MAX_BYTES"
HBM_ON_HOST = "GROUP_EMBEDDING_HBM_ON_HOST"

# Defaults that other modules quote (messages, docstrings).
DEFAULT_CUDA_ARCHS: Tuple[str, ...] = ("75", "80", "86", "89", "90")
DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 300.0
DEFAULT_SHM_BYTES = 64 << 20
DEFAULT_MAX_BYTES_PER_PEER = 4 << 30

VARIABLES: Tuple[Variable, ...] = (
    Variable(KERNELS, "auto | custom | tf | cuda", "auto",
             "Which kernels the lookups, id conversions and sparse updates "
             "build: auto = the C++ CPU kernels, on a GPU the GPU kernels "
             "when they load (else pure TF); custom = the C++ kernels or "
             "an error (pure TF on a GPU); cuda = the GPU kernels on a GPU "
             "or an error; tf = stock TF ops only. Read on every lookup."),
    Variable(CACHE, "a folder",
             "$XDG_CACHE_HOME/group_embedding, else "
             "~/.cache/group_embedding",
             "Where kernel libraries compiled on first use are kept."),
    Variable(NVCC, "the path of a CUDA compiler",
             "PyPI's nvidia-cuda-nvcc, else nvcc on the PATH, else "
             "/usr/local/cuda/bin/nvcc",
             "The compiler of the GPU kernels."),
    Variable(CUDA_ARCHS, "compute capabilities, comma or semicolon "
             "separated (e.g. 90)", ",".join(DEFAULT_CUDA_ARCHS),
             "The GPUs the GPU kernels are compiled for (plus PTX of the "
             "last)."),
    Variable(COLLECTIVE_TIMEOUT, "seconds >= 0 (0: none)",
             f"{DEFAULT_COLLECTIVE_TIMEOUT_SECONDS:g}",
             "How long a collective-mode worker waits for the others "
             "before every worker stops naming the stuck one (when "
             "`enable_distributed_strategy` gets no `collective_timeout`)."),
    Variable(TRANSPORT, "auto | sockets | horovod", "auto",
             "The collective exchanges: auto = the peer sockets when the "
             "C++ kernels are loaded, else Horovod; sockets = the peer "
             "sockets or an error; horovod = Horovod's alltoall."),
    Variable(TRANSPORT_HOST, "an address",
             "the address of HOROVOD_HOSTNAME (or of this host's name)",
             "The address peers use to reach this worker's socket."),
    Variable(TRANSPORT_SAME_HOST, "shm | unix | tcp", "shm",
             "How workers on one host connect: shared memory behind a "
             "Unix socket, a Unix socket, or TCP."),
    Variable(TRANSPORT_SHM_BYTES, "bytes >= 1", str(DEFAULT_SHM_BYTES),
             "The size of each shared buffer of two workers on one host; "
             "larger blocks go on the socket."),
    Variable(TRANSPORT_MAX_BYTES, "bytes >= 1",
             str(DEFAULT_MAX_BYTES_PER_PEER),
             "The most a peer may make this worker allocate with one "
             "exchange whose counts it cannot know (ids and the rows they "
             "turn into)."),
    Variable(HBM_ON_HOST, "0 | 1", "0",
             "For tests on machines without a GPU: 1 runs "
             "`StorageType.HBM` EmbeddingVariables on the GPU adaptor "
             "built against the CUDA core's host stand-in (host memory, "
             "DEVICE_CPU) where TF sees no GPU, instead of refusing to "
             "create them. A test double, not a CPU backend: it is slow "
             "and never chosen on its own. Ignored where TF sees a GPU."),
)


_C = TypeVar("_C", bound=Choice)


def _choice(name: str, default: _C) -> _C:
    """Variable `name` as a member of `default`'s Enum (any case)."""
    kind = type(default)
    raw = os.environ.get(name, default.value).lower()
    allowed = [c.value for c in kind]
    if raw not in allowed:
        raise ValueError(f"Invalid `{name}`: {raw!r}, use one of "
                         f"{', '.join(allowed)}.")
    return kind(raw)


def kernel_mode() -> KernelMode:
    """`GROUP_EMBEDDING_KERNELS`, checked (default auto).

    Raises:
        ValueError: a value that is not a `KernelMode`.
    """
    return _choice(KERNELS, KernelMode.AUTO)


@contextlib.contextmanager
def kernel_mode_set(mode: KernelMode) -> Iterator[None]:
    """Sets `GROUP_EMBEDDING_KERNELS` to `mode` inside the block and
    restores what was there after (e.g. the frozen-graph export builds
    its graph with the pure-TF lookups)."""
    previous = os.environ.get(KERNELS)
    os.environ[KERNELS] = KernelMode(mode).value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[KERNELS]
        else:
            os.environ[KERNELS] = previous


def cache_dir() -> str:
    """`GROUP_EMBEDDING_CACHE`, else `$XDG_CACHE_HOME/group_embedding`,
    else `~/.cache/group_embedding`: an absolute path."""
    explicit = os.environ.get(CACHE)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = (os.environ.get("XDG_CACHE_HOME")
            or os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "group_embedding")


def nvcc() -> Optional[str]:
    """`GROUP_EMBEDDING_NVCC`, or None when unset (then searched)."""
    return os.environ.get(NVCC) or None


def cuda_archs() -> Tuple[str, ...]:
    """`GROUP_EMBEDDING_CUDA_ARCHS` as a tuple, else the defaults."""
    explicit = os.environ.get(CUDA_ARCHS)
    if explicit:
        return tuple(a.strip() for a in explicit.replace(";", ",").split(",")
                     if a.strip())
    return DEFAULT_CUDA_ARCHS


def collective_timeout() -> float:
    """`GROUP_EMBEDDING_COLLECTIVE_TIMEOUT` in seconds (default 300; 0
    disables the timeout).

    Raises:
        ValueError: not a number, negative, NaN or infinite.
    """
    raw = os.environ.get(COLLECTIVE_TIMEOUT)
    if raw is None or not raw.strip():
        return DEFAULT_COLLECTIVE_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or math.isinf(value):
        raise ValueError(
            f"Invalid {COLLECTIVE_TIMEOUT}: {raw!r}, use seconds >= 0 (0 "
            f"disables the collective timeout).")
    return value


def hbm_on_host() -> bool:
    """`GROUP_EMBEDDING_HBM_ON_HOST`: whether HBM EVs may run on the host
    stand-in where TF sees no GPU (tests only; default 0).

    Raises:
        ValueError: a value other than 0 or 1.
    """
    raw = os.environ.get(HBM_ON_HOST, "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"Invalid `{HBM_ON_HOST}`: {raw!r}, use 0 or 1.")
    return raw == "1"


def transport() -> Transport:
    """`GROUP_EMBEDDING_TRANSPORT`, checked (default auto).

    Raises:
        ValueError: a value that is not a `Transport`.
    """
    return _choice(TRANSPORT, Transport.AUTO)


def transport_host() -> Optional[str]:
    """`GROUP_EMBEDDING_TRANSPORT_HOST`, or None when unset."""
    return os.environ.get(TRANSPORT_HOST) or None


def same_host_link() -> SameHostLink:
    """`GROUP_EMBEDDING_TRANSPORT_SAME_HOST`, checked (default shm).

    Raises:
        ValueError: a value that is not a `SameHostLink`.
    """
    return _choice(TRANSPORT_SAME_HOST, SameHostLink.SHM)


def transport_shm_bytes() -> int:
    """`GROUP_EMBEDDING_TRANSPORT_SHM_BYTES` (default 64 MiB).

    Raises:
        ValueError: not an integer, or below 1.
    """
    cap = int(os.environ.get(TRANSPORT_SHM_BYTES, DEFAULT_SHM_BYTES))
    if cap < 1:
        raise ValueError(f"{TRANSPORT_SHM_BYTES} must be >= 1, got {cap}.")
    return cap


def transport_max_bytes() -> int:
    """`GROUP_EMBEDDING_TRANSPORT_MAX_BYTES` (default 4 GiB).

    Raises:
        ValueError: not an integer >= 1.
    """
    raw = os.environ.get(TRANSPORT_MAX_BYTES)
    if raw is None:
        return DEFAULT_MAX_BYTES_PER_PEER
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"Invalid {TRANSPORT_MAX_BYTES}: {raw!r}, use a "
                         "number of bytes >= 1.")
    return value
