"""The ILP (planner/hetero/solve.py) is exact at every size: on random 6–12-device clusters, asked
for a gap of EXACT_GAP (its default is BISECTION_TOL, 1e-4), it equals an exhaustive search over
world sizes and per-device choices within 1e-6, is never better than it, and says "optimal"; at its
default it is within BISECTION_TOL.

The exhaustive search is a different algorithm over the same cost tables: for each scope (all
nodes, each node alone), each world size k and each compute end T1 (every choice's compute plus
comm(k)) it finds the least optimizer time T2 at which exactly k devices, on choices that end by
T1, can take the global batch and hold the whole state (the step is max-plus: T1 + T2), by
bisection on T2 with a dynamic program over the devices (state: devices used, samples taken;
value: the most state they can hold within T2 — every device tried unused, state-only, or on each
of its (m, n), every count n up to B/m enumerated here, not the solver's choices and bands). No
bisection tolerance is shared with the solver: T2 is closed to 1e-12.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from contracts.cluster import DeviceSpec
from planner.costmodel.training import DeviceCoeffs
from planner.hetero.solve import BISECTION_TOL, solve_with_cost_model
from tests.unit.test_hetero import GB, affine_memory, every_choice, make_cost, plan_time

MICRO_BATCHES = [1, 2, 4]
EXACT_GAP = 5e-7  # the solver's own closing tolerance, asked tighter than its default
# random clusters checked (the exhaustive search now also walks every compute end, so fewer and smaller)
INSTANCES = 6


def _caps_by_batch(choices, opt_s: float, budget_s: float, global_batch: int) -> np.ndarray:
    """For one device whose optimizer may take budget_s (T2): the most state it can hold for each batch
    it may take among `choices` (−inf where none has that batch). Choices of one batch differ only in that room."""
    out = np.full(global_batch + 1, -np.inf)
    for ch in choices:
        if ch.batch > global_batch:
            continue
        cap = ch.max_share if opt_s <= 0 else min(ch.max_share, budget_s / opt_s)
        out[ch.batch] = max(out[ch.batch], cap)
    return out


def _most_state(devices, budget_s: float, global_batch: int) -> np.ndarray:
    """S[k, b]: the most state k devices taking b samples in all can hold within the optimizer budget (−inf: impossible)."""
    n = len(devices)
    S = np.full((n + 1, global_batch + 1), -np.inf)
    S[0, 0] = 0.0
    for choices, opt_s in devices:
        caps = _caps_by_batch(choices, opt_s, budget_s, global_batch)
        new = S.copy()
        for b in np.nonzero(np.isfinite(caps))[0]:
            cand = S[:-1, :global_batch + 1 - b] + caps[b]
            np.maximum(new[1:, b:], cand, out=new[1:, b:])
        S = new
    return S


def least_step_at(devs, k: int, global_batch: int, end_of, best: float) -> float:
    """The least T1 + T2 of k of `devs` ([(choices, optimizer_s)]) taking the batch and holding the state,
    or `best` if none is below it: per compute end T1 (every distinct end_of(compute) of a choice, the
    devices limited to the choices that end by it), the least optimizer budget T2 by bisection to
    1e-12 over the exact dynamic program."""
    ends = sorted({end_of(ch.compute_s) for chs, _ in devs for ch in chs}, reverse=True)
    top = max(o for _, o in devs) + 1.0
    for t1 in ends:
        if t1 >= best:
            continue
        allowed = [([ch for ch in chs if end_of(ch.compute_s) <= t1], o) for chs, o in devs]

        def holds(t2: float) -> bool:
            return _most_state(allowed, t2, global_batch)[k, global_batch] >= 1 - 1e-12

        hi = min(top, best - t1)
        if not holds(hi):
            continue  # no budget this T1 leaves beats the best found
        lo = 0.0
        while hi - lo > 1e-12 * max(hi, 1e-12):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if holds(mid) else (mid, hi)
        best = min(best, t1 + hi)
    return best


def exhaustive_best(cost, global_batch: int) -> float:
    best = math.inf
    devices_all = cost.cluster.devices()
    for _, multi, members in cost.scopes():
        idx = [i for _, ix in members for i in ix]
        kinds = {devices_all[i][1] for i in idx}
        comm = cost.comm_model(kinds, multi)
        devs = [(every_choice(cost.coeffs[devices_all[i][1]], global_batch, MICRO_BATCHES), cost.coeffs[devices_all[i][1]].optimizer_s)
                for i in idx]
        for k in range(1, len(idx) + 1):
            if multi and k == 1:
                continue  # one device is one node: its own scope prices it
            comm_s = comm.comm_s(k)
            if comm_s >= best:
                continue
            best = least_step_at(devs, k, global_batch, lambda c: c + comm_s, best)
    return best


def random_cluster(rng: random.Random):
    kinds = [DeviceSpec(t, slowdown=s, memory_gb=g) for t, s, g in
             [("A100-80GB", 1.0, None), ("T4", 1.0, 2.0), ("L4", 2.0, None), ("cpu", 3.0, 1.0)]]
    rng.shuffle(kinds)
    kinds = kinds[:rng.randint(2, 3)]
    num = rng.randint(6, 12)
    devs = [rng.choice(kinds) for _ in range(num)]
    cut = sorted(rng.sample(range(1, num), rng.randint(0, 2)))
    nodes = [devs[a:b] for a, b in zip([0] + cut, cut + [num])]
    table = {}
    for d in kinds:
        cap = rng.uniform(1.5, 8.0) * GB
        memory = affine_memory(rng.uniform(0, 0.5) * GB, rng.uniform(0.3, 1.5) * GB, rng.uniform(2.0, 30.0) * GB)
        table[d] = DeviceCoeffs(d, "fp32", rng.uniform(0.0, 0.3), rng.uniform(0.05, 1.0), rng.uniform(0.0, 2.0),
                                cap, memory)
    # the collectives matter: their time grows with k, so fewer devices can win
    cost = make_cost(nodes, table, bandwidth_bytes_per_s=rng.uniform(2.0, 20.0), hop_latency_s=rng.uniform(0, 0.02),
                     inter_factor=rng.uniform(1.0, 3.0))
    return cost, rng.randint(8, 48)


def test_ilp_equals_exhaustive_search_on_random_6_to_12_device_clusters():
    rng = random.Random(20261201)
    checked = optimal = 0
    while checked < INSTANCES:
        cost, batch = random_cluster(rng)
        expected = exhaustive_best(cost, batch)
        if math.isinf(expected):
            with pytest.raises(ValueError, match="no feasible plan"):
                solve_with_cost_model(cost, batch, time_limit_s=60.0, micro_batches=MICRO_BATCHES)
            continue
        for gap, within in ((EXACT_GAP, 1e-6), (0.0, BISECTION_TOL)):
            sol, _ = solve_with_cost_model(cost, batch, time_limit_s=60.0, gap=gap, micro_batches=MICRO_BATCHES)
            per_device = [sol.per_device.get(i, (0, 0, 0.0)) for i in range(cost.cluster.num_devices)]
            got = plan_time(cost, per_device)
            assert sum(m * n for m, n, _ in per_device) == batch
            info = (cost.cluster.num_devices, batch, gap, got, expected)
            assert expected * (1 - 1e-9) <= got <= expected * (1 + within), info
            optimal += sol.status == "optimal"
        checked += 1
    assert optimal == 2 * checked  # every instance proven at both gaps, none only "feasible"


def test_the_exhaustive_search_sees_a_cheaper_world_size():
    """The checker itself: with collectives far dearer than compute, one device beats all of them."""
    d = DeviceSpec("A100-80GB")
    c = DeviceCoeffs(d, "fp32", 0.0, 0.1, 0.0, 8 * GB, affine_memory(0, 0.1 * GB, 1.0 * GB))
    cost = make_cost([[d] * 12], {d: c}, bandwidth_bytes_per_s=0.01)
    assert exhaustive_best(cost, 8) == pytest.approx(0.8, rel=1e-9)
    sol, _ = solve_with_cost_model(cost, 8, time_limit_s=30.0, micro_batches=MICRO_BATCHES)
    assert len(sol.per_device) == 1
