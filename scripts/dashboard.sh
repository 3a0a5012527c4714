#!/usr/bin/env bash
# Install and start the dashboard on the embedded defaults (this machine, SQLite
# under data/, the tiny model, the Python standard library as corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
GPUMIX_SKIP_BROWSER=1 bash scripts/install.sh
exec python3 -m streamlit run app.py "$@"
