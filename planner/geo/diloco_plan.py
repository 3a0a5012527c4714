"""A DiLoCo plan from a data-parallel plan across datacenters (contracts/plan.py `DilocoSpec`).

`to_diloco_plan` keeps every device's samples (so the global batch and each step's windows stay) and
makes each datacenter (plan node) one DiLoCo group by default: a group holds a whole copy of the
training state, so its devices' shard fractions are rescaled to sum to 1 inside the group, in the
proportions the plan gave them (by samples where the group held none). Every cut between two used
nodes gets its kind: "diloco" between groups (with H), "dp" inside one. The runtime:
models/diloco.py; the fields: docs/models/diloco.md.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from itertools import combinations
from typing import Sequence

from contracts.plan import Cut, DilocoSpec, Plan, plan_nodes

log = logging.getLogger(__name__)


def _group_fractions(plan: Plan, groups: Sequence[Sequence[str]]) -> dict[int, float]:
    """device_index -> its shard fraction inside its group (the group's fractions sum to 1)."""
    out: dict[int, float] = {}
    for g, nodes in enumerate(groups):
        members = [a for a in plan.used if a.node in nodes]
        frac = sum(a.shard_fraction for a in members)
        samples = sum(a.batch for a in members)
        if samples == 0:
            raise ValueError(f"to_diloco_plan: group {g} ({', '.join(nodes)}) has no device with samples")
        for a in members:
            out[a.device_index] = a.shard_fraction / frac if frac > 0 else a.batch / samples
    return out


def to_diloco_plan(plan: Plan, inner_steps: int, *, groups: Sequence[Sequence[str]] | None = None,
                   outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True, fragments: int = 1,
                   compress: str = "fp32", overlap: bool = False, merge_alpha: float = 0.5) -> Plan:
    """`plan` (data parallel, no pipeline) as a DiLoCo plan over `groups` (default: one per used
    node); ValueError naming the problem (the DilocoSpec and Plan checks included)."""
    if plan.pipeline is not None:
        raise ValueError("to_diloco_plan: the plan has a pipeline; DiLoCo groups run data parallelism")
    if plan.tensor_parallel:
        raise ValueError("to_diloco_plan: the plan is tensor parallel; DiLoCo groups run tp 1")
    nodes = plan_nodes(plan)
    groups = [[n] for n in nodes] if groups is None else [list(g) for g in groups]
    spec = DilocoSpec(tuple(tuple(g) for g in groups), inner_steps, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, nesterov=nesterov, fragments=fragments, compress=compress,
                      overlap=overlap, merge_alpha=merge_alpha)
    missing = [n for n in nodes if n not in spec.groups_nodes()]
    if missing:
        raise ValueError(f"to_diloco_plan: used node(s) {', '.join(missing)} are in no group")
    fractions = _group_fractions(plan, spec.groups)
    assignments = tuple(replace(a, shard_fraction=fractions.get(a.device_index, a.shard_fraction))
                        for a in plan.assignments)
    cuts = tuple(Cut(a, b, "diloco", inner_steps) if spec.group_of(a) != spec.group_of(b) else Cut(a, b, "dp")
                 for a, b in combinations(nodes, 2))
    note = (f"diloco: {spec.num_groups} group(s) {[list(g) for g in spec.groups]}, H={inner_steps}, "
            f"outer lr {outer_lr:g} momentum {outer_momentum:g}{' nesterov' if nesterov else ''}, "
            f"{fragments} fragment(s), {compress} exchange{' overlapped' if overlap else ''}")
    return replace(plan, assignments=assignments, diloco=spec, cuts=cuts, rebalance="off",
                   notes=(*plan.notes, note))


__all__ = ["to_diloco_plan"]
