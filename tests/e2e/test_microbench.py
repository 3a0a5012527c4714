"""Micro-benchmarks on this machine's CPU, and a real 2-rank gloo collective benchmark."""
import json
import os
import subprocess
import sys

import pytest
import torch

from planner.core.profiles import get_collective_profile, get_device_bench, peak_tflops
from profiler.collectives import KIB, benchmark_collectives, fit_collective
from profiler.microbench import matmul_tflops, memory_gbps, run_bench
from profiler.step_profile import executor_threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.slow
def test_two_rank_gloo_collectives_run_fit_and_reach_the_store():
    # the largest size must be bandwidth-bound: gloo's latency on a busy 2-core machine is ~1 ms,
    # about what 2 MiB takes, so 8 MiB (~7 ms at ~1.2 GB/s)
    sizes = (KIB, 16 * KIB, 256 * KIB, 8192 * KIB)
    bench = run_bench("cpu", dtypes=("fp32",), sizes=(64,), copy_bytes=8 * 2**20, collective_sizes_bytes=sizes)
    prof = bench.collectives
    assert prof.backend == "gloo" and prof.world_size == 2 and prof.device_type == "cpu"
    assert [f.op for f in prof.fits] == ["all_reduce", "all_gather", "broadcast"]
    for f in prof.fits:
        assert f.sizes_bytes == sizes and len(f.times_s) == 4 and all(t > 0 for t in f.times_s)
        assert f.latency_s >= 0 and f.bandwidth_bytes_per_s > 0
        # moving 8 MiB takes longer than moving 1 KiB, even on a noisy machine
        assert f.times_s[-1] > f.times_s[0]
    assert get_collective_profile("cpu") == prof  # saved where the planner reads it
    with pytest.raises(ValueError, match="at least 2 ranks"):
        benchmark_collectives(1, sizes)
    with pytest.raises(ValueError, match="unknown collectives"):
        benchmark_collectives(2, sizes, ops=("all_to_all",))


def test_bench_goes_to_the_store_and_becomes_the_cpu_peak():
    bench = run_bench("cpu", dtypes=("fp32",), sizes=(64, 128), copy_bytes=16 * 2**20, collective_sizes_bytes=None)
    assert bench.device_type == "cpu" and bench.num_threads == 1 and bench.collectives is None
    assert [(m.dtype, m.size) for m in bench.matmul] == [("fp32", 64), ("fp32", 128)]
    stored = get_device_bench("cpu")
    assert stored == bench
    assert get_collective_profile("cpu") is None
    assert peak_tflops("cpu", "fp32") == pytest.approx(bench.best_tflops("fp32"))


def test_bench_cli_json(data_dir):
    r = subprocess.run([sys.executable, "-m", "profiler", "bench", "--json", "--quick", "--no-collectives"],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["measured"] is True and doc["memory_gbps"] > 0
    assert set(doc["matmul_tflops"]) == {"fp32", "bf16"} and doc["matmul_tflops"]["fp32"] > 0
    stored = json.loads(json.dumps(get_device_bench("cpu").to_dict()))  # tuples -> lists, as in the output
    assert stored == {k: v for k, v in doc.items() if k not in ("measured", "matmul_tflops", "collective_gbps")}
    r = subprocess.run([sys.executable, "-m", "profiler", "bench", "--world-size", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 2 and "at least 2 ranks" in r.stderr and "Traceback" not in r.stderr
