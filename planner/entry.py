"""The planner's one entry: every caller that wants a plan of a job on a cluster asks here.

`plan_job` is what `python -m planner plan` does: the hetero ILP's data-parallel plan
(planner/hetero/solve.py), then on a cluster of two or more nodes the best pipeline beside it and
the faster of the two (planner/geo/cluster_plan.py), and on a cluster of SCALE_MIN_NODES or more the joint search
over pipeline stages × uneven data parallelism × tensor parallelism (planner/geo/scale/). The Plan page, the dashboard's default plan,
the queue's orchestrator and the CLI all call it, so the same inputs give the same plan everywhere.
Beside it, what the executor asks of the planner: a job's plan on the devices the scheduler picked
(`plan_on_devices`), and the even or proportional split of a plan's devices that a run is
measured against (`baseline_plan`). Which devices a queued job gets is the scheduler's
(planner/schedule/).

Read docs/ARCHITECTURE.md for who calls what; the models behind each plan are in docs/.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from contracts.cluster import ClusterSpec, NodeSpec
from contracts.constants import MEMORY_HEADROOM
from contracts.plan import DEFAULT_PREFETCH, Assignment, BaselineResult, Plan
from contracts.specs import get_model, with_max_seq
from planner.core.profiles import profile_notes, with_profile_notes
from planner.costmodel.training import PARAM_DTYPE_AUTO, CostModel
from planner.geo.cluster_plan import choose_plan, solve_cluster_pipeline
from planner.geo.scale.job import DEFAULT_MAX_TP, applies, solve_job_at_scale
from planner.hetero.baselines import fastest_fitting_split, split_by_weights
from planner.hetero.solve import DEFAULT_MAX_SEQ, ZERO_AUTO, evaluate_plan, solve_plan

DEFAULT_TIME_LIMIT_S = 10.0  # the solver's time limit (`planner plan --time-limit`)
MIXED_GAIN = 0.9  # take idle devices of other types only for a predicted >= 10 % shorter iteration
EVEN = "even"
PROPORTIONAL = "proportional"


@dataclass(frozen=True)
class PlanResult:
    status: str  # "optimal" | "feasible" (the ILP's time limit ran out before its search closed)
    reason: str  # why not proven optimal ("" when it is)
    plan: Plan  # the fastest plan the runtime runs (every TP degree 1)
    solve_s: float  # the whole planning: the ILP, the pipeline search and the joint search
    # the plan file to write where it is not `plan.to_dict()`: the joint search's plan with its stage / tp /
    # tp_group keys, or a faster plan with tensor parallelism (`"tensor_parallel": true`, which the runtime
    # does not run yet); None: write `plan.to_dict()`
    plan_file: dict | None = None

    def plan_dict(self) -> dict:
        """The plan file this result writes (`planner plan --json` / `--out`)."""
        return self.plan_file if self.plan_file is not None else self.plan.to_dict()


def default_seq(model: str) -> int:
    """The sequence length a plan uses when none is given: the model's own, at most DEFAULT_MAX_SEQ."""
    return min(get_model(model).max_seq, DEFAULT_MAX_SEQ)


def plan_job(cluster: ClusterSpec, model: str, global_batch: int, *, seq: int | None = None, dtype: str = "fp32",
             recompute: str = "none", zero: int | str = ZERO_AUTO, headroom: float = MEMORY_HEADROOM,
             time_limit_s: float = DEFAULT_TIME_LIMIT_S, pipeline: bool = True,
             profiles_dir: str | None = None, param_dtype: str = PARAM_DTYPE_AUTO,
             reduce_dtype: str = "fp32", max_tp: int = DEFAULT_MAX_TP) -> PlanResult:
    """The fastest plan of `model` on `cluster` at `global_batch` (module docstring). `pipeline`:
    price pipeline stages on a multi-node cluster (False: pure data parallelism); on a cluster of
    SCALE_MIN_NODES or more nodes of one GPU type each, the joint search over stages × uneven data
    parallelism × tensor parallelism up to `max_tp` (planner/geo/scale/, docs/models/scale.md), kept
    where it predicts a shorter iteration; a faster plan with tp > 1 is returned as `plan_file` only
    (`plan` stays the fastest the runtime runs). `param_dtype`,
    `reduce_dtype`: the runtime's mixed precision (planner.hetero.solve.solve_plan; the plan file
    records them resolved, with the prefetch depth and reduce-scatters in flight the ILP chose). Raises ValueError on bad input
    and when no plan fits, naming why."""
    result = solve_plan(cluster, model, global_batch, seq=seq, dtype=dtype, recompute=recompute, headroom=headroom,
                        time_limit_s=time_limit_s, profiles_dir=profiles_dir, zero=zero, param_dtype=param_dtype,
                        reduce_dtype=reduce_dtype)
    plan = result.plan
    if pipeline and len(cluster.nodes) > 1:
        option = solve_cluster_pipeline(cluster, model, global_batch, plan.seq, dtype, profiles_dir=profiles_dir)
        plan = choose_plan(plan, option)
    plan_file, solve_s = None, plan.solve_s
    if pipeline and dtype == "fp32" and recompute == "none" and applies(cluster):
        plan, plan_file, solve_s = _joint(cluster, model, global_batch, plan, dtype, headroom, time_limit_s,
                                          profiles_dir, max_tp)
    named = profile_notes(plan, profiles_dir)
    plan = with_profile_notes(plan, notes=named)  # in place of a pipeline plan's own (planner/geo/plan_file.py)
    if plan_file is not None:
        plan_file = dict(plan_file, notes=list(plan_file.get("notes", ())) + list(named))
    return PlanResult(result.status, result.reason, plan, solve_s, plan_file)


def _joint(cluster: ClusterSpec, model: str, global_batch: int, plan: Plan, dtype: str, headroom: float,
           time_limit_s: float, profiles_dir: str | None, max_tp: int) -> tuple[Plan, dict | None, float]:
    """The joint search beside `plan`: (the plan to run, the plan file when it is not that plan's own, the
    whole solve time). The joint plans are priced in fp32 without recomputation (the per-layer tables'
    setting), so only such jobs ask it."""
    spec = with_max_seq(get_model(model), plan.seq)
    try:
        outcome = solve_job_at_scale(cluster, spec, model, global_batch, plan.seq, dtype, max_tp=max_tp,
                                     time_limit_s=time_limit_s, headroom=headroom, profiles_dir=profiles_dir)
    except ValueError as e:  # nothing of the joint families fits: the ILP's plan stands
        note = f"joint search: {e}"
        return replace(plan, notes=plan.notes + (note,)), None, plan.solve_s
    solve_s = plan.solve_s + outcome.result.solve_s
    joint_s = outcome.result.plan.iteration_s
    beside = f"joint search: {joint_s:.4g} s/iteration vs {plan.predicted_iteration_s:.4g} s"
    if joint_s >= plan.predicted_iteration_s:
        return replace(plan, notes=plan.notes + (beside + " (not faster: kept the plan above)",),
                       solve_s=solve_s), None, solve_s
    if outcome.plan is None:  # faster with tp > 1: the file says so; the runtime's plan stays
        note = beside + " with tensor parallelism (the plan file; the dashboard and queue keep plans that checkpoint)"
        runnable = replace(plan, notes=plan.notes + (note,), solve_s=solve_s)
        d = dict(outcome.plan_dict, solve_s=solve_s)
        return runnable, d, solve_s
    joint = replace(outcome.plan, solve_s=solve_s, baselines={**plan.baselines, "data_parallel_or_geo": BaselineResult(
        plan.predicted_iteration_s, False, "the ILP's / geo search's plan")}, notes=outcome.plan.notes + (beside,))
    d = dict(outcome.plan_dict)
    d.update(solve_s=solve_s, baselines={k: v.to_dict() for k, v in joint.baselines.items()}, notes=list(joint.notes))
    return joint, d, solve_s


# ---- the executor's questions ---------------------------------------------------------------


def sub_cluster(cluster: ClusterSpec, devices: tuple[int, ...], name: str) -> ClusterSpec:
    """The devices `devices` of `cluster` as a cluster of their own (same nodes, same order)."""
    chosen = set(devices)
    nodes, i = [], 0
    for node in cluster.nodes:
        keep = tuple(d for k, d in enumerate(node.devices, start=i) if k in chosen)
        i += len(node.devices)
        if keep:
            nodes.append(NodeSpec(node.name, node.datacenter, keep))
    return ClusterSpec(name, tuple(nodes), cluster.network)


def plan_on_devices(cluster: ClusterSpec, devices: tuple[int, ...], model: str, global_batch: int, *, seq: int,
                    dtype: str, name: str, idle: tuple[int, ...] = (),
                    time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> tuple[Plan, tuple[int, ...]]:
    """`plan_job` on the devices `devices` of `cluster` (as the cluster `name`); when devices of other
    types would idle (`idle`), also on both together, kept when predicted MIXED_GAIN faster, then
    re-planned on only the devices it uses. Returns the plan and the cluster's indices of its devices."""
    def plan_on(chosen: tuple[int, ...]) -> Plan:
        return plan_job(sub_cluster(cluster, chosen, name), model, global_batch, seq=seq, dtype=dtype,
                        time_limit_s=time_limit_s).plan

    plan = plan_on(devices)
    if not idle:
        return plan, devices
    both = tuple(sorted(devices + idle))
    mixed = plan_on(both)
    if mixed.predicted_iteration_s >= MIXED_GAIN * plan.predicted_iteration_s:
        return plan, devices
    used = tuple(both[a.device_index] for a in mixed.assignments if a.used)
    return (plan_on(used) if len(used) < len(both) else mixed), used


def baseline_plan(cluster: ClusterSpec, name: str, model: str, global_batch: int, seq: int, dtype: str = "fp32",
                  recompute: str = "none", zero: int = 1, unit: int = 1,
                  headroom: float = MEMORY_HEADROOM, param_dtype: str = PARAM_DTYPE_AUTO, reduce_dtype: str = "fp32",
                  prefetch: int = DEFAULT_PREFETCH, reduce_in_flight: int = 0) -> Plan:
    """The planner's `even` or `proportional` baseline as a launchable plan: the batch split its way
    (planner.hetero.baselines: `even` equal parts, `proportional` in proportion to each device's
    profiled speed), in multiples of `unit` samples (bench/hetero_speedup.py rounds to its smallest
    micro-batch), even state shards, on each device the largest power-of-two micro-batch dividing
    its batch that fits, priced by the planner's cost model at `zero` and the runtime settings given
    (`param_dtype` auto resolved as planner plan resolves it). Raises ValueError when the batch does
    not divide into units or a device cannot hold its part."""
    if name not in (EVEN, PROPORTIONAL):
        raise ValueError(f"baseline must be {EVEN!r} or {PROPORTIONAL!r}, got {name!r}")
    if unit < 1 or global_batch % unit:
        raise ValueError(f"global batch {global_batch} is not a multiple of {unit} samples")
    cost = CostModel.build(cluster, with_max_seq(get_model(model), seq), seq, dtype, recompute, headroom, zero=zero,
                           param_dtype=param_dtype, reduce_dtype=reduce_dtype, prefetch=prefetch,
                           reduce_in_flight=reduce_in_flight)
    devices = cluster.devices()
    weights = ([1.0] * len(devices) if name == EVEN
               else [cost.coeffs[d].speed_samples_per_s for _, d in devices])
    shard = 1.0 / len(devices)
    assignments = []
    for i, ((node, dev), units) in enumerate(zip(devices, split_by_weights(global_batch // unit, weights))):
        batch = unit * units
        split = fastest_fitting_split(cost, dev, batch, shard)
        if split is None:
            raise ValueError(f"{name} split: {dev.label} cannot hold a batch of {batch} with {shard:.0%} of the state")
        assignments.append(Assignment(i, node.name, dev.type, split[0], split[1], batch, shard, 0, 0.0,
                                      dev.emulated, dev.slowdown, dev.memory_gb))
    plan = Plan(cluster, model, global_batch, seq, dtype, recompute, tuple(assignments), 0.0, 0.0, zero=zero,
                param_dtype=cost.step.param_dtype, reduce_dtype=cost.step.reduce_dtype, prefetch=cost.step.prefetch,
                reduce_in_flight=cost.step.reduce_in_flight)
    return evaluate_plan(plan, headroom)


def even_plan(plan: Plan, headroom: float = MEMORY_HEADROOM) -> Plan:
    """The even split of `plan`'s devices at its model, global batch, seq, dtype, recompute, ZeRO stage
    and runtime settings (param and reduce dtypes, prefetch, reduce-scatters in flight), with live
    rebalancing off: a baseline measured against the plan is run as split, never moved toward the plan."""
    even = baseline_plan(plan.cluster, EVEN, plan.model, plan.global_batch, plan.seq, plan.dtype, plan.recompute,
                         plan.zero, headroom=headroom, param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                         prefetch=plan.prefetch, reduce_in_flight=plan.reduce_in_flight)
    return replace(even, rebalance="off")
