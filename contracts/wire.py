"""What one uneven all-gather / reduce-scatter of models/collectives.py sends on the network, per rank, and
the scratch it allocates: pure functions of the slice sizes, for the cost model and the memory model.

    gather_method(sizes, elem_bytes, world, backend, position_to_rank=None) -> str
    reduce_scatter_method(sizes, elem_bytes, world, backend, position_to_rank=None) -> str
    gather_send_bytes(sizes, elem_bytes, world, backend, position_to_rank=None, method=None) -> list[int]
    reduce_scatter_send_bytes(sizes, elem_bytes, world, backend, position_to_rank=None, method=None) -> list[int]
    gather_scratch_bytes(sizes, elem_bytes, world, backend, position_to_rank=None, method=None) -> int
    reduce_scatter_scratch_bytes(sizes, elem_bytes, world, backend, position_to_rank=None, method=None) -> int
    token_rows_exchange(tokens, table_numel, hidden, elem_bytes, world) -> bool
    token_rows_send_bytes(token_sizes, hidden, elem_bytes, world, backend, position_to_rank=None) -> list[int]

`sizes[p]` is plan position p's slice in elements (0 allowed), `elem_bytes` the element size (4 fp32, 2
bf16), `world == len(sizes)`, `backend` "gloo" or "nccl", `position_to_rank[p]` the process-group rank of
position p (default: the identity). The `*_send_bytes` lists are per POSITION: what that rank's sockets
send for the call. `method=None` is the method models/collectives.py runs (`gather_method`,
`reduce_scatter_method`); naming one prices another candidate (bench/uneven_collectives.py).

gloo: the bytes are exact, read from gloo's algorithms (gloo/broadcast.cc: binomial tree; gloo/reduce.cc:
a segmented ring reduce-scatter then a gather to the root; gloo/allreduce.cc: segmented ring; gloo/
allgather.cc: ring in half chunks) and from torch's ProcessGroupGloo (broadcast/reduce/allreduce in place;
reduce_scatter_tensor = clone + allreduce; all_gather_into_tensor = allgather into a flat copy). They are
what the kernel's tcp_info `bytes_sent` counts: payload plus gloo's framing, 96 bytes per message sent and
48 per message received (its 48-byte op header: send-ready and data from the sender, recv-ready from the
receiver), not the TCP/IP headers. nccl: ring payload (NCCL's ring, or PAT, in rank order), no framing.
Derivations and the measurements that check them: docs/models/cost.md ("Wire bytes of the collectives").
"""
from __future__ import annotations

from typing import Sequence

BACKENDS = ("gloo", "nccl")
# gloo: one broadcast / reduce per non-empty owner, the whole buffer all-reduced (one call), or
# ("direct") each owner's slice sent to it point to point and summed there
GLOO_GATHER_METHODS = ("broadcast", "allreduce", "padded")
GLOO_REDUCE_SCATTER_METHODS = ("reduce", "allreduce", "padded", "direct")
# nccl: the native tensor form (even split in rank order), or torch's uneven list form, which NCCL runs as
# one group of broadcasts / reduces (one call, no padding)
NCCL_GATHER_METHODS = ("native", "grouped", "padded")
NCCL_REDUCE_SCATTER_METHODS = ("native", "grouped", "padded")

GLOO_MAX_SEGMENT_BYTES = 2**20  # gloo's ReduceOptions / AllreduceOptions maxSegmentSize, torch leaves it
GLOO_SEND_FRAMING_BYTES = 96  # per message sent: a 48-byte send-ready notice and the 48-byte data header
GLOO_RECV_FRAMING_BYTES = 48  # per message received: a 48-byte recv-ready notice to the sender


def _check(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
           position_to_rank: Sequence[int] | None) -> tuple[list[int], list[int]]:
    sizes = [int(n) for n in sizes]
    if len(sizes) != world or world < 1:
        raise ValueError(f"sizes has {len(sizes)} slices for a world of {world} positions")
    if any(n < 0 for n in sizes):
        raise ValueError(f"slice sizes must be >= 0, got {sizes}")
    if elem_bytes <= 0:
        raise ValueError(f"elem_bytes must be positive, got {elem_bytes}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ranks = list(range(world)) if position_to_rank is None else [int(r) for r in position_to_rank]
    if sorted(ranks) != list(range(world)):
        raise ValueError(f"position_to_rank {ranks} is not a permutation of {world} ranks")
    return sizes, ranks


def _native_even(sizes: list[int], ranks: list[int]) -> bool:
    return len(set(sizes)) == 1 and ranks == list(range(len(sizes)))


# ---- the rules models/collectives.py follows (bench/uneven_collectives.py measured them) -----------------


def gather_method(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
                  position_to_rank: Sequence[int] | None = None) -> str:
    """gloo: "broadcast" (fewest bytes, no scratch, fastest in the bench at every split and size);
    nccl: "native" for an even split in rank order, else "grouped". (`elem_bytes` does not change the
    choice; it is taken so every function of this module has the same leading arguments.)"""
    sizes, ranks = _check(sizes, elem_bytes, world, backend, position_to_rank)
    if backend == "gloo":
        return "broadcast"
    return "native" if _native_even(sizes, ranks) else "grouped"


def reduce_scatter_method(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
                          position_to_rank: Sequence[int] | None = None) -> str:
    """gloo: of the methods that allocate no scratch, the one whose busiest rank sends the fewest bytes
    (ties: the first of "direct", "reduce", "allreduce"). gloo's reduce re-sends most of a slice over
    2 MiB (its ring runs numSegments - 2 steps, not (k-1)/k of them); "direct" sends every slice once,
    and needs no scratch on 2 ranks only. nccl: "native" for an even split in rank order, else "grouped"."""
    sizes, ranks = _check(sizes, elem_bytes, world, backend, position_to_rank)
    if backend == "nccl":
        return "native" if _native_even(sizes, ranks) else "grouped"
    candidates = [m for m in ("direct", "reduce", "allreduce") if _scratch(sizes, elem_bytes, world, backend, m) == 0]
    return min(candidates, key=lambda m: max(reduce_scatter_send_bytes(sizes, elem_bytes, world, backend, ranks, m)))


# ---- gloo's algorithms, per rank: (payload bytes sent, messages sent, messages received) ----------------


def _seg_sum(lo: int, hi: int, seg: int, total: int) -> tuple[int, int]:
    """(bytes, non-empty segments) of segments [lo, hi) of `seg` bytes each, clipped to `total` bytes."""
    lo, hi = max(lo, 0), max(hi, lo)
    nonempty = -(-total // seg)
    return min(hi * seg, total) - min(lo * seg, total), min(hi, nonempty) - min(lo, nonempty)


def _ring_range(start: int, count: int, n: int, seg: int, total: int) -> tuple[int, int]:
    """Bytes and non-empty segments of the `count` segments start, start+1, ... taken modulo n."""
    start %= n
    first = min(count, n - start)
    b1, c1 = _seg_sum(start, start + first, seg, total)
    b2, c2 = _seg_sum(0, count - first, seg, total)
    return b1 + b2, c1 + c2


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _gloo_broadcast(nbytes: int, root: int, k: int) -> list[tuple[int, int, int]]:
    """gloo/broadcast.cc: a binomial tree from the root; virtual rank v sends the whole buffer to v + 2^i
    for every round i with v < 2^i and v + 2^i < k, and receives once (v > 0)."""
    out = []
    for r in range(k):
        v = (r - root) % k
        sends = sum(1 for i in range(max(k - 1, 1).bit_length()) if v < 2**i and v + 2**i < k)
        out.append((sends * nbytes, sends, 1 if v else 0))
    return out


def _gloo_reduce(nbytes: int, elem: int, root: int, k: int) -> list[tuple[int, int, int]]:
    """gloo/reduce.cc: segments of min(ceil(T/2k), 1 MiB); each rank sends numSegments - 2 ring segments
    (all but the last two of its own chunk), then every non-root sends its chunk to the root."""
    max_seg = elem * max(1, GLOO_MAX_SEGMENT_BYTES // elem)
    seg = _round_up(min(-(-nbytes // (2 * k)), max_seg), elem)
    nseg = _round_up(max(-(-nbytes // seg), 2 * k), k)
    per_rank = nseg // k
    out = []
    for r in range(k):
        sent, nsent = _ring_range((r + 1) * per_rank, nseg - 2, nseg, seg, nbytes)
        _, nrecv = _ring_range((r + 2) * per_rank, nseg - 2, nseg, seg, nbytes)
        if r == root:
            nrecv += sum(1 for q in range(k) if q != r and _seg_sum(q * per_rank, (q + 1) * per_rank, seg, nbytes)[0])
        else:
            chunk = _seg_sum(r * per_rank, (r + 1) * per_rank, seg, nbytes)[0]
            sent, nsent = sent + chunk, nsent + (1 if chunk else 0)
        out.append((sent, nsent, nrecv))
    return out


def _gloo_allreduce(nbytes: int, elem: int, k: int) -> list[tuple[int, int, int]]:
    """gloo/allreduce.cc (ring): numSegments = k·ceil(max(ceil(T/1 MiB), 2k)/k); a ring reduce-scatter that
    sends all but the rank's own chunk, then a ring all-gather that sends all but chunk rank-1."""
    if nbytes == 0:  # gloo returns before sending anything
        return [(0, 0, 0)] * k
    max_seg = elem * max(1, GLOO_MAX_SEGMENT_BYTES // elem)
    nseg = _round_up(max(-(-nbytes // max_seg), 2 * k), k)
    per_rank = nseg // k
    seg = _round_up(-(-nbytes // nseg), elem)
    steps = nseg - per_rank
    out = []
    for r in range(k):
        rs_b, rs_n = _ring_range((r + 1) * per_rank, steps, nseg, seg, nbytes)
        ag_b, ag_n = _ring_range(r * per_rank, steps, nseg, seg, nbytes)
        _, rs_recv = _ring_range((r + 2) * per_rank, steps, nseg, seg, nbytes)
        _, ag_recv = _ring_range((r + 1) * per_rank, steps, nseg, seg, nbytes)
        out.append((rs_b + ag_b, rs_n + ag_n, rs_recv + ag_recv))
    return out


def _gloo_allgather(chunk_bytes: int, k: int) -> list[tuple[int, int, int]]:
    """gloo/allgather.cc: a ring in half chunks, 2(k-1) messages each way, (k-1)·chunk bytes sent."""
    if chunk_bytes == 0:  # gloo returns before sending anything
        return [(0, 0, 0)] * k
    return [((k - 1) * chunk_bytes, 2 * (k - 1), 2 * (k - 1)) for _ in range(k)]


def _gloo_direct(sizes: list[int], elem: int) -> list[tuple[int, int, int]]:
    """models/collectives.py's "direct" reduce-scatter (gloo send/recv): position p sends every other
    non-empty slice to its owner, one message each, and receives one from every other rank when its own
    slice is not empty (per position; _by_position is the identity here)."""
    k = len(sizes)
    out = []
    for p, mine in enumerate(sizes):
        others = [n for q, n in enumerate(sizes) if q != p and n]
        out.append((sum(others) * elem, len(others), (k - 1) if mine else 0))
    return out


def _wire(per_rank: list[tuple[int, int, int]]) -> list[int]:
    return [b + GLOO_SEND_FRAMING_BYTES * s + GLOO_RECV_FRAMING_BYTES * r for b, s, r in per_rank]


def _per_owner(sizes: list[int], ranks: list[int], call, elem_bytes: int) -> list[int]:
    """Per rank, the sum over the non-empty owners' calls `call(slice bytes, owner's rank)`."""
    per_rank = [0] * len(sizes)
    for p, n in enumerate(sizes):
        if n:
            per_rank = [a + b for a, b in zip(per_rank, _wire(call(n * elem_bytes, ranks[p])))]
    return per_rank


def _by_position(per_rank: list[int], ranks: list[int]) -> list[int]:
    return [per_rank[r] for r in ranks]


# ---- nccl's ring, payload only -------------------------------------------------------------------------


def _nccl_gather(sizes: list[int], elem: int, ranks: list[int], method: str) -> list[int]:
    k = len(sizes)
    if method in ("native", "padded") or len(set(sizes)) == 1:  # ring all-gather of k chunks of the largest
        # slice (torch runs the list form of an even split as one all-gather into a flat copy)
        return [(k - 1) * max(sizes) * elem] * k
    # grouped broadcasts: a chain from the owner along the ring; every rank but the owner's predecessor sends
    per_rank = [0] * k
    for p, n in enumerate(sizes):
        for r in range(k):
            if r != (ranks[p] - 1) % k:
                per_rank[r] += n * elem
    return _by_position(per_rank, ranks)


def _nccl_reduce_scatter(sizes: list[int], elem: int, ranks: list[int], method: str) -> list[int]:
    k = len(sizes)
    if method in ("native", "padded") or len(set(sizes)) == 1:
        return [(k - 1) * max(sizes) * elem] * k
    total = sum(sizes) * elem  # grouped reduces: a chain ending at the owner; everyone but the owner sends
    return [total - n * elem for n in sizes]


# ---- the public functions ------------------------------------------------------------------------------


TOKEN_ID_BYTES = 8  # an int64 token id


def token_rows_exchange(tokens: int, table_numel: int, hidden: int, elem_bytes: int, world: int) -> bool:
    """The rule models/sharded.py follows for the embedding unit's gradient at the end of a layer-wise
    step (zero 2/3) on `world` > 1 ranks: True sends the step's rows instead of the table, when the
    `tokens` rows of the step (`hidden` elements of `elem_bytes` each, the reduce dtype) and their ids
    are fewer bytes than the unit's `table_numel` elements. Each rank then all-gathers every rank's ids
    and rows (two uneven all_gathers, `token_rows_send_bytes`) and adds the rows that land in its own
    slice; otherwise the table is reduce-scattered. Both move, per rank, the payload they name once
    to every other rank, so the comparison does not depend on the world or the split."""
    if world <= 1 or tokens <= 0:
        return False
    return tokens * (hidden * elem_bytes + TOKEN_ID_BYTES) < table_numel * elem_bytes


def token_rows_send_bytes(token_sizes: Sequence[int], hidden: int, elem_bytes: int, world: int, backend: str,
                          position_to_rank: Sequence[int] | None = None) -> list[int]:
    """Bytes each position's rank sends for the rows exchange (`token_rows_exchange`): the all_gather
    of the ids (`token_sizes[p]` int64 each) and the all_gather of the rows (`hidden` elements each)."""
    ids = gather_send_bytes(token_sizes, TOKEN_ID_BYTES, world, backend, position_to_rank)
    rows = gather_send_bytes([t * hidden for t in token_sizes], elem_bytes, world, backend, position_to_rank)
    return [a + b for a, b in zip(ids, rows)]



def gather_send_bytes(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
                      position_to_rank: Sequence[int] | None = None, method: str | None = None) -> list[int]:
    """Bytes each position's rank sends for one uneven all_gather (see the module docstring)."""
    sizes, ranks = _check(sizes, elem_bytes, world, backend, position_to_rank)
    method = method or gather_method(sizes, elem_bytes, world, backend, ranks)
    if world == 1:
        return [0]
    if backend == "nccl":
        _known(method, NCCL_GATHER_METHODS)
        return _nccl_gather(sizes, elem_bytes, ranks, method)
    _known(method, GLOO_GATHER_METHODS)
    if method == "broadcast":
        per_rank = _per_owner(sizes, ranks, lambda nbytes, root: _gloo_broadcast(nbytes, root, world), elem_bytes)
    elif method == "allreduce":
        per_rank = _wire(_gloo_allreduce(sum(sizes) * elem_bytes, elem_bytes, world))
    else:
        per_rank = _wire(_gloo_allgather(max(sizes) * elem_bytes, world))
    return _by_position(per_rank, ranks)


def reduce_scatter_send_bytes(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
                              position_to_rank: Sequence[int] | None = None,
                              method: str | None = None) -> list[int]:
    """Bytes each position's rank sends for one uneven reduce_scatter (see the module docstring)."""
    sizes, ranks = _check(sizes, elem_bytes, world, backend, position_to_rank)
    method = method or reduce_scatter_method(sizes, elem_bytes, world, backend, ranks)
    if world == 1:
        return [0]
    if backend == "nccl":
        _known(method, NCCL_REDUCE_SCATTER_METHODS)
        return _nccl_reduce_scatter(sizes, elem_bytes, ranks, method)
    _known(method, GLOO_REDUCE_SCATTER_METHODS)
    if method == "reduce":
        per_rank = _per_owner(sizes, ranks, lambda nbytes, root: _gloo_reduce(nbytes, elem_bytes, root, world),
                              elem_bytes)
    elif method == "allreduce":
        per_rank = _wire(_gloo_allreduce(sum(sizes) * elem_bytes, elem_bytes, world))
    elif method == "direct":  # per position already
        return _wire(_gloo_direct(sizes, elem_bytes))
    else:  # torch: reduce_scatter_tensor on gloo clones the padded input and all-reduces it
        per_rank = _wire(_gloo_allreduce(world * max(sizes) * elem_bytes, elem_bytes, world))
    return _by_position(per_rank, ranks)


def gather_scratch_bytes(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
                         position_to_rank: Sequence[int] | None = None, method: str | None = None) -> int:
    """Torch-allocator bytes one all_gather allocates beyond its arguments (models/collectives.py's
    `scratch_bytes`). broadcast, allreduce, native, grouped: 0, they work in views of `full`, except the
    grouped list form of an even split (out of rank order), which torch gathers into a flat k·m copy.
    padded: the k·m output and the m input of the largest slice m; gloo adds its own flat k·m copy."""
    sizes, ranks = _check(sizes, elem_bytes, world, backend, position_to_rank)
    method = method or gather_method(sizes, elem_bytes, world, backend, ranks)
    _known(method, GLOO_GATHER_METHODS if backend == "gloo" else NCCL_GATHER_METHODS)
    return _scratch(sizes, elem_bytes, world, backend, method)


def reduce_scatter_scratch_bytes(sizes: Sequence[int], elem_bytes: int, world: int, backend: str,
                                 position_to_rank: Sequence[int] | None = None,
                                 method: str | None = None) -> int:
    """Torch-allocator bytes one reduce_scatter allocates beyond its arguments. reduce, allreduce (both in
    place on `full`), native, grouped: 0; direct: a received buffer of the largest slice for every peer
    after the first (0 on 2 ranks); except the grouped list form of an even split (out of rank
    order), which torch copies into a flat k·m input. padded: the k·m input and the m output; gloo adds
    the k·m clone its reduce_scatter_tensor all-reduces."""
    sizes, ranks = _check(sizes, elem_bytes, world, backend, position_to_rank)
    method = method or reduce_scatter_method(sizes, elem_bytes, world, backend, ranks)
    _known(method, GLOO_REDUCE_SCATTER_METHODS if backend == "gloo" else NCCL_REDUCE_SCATTER_METHODS)
    return _scratch(sizes, elem_bytes, world, backend, method)


def _scratch(sizes: list[int], elem_bytes: int, world: int, backend: str, method: str) -> int:
    m = max(sizes) * elem_bytes
    if world == 1:
        return 0
    if method == "padded":
        return (world + 1) * m + (world * m if backend == "gloo" else 0)
    if method == "grouped" and len(set(sizes)) == 1:  # torch's list form of an even split: one flat copy
        return world * m
    if method == "direct":  # the first peer's part lands in the output, every further one in a buffer
        return max(world - 2, 0) * m
    return 0


def _known(method: str, methods: tuple[str, ...]) -> None:
    if method not in methods:
        raise ValueError(f"method must be one of {methods}, got {method!r}")
