#!/usr/bin/env bash
# Install (into .venv/, see install.sh) and start the dashboard on the embedded defaults
# (this machine, SQLite under data/, the tiny model, the Python standard library as corpus):
# `gpumix dashboard` (gpumix/dashboard.py), on http://localhost:8501; flags go to `streamlit run`.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUMIX_SKIP_TEST_PACKAGES=1 bash scripts/install.sh
VENV=$(realpath -m "${GPUMIX_VENV:-.venv}")
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m gpumix dashboard "$@"
