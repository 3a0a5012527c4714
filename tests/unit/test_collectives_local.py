"""Uneven collectives in one process: the local copy takes only its slice, allocations match the real
backend under fake tensors, bad bounds and arguments raise, the group's backend is read as gloo or nccl
(the multi-rank collectives: tests/e2e/test_collectives.py; their bytes and scratch: test_wire.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from contracts import wire
from models.collectives import LocalCollectives, ProcessGroupCollectives, validate_bounds
from profiler.memtrack import LiveTensorBytes
from tests.e2e.test_collectives import BOUNDS, NUMEL, SENTINEL, WORLD, rank_full, shard_values


def test_local_copies_only_its_slice():
    lc = LocalCollectives(2, WORLD)
    full = torch.full((NUMEL,), SENTINEL)
    lc.all_gather(full, shard_values(2), BOUNDS).wait()
    want = torch.full((NUMEL,), SENTINEL)
    want[6:11] = shard_values(2)
    torch.testing.assert_close(full, want)
    out = torch.empty(5)
    lc.reduce_scatter(out, rank_full(0), BOUNDS).wait()
    torch.testing.assert_close(out, rank_full(0)[6:11])
    t = torch.tensor([1.0, 2.0])
    lc.all_reduce(t, "max")
    torch.testing.assert_close(t, torch.tensor([1.0, 2.0]))
    assert lc.scratch_bytes(BOUNDS, 4) == 0


def test_local_allocations_match_the_real_backend_and_work_under_fake_tensors():
    lc = LocalCollectives(0, WORLD)
    full, shard = torch.zeros(NUMEL), shard_values(0)
    with LiveTensorBytes([full, shard]) as mem:
        lc.all_gather(full, shard, BOUNDS).wait()
        lc.reduce_scatter(shard, full, BOUNDS, async_op=True).wait()
    # the same count the 3-rank job measured for ProcessGroupCollectives (test above), plus scratch 0
    assert mem.peak_bytes == full.nbytes + shard.nbytes + lc.scratch_bytes(BOUNDS, full.element_size())
    with FakeTensorMode():
        f, s = torch.empty(NUMEL, dtype=torch.bfloat16), torch.empty(6, dtype=torch.bfloat16)
        lc.all_gather(f, s, BOUNDS, async_op=True).wait()
        lc.reduce_scatter(s, f, BOUNDS).wait()


@pytest.mark.parametrize("bounds, match", [
    (((0, 6), (7, 7), (7, 11)), "not contiguous: slice 1 starts at 7, expected 6"),
    (((1, 6), (6, 6), (6, 11)), "slice 0 starts at 1, expected 0"),
    (((0, 6), (6, 5), (5, 11)), "ends before it starts"),
    (((0, 6), (6, 11)), "2 slices for a world of 3"),
    (((0, 6), (6, 6), (6, 10)), "cover \\[0, 10\\) but the full buffer has 11"),
])
def test_bad_bounds_raise(bounds, match):
    lc = LocalCollectives(0, WORLD)
    with pytest.raises(ValueError, match=match):
        lc.all_gather(torch.zeros(NUMEL), torch.zeros(6), bounds)


def test_bad_arguments_raise():
    lc = LocalCollectives(0, WORLD)
    with pytest.raises(ValueError, match="shard has 5 elements but position 0's slice \\[0, 6\\) has 6"):
        lc.all_gather(torch.zeros(NUMEL), torch.zeros(5), BOUNDS)
    with pytest.raises(ValueError, match="shard_out has 7 elements"):
        lc.reduce_scatter(torch.zeros(7), torch.zeros(NUMEL), BOUNDS)
    with pytest.raises(ValueError, match="bfloat16"):
        lc.all_gather(torch.zeros(NUMEL), torch.zeros(6, dtype=torch.bfloat16), BOUNDS)
    with pytest.raises(ValueError, match="contiguous"):
        lc.all_gather(torch.zeros(2 * NUMEL)[::2], torch.zeros(6), BOUNDS)
    with pytest.raises(ValueError, match="op must be one of"):
        lc.all_reduce(torch.zeros(2), "mean")
    with pytest.raises(ValueError, match="not in a world"):
        LocalCollectives(3, WORLD)
    assert validate_bounds([(0, 0), (0, 3)], 2, 3) == ((0, 0), (0, 3))


def test_local_scratch_is_what_the_gloo_methods_allocate():
    """The tracer's stand-in allocates nothing, as gloo's chosen methods do (contracts.wire)."""
    lc = LocalCollectives(1, WORLD)
    for bounds in (BOUNDS, ((0, 4), (4, 8), (8, 12)), ((0, 2_000_000), (2_000_000, 2_000_000), (2_000_000, 2_100_000))):
        sizes = [e - s for s, e in bounds]
        for elem in (4, 2):
            assert lc.scratch_bytes(bounds, elem) == 0
            assert wire.gather_scratch_bytes(sizes, elem, WORLD, "gloo") == 0
            assert wire.reduce_scatter_scratch_bytes(sizes, elem, WORLD, "gloo") == 0


@pytest.mark.parametrize("name, want", [("gloo", "gloo"), ("nccl", "nccl"), ("cpu:gloo,cuda:nccl", "nccl")])
def test_backend_name_of_the_group(monkeypatch, name, want):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    assert ProcessGroupCollectives(0, (0, 1)).backend == want


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "mpi")
    with pytest.raises(ValueError, match="gloo or nccl"):
        ProcessGroupCollectives(0, (0, 1))
