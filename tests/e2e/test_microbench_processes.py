"""Microbenchmarks that start processes: `python -m profiler bench --json` and two gloo ranks whose
collectives are fitted and stored. The rest: tests/unit/test_microbench.py."""
import json
import os
import subprocess
import sys

import pytest

from planner.core.profiles import get_collective_profile, get_device_bench
from profiler.collectives import KIB, benchmark_collectives
from profiler.microbench import run_bench
from testkit import ROOT


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
