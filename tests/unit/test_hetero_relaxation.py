"""The probe's LP relaxation (planner/hetero/solve.py: relaxation_infeasible) proves infeasibility
only where CBC finds none: hand-solved instances, and every certificate of a large-batch solve
checked against CBC itself."""
import math
import os

from contracts.cluster import ClusterSpec
from planner.costmodel.training import Choice
from planner.hetero import solve as hetero_solve
from planner.hetero.solve import _ChoiceVar, relaxation_infeasible

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def offer(g, batch, cap, ub=2):
    return _ChoiceVar(g, batch, Choice(batch, 1, 1.0, 0.0, 0.0, cap), cap, ub)


def test_hand_solved_instances():
    # two classes of 2 devices: batch 4 with share 0.3 each, or batch 0 (state only) with share 0.5
    offered = [offer(0, 0, 0.5), offer(1, 4, 0.3)]
    counts = [2, 2]
    # B = 8 needs both class-1 devices (0.6), the two state-only ones add 1.0: feasible
    assert not relaxation_infeasible(offered, counts, 8, (1, 4))
    # at most 3 devices: 2 workers (0.6) + 1 state-only (0.5) = 1.1 ≥ 1, still feasible
    assert not relaxation_infeasible(offered, counts, 8, (1, 3))
    # at most 2 devices: both must compute (B = 8), holding 0.6 < 1
    assert relaxation_infeasible(offered, counts, 8, (1, 2))
    # B = 12 exceeds what the two workers take
    assert relaxation_infeasible(offered, counts, 12, (1, 4))
    # 5 devices asked of 4
    assert relaxation_infeasible(offered, counts, 8, (5, 5))


def test_every_certificate_is_confirmed_by_cbc(monkeypatch):
    """Every t the relaxation rejects in a solve, inside a probe or in the bisection's
    relaxation-only floor (relaxation_bound_at), CBC finds infeasible too."""
    real = hetero_solve.relaxation_value
    limit = 1 - hetero_solve.RELAXATION_MARGIN
    certified = []

    def recording(offered, counts, batch, world, stop_below=-math.inf):
        value = real(offered, counts, batch, world, stop_below)
        if value < limit:
            certified.append(world)
        return value

    calls = []  # (table, batch, world, comm_s, t_s) of each certificate
    real_probe, real_bound = hetero_solve.probe, hetero_solve.relaxation_bound_at

    def probe(*args, **kwargs):
        before = len(certified)
        out = real_probe(*args, **kwargs)
        if len(certified) > before:
            calls.append(args[:5])
        return out

    def bound(*args):
        before = len(certified)
        out = real_bound(*args)
        if len(certified) > before:
            calls.append(args)
        return out

    monkeypatch.setattr(hetero_solve, "relaxation_value", recording)
    monkeypatch.setattr(hetero_solve, "probe", probe)
    monkeypatch.setattr(hetero_solve, "relaxation_bound_at", bound)
    spec = ClusterSpec.load(os.path.join(ROOT, "examples", "clusters", "mixed-16.json"))
    for batch in (8, 1_000):
        hetero_solve.solve_plan(spec, "gpt2-xl", batch, dtype="bf16", recompute="full", time_limit_s=60.0)
    assert len(calls) >= 5
    monkeypatch.setattr(hetero_solve, "relaxation_value", lambda *a, **k: math.inf)
    for args in calls:
        assert real_probe(*args, 60.0) is None, args[2:5]
