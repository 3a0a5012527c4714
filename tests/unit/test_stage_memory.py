"""Pipeline stage memory without ranks: the micro-batches in flight match the schedule the runtime
runs, and activations grow with them (measured peaks per stage rank:
tests/e2e/test_stage_memory.py)."""
import pytest

from contracts.pipeline_order import schedule_in_flight, schedule_order
from contracts.specs import get_model, with_max_seq
from planner.core.stage_memory import estimate_stage_memory
from tests.e2e.test_pipeline_runtime import DP2_THEN_1, plan_of


def test_in_flight_counts_match_the_schedule_the_runtime_runs():
    """The closed form (1F1B min(S-s, M), GPipe M) against a walk over the ops of the order."""
    for schedule in ("1f1b", "gpipe"):
        for S in (1, 2, 3, 5):
            for M in (1, 2, 4, 7):
                for s in range(S):
                    live = peak = 0
                    for op, _ in schedule_order(schedule, S, s, M):
                        live += 1 if op == "F" else -1
                        peak = max(peak, live)
                    assert live == 0 and schedule_in_flight(schedule, S, s, M) == peak, (schedule, S, s, M)
    assert [schedule_in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [schedule_in_flight("gpipe", 4, s, 8) for s in range(4)] == [8] * 4
    with pytest.raises(ValueError, match="schedule"):
        schedule_in_flight("interleaved", 2, 0, 4)


def test_activations_grow_with_the_micro_batches_in_flight():
    spec = with_max_seq(get_model("small"), 64)
    plan = plan_of(DP2_THEN_1, "gpipe", num_microbatches=8)
    e8 = estimate_stage_memory(spec, plan.pipeline, 0, 0, 0.6, 64)
    e4 = estimate_stage_memory(spec, plan_of(DP2_THEN_1, "gpipe").pipeline, 0, 0, 0.6, 64)
    assert e8.in_flight == 8 and e4.in_flight == 4
    assert e8.phase == e4.phase == "last_block" and e8.activations_bytes == 2 * e4.activations_bytes
    last = estimate_stage_memory(spec, plan.pipeline, 1, 0, 1.0, 64)
    assert last.tied_replica_bytes > 0 and last.params_bytes > last.tied_replica_bytes / 2
    with pytest.raises(ValueError, match="no rank"):
        estimate_stage_memory(spec, plan.pipeline, 2, 0, 1.0, 64)
    with pytest.raises(ValueError, match="recompute"):
        estimate_stage_memory(spec, plan.pipeline, 0, 0, 0.6, 64, recompute="selective")
    # full recomputation: GPipe's 8 micro-batches keep 3 block inputs each, not 3 blocks' activations
    full = estimate_stage_memory(spec, plan.pipeline, 0, 0, 0.6, 64, recompute="full")
    assert full.peak_bytes < e8.peak_bytes and full.params_bytes == e8.params_bytes
