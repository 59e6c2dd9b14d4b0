"""Fixtures shared by the tests: the kernel path a test runs on."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from testing import KERNEL_MODES  # noqa: E402


@pytest.fixture(params=KERNEL_MODES)
def kernel_mode(request, monkeypatch):
    """Runs the test on the C++ kernels ("custom") and on pure TF ("tf").

    `GROUP_EMBEDDING_KERNELS` is read on every lookup, so setting it here
    switches the path for everything the test traces or runs.
    """
    monkeypatch.setenv("GROUP_EMBEDDING_KERNELS", request.param)
    return request.param


@pytest.fixture(autouse=True)
def _compat_left_installed():
    """Fails a test that leaves DeepRec's names patched into `tf`: every
    later test comparing against stock `tf.feature_column` would then
    compare against this library instead."""
    import sys
    compat = sys.modules.get("group_embedding.compat")
    before = compat is not None and compat.is_installed()
    yield
    compat = sys.modules.get("group_embedding.compat")
    if compat is not None and compat.is_installed() and not before:
        compat.uninstall()
        pytest.fail("test left group_embedding.compat installed; "
                    "call compat.uninstall() when done")


@pytest.fixture
def compat():
    """`group_embedding.compat` with DeepRec's names installed into `tf`,
    uninstalled after the test so later tests see stock TF."""
    import importlib
    module = importlib.import_module("group_embedding.compat")
    module.install()
    yield module
    module.uninstall()
