"""Fabricated plans and run folders, as the executor writes them (through its own store API), for
tests and benches that read runs without training one: `two_cpu_plan`, `small_plan`,
`fabricate_run`, `write_step`."""
from __future__ import annotations

import os
from typing import Any

GLOBAL_BATCH = 4
SEQ = 64
STEP_S = 0.25


def two_cpu_plan(slowdown: float = 1.0) -> Any:
    """A 2-rank plan of the tiny model on this machine; rank 1 emulated slower if slowdown != 1."""
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from contracts.plan import Assignment, Plan

    dev = DeviceSpec("cpu", slowdown=slowdown)
    cluster = ClusterSpec("local", (NodeSpec("localhost", "local", (DeviceSpec("cpu"), dev)),))
    asg = (
        Assignment(0, "localhost", "cpu", 2, 1, 2, 0.5, 10**7, 0.1),
        Assignment(1, "localhost", "cpu", 1, 2, 2, 0.5, 10**7, 0.1, emulated=dev.emulated, slowdown=slowdown),
    )
    return Plan(cluster, "tiny", GLOBAL_BATCH, SEQ, "fp32", "none", asg, 0.1, 40.0)


def small_plan(slowdowns: tuple[float, ...] = (1.0, 3.0)) -> Any:
    """A plan of one emulated CPU rank per slowdown (sequence 16), for the store's tests and bench."""
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from contracts.plan import Assignment, Plan

    devs = tuple(DeviceSpec("cpu", slowdown=s) for s in slowdowns)
    cluster = ClusterSpec("t", (NodeSpec("localhost", "local", devs),))
    asg = tuple(Assignment(i, "localhost", "cpu", 2, 1, 2, 1 / len(devs), 1000 + i, 0.5, emulated=d.emulated,
                           slowdown=d.slowdown) for i, d in enumerate(devs))
    return Plan(cluster, "tiny", 2 * len(devs), 16, "fp32", "none", asg, 0.5, 8.0)


def losses(offset: float, n: int) -> list[float]:
    return [offset + 4.0 / (1 + i) for i in range(n)]


def write_step(store: Any, step: int, loss: float) -> None:
    """One optimizer step as the ranks record it (rank rows first, then rank 0's step row)."""
    for rank in (0, 1):
        store.record_rank_step(rank, step, 0.2, 0.0, 0.01, 0.02, 5_000_000 + rank)
    store.record_step(step, loss, STEP_S, GLOBAL_BATCH, SEQ)


def fabricate_run(name: str, n_steps: int, status: str | None, slowdown: float = 1.0, loss_offset: float = 0.0,
                  root: str | None = None) -> str:
    """A run folder as the executor writes it: plan.json + metrics.sqlite through MetricsStore.
    status None leaves it running (its 'launcher' is this process, which is alive)."""
    from contracts.paths import runs_dir
    from executor.store import MetricsStore

    run_dir = os.path.join(root or runs_dir(), name)
    os.makedirs(run_dir)
    plan = two_cpu_plan(slowdown)
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    try:
        store.init_run(plan, steps_target=10_000, seed=0, backend="gloo")
        for step, loss in enumerate(losses(loss_offset, n_steps)):
            write_step(store, step, loss)
        if status is not None:
            store.finish(status)
    finally:
        store.close()
    return run_dir


def one_cpu_rank_plan(model: str, global_batch: int, seq: int, micro_batch: int = 8) -> Any:
    """`model` at `global_batch` on one unlimited CPU rank (micro-batch × accumulation): the
    reference a parallel run's losses are compared with."""
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from contracts.plan import Assignment, Plan

    cluster = ClusterSpec("one", (NodeSpec("localhost", "local", (DeviceSpec("cpu"),)),))
    asg = (Assignment(0, "localhost", "cpu", micro_batch, global_batch // micro_batch, global_batch, 1.0, 0, 0.0),)
    return Plan(cluster, model, global_batch, seq, "fp32", "none", asg, 0.0, 0.0)


def run_losses(run_dir: str) -> list[float]:
    """The losses a run folder's store recorded, step by step."""
    from executor.store import read_metrics

    return [s["loss"] for s in read_metrics(run_dir)["steps"]]
