#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), lints the package with ruff,
# type-checks it with mypy, then runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k lookup`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL=2
# Lint first (seconds): the package, the benchmarks and the tests,
# pyproject's rules (import order included).
.venv/bin/ruff check group_embedding ops feature_column benchmarks tests tutorials
# Types (about a minute): mypy on the package's installed layout.
bash scripts/typecheck.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
