"""The pages' heavy library calls that are more than one call, as module-level functions (importable
without running a page): ui/background.py runs some in a child process, which imports them by name."""
from __future__ import annotations

from contracts.plan import Plan
from planner.core.profiles import split_profile_key
from planner.schedule.simulate import simulate_schedule
from planner.schedule.trace import DEMO_CLUSTERS, generate_trace, mixed_cluster

HOUR_S = 3600.0
# GPUMix's policy first, then the baselines a practitioner would use, strongest kinds first
POLICIES = ("gpumix", "srtf", "las", "gavel", "sjf", "fifo-backfill-sized", "frenzy", "fifo-backfill", "fifo")
BASELINES = POLICIES[1:]


def simulate_policies(seed: int, num_gpus: int, num_jobs: int, load: float) -> dict:
    """Every policy on one generated trace (the same jobs, the same seeded prediction errors):
    {policy: {"summary": ..., "rows": Gantt rows in hours}}."""
    cluster = mixed_cluster(DEMO_CLUSTERS[num_gpus])
    jobs = generate_trace(seed, num_jobs, cluster, load=load)
    types = [d.type for _, d in cluster.devices()]
    out = {}
    for policy in POLICIES:
        r = simulate_schedule(jobs, cluster, policy)
        out[policy] = {"summary": r.to_dict(jobs=False),
                       "rows": [{"device": f"{i:04d} {types[i]}", "job": x.job.job_id, "start": x.start_s / HOUR_S,
                                 "end": x.end_s / HOUR_S} for x in r.records if x.status == "done"
                                for i in x.devices]}
    return out


def profile_kinds(plan: Plan, kinds: list[str], progress) -> None:
    """Measure the plan's devices of these kinds as the run will use them, through the profiler's one
    path (what `profiler profile --plan` runs too): profiler.run_profile.profile_devices, a CPU kind
    with every CPU device of the plan, the window the run's CPU devices share; then a pipeline plan of
    CPU devices on this machine has its stages run and profiled (profiler.stage_run.profile_plan_stages),
    so the plan computed again prices its stages from them."""
    from profiler.run_profile import plan_devices, profile_devices  # torch: only when asked
    from profiler.stage_run import profile_plan_stages

    cpu = any(split_profile_key(k)[0] == "cpu" for k in kinds)
    devices = [d for d in plan_devices(plan) if d.profile_key in kinds or (cpu and d.type == "cpu")]
    profile_devices(plan.model, plan.seq, plan.dtype, devices, recompute=plan.recompute, progress=progress)
    try:
        profile_plan_stages(plan, progress=progress)
    except RuntimeError as e:  # the stages' run failed: said on the page (the kinds' profiles are kept)
        raise ValueError(f"the device kinds were profiled and saved, but the plan's stages' run failed: {e}") from e
