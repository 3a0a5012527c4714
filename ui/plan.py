"""Plan: the fastest heterogeneous plan of a model on a cluster (Cephalo's ILP, planner/hetero/solve.py).

Widgets -> one library call (`planner.entry.plan_job`, cached) -> render: the per-device table, memory
against capacity, predicted samples/s against the baselines, the plan file to download. The plan is stored
in the session (ui/state.set_plan) so that the Launch page runs it.
"""
from __future__ import annotations

import glob
import json
import logging
import os

import streamlit as st

from contracts.cluster import ClusterSpec
from planner.entry import plan_job
from planner.hetero.solve import DEFAULT_MAX_SEQ, DTYPES
from contracts.paths import EXAMPLES_DIR as EXAMPLES_ROOT
from contracts.plan import Plan
from planner.core.profiles import split_profile_key
from contracts.specs import PRESETS
from contracts.specs import get_model as get_model_spec
from contracts.specs import with_max_seq
from contracts.uploads import cluster_from_upload
from ui import background
from ui.compute import profile_kinds
from ui.charts import bar_chart, capacity_chart
from ui.common import (MEASURED, PREDICTED, error_message, fmt_bytes, fmt_percent, fmt_rate, fmt_seconds, labelled,
                       metric, number_field, page_header, page_link, parse_upload, profiles_version,
                       show_emulated_note, show_errors, show_figure, show_table)
from ui.state import DEFAULT_GLOBAL_BATCH, clear_plan, get_cluster, get_model, get_plan, set_plan
from contracts.constants import GIB, MEMORY_HEADROOM

log = logging.getLogger(__name__)

EXAMPLES_DIR = os.path.join(EXAMPLES_ROOT, "clusters")
SESSION_SOURCE = "This machine (session cluster)"
UPLOAD_SOURCE = "Upload a cluster file…"
HEADROOM = MEMORY_HEADROOM  # the planner's default: the capacity line on the memory chart
JOB = "plan"  # this page's background job (ui/background.py)
REQUEST = "plan_request"  # session key: the compute_plan arguments asked for and not yet answered
FAILED = "plan_failed"  # session key: the last request ended in an error (no plan shown)
AUTO_STARTED = "plan_auto_started"  # the first open asked for a default plan once (not again after Cancel)


@st.cache_data(show_spinner="Solving the plan…", max_entries=32)
def compute_plan(cluster_json: str, model: str, global_batch: int, seq: int | None, dtype: str,
                 profiles_version: int = 0) -> Plan:
    """plan_job (what `planner plan` runs) on a cluster given as JSON (hashable for the cache), in this
    session's background process (ui/background.py: cancellable, killed with the session). Raises ValueError, and
    background.Pending while the solver runs (not cached). `profiles_version` only keys the
    cache: a new profile ("Profile now") re-solves."""
    cluster = ClusterSpec.from_dict(json.loads(cluster_json))
    return background.result_of(JOB, plan_job, cluster, model, global_batch, seq=seq, dtype=dtype,
                                headroom=HEADROOM).plan


def example_clusters() -> dict[str, str]:
    return {os.path.basename(p): p for p in sorted(glob.glob(os.path.join(EXAMPLES_DIR, "*.json")))}


def choose_cluster() -> ClusterSpec | None:
    examples = example_clusters()
    source = st.selectbox("Cluster", [SESSION_SOURCE, *examples, UPLOAD_SOURCE], key="plan_cluster_source")
    if source == SESSION_SOURCE:
        return get_cluster()
    if source == UPLOAD_SOURCE:
        up = st.file_uploader("Cluster file (JSON)", type=["json"], key="plan_cluster_upload")
        if up is None:
            st.info("Upload a cluster file to plan for it.")
            return None
        return parse_upload(up, cluster_from_upload, "Bad cluster file")
    with show_errors("Bad cluster file"):
        return ClusterSpec.load(examples[source])
    return None


MAX_GLOBAL_BATCH = 1_000_000
MAX_SEQ = 131_072  # tokens: the planner extends a learned position table past the model's own


def default_seq(model: str) -> int:
    """The sequence length the planner uses when none is given: the model's own, at most
    DEFAULT_MAX_SEQ (planner/hetero/solve.py)."""
    return min(get_model_spec(model).max_seq, DEFAULT_MAX_SEQ)


def inputs() -> tuple[ClusterSpec | None, str, int | None, int | None, str]:
    """The cluster, model, global batch, sequence length and dtype; None for a number out of range
    (its error is shown under the field)."""
    cluster = choose_cluster()
    current = get_model()
    models = list(PRESETS) if current in PRESETS else [current, *PRESETS]
    c1, c2, c3, c4 = st.columns(4)
    model = c1.selectbox("Model", models, index=models.index(current), key="plan_model")
    batch = number_field("Global batch", unit="samples", min_value=1, max_value=MAX_GLOBAL_BATCH,
                         value=DEFAULT_GLOBAL_BATCH, step=1, key="plan_global_batch", where=c2)
    seq = None
    with show_errors(f"Unknown model {model}"):
        own = default_seq(model)
        # one field per model, so that each starts at its own default
        seq = number_field("Sequence length", unit="tokens", min_value=1, max_value=MAX_SEQ, value=own, step=64,
                           key=f"plan_seq:{model}", where=c3,
                           help=f"{model}'s default: {own:,} (its context, at most {DEFAULT_MAX_SEQ:,})")
    dtype = c4.selectbox("Dtype", DTYPES, key="plan_dtype")
    return cluster, model, batch, seq, dtype


def device_rows(plan: Plan) -> list[dict]:
    """One row per device, every cell text a person reads (units in the column names)."""
    devices = plan.cluster.devices()
    return [{
        "device": str(a.device_index), "node": a.node, "type": devices[a.device_index][1].label,
        "micro-batch": str(a.micro_batch), "accum. steps": str(a.accum_steps), "batch (samples)": str(a.batch),
        "state shard": fmt_percent(100.0 * a.shard_fraction),
        labelled("memory", PREDICTED): fmt_bytes(a.predicted_memory_bytes),
        "capacity": fmt_bytes(devices[a.device_index][1].memory_bytes),
        labelled("step", PREDICTED): fmt_seconds(a.predicted_step_s) if a.used else "—",
        "used": "yes" if a.used else "no (not needed)",
    } for a in plan.assignments]


def memory_figure(plan: Plan):
    """Each device's predicted peak as a bar, its capacity as a thick marker across the bar (a bar
    over its capacity shows above it) and the planner's headroom as a thinner one."""
    devices = plan.cluster.devices()
    names = [f"{a.device_index} · {devices[a.device_index][1].label}" for a in plan.assignments]
    capacity = [devices[a.device_index][1].memory_bytes / GIB for a in plan.assignments]
    predicted = [a.predicted_memory_bytes / GIB for a in plan.assignments]
    # a tiny model next to a large capacity would be an invisible sliver on a linear axis: a log
    # axis, labelled at powers of ten only (no labelled minor ticks)
    log_y = max(predicted, default=0) < 0.02 * max(capacity, default=1)
    return capacity_chart(
        names, predicted, capacity, "device", "memory (GiB)", "Memory per device: predicted vs capacity",
        value_name="predicted peak", capacity_name="capacity",
        value_labels=[fmt_bytes(a.predicted_memory_bytes) for a in plan.assignments],
        capacity_labels=[fmt_bytes(c * GIB) for c in capacity],
        marks={f"capacity × {HEADROOM:g}": [c * HEADROOM for c in capacity]}, log_y=log_y)


def throughput_figure(plan: Plan):
    """The plan's predicted samples/s beside each baseline's, each bar labelled with its value
    (a baseline that does not fit: no bar, "out of memory")."""
    names, rates, text = ["GPUMix plan"], [plan.predicted_samples_per_s], [fmt_rate(plan.predicted_samples_per_s)]
    for name, b in plan.baselines.items():
        names.append(name.replace("_", " "))
        if b.oom or not b.predicted_iteration_s:
            rates.append(0.0)
            text.append("out of memory")
        else:
            rate = plan.global_batch / b.predicted_iteration_s
            rates.append(rate)
            text.append(fmt_rate(rate))
    return bar_chart(names, {labelled("throughput", PREDICTED): rates}, "plan", "throughput (samples/s, predicted)",
                     "Predicted samples/s vs baselines", labels={labelled("throughput", PREDICTED): text})


@st.cache_data(show_spinner=False, max_entries=32)
def figure_specs(plan_json: str) -> tuple[dict, dict]:
    """The memory and throughput charts' Plotly figures of a plan (its plan file's JSON: every
    figure they draw is in it), built once for every session that shows that plan."""
    plan = Plan.from_dict(json.loads(plan_json))
    return memory_figure(plan), throughput_figure(plan)


def same_as_baselines(plan: Plan) -> bool:
    """Every baseline that fits predicts the plan's own throughput (within 0.5 %)."""
    rates = [plan.global_batch / b.predicted_iteration_s for b in plan.baselines.values()
             if not b.oom and b.predicted_iteration_s]
    return bool(rates) and all(abs(r - plan.predicted_samples_per_s) <= 0.005 * plan.predicted_samples_per_s
                               for r in rates)


def unmeasured_kinds(plan: Plan) -> list[str]:
    """The device kinds (type, or type@share) the plan's used devices were priced on estimated,
    not measured, step profiles (the profile store has none for its model, seq, dtype)."""
    from planner.core.profiles import get_step_profile

    spec = with_max_seq(get_model_spec(plan.model), plan.seq)
    devices = plan.cluster.devices()
    kinds = sorted({devices[a.device_index][1].profile_key for a in plan.assignments if a.used})
    return [k for k in kinds
            if not get_step_profile(k, spec, plan.seq, plan.dtype, plan.recompute).measured]


def local_types() -> set[str]:
    from profiler.inventory import detect_devices  # torch: only when a plan is shown

    return {d.catalog_type for d in detect_devices()}


def render_estimated(plan: Plan) -> None:
    """Say plainly when the figures are estimates, and offer the one click that measures them:
    profile this machine's device type (once: the profile store keeps it), then plan again."""
    kinds = unmeasured_kinds(plan)
    if not kinds:
        return
    st.warning(f"**Estimated, not measured**: no step profile of {plan.model} at seq {plan.seq}, {plan.dtype} on "
               f"{', '.join(kinds)} yet, so the step times and throughput below are estimates; a run's measured "
               "step can differ from them by a factor of 2 or more.", icon=":material/warning:")
    local = local_types()
    here = [k for k in kinds if split_profile_key(k)[0] in local]
    elsewhere = [k for k in kinds if k not in here]
    if elsewhere:
        st.caption(f"Not on this machine: {', '.join(elsewhere)}. Measure them where they are "
                   f"(`python -m profiler profile --model {plan.model} --seq {plan.seq} --dtype {plan.dtype}`) "
                   "and copy the profile store here.")
    if here and plan.recompute == "none" and st.button(
            f"Profile {', '.join(here)} now and plan again (measured; once, kept in the profile store)",
            key="plan_profile_now", type="primary", icon=":material/speed:"):
        bar = st.progress(0.0, text="starting")
        with show_errors("Profiling failed"):
            profile_kinds(plan, here, lambda f, m: bar.progress(min(1.0, max(0.0, f)), text=m))
            from planner.schedule.options import clear_caches  # the scheduler's cached profile figures

            clear_caches()
            st.session_state[REQUEST] = (json.dumps(plan.cluster.to_dict()), plan.model, plan.global_batch,
                                         plan.seq, plan.dtype, profiles_version())
            st.rerun()


def render(plan: Plan) -> None:
    st.subheader(f"{plan.model} on {plan.cluster.name}: global batch {plan.global_batch}, seq {plan.seq}, {plan.dtype}")
    c1, c2, c3 = st.columns(3)
    with c1:
        metric("Iteration time", fmt_seconds(plan.predicted_iteration_s), PREDICTED)
    with c2:
        metric("Throughput", fmt_rate(plan.predicted_samples_per_s), PREDICTED)
    with c3:
        metric("Solve time", fmt_seconds(plan.solve_s), MEASURED)
    render_estimated(plan)
    for note in plan.notes:
        st.caption(f":material/info: {note}")
    show_table(device_rows(plan), key="plan_table")
    show_emulated_note(plan.cluster.emulated)
    memory_spec, throughput_spec = figure_specs(plan.to_json())
    left, right = st.columns(2)
    with left:
        show_figure(memory_spec, key="plan_memory_chart")
    with right:
        show_figure(throughput_spec, key="plan_baselines_chart")
        if same_as_baselines(plan):
            st.caption("The plan and its baselines predict the same throughput: this cluster's devices are "
                       "identical, so an even split is already the fastest. Add a slower or smaller device "
                       "on **Inventory** (emulated) to see an uneven split win.")
    st.download_button("Download the plan (JSON)", plan.to_json(), file_name=f"plan-{plan.cluster.name}.json",
                       mime="application/json", key="plan_download")
    page_link("ui/launch.py", "Launch this plan", icon=":material/rocket_launch:")


page_header("Plan", "Per-device micro-batch, accumulation steps and state shard for a mixed cluster: "
                    "no device out of memory, the shortest predicted iteration.")
cluster, model, batch, seq, dtype = inputs()
valid = cluster is not None and batch is not None and seq is not None
clicked = st.button("Compute plan", key="plan_compute", type="primary", disabled=not valid)
if valid and (clicked or (get_plan() is None and not st.session_state.get(AUTO_STARTED))):
    st.session_state[AUTO_STARTED] = True
    st.session_state[REQUEST] = (json.dumps(cluster.to_dict()), model, batch, seq, dtype, profiles_version())
    st.session_state.pop(FAILED, None)
request = st.session_state.get(REQUEST)
if request is not None:
    try:
        set_plan(compute_plan(*request))
        st.session_state.pop(REQUEST, None)  # answered
    except background.Pending:
        background.show_pending(JOB, "Solving the plan…", "plan_cancel",
                                on_cancel=lambda: st.session_state.pop(REQUEST, None))
    except (ValueError, OSError, background.ChildFailed) as e:
        # a failed plan: the previous one (and its launch link) must not stay on screen
        log.info("plan failed: %s", e, exc_info=not isinstance(e, ValueError))
        clear_plan()
        st.session_state[FAILED] = error_message(e)
        st.session_state.pop(REQUEST, None)
if st.session_state.get(FAILED):
    st.error(f"Cannot compute the plan: {st.session_state[FAILED]}", icon=":material/error:")
plan = get_plan()
if plan is not None:
    if cluster is None or (plan.cluster.name, plan.model, plan.global_batch, plan.seq, plan.dtype) != (
            cluster.name, model, batch, seq, dtype):
        st.caption("Showing the last computed plan: press **Compute plan** for the inputs above.")
    render(plan)
