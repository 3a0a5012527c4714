"""Launch & monitor: run the session's plan for real and watch it live.

Widgets -> executor.launch.start_run / stop_run, executor.live.RunFollower -> render.
The run is a separate process group (a new session), so it survives a browser reload
and an app restart: the page finds it again from the SQLite store (ui.state.current_run_dir).
The live panel is an `st.fragment(run_every=1 s)` that reads the store through the session's
executor.live.RunFollower: only the rows newer than it holds, its charts at most a few hundred
points a series, so a refresh costs the same at any run length (bench/live_panel.py). Measured
figures sit beside the plan's predictions; emulated devices are marked. The straggler (which rank,
on which device, how much slower than its profile, what it costs the step: executor/straggler.py),
each rank's measured compute and wait beside the predicted ones, and the run's timeline of splits
(the plan's, then each live rebalance: executor/rebalance.py, drawn as a vertical marker on the
throughput chart) come from the run's step events (executor.store.read_events).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import pandas as pd
import streamlit as st

from contracts.cluster import PROFILE_KEY_SHARE
from contracts.plan import Plan
from executor.live import CHART_TAIL_STEPS, WINDOW_STEPS
from ui import common, state

log = logging.getLogger(__name__)

LIVE_REFRESH_S = 1.0
MAX_STEPS = 1_000_000
MIN_DEFAULT_STEPS = 200
WATCH_S = 60.0  # the default run lasts about this long at the predicted step time: long enough to watch
DEFAULT_CHECKPOINT_EVERY = 500
MIB = 2**20
SMOOTH_STEPS = 11  # the throughput chart's rolling median window (steps)
MIN_STEPS_FOR_GAP = 10  # measured against predicted only once the median means something
GAP_TOLERANCE_PERCENT = 15.0  # within this, the prediction holds (a first run's target)
BACKENDS = ("local", "slurm")  # executor launch --backend
COMPARE_WATCH_S = 30.0  # the even-split run's default length, at most, at its predicted step
MIN_COMPARE_STEPS = 20  # and at least this many steps
MANY_MICRO_BATCHES = 8  # per step: where an unpriced per-micro-batch cost shows (gap_reasons)
SPLIT_MARKER_COLOR = "#7b3294"  # the throughput chart's markers of a change of split


def _store():
    from executor import store  # torch-free

    return store


# ---- launching -------------------------------------------------------------------------


def plan_frame(plan: Plan) -> pd.DataFrame:
    devices = plan.cluster.devices()
    rows = []
    for a in plan.used:
        dev = devices[a.device_index][1] if a.device_index < len(devices) else None
        rows.append({
            "node": a.node, "device": common.device_label(dev) if dev else a.type,
            "emulated": common.emulated_marker(a.emulated or a.slowdown != 1.0 or a.memory_gb is not None),
            "micro-batch × accum": f"{a.micro_batch} × {a.accum_steps}", "batch (samples)": str(a.batch),
            "state shard": common.fmt_percent(100.0 * a.shard_fraction),
            "memory (predicted, MiB)": _mib(a.predicted_memory_bytes),
            "step (predicted)": common.fmt_cell(a.predicted_step_s, common.fmt_seconds),
        })
    return pd.DataFrame(rows)


def default_steps(plan: Plan) -> int:
    """Steps that take about WATCH_S at the plan's predicted iteration time (at least
    MIN_DEFAULT_STEPS), rounded to 50."""
    if not plan.predicted_iteration_s or plan.predicted_iteration_s <= 0:
        return MIN_DEFAULT_STEPS
    steps = int(round(WATCH_S / plan.predicted_iteration_s / 50.0)) * 50
    return max(MIN_DEFAULT_STEPS, min(MAX_STEPS, steps))


def render_launch(plan: Plan | None) -> None:
    st.subheader("Launch")
    if plan is None:
        st.info("No plan in this session yet: compute one on **Plan** first, then come back to launch it.",
                icon=":material/info:")
        common.page_link("ui/plan.py", "Go to Plan", ":material/account_tree:")
        return
    from executor.launch import multinode_commands, runs_here

    st.caption(f"Plan: **{plan.model}**, global batch {plan.global_batch}, seq {plan.seq}, {plan.dtype}, "
               f"{len(plan.used)} ranks on {plan.cluster.name}")
    common.show_table(plan_frame(plan), key="launch_plan_table")
    c1, c2 = st.columns(2)
    with c1:
        common.metric("Iteration time", common.fmt_seconds(plan.predicted_iteration_s), common.PREDICTED)
    with c2:
        common.metric("Throughput", common.fmt_rate(plan.predicted_samples_per_s), common.PREDICTED)
    common.show_emulated_note(any(a.emulated or a.slowdown != 1.0 for a in plan.used))
    for note in plan.notes:
        st.caption(f":material/info: {note}")
    if any("estimat" in n for n in plan.notes):
        common.page_link("ui/plan.py", "Estimated figures: measure this machine and plan again (one click on Plan)",
                         ":material/speed:")
    steps = common.number_field("Steps", unit="steps", min_value=1, max_value=MAX_STEPS, value=default_steps(plan),
                                step=50, key="launch_steps",
                                help=f"default: about {common.fmt_seconds(WATCH_S)} at the predicted step time, "
                                     "long enough to watch the run live")
    ckpt_every = 0
    if st.checkbox("Save checkpoints", value=False, key="launch_checkpoints"):
        ckpt_every = common.number_field("Checkpoint every", unit="steps", min_value=1, max_value=MAX_STEPS,
                                         value=DEFAULT_CHECKPOINT_EVERY, step=50, key="launch_checkpoint_every")
    if steps is None or ckpt_every is None:
        return
    backend = st.radio("Backend", BACKENDS, horizontal=True, key="launch_backend",
                       format_func=lambda b: {"local": "this machine (torchrun)", "slurm": "SLURM (sbatch)"}[b],
                       help="SLURM submits the plan as one job; its nodes must be the cluster's SLURM nodes")
    settings = None
    if backend == "slurm":
        from executor.slurm_job import SlurmSettings, default_gres_name  # torch-free

        gres = st.text_input("SLURM GRES name", default_gres_name(), key="launch_gres_name",
                             help="the site's GRES name of its accelerators (GPUMIX_SLURM_GRES)")
        settings = SlurmSettings(gres_name=gres.strip() or default_gres_name())
    elif not runs_here(plan):
        st.warning("This plan spans several nodes: run one of these commands on each node "
                   "(c10d rendezvous on the first).", icon=":material/lan:")
        st.code("\n".join(multinode_commands("plan.json", plan, int(steps), "RUN_DIR")), language="bash")
        return
    inputs = state.get_training_inputs()
    chosen = [f"{label}: `{inputs[k]}`" for k, label in (("init_from", "start from"), ("tokenizer", "tokenizer"),
                                                         ("corpus_dir", "data")) if inputs[k]]
    st.caption(("Inputs (Model & memory page): " + ", ".join(chosen)) if chosen else
               "Inputs: random initialisation, byte tokens, the Python standard library as corpus "
               "(choose others on the Model & memory page).")
    launch_button(plan, int(steps), int(ckpt_every), inputs, settings)


def launch_button(plan: Plan, steps: int, ckpt_every: int, inputs: dict[str, str | None],
                  slurm=None) -> None:
    """Launch (on this machine, or through SLURM with `slurm`'s SlurmSettings), disabled while
    another run holds any of the plan's devices (the booking ledger); re-checked every second
    while they are busy, so it comes back when that run ends."""
    with common.show_errors("Cannot check the devices"):
        busy = state.devices_in_use(plan, slurm=slurm is not None)

        @st.fragment(run_every=LIVE_REFRESH_S if busy else None)
        def panel() -> None:
            now_busy = state.devices_in_use(plan, slurm=slurm is not None)
            if bool(now_busy) != bool(busy):
                st.rerun()  # the devices came free (or were taken): redraw the page
            for line in now_busy:
                st.warning(f"Launch is disabled: {line}. Stop it or wait for it to end.", icon=":material/block:")
            if st.button("Launch", type="primary", key="launch_button", icon=":material/rocket_launch:",
                         disabled=bool(now_busy)):
                with common.show_errors("Cannot launch"), st.spinner("Starting the launcher…"):
                    if slurm is not None:
                        from executor.slurm import start_slurm_run

                        handle = start_slurm_run(plan, steps, settings=slurm, checkpoint_every=ckpt_every, **inputs)
                    else:
                        from executor.launch import start_run

                        handle = start_run(plan, steps, checkpoint_every=ckpt_every, **inputs)
                    state.set_run_dir(handle.run_dir)
                    st.session_state["launch_run_select"] = handle.run_dir
                    st.toast(f"Launched {os.path.basename(handle.run_dir)}", icon=":material/rocket_launch:")
                    st.rerun()  # the whole page: the monitor, the sidebar's "Running" link

        panel()


# ---- choosing the run to watch -----------------------------------------------------------


def pick_run() -> str | None:
    runs = _store().list_runs()
    current = state.current_run_dir()
    dirs = [r["run_dir"] for r in runs]
    if current and current not in dirs and os.path.isdir(current):
        dirs.insert(0, current)
    if not dirs:
        st.caption("No runs yet.")
        return None
    # no status in the label: the selector is outside the live panel, so it would go stale
    labels = {r["run_dir"]: f"{r['name']} — {r['model']}, {r['world_size']} ranks"
              + (" (emulated)" if r["emulated"] else "") for r in runs}
    if st.session_state.get("launch_run_select") not in dirs:
        st.session_state["launch_run_select"] = current if current in dirs else dirs[0]
    choice = st.selectbox("Run to watch", dirs, key="launch_run_select",
                          format_func=lambda d: labels.get(d, os.path.basename(d)))
    state.set_run_dir(choice)
    return choice


# ---- the live panel ------------------------------------------------------------------------

MAX_FOLLOWED_RUNS = 4  # followers a session keeps (the watched run, its planned or even-split runs)


def live_metrics(run_dir: str) -> dict[str, Any]:
    """The run's bounded metrics (executor.live.RunFollower.refresh), through this session's follower
    of it: each refresh reads only the rows newer than the last. Raises ValueError."""
    from executor.live import RunFollower  # torch-free

    followers: dict[str, Any] = st.session_state.setdefault("launch_followers", {})
    follower = followers.pop(run_dir, None) or RunFollower(run_dir)
    followers[run_dir] = follower  # the most recently used last
    while len(followers) > MAX_FOLLOWED_RUNS:
        followers.pop(next(iter(followers)))
    return follower.refresh()



def _mib(b: float | None) -> str:
    return common.fmt_cell(b, lambda x: f"{x / MIB:,.1f}")


def ranks_frame(m: dict[str, Any]) -> pd.DataFrame:
    return common.ranks_table(m["ranks"])


def points(m: dict[str, Any], column: str) -> tuple[list[float], list[float]]:
    """A chart's (steps, values) of one step column: a live view's history (executor/live.py:
    older steps as bucket means), else every step's."""
    if "history" in m:
        xs, ys = m["history"][column]
        return list(xs), list(ys)
    rows = [s for s in m["steps"] if s[column] is not None]
    return [s["step"] for s in rows], [s[column] for s in rows]


def per_rank_series(m: dict[str, Any], column: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    emulated = {r["rank"]: r["emulated"] for r in m["ranks"]}
    if column in m.get("history", {}):
        for rank, (xs, ys) in sorted(m["history"][column].items(), key=lambda kv: int(kv[0])):
            out[f"rank {rank}" + (" (emulated)" if emulated.get(int(rank)) else "")] = (list(xs), list(ys))
        return out
    for row in m["rank_steps"]:
        name = f"rank {row['rank']}" + (" (emulated)" if emulated.get(row["rank"]) else "")
        xs, ys = out.setdefault(name, ([], []))
        xs.append(row["step"])
        ys.append(row[column])
    return out


def memory_figure(m: dict[str, Any]) -> Any:
    """Per rank: the measured peak beside the plan's prediction, each labelled in MiB."""
    from ui.charts import bar_chart

    names = [f"rank {r['rank']}" + (" (emulated)" if r["emulated"] else "") for r in m["ranks"]]
    series, labels = {}, {}
    for name, key in (("peak (measured)", "peak_memory_bytes"), ("predicted", "predicted_memory_bytes")):
        series[name] = [None if r[key] is None else r[key] / MIB for r in m["ranks"]]
        labels[name] = [_mib(r[key]) for r in m["ranks"]]
    return bar_chart(names, series, "rank", "memory (MiB)", "Per-rank memory", labels=labels)


def throughput_figure(m: dict[str, Any]) -> Any:
    """Measured samples/s per step as points, their rolling median as the line to read, and the
    plan's prediction as a dashed rule."""
    from ui.charts import line_chart

    xs, ys = points(m, "samples_per_s")
    pred = m.get("predicted_samples_per_s")
    fig = line_chart({"each step (measured)": (xs, ys)}, "step", "throughput (samples/s)",
                     "Throughput (measured, predicted)", smooth=SMOOTH_STEPS,
                     hlines={"predicted": pred} if pred and xs else None)
    return with_step_markers(fig, m.get("split_changes") or [])


def with_step_markers(fig: dict[str, Any], changes: list[dict[str, Any]]) -> dict[str, Any]:
    """`fig` with a dotted vertical line at each change of split (`{"step", "kind"}`: the first step
    trained on the new split), labelled with its kind at the top."""
    shapes = list(fig["layout"].get("shapes", []))
    for c in changes:
        shapes.append({"type": "line", "xref": "x", "x0": c["step"], "x1": c["step"], "yref": "paper", "y0": 0,
                       "y1": 1, "line": {"color": SPLIT_MARKER_COLOR, "dash": "dot", "width": 2},
                       "label": {"text": f"{c['kind']} (step {c['step']})", "textposition": "end",
                                 "font": {"size": 10, "color": SPLIT_MARKER_COLOR}}})
    fig["layout"]["shapes"] = shapes
    return fig


def loss_figure(m: dict[str, Any]) -> Any:
    from ui.charts import line_chart

    loss = {"training": points(m, "loss")}
    val = points(m, "val_loss")
    if val[0]:
        loss["validation"] = val
    return line_chart(loss, "step", "loss (nats/token)", "Loss (measured)")


def wait_figure(m: dict[str, Any]) -> Any:
    from ui.charts import line_chart

    return line_chart(per_rank_series(m, "wait_s"), "step", "wait time (s)",
                      "Per-rank wait in collectives (measured)")


def run_plan(m: dict[str, Any]) -> Plan | None:
    """The plan a run executed (its folder's plan.json), None where there is none to read."""
    path = os.path.join(m.get("run_dir") or "", "plan.json")
    try:
        return Plan.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _rank_devices(plan: Plan | None) -> dict[int, Any]:
    """rank -> the DeviceSpec it trained on (a local run: rank r trains the r-th used device)."""
    if plan is None:
        return {}
    devices = plan.cluster.devices()
    return {rank: devices[a.device_index][1] for rank, a in enumerate(plan.used) if a.device_index < len(devices)}


def _profile_reasons(m: dict[str, Any], kinds: dict[int, str]) -> list[str]:
    """Device kinds priced on estimates; micro-batches outside the sizes a measured profile timed."""
    from planner.core.profiles import get_step_profile
    from contracts.specs import get_model, with_max_seq

    reasons = []
    with contextlib.suppress(ValueError, OSError, TypeError):  # TypeError: a run that recorded no seq
        spec = with_max_seq(get_model(m["model"]), m["seq"])
        profiles = {k: get_step_profile(k, spec, m["seq"], m["dtype"]) for k in sorted(set(kinds.values()))}
        unmeasured = [k for k, p in profiles.items() if not p.measured]
        if unmeasured:
            reasons.append(f"no measured profile of {m['model']} at seq {m['seq']} on {', '.join(unmeasured)}: "
                           "the plan's step times are estimates (profile it on **Inventory**, then plan again)")
        for r in m["ranks"]:
            p = profiles.get(kinds.get(r["rank"]))
            if p is not None and p.measured and p.micro_batches and r.get("micro_batch"):
                lo, hi = min(p.micro_batches), max(p.micro_batches)
                if not lo <= r["micro_batch"] <= hi:
                    reasons.append(f"rank {r['rank']}'s micro-batch of {r['micro_batch']} is outside the sizes its "
                                   f"profile timed ({lo}–{hi}): the profile's line is extrapolated there (small "
                                   "micro-batches pay a per-call overhead the line does not hold)")
            if (p is not None and p.measured and p.alpha_s <= 0
                    and (r.get("accum_steps") or 0) >= MANY_MICRO_BATCHES):
                reasons.append(f"rank {r['rank']} runs {r['accum_steps']} micro-batches per step and its profile "
                               "fitted no fixed cost per micro-batch (α = 0): what the runtime does per micro-batch "
                               "(its data windows, the gradient accumulation) is not priced")
    return reasons


def _collective_reasons(m: dict[str, Any], devices: dict[int, Any]) -> list[str]:
    """Collectives priced from the cluster file; a CPU-quota rank's throttled part of them."""
    from planner.core.profiles import collective_set_key, get_collective_profile

    kinds = collective_set_key({d.profile_key for d in devices.values()})
    under_quota = len(devices) > 1 and PROFILE_KEY_SHARE in kinds and get_collective_profile(kinds) is not None
    reasons = []
    cpu_ranks = [r for r in m["ranks"] if r["type"] == "cpu"]
    if (len(cpu_ranks) > 1 and len(cpu_ranks) == len(m["ranks"]) and not under_quota
            and get_collective_profile("cpu") is None):
        reasons.append("the collectives between this machine's CPU workers were not measured (`python -m profiler "
                       "bench`): the plan priced them from the cluster file's intra-node bandwidth")
    pricing = ("the plan priced them as measured under the quotas (\"Profile now\"), each call timed right after "
               "computing, its quota spent: calls that follow one another in a run may wait less" if under_quota else
               "which the collectives' pricing (unthrottled) does not see")
    for r in m["ranks"] if len(devices) > 1 else ():
        share = devices[r["rank"]].cpu_share if r["rank"] in devices else None
        if share is not None and share < 1 and r.get("median_wait_s"):
            reasons.append(f"rank {r['rank']} runs under a CPU quota of {share:g} of a core: its part of each "
                           f"collective is throttled too, {pricing} "
                           f"(its median wait in collectives: {common.fmt_seconds(r['median_wait_s'])} per step)")
    return reasons


def gap_reasons(m: dict[str, Any]) -> list[str]:
    """Why a run's measured step may differ from its prediction, from what this page can check:
    device kinds planned on estimated (not measured) figures, micro-batches outside the sizes a
    profile timed, collectives priced from the cluster file or throttled by a CPU quota, emulation
    by sleeping, and the machine's load (CPU profiles time one dedicated core per rank)."""
    devices = _rank_devices(run_plan(m))
    # the profile kind each rank was priced by (type@share for a CPU quota); else the store's type
    kinds = {r["rank"]: devices[r["rank"]].profile_key if r["rank"] in devices else r["type"] for r in m["ranks"]}
    reasons = _profile_reasons(m, kinds) + _collective_reasons(m, devices)
    if any(r["slowdown"] and r["slowdown"] != 1.0 for r in m["ranks"]):
        reasons.append("emulated slowdowns sleep after each step: the sleep is exact, the compute beside it is not")
    with contextlib.suppress(OSError):
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
        if load > 0.8 * cores:
            reasons.append(f"this machine is loaded (load average {load:.1f} on {cores} cores): CPU profiles time "
                           "one dedicated core per rank, a shared core makes every step longer")
    return reasons


def measured_step(m: dict[str, Any]) -> float | None:
    """The run's measured median step: over steps 3.. (executor.compare) once there are enough of
    them, before that over what the store has (steps 2..)."""
    from executor.compare import step_median

    return step_median(m) or m.get("median_step_s")


def gap_text(measured_s: float, predicted_s: float) -> tuple[str, bool]:
    """"Measured ... against ... predicted: by how much" and whether it is within the tolerance."""
    from executor.compare import prediction_gap

    gap = 100.0 * prediction_gap(measured_s, predicted_s)
    by = f"{measured_s / predicted_s:.1f}× the prediction" if measured_s >= 2 * predicted_s else (
        f"{common.fmt_percent(gap, signed=True)}, {'slower' if gap > 0 else 'faster'} than predicted")
    line = (f"measured median step {common.fmt_seconds(measured_s)} against {common.fmt_seconds(predicted_s)} "
            f"predicted: {by}")
    return line, abs(gap) <= GAP_TOLERANCE_PERCENT


def gap_line(measured_s: float, predicted_s: float) -> str:
    """gap_text with its verdict: "(within 15 %)" or "(outside 15 %)"."""
    line, within = gap_text(measured_s, predicted_s)
    return f"{line} ({'within' if within else 'outside'} {GAP_TOLERANCE_PERCENT:g} %)"


def render_gap(m: dict[str, Any], prefix: str = "") -> None:
    """Measured against predicted step time: by how much, and the likely reasons when they differ."""
    med, pred = measured_step(m), m.get("predicted_iteration_s")
    if not med or not pred or m["steps_recorded"] < MIN_STEPS_FOR_GAP:
        return
    line, within = gap_text(med, pred)
    line = (prefix + line) if prefix else line[0].upper() + line[1:]
    if within:
        st.caption(f":material/check_circle: {line} (within {GAP_TOLERANCE_PERCENT:g} %).")
        return
    reasons = gap_reasons(m)
    st.warning(line + (". Likely: " + "; ".join(reasons) + "." if reasons else
                       ". None of the usual causes (unprofiled device, micro-batch, collectives, emulation, load) "
                       "applies here."), icon=":material/difference:")


# ---- against the even split -----------------------------------------------------------------


def even_default_steps(even: Plan, planned_steps: int) -> int:
    """The even run's default length: as many steps as the planned run recorded, at most about
    COMPARE_WATCH_S at the even plan's predicted step, at least MIN_COMPARE_STEPS (a median over
    steps 3.. of enough of them to compare)."""
    watch = int(COMPARE_WATCH_S / even.predicted_iteration_s) if even.predicted_iteration_s > 0 else planned_steps
    return max(MIN_COMPARE_STEPS, min(planned_steps, watch, MAX_STEPS))


def render_even_run(even_m: dict[str, Any] | None, even_dir: str) -> None:
    """Where the latest even-split run stands, while it is not a finished measurement."""
    name = os.path.basename(even_dir)
    if even_m is None:
        st.caption(f"Even split: run `{name}` is starting…")
        return
    steps, target = even_m["steps"], even_m.get("steps_target") or 0
    if even_m["status"] == "running":
        done = steps[-1]["step"] if steps else 0
        st.progress(min(1.0, done / target) if target else 0.0, text=f"Even split, run {name}: step {done} of {target}")
    elif even_m["status"] == "failed":
        st.error(f"The even-split run {name} failed: {even_m.get('reason') or 'no reason recorded'}",
                 icon=":material/error:")
    elif even_m["status"] == "stopped":
        st.warning(f"The even-split run {name} was stopped: {even_m.get('reason') or 'on request'}",
                   icon=":material/stop_circle:")


def render_comparison(planned_m: dict[str, Any], even_m: dict[str, Any], with_reasons: bool) -> None:
    """Both runs measured: their median step times, the speedup, and each against its prediction
    (`with_reasons`: the planned run's likely reasons too, when the page does not show them above)."""
    from executor.compare import SKIP_STEPS, compare_runs

    try:
        c = compare_runs(planned_m, even_m)
    except ValueError as e:
        st.caption(common.error_message(e))
        return
    c1, c2, c3 = st.columns(3)
    with c1:
        common.metric("Step, planned split (median)", common.fmt_seconds(c.planned_step_s), common.MEASURED)
    with c2:
        common.metric("Step, even split (median)", common.fmt_seconds(c.even_step_s), common.MEASURED)
    with c3:
        common.metric("Speedup over the even split", f"{c.speedup:.2f}×", common.MEASURED,
                      help="even split's median step / planned split's (the same global batch: samples/s ratio)")
    faster = "faster" if c.speedup >= 1 else "slower"
    with st.container(key="launch_compare_figures"):
        st.markdown(f"{common.source_badge(common.MEASURED)} Median step over steps {SKIP_STEPS + 1}..: planned split "
                    f"{common.fmt_seconds(c.planned_step_s)} ({c.planned_steps} steps), even split "
                    f"{common.fmt_seconds(c.even_step_s)} ({c.even_steps} steps): the planned split is "
                    f"{c.speedup:.2f}× as fast ({faster}).")
        if with_reasons:
            render_gap(planned_m, prefix="Planned split: ")
        elif c.planned_predicted_s:  # the watched run: its gap and reasons are shown above
            st.caption(f"Planned split: {gap_line(c.planned_step_s, c.planned_predicted_s)}.")
        if c.even_predicted_s:
            st.caption(f"Even split: {gap_line(c.even_step_s, c.even_predicted_s)}.")


def measure_even_button(even: Plan, planned_dir: str, planned_m: dict[str, Any], again: bool) -> None:
    """Launch the even split for a short run, as a normal run beside the planned one (named after
    it: executor.compare.next_even_run_dir), on the default corpus and a random initialisation
    (the step's work is the model's, batch's and split's, not the data's); disabled while any
    run is live (the measurement needs the machine to itself, and the devices)."""
    from executor.compare import MIN_COMPARED_STEPS, SKIP_STEPS, next_even_run_dir

    planned_steps = planned_m["steps_recorded"]
    busy = state.find_live_run()
    held = [] if busy else state.devices_in_use(even)
    steps = common.number_field("Even-split steps", unit="steps", min_value=SKIP_STEPS + MIN_COMPARED_STEPS,
                                max_value=MAX_STEPS, value=even_default_steps(even, max(planned_steps, 1)), step=10,
                                key="launch_even_steps",
                                help=f"a short run; its median over steps {SKIP_STEPS + 1}.. is compared")
    if busy:
        st.caption(f"Measure the even split: disabled while run `{os.path.basename(busy)}` is live.")
    for line in held:
        st.caption(f"Measure the even split: disabled, {line}.")
    label = "Measure the even split again" if again else "Measure the even split"
    if steps is not None and st.button(label, key="launch_measure_even", icon=":material/balance:",
                                       disabled=bool(busy or held), help=(
                                           "launch the even split of the same devices, model, batch and ZeRO stage "
                                           "for a short run (a normal run, in the run history) and compare")):
        from executor.launch import start_run

        with common.show_errors("Cannot launch the even split"), st.spinner("Starting the even split…"):
            handle = start_run(even, int(steps), run_dir=next_even_run_dir(planned_dir))
            st.toast(f"Launched {os.path.basename(handle.run_dir)} (even split)", icon=":material/balance:")
            st.rerun()  # the whole page: the monitor refreshes while the even run goes


def render_compare(run_dir: str, m: dict[str, Any]) -> None:
    """The watched run against the even split of its devices: measured, not predicted. For an
    even-split run, the planned run it measured against."""
    from executor.compare import already_even, even_run_dirs, planned_run_of
    from planner.entry import even_plan

    planned_dir = planned_run_of(run_dir) or run_dir
    try:
        planned_m = m if planned_dir == run_dir else live_metrics(planned_dir)
    except ValueError:
        return  # an even-split run whose planned run is gone from the history
    plan = run_plan(planned_m)
    if plan is None or len(plan.used) < 2:
        return
    st.markdown("**Against the even split** (measured)")
    with common.show_errors("No even split to compare"):
        even = even_plan(plan)
        if len({d.profile_key for _, d in plan.cluster.devices()}) == 1:
            st.caption("The devices are alike: an even split is already what was planned, so there is nothing to "
                       "compare.")
            return
        if already_even(plan, even):
            st.caption("The plan already splits the batch and the state evenly: nothing to compare.")
            return
        evens = even_run_dirs(planned_dir)
        even_m = None
        if evens:
            with contextlib.suppress(ValueError):  # the launcher has not written its store yet
                even_m = live_metrics(evens[-1])
            if even_m is not None and even_m["status"] == "done" and planned_m["status"] != "running":
                # both ended (the panel no longer refreshes): every step of each, read once
                render_comparison(_store().read_metrics(planned_dir), _store().read_metrics(evens[-1]),
                                  with_reasons=planned_dir != run_dir)
            else:
                render_even_run(even_m, evens[-1])
        if planned_m["status"] == "running":
            st.caption("Measure the even split once this run has ended.")
            return
        measure_even_button(even, planned_dir, planned_m, again=bool(evens))


def run_is_live(run_dir: str) -> bool:
    """The run, or its latest even-split run, is running (or starting): the monitor refreshes."""
    from executor.compare import even_run_dirs, planned_run_of

    planned = planned_run_of(run_dir) or run_dir
    for d in [planned, *even_run_dirs(planned)[-1:]]:
        try:
            if _store().run_status(d) == "running":
                return True
        except ValueError:
            return True  # the launcher has not written the store yet
    return False


def validation_note(m: dict[str, Any]) -> str | None:
    """Which data the validation loss is computed on, and how often."""
    from executor.corpus import NUM_VAL_WINDOWS, VAL_EVERY, VAL_FRACTION  # torch-free

    val_steps = [s["step"] for s in m["steps"] if s["val_loss"] is not None]
    if not val_steps:
        return None
    what = f"{NUM_VAL_WINDOWS} fixed windows"
    every = f"every {val_steps[1] - val_steps[0]} steps" if len(val_steps) > 1 else f"at step {val_steps[0]}"
    return (f"Validation loss: mean cross-entropy over {what} of {m['seq']} tokens from the held-out "
            f"{VAL_FRACTION:.0%} of the corpus (every {VAL_EVERY}th document, never trained on), {every} "
            "and at the last step; the same windows each time, so the points compare.")


def render_status(m: dict[str, Any]) -> None:
    status, steps = m["status"], m["steps"]
    st.caption(f"This run: **{m.get('model')}**, global batch {m.get('global_batch')}, seq {m.get('seq')}, "
               f"{m.get('dtype')}, {m.get('world_size')} ranks")
    st.markdown(f"Run status: {status}")
    st.markdown(f"Steps recorded: {m['steps_recorded']}")
    target = m.get("steps_target") or 0
    if status == "running" and not steps:
        up = sum(1 for r in m["ranks"] if r.get("pid"))
        world = m.get("world_size") or 1
        st.progress(min(1.0, up / world), text=f"Starting: {up}/{world} ranks up, waiting for the first step…")
    elif target:
        done = steps[-1]["step"] if steps else 0
        st.progress(min(1.0, done / target), text=f"step {done} of {target}")
    if status == "failed":
        rank = f" (rank {m['failed_rank']})" if m.get("failed_rank") is not None else ""
        st.error(f"The run failed{rank}: {m.get('reason') or 'no reason recorded'}", icon=":material/error:")
    elif status == "stopped":
        st.warning(f"Stopped: {m.get('reason') or 'on request'}", icon=":material/stop_circle:")
    common.show_emulated_note(m["emulated"])


def render_numbers(m: dict[str, Any]) -> None:
    steps = m["steps"]
    c1, c2, c3, c4 = st.columns(4)
    with c1:
        common.metric("Loss", f"{steps[-1]['loss']:.4f}" if steps else "—", common.MEASURED,
                      help="training loss of the last step, nats/token")
    with c2:
        common.metric("Step time (median)", common.fmt_seconds(measured_step(m)), common.MEASURED,
                      help="median over steps 3.. (steps 1 and 2 warm up); in a long run, over its newest "
                           f"{WINDOW_STEPS:,} steps")
    with c3:
        common.metric("Step time", common.fmt_seconds(m.get("predicted_iteration_s")), common.PREDICTED,
                      help="the plan's predicted iteration time")
    with c4:
        med = measured_step(m)
        common.metric("Samples/s (median)", f"{m['global_batch'] / med:,.1f}" if med else "—", common.MEASURED,
                      help=f"global batch {m['global_batch']} / median step time")


CHART_INPUTS = ("history", "ranks", "predicted_samples_per_s", "split_changes")


@st.cache_data(show_spinner=False, max_entries=64)
def figure_specs(chart_json: str) -> tuple[dict, dict, dict, dict]:
    """The loss, throughput, memory and wait charts' Plotly figures of a live view's CHART_INPUTS
    (as JSON: one string to hash, not a nest of dicts), built once per change: every session
    watching the run shares them."""
    m = json.loads(chart_json)
    return tuple(f(m) for f in (loss_figure, throughput_figure, memory_figure, wait_figure))


def chart_figures(m: dict[str, Any]) -> tuple[dict, dict, dict, dict]:
    """figure_specs of a live view (RunFollower.refresh)."""
    return figure_specs(json.dumps({k: m.get(k) for k in CHART_INPUTS}))


def render_charts(m: dict[str, Any]) -> None:
    if not m["steps"]:
        return
    loss, speed, memory, wait = chart_figures(m)
    c1, c2 = st.columns(2)
    with c1:
        common.show_figure(loss, key="launch_loss_chart")
        note = validation_note(m)
        if note:
            st.caption(note)
    with c2:
        common.show_figure(speed, key="launch_speed_chart")
    c3, c4 = st.columns(2)
    with c3:
        common.show_figure(memory, key="launch_memory_chart")
    with c4:
        common.show_figure(wait, key="launch_wait_chart")
    width = m["history"]["width"]
    if width > 1:
        st.caption(f"Older steps are drawn as means of {width} steps, the newest {CHART_TAIL_STEPS} one by one; "
                   "every step is on **Runs** (CSV).")
    st.caption(f"Per rank: {common.source_badge(common.MEASURED)} beside the plan's "
               f"{common.source_badge(common.PREDICTED)} figures")
    common.show_table(ranks_frame(m), key="launch_ranks_table")


# ---- the straggler, per-rank predictions, the timeline of splits -------------------------------


def split_text(rows: list[dict[str, Any]]) -> str:
    """"rank 0: 12 (4×3), rank 1: 20 (4×5)" of a split's rows ({"rank", "batch", "micro_batch", "accum_steps"})."""
    return ", ".join(f"rank {r['rank']}: {r['batch']} ({r['micro_batch']}×{r['accum_steps']})" for r in rows)


def timeline_rows(plan: Plan | None, events: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The run's plans in order: the plan it started with, then each step event of
    executor.store.TIMELINE_KINDS (a rebalance's new split and reason; the others' message)."""
    rows = []
    if plan is not None:
        devices = plan.cluster.devices()
        used = plan.used
        rows.append({"from step": "1", "change": "plan", "devices": ", ".join(
            f"rank {r}: {devices[a.device_index][1].profile_key} on {a.node}" for r, a in enumerate(used)),
            "split": split_text([{"rank": r, "batch": a.batch, "micro_batch": a.micro_batch,
                                  "accum_steps": a.accum_steps} for r, a in enumerate(used)]),
            "why": f"the plan (predicted step {common.fmt_seconds(plan.predicted_iteration_s)})"
                   if plan.predicted_iteration_s else "the plan"})
    for e in events:
        if e["kind"] not in _store().TIMELINE_KINDS:
            continue
        d = e["detail"] if isinstance(e["detail"], dict) else {}
        if e["kind"] == "rebalance" and d.get("new_split"):
            why = (f"{d.get('reason', '')}; predicted step {common.fmt_seconds(d.get('predicted_step_s_before'))} "
                   f"→ {common.fmt_seconds(d.get('predicted_step_s'))}")
            rows.append({"from step": str(e["step"]), "change": "rebalance", "devices": "unchanged",
                         "split": split_text(d["new_split"]), "why": why})
        else:
            rows.append({"from step": "?" if e["step"] is None else str(e["step"]), "change": e["kind"],
                         "devices": "", "split": "", "why": e["message"]})
    return rows


def straggler_line(s: dict[str, Any]) -> str:
    """The straggler as the page says it: which rank, on which device, how much slower, its cost."""
    return (f"Straggler: **rank {s['rank']}** on **{s['device']}** is **{s['slowdown']:.2f}× slower than its "
            f"profile** (against how the other ranks match theirs; {s.get('compute_vs_profile', 0):.2f}× its "
            f"profile's compute) since step {s['since_step']}; it costs each step "
            f"**{common.fmt_seconds(s.get('cost_s'))}** (measured).")


def prediction_frame(m: dict[str, Any]) -> pd.DataFrame:
    """Per rank: measured compute and wait (medians) beside the predicted ones, and compute ÷ profile."""
    def secs(x: float | None) -> str:
        return common.fmt_cell(x, common.fmt_seconds)

    rows = []
    for r in m["ranks"]:
        compute = None if r.get("median_compute_s") is None else (
            r["median_compute_s"] + (r.get("median_emulated_delay_s") or 0.0))
        rows.append({"rank": str(r["rank"]), "split now": f"{r['micro_batch']} × {r['accum_steps']}",
                     "compute (measured)": secs(compute), "compute (predicted)": secs(r.get("median_predicted_compute_s")),
                     "wait (measured)": secs(r.get("median_wait_s")),
                     "wait (predicted)": secs(r.get("median_predicted_wait_s")),
                     "compute ÷ profile (newest steps)": common.fmt_cell(r.get("compute_vs_profile"),
                                                                           lambda x: f"{x:.2f}×")})
    return pd.DataFrame(rows)


def render_adaptive(run_dir: str, m: dict[str, Any]) -> None:
    """The straggler, the per-rank predictions and the timeline of splits; sets m["split_changes"]
    (the throughput chart's markers)."""
    try:
        events = _store().read_events(run_dir)
    except ValueError:
        events = []
    m["split_changes"] = [{"step": e["step"], "kind": e["kind"]} for e in events
                          if e["kind"] in _store().TIMELINE_KINDS and e["step"] is not None]
    s = _store().straggler_of(events)
    if s is not None:
        st.warning(straggler_line(s), icon=":material/speed:")
    if any(r.get("median_predicted_compute_s") is not None for r in m["ranks"]):
        with st.expander("Per rank: measured compute and wait beside the predicted ones", expanded=s is not None):
            common.show_table(prediction_frame(m), key="launch_prediction_table")
    rows = timeline_rows(run_plan(m), events)
    if rows:
        st.markdown("**Timeline of plans** (which devices, which split, why it changed)")
        common.show_table(pd.DataFrame(rows), key="launch_timeline_table")


def render_monitor(run_dir: str) -> None:
    live = run_is_live(run_dir)

    @st.fragment(run_every=LIVE_REFRESH_S if live else None)
    def panel() -> None:
        try:
            m = live_metrics(run_dir)
        except ValueError as e:
            st.markdown("Run status: starting")
            st.markdown("Steps recorded: 0")
            st.caption(common.error_message(e))
            return
        stop = st.button("Stop", key="stop_button", icon=":material/stop_circle:", disabled=m["status"] != "running")
        if stop:
            from executor.launch import stop_run

            with common.show_errors("Cannot stop"), st.spinner("Stopping every rank…"):
                stop_run(run_dir)
                st.rerun()  # the whole app: the sidebar's "Running" link and Launch read the store again
            m = live_metrics(run_dir)
        render_status(m)
        render_numbers(m)
        render_adaptive(run_dir, m)
        render_gap(m)
        render_compare(run_dir, m)
        render_charts(m)

    panel()


def render() -> None:
    common.page_header("Launch & monitor",
                       "Run the session's plan with torchrun on this machine and watch it live (SQLite, every second).")
    render_launch(state.get_plan())
    st.divider()
    st.subheader("Monitor")
    with common.show_errors("Cannot list the runs"):
        run_dir = pick_run()
        if run_dir:
            st.caption(f"Run folder: `{run_dir}`")
            render_monitor(run_dir)


if __name__ == "__main__":  # Streamlit runs pages as __main__; tests import the helpers above
    render()
