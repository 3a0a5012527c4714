#!/usr/bin/env bash
# Install (into .venv/, see install.sh) and run the whole test suite (unit, multi-process
# torch.distributed, AppTest and the real-browser end-to-end test) with its interpreter.
# The venv's bin/ goes first on PATH: subprocesses that start `python` (torchrun agents
# of the SLURM backend) get the same interpreter and packages.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=$(realpath -m "${GPUMIX_VENV:-.venv}")
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest tests "$@"
