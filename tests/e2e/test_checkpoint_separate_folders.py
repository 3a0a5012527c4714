"""Two ranks (real processes, gloo) saving into run folders that are not shared, as nodes with
their own disks do: position 0 cannot see position 1's files, so the save raises
CheckpointIncomplete on position 0 only after the barrier every rank passes (nobody hangs in it),
and latest.json names nothing."""
from __future__ import annotations

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from executor import checkpoint as ckpt
from testkit.processes import free_port
from testkit.wait import wait_until
from tests.e2e.test_executor_checkpoint import FakeRuntime, make_plan, whole_state

FRACTIONS = (0.5, 0.5)


def _rank(rank: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    plan = make_plan(FRACTIONS)
    units = ckpt.plan_units(plan)
    run = os.path.join(root, f"node{rank}")
    got = "saved"
    try:
        ckpt.save(run, FakeRuntime(units, FRACTIONS, rank, whole_state(units)), rank, 3, plan)
    except ckpt.CheckpointIncomplete as e:
        got = str(e)
    dist.barrier()  # the next collective of the run: matched by both ranks
    with open(os.path.join(root, f"rank{rank}.txt"), "w") as fh:
        fh.write(got)
    dist.destroy_process_group()


def test_a_save_into_unshared_folders_is_incomplete_on_position_0_and_hangs_no_rank(tmp_path):
    ctx = mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    try:
        wait_until(lambda: ctx.join(timeout=1), 120, "both ranks to pass the save and end")
    finally:
        for p in ctx.processes:  # a hung rank must not outlive the test
            if p.is_alive():
                p.kill()
    assert "positions [1] wrote no complete meta" in (tmp_path / "rank0.txt").read_text()
    assert (tmp_path / "rank1.txt").read_text() == "saved"
    assert ckpt.latest(str(tmp_path / "node0")) is None and ckpt.latest(str(tmp_path / "node1")) is None
