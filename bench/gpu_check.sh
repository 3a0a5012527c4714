#!/usr/bin/env bash
# On a lent GPU machine only (never in CI): ZeRO-1/2/3 memory against torch.cuda.max_memory_allocated,
# step time against the profile, uneven NCCL collectives. Installs the pinned packages if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, pulp" 2>/dev/null || python3 -m pip install --quiet -r requirements.txt
exec timeout 420 python3 bench/gpu_check.py "$@"
