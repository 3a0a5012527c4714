"""Predicted speedup of the heterogeneous plan over `even` and `proportional` (and the best single type).

All figures are predictions of one cost model (planner/costmodel/training.py): the plan and its baselines are
priced the same way, so the ratios isolate what the ILP's choices buy. A baseline that does not fit
in memory is reported as OOM (Cephalo's point: an even split either runs out of memory or has to
shrink everyone's micro-batch to the smallest device's).

    python bench/planner_vs_baselines.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from contracts.cluster import ClusterSpec  # noqa: E402
from planner.hetero.solve import solve_plan  # noqa: E402

CASES = (
    # (cluster file, model, global batch, seq, dtype, recompute)
    # Cephalo: 2×L4 + A6000 + P40, 2.7B GPT, batch 64. The runtime keeps full fp32 params and grads
    # (21 GB) on every device, so in bf16 (autocast adds 2-byte weight copies) only the A6000 computes.
    ("cephalo.json", "gpt-2.7b", 64, 2048, "bf16", "full"),
    ("cephalo.json", "gpt-2.7b", 64, 2048, "fp32", "full"),
    ("cephalo.json", "gpt2-large", 64, 1024, "fp32", "none"),
    ("lab.json", "gpt2-xl", 256, 1024, "bf16", "none"),  # DESIGN.md's lab: 4×A100 + 2×V100 + 2×T4
    ("mixed-16.json", "gpt2-large", 256, 1024, "bf16", "none"),  # 8 types on 4 nodes
    ("mixed-64.json", "gpt2-xl", 512, 1024, "bf16", "full"),
)


def speedup(base_s: float | None, plan_s: float) -> float | None:
    return None if base_s is None else base_s / plan_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for cluster_file, model, batch, seq, dtype, recompute in CASES:
        cluster = ClusterSpec.load(os.path.join(ROOT, "examples", "clusters", cluster_file))
        result = solve_plan(cluster, model, batch, seq=seq, dtype=dtype, recompute=recompute)
        plan = result.plan
        b = plan.baselines
        rows.append({
            "cluster": cluster.name, "num_gpus": cluster.num_devices, "types": "+".join(cluster.device_types()),
            "model": model, "global_batch": batch, "seq": seq, "dtype": dtype, "recompute": recompute,
            "plan_iteration_s": plan.predicted_iteration_s, "devices_used": len(plan.used),
            **{f"{k}_iteration_s": v.predicted_iteration_s for k, v in b.items()},
            **{f"speedup_vs_{k}": speedup(v.predicted_iteration_s, plan.predicted_iteration_s) for k, v in b.items()},
            "solve_s": plan.solve_s, "status": result.status,
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("predicted iteration times (s) and the plan's predicted speedup; OOM = the baseline does not fit")

    def fmt(x: float | None, suffix: str = "") -> str:
        return "OOM" if x is None else f"{x:.3g}{suffix}"

    header = (f"{'cluster':<22} {'model':<11} {'B':>4} {'dtype/recompute':<16} {'plan s':>8} {'even':>12} {'proportional':>14} "
              f"{'best single type':>17} {'solve s':>8}")
    print(header)
    for r in rows:
        name = f"{r['cluster']} ({r['num_gpus']})"
        setting = f"{r['dtype']}/{r['recompute']}"
        print(f"{name:<22} {r['model']:<11} {r['global_batch']:>4} {setting:<16} {r['plan_iteration_s']:>8.3g} "
              f"{fmt(r['even_iteration_s']) + ' ' + fmt(r['speedup_vs_even'], 'x'):>12} "
              f"{fmt(r['proportional_iteration_s']) + ' ' + fmt(r['speedup_vs_proportional'], 'x'):>14} "
              f"{fmt(r['best_homogeneous_iteration_s']) + ' ' + fmt(r['speedup_vs_best_homogeneous'], 'x'):>17} "
              f"{r['solve_s']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
