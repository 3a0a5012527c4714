"""`python -m planner geo`: plan training across datacenters (Atlas) and fill its bubbles with
prefill (BubbleTea); every figure is simulated (planner/pipeline_sim) from the cost model.

`--out P` writes the chosen plan as a plan file that `python -m executor launch` runs
(planner/geo/plan_file.py); the JSON output then also carries it under "plan_file"."""
from __future__ import annotations

import argparse

from contracts.cli import print_json, print_table
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


def run(args: argparse.Namespace) -> int:
    scenario = GeoScenario.load(args.scenario)
    report = simulate_geo(scenario, args.schedule, baselines=not args.no_baselines)
    out = report.to_dict()
    plan_file = None
    if args.out:
        plan_file = geo_plan_to_plan(scenario, report.plan, schedule=args.schedule,
                                     baselines=report_baselines(report.baselines),
                                     search_iteration_s=report.sim.iteration_s, solve_s=report.solve_time_s)
        plan_file.save(args.out)
        out["plan_file"] = {"path": args.out, "predicted_iteration_s": plan_file.predicted_iteration_s,
                            "pipeline": plan_file.pipeline is not None}
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
    if plan_file is not None:
        kind = f"{len(plan_file.pipeline.stages)} stages" if plan_file.pipeline else "data parallel, one stage"
        print(f"plan file written to {args.out} ({kind}): predicted {plan_file.predicted_iteration_s:.4g} s/iteration "
              "as the runtime runs it (fp32 transfers, fair link sharing)")
    return 0
