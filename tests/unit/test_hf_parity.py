"""GPUMix's decoder against `transformers` itself, family by family.

Numerics: a SMALL random model built locally with transformers (fp32, eval, eager attention),
its config read by contracts/specs.py (from `config.to_dict()` and from the folder that
`save_pretrained` writes), its weights copied in by models/decoder.py's mapping: the logits agree
within 1e-5 and the shifted cross-entropy equals transformers' `labels=` loss. The mapping's
inverse gives back transformers' state dict exactly.

Parameter counts: real published configs (written out below from the hub's config.json values)
against transformers' `num_parameters()` of the model built on the meta device.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import (AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from models.decoder import build_model, decoder_state_dict_to_hf, hf_state_dict_to_decoder
from contracts.specs import get_model, spec_from_hf_dict

VOCAB, SEQ = 101, 24
_L = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=VOCAB,
          max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

SMALL = {  # family case -> (config class, model class, config kwargs)
    "gpt2-tied": (GPT2Config, GPT2LMHeadModel, dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB,
                                                  n_positions=64, bos_token_id=1, eos_token_id=2)),
    "gpt2-untied": (GPT2Config, GPT2LMHeadModel, dict(n_embd=64, n_head=4, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                                    activation_function="gelu_pytorch_tanh", tie_word_embeddings=False,
                                                    bos_token_id=1, eos_token_id=2)),
    "llama2": (LlamaConfig, LlamaForCausalLM, _L),
    "llama3-rope-llama3-tied": (LlamaConfig, LlamaForCausalLM,
                                dict(_L, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE)),
    "llama-biases-rope-linear": (LlamaConfig, LlamaForCausalLM, dict(
        _L, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "mistral-sliding": (MistralConfig, MistralForCausalLM, dict(_L, num_key_value_heads=2, sliding_window=SEQ)),
    "qwen2-qkv-bias-tied": (Qwen2Config, Qwen2ForCausalLM, dict(_L, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-untied": (Qwen2Config, Qwen2ForCausalLM, dict(_L, num_key_value_heads=1, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})),
}


def _hf_model(case: str) -> torch.nn.Module:
    cfg_cls, model_cls, kw = SMALL[case]
    torch.manual_seed(0)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    with torch.no_grad():  # larger than the init's N(0, 0.02) (and non-zero biases, non-unit norms) so errors show
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(-0.5, 0.5)
    return model


def _decoder_from(spec, hf: torch.nn.Module) -> torch.nn.Module:
    dec = build_model(spec).eval()
    dec.load_state_dict(hf_state_dict_to_decoder(spec, hf.state_dict()), strict=True)
    return dec


def _compare(spec, hf, idx):
    dec = _decoder_from(spec, hf)
    with torch.no_grad():
        ref = hf(input_ids=idx, labels=idx)
        logits = dec(idx)
    # transformers shifts inside: position t predicts token t + 1
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, spec.vocab_size), idx[:, 1:].reshape(-1))
    return (logits - ref.logits).abs().max().item(), abs(loss.item() - ref.loss.item()), dec


@pytest.mark.parametrize("case", sorted(SMALL))
def test_logits_and_loss_equal_transformers(case, tmp_path):
    hf = _hf_model(case)
    spec = spec_from_hf_dict(hf.config.to_dict(), name=case)
    hf.config.save_pretrained(tmp_path)  # the folder form: config.json as transformers writes it
    assert replace(get_model(str(tmp_path)), name=case) == spec
    assert spec.num_params == hf.num_parameters()
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logit_diff, loss_diff, dec = _compare(spec, hf, idx)
    assert logit_diff <= 1e-5, logit_diff
    assert loss_diff <= 1e-6, loss_diff
    # the inverse mapping gives transformers' tensors back (a tied head has no lm_head.weight of its own)
    back, ref = decoder_state_dict_to_hf(spec, dec.state_dict()), hf.state_dict()
    assert set(back) == set(ref) - ({"lm_head.weight"} if spec.tied_embeddings else set())
    for k, t in back.items():
        assert torch.equal(t, ref[k]), k


def test_the_comparison_can_fail():
    """Each honoured key changes the numbers: drop it and the logits move far past 1e-5."""
    idx = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    hf = _hf_model("llama3-rope-llama3-tied")
    spec = spec_from_hf_dict(hf.config.to_dict())
    assert spec.rope_type == "llama3"
    assert _compare(replace(spec, rope_type="default"), hf, idx)[0] > 1e-3
    assert _compare(replace(spec, rope_theta=10000.0), hf, idx)[0] > 1e-3
    hf = _hf_model("llama-biases-rope-linear")
    spec = spec_from_hf_dict(hf.config.to_dict())
    assert (spec.rope_type, spec.qkv_bias, spec.o_bias, spec.mlp_bias) == ("linear", True, True, True)
    assert _compare(replace(spec, rope_factor=1.0), hf, idx)[0] > 1e-3
    # a spec without the biases does not silently drop the checkpoint's bias tensors
    with pytest.raises(ValueError, match="tensors the model does not: model.layers.0.mlp.down_proj.bias"):
        hf_state_dict_to_decoder(replace(spec, mlp_bias=False), hf.state_dict())
    with pytest.raises(ValueError, match="checkpoint misses 'model.layers.0.self_attn.q_proj.bias'"):
        hf_state_dict_to_decoder(spec, {k: v for k, v in hf.state_dict().items() if "q_proj.bias" not in k})


def test_explicit_head_dim_is_exact_in_the_decoder():
    """head_dim 24 with hidden 64 and 4 heads: q and o are 96 wide. The decoder computes what
    transformers does (and the memory model sizes q/o by the q width: test_profiler_memory)."""
    cfg_cls, model_cls, kw = SMALL["llama-biases-rope-linear"]
    SMALL["head_dim"] = (cfg_cls, model_cls, dict(kw, head_dim=24))
    try:
        hf = _hf_model("head_dim")
    finally:
        del SMALL["head_dim"]
    spec = spec_from_hf_dict(hf.config.to_dict())
    assert (spec.head_dim, spec.q_width, spec.num_params) == (24, 96, hf.num_parameters())
    idx = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    logit_diff, loss_diff, _ = _compare(spec, hf, idx)
    assert logit_diff <= 1e-5 and loss_diff <= 1e-6, (logit_diff, loss_diff)


def test_sliding_window_exact_up_to_the_window_and_refused_past_it():
    hf = _hf_model("mistral-sliding")
    spec = spec_from_hf_dict(hf.config.to_dict())
    assert (spec.sliding_window, spec.max_seq) == (SEQ, SEQ)  # max_position_embeddings 64 capped at the window
    long = torch.randint(0, VOCAB, (1, 2 * SEQ), generator=torch.Generator().manual_seed(3))
    dec = _decoder_from(spec, hf)
    with pytest.raises(ValueError, match="exceeds the model's max_seq"):
        dec(long)
    # past the window transformers' sliding attention differs from causal attention: the cap is needed
    with torch.no_grad():
        causal = _decoder_from(replace(spec, sliding_window=None, max_seq=2 * SEQ), hf)(long)
        assert (causal - hf(input_ids=long).logits).abs().max().item() > 1e-3


# Published config.json values (hub), the keys that shape the model.
_LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
              "hidden_act": "silu", "attention_bias": False}
_LLAMA3_8B = dict(_LLAMA2_7B, intermediate_size=14336, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=8192, rope_theta=500000.0)
_QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "use_sliding_window": False, "max_position_embeddings": 131072, "sliding_window": 131072}
REAL = {
    "gpt2": {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024, "n_ctx": 1024,
             "vocab_size": 50257, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5},
    "gpt2-medium": {"model_type": "gpt2", "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_positions": 1024,
                    "vocab_size": 50257, "activation_function": "gelu_new"},
    "Llama-2-7b": _LLAMA2_7B,
    "Meta-Llama-3-8B": _LLAMA3_8B,
    "Llama-3.1-8B": dict(_LLAMA3_8B, max_position_embeddings=131072, rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}),
    "Llama-3.2-1B": dict(_LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_scaling={
                             "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "Mistral-7B-v0.1": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                        "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
                        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False},
    "Qwen2-0.5B": dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_hidden_layers=24,
                       num_key_value_heads=2, vocab_size=151936, max_window_layers=24, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(_QWEN2, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_hidden_layers=28, num_key_value_heads=4, vocab_size=152064, max_window_layers=28,
                       tie_word_embeddings=False),
}
PUBLISHED = {"gpt2": 124_439_808, "Llama-2-7b": 6_738_415_616, "Meta-Llama-3-8B": 8_030_261_248,
             "Llama-3.2-1B": 1_235_814_400, "Mistral-7B-v0.1": 7_241_732_096, "Qwen2-0.5B": 494_032_768}


@pytest.mark.parametrize("name", sorted(REAL))
def test_param_count_equals_transformers_num_parameters(name, tmp_path):
    cfg = REAL[name]
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    spec = get_model(str(path.parent))
    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(hf_cfg).num_parameters()
    assert spec.num_params == expected
    if name in PUBLISHED:
        assert expected == PUBLISHED[name]
