"""`planner plan --param-dtype --reduce-dtype` and the plan file's mixed-precision fields (contracts/plan.py):
the flags reach the plan JSON resolved, an old plan file loads as fp32 gathers and reduces with prefetch 1
and no reduce-scatter in flight, half parameters at zero 1/2 are refused in one line, and the ILP chooses
the prefetch depth, the reduce-scatters left in flight and the reduce dtype where they change memory
(planner/hetero/solve.py: step_candidates, solve_candidates)."""
from __future__ import annotations

import json
import os
import time

import pytest

from contracts.cli import main
from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.plan import Plan
from planner.__main__ import COMMANDS
from planner.costmodel.training import CommModel, CostModel, DeviceCoeffs, StepConfig
from planner.hetero.solve import solve_candidates, step_candidates

GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL = os.path.join(ROOT, "examples", "clusters", "local-2cpu-emulated.json")
NEW_FIELDS = ("param_dtype", "reduce_dtype", "prefetch", "reduce_in_flight", "predicted_wire_bytes_per_step",
              "predicted_exposed_comm_s")


def planner(*argv):
    return main("python -m planner", COMMANDS, list(argv))


@pytest.fixture
def gpu_cluster(tmp_path):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"name": "gpus", "nodes": [{"name": "n0", "datacenter": "dc", "gpus": {"L4": 4}}],
                                "network": {"intra_node_gbps": 100, "inter_node_gbps": 100}}))
    return str(path)


def plan_json(capsys, *argv) -> dict:
    assert planner("plan", *argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


def test_flags_round_trip_into_the_plan_file(gpu_cluster, tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    d = plan_json(capsys, "--cluster", gpu_cluster, "--model", "gpt2", "--global-batch", "16", "--dtype", "bf16",
                  "--zero", "3", "--param-dtype", "fp32", "--reduce-dtype", "bf16", "--out", out)
    assert (d["zero"], d["param_dtype"], d["reduce_dtype"]) == (3, "fp32", "bf16")
    assert d["prefetch"] in (0, 1) and d["reduce_in_flight"] in (0, 1)
    assert d["predicted_wire_bytes_per_step"] > 0 and d["predicted_exposed_comm_s"] > 0
    loaded = Plan.load(out)
    assert loaded.to_dict() == d
    # auto at zero 3: the compute dtype (bf16 on an L4); fp32 reduces unless bf16 is asked
    auto = plan_json(capsys, "--cluster", gpu_cluster, "--model", "gpt2", "--global-batch", "16", "--dtype", "bf16",
                     "--zero", "3")
    assert (auto["param_dtype"], auto["reduce_dtype"]) == ("bf16", "fp32")
    # bf16 gathers put fewer bytes on the wire than the fp32 ones of the same plan would
    fp32 = Plan.from_dict({**auto, "param_dtype": "fp32"})
    from planner.hetero.solve import evaluate_plan
    assert evaluate_plan(fp32).predicted_wire_bytes_per_step > auto["predicted_wire_bytes_per_step"]
    # auto at zero 1/2: the replicated fp32 parameters
    z1 = plan_json(capsys, "--cluster", gpu_cluster, "--model", "gpt2", "--global-batch", "16", "--dtype", "bf16",
                   "--zero", "1")
    assert (z1["param_dtype"], z1["prefetch"], z1["reduce_in_flight"]) == ("fp32", 1, 0)


def test_auto_with_half_parameters_asked_plans_zero_3_only(gpu_cluster, capsys):
    d = plan_json(capsys, "--cluster", gpu_cluster, "--model", "gpt2", "--global-batch", "16", "--dtype", "bf16",
                  "--param-dtype", "bf16")
    assert d["zero"] == 3 and d["param_dtype"] == "bf16"
    assert list(d["zero_candidates"]) == ["3"]
    assert any("zero 3 only" in n for n in d["notes"])


def test_old_plan_file_without_the_fields_loads_as_fp32(capsys):
    d = plan_json(capsys, "--cluster", LOCAL, "--model", "tiny", "--global-batch", "4", "--seq", "64", "--zero", "1")
    old = {k: v for k, v in d.items() if k not in NEW_FIELDS}
    plan = Plan.from_dict(old)
    assert (plan.param_dtype, plan.reduce_dtype, plan.prefetch, plan.reduce_in_flight) == ("fp32", "fp32", 1, 0)
    assert plan.predicted_wire_bytes_per_step is None and plan.predicted_exposed_comm_s is None


@pytest.mark.parametrize("argv, message", [
    (("--zero", "1", "--param-dtype", "bf16"), "--param-dtype bf16 needs zero 3 (got zero 1)"),
    (("--zero", "2", "--param-dtype", "bf16"), "--param-dtype bf16 needs zero 3 (got zero 2)"),
    (("--zero", "3", "--param-dtype", "fp16"), "--param-dtype fp16 needs --dtype fp16"),
])
def test_refused_in_one_line(gpu_cluster, capsys, argv, message):
    assert planner("plan", "--cluster", gpu_cluster, "--model", "gpt2", "--global-batch", "16", "--dtype", "bf16",
                   *argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_plan_file_with_half_parameters_at_zero_1_is_refused(capsys):
    d = plan_json(capsys, "--cluster", LOCAL, "--model", "tiny", "--global-batch", "4", "--seq", "64", "--zero", "1")
    with pytest.raises(ValueError, match="param_dtype bf16 needs zero 3"):
        Plan.from_dict({**d, "param_dtype": "bf16"})
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        Plan.from_dict({**d, "reduce_dtype": "fp16"})
    with pytest.raises(ValueError, match="prefetch must be an integer"):
        Plan.from_dict({**d, "prefetch": -1})
    with pytest.raises(ValueError, match=r"reduce_in_flight must be 0 or 1 .* got 2"):
        Plan.from_dict({**d, "reduce_in_flight": 2})
    with pytest.raises(ValueError, match="reduce_in_flight 1 needs zero 2 or 3 .got zero 1."):
        Plan.from_dict({**d, "reduce_in_flight": 1})
    for zero in (2, 3):  # round trip where a reduce may be left in flight
        plan = Plan.from_dict({**d, "zero": zero, "reduce_in_flight": 1})
        assert Plan.from_dict(plan.to_dict()).reduce_in_flight == 1


def test_candidates_offer_bf16_reduces_only_when_asked():
    assert step_candidates(3, "auto", "fp32") == [StepConfig("auto", "fp32", 1, 1), StepConfig("auto", "fp32", 1, 0),
                                                  StepConfig("auto", "fp32", 0, 1), StepConfig("auto", "fp32", 0, 0)]
    assert [(s.reduce_dtype, s.prefetch, s.reduce_in_flight) for s in step_candidates(3, "auto", "bf16")] == [
        ("bf16", 1, 1), ("bf16", 1, 0), ("bf16", 0, 1), ("bf16", 0, 0),
        ("fp32", 1, 1), ("fp32", 1, 0), ("fp32", 0, 1), ("fp32", 0, 0)]
    # zero 2: reduces left in flight or not, no prefetch; zero 1: none left in flight
    assert step_candidates(2, "auto", "fp32") == [StepConfig("auto", "fp32", 1, 1), StepConfig("auto", "fp32", 1, 0)]
    assert step_candidates(1, "auto", "fp32") == [StepConfig("auto", "fp32", 1, 0)]


# ---- the ILP chooses the prefetch depth and the reduces in flight: hand-made instances ----------------

DEV = DeviceSpec("A100-80GB")


def hand_step_cost(step: StepConfig, capacity_gb: float, extra_gb: float, exposed_gather: float,
                   exposed_reduce: float) -> CostModel:
    """Two devices; α = 1 s a micro-batch, β = 0.1 s a sample, AdamW 1 s for the whole state. Memory:
    1.5 GB + `extra_gb` (what the setting keeps) + 1 GB a sample + 2 GB of state. Collectives of 1 s in
    all on two ranks, of which the exposed gathers and reduces given (in bytes at 1 B/s, over 2 ranks
    half of it on the wire)."""
    cluster = ClusterSpec("hand", (NodeSpec("n0", "dc", (DEV, DEV)),), NetworkSpec(1.0, 1.0))

    def memory(m, n, f):
        return (1.5 + extra_gb + 1.0 * m + 2.0 * f) * GB

    coeffs = {DEV: DeviceCoeffs(DEV, "fp32", 1.0, 0.1, 1.0, capacity_gb * GB, memory)}

    def comm_for(devices, multi_node):
        return CommModel(1.0, 0.0, 1.0, 1.0, 0, exposed_gather_bytes=exposed_gather,
                         exposed_reduce_bytes=exposed_reduce, exposed_calls=0)

    return CostModel(cluster, 1, coeffs, comm_for, zero=3, step=step)


def prefetch_cost(prefetch: int, capacity_gb: float) -> CostModel:
    """hand_step_cost with prefetch units of 1 GB gathered ahead; exposed: the first gather and last
    reduce (0.1 s) with prefetch, every gather too (0.55 s) without."""
    return hand_step_cost(StepConfig("fp32", "fp32", prefetch), capacity_gb, 1.0 * prefetch,
                          0.1 if prefetch else 1.0, 0.1)


def in_flight_cost(reduce_in_flight: int, capacity_gb: float) -> CostModel:
    """hand_step_cost at prefetch 1 with a reduce's 1 GB of buffers kept in flight; exposed: the first
    gather and last reduce (0.1 s) in flight, every reduce too (0.55 s) without."""
    return hand_step_cost(StepConfig("fp32", "fp32", 1, reduce_in_flight), capacity_gb, 1.0 * reduce_in_flight,
                          0.1, 0.1 if reduce_in_flight else 1.0)


def chosen(costs: list[CostModel]) -> tuple[StepConfig, float]:
    best, errors = solve_candidates(costs, 8, time.monotonic() + 30.0, micro_batches=[1, 2, 4])
    assert best is not None, errors
    return best.cost.step, best.iteration_s


@pytest.mark.parametrize("make_cost, setting", [(prefetch_cost, "prefetch"), (in_flight_cost, "reduce_in_flight")])
def test_ilp_overlaps_where_memory_allows_and_not_where_it_is_tight(make_cost, setting):
    """The same instance for prefetching the next gather and for leaving a reduce-scatter in flight:
    each costs 1 GB and hides 0.45 s of exposed collectives."""
    def chosen_setting(capacity_gb: float) -> tuple[int, float]:
        step, t = chosen([make_cost(1, capacity_gb), make_cost(0, capacity_gb)])
        return getattr(step, setting), t

    # roomy: both fit micro-batch 4 (one each): the overlap hides 0.45 s more of the collectives
    p, t = chosen_setting(20.0)
    assert p == 1 and t == pytest.approx(0.1 + 1.4 + 0.5)
    # tight: with the overlap micro-batch 4 no longer fits beside half the state (7.5 GB > 7), two of 2
    # take 2.4 s; without it one of 4 fits (6.5 GB) and the step is shorter although more is exposed
    p, t = chosen_setting(7.0)
    assert p == 0 and t == pytest.approx(0.55 + 1.4 + 0.5)
    # tighter: with the overlap not even micro-batch 1 fits beside any state; without it the ILP still plans
    p, _ = chosen_setting(3.2)
    assert p == 0


def test_the_solved_plan_records_the_reduce_in_flight_it_was_priced_at(gpu_cluster, capsys):
    # zero 2 on roomy L4s: leaving a reduce in flight fits and hides the reduces, so the ILP takes it
    d = plan_json(capsys, "--cluster", gpu_cluster, "--model", "tiny", "--global-batch", "16", "--seq", "64",
                  "--zero", "2")
    assert d["reduce_in_flight"] == 1
    assert any("1 reduce-scatter left in flight" in n for n in d["notes"])
    plan = Plan.from_dict(d)
    from planner.hetero.solve import evaluate_plan
    # the same plan waiting each reduce as issued exposes more of its communication
    waited = evaluate_plan(Plan.from_dict({**d, "reduce_in_flight": 0}))
    assert waited.predicted_exposed_comm_s > evaluate_plan(plan).predicted_exposed_comm_s
