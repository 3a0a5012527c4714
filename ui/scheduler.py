"""Scheduler: submit models without choosing devices; the queue, its runs over time; GPUMix's policy
against every baseline in one simulator, with how many of its jobs ran on mixed-type gangs (marked in the Gantt).

Widgets -> one library call -> render: executor.queue.JobQueue (submit, list),
executor.orchestrator.Orchestrator.tick (one scheduler pass on this machine's devices),
planner.schedule.simulate.simulate_schedule (a generated trace on a simulated mixed pool).
"""
from __future__ import annotations

import time

import streamlit as st

from executor.queue import JobQueue
from contracts.specs import PRESETS
from planner.schedule.trace import DEMO_CLUSTERS
from ui import background
from ui.charts import gantt_chart
from ui.common import (MEASURED, PREDICTED, fmt_cell, fmt_percent, metric, number_field, page_header, show_errors, show_figure,
                       show_table)
from ui.compute import BASELINES, HOUR_S, POLICIES, simulate_policies
from ui.state import default_local_cluster

LOCAL_MODELS = ("tiny", "tiny-llama", "small", "gpt2")  # what a CPU machine trains in minutes
AUTO_TICK_S = 2.0
SIM_JOB = "schedule-simulation"  # this page's background job (ui/background.py)
MIXED_MARK = "[mixed gang]"  # how the Gantt's tooltip names a job that ran on devices of several types


def gantt(rows: list[dict], title: str, x_title: str):
    """Horizontal bars, one per (device, job) from rows of {device, job, start, end}; one colour per
    job (cycling through the palette: a trace has hundreds of jobs, so no legend; the tooltip names it)."""
    return gantt_chart([{"row": str(r["device"]), "start": r["start"], "end": r["end"], "color": str(r["job"])}
                        for r in rows], x_title, "device", title, legend=False, color_title="job")


@st.cache_resource(show_spinner=False)
def _local_cluster():
    return default_local_cluster()


def _orchestrator():
    from executor.orchestrator import Orchestrator  # planner + hetero: only when a pass runs

    return Orchestrator(JobQueue(), _local_cluster())


def submit_panel() -> None:
    c1, c2, c3, c4 = st.columns([2, 1, 1, 1])
    model = c1.selectbox("Model", LOCAL_MODELS + tuple(m for m in PRESETS if m not in LOCAL_MODELS),
                         key="sched_model")
    batch = number_field("Global batch", unit="samples", min_value=1, max_value=1_000_000, value=8,
                         key="sched_global_batch", where=c2)
    steps = number_field("Steps", unit="steps", min_value=1, max_value=1_000_000, value=20, key="sched_steps", where=c3)
    c4.write("")
    if c4.button("Submit", key="sched_submit", type="primary", disabled=batch is None or steps is None):
        with show_errors("Cannot queue the job"):
            job_id = JobQueue().submit(model, int(batch), int(steps))
            st.success(f"Queued job {job_id}: GPUMix picks its devices at the next scheduler pass.")


def tick_panel() -> None:
    c1, c2 = st.columns([1, 3])
    if c1.button("Run scheduler pass", key="sched_tick"):
        with show_errors("Scheduler pass failed"):
            report = _orchestrator().tick()
            c2.info(f"started {report.started or 'none'}; finished "
                    f"{', '.join(f'{i} ({s})' for i, s in report.finished) or 'none'}")
    c1.toggle("Auto passes", key="sched_auto", help=f"run a scheduler pass in the background every {AUTO_TICK_S:g} s while this page is open")


def queue_table(jobs) -> None:
    if not jobs:
        st.caption("The queue is empty: submit a job above.")
        return
    rows = [{"id": j.id, "state": j.state, "model": j.model, "global batch": j.global_batch, "seq": j.seq,
             "steps": j.steps, "devices": ", ".join(f"{i}: {lab}" for i, lab in zip(j.devices, j.device_labels)),
             "duration (s, predicted)": fmt_cell(j.predicted_duration_s, lambda x: f"{x:,.1f}"),
             "ran (s, measured, with start-up)": fmt_cell((j.ended_s or time.time()) - j.started_s if j.started_s else None,
                                                          lambda x: f"{x:,.1f}"),
             "run folder": j.run_dir or "", "reason": j.reason or ""} for j in jobs]
    show_table(rows, key="sched_queue_table")


def real_gantt(jobs) -> None:
    ran = [j for j in jobs if j.started_s and j.devices]
    if not ran:
        return
    t0 = min(j.started_s for j in ran)
    now = time.time()
    rows = [{"device": f"{i}: {lab}", "job": j.id, "start": j.started_s - t0, "end": (j.ended_s or now) - t0}
            for j in ran for i, lab in zip(j.devices, j.device_labels)]
    show_figure(gantt(rows, "Local devices over time (measured)", "time since the first start (s)"),
                key="sched_real_gantt")


def local_queue() -> None:
    st.subheader("Local queue (real runs)")
    submit_panel()
    tick_panel()

    @st.fragment(run_every=AUTO_TICK_S if st.session_state.get("sched_auto") else None)
    def live() -> None:
        if st.session_state.get("sched_auto"):
            with show_errors("Scheduler pass failed"):
                _orchestrator().tick()
        with show_errors("Cannot read the queue"):
            jobs = JobQueue().list()
            queue_table(jobs)
            real_gantt(jobs)

    live()


@st.cache_data(show_spinner="Simulating every policy…", max_entries=8)
def _simulate(seed: int, num_gpus: int, num_jobs: int, load: float) -> dict:
    """Both policies on one trace, in this session's background process (ui/background.py:
    cancellable, killed with the session). Raises background.Pending while it runs (not cached)."""
    return background.result_of(SIM_JOB, simulate_policies, seed, num_gpus, num_jobs, load)


def simulation() -> None:
    st.subheader("Simulation: GPUMix's policy against every baseline on a generated trace")
    st.caption("fifo: first come first served on each user's own request (type, count); fifo-backfill: the same "
               "with EASY backfill; fifo-backfill-sized and sjf: EASY backfill with GPUMix's memory-aware sizing, "
               "in arrival or shortest-predicted-first order; frenzy: the paper's policy; gpumix: shortest remaining "
               "work with aging, sizing by expected cost to the queue, preemption and growth through checkpoint "
               "and resume. Durations are the cost model's predictions times a seeded error (the same for every "
               "policy); the decision time is measured.")
    c1, c2, c3, c4 = st.columns(4)
    seed = number_field("Trace seed", unit="integer", min_value=0, max_value=2**31 - 1, value=1,
                        key="sched_trace_seed", where=c1)
    num_gpus = c2.selectbox("GPUs in the pool", tuple(DEMO_CLUSTERS), key="sched_num_gpus",
                            format_func=lambda n: f"{n} ({', '.join(DEMO_CLUSTERS[n])})")
    num_jobs = number_field("Jobs", unit="jobs", min_value=10, max_value=3000, value=200, step=10,
                            key="sched_num_jobs", where=c3)
    load = c4.slider("Requested load (GPU-s per device-s)", 0.1, 1.5, 0.6, 0.1, key="sched_load",
                     help="requested GPU-seconds per device-second of the trace's span")
    if st.button("Simulate", key="sched_simulate", type="primary", disabled=seed is None or num_jobs is None):
        st.session_state["sched_result"] = (int(seed), int(num_gpus), int(num_jobs), float(load))
    args = st.session_state.get("sched_result")
    if not args:
        return
    try:
        with show_errors("Simulation failed"):
            res = _simulate(*args)
            show_simulation(res)
    except background.Pending:
        background.show_pending(SIM_JOB, "Simulating every policy…", "sched_sim_cancel",
                                on_cancel=lambda: st.session_state.pop("sched_result", None))


def show_simulation(res: dict) -> None:
    ours = res["gpumix"]["summary"]
    done = {p: res[p]["summary"] for p in BASELINES if res[p]["summary"]["avg_jct_s"] is not None}
    strongest = min(done, key=lambda p: done[p]["avg_jct_s"]) if done else None
    cards = []
    if strongest is not None and ours["avg_jct_s"] is not None:
        ref = done[strongest]
        cards += [(f"Avg JCT vs {strongest} (strongest baseline)",
                   fmt_percent(100 * (ours["avg_jct_s"] / ref["avg_jct_s"] - 1.0), signed=True), PREDICTED),
                  (f"p99 JCT vs {strongest}",
                   fmt_percent(100 * (ours["p99_jct_s"] / ref["p99_jct_s"] - 1.0), signed=True), PREDICTED)]
    cards.append(("gpumix decision time", f"{ours['scheduling_overhead_ms_per_job']:.2f} ms/job", MEASURED))
    cards.append(("gpumix jobs on mixed-type gangs", f"{ours.get('num_mixed_gang_jobs', 0)} of {ours['num_jobs']}",
                  PREDICTED))
    for col, (label, value, kind) in zip(st.columns(len(cards)), cards):
        with col:
            metric(label, value, kind)
    st.dataframe([{"policy": p, "avg JCT (h, predicted)": d["avg_jct_s"] / HOUR_S,
                   "p99 JCT (h, predicted)": d["p99_jct_s"] / HOUR_S,
                   "makespan (h, predicted)": d["makespan_s"] / HOUR_S,
                   "GPU utilization (predicted)": d["gpu_utilization"],
                   "decision time (ms/job, measured)": d["scheduling_overhead_ms_per_job"],
                   "jobs on mixed gangs": d.get("num_mixed_gang_jobs", 0),
                   "failed jobs": d["num_failed"]}
                  for p, d in ((p, res[p]["summary"]) for p in POLICIES)], hide_index=True, key="sched_sim_table")
    policy = st.radio("Gantt of", POLICIES, horizontal=True, key="sched_gantt_policy")
    mixed = set(res[policy]["summary"].get("mixed_gang_job_ids", ()))
    rows = [{**r, "job": f"{r['job']} {MIXED_MARK}" if r["job"] in mixed else r["job"]} for r in res[policy]["rows"]]
    show_figure(gantt(rows, f"{policy}: devices over time (predicted)", "time (h)"), key="sched_sim_gantt")
    if mixed:
        st.caption(f"{MIXED_MARK} marks the {len(mixed)} jobs that ran on a mixed-type gang (devices of several "
                   f"types at once, batch and state split unevenly): {', '.join(sorted(mixed)[:20])}"
                   f"{' …' if len(mixed) > 20 else ''}")


page_header("Scheduler", "Submit a model, not a GPU request: GPUMix predicts what fits where and places the job.")
st.caption(f"Local devices: {', '.join(d.label for _, d in _local_cluster().devices())}")
local_queue()
st.divider()
simulation()
