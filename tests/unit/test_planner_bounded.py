"""Huge global batches in the planner, in this process: a local batch of 1e5 planned exactly and never
over memory, candidate tables that do not grow with the batch (the solver's wall limit and
subprocess runs: tests/e2e/test_planner_bounded.py)."""
from contracts.cluster import ClusterSpec
from planner.costmodel.training import CostModel
from planner.hetero.solve import solve_plan
from tests.e2e.test_planner_bounded import LOCAL


def test_local_batch_of_1e5_is_planned_exactly_and_never_over_memory(data_dir):
    # before bounded planning this failed after 10 s: "the solver's time limit of 10 s ran out"
    cluster = ClusterSpec.load(LOCAL)
    result = solve_plan(cluster, "tiny", 100_000, time_limit_s=10.0)
    plan = result.plan
    assert sum(a.batch for a in plan.assignments) == 100_000
    assert result.status == "optimal", result.reason  # the bands are exact (planner/costmodel/training.py)
    for a, (_, d) in zip(plan.assignments, cluster.devices()):
        assert a.predicted_memory_bytes <= d.memory_bytes * 0.9 + 1
    feasible = [b.predicted_iteration_s for b in plan.baselines.values() if not b.oom]
    assert all(plan.predicted_iteration_s <= t * (1 + 1e-9) for t in feasible)


def test_candidate_tables_do_not_grow_with_the_batch(data_dir):
    from contracts.specs import get_model, with_max_seq
    spec = with_max_seq(get_model("tiny"), 128)
    cost = CostModel.build(ClusterSpec.load(LOCAL), spec, 128, "fp32", "none", 0.9, zero=1)
    dev = cost.cluster.devices()[0][1]
    sizes = {b: len(cost.choices(dev, b)) + len(cost.bands(dev, b)) for b in (10_000, 100_000, 10**8)}
    # 10,000× the batch, the same table: per micro-batch one n = 1 choice and a band or two (the room's
    # plateau at the whole state, then its affine descent); the old tables grew with log2 B, and before
    # them 10,000×
    assert sizes[10_000] == sizes[100_000] <= sizes[10**8] <= sizes[10_000] + 8, sizes
    assert max(sizes.values()) <= 3 * 8, sizes
