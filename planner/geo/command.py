"""`python -m planner geo`: plan training across datacenters (Atlas) and fill its bubbles with
prefill (BubbleTea); every figure is simulated (planner/pipeline_sim) from the cost model.

Every cut between datacenters then gets its kind (pipeline, DiLoCo with its H, or synchronous DP) by
predicted time to a target loss (planner/geo/cuts.py, its convergence model planner/geo/convergence.py);
`--json` carries them under "cuts" and the priced candidates under "cut_choice". `--out P` writes the
chosen plan (Atlas's pipeline, DP over every datacenter, or a DiLoCo plan) as a plan file that
`python -m executor launch` runs (planner/geo/plan_file.py); the JSON output then also carries it
under "plan_file". `--cut-kind` forces one kind."""
from __future__ import annotations

import argparse
from dataclasses import replace

from contracts.cli import print_json, print_table
from planner.geo.convergence import load_fit
from planner.geo.cuts import CutCandidate, CutChoice, choose_cuts
from planner.geo.evaluate import simulate_geo
from planner.geo.plan_file import geo_plan_to_plan, report_baselines
from planner.geo.scenario import GeoScenario
from planner.geo.pipeline_sim import SCHEDULES

HELP = "plan training across datacenters over a WAN (Atlas) and fill pipeline bubbles with prefill (BubbleTea)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True, help="geo scenario JSON (DESIGN.md): datacenters, wan, model, batch")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule to simulate")
    p.add_argument("--no-baselines", action="store_true", help="skip the baselines (faster)")
    p.add_argument("--json", action="store_true", help="one JSON object (the plan's stages included)")
    p.add_argument("--out", metavar="P", help="write the chosen plan as a plan file that `executor launch` runs")
    p.add_argument("--cut-kind", choices=("auto", "pipeline", "dp", "diloco"), default="auto",
                   help="auto: the kind with the least predicted time to the target loss; else the best of that kind")
    p.add_argument("--target-tokens", type=int, default=None,
                   help="tokens the target loss takes synchronous DP (default: 1000 iterations' tokens)")


def run(args: argparse.Namespace) -> int:
    scenario = GeoScenario.load(args.scenario)
    if args.target_tokens is not None and args.target_tokens < 1:
        raise ValueError(f"--target-tokens must be >= 1, got {args.target_tokens}")
    report = simulate_geo(scenario, args.schedule, baselines=not args.no_baselines)
    out = report.to_dict()
    try:
        pipeline, why = geo_plan_to_plan(scenario, report.plan, schedule=args.schedule,
                                         baselines=report_baselines(report.baselines),
                                         search_iteration_s=report.sim.iteration_s, solve_s=report.solve_time_s), None
    except ValueError as e:  # the search's plan is not one the runtime runs: the other kinds may be
        if len(scenario.datacenters) == 1:
            raise
        pipeline, why = None, f"pipeline not offered: {e}"
    choice = choose_cuts(scenario, pipeline, load_fit(), target_tokens=args.target_tokens)
    if why is not None:
        choice = replace(choice, notes=(why, *choice.notes))
    picked = pick(choice, args.cut_kind)
    out["cuts"] = [c.to_dict() for c in picked.plan.cuts]
    out["cut_choice"] = {**choice.to_dict(), "written": picked.name, "cut_kind": args.cut_kind}
    plan_file = None
    if args.out:
        plan_file = picked.plan
        plan_file.save(args.out)
        out["plan_file"] = {"path": args.out, "predicted_iteration_s": plan_file.predicted_iteration_s,
                            "pipeline": plan_file.pipeline is not None, "kind": picked.kind,
                            "inner_steps": picked.inner_steps}
    if args.json:
        print_json(out)
        return 0
    plan = out["plan"]
    print(f"{scenario.name}: {scenario.model}, global batch {scenario.global_batch} × seq {scenario.seq} "
          f"— all times simulated from the cost model")
    print_table([{
        "datacenters": "→".join(plan["datacenters"]),
        "gpus": sum(plan["gpus_per_dc"].values()),
        "dp": plan["dp_degree"], "stages": plan["num_stages"],
        "layers": "/".join(str(plan["layers_per_dc"][d]) for d in plan["datacenters"]),
        "recompute": plan["recompute"],
        "connections": ",".join(f"{k}:{v}" for k, v in plan["connections"].items()) or "-",
        "link_order": plan["link_order"],
    }])
    print()
    rows = [{"plan": "atlas (this plan)", "iteration_s": out["iteration_s"], "gpus": sum(plan["gpus_per_dc"].values()),
             "gpu_utilization": out["gpu_utilization"], "speedup": 1.0}]
    for name, b in out["baselines"].items():
        it = b["iteration_s"]
        rows.append({"plan": name, "iteration_s": it if it is not None else "infeasible", "gpus": b["num_gpus"],
                     "gpu_utilization": b["gpu_utilization"] if it is not None else "-",
                     "speedup": it / out["iteration_s"] if it else "-"})
    print_table(rows)
    how = "every structure enumerated" if out["search_exact"] else "stage counts cut to a reduced set (too many)"
    slower = ", ".join(out["slower_than"])
    print(f"search: {out['num_candidates']} structures priced ({how}); plan from {out['chosen_from']}"
          + (f"; SLOWER than {slower}" if slower else "; no baseline is faster"))
    if out["wan_utilization"]:
        print("WAN utilization (simulated): " +
              ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(out["wan_utilization"].items())))
    if out["prefill"] is not None:
        pre = out["prefill"]
        print()
        print_table([{"gpu_utilization": out["gpu_utilization"],
                      "with_prefill": out["gpu_utilization_with_prefill"],
                      "prefill_tokens_per_s": out["prefill_tokens_per_s"],
                      "requests": pre["prefill_requests_served"],
                      "ttft_mean_s": pre["ttft_mean_s"] if pre["ttft_mean_s"] is not None else "-",
                      "training_unchanged": out["training_unchanged_by_prefill"]}])
        if pre["note"]:
            print(f"note: {pre['note']}")
    print()
    print_table([{"candidate": c.name, "iteration_s": c.iteration_s, "k": c.multiplier,
                  "time_to_target_s": c.time_to_target_s, "wan_bytes_per_step": c.wan_bytes_per_step}
                 for c in choice.candidates[:8]])
    print(f"cuts ({picked.name}, time to {choice.target_tokens} tokens of DP-equivalent loss): "
          + (", ".join(f"{c.a}-{c.b} {c.kind}" + (f" H={c.inner_steps}" if c.inner_steps else "")
                       for c in picked.plan.cuts) or "none (one datacenter)"))
    for n in choice.notes:
        print(f"note: {n}")
    if plan_file is not None:
        kind = (f"{len(plan_file.pipeline.stages)} stages" if plan_file.pipeline else
                f"DiLoCo H={plan_file.diloco.inner_steps}" if plan_file.diloco else "data parallel, one stage")
        print(f"plan file written to {args.out} ({kind}): predicted {plan_file.predicted_iteration_s:.4g} s/iteration "
              "as the runtime runs it (fp32 transfers, fair link sharing)")
    return 0


def pick(choice: CutChoice, kind: str) -> CutCandidate:
    """The candidate to write: the chosen one (`auto`), else the fastest of `kind`; ValueError when
    no candidate of that kind was priced."""
    if kind == "auto":
        return choice.chosen
    of_kind = [c for c in choice.candidates if c.kind == kind]
    if not of_kind:
        raise ValueError(f"--cut-kind {kind}: no such candidate was priced "
                         f"({', '.join(c.name for c in choice.candidates)}; notes: {'; '.join(choice.notes) or '-'})")
    return of_kind[0]
