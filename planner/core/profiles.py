"""The profile store: measured step times and collective bandwidths, read by the planner.

Cephalo's time model: on one device kind, forward+backward of a micro-batch of `m` samples takes
`α + β·m`, fitted by `profiler profile` (profiler/step_profile.py). For a kind never measured,
`get_step_profile` *estimates* α, β (a GPU type from planner/core/roofline.py, the CPU from FLOPs ÷
(peak × calibrated efficiency)), and every `StepProfile` says which it is (`measured`, `source`).
Profiles are JSON files under `contracts.paths.profiles_dir()` (steps/ and bench/), keyed by device
kind (a CPU-quota kind such as `cpu@share0.333` is measured under its own quota) and tensor-parallel
degree (`tp`, one rank's share; imported profiles carry it); an emulated device's `slowdown` is
applied by the cost model, never here. Pure Python (no torch).

The store layout and the estimates' constants with their sources: docs/models/cost.md.
"""
from __future__ import annotations

import json
import logging
import os
import re
import statistics
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from contracts import paths
from contracts.catalog import CPU_TYPE, GB, get_gpu_type
from contracts.cluster import split_profile_key
from contracts.specs import ModelSpec, get_model, with_max_seq
from planner.core import roofline
from contracts.constants import RECOMPUTE

if TYPE_CHECKING:
    from contracts.plan import Plan

log = logging.getLogger(__name__)

TFLOPS = 1e12
HOW_TOGETHER = "together"  # StepProfile.how: timed at once with the run's other devices
HOW_ALONE = "alone"  # StepProfile.how: timed by itself (with stand-in companions at most)
# A profile taken at a 1-minute load average that differs from the machine's now by more than this
# many runnable processes was measured under visibly different contention (`load_changed`): one
# more busy process on a core shifts the average by ~1 within a minute.
LOAD_CHANGE_FLAG = 1.0
PROFILE_AGAIN = "profile the plan's devices (python -m profiler profile --plan PLAN_FILE), then plan again"

# ---- Estimates -------------------------------------------------------------------------------
# Used only where nothing was measured; each measured profile in the store replaces them
# (see `calibration`).
# Fraction of the datasheet peak a GPU reaches on a transformer's forward+backward:
# Megatron-LM reports 40-52 % model FLOPs utilization for GPT on A100 (Narayanan et al. 2021,
# table 1; Korthikanti et al. 2022, table 5). Take the low end: small micro-batches do worse.
DEFAULT_GPU_EFFICIENCY = 0.40
# A CPU core running fp32 GEMMs through oneDNN/MKL reaches about half of the catalog's
# placeholder peak (contracts/catalog.py), which `profiler bench` replaces with a measurement.
DEFAULT_CPU_EFFICIENCY = 0.5
# α, the fixed cost of a micro-batch, is kernel-launch and Python overhead: about 25 kernels per
# layer forward+backward at ~10 µs each on a GPU (PyTorch eager); ~0.1 ms per layer on a CPU core.
DEFAULT_GPU_ALPHA_PER_LAYER_S = 0.25e-3
DEFAULT_CPU_ALPHA_PER_LAYER_S = 0.1e-3
# Adam's step streams about 32 bytes per parameter (read param, grad, m, v in fp32 = 16 bytes,
# write param, m, v = 12, plus a 16-bit copy of the parameter = 2-4), at about 70 % of the
# memory bandwidth (a streaming kernel).
ADAM_BYTES_PER_PARAM = 32
STREAM_EFFICIENCY = 0.7


@dataclass(frozen=True)
class StepProfile:
    """Forward+backward time of one micro-batch on one device type: `alpha_s + beta_s * m`.

    `flops_per_sample` are the training FLOPs (forward+backward) of one sample of `seq`
    tokens; `efficiency` = achieved FLOP/s (flops_per_sample / beta_s) over the peak the
    profile was measured or estimated against."""

    device_type: str
    model: str
    seq: int
    dtype: str
    recompute: str
    alpha_s: float
    beta_s: float
    optimizer_s_per_param: float
    r2: float | None  # fit quality of a measured profile; None when estimated
    measured: bool
    source: str  # one line: how this profile was obtained
    flops_per_sample: float
    num_params: int = 0
    num_layers: int = 0
    micro_batches: tuple[int, ...] = ()  # measured sizes
    step_times_s: tuple[float, ...] = ()  # median time of each measured size
    efficiency: float | None = None
    peak_tflops: float | None = None  # the peak `efficiency` refers to
    host: str = ""
    created: str = ""  # ISO time of the measurement
    # matmul weights of the profiled model (ModelSpec.matmul_params): identifies the architecture
    # (a longer position table, with_max_seq, does not change it)
    num_matmul_params: int = 0
    # tensor-parallel degree: the times are one rank's of a group of `tp` splitting every layer, and
    # flops_per_sample and num_params are that rank's share
    tp: int = 1
    # ---- provenance of a measurement (ProfileProvenance's fields; a profile saved before they
    # existed reads the defaults: how "" = not recorded)
    how: str = ""  # HOW_TOGETHER: timed beside the run's other devices in one window; HOW_ALONE: by itself
    cpu_share: float | None = None  # the CPU quota it was timed under (None: none)
    memory_gb: float | None = None  # the memory limit over the baseline it was timed under (None: none)
    load_avg: float | None = None  # os.getloadavg()[0] of the machine when the timing started
    num_cpus: int = 0  # CPUs the machine had then (os.cpu_count())
    # relative spread of β: IQR / median of the per-round slopes (each round's sizes fitted alone)
    noise: float | None = None
    noise_alpha_s: float | None = None  # IQR of the per-round intercepts α, seconds
    # the kinds of every device timed in the same window (one entry per device; () when alone)
    together_with: tuple[str, ...] = ()

    def matches(self, spec: ModelSpec) -> bool:
        """Same model name and, when recorded, the same architecture."""
        return self.model == spec.name and self.num_matmul_params in (0, spec.matmul_params())

    def step_time_s(self, micro_batch: int) -> float:
        """Forward+backward of one micro-batch of `micro_batch` samples."""
        return self.alpha_s + self.beta_s * micro_batch

    def optimizer_time_s(self, num_params: int | float) -> float:
        """The optimizer step over a shard of `num_params` parameters."""
        return self.optimizer_s_per_param * num_params

    @property
    def kind(self) -> str:
        return "measured" if self.measured else "estimated"

    @property
    def taken_at(self) -> str:
        """UTC ISO time the measurement was taken ("" when estimated): the `created` field."""
        return self.created

    def describe(self) -> str:
        """One line naming the profile: its kind, when, how, under which limits and load, how noisy."""
        if not self.measured:
            return f"{self.device_type}: estimated, not measured"
        limits = ", ".join(x for x in (f"cpu_share {self.cpu_share:g}" if self.cpu_share is not None else "",
                                       f"memory +{self.memory_gb:g} GiB" if self.memory_gb is not None else "") if x)
        load = f"load {self.load_avg:.2f} on {self.num_cpus} CPUs" if self.load_avg is not None else "load not recorded"
        noise = (f"β noise {self.noise:.1%} (IQR/median of per-round slopes)" if self.noise is not None
                 else "noise not recorded")
        when, how = self.taken_at or "(time not recorded)", self.how or "how not recorded"
        return f"{self.device_type}: measured {when}, {how}{f', {limits}' if limits else ''}, {load}, {noise}"

    @property
    def achieved_tflops(self) -> float:
        return self.flops_per_sample / self.beta_s / TFLOPS if self.beta_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["micro_batches"] = list(self.micro_batches)
        d["step_times_s"] = list(self.step_times_s)
        d["together_with"] = list(self.together_with)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StepProfile":
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}  # newer files may carry more
        d["micro_batches"] = tuple(int(x) for x in d.get("micro_batches", ()))
        d["step_times_s"] = tuple(float(x) for x in d.get("step_times_s", ()))
        d["together_with"] = tuple(str(x) for x in d.get("together_with", ()))
        return cls(**d)


@dataclass(frozen=True)
class CollectiveFit:
    """`time_s(size) = latency_s + size_bytes / bandwidth_bytes_per_s` for one collective.

    `size_bytes` is the size of the *whole* tensor: the buffer that is all-reduced or
    broadcast, the gathered output of an all-gather. The bandwidth is therefore the
    algorithm bandwidth (size / time), not NCCL's bus bandwidth."""

    op: str  # "all_reduce" | "all_gather" | "broadcast"
    latency_s: float
    bandwidth_bytes_per_s: float
    r2: float
    sizes_bytes: tuple[int, ...] = ()
    times_s: tuple[float, ...] = ()

    def time_s(self, size_bytes: float) -> float:
        return self.latency_s + size_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class CollectiveProfile:
    device_type: str
    backend: str  # "gloo" | "nccl"
    world_size: int
    fits: tuple[CollectiveFit, ...]
    measured: bool = True
    host: str = ""

    def fit(self, op: str) -> CollectiveFit | None:
        return next((f for f in self.fits if f.op == op), None)

    def time_s(self, op: str, size_bytes: float) -> float:
        f = self.fit(op)
        if f is None:
            raise ValueError(f"collective {op!r} was not benchmarked on {self.device_type}")
        return f.time_s(size_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CollectiveProfile":
        fits = tuple(
            CollectiveFit(f["op"], float(f["latency_s"]), float(f["bandwidth_bytes_per_s"]), float(f["r2"]),
                          tuple(int(x) for x in f.get("sizes_bytes", ())),
                          tuple(float(x) for x in f.get("times_s", ())))
            for f in d["fits"])
        return cls(d["device_type"], d["backend"], int(d["world_size"]), fits, bool(d.get("measured", True)),
                   d.get("host", ""))


@dataclass(frozen=True)
class MatmulResult:
    dtype: str
    size: int  # n of an n×n @ n×n product
    tflops: float


@dataclass(frozen=True)
class DeviceBench:
    """What `profiler bench` measured on one device type of this machine."""

    device_type: str
    device_name: str
    num_threads: int  # torch threads during the matmul/memory benchmarks (1: an executor rank)
    matmul: tuple[MatmulResult, ...]
    memory_gbps: float  # GB/s (bytes, decimal) of a large copy: read + write counted
    collectives: CollectiveProfile | None = None
    host: str = ""
    created: str = ""

    def best_tflops(self, dtype: str) -> float | None:
        rates = [m.tflops for m in self.matmul if m.dtype == dtype]
        return max(rates) if rates else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceBench":
        coll = d.get("collectives")
        if coll:
            coll = CollectiveProfile.from_dict(coll)
        return cls(d["device_type"], d.get("device_name", ""), int(d.get("num_threads", 1)),
                   tuple(MatmulResult(m["dtype"], int(m["size"]), float(m["tflops"])) for m in d.get("matmul", ())),
                   float(d.get("memory_gbps", 0.0)), coll or None, d.get("host", ""), d.get("created", ""))


# ---- the store ---------------------------------------------------------------------------------


def store_root(store_dir: str | None = None) -> str:
    return store_dir if store_dir is not None else paths.profiles_dir()


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", part)


def step_profile_path(device_type: str, model: str, seq: int, dtype: str, recompute: str,
                      store_dir: str | None = None, tp: int = 1) -> str:
    parts = (device_type, model, f"s{seq}", dtype, recompute) + ((f"tp{tp}",) if tp != 1 else ())
    name = "__".join(_safe(p) for p in parts) + ".json"
    return os.path.join(store_root(store_dir), "steps", name)


def bench_path(device_type: str, store_dir: str | None = None) -> str:
    return os.path.join(store_root(store_dir), "bench", _safe(device_type) + ".json")


def _write_json(path: str, obj: dict[str, Any]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)  # readers never see half a file
    return path


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
        return d if isinstance(d, dict) else None
    except (OSError, json.JSONDecodeError) as e:
        log.warning("skipping unreadable profile %s: %s", path, e)
        return None


def save_step_profile(profile: StepProfile, store_dir: str | None = None) -> str:
    """Write a (measured) profile; it replaces the one with the same key."""
    path = step_profile_path(profile.device_type, profile.model, profile.seq, profile.dtype, profile.recompute,
                             store_dir, profile.tp)
    return _write_json(path, profile.to_dict())


def load_step_profiles(store_dir: str | None = None) -> list[StepProfile]:
    """Every profile in the store (malformed files are skipped with a warning)."""
    folder = os.path.join(store_root(store_dir), "steps")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for n in names:
        d = _read_json(os.path.join(folder, n))
        if d is None:
            continue
        try:
            out.append(StepProfile.from_dict(d))
        except (TypeError, ValueError, KeyError) as e:
            log.warning("skipping malformed profile %s: %s", n, e)
    return out


def save_device_bench(bench: DeviceBench, store_dir: str | None = None) -> str:
    return _write_json(bench_path(bench.device_type, store_dir), bench.to_dict())


def get_device_bench(device_type: str, store_dir: str | None = None) -> DeviceBench | None:
    d = _read_json(bench_path(device_type, store_dir))
    if d is None:
        return None
    try:
        return DeviceBench.from_dict(d)
    except (TypeError, ValueError, KeyError) as e:
        log.warning("skipping malformed bench of %s: %s", device_type, e)
        return None


def collective_set_key(kinds: Iterable[str]) -> str:
    """The store key of collectives measured between local ranks of these device kinds (profile
    keys: a CPU-quota kind is `cpu@share<s>`), each kind once however many devices share it (the
    profile's world_size says how many ranks took part): "cpu@share0.333+cpu@share1"."""
    return "+".join(sorted(set(kinds)))


def collectives_path(key: str, store_dir: str | None = None) -> str:
    return os.path.join(store_root(store_dir), "collectives", _safe(key) + ".json")


def save_collective_profile(profile: CollectiveProfile, store_dir: str | None = None) -> str:
    """Save collectives measured between a set of device kinds, under `profile.device_type`
    (collective_set_key of the kinds)."""
    return _write_json(collectives_path(profile.device_type, store_dir), profile.to_dict())


def get_collective_profile(device_type: str, store_dir: str | None = None) -> CollectiveProfile | None:
    """Measured latency and bandwidth of all-reduce / all-gather / broadcast between local
    ranks: of the device set `device_type` names (collective_set_key: its ranks each under their
    own CPU quota, as `profiler.collectives` measured them for a run's emulated devices), else of
    plain `device_type` ranks as `profiler bench` measured them; None when neither was measured."""
    d = _read_json(collectives_path(device_type, store_dir))
    if d is not None:
        try:
            return CollectiveProfile.from_dict(d)
        except (TypeError, ValueError, KeyError) as e:
            log.warning("skipping malformed collectives of %s: %s", device_type, e)
    bench = get_device_bench(device_type, store_dir)
    return bench.collectives if bench else None


# ---- peaks and calibration -----------------------------------------------------------------------


def peak_tflops(device_type: str, dtype: str, store_dir: str | None = None) -> float:
    """The peak an efficiency refers to: the datasheet's, except for `cpu`, whose catalog entry
    is a placeholder: there the best single-thread matmul `profiler bench` measured, if any. fp32 on a
    part with TF32 refers to the TF32 peak its matmuls run at (catalog.FP32_MATMULS_IN_TF32)."""
    if device_type == CPU_TYPE:
        bench = get_device_bench(CPU_TYPE, store_dir)
        if bench and bench.num_threads == 1:
            rate = bench.best_tflops("fp32" if dtype not in ("bf16", "fp16") else dtype) or bench.best_tflops("fp32")
            if rate:
                return rate
    return get_gpu_type(device_type).matmul_peak_tflops(dtype)


def _is_cpu(device_type: str) -> bool:
    return device_type == CPU_TYPE


@dataclass(frozen=True)
class Calibration:
    """Efficiency, α per layer and optimizer time per parameter for one device type."""

    efficiency: float
    alpha_per_layer_s: float
    optimizer_s_per_param: float
    basis: str  # which measurements (or defaults) these come from
    num_profiles: int = 0


def calibration(device_type: str, dtype: str, store_dir: str | None = None,
                profiles: list[StepProfile] | None = None) -> Calibration:
    """Calibrate the estimate for `device_type` from the measured profiles in the store.

    Efficiency: the median over measured profiles of (flops_per_sample / β) / peak, taken
    from the same device type (same dtype first) or else from other device types of the
    same class (GPU or CPU): efficiency is a fraction of the peak, so it carries across
    types in the ratio of their peaks. α per layer and the optimizer time per parameter
    come from the same device type only; elsewhere from the defaults above."""
    profiles = load_step_profiles(store_dir) if profiles is None else profiles
    # a CPU-quota kind (contracts.cluster.profile_key) is a throttled core, not its type's speed
    measured = [p for p in profiles if p.measured and p.beta_s > 0 and p.flops_per_sample > 0
                and split_profile_key(p.device_type)[1] is None and p.tp == 1]
    same_type = [p for p in measured if p.device_type == device_type]
    same_dtype = [p for p in same_type if p.dtype == dtype]
    same_class = [p for p in measured if _is_cpu(p.device_type) == _is_cpu(device_type)]
    pool, where = ((same_dtype, f"{device_type} {dtype}") if same_dtype else
                   (same_type, device_type) if same_type else
                   (same_class, "other device types (ratio of peaks)"))
    cpu = _is_cpu(device_type)
    if pool:
        eff = statistics.median(p.flops_per_sample / p.beta_s / TFLOPS / peak_tflops(p.device_type, p.dtype, store_dir)
                                for p in pool)
        basis = f"efficiency {eff:.2f} calibrated from {len(pool)} measured profile(s) on {where}"
    else:
        eff = DEFAULT_CPU_EFFICIENCY if cpu else DEFAULT_GPU_EFFICIENCY
        basis = f"default efficiency {eff:.2f} (nothing measured)"
    alphas = [max(p.alpha_s, 0.0) / p.num_layers for p in same_type if p.num_layers > 0]
    alpha_layer = statistics.median(alphas) if alphas else (
        DEFAULT_CPU_ALPHA_PER_LAYER_S if cpu else DEFAULT_GPU_ALPHA_PER_LAYER_S)
    opts = [p.optimizer_s_per_param for p in same_type if p.optimizer_s_per_param > 0]
    if opts:
        opt = statistics.median(opts)
    else:
        bench = get_device_bench(device_type, store_dir) if cpu else None
        mem_bytes_per_s = (bench.memory_gbps * GB if bench and bench.memory_gbps > 0
                           else get_gpu_type(device_type).memory_bytes_per_s)
        opt = ADAM_BYTES_PER_PARAM / (mem_bytes_per_s * STREAM_EFFICIENCY)
    return Calibration(eff, alpha_layer, opt, basis, len(pool))


def analytic_flops_per_sample(spec: ModelSpec, seq: int, recompute: str = "none") -> float:
    """Training FLOPs of one sample: ModelSpec.flops_per_token (6·N + attention) × seq.

    Full recomputation (models/decoder.py checkpoints each block, not the LM head) runs
    every block's forward once more: + 2·N_blocks + 4·L·h·s per token (a third of the
    blocks' 6·N_blocks + 12·L·h·s)."""
    per_token = spec.flops_per_token(seq)
    if recompute == "full":
        block_matmul_params = spec.matmul_params() - spec.vocab_size * spec.hidden
        per_token += 2.0 * block_matmul_params + 4.0 * spec.num_layers * spec.hidden * seq
    return per_token * seq


def _check_args(seq: int, dtype: str, recompute: str) -> None:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0:
        raise ValueError(f"seq must be a positive integer, got {seq!r}")
    if dtype not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"dtype must be fp32, fp16 or bf16, got {dtype!r}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def find_measured(device_type: str, spec: ModelSpec, seq: int, dtype: str, recompute: str = "none",
                  store_dir: str | None = None, tp: int = 1) -> StepProfile | None:
    """The measured profile of one key (a rank of a `tp`-way tensor-parallel group), or None."""
    path = step_profile_path(device_type, spec.name, seq, dtype, recompute, store_dir, tp)
    d = _read_json(path)
    if d is None:
        return None
    try:
        p = StepProfile.from_dict(d)
    except (TypeError, ValueError, KeyError) as e:
        log.warning("skipping malformed profile %s: %s", path, e)
        return None
    if not p.matches(spec):
        # same name, different architecture (e.g. two config.json in folders of one name)
        log.warning("profile %s is of a different %s (%d matmul parameters, not %d); ignoring it",
                    path, spec.name, p.num_matmul_params, spec.matmul_params())
        return None
    return p if p.measured else None


def get_step_profile(device_type: str, spec: ModelSpec, seq: int, dtype: str, recompute: str = "none",
                     store_dir: str | None = None) -> StepProfile:
    """The measured profile of (device type, model, seq, dtype, recompute) when the store has
    one; else an estimate: on a GPU type the roofline of its kernels (`_roofline_estimate`,
    planner/core/roofline.py), on the CPU β = FLOPs per sample / (peak × calibrated efficiency),
    α = layers × calibrated α per layer. `measured` and `source` say which."""
    _check_args(seq, dtype, recompute)
    base_type, cpu_share = split_profile_key(device_type)  # a kind: the type plus its CPU quota
    get_gpu_type(base_type)  # unknown type -> ValueError naming the known ones
    found = find_measured(device_type, spec, seq, dtype, recompute, store_dir)
    if found is not None:
        return found
    if cpu_share is not None:
        # never profiled under its quota: the type's profile over the share, labelled as derived
        p = get_step_profile(base_type, spec, seq, dtype, recompute, store_dir)
        return replace(p, device_type=device_type, alpha_s=p.alpha_s / cpu_share, beta_s=p.beta_s / cpu_share,
                       optimizer_s_per_param=p.optimizer_s_per_param / cpu_share, measured=False,
                       source=f"estimated: the {base_type} profile ÷ cpu_share {cpu_share:g}, not measured under "
                              f"its quota (`python -m profiler profile --cpu-share {cpu_share:g}`); {p.source}")
    profiles = load_step_profiles(store_dir)
    counted = [p for p in profiles if p.measured and p.matches(spec) and p.seq == seq
               and p.recompute == recompute and p.flops_per_sample > 0 and p.tp == 1]
    if counted:
        flops, flops_src = counted[0].flops_per_sample, "counted FLOPs"
    else:
        flops, flops_src = analytic_flops_per_sample(spec, seq, recompute), "analytic FLOPs"
    cal = calibration(device_type, dtype, store_dir, profiles)
    peak = peak_tflops(device_type, dtype, store_dir)
    if not _is_cpu(device_type):  # a GPU never measured: the roofline of its kernels (planner/core/roofline.py)
        return _roofline_estimate(device_type, spec, seq, dtype, recompute, profiles, cal, flops, flops_src, peak)
    beta = flops / (peak * TFLOPS * cal.efficiency)
    alpha = spec.num_layers * cal.alpha_per_layer_s
    source = (f"estimated: {flops_src} {flops:.3g}/sample ÷ ({device_type} {dtype} peak {peak:.3g} TFLOP/s × "
              f"{cal.basis})")
    return StepProfile(device_type, spec.name, seq, dtype, recompute, alpha, beta, cal.optimizer_s_per_param,
                       None, False, source, flops, spec.num_params, spec.num_layers,
                       efficiency=cal.efficiency, peak_tflops=peak)


def _roofline_estimate(device_type: str, spec: ModelSpec, seq: int, dtype: str, recompute: str,
                       profiles: list[StepProfile], cal: Calibration, flops: float, flops_src: str,
                       peak: float) -> StepProfile:
    """A GPU type's estimate: β = the roofline's per-sample time, α = launch overhead (calibrated α
    per layer) + the roofline's per-micro-batch weight traffic, the optimizer by bandwidth. Measured
    GPU profiles of the same model correct it by the median of measured β over the roofline's β on
    their own type (same type first): the roofline's error on real hardware, not a ratio of peaks."""
    est = roofline.estimate_step_roofline(device_type, spec, seq, dtype, recompute)
    gpu_measured = [p for p in profiles if p.measured and p.beta_s > 0 and p.matches(spec) and p.tp == 1
                    and not _is_cpu(split_profile_key(p.device_type)[0])]
    pool = [p for p in gpu_measured if p.device_type == device_type] or gpu_measured
    factor, basis = 1.0, "no GPU profile of this model measured, uncorrected"
    if pool:
        factor = statistics.median(
            p.beta_s / roofline.estimate_step_roofline(p.device_type, spec, p.seq, p.dtype, p.recompute).per_sample_s
            for p in pool)
        basis = f"× {factor:.2f}, measured ÷ roofline over {len(pool)} profile(s) on {sorted({p.device_type for p in pool})}"
    beta = est.per_sample_s * factor
    alpha = spec.num_layers * cal.alpha_per_layer_s + est.fixed_s * factor
    same_type_opt = any(p.device_type == device_type and p.optimizer_s_per_param > 0 for p in profiles if p.measured)
    opt = cal.optimizer_s_per_param if same_type_opt else est.optimizer_s_per_param
    source = f"estimated, not measured: {est.source} {basis}; {flops_src} {flops:.3g}/sample"
    return StepProfile(device_type, spec.name, seq, dtype, recompute, alpha, beta, opt, None, False, source, flops,
                       spec.num_params, spec.num_layers, efficiency=flops / beta / (peak * TFLOPS), peak_tflops=peak)


# ---- which profile a plan used ------------------------------------------------------------------


def load_changed(profile: StepProfile, load_now: float | None) -> bool:
    """The machine's 1-minute load average now differs from the one the profile recorded by more than
    LOAD_CHANGE_FLAG (False when either is unknown)."""
    if profile.load_avg is None or load_now is None:
        return False
    return abs(load_now - profile.load_avg) > LOAD_CHANGE_FLAG


def other_devices(profile: StepProfile, run_cpu_kinds: Sequence[str] | None) -> bool:
    """A CPU kind measured beside other devices than the run's CPU devices (`run_cpu_kinds`, one
    entry per device): timed together with another set, or alone while the run shares the machine
    between several. False when unknown (a profile without provenance, or no run given)."""
    if run_cpu_kinds is None or not profile.how or not _is_cpu(split_profile_key(profile.device_type)[0]):
        return False
    window = profile.together_with if profile.how == HOW_TOGETHER else (profile.device_type,)
    return sorted(window) != sorted(run_cpu_kinds)


def profile_note(profile: StepProfile, load_now: float | None = None,
                 run_cpu_kinds: Sequence[str] | None = None) -> str:
    """A plan note naming the profile a device kind is priced by (StepProfile.describe), flagging a
    measurement taken under visibly different load than `load_now` (load_changed) or beside other
    devices than the run's CPU devices `run_cpu_kinds` (other_devices): then it says to profile again."""
    note = f"profile {profile.describe()}"
    if load_changed(profile, load_now):
        note += (f"; profiled at load {profile.load_avg:.2f}, now {load_now:.2f}: the machine is visibly "
                 "busier or quieter than when it was measured")
    if other_devices(profile, run_cpu_kinds):
        window = " + ".join(profile.together_with) if profile.how == HOW_TOGETHER else "alone"
        note += f"; profiled beside other devices ({window}) than the run's ({' + '.join(run_cpu_kinds)})"
    if load_changed(profile, load_now) or other_devices(profile, run_cpu_kinds):
        note += f": {PROFILE_AGAIN}"
    return note


def _load_now() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # a platform without a load average
        return None


def profile_notes(plan: Plan, profiles_dir: str | None = None) -> tuple[str, ...]:
    """One note per device kind the plan trains on, naming the step profile it was priced by (the
    store's profile of that key, which is the newest saved: profile_note), and
    flagging one taken under a load average more than LOAD_CHANGE_FLAG away from the machine's now
    or beside other devices than the plan's CPU devices; a kind with no measured profile says how to
    measure it. A flagged or missing profile's note ends in PROFILE_AGAIN."""
    spec = with_max_seq(get_model(plan.model), plan.seq)
    devices = plan.cluster.devices()
    used = [devices[a.device_index][1] for a in plan.assignments if a.used]
    cpu_kinds = [d.profile_key for d in used if d.type == CPU_TYPE]
    load_now, notes = _load_now(), []
    for kind in dict.fromkeys(d.profile_key for d in used):
        p = get_step_profile(kind, spec, plan.seq, plan.dtype, plan.recompute, profiles_dir)
        if p.measured:
            notes.append(profile_note(p, load_now, cpu_kinds))
        else:
            notes.append(f"profile {kind}: none measured, priced by an estimate: {PROFILE_AGAIN}")
    return tuple(notes)


def with_profile_notes(plan: Plan, profiles_dir: str | None = None, notes: tuple[str, ...] | None = None) -> Plan:
    """The plan with its notes naming the step profiles it was priced by (`notes`, else `profile_notes`
    written now), in place of any it carried ("profile KIND: …" of its device kinds)."""
    named = tuple(f"profile {d.profile_key}:" for _, d in plan.cluster.devices())
    kept = tuple(n for n in plan.notes if not n.startswith(named))
    return replace(plan, notes=kept + (profile_notes(plan, profiles_dir) if notes is None else notes))


# ---- least squares (shared by the profiler's fits) --------------------------------------------------


def fit_line(xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None,
             nonnegative_intercept: bool = False) -> tuple[float, float, float]:
    """Weighted least squares `y = a + b·x`: returns (a, b, R²), R² = 1 − SS_res / SS_tot
    (both weighted). `nonnegative_intercept`: when the free fit gives a < 0 (a fixed cost
    below zero has no meaning), refit through the origin instead."""
    n = len(xs)
    if n < 2 or n != len(ys):
        raise ValueError(f"a line fit needs at least 2 points of (x, y), got {n}")
    w = [1.0] * n if weights is None else [float(v) for v in weights]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    if sxx == 0:
        raise ValueError("a line fit needs at least 2 distinct x values")
    b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
    a = my - b * mx
    if nonnegative_intercept and a < 0:
        a, b = 0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs))
    ss_tot = sum(wi * (y - my) ** 2 for wi, y in zip(w, ys))
    ss_res = sum(wi * (y - a - b * x) ** 2 for wi, x, y in zip(w, xs, ys))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return a, b, r2


__all__ = [
    "StepProfile", "CollectiveFit", "CollectiveProfile", "MatmulResult", "DeviceBench", "Calibration",
    "get_step_profile", "get_collective_profile", "get_device_bench", "save_step_profile", "save_device_bench",
    "load_step_profiles", "find_measured", "calibration", "peak_tflops", "analytic_flops_per_sample", "fit_line",
    "step_profile_path", "bench_path", "store_root", "profile_note", "load_changed", "HOW_TOGETHER", "HOW_ALONE",
    "LOAD_CHANGE_FLAG", "PROFILE_AGAIN", "other_devices",
]
