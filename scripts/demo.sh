#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the DeepFM tutorial end
# to end on generated Criteo-like data: EV feature columns in one
# group_embedding_column_scope, training with a progress bar, validation
# AUC, checkpoint + reload, and a loss/AUC curve PNG. Extra arguments go to
# tutorials/deepfm_keras.py (e.g. --rows 50000 --out-dir /tmp/deepfm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WITH_HOROVOD=${WITH_HOROVOD:-0} bash scripts/setup.sh
export TF_CPP_MIN_LOG_LEVEL=2
exec .venv/bin/python tutorials/deepfm_keras.py --min-auc 0.7 "$@"
