"""Every ported DeepRec case runs with DeepRec's names installed."""

import importlib

import pytest


@pytest.fixture(autouse=True)
def compat():
    """`import group_embedding.compat` for the test, undone afterwards
    (as the other compat tests do)."""
    module = importlib.import_module("group_embedding.compat")
    module.install()
    yield module
    module.uninstall()
