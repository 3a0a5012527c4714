"""Micro-benchmarks on this machine's CPU, and the collective fit (the
bench CLI and a real 2-rank gloo benchmark: tests/e2e/test_microbench_processes.py)."""
import pytest
import torch

from planner.core.profiles import get_collective_profile, get_device_bench, peak_tflops
from profiler.collectives import KIB, fit_collective
from profiler.microbench import matmul_tflops, memory_gbps, run_bench
from profiler.step_profile import executor_threads


def test_matmul_rate_grows_with_work_and_memory_bandwidth_is_positive():
    cpu = torch.device("cpu")
    with executor_threads(cpu):  # one thread, as run_bench: OpenMP barriers on a loaded machine are chaos
        small, big = matmul_tflops(16, "fp32", cpu, repeats=15), matmul_tflops(256, "fp32", cpu, repeats=15)
    assert 0 < small and 0 < big < 100  # one core, far below any GPU
    assert big > small  # a 16×16 matmul is overhead-bound: the FLOP rate must rise with size
    assert memory_gbps(cpu, size_bytes=32 * 2**20) > 0.1


def test_fit_collective_recovers_latency_and_bandwidth():
    sizes = [KIB * 4**i for i in range(8)]
    times = [50e-6 + s / 2e9 for s in sizes]
    fit = fit_collective("all_reduce", sizes, times)
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6) and fit.r2 == pytest.approx(1.0)
    with pytest.raises(ValueError, match="cannot fit a bandwidth"):
        fit_collective("broadcast", sizes[:3], [1e-3, 1e-3, 1e-3])


def test_bench_goes_to_the_store_and_becomes_the_cpu_peak():
    bench = run_bench("cpu", dtypes=("fp32",), sizes=(64, 128), copy_bytes=16 * 2**20, collective_sizes_bytes=None)
    assert bench.device_type == "cpu" and bench.num_threads == 1 and bench.collectives is None
    assert [(m.dtype, m.size) for m in bench.matmul] == [("fp32", 64), ("fp32", 128)]
    stored = get_device_bench("cpu")
    assert stored == bench
    assert get_collective_profile("cpu") is None
    assert peak_tflops("cpu", "fp32") == pytest.approx(bench.best_tflops("fp32"))


