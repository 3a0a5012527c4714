"""What a collective costs: one set of formulas for every planner (hetero, schedule, geo).

A ring of k ranks moves (k−1)/k of a buffer per rank for an all-gather or a reduce-scatter and
twice that for an all-reduce (a reduce-scatter then an all-gather); each call also pays a
latency: the measured one when `profiler bench` timed the link, else ⌈log2 k⌉ hops (NCCL and
gloo switch to trees or PAT for small messages). A point-to-point send (pipeline stages) moves the
whole buffer once. Bandwidths are bytes/s per rank ("bus bandwidth"); files and scenarios quote
Gbit/s, converted once by `bytes_per_s`.

The uneven collectives of the sharded runtime (models/collectives.py) move the same bytes as the
even ones: an owner's slice is what it broadcasts (all-gather) or receives reduced (reduce-scatter),
so the ring volume is the same whatever the split (bench/uneven_collectives.py measures it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from contracts.constants import BITS_PER_BYTE, GBIT

# Per-hop latency of one collective step when nothing was measured: NCCL's ring step costs a few
# microseconds over NVLink/PCIe and tens over a datacenter network (NCCL tests, 8-byte all-reduce).
INTRA_NODE_HOP_LATENCY_S = 5e-6
INTER_NODE_HOP_LATENCY_S = 25e-6


# What the profiling path records beside its latency/bandwidth fits (profiler/run_profile.py, the
# collectives of a run's CPU ranks): an all-gather issued as a step issues it, after a burst of compute
# (a CollectiveFit: t = latency + size / bandwidth), and an async one issued before compute and waited
# after it (times_s: compute alone, the gather alone, both).
BESIDE_COMPUTE = "all_gather_beside_compute"
ASYNC_BESIDE_COMPUTE = "all_gather_async_beside_compute"


def exposed_share(compute_s: float, alone_s: float, both_s: float) -> float:
    """The share of an async collective that compute beside it does not hide, in [0, 1]:
    (both − compute) / alone. 0: hidden entirely; 1: it runs as if issued after the compute (on CPU
    ranks gloo's thread needs a core the compute holds)."""
    if alone_s <= 0:
        raise ValueError(f"a collective timed alone at {alone_s} s: cannot say how much of it overlaps")
    return min(max((both_s - compute_s) / alone_s, 0.0), 1.0)


def bytes_per_s(gbps: float) -> float:
    """Gbit/s (cluster file, scenario, catalog link figures in Gbit/s) -> bytes/s."""
    return gbps * GBIT / BITS_PER_BYTE


@dataclass(frozen=True)
class Link:
    """The links among the ranks of one collective: the slowest one's bandwidth, and its latency."""

    bandwidth_bytes_per_s: float
    hop_latency_s: float = INTRA_NODE_HOP_LATENCY_S
    call_latency_s: float | None = None  # measured latency of one call (replaces the hop model)

    def latency_s(self, world_size: int) -> float:
        if world_size <= 1:
            return 0.0
        if self.call_latency_s is not None:
            return self.call_latency_s
        return math.ceil(math.log2(world_size)) * self.hop_latency_s


def ring_fraction(world_size: int) -> float:
    """(k−1)/k: the share of a buffer each rank sends in a ring all-gather or reduce-scatter."""
    return (world_size - 1) / world_size if world_size > 1 else 0.0


def ring_wire_bytes(buffer_bytes: float, world_size: int) -> int:
    """Bytes a ring all-gather or reduce-scatter of a `buffer_bytes` buffer puts on the network, every
    rank's sends together: (k−1)/k of the buffer from each of the k ranks, (k−1)·bytes (an uneven
    split moves the same: each owner's slice reaches the k−1 others once)."""
    if world_size <= 1:
        return 0
    return round((world_size - 1) * buffer_bytes)


def all_gather_s(buffer_bytes: float, world_size: int, link: Link) -> float:
    """Ring all-gather of a `buffer_bytes` result among `world_size` ranks (0 for one rank)."""
    if world_size <= 1:
        return 0.0
    return ring_fraction(world_size) * buffer_bytes / link.bandwidth_bytes_per_s + link.latency_s(world_size)


def reduce_scatter_s(buffer_bytes: float, world_size: int, link: Link) -> float:
    """Ring reduce-scatter of a full `buffer_bytes` input: the same wire volume as an all-gather."""
    return all_gather_s(buffer_bytes, world_size, link)


def all_reduce_s(buffer_bytes: float, world_size: int, link: Link) -> float:
    """Ring all-reduce: a reduce-scatter and an all-gather of the buffer."""
    return reduce_scatter_s(buffer_bytes, world_size, link) + all_gather_s(buffer_bytes, world_size, link)


def send_s(buffer_bytes: float, link: Link) -> float:
    """One point-to-point transfer of a whole buffer (a pipeline stage boundary)."""
    return buffer_bytes / link.bandwidth_bytes_per_s + link.hop_latency_s


def sharded_step_comm_s(gather_bytes: float, reduce_bytes: float, num_calls: int, world_size: int,
                        gather_link: Link, reduce_link: Link | None = None) -> float:
    """What the sharded runtime's collectives of one optimizer step cost on `world_size` ranks:
    all-gathers of `gather_bytes` in total and reduce-scatters of `reduce_bytes`
    (contracts.units.step_collectives), `num_calls` calls each paying the latency, one after
    another on the network (what of it overlaps compute: training.StepComm). Non-decreasing in k."""
    if world_size <= 1:
        return 0.0
    reduce_link = reduce_link or gather_link
    ring = ring_fraction(world_size) * (gather_bytes / gather_link.bandwidth_bytes_per_s
                                        + reduce_bytes / reduce_link.bandwidth_bytes_per_s)
    return ring + num_calls * gather_link.latency_s(world_size)
