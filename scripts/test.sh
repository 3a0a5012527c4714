#!/usr/bin/env bash
# Install (into .venv/, see install.sh) and run the whole test suite (unit, multi-process
# torch.distributed, AppTest and the real-browser end-to-end test) with its interpreter.
# The venv's bin/ goes first on PATH: subprocesses that start `python` (torchrun agents
# of the SLURM backend) get the same interpreter and packages.
#
#   bash scripts/test.sh [pytest args]          the whole suite (CI's command)
#   bash scripts/test.sh --fast [pytest args]   tests/unit only: no process started (731 tests,
#                                               4 min 40 s on 2 cores with one busy beside them)
# Markers select by kind (pytest.ini): e.g. bash scripts/test.sh -m "not browser and not slurm".
set -euo pipefail
cd "$(dirname "$0")/.."
paths=(tests)
if [[ "${1:-}" == "--fast" ]]; then
    shift
    paths=(tests/unit)
fi
bash scripts/install.sh
VENV=$(realpath -m "${GPUMIX_VENV:-.venv}")
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest "${paths[@]}" "$@"
