"""`python -m profiler import`: Sailor's per-layer profiles and the GPUMix layer format into the profile store
(profiler/importer.py, planner/core/layer_profiles.py). A synthetic file in Sailor's format is written by each test;
the real one is read only where ../shared/sailor is present."""
from __future__ import annotations

import json
import os

import pytest

from contracts.cli import main
from planner.core.layer_profiles import LayerProfiles, load_layer_profiles
from planner.core.profiles import calibration, find_measured, get_step_profile, load_step_profiles
from profiler.__main__ import COMMANDS
from profiler.importer import SAILOR_MODELS

SAILOR_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "sailor")
SAILOR_PROFILES = os.path.join(SAILOR_DIR, "profiles_tmp.json")
OPT = SAILOR_MODELS["OPT-350"]
NUM_ROWS = OPT.num_layers + 2  # embedding, 24 blocks, head
# synthetic times: per block forward 0.002 + 0.001 m, backward twice that; embedding and head a fixed 0.001 each
ALPHA = {"A100-40": 24 * 0.006 + 0.002, "V100-16": 3 * (24 * 0.006 + 0.002)}
BETA = {"A100-40": 24 * 0.003, "V100-16": 3 * 24 * 0.003}


def _layers(gpu: str, mb: int, tp: int) -> dict:
    scale = (3.0 if gpu == "V100-16" else 1.0) / tp
    rows = {"0": [0.001 * scale, 0.0, 0.0005]}
    for i in range(1, NUM_ROWS - 1):
        rows[str(i)] = [(0.002 + 0.001 * mb) * scale, 2 * (0.002 + 0.001 * mb) * scale, 0.0005]
    rows[str(NUM_ROWS - 1)] = [0.001 * scale, 0.0, 0.0005]
    return rows


def _sailor_file(tmp_path, gpus=("A100-40", "V100-16")) -> str:
    data = {"OPT-350": {g: {str(mb): {str(tp): _layers(g, mb, tp) for tp in (1, 2)} for mb in (1, 2, 4)}
                        for g in gpus},
            "OPT-30": {"A100-40": {"1": {"1": {"0": [1.0, 1.0, 1.0]}}}}}
    path = tmp_path / "profiles_tmp.json"
    path.write_text(json.dumps(data))
    return str(path)


def _import(*argv: str) -> int:
    return main("python -m profiler", COMMANDS, ["import", *argv])


def test_synthetic_sailor_file_becomes_fitted_profiles_per_device_and_tp(tmp_path):
    path = _sailor_file(tmp_path)
    assert _import("--format", "sailor", "--profiles", path, "--model", "OPT-350") == 0
    for gpu, device in (("A100-40", "A100-40GB"), ("V100-16", "V100-16GB")):
        p = find_measured(device, OPT, 2048, "fp32")
        assert p is not None and p.measured and p.tp == 1 and p.micro_batches == (1, 2, 4)
        assert p.alpha_s == pytest.approx(ALPHA[gpu]) and p.beta_s == pytest.approx(BETA[gpu])
        assert p.r2 == pytest.approx(1.0)
        assert p.optimizer_s_per_param == pytest.approx(NUM_ROWS * 0.0005 / OPT.num_params)
        assert p.source.startswith("imported from Sailor profiles_tmp.json (") and "Megatron-DeepSpeed" in p.source
        assert os.path.abspath(path) in p.source
        tp2 = find_measured(device, OPT, 2048, "fp32", tp=2)
        assert tp2.tp == 2 and tp2.beta_s == pytest.approx(BETA[gpu] / 2) and "tp 2" in tp2.source
        assert tp2.num_params == -(-OPT.num_params // 2)
    table = load_layer_profiles("opt-350", 2048, "fp32")
    assert len(table.measurements) == 2 * 3 * 2 and all(len(m.layers_s) == NUM_ROWS for m in table.measurements)


def test_a_tp_profile_never_stands_in_for_a_whole_device():
    """A TP-2 rank's β is half a device's: the estimate of another type and the calibration ignore it."""
    from planner.core.layer_profiles import LayerMeasurement
    from profiler.importer import import_layer_profiles

    rows = tuple((0.001, 0.002, 0.0) for _ in range(NUM_ROWS))
    lp = LayerProfiles("opt-350", 2048, "fp32", "none", "test", tuple(
        LayerMeasurement("A100-40GB", mb, 2, tuple((f * mb, b * mb, u) for f, b, u in rows)) for mb in (1, 2)))
    before = get_step_profile("H100-SXM", OPT, 2048, "fp32")
    import_layer_profiles(lp, OPT)
    assert [p.tp for p in load_step_profiles()] == [2]
    assert get_step_profile("H100-SXM", OPT, 2048, "fp32") == before
    assert find_measured("A100-40GB", OPT, 2048, "fp32") is None
    assert calibration("A100-40GB", "fp32").num_profiles == 0


def test_gpumix_format_round_trip_gives_the_same_profiles(tmp_path, data_dir, monkeypatch):
    path = _sailor_file(tmp_path)
    assert _import("--format", "sailor", "--profiles", path, "--model", "opt-350") == 0
    sailor = {(p.device_type, p.tp): p for p in load_step_profiles()}
    table = load_layer_profiles("opt-350", 2048, "fp32")
    gpumix_file = tmp_path / "layers.json"
    gpumix_file.write_text(json.dumps(table.to_dict()))
    assert LayerProfiles.from_dict(json.loads(gpumix_file.read_text())) == table
    monkeypatch.setenv("GPUMIX_DATA_DIR", str(tmp_path / "second-store"))
    assert _import("--format", "gpumix", "--profiles", str(gpumix_file)) == 0
    again = {(p.device_type, p.tp): p for p in load_step_profiles()}
    assert again.keys() == sailor.keys()
    for key, p in sailor.items():
        q = again[key]
        assert (q.alpha_s, q.beta_s, q.r2, q.source, q.optimizer_s_per_param) == (
            p.alpha_s, p.beta_s, p.r2, p.source, p.optimizer_s_per_param)
    assert load_layer_profiles("opt-350", 2048, "fp32") == table


@pytest.mark.parametrize("argv,needle", [
    (["--model", "GPT-9"], "unknown model 'GPT-9'"),
    (["--model", "OPT-30"], "A100-40GB micro-batch 1 tp 1: 1 layers, but opt-30b has 48 blocks"),
    (["--model", "GPT-Neo-2.7"], "GPT-Neo-2.7 is not supported"),
])
def test_bad_model_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    path = _sailor_file(tmp_path)
    assert _import("--format", "sailor", "--profiles", path, *argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert load_step_profiles() == []


def test_malformed_json_and_unknown_gpu_exit_2_naming_the_problem(tmp_path, capsys):
    bad = tmp_path / "broken.json"
    bad.write_text('{"OPT-350": {"A100-40": ')
    assert _import("--format", "sailor", "--profiles", str(bad), "--model", "OPT-350") == 2
    err = capsys.readouterr().err
    assert "is not valid JSON" in err and str(bad) in err and err.count("\n") == 1
    path = _sailor_file(tmp_path, gpus=("A100-40", "B300-288"))
    assert _import("--format", "sailor", "--profiles", path, "--model", "OPT-350") == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'B300-288'" in err and err.count("\n") == 1
    assert load_step_profiles() == []  # nothing written when any part is bad
    gpumix = tmp_path / "g.json"
    gpumix.write_text(json.dumps({"format": "gpumix-layer-profiles", "version": 1, "model": "opt-350", "seq": 2048,
                                  "dtype": "fp32", "source": "x", "measurements": [
                                      {"device_type": "Z80", "micro_batch": 1, "layers_s": [[0.1, 0.2, 0.0]]}]}))
    assert _import("--format", "gpumix", "--profiles", str(gpumix)) == 2
    assert "unknown GPU type 'Z80'" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(SAILOR_PROFILES), reason="Sailor's data (../shared/sailor) is not here")
def test_sailor_opt_350_imports_every_gpu_and_tp(capsys):
    assert _import("--format", "sailor", "--profiles", SAILOR_PROFILES, "--model", "OPT-350", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["profiles"]) == 25
    a100 = find_measured("A100-40GB", OPT, 2048, "fp32")
    v100 = find_measured("V100-16GB", OPT, 2048, "fp32")
    # Σ layers forward + backward at micro-batch 1, 2, 4, 8 (A100) and 1, 2, 4 (V100), TP 1
    assert a100.step_times_s == pytest.approx((0.206739, 0.395716, 0.773872, 1.531108), rel=1e-4)
    assert a100.beta_s == pytest.approx(0.1892, rel=1e-3) and a100.r2 > 0.999
    assert v100.beta_s == pytest.approx(0.6465, rel=1e-3) and v100.micro_batches == (1, 2, 4)
    # fp32 efficiency on the TF32 peak the A100's matmuls ran at, not above 1 of the 19.5 TF vector peak
    assert a100.peak_tflops == 156.0 and 0 < a100.efficiency < 1
