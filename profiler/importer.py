"""Measured profiles from elsewhere into the profile store: Sailor's files and the GPUMix layer format.

Sailor (SOSP'25; github.com/eth-easl/sailor) ships per-layer [forward, backward, update] seconds by
model, GPU type, micro-batch and tensor-parallel degree (`profiles_tmp.json`, measured with
Megatron-DeepSpeed) and network bandwidth fits (`multizone_bandwidths_het.json` between nodes,
`intra_node_bandwidths.json` inside one). `read_sailor_profiles` maps its GPU and model names to
GPUMix's and converts one model's table into the GPUMix layer-profile format
(planner/core/layer_profiles.py), which `--format gpumix` files hold directly; both then share
`import_layer_profiles` (per-layer table kept, step profiles fitted and stored). `read_sailor_network`
converts a bandwidth file into a stored NetworkProfile (planner/costmodel/netcurve.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from contracts.jsonio import load_json_file
from contracts.specs import PRESETS, ModelSpec, get_model
from planner.core.layer_profiles import FittedProfile, LayerMeasurement, LayerProfiles, fit_step_profiles, save_layer_profiles
from planner.core.profiles import save_step_profile
from planner.costmodel.netcurve import BandwidthCurve, NetworkProfile, save_network_profile

MAX_IMPORT_FILE_BYTES = 64 * 2**20  # Sailor's largest file is 0.6 MB

# Sailor's GPU names -> catalog types. "RTX-2080" is the 11 GiB card (Sailor's basic_cluster_config.json:
# mem_per_gpu 11811160064), i.e. the 2080 Ti; "GH-96" the GH200 with 96 GB of HBM3.
SAILOR_GPU_TYPES = {
    "A100-40": "A100-40GB", "A100-80": "A100-80GB", "V100-16": "V100-16GB", "V100-32": "V100-32GB",
    "GH-96": "GH200-96GB", "H100-80": "H100-SXM", "Titan-RTX": "TitanRTX", "RTX-2080": "RTX2080Ti",
    "RTX-3090": "RTX3090", "P100-16": "P100",
}

# Sailor's model names -> GPUMix specs. OPT-350 as Sailor trains it (training_config_opt_350.json,
# llm_info.json): a GPT-2-style decoder of 24 layers, hidden 1024, 16 heads, vocab 50272, 2048 learned
# positions, untied head: 407.4 M parameters, Sailor's count. OPT-30 likewise (48 layers, hidden 7168,
# 56 heads). GPT-Neo-2.7 is refused: its alternate local-attention layers are not GPUMix's decoder.
SAILOR_MODELS: dict[str, ModelSpec] = {
    "OPT-350": ModelSpec("opt-350", "gpt2", 24, 1024, 16, 16, 4096, 50272, 2048, tied_embeddings=False,
                         linear_bias=True),
    "OPT-30": ModelSpec("opt-30b", "gpt2", 48, 7168, 56, 56, 4 * 7168, 50272, 2048, tied_embeddings=False,
                        linear_bias=True),
    "LLAMA-3-8": PRESETS["llama3-8b"],
}
# Sailor's training configs all use sequences of 2048 tokens; its profiles do not record it
SAILOR_SEQ = 2048
SAILOR_MEASURED_WITH = "measured with Megatron-DeepSpeed, fp32 with TF32 matmuls on Ampere and newer"


def resolve_model(name: str) -> tuple[ModelSpec, str | None]:
    """A GPUMix spec and Sailor's name for it: `name` is Sailor's model name (OPT-350), the GPUMix name of
    one (opt-350), a preset, or a path to a config.json."""
    for sailor, spec in SAILOR_MODELS.items():
        if name.lower() in (sailor.lower(), spec.name.lower()):
            return PRESETS.get(spec.name, spec), sailor
    if name.lower() == "gpt-neo-2.7":
        raise ValueError("model GPT-Neo-2.7 is not supported: its local-attention layers are not GPUMix's decoder")
    try:
        return get_model(name), None
    except ValueError as e:
        if "unknown model" not in str(e):
            raise
        raise ValueError(f"unknown model {name!r}: use one of Sailor's ({', '.join(SAILOR_MODELS)}), a preset "
                         "or a path to a config.json") from None


def _sailor_gpu(name: str, where: str) -> str:
    try:
        return SAILOR_GPU_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r} in {where}; known: {', '.join(sorted(SAILOR_GPU_TYPES))}") from None


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _int_key(key: str, what: str, where: str) -> int:
    if not key.isdigit() or int(key) <= 0:
        raise ValueError(f"{where}: {what} {key!r} is not a positive integer")
    return int(key)


def read_sailor_profiles(path: str, model: str, seq: int = SAILOR_SEQ) -> tuple[LayerProfiles, ModelSpec]:
    """One model's per-layer table of Sailor's `profiles_tmp.json`, as GPUMix layer profiles (fp32)."""
    spec, sailor_name = resolve_model(model)
    data = _object(load_json_file(path, "Sailor profiles file", MAX_IMPORT_FILE_BYTES), path)
    key = sailor_name or next((k for k in data if k.lower() == model.lower()), None)
    if key not in data:
        raise ValueError(f"model {model!r} is not in {path}; it has {', '.join(sorted(data))}")
    measurements = []
    for gpu, by_mb in _object(data[key], f"{path}: {key}").items():
        device = _sailor_gpu(gpu, path)
        for mb, by_tp in _object(by_mb, f"{path}: {key}/{gpu}").items():
            micro_batch = _int_key(mb, "micro-batch", f"{path}: {key}/{gpu}")
            for tp, layers in _object(by_tp, f"{path}: {key}/{gpu}/{mb}").items():
                where = f"{path}: {key}/{gpu}/mb {mb}/tp {tp}"
                layers = _object(layers, where)
                try:
                    order = sorted(layers, key=int)
                except ValueError:
                    raise ValueError(f"{where}: layer keys must be integers, got {sorted(layers)[:3]}") from None
                if [int(k) for k in order] != list(range(len(order))):
                    raise ValueError(f"{where}: layers must be numbered 0..{len(order) - 1}")
                measurements.append(LayerMeasurement.from_dict(
                    {"device_type": device, "micro_batch": micro_batch, "tp": _int_key(tp, "tp", where),
                     "layers_s": [layers[k] for k in order]}, where))
    if not measurements:
        raise ValueError(f"{path}: no measurements for model {key}")
    source = (f"imported from Sailor {os.path.basename(path)} ({os.path.abspath(path)}), model {key}, "
              f"{SAILOR_MEASURED_WITH}")
    lp = LayerProfiles(spec.name, seq, "fp32", "none", source, tuple(measurements))
    lp.check_model(spec, path)
    return lp, spec


def read_gpumix_profiles(path: str, model: str | None = None) -> tuple[LayerProfiles, ModelSpec]:
    """A file in the GPUMix layer-profile format (docs/profiler.md); `model`, when given, must name the
    file's model."""
    lp = LayerProfiles.from_dict(load_json_file(path, "layer-profile file", MAX_IMPORT_FILE_BYTES), path)
    spec, _ = resolve_model(model or lp.model)
    if spec.name != lp.model:
        raise ValueError(f"{path} holds model {lp.model!r}, not {spec.name!r}")
    lp.check_model(spec, path)
    return lp, spec


def import_layer_profiles(layers: LayerProfiles, spec: ModelSpec, store_dir: str | None = None,
                          created: str = "") -> list[FittedProfile]:
    """Keep the per-layer table and store one fitted step profile per (device type, TP degree)."""
    fitted = fit_step_profiles(layers, spec, created)
    save_layer_profiles(layers, store_dir)
    for f in fitted:
        save_step_profile(f.profile, store_dir)
    return fitted


@dataclass(frozen=True)
class _NetworkShape:
    kind: str
    curves: tuple[BandwidthCurve, ...]


def _curve(value: Any, where: str, **endpoints: Any) -> BandwidthCurve:
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], list)
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in value[0])
            or isinstance(value[1], bool) or not isinstance(value[1], (int, float))):
        raise ValueError(f"{where}: expected [[coefficients...], maximum bytes/s], got {str(value)[:80]}")
    try:
        return BandwidthCurve(coeffs_gb_per_s=tuple(float(c) for c in value[0]), max_bytes_per_s=float(value[1]),
                              **endpoints)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _read_network_shape(data: dict, path: str) -> _NetworkShape:
    """Sailor's inter-node file: zone -> GPU -> count -> zone -> GPU -> count -> curve; its intra-node
    file: GPU -> count -> curve. Told apart by the top level: GPU names or zones."""
    if data and all(k in SAILOR_GPU_TYPES for k in data):
        curves = []
        for gpu, by_count in data.items():
            device = _sailor_gpu(gpu, path)
            for count, value in _object(by_count, f"{path}: {gpu}").items():
                n = _int_key(count, "GPU count", f"{path}: {gpu}")
                curves.append(_curve(value, f"{path}: {gpu}/{count}", gpu_type_a=device, num_gpus_a=n,
                                     gpu_type_b=device, num_gpus_b=n))
        return _NetworkShape("intra_node", tuple(curves))
    curves = []
    for zone_a, by_gpu in data.items():
        for gpu_a, by_count in _object(by_gpu, f"{path}: {zone_a}").items():
            device_a = _sailor_gpu(gpu_a, path)
            for count_a, by_zone in _object(by_count, f"{path}: {zone_a}/{gpu_a}").items():
                n_a = _int_key(count_a, "GPU count", f"{path}: {zone_a}/{gpu_a}")
                for zone_b, by_gpu_b in _object(by_zone, f"{path}: {zone_a}/{gpu_a}/{count_a}").items():
                    for gpu_b, by_count_b in _object(by_gpu_b, f"{path}: …/{zone_b}").items():
                        device_b = _sailor_gpu(gpu_b, path)
                        for count_b, value in _object(by_count_b, f"{path}: …/{zone_b}/{gpu_b}").items():
                            where = f"{path}: {zone_a}/{gpu_a}/{count_a} -> {zone_b}/{gpu_b}/{count_b}"
                            curves.append(_curve(value, where, zone_a=zone_a, gpu_type_a=device_a, num_gpus_a=n_a,
                                                 zone_b=zone_b, gpu_type_b=device_b,
                                                 num_gpus_b=_int_key(count_b, "GPU count", where)))
    if not curves:
        raise ValueError(f"{path}: no bandwidth curves found")
    return _NetworkShape("inter_node", tuple(curves))


def read_sailor_network(path: str) -> NetworkProfile:
    """A Sailor bandwidth file as a NetworkProfile named after the file (e.g. `multizone_bandwidths_het`)."""
    data = _object(load_json_file(path, "Sailor network file", MAX_IMPORT_FILE_BYTES), path)
    shape = _read_network_shape(data, path)
    name = os.path.splitext(os.path.basename(path))[0]
    source = (f"imported from Sailor {os.path.basename(path)} ({os.path.abspath(path)}): measured bandwidth, "
              "polynomial in log2(message MB) in GB/s, capped at the measured maximum")
    return NetworkProfile(name, shape.kind, source, shape.curves)


def import_sailor_network(path: str, store_dir: str | None = None) -> tuple[NetworkProfile, str]:
    profile = read_sailor_network(path)
    return profile, save_network_profile(profile, store_dir)


__all__ = ["SAILOR_GPU_TYPES", "SAILOR_MODELS", "resolve_model", "read_sailor_profiles", "read_gpumix_profiles",
           "import_layer_profiles", "read_sailor_network", "import_sailor_network"]
