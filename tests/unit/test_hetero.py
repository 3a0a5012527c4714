"""The heterogeneous planner's ILP (planner/hetero/solve.py) on hand-solved instances and against a brute force.

The brute force below is an independent implementation over the same coefficient tables: it
enumerates every per-device choice (unused, state only, or a (micro-batch, accumulation) of the
table), prices the collectives from the devices actually used, and places the state with an exact
piecewise-linear solve of the least optimizer time (the step is max-plus: every rank's compute and
collectives, then every rank's optimizer) instead of the solver's budget walk and water-filling.
"""
import math
import random

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from planner.costmodel.training import CommModel, CostModel, DeviceCoeffs, make_choice
from planner.hetero.solve import solve_plan, solve_with_cost_model

GB = 1e9


def affine_memory(base_bytes, per_sample_bytes, state_bytes):
    return lambda m, n, f: base_bytes + per_sample_bytes * m + state_bytes * f


def make_cost(nodes, coeffs, bandwidth_bytes_per_s=math.inf, hop_latency_s=0.0, inter_factor=1.0, grad_bytes=1.0):
    """A CostModel from explicit coefficients: nodes = [[DeviceSpec, ...], ...]."""
    cluster = ClusterSpec("test", tuple(NodeSpec(f"n{i}", "dc0", tuple(devs)) for i, devs in enumerate(nodes)),
                          NetworkSpec(1.0, 1.0))

    def comm_for(devices, multi_node):
        bw = bandwidth_bytes_per_s / (inter_factor if multi_node else 1.0)
        return CommModel(bw, hop_latency_s, grad_bytes, grad_bytes, num_calls=2)

    return CostModel(cluster, 1, coeffs, comm_for)


def coeffs(device, alpha_s, beta_s, opt_s, capacity_bytes, memory_fn):
    return DeviceCoeffs(device, "fp32", alpha_s, beta_s, opt_s, capacity_bytes, memory_fn)


def plan_time(cost, per_device):
    return cost.estimate_iteration_s(per_device)[0]


def solve(cost, global_batch, micro_batches=None):
    sol, _ = solve_with_cost_model(cost, global_batch, time_limit_s=20.0, micro_batches=micro_batches)
    per_device = [sol.per_device.get(i, (0, 0, 0.0)) for i in range(cost.cluster.num_devices)]
    return per_device, plan_time(cost, per_device)


# ---- hand-solved -------------------------------------------------------------------------------

A = DeviceSpec("A100-80GB")
B_ = DeviceSpec("A100-80GB", memory_gb=1.5)


def test_non_binding_memory_splits_evenly_into_one_micro_batch_each():
    # α = 1 s, β = 1 s/sample, no optimizer or collective cost: B = 4 on two devices -> m=2, n=1 each, T = 1 + 2
    mem = affine_memory(0, 1 * GB, 4 * GB)
    cost = make_cost([[A, A]], {A: coeffs(A, 1.0, 1.0, 0.0, 100 * GB, mem)})
    per_device, t = solve(cost, 4)
    assert t == pytest.approx(3.0)
    assert [(m, n) for m, n, _ in per_device] == [(2, 1), (2, 1)]



def test_equal_time_choices_take_the_larger_micro_batch():
    # α = 0: m=1 × n=4 and m=4 × n=1 predict the same time; fewer accumulation steps win the tie
    mem = affine_memory(0, 1 * GB, 4 * GB)
    cost = make_cost([[A, A]], {A: coeffs(A, 0.0, 1.0, 0.0, 100 * GB, mem)})
    per_device, t = solve(cost, 8)
    assert t == pytest.approx(4.0)
    assert [(m, n) for m, n, _ in per_device] == [(4, 1), (4, 1)]


def test_binding_memory_limits_the_small_device_to_micro_batch_1_and_a_small_shard():
    # the small device holds m=1 only (1 GB) and f ≤ 0.125 (0.5 GB / 4 GB):
    # options are (A:1, B:3) -> max(2, 4) = 4 and (A:2 as 2×1, B:2) -> max(4, 3) = 4; unconstrained it is 3
    mem = affine_memory(0, 1 * GB, 4 * GB)
    cost = make_cost([[A, B_]], {A: coeffs(A, 1.0, 1.0, 0.0, 100 * GB, mem),
                                 B_: coeffs(B_, 1.0, 1.0, 0.0, 1.5 * GB, mem)})
    per_device, t = solve(cost, 4)
    assert t == pytest.approx(4.0)
    small = per_device[1]
    assert small[0] <= 1 and small[2] <= 0.125 + 1e-9
    assert 1 * GB * small[0] + 4 * GB * small[2] <= 1.5 * GB * (1 + 1e-9)


def test_the_optimizers_share_the_state_after_the_barrier():
    # device 0 computes the whole batch (device 1 is too small for a micro-batch) and both hold state.
    # The optimizers run after every rank's compute (max-plus): T = 4·1 + max(2·f0, 2·f1), least at
    # f0 = f1 = 1/2 (within device 1's memory, f1 ≤ 0.75): T = 4 + 1 = 5. (Per device, as
    # max(4 + 2·f0, 2·f1), it would give device 1 all it holds, 0.75, and claim 4.5: the runtime's
    # fast rank waits at the next gather for device 1's optimizer.)
    big, small = DeviceSpec("L4"), DeviceSpec("L4", memory_gb=3.0)
    mem = affine_memory(0, 4 * GB, 4 * GB)
    cost = make_cost([[big, small]], {big: coeffs(big, 0.0, 1.0, 2.0, 100 * GB, mem),
                                      small: coeffs(small, 0.0, 1.0, 2.0, 3 * GB, mem)})
    per_device, t = solve(cost, 4)
    assert t == pytest.approx(5.0, rel=1e-4)
    assert per_device[1][0] == 0 and per_device[1][2] == pytest.approx(0.5, rel=1e-4)


def test_infeasible_state_names_the_reason():
    mem = affine_memory(0, 1 * GB, 4 * GB)
    tiny = DeviceSpec("T4", memory_gb=1.0)
    cost = make_cost([[tiny, tiny]], {tiny: coeffs(tiny, 1.0, 1.0, 0.0, 1.5 * GB, mem)})
    with pytest.raises(ValueError, match="state does not fit: the devices hold at most 75%"):
        solve(cost, 4)
    cost = make_cost([[tiny, tiny]], {tiny: coeffs(tiny, 1.0, 1.0, 0.0, 2 * GB, mem)})
    with pytest.raises(ValueError, match="does not fit beside the micro-batches"):
        solve(cost, 4)
    no_room = DeviceSpec("T4", memory_gb=0.5)
    cost = make_cost([[no_room]], {no_room: coeffs(no_room, 1.0, 1.0, 0.0, 0.5 * GB, affine_memory(1 * GB, 1, 1))})
    with pytest.raises(ValueError, match="cannot hold even the smallest shard"):
        solve(cost, 4)


def test_bad_inputs_raise_value_errors():
    cluster = ClusterSpec("c", (NodeSpec("n0", "dc0", (DeviceSpec("cpu"),) * 2),))
    for kwargs, what in [(dict(global_batch=0), "global batch"), (dict(global_batch=4, dtype="int8"), "dtype"),
                         (dict(global_batch=4, headroom=1.5), "headroom"), (dict(global_batch=4, seq=0), "seq"),
                         (dict(global_batch=4, recompute="some"), "recompute")]:
        with pytest.raises(ValueError, match=what):
            solve_plan(cluster, "tiny", **kwargs)
    with pytest.raises(ValueError, match="unknown model"):
        solve_plan(cluster, "no-such-model", 4)


# ---- brute force -------------------------------------------------------------------------------


def least_time_for_shares(entries):
    """entries: (a_s, max_share, opt_s) per used device. The least t with Σ min(max_share, (t − a)/opt) ≥ 1
    and t ≥ max a, solved exactly on the piecewise-linear capacity (a = 0: the least optimizer time T2)."""
    t0 = max(a for a, _, _ in entries)

    def cap(t):
        return sum(ms if o == 0 else min(ms, max(0.0, (t - a) / o)) for a, ms, o in entries)

    if cap(t0) >= 1:
        return t0
    knots = sorted({t0} | {a + ms * o for a, ms, o in entries if o > 0 and a + ms * o > t0})
    for lo, hi in zip(knots, knots[1:]):
        if cap(hi) >= 1 - 1e-12:  # capacity is linear on [lo, hi]
            return min(hi, lo + (1 - cap(lo)) * (hi - lo) / (cap(hi) - cap(lo)))
    return math.inf


def every_choice(c: DeviceCoeffs, global_batch: int, micro_batches) -> list:
    """State only, and every (m, n) with m in micro_batches and m·n ≤ B whose memory fits: the whole
    plan space of one device, enumerated here rather than taken from the solver's choices and bands."""
    out = [make_choice(c, 0, 0, c.max_share(0, 0))]
    for m in micro_batches:
        for n in range(1, global_batch // m + 1):
            share = c.max_share(m, n)
            if share >= 0:
                out.append(make_choice(c, m, n, share))
    return [ch for ch in out if ch.max_share >= 0]


def brute_force(cost, global_batch, micro_batches):
    devices = cost.cluster.devices()
    options = []
    for _, d in devices:
        options.append([None] + every_choice(cost.coeffs[d], global_batch, micro_batches))
    best = math.inf

    def rec(i, left, picked):
        nonlocal best
        if i == len(devices):
            if left:
                return
            used = [(j, ch) for j, ch in enumerate(picked) if ch is not None]
            if not used:
                return
            nodes = {devices[j][0].name for j, _ in used}
            comm = cost.comm_model({devices[j][1] for j, _ in used}, len(nodes) > 1).comm_s(len(used))
            # max-plus: every rank's compute and collectives, then every rank's optimizer on its shard
            t1 = max(ch.compute_s + comm for _, ch in used)
            t2 = least_time_for_shares([(0.0, ch.max_share, cost.coeffs[devices[j][1]].optimizer_s) for j, ch in used])
            best = min(best, t1 + t2)
            return
        for ch in options[i]:
            b = 0 if ch is None else ch.batch
            if b <= left:
                rec(i + 1, left - b, picked + [ch])

    rec(0, global_batch, [])
    return best


def random_instance(rng, layerwise=False):
    kinds = [DeviceSpec(t, slowdown=s, memory_gb=g) for t, s, g in
             [("A100-80GB", 1.0, None), ("T4", 1.0, 2.0), ("L4", 2.0, None), ("cpu", 3.0, 1.0)]]
    rng.shuffle(kinds)
    num = rng.randint(1, 4)
    devs = [rng.choice(kinds[:rng.randint(1, 3)]) for _ in range(num)]
    split = rng.randint(1, num)
    nodes = [devs[:split], devs[split:]] if split < num and rng.random() < 0.5 else [devs]
    table = {}
    for d in set(devs):
        cap = rng.uniform(1.5, 8.0) * GB
        alpha_s, beta_s = rng.uniform(0.0, 0.5), rng.uniform(0.1, 1.0)
        memory = affine_memory(rng.uniform(0, 0.5) * GB, rng.uniform(0.3, 1.5) * GB, rng.uniform(0.5, 6.0) * GB)
        if layerwise:  # zero ≥ 2: every accumulation step's boundaries kept, and n > 1 recomputes (β × 4/3)
            per_step = rng.uniform(0.1, 0.8) * GB
            memory = (lambda mem, b: lambda m, n, f: mem(m, n, f) + b * m * (n - 1))(memory, per_step)
        table[d] = DeviceCoeffs(d, "fp32", alpha_s, beta_s, rng.uniform(0.0, 1.5), cap, memory, layerwise=layerwise,
                                recompute_alpha_s=alpha_s, recompute_beta_s=beta_s * 4 / 3)
    cost = make_cost(nodes, table, bandwidth_bytes_per_s=rng.uniform(0.5, 4.0), hop_latency_s=rng.uniform(0, 0.05),
                     inter_factor=rng.uniform(1.0, 4.0))
    return cost, rng.randint(1, 9)


@pytest.mark.parametrize("layerwise, instances", [(False, 21), (True, 10)])
def test_ilp_matches_brute_force_on_random_small_clusters(layerwise, instances):
    rng = random.Random(20241101)
    checked = 0
    while checked < instances:
        cost, batch = random_instance(rng, layerwise)
        micro_batches = [1, 2, 4]
        expected = brute_force(cost, batch, micro_batches)
        if math.isinf(expected):
            with pytest.raises(ValueError, match="no feasible plan"):
                solve(cost, batch, micro_batches)
            continue
        per_device, t = solve(cost, batch, micro_batches)
        assert t == pytest.approx(expected, rel=0.01), (cost.cluster, batch)
        assert t >= expected * (1 - 1e-9)  # never below the true optimum: the plan is a real plan
        checked += 1


def test_planned_devices_fit_and_batches_sum_on_random_clusters():
    rng = random.Random(7)
    for _ in range(10):
        cost, batch = random_instance(rng)
        try:
            per_device, _ = solve(cost, batch)
        except ValueError:
            continue
        assert sum(m * n for m, n, _ in per_device) == batch
        assert sum(f for *_, f in per_device) == pytest.approx(1.0)
        for (_, d), (m, n, f) in zip(cost.cluster.devices(), per_device):
            c = cost.coeffs[d]
            if m * n or f:
                assert c.memory_bytes(m, n, f) <= c.capacity_bytes * (1 + 1e-9)


def test_real_models_plan_is_valid_and_never_over_capacity():
    cluster = ClusterSpec.load("examples/clusters/cephalo.json")
    for dtype, zero in (("bf16", "auto"), ("fp32", 1)):
        result = solve_plan(cluster, "gpt-2.7b", 64, dtype=dtype, recompute="full", headroom=0.9, zero=zero)
        plan = result.plan
        assert result.status == "optimal"
        assert sum(a.batch for a in plan.assignments) == 64
        for a, (_, d) in zip(plan.assignments, cluster.devices()):
            assert a.predicted_memory_bytes <= d.memory_bytes * 0.9 + 1
        feasible = [b.predicted_iteration_s for b in plan.baselines.values() if not b.oom]
        assert all(plan.predicted_iteration_s <= t for t in feasible)
        assert any("P40 has no bf16" in n for n in plan.notes) == (dtype == "bf16")
        if zero == 1:
            # Cephalo's point at ZeRO-1: 21 GB of fp32 params + grads leave the 24 GB parts no room for an even split
            assert plan.baselines["even"].oom and plan.baselines["proportional"].oom
        else:  # sharding the gradients too frees that room: auto takes a higher stage, and it is faster
            assert plan.zero in (2, 3)
            assert plan.predicted_iteration_s < plan.zero_candidates[1].predicted_iteration_s
