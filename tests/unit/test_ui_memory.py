"""AppTest of the "Model & memory" page (ui/memory.py)."""
from __future__ import annotations

import json
import os

import pytest
from streamlit.testing.v1 import AppTest

from contracts.catalog import CATALOG
from planner.core.memory import MemoryConfig, estimate_memory
from contracts.specs import PRESETS
from ui.charts import drawn_figures

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ui", "memory.py")
TIMEOUT_S = 60


def _page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=TIMEOUT_S).run()
    assert not at.exception
    return at


def _text(at: AppTest) -> str:
    return " ".join(str(e.value) for e in (*at.success, *at.error, *at.caption, *at.info))


def test_default_preset_fits_and_shows_chart():
    at = _page()
    assert at.selectbox(key="mem_model").value == "tiny"
    assert "Fits on cpu" in _text(at)  # the session cluster (this machine) is the default type
    # the page's figures are the library's: the table and the stacked bar hold estimate_memory's peak
    b = estimate_memory(PRESETS["tiny"], MemoryConfig(micro_batch=1, seq=128, zero=1))
    df = at.table[0].value
    assert int(df.iloc[-1, 1].replace(",", "")) == b.peak_bytes
    (fig,) = drawn_figures(at)
    assert fig["layout"]["barmode"] == "stack"
    assert {t["name"]: t["y"][0] for t in fig["data"]} == pytest.approx(
        {name: getattr(b, f"{name}_bytes") / 2**20 for name in ("params", "grads", "optimizer", "activations", "other")})
    assert fig["layout"]["yaxis"]["title"]["text"] == "memory (MiB)"  # a tiny model: MiB, no capacity line
    assert not fig["layout"]["shapes"]


def test_large_model_does_not_fit_then_sharding_changes_it():
    at = _page()
    at.selectbox(key="mem_model").set_value("llama2-7b").run()
    assert at.number_input(key="mem_seq:llama2-7b").value == 1024  # each model's field starts at its default
    at.number_input(key="mem_seq:llama2-7b").set_value(2048).run()
    at.selectbox(key="mem_gpu_type").set_value("A100-40GB").run()
    assert not at.exception
    assert "Does not fit on A100-40GB" in _text(at)
    # the predicted stack drawn over the GPU's capacity, a dashed rule at its datasheet GiB
    fig = drawn_figures(at)[0]
    (rule,) = fig["layout"]["shapes"]
    assert (rule["name"], rule["y0"]) == ("A100-40GB capacity", CATALOG["A100-40GB"].memory_bytes / 2**30)
    assert sum(t["y"][0] for t in fig["data"]) > rule["y0"]
    at.number_input(key="mem_dp").set_value(8).run()
    at.selectbox(key="mem_recompute").set_value("full").run()
    at.selectbox(key="mem_dtype").set_value("bf16").run()
    at.selectbox(key="mem_zero").set_value(3).run()
    at.selectbox(key="mem_gpu_type").set_value("A100-80GB").run()
    assert not at.exception
    assert "Fits on A100-80GB" in _text(at), _text(at)


def test_bad_inputs_show_errors_not_tracebacks():
    at = _page()
    at.number_input(key="mem_seq:tiny").set_value(4096).run()  # tiny's max_seq is 128
    assert not at.exception
    assert [e.value for e in at.error] == ["Sequence: 4,096 is out of range, 1–128 tokens"]
    assert at.number_input(key="mem_seq:tiny").value == 4096  # kept as typed, not replaced
    assert not at.table and not drawn_figures(at)  # nothing computed from a refused value
    at.number_input(key="mem_seq:tiny").set_value(128).run()
    at.number_input(key="mem_dp").set_value(4).run()
    at.checkbox(key="mem_uneven").check().run()
    assert at.number_input(key="mem_shard_fraction").value == 0.25  # the even share shown, not a magic 0
    at.selectbox(key="mem_zero").set_value(0).run()
    at.number_input(key="mem_shard_fraction").set_value(0.3).run()  # a shard needs ZeRO >= 1
    assert not at.exception
    assert any("zero" in e.value.lower() for e in at.error)


def test_upload_config(tmp_path):
    at = _page()
    at.selectbox(key="mem_model").set_value("Upload a config.json…").run()
    assert not at.exception
    good = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}
    at.file_uploader(key="mem_upload").set_value(("my-llama.json", json.dumps(good).encode(), "application/json"))
    at.run()
    assert not at.exception and not at.error
    assert "Fits on" in _text(at)
    at.file_uploader(key="mem_upload").set_value(("broken.json", b'{"model_type": "llama", ', "application/json"))
    at.run()
    assert not at.exception
    assert any("broken.json" in e.value and "JSON" in e.value for e in at.error)
    at.file_uploader(key="mem_upload").set_value(("x.json", b'{"model_type": "bert"}', "application/json"))
    at.run()
    assert not at.exception
    assert any("unsupported model_type" in e.value for e in at.error)


def test_trace_now_shows_the_measured_peak():
    at = _page()
    at.button(key="mem_trace").click().run()
    assert not at.exception
    assert any("measured" in m.label for m in at.metric), [m.label for m in at.metric]
    line = next(c.value for c in at.caption if "predicted − measured" in c.value)
    percent = line.split(":")[1].split("%")[0].strip()
    assert not percent.startswith("-0.00") and abs(float(percent)) <= 8.0, line


def test_a_model_folder_tokenizer_and_dataset_are_chosen_here_and_counted(tmp_path, monkeypatch):
    """A Hugging Face folder planned by its config (parameter count from it), its weights offered
    as --init-from, a JSON Lines dataset with a tokenizer.json counted in tokens; the choices are
    the session's training inputs (the Launch page passes them to the run)."""
    monkeypatch.setenv("GPUMIX_ALLOWED_ROOTS", str(tmp_path))  # typed paths are confined to allowed roots
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(folder)
    texts = [f"document number {i} says hello to the world of mixed GPUs" for i in range(40)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")

    at = _page()
    at.selectbox(key="mem_model").set_value("A Hugging Face model folder…").run()
    at.text_input(key="mem_folder").set_value(str(folder)).run()
    assert not at.exception
    n = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(folder).parameters())
    assert f"{n:,} parameters" in " ".join(str(c.value) for c in at.caption)
    assert at.checkbox(key="mem_init_from").value is True
    at.text_input(key="mem_tokenizer").set_value(str(tmp_path / "tokenizer.json")).run()
    at.text_input(key="mem_data").set_value(str(data)).run()
    at.button(key="mem_count_tokens").click().run()
    assert not at.exception
    msg = " ".join(str(s.value) for s in at.success)
    assert "training tokens" in msg and "validation tokens" in msg, _text(at)
    inputs = at.session_state["training_inputs"]
    assert inputs == {"corpus_dir": str(data), "tokenizer": str(tmp_path / "tokenizer.json"),
                      "init_from": str(folder)}
    # a folder without a config is one clear error, not a traceback
    at.text_input(key="mem_folder").set_value(str(tmp_path)).run()
    assert not at.exception and "no config.json" in _text(at)
