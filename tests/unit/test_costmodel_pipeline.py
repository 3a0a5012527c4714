"""The pipeline stage cost model (planner/costmodel/pipeline.py) against the pieces it is built from."""
from dataclasses import replace

import pytest

from planner.core.memory import MemoryConfig, estimate_memory
from planner.core.profiles import get_step_profile
from contracts.specs import get_model, with_max_seq
from contracts.units import runtime_units
from planner.costmodel.collectives import Link, bytes_per_s, sharded_step_comm_s
from planner.costmodel.pipeline import PipelineCostModel, in_flight

SEQ, MB = 1024, 2


@pytest.fixture(scope="module")
def model():
    return PipelineCostModel(with_max_seq(get_model("gpt2-medium"), SEQ), SEQ, MB, "bf16")


def test_stages_add_up_to_the_step_profile(model):
    g, L = "A100-80GB", model.spec.num_layers
    for rc in ("none", "full"):
        whole = get_step_profile(g, model.spec, SEQ, "bf16", rc).step_time_s(MB)
        cuts = [(0, 5), (5, 11), (16, L - 16)]
        parts = [model.compute_s(g, rc, n, j == 0, j == len(cuts) - 1) for j, (_, n) in enumerate(cuts)]
        assert sum(f + b for f, b in parts) == pytest.approx(whole, rel=1e-12)
    f, b = model.compute_s(g, "none", 4, False, False)
    assert b == pytest.approx(2 * f)  # backward is twice the forward
    f, b = model.compute_s(g, "full", 4, False, False)
    assert b == pytest.approx(3 * f)  # and the forward once more with full recomputation


def test_stage_params_are_the_runtimes_units(model):
    L = model.spec.num_layers
    units = runtime_units(model.spec)
    assert model.stage_params(3, True, False) == units[0].numel + 3 * units[1].numel
    assert model.stage_params(L - 3, False, True) == (L - 3) * units[1].numel + units[-1].numel
    assert model.stage_params(3, True, False) + model.stage_params(L - 3, False, True) == model.spec.num_params


def test_collectives_and_optimizer_of_a_stage(model):
    g, link = "A100-80GB", Link(bytes_per_s(100), 10e-6)
    n = model.stage_params(6, False, False)
    assert model.sync_s(g, 6, False, False, 1, link) == 0.0
    # ZeRO-1: fp32 gradients reduce-scattered, bf16 parameters all-gathered, one call per unit each
    assert model.sync_s(g, 6, False, False, 4, link) == pytest.approx(sharded_step_comm_s(2 * n, 4 * n, 12, 4, link))
    per_param = get_step_profile(g, model.spec, SEQ, "bf16", "none").optimizer_s_per_param
    assert model.optimizer_s(g, "none", n, 4) == pytest.approx(per_param * n / 4)


def test_stage_memory_is_the_memory_models_plus_in_flight_activations(model):
    g = "A100-80GB"
    cfg = MemoryConfig(micro_batch=MB, seq=SEQ, dtype="bf16", dp=2, zero=1, device_type=g)
    alone = estimate_memory(replace(model.spec, num_layers=6), cfg).peak_bytes
    assert model.memory_bytes(g, 6, 1, 2, "none") == alone
    assert model.memory_bytes(g, 6, 3, 2, "none") > alone
    assert in_flight("1f1b", 0, 4, 8) == 4 and in_flight("1f1b", 3, 4, 8) == 1 and in_flight("gpipe", 3, 4, 8) == 8
    cap = model.max_layers(g, 3, 2, "none")
    assert model.memory_bytes(g, cap, 3, 2, "none") <= model.capacity_bytes(g)
    if cap < model.spec.num_layers:
        assert model.memory_bytes(g, cap + 1, 3, 2, "none") > model.capacity_bytes(g)
