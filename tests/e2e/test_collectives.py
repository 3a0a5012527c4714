"""models/collectives.py: uneven all-gather / reduce-scatter on 3 real gloo ranks, LocalCollectives.

One 3-rank gloo job (spawned once per module) runs every multi-rank scenario and saves each rank's
raw outputs; the tests compute the expected values here, from the inputs' formulas, and compare.
Positions are permuted against ranks (position_to_rank = (2, 0, 1)) and one slice is empty. Also:
several calls in flight at once, waited in reverse order; the one-all_reduce reduce-scatter (a 2-rank
group, a slice large enough for contracts.wire's rule to pick it); the bytes each rank's sockets send
against contracts/wire.py.
"""
from __future__ import annotations

import shutil
import time

import pytest
import torch
import torch.distributed as dist

from bench.uneven_collectives import measure_sent_bytes
from contracts import wire
from profiler.memtrack import LiveTensorBytes
from models.collectives import ProcessGroupCollectives
from testkit.processes import save_rank_result, spawn_ranks

WORLD = 3
POSITION_TO_RANK = (2, 0, 1)
NUMEL = 11
BOUNDS = ((0, 6), (6, 6), (6, 11))  # position 1 holds nothing (shard fraction 0)
EVEN = ((0, 4), (4, 8), (8, 12))
OFFSET = 3  # `full` is a view into a bigger buffer, starting here
SENTINEL = -7.0
ASYNC_DELAY_S = 0.6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SKEWED = ((0, 2), (2, 9), (9, 11))  # a second split for calls in flight beside BOUNDS
# 8 MiB on a 2-rank group split 0.9/0.1: the rule reduce-scatters by one all_reduce, in fp32 and in bf16
PAIR_NUMEL = {"fp32": 2**21, "bf16": 2**22}
PAIR_POSITION_TO_RANK = (1, 0)
WIRE_BOUNDS = ((0, 150_000), (150_000, 150_000), (150_000, 262_144))  # fp32, ~1 MiB: bytes on the sockets
SCRATCH_CASES = (BOUNDS, SKEWED, EVEN, WIRE_BOUNDS)


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


def _in_flight(coll, rank):
    """Two gathers and two reduce-scatters (fp32 and bf16, two splits) issued async, waited in reverse."""
    calls = []
    for dtype, bounds in ((torch.float32, BOUNDS), (torch.bfloat16, SKEWED)):
        numel = bounds[-1][1]
        full = torch.full((numel,), SENTINEL, dtype=dtype)
        calls.append(("gather", dtype, bounds, full,
                      coll.all_gather(full, shard_values(coll.position, bounds).to(dtype), bounds, async_op=True)))
        s, e = bounds[coll.position]
        out = torch.full((e - s,), SENTINEL, dtype=dtype)
        calls.append(("reduce", dtype, bounds, out,
                      coll.reduce_scatter(out, rank_full(rank, numel).to(dtype), bounds, async_op=True)))
    for *_, work in reversed(calls):
        work.wait()
    return [(kind, str(dtype), bounds, t) for kind, dtype, bounds, t, _ in calls]


def pair_bounds(dtype: str) -> tuple[tuple[int, int], tuple[int, int]]:
    numel = PAIR_NUMEL[dtype]
    return (0, int(0.9 * numel)), (int(0.9 * numel), numel)


def _pair(rank, pair_group, dtype):
    """The 2-rank group (ranks 0 and 1, positions swapped): an 8 MiB reduce-scatter by all_reduce in flight
    beside a gather, waited in reverse order, and its allocations."""
    position = PAIR_POSITION_TO_RANK.index(rank)
    coll = ProcessGroupCollectives(position, PAIR_POSITION_TO_RANK, group=pair_group)
    bounds, numel, dt = pair_bounds(dtype), PAIR_NUMEL[dtype], DTYPES[dtype]
    s, e = bounds[position]
    out = torch.full((e - s,), SENTINEL, dtype=dt)
    full = torch.full((numel,), SENTINEL, dtype=dt)
    sent = rank_full(rank, numel).to(dt)
    rs = coll.reduce_scatter(out, sent, bounds, async_op=True)
    ag = coll.all_gather(full, shard_values(position, bounds).to(dt), bounds, async_op=True)
    ag.wait()
    rs.wait()
    shard = torch.zeros(e - s, dtype=dt)
    with LiveTensorBytes([sent, shard]) as mem:
        coll.reduce_scatter(shard, sent, bounds, async_op=True).wait()
    return {"position": position, "out": out, "full": full,
            "alloc": (mem.peak_bytes, sent.nbytes + shard.nbytes + coll.scratch_bytes(bounds, dt.itemsize))}


def _wire_bytes(coll, rank):
    """Bytes this rank's sockets send for one gather and one reduce-scatter (None without `ss`)."""
    if shutil.which("ss") is None:
        return None
    s, e = WIRE_BOUNDS[coll.position]
    full, shard = torch.zeros(WIRE_BOUNDS[-1][1]), torch.ones(e - s)
    gather = measure_sent_bytes(lambda: coll.all_gather(full, shard, WIRE_BOUNDS).wait())
    reduce = measure_sent_bytes(lambda: coll.reduce_scatter(shard, full, WIRE_BOUNDS).wait())
    return gather, reduce


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
        res["in_flight"] = _in_flight(coll, rank)
        res["scratch"] = [coll.scratch_bytes(b, el) for b in SCRATCH_CASES for el in (4, 2)]
        res["wire"] = _wire_bytes(coll, rank)
        pair_group = dist.new_group([0, 1])  # every rank creates every group
        if rank in (0, 1):
            res["pair"] = {dtype: _pair(rank, pair_group, dtype) for dtype in DTYPES}
        try:
            ProcessGroupCollectives((position + 1) % WORLD, POSITION_TO_RANK)
        except ValueError as exc:
            res["wrong_position"] = str(exc)
        # world 1: a group holding only this rank (every rank creates every group, in order)
        groups = [dist.new_group([r]) for r in range(WORLD)]
        solo = ProcessGroupCollectives(0, [0], group=groups[rank])
        res["solo/gather"] = _gather(solo, torch.float32, True, ((0, 5),))
        res["solo/reduce"] = _reduce(solo, rank, torch.float32, False, ((0, 5),))
        save_rank_result(res, out_dir, rank)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("collectives"))
    return spawn_ranks(_worker, WORLD, out_dir)


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


def test_calls_in_flight_at_once_waited_in_reverse_order(ranks):
    for res in ranks:
        for kind, dtype, bounds, got in res["in_flight"]:
            if kind == "gather":
                want = expected_full(bounds)
            else:
                want = expected_slice(res["position"], bounds)
            assert str(got.dtype) == dtype
            torch.testing.assert_close(got.float(), want.to(got.dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_pair_reduce_scatter_point_to_point_on_a_large_skewed_split(ranks, dtype):
    bounds, numel, dt = pair_bounds(dtype), PAIR_NUMEL[dtype], DTYPES[dtype]
    sizes = [e - s for s, e in bounds]
    assert wire.reduce_scatter_method(sizes, dt.itemsize, 2, "gloo", PAIR_POSITION_TO_RANK) == "direct"  # 2 ranks: each slice sent once
    total = rank_full(0, numel) + rank_full(1, numel)  # small integers: exact in bf16 too
    for res in ranks[:2]:
        pair = res["pair"][dtype]
        s, e = bounds[pair["position"]]
        assert pair["out"].dtype == dt
        torch.testing.assert_close(pair["out"].float(), total[s:e], rtol=0, atol=0)
        torch.testing.assert_close(pair["full"].float(), expected_full(bounds).to(dt).float(), rtol=0, atol=0)
        peak, resident_plus_scratch = pair["alloc"]
        assert peak == resident_plus_scratch  # the all_reduce works in place: scratch 0


def test_scratch_bytes_are_contracts_wire(ranks):
    for res in ranks:
        want = []
        for bounds in SCRATCH_CASES:
            sizes = [e - s for s, e in bounds]
            for elem in (4, 2):
                args = (sizes, elem, WORLD, "gloo", POSITION_TO_RANK)
                want.append(max(wire.gather_scratch_bytes(*args), wire.reduce_scatter_scratch_bytes(*args)))
        assert res["scratch"] == want


def test_bytes_on_the_sockets_are_contracts_wire(ranks):
    if ranks[0]["wire"] is None:
        pytest.skip("`ss` (iproute2) is not installed: no per-socket byte counts")
    sizes = [e - s for s, e in WIRE_BOUNDS]
    gather = wire.gather_send_bytes(sizes, 4, WORLD, "gloo", POSITION_TO_RANK)
    reduce = wire.reduce_scatter_send_bytes(sizes, 4, WORLD, "gloo", POSITION_TO_RANK)
    for res in ranks:
        p = res["position"]
        got_gather, got_reduce = res["wire"]
        # exact but for a rare stray message of the barrier the measurement subtracts (the median of 3)
        assert abs(got_gather - gather[p]) <= 0.01 * gather[p] + 200, (p, got_gather, gather)
        assert abs(got_reduce - reduce[p]) <= 0.01 * reduce[p] + 200, (p, got_reduce, reduce)


# ---- LocalCollectives: one process standing in for one position ---------------------------------


