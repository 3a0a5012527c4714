"""A joint-search plan as a plan file (DESIGN.md "Plans at scale").

Every assignment carries `stage` (its pipeline stage, or null for a device left out) and `tp` (its
TP degree); the devices of one TP group share `tp_group` (the group's first device index). A stage
lists devices of any nodes and types. A device of a TP group carries its group's rows as
`micro_batch`, `num_microbatches` as `accum_steps` and its group's share of the stage's state as
`shard_fraction` (each TP rank holds that share of its 1/tp slice): per stage, batches and shares
sum to the global batch and to 1 over the TP groups, each group counted once.

At tp 1 everywhere that is today's pipeline plan (contracts/plan.py validates and the executor runs
it; the three keys ride along in the JSON, ignored by today's reader): `to_plan` builds it. A plan
with tp > 1 is written as its JSON (`to_plan_dict`, `"tensor_parallel": true`), which contracts/plan.py
reads (TP groups) and `executor launch` runs at zero 1 (docs/executor.md, "Tensor-parallel plans").
"""
from __future__ import annotations

from typing import Any

from contracts.cluster import ClusterSpec
from contracts.plan import DEFAULT_PREFETCH, PLAN_VERSION, Assignment, PipelineSpec, PipelineStage, Plan
from planner.geo.scale.price import PricedPlan

TP_NOTE = ("tensor parallel plan (tp > 1): executor launch runs it at zero 1 without checkpoints, resume or "
           "--init-from (docs/executor.md, \"Tensor-parallel plans\")")


def _datacenter(cluster: ClusterSpec, nodes: set[int]) -> str:
    return "+".join(sorted({cluster.nodes[n].datacenter for n in nodes}))


def device_rows(plan: PricedPlan) -> dict[int, tuple[int, Any]]:
    """device index -> (stage, replica) of every device the plan uses."""
    out = {}
    for s, st in enumerate(plan.stages):
        for r in st.replicas:
            for d in r.devices:
                out[d] = (s, r)
    return out


def to_plan(cluster: ClusterSpec, model: str, global_batch: int, seq: int, dtype: str, plan: PricedPlan,
            notes: tuple[str, ...] = (), solve_s: float = 0.0) -> Plan:
    """The contracts' Plan of a plan whose every TP degree is 1 (ValueError otherwise)."""
    if any(r.tp != 1 for st in plan.stages for r in st.replicas):
        raise ValueError("a plan with tensor parallelism has no contracts Plan yet (use to_plan_dict)")
    M = plan.structure.num_microbatches
    used = device_rows(plan)
    stages = tuple(PipelineStage(st.first_layer, st.num_layers, tuple(r.devices[0] for r in st.replicas),
                                 tuple(r.rows for r in st.replicas), _datacenter(cluster, {r.node for r in st.replicas}))
                   for st in plan.stages)
    pipeline = PipelineSpec("1f1b", plan.structure.micro_batch, M, stages)
    assignments = []
    for i, (node, dev) in enumerate(cluster.devices()):
        if i in used:
            _, r = used[i]
            assignments.append(Assignment(i, node.name, dev.type, r.rows, M, r.rows * M, r.shard_fraction,
                                          r.memory_bytes, plan.iteration_s, dev.emulated, dev.slowdown, dev.memory_gb))
        else:
            assignments.append(Assignment(i, node.name, dev.type, 0, 0, 0, 0.0, 0, 0.0, dev.emulated, dev.slowdown,
                                          dev.memory_gb))
    return Plan(cluster, model, global_batch, seq, dtype, "none", tuple(assignments), plan.iteration_s,
                global_batch / plan.iteration_s, {}, solve_s, tuple(notes), zero=1, pipeline=pipeline)


def to_plan_dict(cluster: ClusterSpec, model: str, global_batch: int, seq: int, dtype: str, plan: PricedPlan,
                 notes: tuple[str, ...] = (), solve_s: float = 0.0) -> dict[str, Any]:
    """The plan file's JSON, with `stage`, `tp` and `tp_group` on every assignment (module docstring)."""
    tp_any = any(r.tp > 1 for st in plan.stages for r in st.replicas)
    if not tp_any:
        d = to_plan(cluster, model, global_batch, seq, dtype, plan, notes, solve_s).to_dict()
    else:
        M = plan.structure.num_microbatches
        used = device_rows(plan)
        d = {"version": PLAN_VERSION, "cluster": cluster.to_dict(), "model": model, "global_batch": global_batch,
             "seq": seq, "dtype": dtype, "recompute": "none", "zero": 1, "param_dtype": "fp32", "reduce_dtype": "fp32",
             "prefetch": DEFAULT_PREFETCH, "reduce_in_flight": 0, "predicted_wire_bytes_per_step": None,
             "predicted_exposed_comm_s": None, "predicted_iteration_s": plan.iteration_s,
             "predicted_samples_per_s": global_batch / plan.iteration_s, "baselines": {}, "solve_s": solve_s,
             "notes": list(notes) + [TP_NOTE], "zero_candidates": {}}
        rows = []
        for i, (node, dev) in enumerate(cluster.devices()):
            r = used.get(i, (None, None))[1]
            rows.append({"device_index": i, "node": node.name, "type": dev.type,
                         "micro_batch": r.rows if r else 0, "accum_steps": M if r else 0,
                         "batch": r.rows * M if r else 0, "shard_fraction": r.shard_fraction if r else 0.0,
                         "predicted_memory_bytes": r.memory_bytes if r else 0,
                         "predicted_step_s": plan.iteration_s if r else 0.0, "emulated": dev.emulated,
                         "slowdown": dev.slowdown, "memory_gb": dev.memory_gb})
        d["assignments"] = rows
        d["pipeline"] = {"schedule": "1f1b", "micro_batch": plan.structure.micro_batch, "num_microbatches": M,
                         "stages": [{"first_layer": st.first_layer, "num_layers": st.num_layers,
                                     "devices": [dd for r in st.replicas for dd in r.devices],
                                     "rows": [r.rows for r in st.replicas for _ in r.devices],
                                     "datacenter": _datacenter(cluster, {r.node for r in st.replicas})}
                                    for st in plan.stages], "simulated_ops": []}
    used = device_rows(plan)
    for a in d["assignments"]:
        s, r = used.get(a["device_index"], (None, None))
        a["stage"] = s
        a["tp"] = r.tp if r else 1
        a["tp_group"] = r.devices[0] if r else None
    d["tensor_parallel"] = tp_any
    return d


__all__ = ["to_plan", "to_plan_dict", "TP_NOTE", "device_rows"]
