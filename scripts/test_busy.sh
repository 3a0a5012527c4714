#!/usr/bin/env bash
# The whole suite (scripts/test.sh, arguments passed on) with one extra CPU-bound process running
# beside it for the whole run, as on a machine shared with other work: the timing-sensitive checks
# must hold with one core taken. The busy process is started here and always killed on exit
# (success, failure, Ctrl-C; on SIGTERM once the suite has ended); the suite's wall time is printed
# at the end. Exit status: the suite's.
#
#   bash scripts/test_busy.sh [pytest args]      e.g. bash scripts/test_busy.sh -m "not browser"
#   bash scripts/test_busy.sh --fast              tests/unit only, beside the busy core
set -euo pipefail
cd "$(dirname "$0")/.."
# the busy loop also ends by itself once this script is gone (even killed with SIGKILL)
python3 -c '
import os
parent, i = os.getppid(), 0
while i % 5_000_000 or os.getppid() == parent:
    i += 1
' &
BUSY=$!
trap 'kill "$BUSY" 2>/dev/null || true; wait "$BUSY" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "test_busy: one CPU-bound process beside the suite (pid $BUSY)"
start=$(date +%s)
status=0
bash scripts/test.sh "$@" || status=$?
elapsed=$(( $(date +%s) - start ))
printf 'test_busy: wall time %d min %02d s (exit %d)\n' $((elapsed / 60)) $((elapsed % 60)) "$status"
exit "$status"
