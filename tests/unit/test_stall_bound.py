"""The stall watchdog's bound (executor/stall.py): derived from the plan's predicted iteration unless
given, and the ranks' collective timeout past it."""
from __future__ import annotations

from dataclasses import replace

from contracts.run import RunConfig
from executor.stall import STALL_FACTOR, STALL_MIN_S, STARTUP_ALLOWANCE_S, collective_timeout, stall_bound_s
from testkit.runs import two_cpu_plan

STALL_S = 8.0


def test_the_bound_comes_from_the_predicted_step_unless_given(tmp_path):
    plan = two_cpu_plan()  # predicted iteration 0.1 s: the floor applies
    assert stall_bound_s(plan, None) == STALL_MIN_S
    slow = replace(plan, predicted_iteration_s=60.0)
    assert stall_bound_s(slow, None) == STALL_FACTOR * 60.0
    assert stall_bound_s(slow, 5.0) == 5.0
    # the ranks' collective timeout outlasts the watchdog (which names the rank) and is read from run.json
    RunConfig(steps=1, run_dir=str(tmp_path), stall_timeout_s=STALL_S).save()
    assert collective_timeout(plan, str(tmp_path)).total_seconds() == 2 * STALL_S + STARTUP_ALLOWANCE_S
    assert collective_timeout(plan, str(tmp_path / "no-run-json")).total_seconds() < 30 * 60  # gloo's default
