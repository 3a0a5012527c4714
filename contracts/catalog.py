"""GPU catalog: datasheet figures for devices the user describes but this machine may lack.

Peak figures are *dense* (no 2:4 sparsity) tensor-core rates where the part has
tensor cores for that dtype; fp32 is the plain vector rate and `tf32_tflops` the
tensor-core TF32 rate fp32 matmuls run at where the part has one (0: none). Sources
are the vendors' datasheets, cited per entry. A part without native bf16
(`bf16_tflops == 0`) makes the planner fall back to fp16 with a note.

`compute_capability` is the CUDA SM version (major, minor) from NVIDIA's table
(https://developer.nvidia.com/cuda-gpus, "CUDA GPU Compute Capability"); it decides
which SDPA kernel torch runs (contracts/attention.py). AMD parts and the CPU have none.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from contracts.constants import GB, GIB



@dataclass(frozen=True)
class GpuType:
    name: str
    memory_bytes: int
    fp32_tflops: float
    fp16_tflops: float
    bf16_tflops: float  # 0.0: no native bf16
    memory_gbps: float  # HBM/GDDR bandwidth in GB/s (bytes, decimal): see memory_bytes_per_s
    interconnect: str  # "nvlink4", "pcie4", ...
    interconnect_gbps: float  # per-GPU peer bandwidth in GB/s (bytes, one direction)
    vendor: str = "nvidia"
    compute_capability: tuple[int, int] | None = None  # CUDA (major, minor); None: not a CUDA device
    tf32_tflops: float = 0.0  # dense tensor-core TF32; 0.0: none (Volta and older, the CPU)

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops > 0

    @property
    def supports_tf32(self) -> bool:
        return self.tf32_tflops > 0

    def matmul_peak_tflops(self, dtype: str) -> float:
        """Peak of the matmuls of a training dtype: fp32 matmuls run in TF32 where the part has it
        (FP32_MATMULS_IN_TF32), otherwise as `peak_tflops`."""
        if dtype == "fp32" and FP32_MATMULS_IN_TF32 and self.supports_tf32:
            return self.tf32_tflops
        return self.peak_tflops(dtype)

    def peak_tflops(self, dtype: str) -> float:
        """Peak for a training dtype; bf16 on a part without it means fp16."""
        if dtype == "fp32":
            return self.fp32_tflops
        if dtype == "bf16" and self.supports_bf16:
            return self.bf16_tflops
        return self.fp16_tflops

    @property
    def memory_bytes_per_s(self) -> float:
        """`memory_gbps` is GB/s (decimal), unlike the Gbit/s of the cluster file's network."""
        return self.memory_gbps * GB

    @property
    def interconnect_bytes_per_s(self) -> float:
        return self.interconnect_gbps * GB

    def to_dict(self) -> dict:
        return asdict(self)


def _g(name, mem_gib, fp32, fp16, bf16, bw, ic, ic_gbps, vendor="nvidia", tf32=0.0) -> GpuType:
    return GpuType(name, int(mem_gib * GIB), fp32, fp16, bf16, bw, ic, ic_gbps, vendor,
                   _COMPUTE_CAPABILITY.get(name), tf32)


# fp32 training runs its matmuls on the TF32 tensor cores of parts that have them (Ampere and newer):
# Megatron-LM and DeepSpeed set `torch.backends.cuda.matmul.allow_tf32 = True`, and Sailor's measured
# profiles (A100, fp32) were taken so; a step priced at the fp32 vector rate is ~8x too slow there.
FP32_MATMULS_IN_TF32 = True


# CUDA compute capability per type, from https://developer.nvidia.com/cuda-gpus (Hopper 9.0,
# Ampere GA100 8.0, Ampere GA10x 8.6, Ada 8.9, Turing 7.5, Volta 7.0, Pascal GP100 6.0, GP10x 6.1).
_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {
    "H200": (9, 0), "H100-SXM": (9, 0), "H100-PCIe": (9, 0), "GH200-96GB": (9, 0),
    "A100-40GB": (8, 0), "A100-80GB": (8, 0),
    "A10": (8, 6), "A10G": (8, 6), "A6000": (8, 6), "RTX3090": (8, 6),
    "L4": (8, 9), "L40S": (8, 9), "RTX4090": (8, 9),
    "T4": (7, 5), "TitanRTX": (7, 5), "RTX2080Ti": (7, 5), "V100-16GB": (7, 0), "V100-32GB": (7, 0),
    "P100": (6, 0), "P40": (6, 1),
}


CATALOG: dict[str, GpuType] = {g.name: g for g in (
    # NVIDIA H200 datasheet (2024): 141 GB HBM3e, 4.8 TB/s, 989 TF bf16/fp16 dense, 494.7 TF TF32 dense, 67 TF fp32,
    # NVLink 900 GB/s
    _g("H200", 141 * GB / GIB, 67.0, 989.0, 989.0, 4800, "nvlink4", 450, tf32=494.7),
    # NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TF dense bf16, 494.7 TF TF32 dense, 67 TF fp32, NVLink 900 GB/s
    _g("H100-SXM", 80, 67.0, 989.0, 989.0, 3350, "nvlink4", 450, tf32=494.7),
    # NVIDIA H100 PCIe datasheet: 80 GB HBM2e, 2.0 TB/s, 756 TF dense bf16, 378 TF TF32 dense, 51 TF fp32, PCIe Gen5 128 GB/s
    _g("H100-PCIe", 80, 51.0, 756.0, 756.0, 2000, "pcie5", 64, tf32=378.0),
    # NVIDIA A100 datasheet (2021): 312 TF bf16/fp16 dense, 156 TF TF32 dense, 19.5 TF fp32, 40GB HBM2 1.555 TB/s,
    # NVLink3 600 GB/s
    _g("A100-40GB", 40, 19.5, 312.0, 312.0, 1555, "nvlink3", 300, tf32=156.0),
    # same datasheet, 80GB HBM2e SXM: 2.039 TB/s
    _g("A100-80GB", 80, 19.5, 312.0, 312.0, 2039, "nvlink3", 300, tf32=156.0),
    # NVIDIA V100 SXM2 datasheet: 125 TF fp16 tensor, 15.7 TF fp32, 900 GB/s, NVLink2 300 GB/s; no bf16
    _g("V100-16GB", 16, 15.7, 125.0, 0.0, 900, "nvlink2", 150),
    _g("V100-32GB", 32, 15.7, 125.0, 0.0, 900, "nvlink2", 150),
    # NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TF fp16, 8.1 TF fp32, PCIe Gen3; no bf16
    _g("T4", 16, 8.1, 65.0, 0.0, 320, "pcie3", 16),
    # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TF bf16/fp16 dense (242 sparse), 60 TF TF32 dense (120 sparse),
    # 30.3 TF fp32, PCIe Gen4
    _g("L4", 24, 30.3, 121.0, 121.0, 300, "pcie4", 32, tf32=60.0),
    # NVIDIA A10 datasheet (PCIe, 150 W): 24 GB GDDR6, 600 GB/s, 125 TF bf16/fp16 dense (250 sparse), 62.5 TF TF32
    # dense (125 sparse), 31.2 TF fp32
    _g("A10", 24, 31.2, 125.0, 125.0, 600, "pcie4", 32, tf32=62.5),
    # NVIDIA A10G (AWS G5; A10 datasheet): 24 GB GDDR6, 600 GB/s, 125 TF bf16 dense (A10), 31.2 TF fp32
    _g("A10G", 24, 31.2, 125.0, 125.0, 600, "pcie4", 32, tf32=62.5),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362 TF bf16 dense (733 sparse), 183 TF TF32 dense (366 sparse),
    # 91.6 TF fp32
    _g("L40S", 48, 91.6, 362.0, 362.0, 864, "pcie4", 32, tf32=183.0),
    # NVIDIA RTX A6000 datasheet: 48 GB GDDR6, 768 GB/s, 38.7 TF fp32, 154.8 TF tensor (309.7 sparse), 77.4 TF TF32
    _g("A6000", 48, 38.7, 154.8, 154.8, 768, "pcie4", 32, tf32=77.4),
    # NVIDIA GeForce RTX 3090 (Ampere whitepaper): 24 GB GDDR6X, 936 GB/s, 35.6 TF fp32, 71 TF fp16 tensor (fp32 acc),
    # 35.6 TF TF32 dense
    _g("RTX3090", 24, 35.6, 71.0, 71.0, 936, "pcie4", 32, tf32=35.6),
    # NVIDIA GeForce RTX 4090 (Ada whitepaper): 24 GB GDDR6X, 1008 GB/s, 82.6 TF fp32, 165.2 TF fp16 tensor (fp32 acc),
    # 82.6 TF TF32 dense
    _g("RTX4090", 24, 82.6, 165.2, 165.2, 1008, "pcie4", 32, tf32=82.6),
    # NVIDIA GH200 Grace Hopper datasheet, 96 GB HBM3 module: 4.0 TB/s, 989 TF bf16/fp16 dense, 494.7 TF TF32 dense,
    # 67 TF fp32, NVLink 900 GB/s (Sailor's "GH-96")
    _g("GH200-96GB", 96 * GB / GIB, 67.0, 989.0, 989.0, 4000, "nvlink4", 450, tf32=494.7),
    # NVIDIA TITAN RTX product page (Turing TU102): 24 GB GDDR6, 672 GB/s, 16.3 TF fp32, 130 TF fp16 tensor; no bf16,
    # no TF32; NVLink bridge 100 GB/s for 2 cards, else PCIe Gen3
    _g("TitanRTX", 24, 16.3, 130.0, 0.0, 672, "pcie3", 16),
    # NVIDIA Turing whitepaper, table 1 (reference card): RTX 2080 Ti 11 GB GDDR6, 616 GB/s, 13.4 TF fp32, 53.8 TF fp16
    # tensor with fp32 accumulate; no bf16, no TF32 (Sailor's "RTX-2080" has 11 GiB: the Ti)
    _g("RTX2080Ti", 11, 13.4, 53.8, 0.0, 616, "pcie3", 16),
    # NVIDIA Tesla P100 SXM2 datasheet: 16 GB HBM2, 732 GB/s, 10.6 TF fp32, 21.2 TF fp16; no tensor cores, no bf16
    _g("P100", 16, 10.6, 21.2, 0.0, 732, "nvlink1", 80),
    # NVIDIA Tesla P40 datasheet: 24 GB GDDR5, 346 GB/s, 11.8 TF fp32; fp16 runs at 1/64 rate (0.18 TF)
    _g("P40", 24, 11.8, 0.18, 0.0, 346, "pcie3", 16),
    # AMD parts keep tf32 0: torch on ROCm runs fp32 matmuls in fp32 unless HIPBLASLT_ALLOW_TF32=1 is set
    # AMD Instinct MI250X datasheet: 128 GB HBM2e, 3.2 TB/s, 383 TF fp16/bf16, 47.9 TF fp32 (vector), Infinity Fabric
    _g("MI250X", 128, 47.9, 383.0, 383.0, 3200, "infinity-fabric", 100, vendor="amd"),
    # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, 1307 TF fp16/bf16 dense, 163.4 TF fp32
    _g("MI300X", 192, 163.4, 1307.0, 1307.0, 5300, "infinity-fabric", 64, vendor="amd"),
)}

# Sustained dense matmul rates (TFLOP/s) MEASURED on the part, per compute dtype, where a
# published measurement exists; planner/core/roofline.py prices matmuls with them (other types:
# datasheet peak x roofline.DEFAULT_*_EFFICIENCY). Sources (Stas Bekman's MAMF table, preferred, and
# zzc0721/torch-performance-test-data, the median of a type's rows), with every row behind each
# figure: docs/models/cost.md ("Sustained matmul rates").
MEASURED_MATMUL_TFLOPS: dict[str, dict[str, float]] = {
    "A100-40GB": {"bf16": 271.2, "fp16": 271.2, "fp32": 18.11},
    "A100-80GB": {"bf16": 271.2, "fp16": 271.2, "fp32": 19.18},
    "H100-SXM": {"bf16": 794.5, "fp16": 794.5, "fp32": 52.11, "tf32": 403.74},
    "H200": {"bf16": 794.5, "fp16": 794.5, "fp32": 51.34},
    "MI300X": {"bf16": 668.4, "fp16": 668.4},
    "T4": {"fp16": 42.31, "fp32": 4.30},
    "RTX3090": {"fp16": 75.64, "bf16": 76.58, "fp32": 24.79},
    "RTX4090": {"fp16": 166.44, "bf16": 166.575, "fp32": 54.72},
    "A6000": {"fp16": 120.49, "bf16": 123.34, "fp32": 23.92},
    "L40S": {"fp16": 264.02, "bf16": 269.15, "fp32": 46.88},
    "P40": {"fp16": 10.02, "fp32": 10.07},
    # zzc0721/torch-performance-test-data database.md at 53db858, its one "Tesla V100-SXM2-16GB" row
    "V100-16GB": {"fp16": 94.84, "fp32": 14.06},
}

# The local CPU worker (one core, one torch thread: what an executor rank uses).
# Its real figures come from `profiler bench` / `profiler profile` (the profile
# store, planner/core/profiles.py); these are conservative placeholders for one core
# of a small VM, used only until those have run. Memory: 8 GiB per worker unless
# the device gives `memory_gb` (an emulated limit).
CPU_TYPE = "cpu"
CATALOG[CPU_TYPE] = GpuType(CPU_TYPE, 8 * GIB, 0.05, 0.02, 0.02, 10, "shared-memory", 5, vendor="cpu")


def get_gpu_type(name: str) -> GpuType:
    try:
        return CATALOG[name]
    except KeyError:
        raise ValueError(
            f"unknown GPU type {name!r}; known types: {', '.join(sorted(CATALOG))}"
        ) from None


# Names CUDA/ROCm report (torch.cuda.get_device_name) -> catalog type. Checked in
# order, first match wins; a `None` memory split means "any memory". The memory
# split tells the 40/80 GB A100s and 16/32 GB V100s apart.
_NAME_PATTERNS: tuple[tuple[str, tuple[tuple[float, str], ...]], ...] = (
    ("gh200", ((0, "GH200-96GB"),)),
    ("h200", ((0, "H200"),)),
    ("h100 pcie", ((0, "H100-PCIe"),)),
    ("h100", ((0, "H100-SXM"),)),
    ("a100", ((0, "A100-40GB"), (60, "A100-80GB"))),
    ("v100", ((0, "V100-16GB"), (24, "V100-32GB"))),
    ("l40s", ((0, "L40S"),)),
    ("a10g", ((0, "A10G"),)),
    ("a10", ((0, "A10"),)),  # whole token: "A100" and "A10G" never reach it
    ("a6000", ((0, "A6000"),)),
    ("3090", ((0, "RTX3090"),)),
    ("2080 ti", ((0, "RTX2080Ti"),)),
    ("titan rtx", ((0, "TitanRTX"),)),
    ("4090", ((0, "RTX4090"),)),
    ("p100", ((0, "P100"),)),
    ("p40", ((0, "P40"),)),
    ("t4", ((0, "T4"),)),
    ("l4", ((0, "L4"),)),
    ("mi250x", ((0, "MI250X"),)),
    ("mi300x", ((0, "MI300X"),)),
)


def match_gpu_type(device_name: str, memory_bytes: int | None = None) -> str | None:
    """The catalog type of a device as the driver names it, or None when unknown.

    "NVIDIA H200" -> "H200"; "NVIDIA A100-SXM4-80GB" -> "A100-80GB";
    "Tesla V100-SXM2-16GB" with 16 GiB -> "V100-16GB". Words are matched on
    token boundaries so "T4" does not match "RTX 4090"."""
    tokens = " " + " ".join(device_name.lower().replace("-", " ").replace("_", " ").split()) + " "
    for pattern, splits in _NAME_PATTERNS:
        if f" {pattern} " not in tokens and not (pattern.isdigit() and pattern in tokens):
            continue
        mem_gib = (memory_bytes / GIB) if memory_bytes else None
        if mem_gib is None:
            # the name itself may carry the size ("A100-SXM4-80GB")
            sizes = [int(t[:-2]) for t in tokens.split() if t.endswith("gb") and t[:-2].isdigit()]
            mem_gib = sizes[0] if sizes else None
        chosen = splits[0][1]
        for threshold, name in splits:
            if mem_gib is not None and mem_gib >= threshold:
                chosen = name
        return chosen
    return None


def device_dtype(gpu_type: str, dtype: str) -> str:
    """bf16 on a part without it trains in fp16 (same bytes, the planner's fallback)."""
    if dtype == "bf16" and not get_gpu_type(gpu_type).supports_bf16:
        return "fp16"
    return dtype
