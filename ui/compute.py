"""The pages' heavy library calls that are more than one call, as module-level functions:
ui/background.py runs them in a child process, which imports them by name."""
from __future__ import annotations

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
