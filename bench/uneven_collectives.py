"""Uneven all-gather / reduce-scatter on gloo: every candidate method, side by side in one run.

    python bench/uneven_collectives.py [--sizes-mib 1 8 64] [--worlds 2 3] [--quick]

For 2 and 3 local gloo ranks, sizes of the full fp32 buffer (1 MiB .. 64 MiB) and even and uneven
splits, prints the median seconds per call (the slowest rank's, over repeats), GB/s of the full
buffer (bytes of `full` / time) and the ratio to the even-split reference
(`all_gather_into_tensor` / `reduce_scatter_tensor` of the same total size). Then one overlap
figure: an async gather issued before a matmul, waited after it, against the two run one after
the other. The methods are written here with raw torch.distributed calls (not through
models/collectives.py), so the measurement that chose the module's methods is independent of it.
Scratch: the extra torch tensors each method allocates, in multiples of the largest shard `m`
(k ranks, n elements): listed in the table header; the module docstring explains the choice.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from contracts.constants import FP32_BYTES  # noqa: E402
from executor.launch import free_port  # noqa: E402

MIB = 2**20
SPLITS = {2: ((0.5, 0.5), (0.7, 0.3)), 3: ((1 / 3, 1 / 3, 1 / 3), (0.6, 0.3, 0.1), (0.7, 0.3, 0.0))}


def split_bounds(numel: int, fractions) -> list[tuple[int, int]]:
    cuts = [0]
    for f in fractions[:-1]:
        cuts.append(cuts[-1] + int(round(f * numel)))
    cuts.append(numel)
    return [(cuts[i], cuts[i + 1]) for i in range(len(fractions))]


# ---- the candidates: (full, shard_or_out, bounds, rank) -> None; positions == ranks here -----------


def ag_broadcast(full, shard, bounds, rank):
    """one async broadcast per non-empty owner, into views of `full`; scratch 0"""
    s, e = bounds[rank]
    full[s:e].copy_(shard)
    works = [dist.broadcast(full[a:b], src=p, async_op=True) for p, (a, b) in enumerate(bounds) if b > a]
    for w in works:
        w.wait()


def ag_padded(full, shard, bounds, rank):
    """all_gather_into_tensor of shards padded to the largest; scratch (k+1)·m"""
    m = max(b - a for a, b in bounds)
    pad = torch.zeros(m, dtype=full.dtype)
    pad[: shard.numel()].copy_(shard)
    out = torch.empty(m * len(bounds), dtype=full.dtype)
    dist.all_gather_into_tensor(out, pad)
    for p, (a, b) in enumerate(bounds):
        full[a:b].copy_(out[p * m: p * m + b - a])


def ag_allreduce(full, shard, bounds, rank):
    """zero the other slices, all_reduce(sum) the whole buffer; scratch 0"""
    s, e = bounds[rank]
    full.zero_()
    full[s:e].copy_(shard)
    dist.all_reduce(full)


def rs_list(out, full, bounds, rank):
    """reduce_scatter(out, uneven list of views of full); gloo flattens the list: scratch ~n"""
    dist.reduce_scatter(out, [full[a:b] for a, b in bounds])


def rs_reduce(out, full, bounds, rank):
    """one async reduce per non-empty owner into its view of full, then copy; scratch 0"""
    works = [dist.reduce(full[a:b], dst=p, async_op=True) for p, (a, b) in enumerate(bounds) if b > a]
    for w in works:
        w.wait()
    s, e = bounds[rank]
    out.copy_(full[s:e])


def rs_allreduce(out, full, bounds, rank):
    """all_reduce(sum) the whole buffer in place, copy the own slice; scratch 0"""
    dist.all_reduce(full)
    s, e = bounds[rank]
    out.copy_(full[s:e])


def rs_padded(out, full, bounds, rank):
    """reduce_scatter_tensor of slices padded to the largest; scratch (k+1)·m"""
    m = max(b - a for a, b in bounds)
    pad = torch.zeros(m * len(bounds), dtype=full.dtype)
    for p, (a, b) in enumerate(bounds):
        pad[p * m: p * m + b - a].copy_(full[a:b])
    o = torch.empty(m, dtype=full.dtype)
    dist.reduce_scatter_tensor(o, pad)
    out.copy_(o[: out.numel()])


AG_METHODS = {"ag_broadcast": ag_broadcast, "ag_padded": ag_padded, "ag_allreduce": ag_allreduce}
RS_METHODS = {"rs_list": rs_list, "rs_reduce": rs_reduce, "rs_allreduce": rs_allreduce, "rs_padded": rs_padded}
SCRATCH = {"ag_broadcast": "0", "ag_padded": "(k+1)m", "ag_allreduce": "0",
           "rs_list": "n (gloo flattens)", "rs_reduce": "0", "rs_allreduce": "0", "rs_padded": "(k+1)m"}


def ref_ag(full, shard, bounds, rank):
    dist.all_gather_into_tensor(full, shard)


def ref_rs(out, full, bounds, rank):
    dist.reduce_scatter_tensor(out, full)


def _time(fn, a, b, bounds, rank, repeats, per_sample) -> float:
    fn(a, b, bounds, rank)  # warm-up: gloo sets up pairs and buffers lazily
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(per_sample):
            fn(a, b, bounds, rank)
        samples.append((time.perf_counter() - t0) / per_sample)
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return statistics.median(t.tolist())


def _overlap(rank, world, numel) -> tuple[float, float, float]:
    """(gather alone, compute alone, async gather + compute then wait) in seconds, slowest rank."""
    bounds = split_bounds(numel, SPLITS[world][1])
    full = torch.zeros(numel)
    s, e = bounds[rank]
    shard = torch.ones(e - s)
    x = torch.randn(384, 384)

    def compute():
        for _ in range(8):
            x @ x

    def both():
        full[s:e].copy_(shard)
        works = [dist.broadcast(full[a:b], src=p, async_op=True) for p, (a, b) in enumerate(bounds) if b > a]
        compute()
        for w in works:
            w.wait()

    out = []
    for fn in (lambda: ag_broadcast(full, shard, bounds, rank), compute, both):
        out.append(_time(lambda *_: fn(), None, None, bounds, rank, 5, 1))
    return out[0], out[1], out[2]


def _worker(rank, world, port, sizes_mib, quick, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    try:
        for size in sizes_mib:
            numel = size * MIB // FP32_BYTES
            numel -= numel % world
            repeats, per_sample = (3, 1) if size >= 32 else (5, 2) if size >= 4 else (7, 8)
            if quick:
                repeats = 2
            full = torch.ones(numel)
            even = split_bounds(numel, (1 / world,) * world)
            ref = {"ag": _time(ref_ag, full, torch.ones(numel // world), even, rank, repeats, per_sample),
                   "rs": _time(ref_rs, torch.empty(numel // world), full, even, rank, repeats, per_sample)}
            for fractions in SPLITS[world]:
                bounds = split_bounds(numel, fractions)
                s, e = bounds[rank]
                for name, fn in AG_METHODS.items():
                    t = _time(fn, full, torch.ones(e - s), bounds, rank, repeats, per_sample)
                    rows.append((size, fractions, name, t, t / ref["ag"]))
                for name, fn in RS_METHODS.items():
                    t = _time(fn, torch.empty(e - s), full, bounds, rank, repeats, per_sample)
                    rows.append((size, fractions, name, t, t / ref["rs"]))
            rows.append((size, "even", "ref all_gather_into_tensor", ref["ag"], 1.0))
            rows.append((size, "even", "ref reduce_scatter_tensor", ref["rs"], 1.0))
        overlap = _overlap(rank, world, 8 * MIB // FP32_BYTES)
        if rank == 0:
            queue.put((rows, overlap))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3], choices=sorted(SPLITS))
    ap.add_argument("--quick", action="store_true", help="2 repeats per point")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    t_start = time.perf_counter()
    for world in args.worlds:
        queue = ctx.Queue()
        procs = mp.start_processes(_worker, args=(world, free_port(), args.sizes_mib, args.quick, queue),
                                   nprocs=world, join=False, start_method="spawn")
        rows, (t_gather, t_compute, t_both) = queue.get()
        procs.join()
        print(f"\n== {world} gloo ranks (fp32; median s per call, slowest rank; GB/s = bytes of full / s;"
              f" ratio to the even-split reference of the same size) ==")
        print(f"{'MiB':>4} {'split':<16} {'method':<28} {'median_ms':>10} {'GB/s':>7} {'ratio':>6}  scratch")
        for size, fractions, name, t, ratio in rows:
            split = fractions if isinstance(fractions, str) else "/".join(f"{f:.2f}" for f in fractions)
            gbps = size * MIB / t / 1e9
            print(f"{size:>4} {split:<16} {name:<28} {t * 1e3:>10.2f} {gbps:>7.2f} {ratio:>6.2f}  "
                  f"{SCRATCH.get(name, '')}")
        print(f"overlap (8 MiB uneven gather, 8 matmuls 384^2): gather {t_gather * 1e3:.1f} ms, compute "
              f"{t_compute * 1e3:.1f} ms, serial sum {(t_gather + t_compute) * 1e3:.1f} ms, async together "
              f"{t_both * 1e3:.1f} ms")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
