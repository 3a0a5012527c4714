"""Every option the scheduler offers is something GPUMix can run.

Property test over random jobs and pools: each offered option is a Plan (`option_plan`) whose
predictions are the option's own, within memory on every device, and the hetero planner on the
option's devices at the option's stage finds a plan too (at least as fast when it proves
optimality). A sample of options on emulated CPU devices (memory limits) is launched for real and
trains.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from executor.launch import launch_run
from executor.store import read_metrics
from contracts.catalog import CATALOG, CPU_TYPE
from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.jobs import JobSpec
from planner.core.memory import MemoryConfig, estimate_memory
from contracts.specs import get_model, with_max_seq
from planner.hetero.solve import solve_plan
from planner.schedule.options import cluster_pools, estimate_options, option_plan, pool_cluster

GPU_TYPES = sorted(t for t in CATALOG if t != CPU_TYPE)
MODELS = ("small", "gpt2", "gpt2-medium", "gpt2-xl", "tinyllama-1.1b", "llama2-7b", "llama2-13b")


def random_pool_cluster(rng: random.Random) -> ClusterSpec:
    nodes = []
    for i in range(rng.randint(1, 4)):
        t = rng.choice(GPU_TYPES)
        nodes.append({"name": f"n{i}", "gpus": {t: rng.choice([1, 2, 4, 8])}})
    return ClusterSpec.from_dict({"name": "random", "nodes": nodes,
                                  "network": {"intra_node_gbps": rng.choice([64, 300, 2400]),
                                              "inter_node_gbps": rng.choice([10, 100, 400])}})


def test_every_offered_option_is_a_plan_the_planner_accepts():
    rng = random.Random(1201)
    checked = 0
    for trial in range(40):
        cluster = random_pool_cluster(rng)
        job = JobSpec(f"j{trial}", rng.choice(MODELS), rng.choice([8, 16, 24, 32, 64, 96, 128]),
                      rng.choice([256, 512, 1024, 2048]), 10, 0.0)
        dtype = rng.choice(["bf16", "fp16", "fp32"])
        options = estimate_options(job, cluster, dtype=dtype)
        for opt in rng.sample(options, min(2, len(options))):
            plan = option_plan(job, opt, dtype)
            assert plan.zero == opt.zero and plan.recompute == opt.recompute
            assert sum(a.batch for a in plan.assignments) == job.global_batch
            assert plan.predicted_iteration_s == pytest.approx(opt.iteration_s, rel=1e-12)
            cap = opt.pool.memory_bytes * opt.headroom
            assert all(a.predicted_memory_bytes <= cap for a in plan.assignments), (job, opt)
            pool = next(p for p in cluster_pools(cluster) if p.device == opt.pool)
            sub = pool_cluster(pool, opt.num_gpus)
            result = solve_plan(sub, job.model, job.global_batch, seq=job.seq, dtype=dtype, recompute=opt.recompute,
                                zero=opt.zero, time_limit_s=30.0)
            assert result.plan is not None, (job, opt, result.reason)
            if result.status == "optimal":
                assert result.plan.predicted_iteration_s <= opt.iteration_s * (1 + 1e-6), (job, opt)
            checked += 1
        if checked >= 24:
            break
    assert checked >= 24


def test_an_option_needs_no_runtime_feature_that_does_not_exist():
    """Only the runtime's stages and recompute modes; every device's batch is m·n exactly."""
    cluster = ClusterSpec.from_dict({"name": "c", "nodes": [{"name": "a", "gpus": {"T4": 8}},
                                                             {"name": "b", "gpus": {"A100-80GB": 4}}]})
    job = JobSpec("j", "gpt2-xl", 42, 1024, 10, 0.0)
    options = estimate_options(job, cluster)
    assert options
    for opt in options:
        assert opt.zero in (1, 2, 3) and opt.recompute in ("none", "full")
        assert sum(m * n for m, n, _ in opt.per_device) == 42 and len(opt.per_device) == opt.num_gpus


# ---- launched for real on emulated CPU devices ------------------------------------------------

SEQ = 32


def _local(plan):
    """The option's plan on this machine's node (the launch checks that its devices exist here)."""
    devices = tuple(d for n in plan.cluster.nodes for d in n.devices)
    cluster = ClusterSpec("local", (NodeSpec("localhost", "local", devices),), NetworkSpec())
    return replace(plan, cluster=cluster, assignments=tuple(replace(a, node="localhost") for a in plan.assignments))


@pytest.mark.slow
def test_a_sample_of_options_on_emulated_cpu_devices_launches_and_trains(data_dir, tmp_path):
    spec = with_max_seq(get_model("tiny"), SEQ)
    whole = estimate_memory(spec, MemoryConfig(micro_batch=2, seq=SEQ, dtype="fp32", dp=1, zero=1,
                                               device_type="cpu")).peak_bytes
    # an emulated device that holds about 70 % of what one rank alone would need: one is never enough
    mem_gb = 0.7 * whole / 0.9 / 1e9
    cluster = ClusterSpec("emulated", (NodeSpec("localhost", "local", (DeviceSpec("cpu", memory_gb=mem_gb),) * 2),),
                          NetworkSpec())
    job = JobSpec("j", "tiny", 4, SEQ, 2, 0.0)
    options = estimate_options(job, cluster, dtype="fp32")
    assert options and all(o.num_gpus == 2 for o in options)
    for i, opt in enumerate(options[:2]):
        plan = _local(option_plan(job, opt, "fp32"))
        run_dir = str(tmp_path / f"run{i}")
        assert launch_run(plan, 2, run_dir, seed=1) == "done", read_metrics(run_dir)["reason"]
        steps = read_metrics(run_dir)["steps"]
        assert len(steps) == 2 and all(s["loss"] > 0 for s in steps)
