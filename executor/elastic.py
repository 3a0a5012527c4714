"""Elastic SLURM runs: `executor launch --backend slurm --elastic --checkpoint-every N`.

A run that loses a node goes on on the nodes left, from its last committed checkpoint, in the same
run folder. executor/slurm.py follows the job; when the job ends failed with nodes found dead
(slurm.dead_nodes: SLURM reports the node down, or its agent vanished while the other nodes' ranks
lost their peers), it asks here what comes next:

1. `node_lost`, one per dead node (step: the last step recorded; detail: the node, why, the ranks
   it held). The old job is ended by then: scancelled, its steps cleaned away (slurm._settle).
2. the plan on the nodes left (`replan_without`, the rule below) and `replan` (step: the
   checkpoint's; detail: the lost nodes, the rule, the old and new assignments);
3. `resume` (step: the checkpoint's; detail: its folder): the store's rows of the steps after the
   checkpoint are dropped (the resumed ranks record them again, so no step counts twice), the
   new plan becomes the run folder's plan.json, and slurm.py submits a new job whose ranks load
   the checkpoint (`--resume`; executor/checkpoint.py reshards it onto the new plan).

It cannot go on, and the run fails as a plain one does (the reason naming the node), when no node
is left or no checkpoint is committed yet.

The new plan is the planner's (planner.entry.plan_job, the entry every other path plans with) for
the surviving devices as a cluster of their own, at the run's model, sequence length, global batch
(so the data order and the loss curve are those of any plan at that batch, executor/corpus.py's
GlobalSampler), dtype, recomputation and ZeRO stage, data parallel only: its split, shards,
micro-batches, memory check and predictions are the planner's, from the profiles the first plan
used. A survivor set the planner cannot plan for (the model does not fit them) ends the run with
the planner's reason.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from contracts.plan import Plan
from contracts.run import RunConfig
from executor import checkpoint as ckpt
from executor.store import MetricsStore

log = logging.getLogger(__name__)

RULE = ("the planner's plan for the surviving devices at the run's model, sequence length, global batch, dtype, "
        "recomputation and ZeRO stage (data parallel)")


def check_elastic(plan: Plan, config: RunConfig) -> None:
    """ValueError when an elastic run of `plan` with `config` could not resume after a node loss."""
    if config.checkpoint_every < 1:
        raise ValueError("--elastic resumes a run that lost a node from its last checkpoint: give "
                         "--checkpoint-every N (N >= 1) with it")
    if plan.pipeline is not None or plan.tensor_parallel:
        raise ValueError("--elastic re-splits a data-parallel plan's batch over the nodes left; this plan has "
                         + ("pipeline stages" if plan.pipeline is not None else "tensor-parallel groups"))


@dataclass(frozen=True)
class Resumption:
    """What the run goes on with after a node loss: the new plan, the config that resumes, the
    checkpoint's step and folder."""

    plan: Plan
    config: RunConfig
    step: int
    checkpoint: str


def replan_without(plan: Plan, lost: set[str]) -> Plan:
    """The planner's plan of `plan`'s job on its devices outside the nodes `lost` (module docstring);
    ValueError when no device is left or the planner cannot plan on them."""
    from planner.entry import plan_job, sub_cluster  # the planner: only when a node is lost

    devices = plan.cluster.devices()
    left = tuple(i for i, (node, _) in enumerate(devices) if node.name not in lost)
    if not any(a.device_index in left and a.used for a in plan.assignments):
        raise ValueError(f"no node left to run on: the plan's nodes {sorted({a.node for a in plan.used})} "
                         f"less the lost {sorted(lost)} hold no device the plan used")
    cluster = sub_cluster(plan.cluster, left, f"{plan.cluster.name} without {'+'.join(sorted(lost))}")
    try:
        new = plan_job(cluster, plan.model, plan.global_batch, seq=plan.seq, dtype=plan.dtype,
                       recompute=plan.recompute, zero=plan.zero, pipeline=False).plan
    except ValueError as e:
        raise ValueError(f"the planner cannot plan the run on the devices left: {e}") from e
    return replace(new, rebalance=plan.rebalance,
                   notes=new.notes + (f"elastic replan without node(s) {', '.join(sorted(lost))}: {RULE}",))


def _pieces(plan: Plan) -> list[dict[str, Any]]:
    """The used assignments, as the replan event's detail lists them."""
    return [{"device_index": a.device_index, "node": a.node, "type": a.type, "micro_batch": a.micro_batch,
             "accum_steps": a.accum_steps, "batch": a.batch, "shard_fraction": a.shard_fraction} for a in plan.used]


def _ranks_on(store: MetricsStore, plan: Plan, node: str) -> list[int]:
    """The ranks the node held: those registered from it, else the plan's positions on it (a node
    lost before its ranks came up)."""
    return store.registered_ranks(node=node) or [i for i, a in enumerate(plan.used) if a.node == node]


def resumption_after(store: MetricsStore, plan: Plan, config: RunConfig,
                     dead: list[tuple[str, str]]) -> Resumption:
    """Record `node_lost` for each (node, why) of `dead`, then the plan on the nodes left and its
    `replan`; the Resumption. ValueError (the reason the run cannot go on) when no node is left or
    no checkpoint is committed; the node_lost events are recorded either way."""
    step = store.last_step()
    for node, why in dead:
        ranks = _ranks_on(store, plan, node)
        store.add_step_event("node_lost", step, {"node": node, "reason": why, "ranks": ranks},
                             f"node {node} lost at step {step} (ranks {', '.join(map(str, ranks)) or 'none'}): {why}")
    meta = ckpt.latest(config.run_dir)
    if meta is None:
        raise ValueError("no checkpoint committed yet to resume from")
    lost = {node for node, _ in dead}
    new_plan = replan_without(plan, lost)
    meta = ckpt.check_resumable(config.run_dir, new_plan)
    done = int(meta["step"])
    store.add_step_event("replan", done, {"lost_nodes": sorted(lost), "rule": RULE, "old": _pieces(plan),
                                          "new": _pieces(new_plan)},
                         f"replanned on {len(new_plan.used)} device(s) without {', '.join(sorted(lost))}: batches "
                         f"{[a.batch for a in plan.used]} -> {[a.batch for a in new_plan.used]}")
    return Resumption(new_plan, replace(config, resume=True, overwrite=False), done, meta["path"])


def begin_resume(store: MetricsStore, r: Resumption, plan_path: str) -> None:
    """The run row on the new plan (its ranks rows are the new job's), the steps after the
    checkpoint dropped, `resume` recorded, plan.json the new plan. A stop asked meanwhile stays
    asked (the new job is then cancelled at once)."""
    r.plan.save(plan_path)
    asked = store.stop_requested()
    store.init_run(r.plan, r.config.steps, r.config.seed, backend="gloo", resume=True)
    if asked:  # init_run writes a fresh run row
        store.request_stop()
    store.truncate_after(r.step)
    store.add_step_event("resume", r.step, {"checkpoint": r.checkpoint, "nodes": sorted({a.node for a in r.plan.used}),
                                            "world_size": len(r.plan.used)},
                         f"resuming from the checkpoint of step {r.step} on {len(r.plan.used)} rank(s)")
    log.info("elastic: resuming from the checkpoint of step %d on %s", r.step,
             ", ".join(sorted({a.node for a in r.plan.used})))
