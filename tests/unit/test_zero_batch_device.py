"""A device with batch 0 that only holds a shard of the state (planner/hetero/solve.py).

The defect: `fewest_steps` rewrote every entry's batch "in the fewest accumulation steps at a larger
micro-batch", and a state-only entry's batch 0 divides by every micro-batch, so a (0, 0) device came
out as (m, 0): in a bf16 plan at 128 A100 + 384 V100 an A100 holding only a shard was given
micro-batch 8 × 0 steps, 30 GB of predicted memory (the activations of 8 samples) and a 1.43 s step.
Here a small cluster reproduces that entry; its plan must say micro-batch 0, accumulation 0, the
memory of its shard and state alone, and a step without compute.
"""
from __future__ import annotations

from contracts.cluster import ClusterSpec
from contracts.specs import get_model
from planner.costmodel.training import CostModel
from planner.hetero.solve import build_plan, fewest_steps

MODEL, SEQ, BATCH = "gpt2", 256, 4


def _cost() -> tuple[CostModel, ClusterSpec]:
    cluster = ClusterSpec.from_dict({"name": "zb", "nodes": [
        {"name": "n0", "datacenter": "d", "gpus": {"A100-80GB": 3}}]})
    cost = CostModel.build(cluster, get_model(MODEL), SEQ, "bf16", "none", 0.9, zero=3)
    return cost, cluster


def test_a_state_only_entry_keeps_no_micro_batch():
    cost, _ = _cost()
    table = cost.scope_table("all", False, [0, 1, 2], BATCH)
    cls = table.classes[0]
    state_only = next(ch for ch in cls.choices if ch.batch == 0)
    computing = next(ch for ch in cls.choices if ch.micro_batch == 2 and ch.accum_steps == 1)
    # the class has larger micro-batches, which the batch-0 entry must not be moved to
    assert any(ch.micro_batch > 1 for ch in cls.choices)
    out = fewest_steps(table, [(0, computing, 2), (0, state_only, 1)])
    (_, comp_after, _), (_, state_after, x) = out
    assert (state_after.micro_batch, state_after.accum_steps) == (0, 0) and x == 1
    assert comp_after.batch == computing.batch  # the computing entry keeps its batch


def test_a_state_only_device_in_a_plan_has_no_activations_and_no_compute():
    cost, cluster = _cost()
    dev = cluster.devices()[2][1]
    share = 0.2
    # (8, 0, share): what the defect produced for the state-only device
    plan = build_plan(cost, MODEL, BATCH, SEQ, "bf16", "none", [(2, 1, 0.4), (2, 1, 0.4), (8, 0, share)])
    a = plan.assignments[2]
    assert (a.micro_batch, a.accum_steps, a.batch) == (0, 0, 0)
    assert a.shard_fraction == share
    state_only = cost.estimate_memory_bytes(dev, 0, 0, share)
    assert a.predicted_memory_bytes == int(state_only)
    # no activations: less than the same shard beside one sample's forward and backward
    assert a.predicted_memory_bytes < cost.estimate_memory_bytes(dev, 1, 1, share)
    # no compute: its step is the optimizer on its shard and the collectives, shorter than a computing device's
    assert cost.coeffs[dev].compute_s(a.micro_batch, a.accum_steps) == 0.0
    assert a.predicted_step_s < plan.assignments[0].predicted_step_s
    assert a.predicted_step_s <= plan.predicted_iteration_s
