#!/usr/bin/env bash
# Install (into .venv/, see install.sh) and start the dashboard on the embedded defaults
# (this machine, SQLite under data/, the tiny model, the Python standard library as corpus):
# `gpumix dashboard` (gpumix/dashboard.py) serves it on 127.0.0.1 whatever the working directory
# and prints http://localhost:PORT/?token=… (GPUMIX_DASHBOARD_TOKEN, else a new token; typed paths
# may name GPUMIX_ALLOWED_ROOTS, see docs/dashboard.md); flags go to `streamlit run`.
set -euo pipefail
cd "$(dirname "$0")/.."
GPUMIX_SKIP_TEST_PACKAGES=1 bash scripts/install.sh
VENV=$(realpath -m "${GPUMIX_VENV:-.venv}")
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m gpumix dashboard "$@"
