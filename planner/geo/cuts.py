"""The kind of every cut between datacenters: pipeline, DiLoCo or synchronous data parallelism,
chosen by predicted time to a target loss.

Candidates, each a plan file the runtime runs (contracts/plan.py), priced by planner/geo/emulated.py:

* pipeline: Atlas's plan (planner/geo/search.py through plan_file.geo_plan_to_plan), its cuts
  between consecutive datacenters of its chain; a plan Atlas keeps in one datacenter has no cut
  (the candidate is still named pipeline: Atlas's search chose it);
* dp: synchronous data parallelism over every datacenter's devices (`scenario_dp_plan`), ZeRO-1,
  its collectives over the WAN every step (emulated.predict_dp_plan);
* diloco: for every way to group the datacenters into G >= 2 groups, every H of INNER_STEPS and
  every outer-delta wire dtype (fp32, bf16, int8) the convergence fit measured k at (a compressed
  one only within the H range measured for it), that DP plan as DiLoCo (diloco_plan.to_diloco_plan):
  cuts inside a group dp, between groups diloco.

Time to a target of `target_tokens` (identical tokens per iteration in every candidate):

    pipeline, dp:  iterations = target_tokens / tokens per iteration,  × predicted iteration_s
    diloco:        iterations × k(H, G, dtype) (planner/geo/convergence.py),  × (inner step + exchange_s / H)

the inner step being the slowest group's data-parallel step on its own devices, the exchange one
world all-reduce of the model's parameters in the wire dtype (what models/diloco.py sends: numel ×
bytes per element on every rank), priced as a ring over the used ranks whose slowest edge is the
slowest WAN link between two groups: 2(N−1)/N × payload over that link, plus 2(N−1) one-way latencies.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Any, Sequence

from contracts.cluster import ClusterSpec, DeviceSpec, NetworkSpec, NodeSpec
from contracts.plan import Assignment, Cut, Plan, WanLink
from planner.geo.convergence import ConvergenceFit
from planner.geo.diloco_plan import to_diloco_plan
from planner.geo.emulated import dp_memory_bytes, model_spec, predict_dp_plan, wan_rate
from planner.geo.plan_file import check_runnable
from planner.geo.scenario import GeoScenario

log = logging.getLogger(__name__)

INNER_STEPS = (5, 10, 25, 50, 100)  # the H values priced for a DiLoCo cut (those bench/diloco_convergence.py measures)
WIRE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}  # bytes per parameter on the outer exchange
GBIT = 1e9
BITS_PER_BYTE = 8


@dataclass(frozen=True)
class CutCandidate:
    """One way to cut the scenario, priced: its plan file and predicted time to the target."""
    name: str  # "pipeline" | "dp" | "diloco H=.. groups=.."
    kind: str  # the kind of its cuts between groups: "pipeline" | "dp" | "diloco"
    plan: Plan
    iteration_s: float  # predicted seconds per iteration (DiLoCo: inner step + exchange / H)
    multiplier: float  # k: tokens to the target over DP's (1 for pipeline and dp)
    time_to_target_s: float
    wan_bytes_per_step: float  # bytes a rank sends across the WAN per iteration (DiLoCo: per H steps / H)
    inner_steps: int | None = None
    exchange_s: float | None = None  # DiLoCo: one outer exchange
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "iteration_s": self.iteration_s, "multiplier": self.multiplier,
                "time_to_target_s": self.time_to_target_s, "wan_bytes_per_step": self.wan_bytes_per_step,
                "inner_steps": self.inner_steps, "exchange_s": self.exchange_s, "note": self.note,
                "cuts": [c.to_dict() for c in self.plan.cuts]}


@dataclass(frozen=True)
class CutChoice:
    """The candidates by time to target, the chosen one first."""
    candidates: tuple[CutCandidate, ...]
    target_tokens: int
    notes: tuple[str, ...] = ()

    @property
    def chosen(self) -> CutCandidate:
        return self.candidates[0]

    def to_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen.name, "target_tokens": self.target_tokens,
                "cuts": [c.to_dict() for c in self.chosen.plan.cuts],
                "candidates": [c.to_dict() for c in self.candidates], "notes": list(self.notes)}


# ---- the data-parallel plan over every datacenter ------------------------------------------------
ZERO_LEVELS = (1, 2, 3)  # tried in turn: the first whose memory fits (less sharding, fewer collectives)


def scenario_dp_plan(scenario: GeoScenario, profiles_dir: str | None = None, rtt: bool = True) -> Plan:
    """Synchronous DP over every GPU of the scenario: a node per datacenter, the global batch's
    micro-batches dealt round-robin (a device with none is left out), shards by samples, at the
    lowest ZeRO level whose memory fits; ValueError naming the last level's problem when none does."""
    err = None
    for zero in ZERO_LEVELS:
        try:
            return _dp_plan(scenario, zero, profiles_dir, rtt)
        except ValueError as e:
            err = e
    raise ValueError(f"at ZeRO-{ZERO_LEVELS[-1]}: {err}")


def _dp_plan(scenario: GeoScenario, zero: int, profiles_dir: str | None, rtt: bool) -> Plan:
    """scenario_dp_plan at one ZeRO level, priced and checked. Round-robin dealing gives work only to
    the first (global batch / micro-batch) devices in scenario order, so only those are written: the
    others would be unused assignments (a scenario may declare more GPUs than a plan can list)."""
    left = max(scenario.global_batch // scenario.micro_batch, 1)
    nodes = []
    for dc in scenario.datacenters:
        take = [t for t, n in dc.gpus for _ in range(min(n, left))][:left]
        left -= len(take)
        if take:
            nodes.append(NodeSpec(dc.name, dc.name, tuple(DeviceSpec(t) for t in take)))
    nodes = tuple(nodes)
    intra = min(dc.intra_dc_gbps for dc in scenario.datacenters)
    cluster = ClusterSpec(f"{scenario.name}-dp", nodes,
                          NetworkSpec(intra, min((l.gbps for l in scenario.wan), default=intra)))
    devices = cluster.devices()
    num_mb = scenario.global_batch // scenario.micro_batch
    if num_mb * scenario.micro_batch != scenario.global_batch:
        raise ValueError(f"scenario: global batch {scenario.global_batch} is not a multiple of the micro-batch "
                         f"{scenario.micro_batch}")
    per = [num_mb // len(devices) + (1 if i < num_mb % len(devices) else 0) for i in range(len(devices))]
    asg = []
    for i, ((node, dev), n) in enumerate(zip(devices, per)):
        m = scenario.micro_batch if n else 0
        asg.append(Assignment(i, node.name, dev.type, m, n, m * n, n / num_mb, 0, 0.0, dev.emulated, dev.slowdown,
                              dev.memory_gb))
    names = [node.name for node in nodes]
    wan = tuple(WanLink(l.a, l.b, l.gbps, l.rtt_ms, l.per_connection_gbps) for l in scenario.wan
                if l.a in names and l.b in names)
    draft = Plan(cluster, scenario.model, scenario.global_batch, scenario.seq, scenario.dtype, "none", tuple(asg),
                 0.0, 0.0, zero=zero, wan=wan, notes=("data parallelism over every datacenter (planner/geo/cuts.py)",))
    it, steps = predict_dp_plan(draft, profiles_dir, rtt)
    mem = dp_memory_bytes(draft, profiles_dir)
    asg = tuple(replace(a, predicted_memory_bytes=mem.get(a.device_index, 0),
                        predicted_step_s=steps.get(a.device_index, 0.0)) for a in draft.assignments)
    plan = replace(draft, assignments=asg, predicted_iteration_s=it, predicted_samples_per_s=scenario.global_batch / it,
                   cuts=tuple(Cut(a, b, "dp") for a, b in combinations(names, 2)))
    check_runnable(plan)
    return plan


def group_step_s(plan: Plan, nodes: Sequence[str], profiles_dir: str | None = None, rtt: bool = True) -> float:
    """A DiLoCo group's inner step: data parallelism on its own nodes' devices alone (their batches,
    its shard fractions summing to 1), predicted as emulated.predict_dp_plan prices any DP plan;
    ValueError when a device would be over its memory (each group holds a whole copy of the state)."""
    members = [a for a in plan.assignments if a.used and a.node in nodes]
    if not members:
        raise ValueError(f"diloco group {list(nodes)}: no device with samples")
    frac = sum(a.shard_fraction for a in members)
    batch = sum(a.batch for a in members)
    asg = tuple(replace(a, shard_fraction=a.shard_fraction / frac) if a.used and a.node in nodes
                else replace(a, micro_batch=0, accum_steps=0, batch=0, shard_fraction=0.0)
                for a in plan.assignments)
    sub = replace(plan, assignments=asg, global_batch=batch, diloco=None, cuts=())
    mem = dp_memory_bytes(sub, profiles_dir)
    check_runnable(replace(sub, assignments=tuple(replace(a, predicted_memory_bytes=mem.get(a.device_index, 0))
                                                  for a in sub.assignments)))
    return predict_dp_plan(sub, profiles_dir, rtt)[0]


def exchange_s(plan: Plan, groups: Sequence[Sequence[str]], payload_bytes: float, rtt: bool = True) -> float:
    """One outer exchange: a ring all-reduce of `payload_bytes` over the plan's used ranks, its slowest
    edge the slowest WAN link joining two groups (one connection): 2(N−1)/N × payload / rate +
    2(N−1) one-way latencies. ValueError when two groups have no WAN link at all."""
    n = sum(1 for a in plan.assignments if a.used)
    group_of = {node: g for g, nodes in enumerate(groups) for node in nodes}
    links = [w for w in plan.wan if w.a in group_of and w.b in group_of and group_of[w.a] != group_of[w.b]]
    if not links:
        raise ValueError(f"diloco groups {[list(g) for g in groups]}: no WAN link joins two of them")
    rates = [wan_rate(w, 1, rtt) for w in links]
    gbps = min(r for r, _ in rates)
    latency = max(l for _, l in rates)
    return 2 * (n - 1) / n * payload_bytes * BITS_PER_BYTE / (gbps * GBIT) + 2 * (n - 1) * latency


def set_partitions(items: Sequence[str]) -> list[list[list[str]]]:
    """Every way to split `items` into non-empty groups (order kept inside each group)."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for p in set_partitions(rest):
        out.append([[first], *p])
        for i in range(len(p)):
            out.append([*p[:i], [first, *p[i]], *p[i + 1:]])
    return out


def wan_bytes_per_step_dp(plan: Plan) -> float:
    """Bytes each rank sends per step in ZeRO-1 data parallelism: the gradients' reduce-scatter and
    the parameters' all-gather, (N−1)/N of the fp32 model each, over the ring that crosses the WAN."""
    n = sum(1 for a in plan.assignments if a.used)
    return 2 * (n - 1) / n * model_spec(plan).num_params * WIRE_BYTES["fp32"] if n > 1 else 0.0


def pipeline_cuts(plan: Plan) -> tuple[Cut, ...]:
    """A pipeline plan's cuts: "pipeline" between the datacenters of every two consecutive stages on
    different ones; a plan without a pipeline has none here."""
    if plan.pipeline is None:
        return ()
    nodes = [s.datacenter for s in plan.pipeline.stages]
    out, seen = [], set()
    for a, b in zip(nodes, nodes[1:]):
        if a != b and frozenset((a, b)) not in seen:
            seen.add(frozenset((a, b)))
            out.append(Cut(a, b, "pipeline"))
    return tuple(out)


def wan_bytes_per_step_pipeline(plan: Plan) -> float:
    """Bytes a rank at a WAN boundary of a pipeline sends per step: its rows' activations of every
    micro-batch forward (or their gradients back), seq × hidden fp32 values a row (the runtime's
    wire dtype); the tied embedding's sync between the end stages is left out (vocab × hidden once)."""
    p = plan.pipeline
    if p is None or not plan.cuts:
        return 0.0
    spec = model_spec(plan)
    rows = max(r for st in p.stages for r in st.rows)
    return float(p.num_microbatches * rows * plan.seq * spec.hidden * WIRE_BYTES["fp32"])


# ---- the choice ----------------------------------------------------------------------------------
def diloco_candidates(dp: Plan, fit: ConvergenceFit, iterations: float, inner_steps: Sequence[int] = INNER_STEPS,
                      compresses: Sequence[str] | None = None, profiles_dir: str | None = None, rtt: bool = True
                      ) -> list[CutCandidate]:
    """DiLoCo over every grouping of the DP plan's used nodes into >= 2 groups, at every H and every
    wire dtype of `compresses` (None: each the fit measured k at; one it did not measure is refused)."""
    compresses = fit.compresses if compresses is None else tuple(compresses)
    missing = [c for c in compresses if c not in fit.compresses]
    if missing or not compresses:
        raise ValueError(f"diloco candidates: compress {missing or '(none)'} has no measured k "
                         f"(the fit measured {', '.join(fit.compresses)}; bench/diloco_convergence.py --compress)")
    out = []
    for compress in compresses:
        out += _diloco_at(dp, fit, iterations, inner_steps, compress, profiles_dir, rtt)
    return out


def _diloco_at(dp: Plan, fit: ConvergenceFit, iterations: float, inner_steps: Sequence[int], compress: str,
               profiles_dir: str | None, rtt: bool) -> list[CutCandidate]:
    """diloco_candidates at one wire dtype: the exchange carries numel x WIRE_BYTES[compress]."""
    nodes = list(dict.fromkeys(a.node for a in dp.assignments if a.used))
    n = sum(1 for a in dp.assignments if a.used)
    payload = model_spec(dp).num_params * WIRE_BYTES[compress]
    suffix = "" if compress == "fp32" else f" {compress}"
    out = []
    for groups in set_partitions(nodes):
        if len(groups) < 2:
            continue
        base, inner = None, None
        for zero in [z for z in ZERO_LEVELS if z >= dp.zero]:  # each group holds a whole copy: may need more
            try:
                base = replace(dp, zero=zero)
                inner = max(group_step_s(base, g, profiles_dir, rtt) for g in groups)
                break
            except ValueError as e:
                log.info("diloco groups %s at ZeRO-%d not priced: %s", groups, zero, e)
        if inner is None:
            continue
        ex = exchange_s(base, groups, payload, rtt)
        lo, hi = fit.inner_steps_range(len(groups), compress)
        for h in inner_steps:
            if compress != "fp32" and not lo <= h <= hi:
                continue  # a compressed exchange is priced only at the H its k was measured over
            est = fit.estimate(h, len(groups), compress)
            plan = to_diloco_plan(base, h, groups=groups, compress=compress)
            it = inner + ex / h
            plan = replace(plan, predicted_iteration_s=it, predicted_samples_per_s=dp.global_batch / it,
                           notes=(*plan.notes, est.note))
            out.append(CutCandidate(f"diloco H={h} groups={'|'.join(','.join(g) for g in groups)}{suffix}", "diloco", plan,
                                    it, est.multiplier, iterations * est.multiplier * it,
                                    2 * (n - 1) / n * payload / h, h, ex, est.note))
    return out


def choose_cuts(scenario: GeoScenario, pipeline: Plan | None, fit: ConvergenceFit | None, *,
                target_tokens: int | None = None, inner_steps: Sequence[int] = INNER_STEPS,
                compresses: Sequence[str] | None = None,
                profiles_dir: str | None = None, rtt: bool = True) -> CutChoice:
    """Price the pipeline plan (Atlas's, as a plan file; None: not offered), synchronous DP over every
    datacenter and DiLoCo (when a convergence fit exists) by time to `target_tokens` (default: 1000
    iterations' tokens); the fastest first. Ties keep the order pipeline, dp, diloco."""
    tokens_per_iteration = scenario.global_batch * scenario.seq
    target = 1000 * tokens_per_iteration if target_tokens is None else int(target_tokens)
    if target < 1:
        raise ValueError(f"target_tokens must be >= 1, got {target_tokens!r}")
    iterations = target / tokens_per_iteration
    cands, notes = [], []
    if pipeline is not None:
        pipeline = replace(pipeline, cuts=pipeline_cuts(pipeline))
        cands.append(CutCandidate("pipeline", "pipeline", pipeline, pipeline.predicted_iteration_s, 1.0,
                                  iterations * pipeline.predicted_iteration_s, wan_bytes_per_step_pipeline(pipeline),
                                  note="Atlas's plan" + ("" if pipeline.cuts else ": one datacenter, no cut")))
    dp = None
    if len(scenario.datacenters) > 1:
        try:
            dp = scenario_dp_plan(scenario, profiles_dir, rtt)
        except ValueError as e:
            notes.append(f"dp and diloco not priced: data parallelism over every datacenter is not runnable ({e})")
    if dp is not None:
        cands.append(CutCandidate("dp", "dp", dp, dp.predicted_iteration_s, 1.0,
                                  iterations * dp.predicted_iteration_s, wan_bytes_per_step_dp(dp)))
    if dp is not None and fit is None:
        notes.append("diloco not priced: no convergence fit (python bench/diloco_convergence.py writes it)")
    elif dp is not None:
        cands += diloco_candidates(dp, fit, iterations, inner_steps, compresses, profiles_dir, rtt)
    if not cands:
        raise ValueError("choose_cuts: nothing to choose from (no pipeline plan and one datacenter)")
    cands.sort(key=lambda c: c.time_to_target_s if math.isfinite(c.time_to_target_s) else math.inf)  # stable
    chosen = cands[0]
    if chosen.kind == "diloco":
        notes.append(chosen.note)
    return CutChoice(tuple(cands), target, tuple(notes))


def choose_geo_cuts(scenario: GeoScenario, geo, schedule: str = "1f1b", target_tokens: int | None = None
                    ) -> CutChoice:
    """choose_cuts with Atlas's plan `geo` (atlas.GeoPlan) as the pipeline candidate and the committed
    convergence fit (convergence.load_fit)."""
    from planner.geo.convergence import load_fit
    from planner.geo.plan_file import geo_plan_to_plan

    return choose_cuts(scenario, geo_plan_to_plan(scenario, geo, schedule=schedule), load_fit(),
                       target_tokens=target_tokens)


__all__ = ["CutCandidate", "CutChoice", "INNER_STEPS", "choose_cuts", "choose_geo_cuts", "diloco_candidates", "exchange_s",
           "group_step_s", "pipeline_cuts", "scenario_dp_plan", "set_partitions", "wan_bytes_per_step_dp",
           "wan_bytes_per_step_pipeline"]
