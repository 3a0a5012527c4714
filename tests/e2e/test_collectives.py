"""models/collectives.py: uneven all-gather / reduce-scatter on 3 real gloo ranks, LocalCollectives.

One 3-rank gloo job (spawned once per module) runs every multi-rank scenario and saves each rank's
raw outputs; the tests compute the expected values here, from the inputs' formulas, and compare.
Positions are permuted against ranks (position_to_rank = (2, 0, 1)) and one slice is empty.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.launch import free_port
from profiler.memtrack import LiveTensorBytes
from models.collectives import ProcessGroupCollectives

WORLD = 3
POSITION_TO_RANK = (2, 0, 1)
NUMEL = 11
BOUNDS = ((0, 6), (6, 6), (6, 11))  # position 1 holds nothing (shard fraction 0)
EVEN = ((0, 4), (4, 8), (8, 12))
OFFSET = 3  # `full` is a view into a bigger buffer, starting here
SENTINEL = -7.0
ASYNC_DELAY_S = 0.6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shard_values(position: int, bounds=BOUNDS) -> torch.Tensor:
    s, e = bounds[position]
    return torch.arange(s, e, dtype=torch.float32) + 100.0 * (position + 1)


def rank_full(rank: int, numel: int = NUMEL) -> torch.Tensor:
    """What rank `rank` contributes to a reduce-scatter: small integers, exact in bf16 sums."""
    return (torch.arange(numel, dtype=torch.float32) % 5) * (rank + 1) + rank


def _gather(coll, dtype, async_op, bounds=BOUNDS):
    numel = bounds[-1][1]
    big = torch.full((numel + 2 * OFFSET,), SENTINEL, dtype=dtype)
    full = big[OFFSET:OFFSET + numel]
    work = coll.all_gather(full, shard_values(coll.position, bounds).to(dtype), bounds, async_op=async_op)
    work.wait()
    return big


def _reduce(coll, rank, dtype, async_op, bounds=BOUNDS):
    s, e = bounds[coll.position]
    out = torch.full((e - s,), SENTINEL, dtype=dtype)
    work = coll.reduce_scatter(out, rank_full(rank, bounds[-1][1]).to(dtype), bounds, async_op=async_op)
    work.wait()
    return out


def _async_probe(coll, rank):
    """Rank 0 issues an async gather while its peers start 0.6 s late: the call must return
    before the peers' data exist, and wait() must deliver all of it."""
    full = torch.full((NUMEL,), SENTINEL)
    if rank != 0:
        time.sleep(ASYNC_DELAY_S)
    t0 = time.perf_counter()
    work = coll.all_gather(full, shard_values(coll.position), BOUNDS, async_op=True)
    issue_s = time.perf_counter() - t0
    before_wait = full.clone()
    work.wait()
    return {"issue_s": issue_s, "total_s": time.perf_counter() - t0, "before_wait": before_wait, "after": full}


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        position = POSITION_TO_RANK.index(rank)
        coll = ProcessGroupCollectives(position, POSITION_TO_RANK)
        res = {"position": position}
        for name, dtype in DTYPES.items():
            for async_op in (False, True):
                res[f"gather/{name}/{async_op}"] = _gather(coll, dtype, async_op)
                res[f"reduce/{name}/{async_op}"] = _reduce(coll, rank, dtype, async_op)
        identity = ProcessGroupCollectives(rank, range(WORLD))
        res["gather/even"] = _gather(identity, torch.float32, False, EVEN)
        res["reduce/even"] = _reduce(identity, rank, torch.float32, True, EVEN)
        t = torch.tensor([float(rank), -float(rank), 1.0])
        coll.all_reduce(t, "sum")
        res["all_reduce/sum"] = t
        t = torch.tensor([float(rank), -float(rank), 1.0])
        coll.all_reduce(t, "max")
        res["all_reduce/max"] = t
        # allocations of the real backend: nothing beyond the arguments' storages
        full, shard = torch.zeros(NUMEL), shard_values(position)
        with LiveTensorBytes([full, shard]) as mem:
            coll.all_gather(full, shard, BOUNDS).wait()
            coll.reduce_scatter(shard, full, BOUNDS, async_op=True).wait()
        res["alloc"] = (mem.peak_bytes, full.nbytes + shard.nbytes)
        res["async"] = _async_probe(coll, rank)
        try:
            ProcessGroupCollectives((position + 1) % WORLD, POSITION_TO_RANK)
        except ValueError as exc:
            res["wrong_position"] = str(exc)
        # world 1: a group holding only this rank (every rank creates every group, in order)
        groups = [dist.new_group([r]) for r in range(WORLD)]
        solo = ProcessGroupCollectives(0, [0], group=groups[rank])
        res["solo/gather"] = _gather(solo, torch.float32, True, ((0, 5),))
        res["solo/reduce"] = _reduce(solo, rank, torch.float32, False, ((0, 5),))
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("collectives"))
    mp.start_processes(_worker, args=(free_port(), out_dir), nprocs=WORLD, start_method="spawn")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def expected_full(bounds=BOUNDS) -> torch.Tensor:
    return torch.cat([shard_values(p, bounds) for p in range(len(bounds))])


def expected_slice(position: int, bounds=BOUNDS) -> torch.Tensor:
    s, e = bounds[position]
    return sum(rank_full(r, bounds[-1][1]) for r in range(WORLD))[s:e]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_gives_every_rank_the_full_buffer(ranks, dtype, async_op):
    want = torch.full((NUMEL + 2 * OFFSET,), SENTINEL)
    want[OFFSET:OFFSET + NUMEL] = expected_full()
    want = want.to(DTYPES[dtype]).float()  # bf16 rounds shard values above 256
    for res in ranks:
        got = res[f"gather/{dtype}/{async_op}"]
        assert got.dtype == DTYPES[dtype]
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)  # outside the view untouched too


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_gives_each_rank_the_sum_of_its_slice(ranks, dtype, async_op):
    for res in ranks:
        got = res[f"reduce/{dtype}/{async_op}"]
        assert got.numel() == BOUNDS[res["position"]][1] - BOUNDS[res["position"]][0]
        torch.testing.assert_close(got.float(), expected_slice(res["position"]), rtol=0, atol=0)


def test_even_split_and_world_one(ranks):
    for rank, res in enumerate(ranks):
        torch.testing.assert_close(res["gather/even"][OFFSET:OFFSET + 12], expected_full(EVEN), rtol=0, atol=0)
        torch.testing.assert_close(res["reduce/even"], expected_slice(rank, EVEN), rtol=0, atol=0)
        torch.testing.assert_close(res["solo/gather"][OFFSET:OFFSET + 5], shard_values(0, ((0, 5),)))
        torch.testing.assert_close(res["solo/reduce"], rank_full(rank, 5))


def test_all_reduce_sum_and_max(ranks):
    for res in ranks:
        torch.testing.assert_close(res["all_reduce/sum"], torch.tensor([3.0, -3.0, 3.0]))
        torch.testing.assert_close(res["all_reduce/max"], torch.tensor([2.0, 0.0, 1.0]))


def test_async_returns_before_the_data_and_wait_delivers_it(ranks):
    probe = ranks[0]["async"]
    own = ranks[0]["position"]
    # peers had not even called yet when the call returned: their slices still hold the sentinel
    assert probe["issue_s"] < 0.25 * ASYNC_DELAY_S, probe
    for p, (s, e) in enumerate(BOUNDS):
        if p != own and e > s:
            assert (probe["before_wait"][s:e] == SENTINEL).all(), (p, probe["before_wait"])
    assert probe["total_s"] > 0.5 * ASYNC_DELAY_S  # wait() waited for the late peers
    torch.testing.assert_close(probe["after"], expected_full(), rtol=0, atol=0)


def test_real_backend_allocates_nothing_beyond_its_arguments(ranks):
    for res in ranks:
        peak, resident = res["alloc"]
        assert peak == resident


def test_position_must_match_this_rank(ranks):
    for res in ranks:
        assert "maps to rank" in res["wrong_position"]


# ---- LocalCollectives: one process standing in for one position ---------------------------------


