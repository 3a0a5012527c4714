import json

import pytest

from contracts.specs import PRESETS, ModelSpec, get_model, spec_from_hf_dict

# Published parameter counts (HF model cards / papers).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "tinyllama-1.1b": 1_100_048_384,
}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_preset_param_count_matches_published(name, count):
    assert PRESETS[name].num_params == count


def test_hf_configs_round_trip(tmp_path):
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}
    mistral = dict(llama, model_type="mistral", intermediate_size=14336, num_key_value_heads=8,
                   max_position_embeddings=32768)
    qwen2 = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
             "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
             "max_position_embeddings": 32768, "tie_word_embeddings": True}
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
            "vocab_size": 50257}
    for cfg, expect in ((llama, "llama2-7b"), (mistral, "mistral-7b"), (qwen2, "qwen2-0.5b"), (gpt2, "gpt2")):
        p = tmp_path / cfg["model_type"] / "config.json"
        p.parent.mkdir()
        p.write_text(json.dumps(cfg))
        spec = get_model(str(p))
        assert spec.num_params == PRESETS[expect].num_params
        assert spec.family == PRESETS[expect].family


@pytest.mark.parametrize("text,needle", [
    ("{not json", "not valid JSON"),
    ('{"model_type": "bert"}', "unsupported model_type"),
    ('{"model_type": "llama", "hidden_size": 64}', "missing key"),
    ('{"model_type": "llama", "hidden_size": 60, "intermediate_size": 10, "num_attention_heads": 7, '
     '"num_hidden_layers": 1, "vocab_size": 10}', "not divisible"),
])
def test_bad_hf_config_names_the_problem(tmp_path, text, needle):
    p = tmp_path / "config.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=needle):
        ModelSpec.from_hf_config(str(p))


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*tiny"):
        get_model("gpt5")


def test_spec_dict_round_trip():
    for spec in PRESETS.values():
        assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown keys"):
        ModelSpec.from_dict(dict(PRESETS["tiny"].to_dict(), bogus=1))


def test_flops_per_token_is_6n_plus_attention():
    spec = PRESETS["gpt2"]
    # 6·N for the matmul weights (embedding lookups excluded, the tied head included)
    assert spec.flops_per_token(1024) == pytest.approx(6 * spec.matmul_params() + 12 * 12 * 768 * 1024)
    assert spec.matmul_params() == pytest.approx(spec.num_params - 1024 * 768, rel=0.01)


# Published config.json values of families the decoder does not implement: each is refused with one
# line naming the key, never read as a dense Llama (Mixtral-8x7B has 46.7 B parameters, not 7.24 B;
# Gemma-7B has head_dim 256, GeGLU, (1 + w) norms, scaled and tied embeddings).
MIXTRAL_8X7B = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
                "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
                "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6, "sliding_window": None}
GEMMA_7B = {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 3072,
            "intermediate_size": 24576, "num_attention_heads": 16, "num_hidden_layers": 28,
            "num_key_value_heads": 16, "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
            "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6}
GEMMA_2B = dict(GEMMA_7B, hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_hidden_layers=18,
                num_key_value_heads=1)
_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
          "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100}


@pytest.mark.parametrize("cfg,needle", [
    (MIXTRAL_8X7B, "num_local_experts=8: mixture of experts is not supported"),
    (dict(MIXTRAL_8X7B, model_type=None), "num_local_experts=8: mixture of experts"),  # whatever the type says
    ({"model_type": "qwen2_moe", "num_experts": 60}, "num_experts=60: mixture of experts"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 256}, "n_routed_experts=256: mixture of experts"),
    (GEMMA_7B, "model_type='gemma': Gemma is not supported"),
    (GEMMA_2B, "model_type='gemma': Gemma is not supported"),
    (dict(GEMMA_7B, model_type="phi3"), "model_type='phi3': unsupported model_type"),
    (dict(_LLAMA, model_type=None), "missing key 'model_type'"),
    (dict(_LLAMA, hidden_act="gelu"), "hidden_act='gelu': only silu"),
    (dict(_LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling rope_type 'yarn' is not implemented"),
    (dict(_LLAMA, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic' is not implemented"),
    (dict(_LLAMA, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_parameters rope_type 'longrope'"),
    (dict(_LLAMA, rope_scaling={"rope_type": "linear"}), "rope_scaling misses 'factor'"),
    (dict(_LLAMA, partial_rotary_factor=0.5), "partial_rotary_factor=0.5: partial rotary"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": 10,
      "activation_function": "relu"}, "activation_function='relu'"),
    ({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 32, "vocab_size": 10,
      "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True: only"),
])
def test_unimplemented_configs_are_refused_with_one_line_naming_the_key(cfg, needle):
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError) as e:
        spec_from_hf_dict(cfg, source="config.json")
    assert needle in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("config.json: ")


def test_honoured_keys_reach_the_spec(monkeypatch):
    # head_dim 32, not 64 / 4: an explicit head_dim is honoured (decoder and memory model)
    spec = spec_from_hf_dict(dict(_LLAMA, head_dim=32, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                  rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                "original_max_position_embeddings": 32}))
    assert (spec.head_dim, spec.q_width, spec.qkv_bias, spec.o_bias, spec.mlp_bias, spec.tied_embeddings) == (
        32, 128, True, True, True, True)
    assert (spec.rope_type, spec.rope_factor, spec.rope_theta, spec.rope_original_max_seq) == ("llama3", 8.0, 5e5, 32)
    # q (4·32) + k, v (2·32 each) + o, their biases, gate/up/down and their biases, two norms
    assert spec.block_params() == 64 * 256 + 256 + 128 * 64 + 64 + 3 * 64 * 96 + 2 * 96 + 64 + 2 * 64
    # transformers 5's rope_parameters form says the same as rope_theta + rope_scaling
    five = spec_from_hf_dict(dict(_LLAMA, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5}))
    assert (five.rope_type, five.rope_factor, five.rope_theta) == ("linear", 2.0, 1e5)
    # Qwen2: q/k/v biases whatever attention_bias says, never an o or MLP bias; Mistral: none
    qwen = spec_from_hf_dict(dict(_LLAMA, model_type="qwen2", num_key_value_heads=2, mlp_bias=True))
    assert (qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias) == (True, False, False)
    mistral = spec_from_hf_dict(dict(_LLAMA, model_type="mistral", attention_bias=True, sliding_window=None,
                                     max_position_embeddings=4096))
    assert (mistral.qkv_bias, mistral.o_bias, mistral.max_seq, mistral.sliding_window) == (False, False, 4096, None)


@pytest.mark.parametrize("extra,max_seq,window", [
    ({"model_type": "mistral", "max_position_embeddings": 32768}, 4096, 4096),  # transformers' default window
    ({"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}, 4096, 4096),
    ({"model_type": "mistral", "sliding_window": 65536, "max_position_embeddings": 32768}, 32768, 65536),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False, "max_position_embeddings": 32768},
     32768, None),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 1,
      "max_position_embeddings": 32768}, 4096, 4096),
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2,
      "max_position_embeddings": 32768}, 32768, None),  # no layer at or past max_window_layers slides
])
def test_sliding_window_caps_max_seq(extra, max_seq, window):
    spec = spec_from_hf_dict(dict(_LLAMA, **extra))
    assert (spec.max_seq, spec.sliding_window) == (max_seq, window)


def test_get_model_reads_a_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(_LLAMA, num_key_value_heads=2)))
    spec = get_model(str(tmp_path))
    assert (spec.name, spec.num_kv_heads, spec.family) == (tmp_path.name, 2, "llama")
    with pytest.raises(ValueError, match="no such file"):
        get_model(str(tmp_path / "missing"))
