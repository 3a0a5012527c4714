"""Geo: training across datacenters over a WAN (Atlas) with prefill in the bubbles (BubbleTea).

Widgets (datacenters, WAN links, model and batch, inference workload) -> one library call
(`planner.geo.evaluate.simulate_geo`, cached) -> render: the plan, a Gantt timeline of one
simulated iteration (training and prefill in different colours), GPU utilization and
iteration time against the baselines. Those figures are simulated from the cost model.

The kind of every cut between datacenters (pipeline, DiLoCo with its H, or synchronous DP), chosen
by predicted time to a target loss (`planner.geo.cuts.choose_geo_cuts`, its own background job), with
each candidate's WAN bytes per step; and, from a `bench/geo_real.py --json` output, the candidates'
measured loss curves at equal wall time per link rate.

Below them, measured runs: a run of a pipeline plan (`executor launch`, rank 0 writes
`timeline.json`: every forward, backward, send, receive, sync and prefill of one step, on one
machine clock) drawn as a Gantt beside the plan's own simulated timeline (`plan.pipeline.
simulated_ops`, which the planner wrote into the plan file), and per stage the measured against the
simulated busy time (forward + backward) with the error; the run's prefill summaries
(`prefill_rank<r>.json`, executor/prefill.py) when it ran BubbleTea. The page reads those files as
JSON (no torch import: the page stays fast); runs come from executor.store.list_runs like the Runs
page's.
"""
from __future__ import annotations

import glob
import json
import math
import os
import statistics
from typing import Any

import pandas as pd
import streamlit as st

from contracts.catalog import CATALOG
from contracts.plan import Plan
from planner.geo.bubbletea import reservations
from planner.geo.cuts import CutChoice, choose_geo_cuts
from planner.geo.evaluate import GeoReport, simulate_geo
from planner.geo.scenario import DEFAULT_INTRA_DC_GBPS, DEFAULT_TCP_WINDOW_BYTES, GeoScenario
from contracts.paths import EXAMPLES_DIR as EXAMPLES_ROOT, confined_path
from contracts.specs import PRESETS
from ui import background
from ui.charts import bar_chart, gantt_chart, line_chart
from ui.common import (MEASURED, SIMULATED, error_message, fmt_cell, fmt_percent, fmt_rate, fmt_seconds, metric,
                       number_field, page_header, show_errors, show_figure, show_table)
from contracts.constants import GIB

MIB = 2**20

EXAMPLES_DIR = os.path.join(EXAMPLES_ROOT, "geo")
DEFAULT_EXAMPLE = "paper_like.json"
MAX_GANTT_PIPELINES = 4  # rows of the timeline: every stage of the first few pipelines
COLORS = {"F": "#1f77b4", "B": "#ff7f0e", "AR": "#7f7f7f", "OPT": "#9467bd", "P": "#2ca02c"}
NAMES = {"F": "training forward", "B": "training backward", "AR": "gradient all-reduce", "OPT": "optimizer step",
         "P": "prefill (BubbleTea)"}
# the measured timeline's op names (timeline.json) -> the legend's names, shared with the simulated Gantt
OP_NAMES = {"forward": NAMES["F"], "backward": NAMES["B"], "grad_sync": NAMES["AR"], "optimizer": NAMES["OPT"],
            "prefill": NAMES["P"], "send_fwd": "send", "send_bwd": "send", "recv_fwd": "receive (posted → arrived)",
            "recv_bwd": "receive (posted → arrived)"}
OP_COLORS = {NAMES["F"]: COLORS["F"], NAMES["B"]: COLORS["B"], NAMES["AR"]: COLORS["AR"], NAMES["OPT"]: COLORS["OPT"],
             NAMES["P"]: COLORS["P"], "send": "#17becf", "receive (posted → arrived)": "#d9d9d9"}
SIM_KINDS = {"F": "forward", "B": "backward", "AR": "grad_sync", "TIED": "grad_sync", "OPT": "optimizer", "P": "prefill"}
BUSY_OPS = ("forward", "backward")  # what a stage's busy time counts, measured and simulated alike
TIMELINE_FILE = "timeline.json"
WARMUP_STEPS = 1  # the measured iteration is the median step after these
JOB = "geo"  # this page's background job (ui/background.py)
CUTS_JOB = "geo_cuts"  # the cut choice's background job
CUT_KINDS = ("dp", "pipeline", "diloco")
REQUEST = "geo_request"  # session key: the scenario JSON asked for and not yet answered


@st.cache_data(show_spinner="Planning and simulating…", max_entries=16)
def compute(scenario_json: str) -> GeoReport:
    """simulate_geo on a scenario given as JSON (hashable for the cache), in this session's background
    process (ui/background.py: cancellable, killed with the session). Raises ValueError, and
    background.Pending while it runs (not cached)."""
    return background.result_of(JOB, simulate_geo, GeoScenario.from_dict(json.loads(scenario_json)))


@st.cache_data(show_spinner=False, max_entries=16)
def compute_cuts(scenario_json: str, _report: GeoReport) -> CutChoice:
    """choose_geo_cuts for the scenario and its Atlas plan (`_report`'s, the one the scenario gave: not
    hashed), in the background job CUTS_JOB."""
    return background.result_of(CUTS_JOB, choose_geo_cuts, GeoScenario.from_dict(json.loads(scenario_json)),
                                _report.plan)


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
    # prefill past the iteration's end runs at the start of the next, the same time of every iteration
    ops += [("P", r, j, s, e) for (r, j), ivs in (reservations(report.prefill).items() if report.prefill else [])
            for s, e in ivs]
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
    # every bar over all the scenario's GPUs (a GPU a plan leaves out counts as idle), as the baselines' are
    utils = [report.gpu_utilization()] + [b.gpu_utilization for b in report.baselines.values()]
    keep = [i for i, t in enumerate(its) if t is not None]
    x = [names[i] for i in keep]
    it_name = "iteration (simulated)"
    fig_t = bar_chart(x, {it_name: [its[i] for i in keep]}, "plan", "iteration time (s, simulated)",
                      "Iteration time, simulated (lower is better)",
                      labels={it_name: [fmt_seconds(its[i]) for i in keep]})
    util = {"training only": [100 * utils[i] for i in keep]}
    if report.prefill is not None:
        util["with prefill (BubbleTea)"] = [100 * report.gpu_utilization_with_prefill()] + [None] * (len(x) - 1)
    fig_u = bar_chart(x, util, "plan", "GPU utilization (%, simulated, over all the scenario's GPUs)",
                      "GPU utilization over all the scenario's GPUs, simulated",
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


# ---- the cuts between datacenters ----------------------------------------------------------------


def cut_rows(choice: CutChoice) -> list[dict[str, str]]:
    """The chosen plan's cuts, one row each."""
    return [{"cut": f"{c.a} – {c.b}", "kind": c.kind, "inner steps H": fmt_cell(c.inner_steps)}
            for c in choice.chosen.plan.cuts]


def candidate_rows(choice: CutChoice) -> list[dict[str, str]]:
    return [{"candidate": c.name + (" (chosen)" if i == 0 else ""),
             "iteration (s, predicted)": f"{c.iteration_s:.4g}", "tokens ×k": f"{c.multiplier:.2f}",
             "time to target (s, predicted)": f"{c.time_to_target_s:.4g}",
             "WAN bytes per step (per rank)": f"{c.wan_bytes_per_step / MIB:.2f} MiB"}
            for i, c in enumerate(choice.candidates)]


def render_cuts(scenario_json: str, report: GeoReport) -> None:
    st.subheader("Cuts between datacenters")
    try:
        with show_errors("Cannot choose the cuts"):
            choice = compute_cuts(scenario_json, report)
            show_table(pd.DataFrame(cut_rows(choice) or [{"cut": "none: the plan uses one datacenter"}]))
            show_table(pd.DataFrame(candidate_rows(choice)))
            st.caption(f"Each candidate's predicted time to the loss synchronous DP reaches in "
                       f"{choice.target_tokens:,} tokens: iterations × k × iteration (k: DiLoCo's extra tokens, "
                       "planner/geo/convergence.py, measured on small CPU runs). "
                       + " ".join(f"Note: {n}." for n in choice.notes))
    except background.Pending:
        background.show_pending(CUTS_JOB, "Choosing the cuts…", "geo_cuts_cancel")


def load_bench(path: str) -> list[dict[str, Any]]:
    """The "links" of a `bench/geo_real.py --json` output; ValueError naming what is wrong."""
    real = confined_path(path, "bench JSON")
    try:
        with open(real, encoding="utf-8") as fh:
            d = json.load(fh)
    except OSError as e:
        raise ValueError(f"bench JSON {path!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"bench JSON {path!r}: not valid JSON ({e.msg}, line {e.lineno})") from e
    links = d.get("links") if isinstance(d, dict) else None
    if not isinstance(links, list) or not links:
        raise ValueError(f"bench JSON {path!r}: no 'links' list (write it with `python bench/geo_real.py --json`)")
    for l in links:
        if not isinstance(l, dict) or not {"mbit", "chosen", "loss_at_equal_time", "wan_bytes_per_token"} <= set(l):
            raise ValueError(f"bench JSON {path!r}: every link needs mbit, chosen, loss_at_equal_time and "
                             "wan_bytes_per_token")
    return links


def loss_figure(link: dict[str, Any]):
    """The candidates' measured training loss against training seconds at one link rate."""
    curves = link.get("loss_curves") or {}
    series = {k: ([p[0] for p in curves[k]], [p[2] for p in curves[k]]) for k in CUT_KINDS if curves.get(k)}
    return line_chart(series, "training time (s, measured)", "training loss (measured)",
                      f"{link['mbit']:g} Mbit/s: loss at equal wall time, chosen {link['chosen']}")


def render_cut_runs() -> None:
    st.subheader("Measured: pipeline, DiLoCo and DP at equal wall time")
    path = st.text_input("bench/geo_real.py --json output", key="geo_bench_json",
                         placeholder="a file under the data folder or GPUMIX_ALLOWED_ROOTS")
    if not path.strip():
        st.caption("Run `sudo python bench/geo_real.py --part cuts --json > FILE` and name FILE here.")
        return
    try:
        links = load_bench(path)
    except ValueError as e:
        st.error(error_message(e))
        return
    show_table(pd.DataFrame([{
        "link (Mbit/s)": f"{l['mbit']:g}", "chosen": l["chosen"], "measured best": l.get("measured_best", "-"),
        **{f"{k} loss": fmt_cell(l["loss_at_equal_time"].get(k), lambda x: f"{x:.4f}") for k in CUT_KINDS},
        **{f"{k} WAN B/token": fmt_cell(l["wan_bytes_per_token"].get(k), lambda x: f"{x:,.0f}") for k in CUT_KINDS},
    } for l in links]))
    for i, l in enumerate(links):
        if l.get("loss_curves"):
            show_figure(loss_figure(l), key=f"geo_cut_loss_{i}")


# ---- measured runs of pipeline plans ------------------------------------------------------------


def _runs_with_timelines() -> list[dict[str, Any]]:
    """The store's runs (newest first) whose folder holds a timeline.json."""
    from executor import store  # torch-free reader

    return [r for r in store.list_runs() if os.path.isfile(os.path.join(r["run_dir"], TIMELINE_FILE))]


def _check_ops(ops: Any, where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    if not isinstance(ops, list):
        raise ValueError(f"{where}: 'ops' must be a list")
    out = []
    for k, o in enumerate(ops):
        try:
            op, start, end = o["op"], float(o["start_s"]), float(o["end_s"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: op {k} needs op, start_s and end_s") from None
        if op not in names:
            raise ValueError(f"{where}: op {k} is {op!r}, not one of {', '.join(sorted(set(names)))}")
        if not (math.isfinite(start) and math.isfinite(end) and end >= start):
            raise ValueError(f"{where}: op {k} ({op}) ends before it starts or has no finite times")
        out.append({**o, "op": names[op], "start_s": start, "end_s": end})
    return out


def parse_timeline(d: Any, plan: Plan) -> list[dict[str, Any]]:
    """timeline.json's ranks, checked against the plan (stages exist, ops known); ValueError, one line."""
    if not isinstance(d, dict) or not isinstance(d.get("ranks"), list) or not d["ranks"]:
        raise ValueError("timeline.json: expected {\"step\", \"ranks\": [...]} with at least one rank")
    num_stages = len(plan.pipeline.stages)
    ranks = []
    for i, r in enumerate(d["ranks"]):
        where = f"timeline.json rank entry {i}"
        if not isinstance(r, dict) or not isinstance(r.get("stage"), int) or not 0 <= r["stage"] < num_stages:
            raise ValueError(f"{where}: 'stage' must be a stage of the plan (0–{num_stages - 1})")
        ranks.append({**r, "dp_index": int(r.get("dp_index", 0)),
                      "ops": _check_ops(r.get("ops"), where, {n: n for n in OP_NAMES})})
    return ranks


@st.cache_data(show_spinner=False, max_entries=32)
def _load_run_cached(run_dir: str, stamp: tuple) -> tuple[Plan, dict[str, Any], list[dict[str, Any]], list[dict]]:
    plan = Plan.load(os.path.join(run_dir, "plan.json"))
    if plan.pipeline is None:
        raise ValueError(f"{os.path.basename(run_dir)}: its plan has no pipeline section")
    with open(os.path.join(run_dir, TIMELINE_FILE), encoding="utf-8") as fh:
        try:
            raw = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"timeline.json is not JSON ({e.msg}, line {e.lineno})") from None
    ranks = parse_timeline(raw, plan)
    sim = _check_ops(list(plan.pipeline.simulated_ops), "the plan's simulated_ops",
                     {**SIM_KINDS, **{n: n for n in OP_NAMES}})
    for k, o in enumerate(sim):
        s, r = o.get("stage"), o.get("replica")
        if not (isinstance(s, int) and 0 <= s < len(plan.pipeline.stages) and isinstance(r, int)
                and 0 <= r < len(plan.pipeline.stages[s].devices)):
            raise ValueError(f"the plan's simulated_ops: op {k} names stage {s!r} replica {r!r}, not one of the plan's")
    prefill = []
    for path in sorted(glob.glob(os.path.join(run_dir, "prefill_rank*.json"))):
        with open(path, encoding="utf-8") as fh:
            prefill.append(json.load(fh))
    return plan, {"step": raw.get("step"), "ranks": ranks}, sim, sorted(prefill, key=lambda p: p.get("rank", 0))


def load_run(run_dir: str):
    """(plan, timeline, simulated ops, prefill summaries) of a run folder, cached until a file changes."""
    names = ["plan.json", TIMELINE_FILE, *sorted(os.path.basename(p) for p in
                                                  glob.glob(os.path.join(run_dir, "prefill_rank*.json")))]
    stamp = tuple((n, os.stat(os.path.join(run_dir, n)).st_mtime_ns) for n in names
                  if os.path.exists(os.path.join(run_dir, n)))
    return _load_run_cached(run_dir, stamp)


def _row_label(stage: int, replica: int, plan: Plan) -> str:
    dc = plan.pipeline.stages[stage].datacenter
    return f"s{stage} r{replica}" + (f" · {dc}" if dc else "")


def _row_order(plan: Plan) -> list[str]:
    return [_row_label(s, r, plan) for s, st_ in enumerate(plan.pipeline.stages) for r in range(len(st_.devices))]


def timeline_gantt(rows: list[dict[str, Any]], plan: Plan, kind: str, title: str, end_s: float):
    """A Gantt of (stage, replica, op, start_s, end_s) rows, one row per stage replica, colours by op,
    on a time axis from 0 to `end_s` (the same for the measured and the simulated chart)."""
    # waits first, prefill last: a prefill chunk runs inside a receive's wait and is drawn over it
    z = {"recv_fwd": 0, "recv_bwd": 0, "send_fwd": 1, "send_bwd": 1, "prefill": 3}
    bars = [{"row": _row_label(r["stage"], r["replica"], plan), "start": r["start_s"], "end": r["end_s"],
             "color": OP_NAMES[r["op"]]} for r in sorted(rows, key=lambda r: z.get(r["op"], 2))]
    x_title = f"time in the step (s, {kind})"
    return gantt_chart(bars, x_title, "stage, replica", title, row_order=_row_order(plan),
                       color_order=list(OP_COLORS), colors=OP_COLORS, x_range=(0.0, end_s))


def measured_ops(timeline: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"stage": r["stage"], "replica": r["dp_index"], **o} for r in timeline["ranks"] for o in r["ops"]]


def _per_replica(ops: list[dict[str, Any]], which: tuple[str, ...]) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for o in ops:
        if o["op"] in which:
            key = (o["stage"], o["replica"])
            out[key] = out.get(key, 0.0) + o["end_s"] - o["start_s"]
    return out


def stage_comparison(plan: Plan, measured: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> list[dict]:
    """Per stage: the mean over its replicas of the forward + backward time in the step, measured and
    simulated, the signed error of the measurement against the simulation, and the measured idle
    share of the step and prefill time. None where a side has no such op (never a guess)."""
    span = max((o["end_s"] for o in measured), default=0.0)
    busy_m, busy_s = _per_replica(measured, BUSY_OPS), _per_replica(simulated, BUSY_OPS)
    work_m = _per_replica(measured, ("forward", "backward", "grad_sync", "optimizer"))
    pre_m = _per_replica(measured, ("prefill",))
    out = []
    for s, st_ in enumerate(plan.pipeline.stages):
        reps = range(len(st_.devices))

        def mean(table: dict[tuple[int, int], float], default: float | None = None) -> float | None:
            vals = [table.get((s, r), default) for r in reps]
            return None if any(v is None for v in vals) else statistics.fmean(vals)

        m, sim = mean(busy_m), mean(busy_s)
        work = mean(work_m)
        out.append({"stage": s, "datacenter": st_.datacenter, "replicas": len(st_.devices),
                    "layers": f"{st_.first_layer}–{st_.first_layer + st_.num_layers - 1}",
                    "busy_measured_s": m, "busy_simulated_s": sim,
                    "error": (m - sim) / sim if m is not None and sim else None,
                    "idle_measured": 1 - work / span if work is not None and span > 0 else None,
                    "prefill_measured_s": mean(pre_m, 0.0) if pre_m else None})
    return out


def measured_iteration_s(run_dir: str) -> tuple[float | None, int]:
    """(median step_s after WARMUP_STEPS, steps it counts) from the run's store; (None, 0) before any."""
    from ui.runs import read_metrics  # cached by the run's change stamp

    steps = [s["step_s"] for s in read_metrics(run_dir).get("steps") or [] if s.get("step_s") is not None]
    after = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps
    return (statistics.median(after) if after else None), len(after)


def render_prefill(summaries: list[dict[str, Any]], timeline: dict[str, Any]) -> None:
    stage_of = {r.get("rank"): r["stage"] for r in timeline["ranks"]}
    show_table(pd.DataFrame([{
        "rank": str(p.get("rank")), "stage": fmt_cell(stage_of.get(p.get("rank"))), "model": p.get("model"),
        "requests done": fmt_cell(p.get("requests_done")),
        "prefill (measured, tokens/s of the run)": fmt_rate(p.get("prefill_tokens_per_s"), "tok/s"),
        "prefill (measured, tokens/s busy)": fmt_rate(p.get("prefill_tokens_per_busy_s"), "tok/s"),
        "TTFT mean (measured)": fmt_seconds(p.get("ttft_mean_s")), "TTFT p99 (measured)": fmt_seconds(p.get("ttft_p99_s")),
        "longest chunk (measured)": fmt_seconds(p.get("chunk_max_s")),
        "chunks over the box": fmt_cell(p.get("chunks_over_box")),
    } for p in summaries]))
    st.caption("Prefill ran only while its rank waited for a pipeline receive, one bounded chunk at a time "
               "(executor/prefill.py); TTFT is arrival to the end of the prompt's prefill, "
               "blank with a standing backlog.")


def render_measured() -> None:
    st.divider()
    st.subheader("Measured runs: a pipeline run's timeline beside its simulation")
    try:
        runs = _runs_with_timelines()
    except ValueError as e:
        st.error(f"Cannot list the runs: {error_message(e)}")
        return
    if not runs:
        st.info("No run of a pipeline plan with a measured timeline yet. Write a plan with "
                "`python -m planner geo --scenario S --out P` and run it with "
                "`python -m executor launch --plan P --emulate-wan`; its timeline shows here.")
        return
    names = {f"{r['name']} ({r['status']})": r["run_dir"] for r in runs}
    choice = st.selectbox("Run", list(names), key="geo_run")
    run_dir = names[choice]
    try:
        plan, timeline, simulated, prefill = load_run(run_dir)
        iteration, counted = measured_iteration_s(run_dir)
    except (OSError, ValueError) as e:
        st.error(f"Cannot show {os.path.basename(run_dir)}: {error_message(e)}")
        return
    predicted = plan.predicted_iteration_s
    c = st.columns(4)
    with c[0]:
        metric("Iteration", fmt_seconds(iteration), MEASURED,
               help=f"median step time of {counted} steps after the first {WARMUP_STEPS}")
    with c[1]:
        metric("Iteration", fmt_seconds(predicted), SIMULATED, help="the plan's predicted_iteration_s")
    with c[2]:
        err = (iteration - predicted) / predicted if iteration is not None and predicted > 0 else None
        metric("Error", fmt_cell(err, lambda x: fmt_percent(100 * x, signed=True)), MEASURED,
               help="measured against simulated iteration")
    with c[3]:
        metric("Timeline of step", fmt_cell(timeline["step"]), MEASURED)
    ops = measured_ops(timeline)
    end = max((o["end_s"] for o in [*ops, *simulated]), default=0.0)
    show_figure(timeline_gantt(ops, plan, "measured", f"Step {fmt_cell(timeline['step'])}, measured", end),
                key="geo_measured_gantt")
    if simulated:
        show_figure(timeline_gantt(simulated, plan, "simulated", "The plan's iteration, simulated", end),
                    key="geo_simulated_gantt")
    else:
        st.info("This plan file has no simulated timeline (write it with `python -m planner geo --out`).")
    show_table(pd.DataFrame([{
        "stage": str(r["stage"]), "datacenter": r["datacenter"] or "—", "replicas": str(r["replicas"]),
        "layers": r["layers"],
        "forward + backward (s, measured)": fmt_cell(r["busy_measured_s"], lambda x: f"{x:.4f}"),
        "forward + backward (s, simulated)": fmt_cell(r["busy_simulated_s"], lambda x: f"{x:.4f}"),
        "error (measured vs simulated)": fmt_cell(r["error"], lambda x: fmt_percent(100 * x, signed=True)),
        "idle (measured, % of the step)": fmt_cell(r["idle_measured"], lambda x: fmt_percent(100 * x)),
        "prefill (s, measured)": fmt_cell(r["prefill_measured_s"], lambda x: f"{x:.4f}"),
    } for r in stage_comparison(plan, ops, simulated)]))
    st.caption("Busy time: a stage replica's forward and backward time in the step, the mean over the stage's "
               "replicas; idle: the share of the measured step in which it ran no forward, backward, gradient "
               "sync or optimizer step.")
    if prefill:
        render_prefill(prefill, timeline)


page_header("Geo", "Train across datacenters over a WAN (Atlas: pipeline across DCs, data parallel inside, "
                   "several TCP connections, WAN shared in turns) and fill the bubbles with inference prefill "
                   "(BubbleTea). The plan's figures are simulated; the measured runs below are measured.")
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
    render_cuts(shown[0], shown[1])
render_cut_runs()
render_measured()
