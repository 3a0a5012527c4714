"""A pipeline stage across two emulated nodes with two CPU-quota kinds (`executor launch --emulate-wan`, cgroups).

Stage 0 (embedding and layer 0 of `small`) runs on node-a at half a core; stage 1 (layers 1-3 and the head) on
two ranks: node-a at a third of a core with 2 rows of every micro-batch, node-b at half a core with 3 rows. The
plan is profiled as `profiler profile --plan` does: its devices as the run trains them
(profiler/run_profile.profile_devices: all at once, each under its quota, then the collectives between them),
then its stages as they run (profiler/stage_run.measure_stages: a short run of the plan on its emulated link,
one stage profile per stage and replica kind). planner/geo/emulated.py predicts the iteration from those
profiles (each replica's forward and backward from its stage profile, the stage at its slowest replica, the
boundary's pieces on their own paths, the stage's syncs as rings across both nodes priced from the
collectives). A separate run of the plan, after the profiling, is measured: its median step after the
warm-up is within 15 % of that prediction, and its losses are one rank's. Sized for a 2-core machine: 3
ranks, 1.33 cores of quota in all."""
from __future__ import annotations

import json
import os
import statistics

import pytest

from contracts.cluster import ClusterSpec
from contracts.paths import ENV_DATA_DIR
from contracts.plan import Assignment, PipelineSpec, PipelineStage, Plan, WanLink, link_key
from executor import wan
from executor.launch import launch_run
from executor.store import read_metrics
from models.optim import OptimConfig
from profiler import cgroups

_WHY = cgroups.unavailable_reason() or wan.unavailable_reason()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"emulated nodes with CPU quotas unavailable: {_WHY}")

MODEL, SEQ, SEED = "small", 256, 5
SHARES = (0.5, 1 / 3, 0.5)  # device 0 node-a (stage 0), device 1 node-a and device 2 node-b (stage 1)
STAGE1_ROWS = (2, 3)  # a third of a core takes 2 rows, half a core 3: about the same time each
MICRO_BATCH, NUM_MICROBATCHES = sum(STAGE1_ROWS), 10
STEPS, WARMUP_STEPS, REFERENCE_STEPS = 6, 2, 2
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, max_grad_norm=0.5, decay_steps=STEPS)
LINK_GBPS = 1.0
PROFILE_SIZES = (1, 2, 3, 5)  # the rows a rank of the plan computes at once (2, 3 and 5), and 1
PROFILE_REPEATS = 3
STAGE_STEPS = 8  # the stages' run of the profile: 2 warm-up steps, 6 timed
TOLERANCE = 0.15


def span_plan() -> Plan:
    """The two-stage plan by hand: stage 1's replicas on node-a and node-b, of two kinds."""
    cluster = ClusterSpec.from_dict({"name": "span", "nodes": [
        {"name": "node-a", "datacenter": "node-a",
         "gpus": [{"type": "cpu", "cpu_share": SHARES[0]}, {"type": "cpu", "cpu_share": SHARES[1]}]},
        {"name": "node-b", "datacenter": "node-b", "gpus": [{"type": "cpu", "cpu_share": SHARES[2]}]}]})
    rows = (MICRO_BATCH, *STAGE1_ROWS)
    shards = (1.0, STAGE1_ROWS[0] / MICRO_BATCH, STAGE1_ROWS[1] / MICRO_BATCH)  # ZeRO-1 inside each stage
    asg = tuple(Assignment(i, node.name, "cpu", rows[i], NUM_MICROBATCHES, rows[i] * NUM_MICROBATCHES, shards[i],
                           0, 0.0, dev.emulated, dev.slowdown, dev.memory_gb)
                for i, (node, dev) in enumerate(cluster.devices()))
    stages = (PipelineStage(0, 1, (0,), (MICRO_BATCH,), "node-a"),
              PipelineStage(1, 3, (1, 2), STAGE1_ROWS, "node-a+node-b"))
    return Plan(cluster, MODEL, MICRO_BATCH * NUM_MICROBATCHES, SEQ, "fp32", "none", asg, 0.0, 0.0,
                pipeline=PipelineSpec("1f1b", MICRO_BATCH, NUM_MICROBATCHES, stages),
                wan=(WanLink("node-a", "node-b", LINK_GBPS, 0.0),), connections={link_key("node-a", "node-b"): 1})


def one_rank_plan() -> Plan:
    """The same training on one plain CPU rank: micro-batches of the same rows, accumulated."""
    cluster = ClusterSpec.from_dict({"name": "one", "nodes": [{"name": "localhost", "gpus": {"cpu": 1}}]})
    asg = (Assignment(0, "localhost", "cpu", MICRO_BATCH, NUM_MICROBATCHES, MICRO_BATCH * NUM_MICROBATCHES, 1.0,
                      0, 0.0),)
    return Plan(cluster, MODEL, MICRO_BATCH * NUM_MICROBATCHES, SEQ, "fp32", "none", asg, 0.0, 0.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Profile the plan's devices, predict the plan from those profiles, run it, then the 1-rank reference."""
    from planner.geo.emulated import build_plan_job, simulate_plan
    from planner.geo.emulated import model_spec
    from profiler.run_profile import plan_devices, profile_devices
    from profiler.stage_run import measure_stages

    plan = span_plan()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DATA_DIR, str(tmp_path_factory.mktemp("data")))
        root = tmp_path_factory.mktemp("runs")
        measured = profile_devices(MODEL, SEQ, "fp32", plan_devices(plan), micro_batches=PROFILE_SIZES,
                                   repeats=PROFILE_REPEATS)
        stages = measure_stages(plan, model_spec(plan), steps=STAGE_STEPS, links=True)
        predicted, job = simulate_plan(plan), build_plan_job(plan)[0]
        pipe, one = str(root / "pipe"), str(root / "one")
        status = launch_run(plan, STEPS, pipe, seed=SEED, optim=OPTIM, emulate_wan=True)
        ref = launch_run(one_rank_plan(), REFERENCE_STEPS, one, seed=SEED, optim=OPTIM)
        yield {"plan": plan, "profiles": measured, "stages": stages, "predicted": predicted, "job": job,
               "pipe": (pipe, status), "one": (one, ref)}


def _op_seconds(rows) -> dict[tuple[int, str], float]:
    """Seconds per (stage, op) of timeline rows, summed over the step's micro-batches."""
    out: dict[tuple[int, str], float] = {}
    for r in rows:
        out[(r["stage"], r["op"])] = out.get((r["stage"], r["op"]), 0.0) + r["end_s"] - r["start_s"]
    return out


def test_the_plan_priced_from_its_devices_profiles_matches_its_run(runs):
    pipe, status = runs["pipe"]
    m = read_metrics(pipe)
    assert status == "done", m["reason"]
    assert runs["profiles"].collectives_key is not None  # the rings are priced from the ranks' own collectives
    job = runs["job"]  # one pipeline: stage 1 at its slowest replica, its syncs a ring across both nodes
    assert job.num_pipelines == 1 and "node-a" in job.stages[1].label and "node-b" in job.stages[1].label
    assert job.stages[1].allreduce_s > 0 and job.stages[0].allreduce_s == 0
    # one stage profile for stage 0 and one per kind of stage 1's replicas, each pricing its stage
    assert sorted((s.first_layer, s.device_type, s.rows) for s in runs["stages"]) == sorted(
        (st.first_layer, runs["plan"].cluster.devices()[i][1].profile_key, r)
        for st in runs["plan"].pipeline.stages for i, r in zip(st.devices, st.rows))
    assert job.stages[1].forward_s == max(s.forward_s for s in runs["stages"] if s.first_layer > 0)
    steps = [s["step_s"] for s in m["steps"]]
    assert len(steps) == STEPS
    measured, predicted = statistics.median(steps[WARMUP_STEPS:]), runs["predicted"].iteration_s
    # where an error comes from: the last step's ops per rank beside the simulated stage (its slowest replica)
    with open(os.path.join(pipe, "timeline.json"), encoding="utf-8") as fh:
        timeline = json.load(fh)
    sim = _op_seconds(runs["predicted"].ops)
    for r in timeline["ranks"]:
        ops = _op_seconds({"stage": r["stage"], **o} for o in r["ops"])
        print(f"rank {r['rank']} stage {r['stage']} ({r['datacenter']}): " + ", ".join(
            f"{op} {ops[(st, op)]:.3f} s (simulated {sim.get((st, op), 0.0):.3f})" for st, op in sorted(ops)))
    print(f"median step {measured:.3f} s (steps {', '.join(f'{s:.3f}' for s in steps)}), predicted {predicted:.3f} s, "
          f"error {measured / predicted - 1:+.1%}; profiles: " + "; ".join(
              f"{p.device_type} α {p.alpha_s * 1e3:.1f} ms β {p.beta_s * 1e3:.1f} ms/sample"
              for p in runs["profiles"].profiles) + "; stages: " + "; ".join(
              f"L{s.first_layer}+{s.num_layers} {s.device_type} r{s.rows} fwd {s.forward_s * 1e3:.1f} ms "
              f"bwd {s.backward_s * 1e3:.1f} ms (their run's step {s.run_step_s:.3f} s)" for s in runs["stages"]))
    assert {(r["stage"], r["datacenter"]) for r in timeline["ranks"]} == {(0, "node-a"), (1, "node-a+node-b")}
    assert abs(measured / predicted - 1) <= TOLERANCE, (measured, predicted)


def test_the_spanning_stage_trains_exactly_like_one_rank(runs):
    (pipe, status), (one, ref) = runs["pipe"], runs["one"]
    assert status == ref == "done", (read_metrics(pipe)["reason"], read_metrics(one)["reason"])
    a = [s["loss"] for s in read_metrics(one)["steps"]]
    b = [s["loss"] for s in read_metrics(pipe)["steps"]][:REFERENCE_STEPS]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"1-rank losses {a}, pipeline {b}: largest relative difference {rel:.2e}")
    assert len(a) == len(b) == REFERENCE_STEPS and a[-1] < a[0]
    assert rel <= 1e-5, (a, b)
