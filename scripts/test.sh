#!/usr/bin/env bash
# Install everything and run the whole test suite (unit, multi-process
# torch.distributed, AppTest and the real-browser end-to-end test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python3 -m pytest tests "$@"
