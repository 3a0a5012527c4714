"""The planner's cost model (planner/costmodel/training.py): units, collectives, choices, slowdown, memory linearity."""
import math

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from planner.costmodel.collectives import bytes_per_s as link_bandwidth_bytes_per_s
from contracts.constants import BITS_PER_BYTE
from planner.costmodel.training import (CommModel, CostModel, DeviceCoeffs, build_comm_model, build_device_coeffs,
                          cached_memory_fn, max_share_fitting)
from contracts.specs import get_model

GB = 1e9


def test_gbps_become_bytes_per_second():
    assert link_bandwidth_bytes_per_s(8.0) == pytest.approx(1e9)
    assert BITS_PER_BYTE == 8


def test_ring_all_gather_and_reduce_scatter_by_hand():
    comm = CommModel(bandwidth_bytes_per_s=1e9, hop_latency_s=1e-3, gather_bytes=2e9, reduce_bytes=4e9, num_calls=10)
    assert comm.comm_s(1) == 0.0  # one device: nothing to gather or reduce
    # k = 4: ring (4−1)/4 · (2e9 + 4e9) / 1e9 = 4.5 s; 10 calls × ⌈log2 4⌉ = 2 hops × 1 ms
    assert comm.comm_s(4) == pytest.approx(4.5 + 0.02)
    times = [comm.comm_s(k) for k in range(1, 40)]
    assert times == sorted(times)  # more devices never cost less (the ILP's bucket pricing relies on it)
    measured = CommModel(1e9, 0.0, 2e9, 4e9, 10, reduce_bandwidth_bytes_per_s=2e9, call_latency_s=1e-4)
    assert measured.comm_s(2) == pytest.approx(0.5 * (2.0 + 2.0) + 10 * 1e-4)


def test_collective_bytes_follow_the_runtime_units():
    from contracts.units import step_collectives

    spec = get_model("gpt2")
    cluster = ClusterSpec("c", (NodeSpec("a", "dc", (DeviceSpec("L4"),) * 2),), NetworkSpec(8.0, 8.0))
    for zero in (1, 2, 3):
        sc = step_collectives(spec, zero)
        bf16 = build_comm_model([DeviceSpec("L4")], False, cluster, spec, zero, "bf16")
        fp32 = build_comm_model([DeviceSpec("L4")], False, cluster, spec, zero, "fp32")
        # param_dtype auto: zero 3 gathers in the compute dtype, zero 1/2 their replicated fp32 parameters
        assert bf16.gather_bytes == (2 if zero == 3 else 4) * sc.gather_numel
        assert fp32.gather_bytes == 4 * sc.gather_numel
        assert bf16.reduce_bytes == fp32.reduce_bytes == 4 * sc.reduce_numel  # gradients reduce in fp32
        assert bf16.num_calls == sc.num_calls
        # the CPU computes (and so gathers, auto) in fp32 whatever the plan's dtype
        cpu = build_comm_model([DeviceSpec("cpu")], True, cluster, spec, zero, "bf16")
        assert cpu.gather_bytes == 4 * sc.gather_numel
    # zero 3 gathers every block twice (forward and backward): it moves more than zero 1/2
    z1, z3 = (build_comm_model([DeviceSpec("L4")], False, cluster, spec, z, "bf16").comm_s(2) for z in (1, 3))
    assert z3 > z1


def test_slowest_link_sets_the_bandwidth():
    cluster = ClusterSpec("c", (NodeSpec("a", "dc", (DeviceSpec("L4"),)), NodeSpec("b", "dc", (DeviceSpec("L4"),))),
                          NetworkSpec(intra_node_gbps=400, inter_node_gbps=80))
    spec = get_model("tiny")
    one_node = build_comm_model([DeviceSpec("L4")], False, cluster, spec, 1, "fp32")
    two_nodes = build_comm_model([DeviceSpec("L4")], True, cluster, spec, 1, "fp32")
    assert one_node.bandwidth_bytes_per_s == pytest.approx(50e9)
    assert two_nodes.bandwidth_bytes_per_s == pytest.approx(10e9)
    assert two_nodes.reduce_bytes == 4 * spec.num_params  # every fp32 gradient, once


def test_emulated_slowdown_multiplies_every_time():
    spec = get_model("tiny")
    plain = build_device_coeffs(DeviceSpec("cpu"), spec, 64, "fp32", "none", 0.9, 2)
    slow = build_device_coeffs(DeviceSpec("cpu", slowdown=3.0), spec, 64, "fp32", "none", 0.9, 2)
    assert slow.alpha_s == pytest.approx(3 * plain.alpha_s)
    assert slow.beta_s == pytest.approx(3 * plain.beta_s)
    assert slow.optimizer_s == pytest.approx(3 * plain.optimizer_s)
    assert slow.compute_s(4, 3) == pytest.approx(3 * (slow.alpha_s + 4 * slow.beta_s))


def test_emulated_memory_sets_the_capacity_and_bf16_falls_back():
    spec = get_model("tiny")
    small = build_device_coeffs(DeviceSpec("cpu", memory_gb=2.0), spec, 64, "fp32", "none", 0.5, 2)
    assert small.capacity_bytes == pytest.approx(2.0 * 2**30 * 0.5)
    assert build_device_coeffs(DeviceSpec("T4"), spec, 64, "bf16", "none", 0.9, 2).dtype == "fp16"
    assert build_device_coeffs(DeviceSpec("A100-80GB"), spec, 64, "bf16", "none", 0.9, 2).dtype == "bf16"


def test_choices_respect_memory_and_the_compute_bound():
    d = DeviceSpec("L4")
    coeffs = DeviceCoeffs(d, "fp32", alpha_s=1.0, beta_s=0.5, optimizer_s=0.1, capacity_bytes=5 * GB,
                          memory_fn=lambda m, n, f: 1 * GB + 1 * GB * m + 8 * GB * f)
    cluster = ClusterSpec("c", (NodeSpec("n", "dc", (d,)),))
    cost = CostModel(cluster, 1, {d: coeffs}, lambda devs, multi: CommModel(1.0, 0.0, 0.0, 0.0))
    choices = cost.choices(d, global_batch=8)
    assert {c.micro_batch for c in choices} == {0, 1, 2, 4}  # m = 8 needs 9 GB > 5 GB
    # n = 1 as choices, n ≥ 2 in bands: every (m, n) with m·n ≤ 8 that fits is offered
    assert cost.offered(d, 8) == {(1, n) for n in range(1, 9)} | {(2, n) for n in range(1, 5)} | {(4, 1), (4, 2)}
    assert (4, 2) in {(b.micro_batch, b.hi) for b in cost.bands(d, 8)}
    assert coeffs.compute_s(4, 2) == pytest.approx(2 * (1.0 + 0.5 * 4))
    by_key = {(c.micro_batch, c.accum_steps): c for c in choices}
    assert by_key[(2, 1)].max_share == pytest.approx((5 - 3) / 8)
    assert by_key[(0, 0)].max_share == pytest.approx(0.5)
    assert all(c.batch <= 8 for c in choices)
    bounded = cost.choices(d, global_batch=8, max_compute_s=3.0)
    assert bounded and all(c.compute_s <= 3.0 for c in bounded)


def test_memory_fn_asks_the_model_and_extrapolates_state_only_devices():
    calls = []

    def model(m, n, f):
        if m == 0 or not 0 < f <= 1:
            raise ValueError("micro_batch 0 refused here; shard_fraction in (0, 1] like planner.core.memory")
        calls.append((m, n, f))
        return 100 + 10 * m + 1000 * f + 7 * n

    fn = cached_memory_fn(model)
    assert fn(3, 1, 0.25) == pytest.approx(100 + 30 + 250 + 7)
    assert fn(3, 2, 0.25) == pytest.approx(100 + 30 + 250 + 14)  # accumulation steps reach the model
    assert fn(0, 0, 0.0) == pytest.approx(107)  # f = 0 asked at a vanishing share; m = 0 from m = 1, 2 at n = 1
    fn(3, 1, 0.25)
    assert len(set(calls)) == len(calls)  # cached


def test_max_share_is_the_largest_fitting_fraction_of_a_piecewise_affine_peak():
    # the peak is the larger of two affine moments (like planner.core.memory's phases): a kink at f = 0.2
    evaluations = []

    def peak(m, n, f):
        evaluations.append(f)
        return max(1000 + 100 * m + 500 * f, 1050 + 100 * m + 250 * f)

    fn = cached_memory_fn(peak)
    assert fn(1, 1, 0.0) == pytest.approx(1150)
    cap = 1100 + 100 + 200  # f where 1000 + 100 + 500 f = 1400 -> f = 0.6
    assert max_share_fitting(fn, 1, cap) == pytest.approx(0.6, abs=1e-8)
    assert max_share_fitting(fn, 1, 1e9) == 1.0
    assert max_share_fitting(fn, 1, 1000) == -1.0
    # on one affine piece the secant lands on the capacity and one point above proves it
    evaluations.clear()
    affine = cached_memory_fn(lambda m, n, f: 1000 + 1000 * f)
    calls = []
    counted = lambda m, n, f: calls.append(f) or affine(m, n, f)  # noqa: E731
    assert max_share_fitting(counted, 1, 1250) == pytest.approx(0.25, abs=1e-8)
    assert len(calls) <= 6


def test_cost_model_memory_is_the_memory_model_and_max_share_is_tight():
    memory = pytest.importorskip("planner.core.memory")
    if not hasattr(memory, "estimate_memory"):
        pytest.skip("planner.core.memory.estimate_memory has not landed")
    spec = get_model("gpt2")
    c = build_device_coeffs(DeviceSpec("cpu", memory_gb=2.5), spec, 256, "fp32", "none", 0.9, 4)
    for m, f in [(1, 0.1), (2, 0.3), (4, 0.8)]:
        cfg = memory.MemoryConfig(micro_batch=m, seq=256, dtype="fp32", recompute="none", dp=4, zero=1,
                                  shard_fraction=f)
        assert c.memory_bytes(m, 1, f) == memory.estimate_memory(spec, cfg).peak_bytes
        # ZeRO-1 keeps full fp32 params and grads on every device: only the AdamW state shrinks with f
        assert memory.estimate_memory(spec, cfg).grads_bytes == 4 * spec.num_params
    for m in (1, 2, 4):
        share = max_share_fitting(c.memory_fn, m, c.capacity_bytes)
        assert 0 < share < 1
        assert c.memory_bytes(m, 1, share) <= c.capacity_bytes < c.memory_bytes(m, 1, share + 1e-6)
    # within one phase the peak is affine in the micro-batch (checked where no phase switch occurs)
    d1 = c.memory_bytes(3, 1, 0.5) - c.memory_bytes(2, 1, 0.5)
    assert c.memory_bytes(4, 1, 0.5) - c.memory_bytes(3, 1, 0.5) == pytest.approx(d1, rel=1e-6)


def test_iteration_time_is_the_slowest_device_plus_collectives():
    a, b = DeviceSpec("L4"), DeviceSpec("T4")
    mem = lambda m, n, f: 0.0  # noqa: E731
    coeffs = {a: DeviceCoeffs(a, "fp32", 0.0, 1.0, 2.0, GB, mem), b: DeviceCoeffs(b, "fp32", 0.0, 3.0, 2.0, GB, mem)}
    cluster = ClusterSpec("c", (NodeSpec("n0", "dc", (a,)), NodeSpec("n1", "dc", (b,))))
    bytes_ = {True: 2.0, False: 1.0}  # gathered and reduced bytes across nodes / on one node
    cost = CostModel(cluster, 1, coeffs, lambda devs, multi: CommModel(1.0, 0.0, bytes_[multi], bytes_[multi]))
    t, steps = cost.estimate_iteration_s([(2, 1, 0.5), (1, 1, 0.5)])
    # comm across nodes: (2−1)/2·(2 + 2) bytes / 1 B/s = 2 s; devices: 2 + 1 and 3 + 1
    assert t == pytest.approx(4 + 2)
    assert steps == pytest.approx([3 + 2, 4 + 2])
    t_alone, steps = cost.estimate_iteration_s([(3, 1, 1.0), (0, 0, 0.0)])
    assert t_alone == pytest.approx(3 + 2) and steps[1] == 0.0
    with pytest.raises(ValueError):
        cost.estimate_iteration_s([(0, 0, 0.0), (0, 0, 0.0)])
    assert math.isfinite(t)


def test_local_cpu_workers_use_the_measured_collectives(data_dir):
    from planner.core.profiles import CollectiveFit, CollectiveProfile, DeviceBench, save_device_bench
    from contracts.units import step_collectives

    fits = (CollectiveFit("all_reduce", 2e-4, 1e9, 0.99), CollectiveFit("all_gather", 1e-4, 2e9, 0.99))
    save_device_bench(DeviceBench("cpu", "test cpu", 1, (), 5.0, CollectiveProfile("cpu", "gloo", 2, fits)))
    cpu = DeviceSpec("cpu")
    cluster = ClusterSpec("c", (NodeSpec("n", "dc", (cpu, cpu)),), NetworkSpec(1.0, 1.0))
    spec = get_model("tiny")
    comm = build_comm_model([cpu], False, cluster, spec, 3, "fp32")
    assert "measured gloo" in comm.source
    sc = step_collectives(spec, 3)
    # k = 2 reproduces the fits: an all-gather of B bytes takes 1e-4 + B/2e9 s; a reduce-scatter is half
    # an all-reduce (2e-4 + B/1e9): its bandwidth term B/2e9; each call pays the all-gather's latency
    expected = 4 * sc.gather_numel / 2e9 + 4 * sc.reduce_numel / 2e9 + sc.num_calls * 1e-4
    assert comm.comm_s(2) == pytest.approx(expected)
    # across nodes the cluster file's figure applies, measured or not
    assert "cluster file" in build_comm_model([cpu], True, cluster, spec, 3, "fp32").source
