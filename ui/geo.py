"""Geo: training across datacenters over a WAN (Atlas) with prefill in the bubbles (BubbleTea).

Widgets (datacenters, WAN links, model and batch, inference workload) -> one library call
(`planner.geo.evaluate.simulate_geo`, cached) -> render: the plan, a Gantt timeline of one
simulated iteration (training and prefill in different colours), GPU utilization and
iteration time against the baselines. Every figure here is simulated from the cost model.
"""
from __future__ import annotations

import glob
import json
import math
import os
from typing import Any

import pandas as pd
import streamlit as st

from planner.core.catalog import CATALOG
from planner.geo.evaluate import GeoReport, simulate_geo
from planner.geo.scenario import DEFAULT_INTRA_DC_GBPS, DEFAULT_TCP_WINDOW_BYTES, GeoScenario
from planner.core.paths import PROJECT_ROOT
from planner.core.specs import PRESETS
from ui import background
from ui.charts import bar_chart, gantt_chart
from ui.common import (SIMULATED, fmt_cell, fmt_percent, fmt_seconds, metric, number_field, page_header, show_errors, show_figure,
                       show_table)
from planner.core.constants import GIB

MIB = 2**20

EXAMPLES_DIR = os.path.join(PROJECT_ROOT, "examples", "geo")
DEFAULT_EXAMPLE = "paper_like.json"
MAX_GANTT_PIPELINES = 4  # rows of the timeline: every stage of the first few pipelines
COLORS = {"F": "#1f77b4", "B": "#ff7f0e", "AR": "#7f7f7f", "OPT": "#9467bd", "P": "#2ca02c"}
NAMES = {"F": "training forward", "B": "training backward", "AR": "gradient all-reduce", "OPT": "optimizer step",
         "P": "prefill (BubbleTea)"}
JOB = "geo"  # this page's background job (ui/background.py)
REQUEST = "geo_request"  # session key: the scenario JSON asked for and not yet answered


@st.cache_data(show_spinner="Planning and simulating…", max_entries=16)
def compute(scenario_json: str) -> GeoReport:
    """simulate_geo on a scenario given as JSON (hashable for the cache), in this session's background
    process (ui/background.py: cancellable, killed with the session). Raises ValueError, and
    background.Pending while it runs (not cached)."""
    return background.result_of(JOB, simulate_geo, GeoScenario.from_dict(json.loads(scenario_json)))


def examples() -> dict[str, str]:
    return {os.path.basename(p): p for p in sorted(glob.glob(os.path.join(EXAMPLES_DIR, "*.json")))}


def load_example(name: str) -> dict[str, Any]:
    with open(examples()[name], encoding="utf-8") as fh:
        return json.load(fh)


def reset_editors() -> None:
    for key in ("geo_dcs", "geo_links", "geo_model", "geo_global_batch", "geo_micro_batch", "geo_seq",
                "geo_inf_model", "geo_prompts", "geo_mode", "geo_rate"):
        st.session_state.pop(key, None)
    st.session_state.pop("geo_report", None)


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v == ""


def scenario_from_widgets(dcs: pd.DataFrame, links: pd.DataFrame, fields: dict[str, Any]) -> dict[str, Any]:
    """The scenario JSON (DESIGN.md) from the editors' rows; one row per (datacenter, GPU type)."""
    centers: dict[str, dict[str, Any]] = {}
    for i, row in enumerate(dcs.to_dict("records"), start=1):
        if all(_blank(v) for v in row.values()):
            continue
        if _blank(row.get("name")) or _blank(row.get("gpu_type")) or _blank(row.get("count")):
            raise ValueError(f"datacenter row {i}: name, gpu_type and count are all needed")
        dc = centers.setdefault(str(row["name"]), {"name": str(row["name"]), "gpus": {}})
        dc["gpus"][str(row["gpu_type"])] = dc["gpus"].get(str(row["gpu_type"]), 0) + float(row["count"])
        if not _blank(row.get("intra_dc_gbps")):
            dc["intra_dc_gbps"] = float(row["intra_dc_gbps"])
    for dc in centers.values():
        dc["gpus"] = {k: int(v) if float(v).is_integer() else v for k, v in dc["gpus"].items()}
    wan = []
    for i, row in enumerate(links.to_dict("records"), start=1):
        if all(_blank(v) for v in row.values()):
            continue
        if any(_blank(row.get(k)) for k in ("a", "b", "gbps", "rtt_ms")):
            raise ValueError(f"wan link row {i}: a, b, gbps and rtt_ms are all needed")
        link = {"a": str(row["a"]), "b": str(row["b"]), "gbps": float(row["gbps"]), "rtt_ms": float(row["rtt_ms"])}
        if not _blank(row.get("per_connection_gbps")):
            link["per_connection_gbps"] = float(row["per_connection_gbps"])
        if not _blank(row.get("tcp_window_mib")):
            link["tcp_window_bytes"] = int(round(float(row["tcp_window_mib"]) * MIB))
        wan.append(link)
    return {"name": fields["name"], "datacenters": list(centers.values()), "wan": wan, **fields["training"],
            "inference": fields["inference"]}


def parse_prompts(text: str) -> list[int]:
    try:
        tokens = [int(x) for x in text.replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"prompt lengths must be comma-separated integers, got {text!r}") from None
    if not tokens:
        raise ValueError("give at least one prompt length")
    return tokens


def inputs(example: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The editors; the scenario dict, or None after showing the error."""
    st.subheader("Datacenters and WAN links")
    # defaults shown as values: the planner's intra-DC bandwidth and TCP window (planner/geo/scenario.py)
    dc_rows = [{"name": dc["name"], "gpu_type": t, "count": n,
                "intra_dc_gbps": dc.get("intra_dc_gbps", DEFAULT_INTRA_DC_GBPS)}
               for dc in example["datacenters"] for t, n in dc["gpus"].items()]
    types = sorted(t for t in CATALOG if t != "cpu")
    dcs = st.data_editor(
        pd.DataFrame(dc_rows, columns=["name", "gpu_type", "count", "intra_dc_gbps"]), key="geo_dcs",
        num_rows="dynamic", width="stretch",
        column_config={"gpu_type": st.column_config.SelectboxColumn("GPU type", options=types),
                       "count": st.column_config.NumberColumn("GPUs", min_value=1, step=1),
                       "intra_dc_gbps": st.column_config.NumberColumn(
                           "intra-DC Gbit/s", min_value=0.1, help=f"default {DEFAULT_INTRA_DC_GBPS:g}")})
    # a measured single-connection rate only where the example has one (else: window / RTT)
    measured = any(l.get("per_connection_gbps") is not None for l in example["wan"])
    columns = ["a", "b", "gbps", "rtt_ms", "tcp_window_mib"] + (["per_connection_gbps"] if measured else [])
    link_rows = [{"a": l["a"], "b": l["b"], "gbps": l["gbps"], "rtt_ms": l["rtt_ms"],
                  "tcp_window_mib": l.get("tcp_window_bytes", DEFAULT_TCP_WINDOW_BYTES) / MIB,
                  "per_connection_gbps": l.get("per_connection_gbps")} for l in example["wan"]]
    links = st.data_editor(
        pd.DataFrame(link_rows, columns=columns), key="geo_links",
        num_rows="dynamic", width="stretch",
        column_config={"gbps": st.column_config.NumberColumn("Gbit/s", min_value=0.001),
                       "rtt_ms": st.column_config.NumberColumn("RTT (ms)", min_value=0.1),
                       "tcp_window_mib": st.column_config.NumberColumn(
                           "TCP window (MiB)", min_value=0.01,
                           help="one TCP connection carries window / RTT (default "
                                f"{DEFAULT_TCP_WINDOW_BYTES / MIB:g} MiB)"),
                       "per_connection_gbps": st.column_config.NumberColumn(
                           "one TCP connection (Gbit/s, measured)", help="empty: window / RTT")})
    st.subheader("Training and inference")
    models = list(PRESETS)
    c1, c2, c3, c4 = st.columns(4)
    model = c1.selectbox("Model", models, index=models.index(example["model"]) if example["model"] in models else 0,
                         key="geo_model")
    batch = number_field("Global batch", unit="sequences", min_value=1, max_value=1_000_000,
                         value=int(example["global_batch"]), key="geo_global_batch", where=c2)
    micro = number_field("Micro-batch", unit="sequences", min_value=1, max_value=4096,
                         value=int(example.get("micro_batch", 1)), key="geo_micro_batch", where=c3)
    seq = number_field("Sequence", unit="tokens", min_value=16, max_value=131_072, value=int(example.get("seq", 2048)),
                       step=256, key="geo_seq", where=c4)
    inf = example.get("inference") or {"model": "llama3-8b", "prompt_tokens": 1024, "backlog": True}
    pt = inf["prompt_tokens"]
    pt_text = ", ".join(str(t) for t in (pt["tokens"] if isinstance(pt, dict) else pt if isinstance(pt, list) else [pt]))
    c1, c2, c3, c4 = st.columns(4)
    inf_model = c1.selectbox("Prefill model", models, index=models.index(inf["model"]) if inf["model"] in models else 0,
                             key="geo_inf_model")
    prompts = c2.text_input("Prompt lengths (tokens, equally likely)", value=pt_text, key="geo_prompts")
    mode = c3.radio("Requests", ["backlog", "arrival rate"], index=0 if inf.get("backlog") else 1, key="geo_mode",
                    horizontal=True)
    rate = 0.0
    if mode != "backlog":
        rate = number_field("Arrival rate", unit="requests/s", min_value=0.1, max_value=100_000.0,
                            value=float(inf.get("requests_per_s") or 50.0), key="geo_rate", where=c4)
    if None in (batch, micro, seq, rate):
        return None  # the field's error is shown under it
    with show_errors("Bad scenario"):
        workload: dict[str, Any] = {"model": inf_model, "prompt_tokens": parse_prompts(prompts)}
        workload.update({"backlog": True} if mode == "backlog" else {"requests_per_s": float(rate)})
        fields = {"name": os.path.splitext(name)[0],
                  "training": {"model": model, "global_batch": int(batch), "micro_batch": int(micro), "seq": int(seq)},
                  "inference": workload}
        scenario = scenario_from_widgets(dcs, links, fields)
        GeoScenario.from_dict(scenario)  # validate now: the error names the problem
        return scenario
    return None


def gantt(report: GeoReport):
    """One simulated iteration: a row per GPU (pipeline, stage) of the first few pipelines, a bar per
    operation from its start to its end, one colour per kind (training forward, backward, ..., prefill)."""
    d = min(report.plan.num_pipelines, MAX_GANTT_PIPELINES)
    stages = report.plan.stages

    def row(r: int, j: int) -> str:
        return f"p{r} s{j} · {stages[j].dc} {stages[j].gpu_type}"

    ops = [(o.kind, o.pipeline, o.stage, o.start_s, o.end_s)
           for o in [*report.sim.ops, *report.sim.step_ops]]  # step_ops: the optimizer step after the collectives
    ops += [("P", p.pipeline, p.stage, p.start_s, p.end_s)
            for p in (report.prefill.placements if report.prefill is not None else [])]
    rows = [{"row": row(pipeline, stage), "start": start, "end": end, "color": NAMES[kind]}
            for kind, pipeline, stage, start, end in ops if pipeline < d]
    order = [row(r, j) for r in range(d) for j in range(len(stages))]
    shown = f"pipelines 0–{d - 1} of {report.plan.num_pipelines}" if d < report.plan.num_pipelines else "all pipelines"
    return gantt_chart(rows, "time in the iteration (s, simulated)", "GPU (pipeline, stage)",
                       f"One iteration, simulated ({shown})", row_order=order,
                       color_order=[NAMES[k] for k in COLORS], colors={NAMES[k]: c for k, c in COLORS.items()})


def comparison_figures(report: GeoReport):
    """Iteration time and GPU utilization of the plan beside each baseline (simulated), each bar
    labelled with its value; utilization also with prefill in the bubbles when a workload is given."""
    names = ["atlas (plan)"] + [name.replace("_", " ") for name in report.baselines]
    its = [report.sim.iteration_s] + [b.iteration_s for b in report.baselines.values()]
    utils = [report.sim.gpu_utilization()] + [b.gpu_utilization for b in report.baselines.values()]
    keep = [i for i, t in enumerate(its) if t is not None]
    x = [names[i] for i in keep]
    it_name = "iteration (simulated)"
    fig_t = bar_chart(x, {it_name: [its[i] for i in keep]}, "plan", "iteration time (s, simulated)",
                      "Iteration time, simulated (lower is better)",
                      labels={it_name: [fmt_seconds(its[i]) for i in keep]})
    util = {"training only": [100 * utils[i] for i in keep]}
    if report.prefill is not None:
        util["with prefill (BubbleTea)"] = [100 * report.prefill.gpu_utilization_with_prefill()] + [None] * (len(x) - 1)
    fig_u = bar_chart(x, util, "plan", "GPU utilization (%, simulated)", "GPU utilization, simulated",
                      labels={k: [fmt_percent(v) if v is not None else "" for v in vs] for k, vs in util.items()},
                      colors={"training only": COLORS["F"], "with prefill (BubbleTea)": COLORS["P"]})
    return fig_t, fig_u


def render(report: GeoReport) -> None:
    out = report.to_dict()
    plan = out["plan"]
    c = st.columns(5)
    with c[0]:
        metric("Iteration", fmt_seconds(out["iteration_s"]), SIMULATED)
    with c[1]:
        dp = out.get("speedup_vs_dp_across_dcs")
        metric("vs DP across DCs", f"{dp:.1f}× faster" if dp else "n/a", SIMULATED)
    with c[2]:
        metric("GPU utilization", f"{100 * out['gpu_utilization']:.1f} %", SIMULATED)
    with c[3]:
        metric("with prefill", f"{100 * out['gpu_utilization_with_prefill']:.1f} %", SIMULATED)
    with c[4]:
        rate = out["prefill_tokens_per_s"]
        metric("Prefill", f"{rate / 1e3:,.1f}k tok/s" if rate >= 1e4 else f"{rate:,.0f} tok/s", SIMULATED,
               help="prefill tokens per second of the training iteration")
    st.subheader("Plan")
    st.markdown(
        f"Pipeline **{' → '.join(plan['datacenters'])}**, {plan['dp_degree']} data-parallel pipelines × "
        f"{plan['num_stages']} stages ({sum(plan['gpus_per_dc'].values())} GPUs), recompute {plan['recompute']}, "
        f"WAN turn order {plan['link_order']}; TCP connections per transfer: "
        f"{', '.join(f'{k}: {v}' for k, v in plan['connections'].items()) or 'no WAN hop'}.")
    if out["wan_utilization"]:
        st.caption("WAN utilization per link direction (simulated): " +
                   ", ".join(f"{k} {100 * v:.0f} %" for k, v in sorted(out["wan_utilization"].items())))
    show_table(pd.DataFrame([{
        "stage": j, "datacenter": s["dc"], "GPU": s["gpu_type"],
        "layers": f"{s['first_layer']}–{s['first_layer'] + s['num_layers'] - 1}",
        "forward (s, predicted)": f"{s['forward_s']:.4f}", "backward (s, predicted)": f"{s['backward_s']:.4f}",
        "memory (GiB, predicted)": f"{s['memory_bytes'] / GIB:.1f}", "capacity (GiB)": f"{s['capacity_bytes'] / GIB:.1f}",
    } for j, s in enumerate(plan["stages"])]))
    show_figure(gantt(report), key="geo_gantt")
    fig_t, fig_u = comparison_figures(report)
    c1, c2 = st.columns(2)
    with c1:
        show_figure(fig_t, key="geo_iteration_bars")
    with c2:
        show_figure(fig_u, key="geo_util_bars")
    show_table(pd.DataFrame([{"baseline": k, "iteration (s, simulated)": fmt_cell(v["iteration_s"], lambda x: f"{x:.2f}"),
                              "GPUs": v["num_gpus"], "what": v["description"], "note": v["note"]}
                             for k, v in out["baselines"].items()]))
    if report.prefill is not None:
        pre = out["prefill"]
        st.caption(f"BubbleTea (simulated): {pre['prefill_requests_served']} prefill requests in one iteration on "
                   "idle GPU time only (a bar past the iteration's end continues into the next iteration's start); "
                   f"on stage{'s' if len(pre['eligible_stages']) != 1 else ''} "
                   f"{', '.join(str(x) for x in pre['eligible_stages']) or 'none'}; the training timeline is "
                   f"{'unchanged' if out['training_unchanged_by_prefill'] else 'CHANGED'} by prefill. {pre['note']}")


page_header("Geo", "Train across datacenters over a WAN (Atlas: pipeline across DCs, data parallel inside, "
                   "several TCP connections, WAN shared in turns) and fill the bubbles with inference prefill "
                   "(BubbleTea). All figures are simulated.")
names = list(examples())
if not names:
    st.error(f"no example scenarios in {EXAMPLES_DIR}")
    st.stop()
choice = st.selectbox("Start from example", names, index=names.index(DEFAULT_EXAMPLE) if DEFAULT_EXAMPLE in names else 0,
                      key="geo_example", on_change=reset_editors)
scenario = inputs(load_example(choice), choice)
current = json.dumps(scenario, sort_keys=True) if scenario is not None else None
if st.button("Plan", key="geo_plan", type="primary", disabled=scenario is None) and current is not None:
    st.session_state.pop("geo_report", None)
    st.session_state[REQUEST] = current
request = st.session_state.get(REQUEST)
if request is not None:
    try:
        with show_errors("Cannot plan this scenario"):
            st.session_state["geo_report"] = (request, compute(request))
        st.session_state.pop(REQUEST, None)  # answered: a report or an error
    except background.Pending:
        background.show_pending(JOB, "Planning and simulating…", "geo_cancel",
                                on_cancel=lambda: st.session_state.pop(REQUEST, None))
shown = st.session_state.get("geo_report")
if shown is not None:
    if shown[0] != current:
        st.info("The inputs changed since this plan: press Plan to update it.")
    render(shown[1])
