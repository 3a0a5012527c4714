#!/usr/bin/env bash
# Install (into .venv/, see install.sh) and run the whole test suite (unit, multi-process
# torch.distributed, AppTest and the real-browser end-to-end test) with its interpreter.
# The venv's bin/ goes first on PATH: subprocesses that start `python` (torchrun agents
# of the SLURM backend) get the same interpreter and packages.
#
#   bash scripts/test.sh                        the whole suite (CI's command): tests/unit on every
#                                               core (pytest-xdist: they start no process and time
#                                               nothing), then tests/e2e one test at a time (their
#                                               runs are timed and use the cores themselves)
#   bash scripts/test.sh [pytest args]          one pytest run of the arguments, one test at a time
#   bash scripts/test.sh --fast [pytest args]   tests/unit only, on every core
# Markers select by kind (pytest.ini): e.g. bash scripts/test.sh -m "not browser and not slurm".
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [[ "${1:-}" == "--fast" ]]; then
    shift
    fast=1
fi
bash scripts/install.sh
VENV=$(realpath -m "${GPUMIX_VENV:-.venv}")
export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
PY="$VENV/bin/python"
if [[ $fast == 1 ]]; then
    exec "$PY" -m pytest tests/unit -n auto "$@"
fi
if [[ $# -gt 0 ]]; then
    exec "$PY" -m pytest "$@"
fi
# both parts always run; the suite fails if either does
rc=0
"$PY" -m pytest tests/unit -n auto || rc=$?
"$PY" -m pytest tests/e2e || rc=$((rc ? rc : $?))
exit "$rc"
