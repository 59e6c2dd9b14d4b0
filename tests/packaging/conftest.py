"""Registers the `packaging` marker (deselect with `-m "not packaging"`)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "packaging: builds a wheel and installs it into a fresh "
        "venv (compiles the kernels once, a few minutes)")
