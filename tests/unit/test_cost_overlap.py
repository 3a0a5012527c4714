"""The cost model prices what the sharded runtime runs (planner/costmodel/training.py): gathers in the
plan's param_dtype, reduce-scatters in its reduce_dtype, and per step exposed + max(compute, hidden
comm) (StepComm), the first gather and the last reduce-scatter exposed with a reduce-scatter left in
flight (every reduce-scatter without); the ILP's bounds and rows stay exact under that pricing (an
exhaustive search over the same tables agrees)."""
from __future__ import annotations

import math
import random

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.specs import get_model
from contracts.units import runtime_units, step_collectives
from planner.costmodel.collectives import Link, bytes_per_s, sharded_step_comm_s
from planner.costmodel.training import (AccumBand, CommModel, CostModel, DeviceCoeffs, StepComm, StepConfig,
                                        build_comm_model, step_wire_bytes)
from planner.hetero.solve import band_rows, solve_with_cost_model
from tests.unit.test_hetero import GB, affine_memory, plan_time
from tests.unit.test_ilp_exact import MICRO_BATCHES, every_choice, least_step_at

GPU = DeviceSpec("A100-80GB")
GBPS = 100.0


def cluster_of(k: int) -> ClusterSpec:
    return ClusterSpec("c", (NodeSpec("n0", "dc", (GPU,) * k),), NetworkSpec(GBPS, GBPS))


def comm_at(spec, zero: int, step: StepConfig, k: int = 4) -> CommModel:
    return build_comm_model([GPU], False, cluster_of(k), spec, zero, "bf16", step=step)


# ---- wire bytes by dtype --------------------------------------------------------------------------


def test_fp32_gathers_put_twice_the_bytes_of_bf16_gathers_on_the_wire():
    spec, k = get_model("gpt2"), 4
    sc = step_collectives(spec, 3)
    bf16, fp32 = (comm_at(spec, 3, StepConfig(p)) for p in ("bf16", "fp32"))
    assert fp32.gather_bytes == 2 * bf16.gather_bytes == 4 * sc.gather_numel
    assert fp32.reduce_bytes == bf16.reduce_bytes == 4 * sc.reduce_numel  # reduce_dtype fp32 in both
    # the plan's wire bytes (contracts.wire, NCCL's ring on an even split): the gathers' part doubles
    even = [1 / k] * k
    wire = {p: step_wire_bytes(spec, 3, StepConfig(p), even, "nccl") for p in ("bf16", "fp32")}
    bf16_gathers = (k - 1) * sc.gather_numel * 2
    assert wire["fp32"] - wire["bf16"] == pytest.approx(bf16_gathers, rel=1e-6)
    # everything in half: exactly half of everything in fp32
    half = step_wire_bytes(spec, 3, StepConfig("bf16", "bf16"), even, "nccl")
    assert 2 * half == pytest.approx(wire["fp32"], rel=1e-6)
    assert comm_at(spec, 3, StepConfig("bf16", "bf16")).reduce_bytes == 2 * sc.reduce_numel


def test_zero_1_and_2_gather_fp32_and_refuse_half_parameters():
    spec = get_model("gpt2")
    sc = step_collectives(spec, 1)
    assert comm_at(spec, 1, None).gather_bytes == 4 * sc.gather_numel  # auto at zero 1: fp32
    with pytest.raises(ValueError, match="param_dtype bf16 needs zero 3"):
        CostModel.build(cluster_of(2), spec, 64, "bf16", "none", 0.9, zero=2, param_dtype="bf16")


def test_the_plans_wire_bytes_are_every_ranks_sends_together():
    spec, k = get_model("tiny"), 3
    fractions = [0.5, 0.3, 0.2]
    sc = step_collectives(spec, 3)
    got = step_wire_bytes(spec, 3, StepConfig("fp32"), fractions, "nccl")
    # NCCL moves each unit's owner slices to the k − 1 others: (k − 1)·buffer per collective, whatever the split
    assert got == pytest.approx((k - 1) * 4 * (sc.gather_numel + sc.reduce_numel), rel=1e-6)
    assert step_wire_bytes(spec, 3, StepConfig("fp32"), [1.0], "nccl") == 0
    # gloo: per owner a reduce (ring reduce-scatter, then the segments gathered to the owner) and its
    # framing: more than the ring's payload, less than half as much again
    gloo = step_wire_bytes(spec, 3, StepConfig("fp32"), fractions, "gloo")
    assert got < gloo < 1.5 * got


# ---- overlap ------------------------------------------------------------------------------------


def hand_cost(spec, zero: int, step: StepConfig, compute_s: float, opt_s: float, k: int = 2) -> CostModel:
    """k identical GPUs of a given compute per sample (β) and optimizer time; the real collectives of spec."""
    cluster = cluster_of(k)
    coeffs = {GPU: DeviceCoeffs(GPU, "bf16", 0.0, compute_s, opt_s, 80 * GB, lambda m, n, f: 0.0)}

    def comm_for(devices, multi_node):
        return build_comm_model(devices, multi_node, cluster, spec, zero, "bf16", step=step)

    return CostModel(cluster, spec.num_params, coeffs, comm_for, zero, step=step, spec=spec)


def link() -> Link:
    return Link(bytes_per_s(GBPS), 5e-6)


def test_exposed_comm_is_the_first_gather_and_the_last_reduce_when_compute_is_longer():
    spec, k = get_model("gpt2"), 2
    embed = runtime_units(spec)[0].numel
    cost = hand_cost(spec, 3, StepConfig("bf16", reduce_in_flight=1), compute_s=10.0, opt_s=1.0, k=k)
    per_device = [(1, 1, 0.5)] * k
    t, _ = cost.estimate_iteration_s(per_device)
    first_gather_last_reduce = sharded_step_comm_s(2 * embed, 4 * embed, 2, k, link())
    total = cost.comm_model({GPU}, False).comm_s(k)
    assert total < 10.0  # compute-bound
    wire, exposed = cost.estimate_comm(per_device)
    assert exposed == pytest.approx(first_gather_last_reduce)
    assert t == pytest.approx(10.0 + first_gather_last_reduce + 0.5)
    assert first_gather_last_reduce < 0.5 * total  # far less than the no-overlap pricing would add
    assert wire > 0


def test_comm_bound_step_is_the_comm_total():
    spec, k = get_model("gpt2"), 2
    cost = hand_cost(spec, 3, StepConfig("bf16"), compute_s=1e-6, opt_s=1.0, k=k)
    per_device = [(1, 1, 0.5)] * k
    t, _ = cost.estimate_iteration_s(per_device)
    total = cost.comm_model({GPU}, False).comm_s(k)
    assert t == pytest.approx(total + 0.5)  # the network is the critical chain; the compute hides under it
    _, exposed = cost.estimate_comm(per_device)
    assert exposed == pytest.approx(total - 1e-6)


def test_prefetch_0_and_zero_1_expose_what_they_wait_for():
    spec, k = get_model("gpt2"), 2
    embed = runtime_units(spec)[0].numel
    sc3 = step_collectives(spec, 3)
    per_device = [(1, 1, 0.5)] * k
    # zero 3 without prefetch: every gather waited for, and the last reduce
    cost = hand_cost(spec, 3, StepConfig("bf16", prefetch=0, reduce_in_flight=1), compute_s=10.0, opt_s=1.0, k=k)
    gather_calls = sc3.num_calls - len(runtime_units(spec)) - (1 if spec.tied_embeddings else 0)
    expected = sharded_step_comm_s(2 * sc3.gather_numel, 4 * embed, gather_calls + 1, k, link())
    assert cost.estimate_comm(per_device)[1] == pytest.approx(expected)
    # zero 1: the reduces after the last micro-batch, the gathers after the optimizer: nothing hidden
    cost1 = hand_cost(spec, 1, StepConfig("fp32"), compute_s=10.0, opt_s=1.0, k=k)
    total1 = cost1.comm_model({GPU}, False).comm_s(k)
    assert cost1.estimate_iteration_s(per_device)[0] == pytest.approx(10.0 + total1 + 0.5)
    assert cost1.estimate_comm(per_device)[1] == pytest.approx(total1)


@pytest.mark.parametrize("zero, prefetch", [(3, 1), (3, 0), (2, 1)])
def test_reduce_in_flight_0_exposes_every_reduce_and_1_all_but_the_last(zero, prefetch):
    spec, k = get_model("gpt2"), 2
    units = runtime_units(spec)
    embed = units[0].numel
    sc = step_collectives(spec, zero)
    reduce_calls = len(units) + (1 if spec.tied_embeddings else 0)
    per_device = [(1, 1, 0.5)] * k
    exposed = {}
    for flight in (0, 1):
        step = StepConfig("bf16" if zero == 3 else "fp32", prefetch=prefetch, reduce_in_flight=flight)
        exposed[flight] = hand_cost(spec, zero, step, compute_s=10.0, opt_s=1.0, k=k).estimate_comm(per_device)[1]
    pbytes = 2 if zero == 3 else 4
    if zero == 3 and prefetch:
        gathered, gathers = embed, 1  # only the first gather waited for
    else:
        gathered, gathers = sc.gather_numel, sc.num_calls - reduce_calls  # every gather waited for
    every_reduce = sharded_step_comm_s(pbytes * gathered, 4 * sc.reduce_numel, gathers + reduce_calls, k, link())
    last_reduce = sharded_step_comm_s(pbytes * gathered, 4 * embed, gathers + 1, k, link())
    assert exposed[0] == pytest.approx(every_reduce)
    assert exposed[1] == pytest.approx(last_reduce)
    assert exposed[0] > exposed[1]
    # zero 1 reduces after the backward: nothing left to overlap, so no plan or cost model leaves one in flight
    with pytest.raises(ValueError, match="reduce_in_flight 1 needs zero 2 or 3"):
        hand_cost(spec, 1, StepConfig("fp32", reduce_in_flight=1), compute_s=10.0, opt_s=1.0, k=k)


def test_reduce_in_flight_reaches_the_memory_model():
    # the cost model's memory asks the memory model at the plan's reduce_in_flight: its buffers cost room
    spec = get_model("gpt2")
    built = {f: CostModel.build(cluster_of(2), spec, 128, "bf16", "none", 0.9, zero=3, reduce_dtype="bf16",
                                reduce_in_flight=f) for f in (0, 1)}
    assert built[1].step.reduce_in_flight == 1 and built[0].step.reduce_in_flight == 0
    # the moments of the step (the peak is their largest): a reduce's buffers kept through the next
    # unit's backward raise some, lower none
    moments = {f: c.coeffs[GPU].phases_fn(2, 1, 0.5) for f, c in built.items()}
    assert all(a >= b for a, b in zip(moments[1], moments[0])) and moments[1] != moments[0]


def test_step_comm_bounds_and_rooms():
    s = StepComm(exposed_s=1.0, hidden_s=3.0)
    assert s.end_s(2.0) == 4.0 and s.end_s(5.0) == 6.0 and s.total_s == 4.0
    assert s.compute_room_s(3.9) == -math.inf and s.compute_room_s(6.0) == 5.0
    assert s.bound_s(2.0) == 4.0 and s.bound_s(7.0) == 8.0
    assert s.exposed_of_s(2.0) == 2.0 and s.exposed_of_s(5.0) == 1.0


@pytest.mark.parametrize("budget_s", [0.1, 0.9, 1.5, math.inf])
def test_band_rows_are_the_interpolated_room_at_whole_counts(budget_s):
    """F ≤ a·x + s·N per row is exact: at whole counts the least row is min(memory room, optimizer room
    budget/opt), and between them the chord (x devices on the even split)."""
    band = AccumBand(micro_batch=2, lo=2, hi=40, step_s=0.1, max_share_lo=0.9, max_share_hi=0.2)
    opt_s = 2.0
    a1, s1 = band.room_line()

    def room(n: float) -> float:
        return min(a1 + s1 * n, budget_s / opt_s)

    rows = band_rows(band, opt_s, budget_s, 30)
    least = lambda n: min(a + s * n for a, s in rows)  # noqa: E731
    for n in range(band.lo, 31):
        assert least(n) == pytest.approx(room(n), abs=1e-12)
        # half-way: the average of its neighbours (two devices at n and n + 1), never more
        if n < 30:
            assert least(n + 0.5) == pytest.approx(0.5 * (room(n) + room(n + 1)), abs=1e-12)


# ---- the ILP stays exact under overlap ------------------------------------------------------------


def overlap_cost(nodes, table, bandwidth, hop_s, inter_factor, exposed_share):
    """A CostModel with hand-made collectives of which `exposed_share` stays exposed (the rest compute hides)."""
    cluster = ClusterSpec("test", tuple(NodeSpec(f"n{i}", "dc0", tuple(d)) for i, d in enumerate(nodes)),
                          NetworkSpec(1.0, 1.0))

    def comm_for(devices, multi_node):
        bw = bandwidth / (inter_factor if multi_node else 1.0)
        return CommModel(bw, hop_s, 1.0, 1.0, num_calls=4, exposed_gather_bytes=exposed_share,
                         exposed_reduce_bytes=exposed_share, exposed_calls=2)

    return CostModel(cluster, 1, table, comm_for)


def exhaustive_overlap_best(cost, global_batch: int) -> float:
    """Per scope and world size k: the least T1 + T2 at which k devices take the batch and hold the
    state, each choice ending at exposed(k) + max(c, hidden(k)): tests/unit/test_ilp_exact.py's search
    over every compute end and the least optimizer budget at it."""
    best = math.inf
    devices_all = cost.cluster.devices()
    for _, multi, members in cost.scopes():
        idx = [i for _, ix in members for i in ix]
        comm = cost.comm_model({devices_all[i][1] for i in idx}, multi)
        devs = [(every_choice(cost.coeffs[devices_all[i][1]], global_batch, MICRO_BATCHES),
                 cost.coeffs[devices_all[i][1]].optimizer_s) for i in idx]
        for k in range(1 if not multi else 2, len(idx) + 1):
            step = comm.step(k)
            best = least_step_at(devs, k, global_batch, step.end_s, best)
    return best


def test_ilp_equals_exhaustive_search_with_overlap():
    rng = random.Random(20261204)
    kinds = [DeviceSpec("A100-80GB"), DeviceSpec("T4", memory_gb=2.0), DeviceSpec("L4", slowdown=2.0)]
    checked = 0
    while checked < 6:
        num = rng.randint(5, 12)
        devs = [rng.choice(kinds) for _ in range(num)]
        cut = rng.randint(1, num - 1)
        table = {d: DeviceCoeffs(d, "fp32", rng.uniform(0.0, 0.3), rng.uniform(0.05, 1.0), rng.uniform(0.1, 2.0),
                                 rng.uniform(1.5, 8.0) * GB,
                                 affine_memory(rng.uniform(0, 0.5) * GB, rng.uniform(0.3, 1.5) * GB,
                                               rng.uniform(2.0, 30.0) * GB))
                 for d in kinds}
        # comm comparable with compute: some plans compute-bound, some comm-bound
        cost = overlap_cost([devs[:cut], devs[cut:]], table, rng.uniform(0.2, 2.0), rng.uniform(0, 0.02),
                            rng.uniform(1.0, 3.0), rng.uniform(0.05, 0.5))
        batch = rng.randint(6, 24)
        expected = exhaustive_overlap_best(cost, batch)
        if math.isinf(expected):
            continue
        sol, _ = solve_with_cost_model(cost, batch, time_limit_s=60.0, gap=5e-7, micro_batches=MICRO_BATCHES)
        per_device = [sol.per_device.get(i, (0, 0, 0.0)) for i in range(cost.cluster.num_devices)]
        got = plan_time(cost, per_device)
        assert expected * (1 - 1e-9) <= got <= expected * (1 + 1e-6), (num, batch, got, expected)
        assert sol.status == "optimal"
        checked += 1
