"""Hugging Face weights in and out: `--init-from DIR` and `python -m executor export`.

Each decoder parameter (models/decoder.py's names) lies in a range of rows, or for GPT-2's
transposed Conv1D of columns, of one Hugging Face tensor (GPT-2 fuses q, k and v into one c_attn).

In: `HFWeights(folder, spec).read(name, a, b)` is what `ShardedRuntime.load_parameters` calls for
the elements [a, b) a rank owns; it reads only those rows or columns through safetensors'
`get_slice`, so a rank holding 1/8 of a model reads about 1/8 of the file.

Out: `export_run(run_dir, out_dir)` loads a run's checkpoint into a one-position runtime and writes
`model.safetensors` (sharded with an index above `max_shard_bytes`), a `config.json` that
`AutoModelForCausalLM.from_pretrained` builds the same architecture from, and the run's tokenizer.
The name mapping itself is models/decoder.py's `hf_source` / `decoder_state_dict_to_hf`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, fields
from typing import Any

import torch

from executor.backend import TOKENIZER_FILES, copy_tokenizer
from models.decoder import decoder_state_dict_to_hf, hf_source
from contracts.specs import ModelSpec, get_model, spec_from_hf_dict, with_max_seq

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' own default shard size is 5 GB (PreTrainedModel.save_pretrained before v5)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class _Range:
    """Where one decoder parameter lies in the folder's HF tensor `key`: indices [lo, hi) along its
    first axis (transposed=False: decoder row r is HF row lo + r) or its second axis
    (transposed=True, GPT-2 Conv1D: decoder row r is HF column lo + r)."""

    key: str
    lo: int
    hi: int
    transposed: bool


def decoder_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """{decoder parameter name: shape}, in the decoder's registration order (built on meta: no memory)."""
    from models.decoder import build_model

    with torch.device("meta"):
        model = build_model(spec)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


# ---- reading a Hugging Face folder, slice by slice -----------------------------------------------


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from None


def spec_mismatch(got: ModelSpec, want: ModelSpec) -> str | None:
    """The first architecture field on which two specs differ (as "key: a vs b"), or None. The name
    never counts; neither does max_seq for RoPE models (it sizes no parameter)."""
    skip = {"name"} | ({"max_seq"} if want.positional == "rope" else set())
    for f in fields(want):
        if f.name not in skip and getattr(got, f.name) != getattr(want, f.name):
            return f"{f.name}: {getattr(got, f.name)!r} in the folder's config vs {getattr(want, f.name)!r} in the plan"
    return None


class HFWeights:
    """A local Hugging Face model folder (`model.safetensors`, or shards with
    `model.safetensors.index.json`) read as the decoder of `spec`, one slice at a time.

    `read(name, a, b)` -> fp32 elements [a, b) of the decoder parameter `name`, flattened row-major:
    the argument `ShardedRuntime.load_parameters` takes. Opening checks the config and every
    tensor's presence and shape (ValueError, one line); files are memory-mapped by safetensors and
    opened on first use. `elements_read` counts the elements fetched from the files."""

    def __init__(self, folder: str, spec: ModelSpec):
        self.folder, self.spec = os.path.abspath(folder), spec
        cfg_path = os.path.join(self.folder, CONFIG_FILE)
        if not os.path.isfile(cfg_path):
            raise ValueError(f"{folder}: no {CONFIG_FILE} (not a Hugging Face model folder)")
        diff = spec_mismatch(spec_from_hf_dict(_read_json(cfg_path, "config"), source=cfg_path), spec)
        if diff is not None:
            raise ValueError(f"{folder}: its config is not the plan's model {spec.name!r} ({diff})")
        self.files = self._weight_map()
        self.shapes = decoder_shapes(spec)
        self._handles: dict[str, Any] = {}
        self.elements_read = 0
        self.ranges = {name: self._range(name, shape) for name, shape in self.shapes.items()}

    def _key(self, name: str) -> str:
        """The folder's tensor name for decoder parameter `name`: transformers' prefixed key, or the
        key without its top-module prefix (the original GPT-2 files have `h.0.attn...`, `wte.weight`)."""
        key = hf_source(self.spec, name).key
        bare = key.split(".", 1)[1] if key.startswith(("transformer.", "model.")) else key
        if key not in self.files and bare in self.files:
            return bare
        if key not in self.files:
            raise ValueError(f"{self.folder}: tensor {key!r} is missing (needed for the plan's model {self.spec.name!r})")
        return key

    def _range(self, name: str, shape: tuple[int, ...]) -> _Range:
        """Where decoder parameter `name` lies in its HF tensor; ValueError when the shapes disagree."""
        src = hf_source(self.spec, name)
        key = self._key(name)
        hf_shape = tuple(self._slice(key).get_shape())
        axis = 1 if src.transpose else 0
        if src.part is not None:  # GPT-2 c_attn: [q | k | v] along the last axis, a third each
            width = hf_shape[-1] // 3 if hf_shape else 0
            lo, hi = src.part * width, (src.part + 1) * width
        else:
            lo, hi = 0, hf_shape[axis] if len(hf_shape) > axis else 0
        rows = hf_shape[:1] if src.transpose else hf_shape[1:]
        if (hi - lo, *rows) != shape or (src.transpose and len(hf_shape) != 2):
            raise ValueError(f"{self.folder}: tensor {key!r} has shape {list(hf_shape)}, which does not hold the "
                             f"plan's model's {name} {list(shape)}")
        return _Range(key, lo, hi, src.transpose)

    def _weight_map(self) -> dict[str, str]:
        """{HF tensor name: absolute file path}."""
        from safetensors import safe_open

        index = os.path.join(self.folder, INDEX_FILE)
        if os.path.isfile(index):
            wmap = _read_json(index, "index").get("weight_map")
            if not isinstance(wmap, dict):
                raise ValueError(f"{index}: no 'weight_map' object")
            out = {k: os.path.join(self.folder, v) for k, v in wmap.items()}
            for path in sorted(set(out.values())):
                if not os.path.isfile(path):
                    raise ValueError(f"{index} names {os.path.basename(path)}, which is not in the folder")
            return out
        single = os.path.join(self.folder, SINGLE_FILE)
        if not os.path.isfile(single):
            raise ValueError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are read)")
        try:
            with safe_open(single, framework="pt") as f:
                return {k: single for k in f.keys()}
        except Exception as e:  # safetensors raises its own SafetensorError on a damaged file
            raise ValueError(f"{single}: not a safetensors file ({str(e).splitlines()[0] if str(e) else e})") from None

    def _slice(self, hf: str) -> Any:
        from safetensors import safe_open

        path = self.files[hf]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt")
        return handle.get_slice(hf)

    def read(self, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of decoder parameter `name` flattened row-major, fp32. Reads only the
        decoder rows those elements lie in: HF rows, or HF columns of a transposed Conv1D."""
        src, shape = self.ranges[name], self.shapes[name]
        cols = math.prod(shape[1:])  # elements per decoder row (1 for a vector)
        if not 0 <= a < b <= shape[0] * cols:
            raise ValueError(f"{name}: elements [{a}, {b}) are not inside its {shape[0] * cols}")
        r0, r1 = a // cols, -(-b // cols)  # decoder rows [r0, r1) hold [a, b)
        sl = self._slice(src.key)
        if src.transposed:
            part = sl[:, src.lo + r0:src.lo + r1].t()  # HF (c, r1-r0) -> decoder rows (r1-r0, c)
        else:
            part = sl[src.lo + r0:src.lo + r1]  # (r1-r0, *rest)
        self.elements_read += part.numel()
        # a copy: safetensors' slices are views of the memory-mapped file
        return part.reshape(-1)[a - r0 * cols:b - r0 * cols].to(torch.float32, copy=True)

    def close(self) -> None:
        self._handles.clear()  # safetensors unmaps a file when its handle is collected

    def __enter__(self) -> "HFWeights":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- writing a Hugging Face folder ---------------------------------------------------------------


def _llama_config(spec: ModelSpec) -> dict[str, Any]:
    """The Llama-style model type whose modules are the decoder's: Qwen2 for q/k/v biases alone
    (its o_proj and MLP have none), Mistral for a sliding window, Llama otherwise (attention_bias:
    q/k/v/o biases, mlp_bias: gate/up/down)."""
    qwen = spec.qkv_bias and not spec.o_bias and not spec.mlp_bias
    mtype = "qwen2" if qwen else "mistral" if spec.sliding_window else "llama"
    rope = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type != "default":
        rope["factor"] = spec.rope_factor
    if spec.rope_type == "llama3":
        rope.update(low_freq_factor=spec.rope_low_freq_factor, high_freq_factor=spec.rope_high_freq_factor,
                    original_max_position_embeddings=spec.rope_original_max_seq)
    cfg = {"architectures": [{"qwen2": "Qwen2", "mistral": "Mistral", "llama": "Llama"}[mtype] + "ForCausalLM"],
           "model_type": mtype, "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden,
           "intermediate_size": spec.ffn_hidden, "num_attention_heads": spec.num_heads,
           "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
           "max_position_embeddings": spec.max_seq, "rms_norm_eps": spec.norm_eps, "hidden_act": "silu",
           # transformers 5 reads rope_parameters; rope_theta (+ rope_scaling) is what 4.x reads
           "rope_theta": spec.rope_theta, "rope_parameters": rope, "sliding_window": spec.sliding_window}
    if spec.rope_type != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if mtype == "llama":
        cfg.update(attention_bias=spec.o_bias, mlp_bias=spec.mlp_bias)
    if mtype == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def hf_config(spec: ModelSpec, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `config.json` from which transformers builds the decoder of `spec`. With `base` (the config
    of the folder the run started from) that config is kept, with the dtype and position table set
    to what was trained; otherwise one is written for the family (GPT-2; Llama, Qwen2 or Mistral,
    _llama_config). Read back by contracts/specs.py it must give `spec` again, or ValueError."""
    if base is not None:
        cfg = dict(base)
        if spec.positional == "learned":  # with_max_seq may have grown the GPT-2 position table
            cfg["n_positions"] = spec.max_seq
            cfg.pop("n_ctx", None)
    elif spec.family == "gpt2":
        cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": spec.num_layers,
               "n_embd": spec.hidden, "n_head": spec.num_heads, "n_inner": spec.ffn_hidden,
               "vocab_size": spec.vocab_size, "n_positions": spec.max_seq, "layer_norm_epsilon": spec.norm_eps,
               "activation_function": "gelu_new",  # the decoder's tanh GELU
               # GPUMix trains without dropout; the export should fine-tune the same way
               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    elif spec.family == "llama":
        cfg = _llama_config(spec)
    else:
        raise ValueError(f"model {spec.name!r}: no Hugging Face config for family {spec.family!r}")
    cfg["tie_word_embeddings"] = spec.tied_embeddings
    cfg["torch_dtype"] = cfg["dtype"] = "float32"  # the masters are fp32 (transformers 4: torch_dtype, 5: dtype)
    diff = spec_mismatch(spec_from_hf_dict(cfg, name=spec.name, source="exported config"), spec)
    if diff is not None:  # never write a config that reads back as another model
        raise ValueError(f"the exported config would describe another model than {spec.name!r} ({diff})")
    return cfg


def _save_shards(tensors: dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when over max_shard_bytes,
    packed in order (a tensor larger than the limit gets a file of its own). Returns the files."""
    from safetensors.torch import save_file

    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    meta = {"format": "pt"}  # transformers checks it
    if len(groups) == 1:
        save_file(tensors, os.path.join(out_dir, SINGLE_FILE), metadata=meta)
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(out_dir, fname), metadata=meta)
        files.append(fname)
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return files + [INDEX_FILE]


def _checkpoint_run_dir(run_dir: str, step: int | None, scratch: str, plan: Any) -> str:
    """A run folder whose latest.json names the checkpoint to export: `run_dir` itself for the
    newest, else a scratch folder whose latest.json names step K's folder (checkpoint.load only
    reads the newest; the step folder is read in place, never copied)."""
    from executor import checkpoint as ckpt

    newest = ckpt.latest(run_dir)
    if newest is None:
        raise ValueError(f"{run_dir}: no checkpoint to export (launch with --checkpoint-every)")
    if step is None or step == newest.get("step"):
        return run_dir
    root = os.path.join(os.path.abspath(run_dir), ckpt.CKPT_DIR)
    path = os.path.join(root, f"step_{step:06d}")
    try:
        m0 = _read_json(ckpt.meta_path(path, 0), "checkpoint meta")
    except OSError:
        have = sorted(int(d[5:]) for d in os.listdir(root) if re.fullmatch(r"step_\d+", d))
        raise ValueError(f"{run_dir}: no checkpoint of step {step} (steps: {have or 'none'})") from None
    n = int(m0["num_positions"])
    for q in range(n):  # every saving position's meta present: the checkpoint is whole
        if not os.path.isfile(ckpt.meta_path(path, q)):
            raise ValueError(f"{path}: incomplete checkpoint (position {q} of {n} wrote no meta)")
    meta = dict(ckpt.checkpoint_meta(plan, step, path), num_positions=n)
    os.makedirs(os.path.join(scratch, ckpt.CKPT_DIR))
    with open(os.path.join(scratch, ckpt.CKPT_DIR, ckpt.LATEST), "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
    return scratch


def run_state_dict(run_dir: str, step: int | None = None) -> tuple[ModelSpec, dict[str, torch.Tensor], int]:
    """(spec, full decoder state dict, step) of a run's newest checkpoint (or step K's), read into a
    one-position runtime on the CPU."""
    from executor import checkpoint as ckpt
    from models.collectives import LocalCollectives
    from models.sharded import ShardedRuntime
    from contracts.plan import Plan

    plan_path = os.path.join(run_dir, "plan.json")
    if not os.path.isfile(plan_path):
        raise ValueError(f"{run_dir}: no plan.json (not a run folder)")
    plan = Plan.load(plan_path)
    spec = with_max_seq(get_model(plan.model), plan.seq)  # as the worker builds it
    rt = ShardedRuntime(spec, zero=1, fractions=[1.0], position=0, comm=LocalCollectives(0, 1),
                        device=torch.device("cpu"), materialize=False)
    with tempfile.TemporaryDirectory() as scratch:
        loaded = ckpt.load(_checkpoint_run_dir(run_dir, step, scratch, plan), rt, 0)
    return spec, rt.full_state_dict(), loaded


def _base_folder(model: str) -> str | None:
    """The Hugging Face folder a run's model came from (the plan names its config.json), or None."""
    if model.endswith(".json") and os.path.isfile(model):
        return os.path.dirname(os.path.abspath(model))
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, CONFIG_FILE)):
        return os.path.abspath(model)
    return None


def _tokenizer_source(run_dir: str, tokenizer: str | None, base: str | None) -> str | None:
    """tokenizer.json to ship: the one given, else the run's (recorded by the launcher), else the
    model folder's."""
    if tokenizer is not None:
        if not os.path.isfile(tokenizer):
            raise ValueError(f"tokenizer {tokenizer}: no such file")
        return tokenizer
    for folder in (run_dir, base):
        if folder and os.path.isfile(os.path.join(folder, TOKENIZER_FILES[0])):
            return os.path.join(folder, TOKENIZER_FILES[0])
    return None


def export_run(run_dir: str, out_dir: str, step: int | None = None, tokenizer: str | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Write the run's newest checkpoint (or step `step`'s) as a Hugging Face model folder that
    `AutoModelForCausalLM.from_pretrained(out_dir)` loads: weights (fp32 safetensors, sharded with
    an index above `max_shard_bytes`), config.json, generation_config.json when the model folder
    had one, and the tokenizer files. Returns out_dir (absolute). ValueError on bad input."""
    from contracts.plan import Plan

    run_dir = os.path.abspath(run_dir)
    spec, sd, loaded = run_state_dict(run_dir, step)
    base = _base_folder(Plan.load(os.path.join(run_dir, "plan.json")).model)
    base_cfg = _read_json(os.path.join(base, CONFIG_FILE), "config") if base else None
    cfg = hf_config(spec, base_cfg)
    tok = _tokenizer_source(run_dir, tokenizer, base)
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    stale = [f for f in os.listdir(out_dir) if f.endswith(".safetensors") or f == INDEX_FILE]
    for f in stale:  # a previous export's shards would be read with this one's index
        os.remove(os.path.join(out_dir, f))
    files = _save_shards(decoder_state_dict_to_hf(spec, sd), out_dir, max_shard_bytes)
    del sd
    with open(os.path.join(out_dir, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
    if base and os.path.isfile(os.path.join(base, GENERATION_CONFIG_FILE)):
        shutil.copyfile(os.path.join(base, GENERATION_CONFIG_FILE), os.path.join(out_dir, GENERATION_CONFIG_FILE))
    if tok is not None:
        copy_tokenizer(tok, out_dir)
    else:
        log.warning("run %s has no tokenizer.json (byte tokens): the export has weights and config only", run_dir)
    log.info("exported step %d of %s to %s (%s)", loaded, run_dir, out_dir, ", ".join(files))
    return out_dir


__all__ = ["HFWeights", "hf_config", "export_run", "run_state_dict", "spec_mismatch"]
