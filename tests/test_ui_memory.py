"""AppTest of the "Model & memory" page (ui/memory.py)."""
from __future__ import annotations

import json
import os

from streamlit.testing.v1 import AppTest

from planner.memory import MemoryConfig, estimate_memory
from planner.specs import PRESETS

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ui", "memory.py")
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
    assert at.get("plotly_chart")
    # the page's figure is the library's: the table holds estimate_memory's peak
    expected = estimate_memory(PRESETS["tiny"], MemoryConfig(micro_batch=1, seq=128, zero=1)).peak_bytes
    df = at.dataframe[0].value
    assert int(df.iloc[-1, 1]) == expected


def test_large_model_does_not_fit_then_sharding_changes_it():
    at = _page()
    at.selectbox(key="mem_model").set_value("llama2-7b").run()
    at.number_input(key="mem_seq").set_value(2048).run()
    at.selectbox(key="mem_gpu_type").set_value("A100-40GB").run()
    assert not at.exception
    assert "Does not fit on A100-40GB" in _text(at)
    at.number_input(key="mem_dp").set_value(8).run()
    at.selectbox(key="mem_recompute").set_value("full").run()
    at.selectbox(key="mem_dtype").set_value("bf16").run()
    at.selectbox(key="mem_zero").set_value(3).run()
    at.selectbox(key="mem_gpu_type").set_value("A100-80GB").run()
    assert not at.exception
    assert "Fits on A100-80GB" in _text(at), _text(at)


def test_bad_inputs_show_errors_not_tracebacks():
    at = _page()
    at.number_input(key="mem_seq").set_value(4096).run()  # tiny's max_seq is 128
    assert not at.exception
    assert any("max_seq" in e.value for e in at.error)
    at.number_input(key="mem_seq").set_value(128).run()
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
    assert abs(float(line.split(":")[1].strip().rstrip("%").strip())) <= 8.0
