"""Every ported DeepRec case runs with DeepRec's names installed."""

import pytest


@pytest.fixture(autouse=True)
def _deeprec_names(compat):
    """Installs `group_embedding.compat` around every ported case (the
    `compat` fixture of tests/conftest.py)."""
    yield compat
