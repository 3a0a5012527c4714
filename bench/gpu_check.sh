#!/usr/bin/env bash
# On a lent GPU machine only (never in CI), one GPU, well under 8 minutes: ZeRO-1/2/3 memory against
# torch.cuda.max_memory_allocated with fp32 and bf16 gathers at prefetch 1 and 2, step time against
# the profile, no host synchronization inside a step (torch.cuda.set_sync_debug_mode("error")),
# FSDP2 (MixedPrecisionPolicy bf16/fp32) side by side, uneven NCCL collectives with 2+ GPUs.
# Needs only torch (and its numpy) besides the repository. Dry run of every part on a CPU:
# bench/gpu_check.sh --device cpu. Arguments pass to bench/gpu_check.py (--json-out PATH keeps the JSON).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c "import torch" 2>/dev/null || { echo "gpu_check: $PY has no torch (pip install torch==2.13.0)" >&2; exit 2; }
export PYTHONUNBUFFERED=1
exec timeout 420 "$PY" bench/gpu_check.py "$@"
