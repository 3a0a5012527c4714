"""The collectives of CPU ranks priced as a step issues them: a call after compute, and an async one
beside compute (planner/costmodel/training.py step_issue_figures, profiler/run_profile.py's probe)."""
import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.specs import get_model
from contracts.units import step_collectives
from planner.core.profiles import CollectiveFit, CollectiveProfile, save_collective_profile
from planner.costmodel.collectives import ASYNC_BESIDE_COMPUTE, BESIDE_COMPUTE, exposed_share
from planner.costmodel.training import STATS_CALLS, CommModel, StepConfig, build_comm_model, step_overlap
from profiler.run_profile import PROBE_LARGE_BYTES, PROBE_SMALL_BYTES, _probe_fits

BENCH_FITS = (CollectiveFit("all_reduce", 2e-4, 1e9, 0.99), CollectiveFit("all_gather", 1e-4, 2e9, 0.99))


def test_exposed_share_is_what_the_async_call_added_to_compute():
    assert exposed_share(5.0, 4.0, 8.0) == pytest.approx(0.75)  # compute 5, gather 4, both 8: 3 of 4 not hidden
    assert exposed_share(5.0, 4.0, 5.0) == 0.0  # hidden entirely
    assert exposed_share(5.0, 4.0, 12.0) == 1.0  # slower than one after the other: capped
    assert exposed_share(5.0, 4.0, 4.0) == 0.0  # faster than compute alone (noise): nothing exposed
    with pytest.raises(ValueError, match="alone"):
        exposed_share(5.0, 0.0, 5.0)


def test_an_exposed_share_moves_that_much_of_the_hidden_collectives_into_the_exposed():
    kw = dict(bandwidth_bytes_per_s=1e9, hop_latency_s=0.0, gather_bytes=4e6, reduce_bytes=2e6, num_calls=6,
              call_latency_s=1e-3, exposed_gather_bytes=1e6, exposed_reduce_bytes=1e6, exposed_calls=2)
    # k = 2: total = 1/2·(4e6 + 2e6)/1e9 + 6 ms = 9 ms; exposed = 1/2·2e6/1e9 + 2 ms = 3 ms; hidden 6 ms
    base = CommModel(**kw).step(2)
    assert (base.exposed_s, base.hidden_s) == pytest.approx((3e-3, 6e-3))
    half = CommModel(**kw, overlap_exposed_share=0.5).step(2)
    assert (half.exposed_s, half.hidden_s) == pytest.approx((6e-3, 3e-3))
    serial = CommModel(**kw, overlap_exposed_share=1.0).step(2)
    assert (serial.exposed_s, serial.hidden_s) == pytest.approx((9e-3, 0.0))
    # compute 10 ms: hidden entirely 3 + 10; half of it not hidden 6 + 10; nothing hidden 9 + 10
    assert [s.end_s(10e-3) for s in (base, half, serial)] == pytest.approx([13e-3, 16e-3, 19e-3])
    # the statistics' all-reduce: one more exposed latency
    stats = CommModel(**kw, stats_calls=1).step(2)
    assert (stats.exposed_s, stats.hidden_s) == pytest.approx((4e-3, 6e-3))


def test_probe_fits_by_hand():
    fit, beside = _probe_fits(small_s=1e-3, large_s=3e-3, compute_s=5e-3, both_s=6.5e-3)
    assert fit.op == BESIDE_COMPUTE and beside.op == ASYNC_BESIDE_COMPUTE
    # the line through the two calls: 2 ms for the bytes between them, its value at 0 bytes the latency
    bw = (PROBE_LARGE_BYTES - PROBE_SMALL_BYTES) / 2e-3
    assert fit.bandwidth_bytes_per_s == pytest.approx(bw)
    assert fit.latency_s == pytest.approx(1e-3 - PROBE_SMALL_BYTES / bw)
    assert fit.time_s(PROBE_SMALL_BYTES) == pytest.approx(1e-3) and fit.time_s(PROBE_LARGE_BYTES) == pytest.approx(3e-3)
    assert beside.times_s == (5e-3, 3e-3, 6.5e-3)
    assert exposed_share(*beside.times_s) == pytest.approx(0.5)
    # a large call no slower than the small one (noise): a finite bandwidth, its whole time
    noisy, _ = _probe_fits(small_s=2e-3, large_s=1e-3, compute_s=5e-3, both_s=6e-3)
    assert noisy.bandwidth_bytes_per_s == pytest.approx(PROBE_LARGE_BYTES / 1e-3)


def _two_cpus():
    cpu = DeviceSpec("cpu")
    return cpu, ClusterSpec("c", (NodeSpec("n", "dc", (cpu, cpu)),), NetworkSpec(1.0, 1.0))


def test_measured_step_issue_prices_every_call_at_its_latency_and_the_overlap_it_achieved(data_dir):
    probe = _probe_fits(small_s=2e-3, large_s=4e-3, compute_s=5e-3, both_s=8e-3)  # share 0.75
    save_collective_profile(CollectiveProfile("cpu", "gloo", 2, BENCH_FITS + probe))
    cpu, cluster = _two_cpus()
    spec = get_model("tiny")
    comm = build_comm_model([cpu], False, cluster, spec, 3, "fp32")
    lat = probe[0].latency_s
    assert comm.call_latency_s == lat and f"{lat * 1e3:.2f} ms a call" in comm.source and "75%" in comm.source
    sc = step_collectives(spec, 3)
    # the bench's bandwidths, the probe's latency for every call the step issues, the statistics' too
    ring = 4 * sc.gather_numel / 2e9 + 4 * sc.reduce_numel / 2e9
    assert comm.comm_s(2) == pytest.approx(ring + (sc.num_calls + STATS_CALLS) * lat)
    step_cfg = StepConfig()  # what build_comm_model prices without a step: prefetch 1, reduces waited as issued
    g, r, calls = step_overlap(spec, 3, step_cfg.prefetch, step_cfg.reduce_in_flight)
    exposed = 4 * g / 2e9 + 4 * r / 2e9 + (calls + STATS_CALLS) * lat
    hidden = comm.comm_s(2) - exposed
    step = comm.step(2)
    assert step.exposed_s == pytest.approx(exposed + 0.75 * hidden)
    assert step.hidden_s == pytest.approx(0.25 * hidden)
    # calls issued back to back (a pipeline stage's syncs: planner/geo/emulated.py) keep the bench's fit
    back_to_back = build_comm_model([cpu], False, cluster, spec, 3, "fp32", interleaved=False)
    assert back_to_back.call_latency_s == BENCH_FITS[1].latency_s != lat  # the all-gather fit
    assert back_to_back.overlap_exposed_share == 0.0 and back_to_back.stats_calls == 0


def test_a_profile_without_the_probe_prices_as_before(data_dir):
    save_collective_profile(CollectiveProfile("cpu", "gloo", 2, BENCH_FITS))
    cpu, cluster = _two_cpus()
    spec = get_model("tiny")
    comm = build_comm_model([cpu], False, cluster, spec, 3, "fp32")
    assert "a call" not in comm.source and comm.overlap_exposed_share == 0.0 and comm.stats_calls == 0
    sc = step_collectives(spec, 3)
    assert comm.comm_s(2) == pytest.approx(4 * sc.gather_numel / 2e9 + 4 * sc.reduce_numel / 2e9 + sc.num_calls * 1e-4)


def test_probe_chunk_is_the_compute_between_two_waits_of_the_profiled_step():
    from planner.core.profiles import StepProfile
    from profiler.run_profile import PROBE_CHUNK_BOUNDS_S, PROBE_CHUNK_S, probe_chunk_s

    def prof(kind, alpha, beta):
        return StepProfile(kind, "tiny", 128, "fp32", "none", alpha, beta, 0.0, 1.0, True, "test", 1.0,
                           micro_batches=(1, 2, 4, 8, 16, 32))

    # tiny: 4 units, a forward and a backward pass each; t(4) = 1 ms + 4 × 2.5 ms = 11 ms over 8 passes
    assert probe_chunk_s("tiny", [prof("cpu", 1e-3, 2.5e-3)]) == pytest.approx(11e-3 / 8)
    # the least over the kinds; within the bounds; the default without a profile
    assert probe_chunk_s("tiny", [prof("cpu", 1e-3, 2.5e-3), prof("cpu@share0.5", 2e-3, 5e-3)]) == pytest.approx(11e-3 / 8)
    assert probe_chunk_s("tiny", [prof("cpu", 10.0, 10.0)]) == PROBE_CHUNK_BOUNDS_S[1]
    assert probe_chunk_s("tiny", [prof("cpu", 0.0, 1e-9)]) == PROBE_CHUNK_BOUNDS_S[0]
    assert probe_chunk_s("tiny", []) == PROBE_CHUNK_S
