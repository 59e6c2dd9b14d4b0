#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then trains the quickstart CTR
# model on generated Criteo-like data and prints its validation AUC.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WITH_HOROVOD=${WITH_HOROVOD:-0} bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL=2
exec .venv/bin/python tutorials/lookup_quickstart.py "$@"
