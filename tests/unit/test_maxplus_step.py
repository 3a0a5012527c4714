"""The step is max-plus (planner/costmodel/training.py, CostModel.estimate_iteration_s): every rank's
compute and collectives, a barrier, every rank's optimizer on its shard, a barrier again. So
T = max_i end_i + max_i opt_i·f_i, and the ILP (planner/hetero/solve.py, the optimizer-budget walk of
solve_scope) balances the optimizers instead of trading a device's compute slack for its optimizer."""
import pytest

from contracts.cluster import DeviceSpec
from planner.hetero.solve import solve_with_cost_model
from tests.unit.test_hetero import GB, affine_memory, coeffs, make_cost, plan_time

FAST = DeviceSpec("A100-80GB")
SLOW = DeviceSpec("T4", memory_gb=3.0)


def two_class_cost(bandwidth_bytes_per_s=float("inf")):
    """A fast device (1 s per sample, optimizer 1 s over the whole state, no memory limit) and a slow one
    (optimizer 3 s) that holds no micro-batch and at most 0.6 of the state (3 GB of 5 GB)."""
    mem = affine_memory(0, 10 * GB, 5 * GB)
    return make_cost([[FAST, SLOW]], {FAST: coeffs(FAST, 0.0, 1.0, 1.0, 100 * GB, mem),
                                      SLOW: coeffs(SLOW, 0.0, 1.0, 3.0, 3 * GB, mem)},
                     bandwidth_bytes_per_s=bandwidth_bytes_per_s)


def test_the_iteration_is_the_slowest_end_plus_the_slowest_optimizer():
    cost = two_class_cost(bandwidth_bytes_per_s=4.0)
    comm_s = cost.comm_model({FAST, SLOW}, False).comm_s(2)
    assert comm_s > 0
    per_device = [(4, 1, 0.4), (0, 0, 0.6)]
    t, steps = cost.estimate_iteration_s(per_device)
    # ends: 4 + comm and 0 + comm; optimizers: 1·0.4 and 3·0.6
    assert t == pytest.approx(4.0 + comm_s + 1.8)
    assert steps == pytest.approx([4.0 + comm_s + 0.4, comm_s + 1.8])  # each device's own work
    assert t > max(steps)  # per device, as max(end + opt·f), it would be 4.4 + comm
    _, exposed = cost.estimate_comm(per_device)
    assert exposed == pytest.approx(comm_s)  # the rank that ends last: the fast one


def brute_force_split(cost, batch: int) -> tuple[float, float]:
    """(least T, the slow device's share): the fast device computes the whole batch (the slow one cannot
    hold a micro-batch); every split of the state on a 1e-4 grid within the slow device's memory, and
    the fast device alone."""
    best = (plan_time(cost, [(batch, 1, 1.0), (0, 0, 0.0)]), 0.0)
    for i in range(1, 6001):
        f = i * 1e-4
        best = min(best, (plan_time(cost, [(batch, 1, 1.0 - f), (0, 0, f)]), f))
    return best


def test_the_ilp_balances_the_optimizers_where_per_device_pricing_would_fill_the_slow_one():
    # per device (the old pricing) the slow device ends at 3·f ≤ 1.8 < 4: it would take all it holds,
    # 0.6, for 4 + 0.4 = 4.4. Max-plus: 4 + max(1·(1 − f), 3·f), least at f = 1/4: 4.75 (that old
    # split now prices 4 + 1.8 = 5.8; the fast device alone 4 + 1 = 5)
    cost = two_class_cost()
    expected, share = brute_force_split(cost, 4)
    assert expected == pytest.approx(4.75, abs=1e-3) and share == pytest.approx(0.25, abs=1e-3)
    assert plan_time(cost, [(4, 1, 0.4), (0, 0, 0.6)]) == pytest.approx(5.8)
    sol, _ = solve_with_cost_model(cost, 4, time_limit_s=20.0, gap=1e-6, micro_batches=[1, 2, 4])
    per_device = [sol.per_device.get(i, (0, 0, 0.0)) for i in range(2)]
    got = plan_time(cost, per_device)
    assert sol.status == "optimal"
    assert got == pytest.approx(4.75, rel=1e-6) and got <= expected * (1 + 1e-9)
    assert per_device[1][:2] == (0, 0) and per_device[1][2] == pytest.approx(0.25, rel=1e-5)
    assert sol.objective_s == pytest.approx(got, rel=1e-12)


def test_dear_collectives_leave_the_state_on_the_fast_device():
    # with the slow device the step pays the collectives of two ranks: above 0.25 s of them the fast
    # device alone (4 + 1) beats the pair (4 + comm + 0.75)
    cost = two_class_cost(bandwidth_bytes_per_s=1.0)
    assert cost.comm_model({FAST, SLOW}, False).comm_s(2) > 0.25
    sol, _ = solve_with_cost_model(cost, 4, time_limit_s=20.0, micro_batches=[1, 2, 4])
    assert sol.per_device == {0: (4, 1, 1.0)}
    assert plan_time(cost, [(4, 1, 1.0), (0, 0, 0.0)]) == pytest.approx(5.0)
