"""The environment variables: each documented and read in `ops/config.py`
only, each value checked with an error naming the variable."""

import ast
import os
import re

import pytest

from group_embedding.ops import config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
PACKAGE_DIRS = ("group_embedding", "ops", "feature_column")
CONFIG_PATH = os.path.join(ROOT, "ops", "config.py")


def _sources():
    for folder in PACKAGE_DIRS:
        for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(base, name)


def _environ_reads(tree):
    """(line, key node) of every `os.environ.get(k)`, `os.getenv(k)` and
    `os.environ[k]` read in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "get"
                    and ast.unparse(f.value) == "os.environ") or (
                    ast.unparse(f) == "os.getenv"):
                yield node.lineno, node.args[0]
        elif (isinstance(node, ast.Subscript)
              and isinstance(node.ctx, ast.Load)
              and ast.unparse(node.value) == "os.environ"):
            yield node.lineno, node.slice


def test_every_variable_named_in_the_package_is_documented():
    documented = {v.name for v in config.VARIABLES}
    named = set()
    for path in _sources():
        with open(path) as f:
            named |= set(re.findall(r"GROUP_EMBEDDING_[A-Z0-9_]*[A-Z0-9]",
                                    f.read()))
    assert named - documented == set()
    # And nothing documented that the package no longer has.
    assert documented - named == set()
    for v in config.VARIABLES:
        assert v.values and v.default and v.effect, v.name


def test_only_the_config_module_reads_the_variables():
    offenders = []
    for path in _sources():
        if path == CONFIG_PATH:
            continue
        with open(path) as f:
            tree = ast.parse(f.read())
        for line, key in _environ_reads(tree):
            literal = isinstance(key, ast.Constant)
            if not literal or key.value.startswith("GROUP_EMBEDDING_"):
                offenders.append(f"{os.path.relpath(path, ROOT)}:{line} "
                                 f"{ast.unparse(key)}")
    assert offenders == []
    # The scan does see reads: the config module's own.
    with open(CONFIG_PATH) as f:
        assert len(list(_environ_reads(ast.parse(f.read())))) >= 9


@pytest.mark.parametrize("read,name,bad", [
    (config.kernel_mode, config.KERNELS, "rocm"),
    (config.transport, config.TRANSPORT, "mpi"),
    (config.same_host_link, config.TRANSPORT_SAME_HOST, "rdma"),
    (config.transport_max_bytes, config.TRANSPORT_MAX_BYTES, "0"),
    (config.transport_max_bytes, config.TRANSPORT_MAX_BYTES, "4G"),
    (config.collective_timeout, config.COLLECTIVE_TIMEOUT, "-1"),
    (config.collective_timeout, config.COLLECTIVE_TIMEOUT, "inf"),
    (config.collective_timeout, config.COLLECTIVE_TIMEOUT, "5min"),
    (config.transport_shm_bytes, config.TRANSPORT_SHM_BYTES, "0"),
])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, read,
                                                     name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        read()


def test_defaults_and_values(monkeypatch):
    for v in config.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert config.kernel_mode() is config.KernelMode.AUTO
    assert config.transport() is config.Transport.AUTO
    assert config.same_host_link() is config.SameHostLink.SHM
    assert config.transport_max_bytes() == 4 << 30
    assert config.transport_shm_bytes() == 64 << 20
    assert config.collective_timeout() == 300.0
    assert config.cuda_archs() == ("75", "80", "86", "89", "90")
    assert config.cache_dir() == "/x/group_embedding"
    assert config.nvcc() is None and config.transport_host() is None
    monkeypatch.setenv(config.KERNELS, "TF")  # case does not matter
    assert config.kernel_mode() is config.KernelMode.TF
    monkeypatch.setenv(config.CUDA_ARCHS, " 90; 80 ,")
    assert config.cuda_archs() == ("90", "80")
    monkeypatch.setenv(config.COLLECTIVE_TIMEOUT, "2.5")
    assert config.collective_timeout() == 2.5
    monkeypatch.setenv(config.CACHE, "~/c")
    assert config.cache_dir() == os.path.expanduser("~/c")


def test_choices_read_as_their_values():
    mode = config.KernelMode.CUSTOM
    assert mode == "custom" and f"{mode}" == "custom" and str(mode) == "custom"
    assert {"custom": 1}[mode] == 1


@pytest.mark.parametrize("before", [None, "custom"])
def test_kernel_mode_set_restores_the_variable(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(config.KERNELS, raising=False)
    else:
        monkeypatch.setenv(config.KERNELS, before)
    with pytest.raises(KeyError):
        with config.kernel_mode_set(config.KernelMode.TF):
            assert config.kernel_mode() is config.KernelMode.TF
            raise KeyError("left by an error")
    assert os.environ.get(config.KERNELS) == before
