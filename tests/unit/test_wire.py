"""contracts/wire.py: the bytes gloo's algorithms send per rank, hand-derived for small cases, the methods'
rule, and scratch equal to what models/collectives.py reports (the bytes on real sockets:
tests/e2e/test_collectives.py and `python bench/uneven_collectives.py --wire`)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from contracts import wire
from contracts.wire import (GLOO_RECV_FRAMING_BYTES as RECV, GLOO_SEND_FRAMING_BYTES as SEND, gather_method,
                            gather_scratch_bytes, gather_send_bytes, reduce_scatter_method,
                            reduce_scatter_scratch_bytes, reduce_scatter_send_bytes)
from models.collectives import ProcessGroupCollectives


def test_gloo_broadcast_is_a_binomial_tree_from_each_owner():
    # 2 ranks: each owner sends its slice once and receives the other's
    assert gather_send_bytes([30, 10], 4, 2, "gloo") == [120 + SEND + RECV, 40 + SEND + RECV]
    # 3 ranks: the root sends to virtual ranks 1 and 2 itself; an empty slice is not broadcast at all
    assert gather_send_bytes([5, 0, 3], 2, 3, "gloo") == [2 * 10 + 2 * SEND + RECV, RECV + RECV, 2 * 6 + 2 * SEND + RECV]
    # 4 ranks: root 0 sends to 1 and 2, rank 1 forwards to 3
    assert gather_send_bytes([8, 0, 0, 0], 1, 4, "gloo") == [16 + 2 * SEND, 8 + SEND + RECV, RECV, RECV]


def test_positions_are_mapped_to_ranks():
    # the same 4-rank broadcast with position 0 held by rank 2: the forwarding rank is rank 3 (virtual rank 1)
    got = gather_send_bytes([8, 0, 0, 0], 1, 4, "gloo", position_to_rank=(2, 0, 1, 3))
    assert got == [16 + 2 * SEND, RECV, RECV, 8 + SEND + RECV]  # positions 0..3 = ranks 2, 0, 1, 3


def test_gloo_reduce_ring_then_gather_small_buffer():
    # 2 ranks, 16 bytes, root 0: segments of ceil(16/4) = 4 bytes, 4 segments, 2 per rank; each rank sends
    # numSegments - 2 = 2 ring segments (8 bytes), then rank 1 sends its 8-byte chunk to the root
    got = reduce_scatter_send_bytes([4, 0], 4, 2, "gloo", method="reduce")
    assert got == [8 + 2 * SEND + 3 * RECV, 16 + 3 * SEND + 2 * RECV]


def test_gloo_reduce_resends_large_slices():
    # 8 MiB from one owner, 2 ranks: 1 MiB segments, 8 of them; each rank sends 6 (not the 4 of a ring
    # reduce-scatter), the non-root adds its 4 MiB chunk
    mib = 2**20
    got = reduce_scatter_send_bytes([2 * mib, 0], 4, 2, "gloo", method="reduce")
    assert got == [6 * mib + 6 * SEND + 7 * RECV, 10 * mib + 7 * SEND + 6 * RECV]


def test_gloo_allreduce_ring_matches_a_measured_call():
    # 4e6 bytes on 3 ranks, measured with ss on loopback (bench/uneven_collectives.py --wire)
    assert reduce_scatter_send_bytes([500_000, 300_000, 200_000], 4, 3, "gloo", method="allreduce") == \
        [5334488, 5334480, 5334488]
    # one call of n bytes sends 2(k-1)/k of them, give or take a segment's rounding
    sent = gather_send_bytes([10**6, 0], 4, 2, "gloo", method="allreduce")
    assert all(abs(s - 4 * 10**6) < 10**4 for s in sent)


def test_padded_forms_send_the_largest_slice_k_minus_one_times():
    assert gather_send_bytes([9, 1], 4, 2, "gloo", method="padded") == [36 + 2 * SEND + 2 * RECV] * 2
    assert gather_send_bytes([6, 3, 1], 2, 3, "nccl", method="padded") == [24, 24, 24]
    assert reduce_scatter_send_bytes([6, 3, 1], 2, 3, "nccl", method="padded") == [24, 24, 24]


def test_nccl_grouped_forms_send_no_padding():
    # broadcast chains along the ring from each owner: all but the owner's predecessor send
    assert gather_send_bytes([6, 3, 1], 1, 3, "nccl") == [6 + 1, 6 + 3, 3 + 1]  # rank r skips owner r + 1
    # reduce chains end at the owner: everyone but the owner sends its slice
    assert reduce_scatter_send_bytes([6, 3, 1], 1, 3, "nccl") == [4, 7, 9]
    assert gather_method([4, 4, 4], 4, 3, "nccl") == "native"
    assert gather_method([4, 4, 4], 4, 3, "nccl", position_to_rank=(1, 0, 2)) == "grouped"


def test_world_one_and_empty_buffers_send_nothing():
    assert gather_send_bytes([7], 4, 1, "gloo") == [0]
    assert reduce_scatter_send_bytes([7], 4, 1, "nccl") == [0]
    for method in wire.GLOO_REDUCE_SCATTER_METHODS:
        assert reduce_scatter_send_bytes([0, 0, 0], 2, 3, "gloo", method=method) == [0, 0, 0]
    for method in wire.GLOO_GATHER_METHODS:
        assert gather_send_bytes([0, 0], 4, 2, "gloo", method=method) == [0, 0]
    assert reduce_scatter_method([0, 0], 4, 2, "gloo") == "direct"


def test_rule_picks_the_fewest_bytes_without_scratch():
    mib = 2**20
    assert gather_method([3 * mib, mib], 4, 2, "gloo") == "broadcast"
    # 2 ranks: every slice sent once, point to point, beats gloo's reduce and allreduce
    assert reduce_scatter_method([mib // 4, mib // 4], 4, 2, "gloo") == "direct"
    assert reduce_scatter_method([int(1.8 * mib), int(0.2 * mib)], 4, 2, "gloo") == "direct"
    assert reduce_scatter_send_bytes([3, 5], 4, 2, "gloo", method="direct") == [5 * 4 + 96 + 48, 3 * 4 + 96 + 48]
    # 3 ranks: direct would need a received buffer, so reduce or allreduce, whichever sends less
    assert reduce_scatter_method([3 * mib, 2 * mib, 0], 4, 3, "gloo") in ("reduce", "allreduce")
    for sizes in ([mib // 4, mib // 4], [int(1.8 * mib), int(0.2 * mib)], [3 * mib, 2 * mib, 0], [mib, mib, mib]):
        k = len(sizes)
        chosen = reduce_scatter_method(sizes, 4, k, "gloo")
        for other in wire.GLOO_REDUCE_SCATTER_METHODS:
            if reduce_scatter_scratch_bytes(sizes, 4, k, "gloo", method=other) == 0:
                assert max(reduce_scatter_send_bytes(sizes, 4, k, "gloo")) <= \
                    max(reduce_scatter_send_bytes(sizes, 4, k, "gloo", method=other))
    assert reduce_scatter_scratch_bytes([mib, mib, mib], 4, 3, "gloo", method="direct") == 4 * mib


def test_scratch_of_each_method():
    assert gather_scratch_bytes([6, 3, 1], 4, 3, "gloo") == 0
    assert reduce_scatter_scratch_bytes([6, 3, 1], 4, 3, "gloo") == 0
    assert gather_scratch_bytes([6, 3, 1], 4, 3, "nccl") == 0
    assert gather_scratch_bytes([6, 3, 1], 4, 3, "nccl", method="padded") == 4 * 24
    assert gather_scratch_bytes([6, 3, 1], 4, 3, "gloo", method="padded") == 4 * 24 + 3 * 24
    assert reduce_scatter_scratch_bytes([4, 4, 4], 2, 3, "nccl", position_to_rank=(2, 0, 1)) == 24


@pytest.mark.parametrize("args, match", [
    (([1, 2], 4, 3, "gloo"), "2 slices for a world of 3"),
    (([1, -2], 4, 2, "gloo"), ">= 0"),
    (([1, 2], 0, 2, "gloo"), "elem_bytes"),
    (([1, 2], 4, 2, "mpi"), "backend"),
])
def test_bad_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        gather_send_bytes(*args)
    with pytest.raises(ValueError, match="permutation"):
        reduce_scatter_send_bytes([1, 2], 4, 2, "gloo", position_to_rank=(0, 0))
    with pytest.raises(ValueError, match="method must be one of"):
        gather_send_bytes([1, 2], 4, 2, "gloo", method="grouped")


BOUNDS_CASES = [((0, 6), (6, 6), (6, 11)), ((0, 4), (4, 8), (8, 12)), ((0, 0), (0, 9), (9, 9)),
                ((0, 300_000), (300_000, 900_000), (900_000, 1_000_000))]


@pytest.mark.parametrize("backend", wire.BACKENDS)
@pytest.mark.parametrize("position_to_rank", [(0, 1, 2), (2, 0, 1)])
def test_scratch_bytes_of_the_module_equal_contracts_wire(monkeypatch, backend, position_to_rank):
    """ProcessGroupCollectives.scratch_bytes is wire's figure for its backend and rank order (the group is
    faked: only the world size, this rank and the backend's name are read)."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: position_to_rank[1])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    coll = ProcessGroupCollectives(1, position_to_rank)
    for bounds in BOUNDS_CASES:
        sizes = [e - s for s, e in bounds]
        for elem in (4, 2):
            want = max(gather_scratch_bytes(sizes, elem, 3, backend, position_to_rank),
                       reduce_scatter_scratch_bytes(sizes, elem, 3, backend, position_to_rank))
            assert coll.scratch_bytes(bounds, elem) == want
    even = BOUNDS_CASES[1]  # NCCL's list form of an even split out of rank order copies it flat
    in_order = position_to_rank == (0, 1, 2)
    assert coll.scratch_bytes(even, 4) == (0 if backend == "gloo" or in_order else 12 * 4)
