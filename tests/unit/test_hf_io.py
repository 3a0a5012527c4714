"""Hugging Face weights in and out (executor/hf_io.py), against `transformers` itself.

Small random Llama (GQA, untied) and GPT-2 (tied, fused transposed Conv1D) models are built and
saved by transformers (one file, and sharded with an index); HFWeights fills 1- and 2-position
ShardedRuntimes (LocalCollectives: one process per position) at zero 1 and 3; the positions'
slices put together give the decoder whose logits equal transformers' (<= 1e-5). A rank holding
a small slice reads a small part of the file (elements counted at safetensors' get_slice). An
export of a checkpoint loads with from_pretrained and gives the decoder's logits again."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch

from executor import checkpoint as ckpt
from executor.hf_io import HFWeights, export_run, hf_config
from models.collectives import LocalCollectives
from models.decoder import decoder_state_dict_to_hf
from models.sharded import ShardedRuntime
from contracts.cli import main as cli_main
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan
from contracts.specs import ModelSpec, get_model

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VOCAB, SEQ = 96, 16
TOL = 1e-5


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def _perturbed(model):
    """Non-trivial norms and biases (transformers initializes them to 1 and 0)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"llama": dir, "llama-sharded": dir, "gpt2": dir, "gpt2-sharded": dir} and the models."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    models = {"llama": _perturbed(_llama()), "gpt2": _perturbed(_gpt2())}
    out = {}
    for fam, m in models.items():
        out[fam] = str(root / fam)
        m.save_pretrained(out[fam])
        out[f"{fam}-sharded"] = str(root / f"{fam}-sharded")
        m.save_pretrained(out[f"{fam}-sharded"], max_shard_size="20KB")
    assert os.path.isfile(os.path.join(out["llama-sharded"], "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(out["gpt2-sharded"], "model.safetensors.index.json"))
    return out, models


def _spec(folder: str) -> ModelSpec:
    return get_model(os.path.join(folder, "config.json"))


def _runtime(spec, zero=1, fractions=(1.0,), position=0, materialize=False):
    return ShardedRuntime(spec, zero=zero, fractions=list(fractions), position=position,
                          comm=LocalCollectives(position, len(fractions)), device=CPU, materialize=materialize)


def _assemble(spec, parts: list[ShardedRuntime]) -> ShardedRuntime:
    """One full-model runtime from the positions' master slices, put side by side."""
    whole = _runtime(spec)
    for i, u in enumerate(whole.units):
        pieces = sorted(((p.units[i].start, p.units[i].master) for p in parts), key=lambda sp: sp[0])
        full = torch.cat([m for _, m in pieces])
        assert full.numel() == u.numel
        with torch.no_grad():
            u.master.copy_(full)  # zero 1, one position: master is the full buffer
    return whole


def _tokens(seed=3):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _max_logit_diff(rt: ShardedRuntime, hf_model) -> float:
    x = _tokens()
    with torch.no_grad():
        return (rt.model(x) - hf_model(x).logits).abs().max().item()


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("zero,fractions", [(1, (1.0,)), (1, (0.7, 0.3)), (3, (0.35, 0.65))])
def test_loaded_decoder_gives_transformers_logits(folders, fam, sharded, zero, fractions):
    out, models = folders
    folder = out[f"{fam}-sharded" if sharded else fam]
    spec = _spec(folder)
    parts = []
    for p in range(len(fractions)):
        rt = _runtime(spec, zero, fractions, p)
        rt.load_parameters(HFWeights(folder, spec).read)
        parts.append(rt)
    whole = _assemble(spec, parts)
    assert _max_logit_diff(whole, models[fam]) <= TOL
    # and a scrambled copy does not pass: the comparison can fail
    with torch.no_grad():
        whole.units[1].master.copy_(whole.units[1].master.flip(0))
    assert _max_logit_diff(whole, models[fam]) > 1e-3


def test_parameters_land_where_transformers_keeps_them(folders):
    out, models = folders
    h = 32
    rt = _runtime(_spec(out["gpt2"]))
    rt.load_parameters(HFWeights(out["gpt2"], _spec(out["gpt2"])).read)
    sd, ref = rt.full_state_dict(), models["gpt2"].state_dict()
    c_attn = ref["transformer.h.1.attn.c_attn.weight"]  # Conv1D: (in, 3 out)
    assert torch.equal(sd["blocks.1.attn.k_proj.weight"], c_attn[:, h:2 * h].t())
    assert torch.equal(sd["blocks.1.attn.v_proj.bias"], ref["transformer.h.1.attn.c_attn.bias"][2 * h:])
    assert torch.equal(sd["blocks.0.mlp.down_proj.weight"], ref["transformer.h.0.mlp.c_proj.weight"].t())
    assert torch.equal(sd["pos_embed.weight"], ref["transformer.wpe.weight"])
    rt = _runtime(_spec(out["llama-sharded"]))
    rt.load_parameters(HFWeights(out["llama-sharded"], _spec(out["llama-sharded"])).read)
    sd, ref = rt.full_state_dict(), models["llama"].state_dict()
    assert torch.equal(sd["blocks.1.attn.k_proj.weight"], ref["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(sd["blocks.0.mlp_norm.weight"], ref["model.layers.0.post_attention_layernorm.weight"])
    assert torch.equal(sd["lm_head.weight"], ref["lm_head.weight"])


class _CountingOpen:
    """safetensors.safe_open, counting the elements every get_slice()[...] returns."""

    def __init__(self, real, counter: list[int]):
        self.real, self.counter = real, counter

    def __call__(self, *args, **kwargs):
        return _CountingHandle(self.real(*args, **kwargs), self.counter)


class _CountingHandle:
    def __init__(self, h, counter):
        self.h, self.counter = h, counter

    def __enter__(self):
        self.h.__enter__()
        return self

    def __exit__(self, *exc):
        return self.h.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_slice(self, name):
        return _CountingSlice(self.h.get_slice(name), self.counter)


class _CountingSlice:
    def __init__(self, s, counter):
        self.s, self.counter = s, counter

    def get_shape(self):
        return self.s.get_shape()

    def __getitem__(self, idx):
        t = self.s[idx]
        self.counter[0] += t.numel()
        return t


@pytest.mark.parametrize("fam", ["llama-sharded", "gpt2"])
def test_a_rank_reads_only_its_own_slice(folders, monkeypatch, fam):
    import safetensors

    out, _ = folders
    spec = _spec(out[fam])
    counter = [0]
    monkeypatch.setattr(safetensors, "safe_open", _CountingOpen(safetensors.safe_open, counter))
    whole = _runtime(spec)
    whole.load_parameters(HFWeights(out[fam], spec).read)
    assert counter[0] == spec.num_params  # the one position reads every element exactly once
    counter[0] = 0
    small = _runtime(spec, 3, (0.9, 0.1), 1)
    small.load_parameters(HFWeights(out[fam], spec).read)
    # plain ints in the asserts: pytest's repr of a zero-3 runtime would print freed storages
    owned, num_units, read = small.shard_numel(), len(small.units), counter[0]
    assert owned <= 0.11 * spec.num_params
    # at most one extra decoder row (128 elements at most here) at each end of each unit's slice
    assert owned <= read <= owned + num_units * 2 * 128
    assert read < 0.2 * spec.num_params


def _one_line_error(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_bad_folders_are_refused_with_one_line(folders, tmp_path):
    out, _ = folders
    llama = _spec(out["llama"])
    with pytest.raises(ValueError) as e:  # another model's config
        HFWeights(out["gpt2"], llama)
    assert "family" in _one_line_error(e)
    bad = tmp_path / "bad"
    shutil.copytree(out["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    with pytest.raises(ValueError) as e:
        HFWeights(str(bad), llama)
    assert "num_kv_heads" in _one_line_error(e)
    # the config matches but a tensor is missing / has the wrong shape
    from safetensors.torch import load_file, save_file

    (bad / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(bad / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
              str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        HFWeights(str(bad), llama)
    assert "model.layers.1.mlp.up_proj.weight" in _one_line_error(e) and "missing" in str(e.value)
    tensors["model.layers.0.self_attn.v_proj.weight"] = tensors["model.layers.0.self_attn.v_proj.weight"][:8]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        HFWeights(str(bad), llama)
    assert "shape [8, 32]" in _one_line_error(e)
    os.remove(bad / "model.safetensors")
    with pytest.raises(ValueError) as e:
        HFWeights(str(bad), llama)
    assert "model.safetensors" in _one_line_error(e)
    with pytest.raises(ValueError) as e:
        HFWeights(str(tmp_path), llama)
    assert "config.json" in _one_line_error(e)


# ---- export --------------------------------------------------------------------------------------


def _plan(model: str) -> Plan:
    cluster = ClusterSpec("test", (NodeSpec("localhost", "local", (DeviceSpec("cpu"),)),))
    return Plan(cluster, model, 2, SEQ, "fp32", "none", (Assignment(0, "localhost", "cpu", 2, 1, 2, 1.0, 0, 0.0),),
                0.0, 0.0, zero=1)


def _write_run(run_dir: str, model: str, runtimes: dict[int, ShardedRuntime]) -> Plan:
    """A run folder as a 1-rank launch leaves it: plan.json and checkpoints of the given steps."""
    plan = _plan(model)
    os.makedirs(run_dir, exist_ok=True)
    plan.save(os.path.join(run_dir, "plan.json"))
    for step, rt in sorted(runtimes.items()):
        ckpt.save(run_dir, rt, 0, step, plan)
    return plan


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _export_logits(out_dir: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        return model(_tokens()).logits


def _logits(rt: ShardedRuntime) -> torch.Tensor:
    with torch.no_grad():
        return rt.model(_tokens())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny"])
def test_export_of_a_preset_run_loads_in_transformers(tmp_path, data_dir, preset):
    spec = get_model(preset)
    torch.manual_seed(1)
    rt = _runtime(spec, materialize=True)
    with torch.no_grad():  # norms and biases away from 1 and 0, so a swapped one shows
        for u in rt.units:
            u.master.add_(0.05 * torch.randn_like(u.master))
    run = str(tmp_path / "run")
    _write_run(run, preset, {4: rt})
    out = export_run(run, str(tmp_path / "export"))
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors"} <= files and "tokenizer.json" not in files
    cfg = _config(out)
    assert cfg["model_type"] == ("llama" if preset == "tiny-llama" else "gpt2")
    assert cfg["tie_word_embeddings"] is spec.tied_embeddings
    ours = _logits(rt)
    assert (ours - _export_logits(out)).abs().max().item() <= TOL


def test_export_from_a_hf_folder_run_step_k_sharded_with_tokenizer(folders, tmp_path, data_dir, capsys):
    out, models = folders
    folder = out["llama"]
    spec = _spec(folder)
    first = _runtime(spec)
    first.load_parameters(HFWeights(folder, spec).read)
    second = _runtime(spec)
    with torch.no_grad():
        for u1, u2 in zip(first.units, second.units):
            u2.master.copy_(u1.master + 0.05)
    run = str(tmp_path / "run")
    _write_run(run, os.path.join(folder, "config.json"), {2: first, 5: second})
    from tokenizers import Tokenizer, models as tmodels

    Tokenizer(tmodels.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")).save(
        os.path.join(run, "tokenizer.json"))
    # newest: step 5, in several files with an index
    newest = export_run(run, str(tmp_path / "newest"), max_shard_bytes=8000)
    files = os.listdir(newest)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    assert {"tokenizer.json", "generation_config.json"} <= set(files)
    assert (_logits(second) - _export_logits(newest)).abs().max().item() <= TOL
    cfg, base = _config(newest), _config(folder)
    assert cfg["rms_norm_eps"] == base["rms_norm_eps"] and cfg["model_type"] == "llama"
    # step 2 is the transformers model itself, through the CLI
    rc = cli_main("python -m executor", {"export": "executor.commands.export"},
                  ["export", "--run-dir", run, "--out", str(tmp_path / "step2"), "--step", "2", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["step"] == 2
    with torch.no_grad():
        theirs = models["llama"](_tokens()).logits
    assert (theirs - _export_logits(str(tmp_path / "step2"))).abs().max().item() <= TOL
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "step2"))
    assert tokenizer.convert_tokens_to_ids("w7") == 7


def test_export_refuses_bad_input_with_exit_2(tmp_path, data_dir, capsys):
    run = str(tmp_path / "run")
    _write_run(run, "tiny", {3: _runtime(get_model("tiny"), materialize=True)})
    argv = ["export", "--run-dir", run, "--out", str(tmp_path / "x"), "--step", "7"]
    assert cli_main("python -m executor", {"export": "executor.commands.export"}, argv) == 2
    err = capsys.readouterr().err.strip()
    assert "no checkpoint of step 7" in err and "[3]" in err and "\n" not in err
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    argv = ["export", "--run-dir", empty, "--out", str(tmp_path / "y")]
    assert cli_main("python -m executor", {"export": "executor.commands.export"}, argv) == 2
    assert "plan.json" in capsys.readouterr().err


_BASE = ModelSpec("q", "llama", 2, 32, 4, 2, 48, VOCAB, 64, tied_embeddings=False, norm_eps=1e-6, rope_theta=1e6)
CONFIG_CASES = {
    "qwen2": (replace(_BASE, qkv_bias=True, tied_embeddings=True), "qwen2"),
    "llama-biases": (replace(_BASE, qkv_bias=True, o_bias=True, mlp_bias=True), "llama"),
    "llama3-rope": (replace(_BASE, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                            rope_high_freq_factor=4.0, rope_original_max_seq=16), "llama"),
    "mistral-window": (replace(_BASE, sliding_window=64), "mistral"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_config_written_from_the_spec_builds_the_same_model(case):
    """Runs of presets have no HF config to start from: the one written from the spec builds, in
    transformers, the model the decoder is (its weights through decoder_state_dict_to_hf)."""
    spec, model_type = CONFIG_CASES[case]
    torch.manual_seed(2)
    rt = _runtime(spec, materialize=True)
    with torch.no_grad():
        for u in rt.units:
            u.master.add_(0.05 * torch.randn_like(u.master))
    cfg = hf_config(spec)
    assert cfg["model_type"] == model_type
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    missing, unexpected = model.load_state_dict(decoder_state_dict_to_hf(spec, rt.full_state_dict()), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing) and (not missing or spec.tied_embeddings)
    model.tie_weights()
    with torch.no_grad():
        assert (_logits(rt) - model.eval()(_tokens()).logits).abs().max().item() <= TOL
