"""The Geo page's measured runs: a pipeline run's timeline beside the plan's simulated one.

Two kinds of run folder:
- written the executor's way (plan.json, metrics through executor.store's MetricsStore, timeline.json,
  prefill_rank<r>.json) with HAND-WRITTEN timeline and simulated numbers, so the expected figures
  are exact (+20.0 %): the page's rendering logic, bad input, no runs; its prefill summary is real
  (a PrefillWorker run);
- a REAL run (`test_a_real_pipeline_runs_timeline_beside_its_simulation`): 2 stages of tiny launched
  with torchrun on this machine (2 steps, ~15-40 s here), prefill on stage 1, the plan's simulated
  ops from planner/geo/emulated.py; the page's per-stage figures recomputed from the files."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics

import pytest
import torch
from streamlit.testing.v1 import AppTest

from executor.prefill import PrefillWorker
from executor.store import MetricsStore
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.paths import runs_dir
from contracts.plan import Assignment, PipelineSpec, PipelineStage, Plan, WanLink
from ui.charts import drawn_figures, gantt_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "ui", "geo.py")
STEP_S = [0.9, 0.52, 0.5, 0.55]  # measured step times: the first is the warm-up
PREDICTED_S = 0.48


def pipeline_plan() -> Plan:
    """tiny (2 layers): stage 0 = layer 0 on 2 replicas in dc-a, stage 1 = layer 1 on 1 in dc-b."""
    cluster = ClusterSpec("geo", (NodeSpec("dc-a", "dc-a", (DeviceSpec("cpu"), DeviceSpec("cpu"))),
                                  NodeSpec("dc-b", "dc-b", (DeviceSpec("cpu"),))))
    asg = (Assignment(0, "dc-a", "cpu", 1, 2, 2, 0.5, 10**7, PREDICTED_S),
           Assignment(1, "dc-a", "cpu", 1, 2, 2, 0.5, 10**7, PREDICTED_S),
           Assignment(2, "dc-b", "cpu", 2, 2, 4, 1.0, 10**7, PREDICTED_S))
    sim = []
    for mb in range(2):  # simulated: stage 0 forward 0.05, backward 0.1; stage 1 forward 0.04, backward 0.08
        for r in range(2):
            sim.append({"stage": 0, "replica": r, "op": "forward", "mb": mb, "start_s": 0.05 * mb, "end_s": 0.05 * mb + 0.05})
            sim.append({"stage": 0, "replica": r, "op": "backward", "mb": mb, "start_s": 0.3 + 0.1 * mb,
                        "end_s": 0.4 + 0.1 * mb})
        sim.append({"stage": 1, "replica": 0, "op": "forward", "mb": mb, "start_s": 0.15 + 0.04 * mb,
                    "end_s": 0.19 + 0.04 * mb})
        sim.append({"stage": 1, "replica": 0, "op": "backward", "mb": mb, "start_s": 0.23 + 0.08 * mb,
                    "end_s": 0.31 + 0.08 * mb})
    pipe = PipelineSpec("1f1b", 2, 2, (PipelineStage(0, 1, (0, 1), (1, 1), "dc-a"), PipelineStage(1, 1, (2,), (2,), "dc-b")),
                        tuple(sim))
    return Plan(cluster, "tiny", 4, 64, "fp32", "none", asg, PREDICTED_S, 4 / PREDICTED_S, pipeline=pipe,
                wan=(WanLink("dc-a", "dc-b", 0.05, 20.0),), connections={"dc-a|dc-b": 2})


def measured_timeline() -> dict:
    """Rank 0, 1: stage 0 (forward 0.06, backward 0.12 per micro-batch); rank 2: stage 1 (0.05, 0.09),
    with receives, sends, a gradient sync, the optimizer and prefill in its wait."""
    def ops(f: float, b: float, offset: float, prefill: bool) -> list[dict]:
        out = []
        for mb in range(2):
            t = offset + mb * 0.3
            out += [{"op": "recv_fwd", "mb": mb, "start_s": t, "end_s": t + 0.02},
                    {"op": "forward", "mb": mb, "start_s": t + 0.02, "end_s": t + 0.02 + f},
                    {"op": "send_fwd", "mb": mb, "start_s": t + 0.02 + f, "end_s": t + 0.03 + f},
                    {"op": "backward", "mb": mb, "start_s": t + 0.1, "end_s": t + 0.1 + b}]
        if prefill:
            out.append({"op": "prefill", "mb": -1, "start_s": offset + 0.25, "end_s": offset + 0.254})
        out += [{"op": "grad_sync", "mb": -1, "start_s": 0.6, "end_s": 0.62},
                {"op": "optimizer", "mb": -1, "start_s": 0.62, "end_s": 0.64}]
        return out

    return {"step": 2, "ranks": [
        {"rank": 0, "stage": 0, "dp_index": 0, "device_index": 0, "datacenter": "dc-a", "ops": ops(0.06, 0.12, 0.0, False)},
        {"rank": 1, "stage": 0, "dp_index": 1, "device_index": 1, "datacenter": "dc-a", "ops": ops(0.06, 0.12, 0.0, False)},
        {"rank": 2, "stage": 1, "dp_index": 0, "device_index": 2, "datacenter": "dc-b", "ops": ops(0.05, 0.09, 0.01, True)},
    ]}


def make_run(name: str, timeline: dict, prefill: bool = True) -> str:
    run_dir = os.path.join(runs_dir(), name)
    os.makedirs(run_dir)
    plan = pipeline_plan()
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    try:
        store.init_run(plan, steps_target=len(STEP_S), seed=0, backend="gloo")
        for step, s in enumerate(STEP_S):
            for rank in range(3):
                store.record_rank_step(rank, step, 0.2, 0.0, 0.01, 0.02, 5_000_000)
            store.record_step(step, 3.0 - 0.1 * step, s, 4, 64)
        store.finish("done")
    finally:
        store.close()
    with open(os.path.join(run_dir, "timeline.json"), "w") as fh:
        json.dump(timeline, fh)
    if prefill:
        w = PrefillWorker.from_config({"model": "tiny", "prompt_tokens": [32, 64], "requests_per_s": 2000.0,
                                       "num_requests": 6}, torch.device("cpu"), seed=2)
        while sum(r.end_s is not None for r in w.requests) < 6:
            w.step()
        w.write_summary(run_dir, rank=2)
    return run_dir


def open_page() -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception, at.exception
    return at


def stage_table(at: AppTest):
    [df] = [t.value for t in at.table if "forward + backward (s, measured)" in t.value.columns]
    return df


def test_measured_gantt_beside_the_simulated_and_the_stage_errors(data_dir):
    run_dir = make_run("pipe-1", measured_timeline())
    at = open_page()
    assert not at.error
    charts = drawn_figures(at)
    assert len(charts) == 2  # measured and simulated Gantt (no scenario planned yet)
    measured, simulated = charts
    assert "measured" in measured["layout"]["xaxis"]["title"]["text"]
    assert "simulated" in simulated["layout"]["xaxis"]["title"]["text"]
    timeline = measured_timeline()
    rows = gantt_rows(measured)
    assert len(rows) == sum(len(r["ops"]) for r in timeline["ranks"])
    assert {r["row"] for r in rows} == {"s0 r0 · dc-a", "s0 r1 · dc-a", "s1 r0 · dc-b"}
    assert {r["color"] for r in rows} == {"training forward", "training backward", "send",
                                          "receive (posted → arrived)", "gradient all-reduce", "optimizer step",
                                          "prefill (BubbleTea)"}
    assert len(gantt_rows(simulated)) == len(pipeline_plan().pipeline.simulated_ops)
    # same rows in the same order, on the same time scale
    assert measured["layout"]["yaxis"]["categoryarray"] == simulated["layout"]["yaxis"]["categoryarray"]
    assert measured["layout"]["xaxis"]["range"] == simulated["layout"]["xaxis"]["range"]

    df = stage_table(at)
    assert list(df["stage"]) == ["0", "1"] and list(df["datacenter"]) == ["dc-a", "dc-b"]
    # stage 0: measured 2 x (0.06 + 0.12) = 0.36 against simulated 2 x (0.05 + 0.1) = 0.30: +20 %
    # stage 1: measured 2 x (0.05 + 0.09) = 0.28 against simulated 2 x (0.04 + 0.08) = 0.24: +16.7 %
    assert list(df["forward + backward (s, measured)"]) == ["0.3600", "0.2800"]
    assert list(df["forward + backward (s, simulated)"]) == ["0.3000", "0.2400"]
    assert list(df["error (measured vs simulated)"]) == ["+20.0 %", "+16.7 %"]
    # idle: 1 - (F + B + sync + optimizer) / the step's span (0.64): stage 0 1 - 0.40/0.64
    assert df["idle (measured, % of the step)"][0] == f"{100 * (1 - 0.40 / 0.64):.1f} %"
    assert list(df["prefill (s, measured)"]) == ["0.0000", "0.0040"]

    labels = {m.label: m.value for m in at.metric}
    it = statistics.median(STEP_S[1:])
    assert any("measured" in k and "Iteration" in k and v == f"{it * 1e3:.1f} ms" for k, v in labels.items())
    assert any("Error" in k and v == f"{100 * (it - PREDICTED_S) / PREDICTED_S:+.1f} %" for k, v in labels.items())

    with open(os.path.join(run_dir, "prefill_rank2.json")) as fh:
        summary = json.load(fh)
    [pre] = [t.value for t in at.table if "requests done" in t.value.columns]
    assert list(pre["rank"]) == ["2"] and list(pre["stage"]) == ["1"] and list(pre["requests done"]) == ["6"]
    assert summary["prefill_tokens"] > 0 and pre["prefill (measured, tokens/s of the run)"][0].endswith("tok/s")
    text = " ".join(str(v) for t in at.table for v in t.value.to_numpy().ravel())
    assert "None" not in text and "nan" not in text and "{" not in text  # no raw Python on screen


def test_a_bad_timeline_is_one_error_line_and_the_page_lives(data_dir):
    bad = measured_timeline()
    bad["ranks"][2]["ops"][0]["op"] = "teleport"
    make_run("pipe-bad", bad, prefill=False)
    at = open_page()
    [err] = [e.value for e in at.error]
    assert "teleport" in err and "\n" not in err
    assert not drawn_figures(at)


def test_without_pipeline_runs_the_page_says_how_to_make_one(data_dir):
    at = open_page()
    assert any("executor launch" in i.value for i in at.info)
    assert not at.error


def test_a_real_pipeline_runs_timeline_beside_its_simulation(data_dir):
    """A REAL run: 2 stages of tiny on this machine (torchrun, gloo), prefill on stage 1, its plan's
    simulated ops from planner/geo/emulated.py; the page's figures recomputed here from the files."""
    from executor.launch import launch_run
    from planner.geo.emulated import simulate_plan

    cluster = ClusterSpec("local", (NodeSpec("localhost", "local", (DeviceSpec("cpu"), DeviceSpec("cpu"))),))
    asg = tuple(Assignment(i, "localhost", "cpu", 2, 2, 4, 1.0, 0, 0.0) for i in range(2))
    stages = (PipelineStage(0, 1, (0,), (2,), "local"), PipelineStage(1, 1, (1,), (2,), "local"))
    draft = Plan(cluster, "tiny", 4, 64, "fp32", "none", asg, 0.0, 0.0, pipeline=PipelineSpec("1f1b", 2, 2, stages))
    sim = simulate_plan(draft)
    plan = dataclasses.replace(draft, predicted_iteration_s=sim.iteration_s, predicted_samples_per_s=4 / sim.iteration_s,
                               pipeline=dataclasses.replace(draft.pipeline, simulated_ops=sim.ops))
    run_dir = os.path.join(runs_dir(), "real-pipe")
    status = launch_run(plan, 2, run_dir, seed=1,
                        prefill={"model": "tiny", "prompt_tokens": 16, "backlog": True, "stages": [1]})
    assert status == "done"
    at = open_page()
    assert not at.error
    measured, simulated = [gantt_rows(f) for f in drawn_figures(at)]
    with open(os.path.join(run_dir, "timeline.json")) as fh:
        timeline = json.load(fh)
    assert len(measured) == sum(len(r["ops"]) for r in timeline["ranks"])
    assert len(simulated) == len(sim.ops)
    df = stage_table(at)
    for r in timeline["ranks"]:
        busy = sum(o["end_s"] - o["start_s"] for o in r["ops"] if o["op"] in ("forward", "backward"))
        sim_busy = sum(o["end_s"] - o["start_s"] for o in sim.ops
                       if o["stage"] == r["stage"] and o["op"] in ("forward", "backward"))
        assert df["forward + backward (s, measured)"][r["stage"]] == f"{busy:.4f}"
        assert df["forward + backward (s, simulated)"][r["stage"]] == f"{sim_busy:.4f}"
        assert df["error (measured vs simulated)"][r["stage"]] == f"{100 * (busy - sim_busy) / sim_busy:+.1f} %"
    [pre] = [t.value for t in at.table if "requests done" in t.value.columns]
    assert list(pre["rank"]) == ["1"] and list(pre["stage"]) == ["1"]
