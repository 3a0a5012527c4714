"""The figures every part of GPUMix must agree on, defined once.

Units: bytes and seconds inside; Gbit/s only where a file or a datasheet says so (converted with
GBIT / BITS_PER_BYTE). The runtime (models/) imports the ones it shares with the models of it
(STEP_CHUNK_NUMEL, RECOMPUTE), so a change here changes both sides at once.
"""
from __future__ import annotations

GIB = 2**30
GB = 10**9  # datasheets quote decimal gigabytes
BITS_PER_BYTE = 8
GBIT = 1e9  # bits per second in one Gbit/s: the cluster file's and the scenarios' *_gbps

DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32_BYTES = 4  # master weights, Adam's moments, reduce-scattered gradients
HALF_BYTES = 2  # bf16 / fp16
INT64_BYTES = 8  # token ids
RECOMPUTE = ("none", "full")
# What the sharded runtime (models/sharded.py) runs; a plan or an option at any other stage is refused.
ZERO_STAGES = (1, 2, 3)
# What the memory model estimates: the runtime's stages and plain data parallelism (0: every rank holds
# the whole state), which `planner memory` and the Model & memory page show for comparison.
MODELLED_ZERO_STAGES = (0, *ZERO_STAGES)


def check_zero(zero: object, stages: tuple[int, ...] = ZERO_STAGES, what: str = "zero") -> int:
    """`zero` if it is one of `stages` (an int, never a bool); else a ValueError naming `what`."""
    if isinstance(zero, bool) or zero not in stages:
        raise ValueError(f"{what} must be one of {', '.join(map(str, stages))}, got {zero!r}")
    return zero  # type: ignore[return-value]

# The largest micro-batch a planner tries: beyond it α is fully amortized and only memory grows.
MAX_MICRO_BATCH = 64
# The micro-batch sizes a step profile times by default (profiler.step_profile): from 1 up, where the
# fixed cost of a micro-batch shows
PROFILE_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# The share of a device's memory a plan may use: the rest is the allocator's fragmentation, the CUDA
# context and the communication library's buffers.
MEMORY_HEADROOM = 0.9
# The optimizer step works on slices of this many elements (models/optim.py; its temporaries are
# priced by planner/core/memory.py).
STEP_CHUNK_NUMEL = 1 << 24

# Input bounds: what a cluster file or a model config may claim before anything is built from it.
# A file of 60 bytes can claim 10^8 devices; each limit is far above any real cluster or model
# (the largest published training runs: tens of thousands of GPUs, ~100 layers, vocabularies of a few
# hundred thousand, contexts of a million tokens), and low enough that what it admits is planned in
# bounded time and memory.
MAX_CLUSTER_DEVICES = 65_536  # devices in a cluster, all nodes together (`count` fields and lists)
MAX_CLUSTER_FILE_BYTES = 16 * 2**20  # a cluster file of MAX_CLUSTER_DEVICES listed devices is ~6 MB
MAX_CONFIG_FILE_BYTES = 4 * 2**20  # a Hugging Face config.json is a few kB
MAX_MODEL_LAYERS = 4_096
MAX_MODEL_HIDDEN = 2**17  # hidden and ffn_hidden widths
MAX_MODEL_HEADS = 2**14
MAX_MODEL_VOCAB = 2**23
MAX_MODEL_SEQ = 2**23  # max_seq (positions), and a plan's or option's seq
