import json
import subprocess
import sys

import pytest

from planner.specs import PRESETS, ModelSpec, get_model, spec_from_hf_dict

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


def test_importing_planner_pulls_in_no_torch():
    code = ("import sys, planner, planner.specs, planner.cluster, planner.plan, planner.catalog, planner.cli\n"
            "import pkgutil, importlib\n"
            "for m in pkgutil.walk_packages(planner.__path__, 'planner.'):\n"
            "    if m.name != 'planner.__main__': importlib.import_module(m.name)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'streamlit', 'profiler', 'executor', 'models')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
