"""Uneven all-gather / reduce-scatter on gloo: every candidate method side by side, and what padding costs.

    python bench/uneven_collectives.py [--sizes-mib 1 8 64] [--worlds 2 3] [--dtypes fp32 bf16] [--quick]
    python bench/uneven_collectives.py --wire [--sizes-mib 1 8] [--worlds 2 3]

For 2 and 3 local gloo ranks, sizes of the full buffer (MiB of fp32; bf16 moves half the bytes), fp32
and bf16, and the splits 0.5/0.5, 0.75/0.25, 0.9/0.1 (2 ranks) and 1/3 each, 0.5/0.3/0.2, 0.7/0.3/0.0
(3 ranks), prints per method the median seconds per call (the slowest rank's, over repeats), the ratio
to the even-split reference (`all_gather_single` / `reduce_scatter_single` of the same total), the bytes
the busiest rank sends (contracts/wire.py), the torch scratch it allocates, and for the padded forms the
padding's cost: (k·m − n) elements of bytes on every rank (m the largest slice) and the time over the
even reference. Each table ends with the measured winner per point beside the method
models/collectives.py picks (contracts.wire's rule). The candidates are raw torch.distributed calls (not
models/collectives.py), so the measurement that chose the module's methods is independent of it.

`--wire` instead measures the bytes each rank's TCP sockets send per call (`ss -ti` bytes_sent, minus a
barrier's) and prints them beside contracts/wire.py's formulas.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from contracts import wire  # noqa: E402
from contracts.constants import FP32_BYTES  # noqa: E402
from executor.rank_commands import free_port  # noqa: E402

MIB = 2**20
SPLITS = {2: ((0.5, 0.5), (0.75, 0.25), (0.9, 0.1)),
          3: ((1 / 3, 1 / 3, 1 / 3), (0.5, 0.3, 0.2), (0.7, 0.3, 0.0))}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# torch 2.13 renamed the tensor forms; older releases have only the old names
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def split_bounds(numel: int, fractions) -> list[tuple[int, int]]:
    cuts = [0]
    for f in fractions[:-1]:
        cuts.append(cuts[-1] + int(round(f * numel)))
    cuts.append(numel)
    return [(cuts[i], cuts[i + 1]) for i in range(len(fractions))]


# ---- the candidates: (full, shard_or_out, bounds, rank) -> None; positions == ranks here -----------


def ag_broadcast(full, shard, bounds, rank):
    """one async broadcast per non-empty owner, into views of `full`"""
    s, e = bounds[rank]
    full[s:e].copy_(shard)
    works = [dist.broadcast(full[a:b], src=p, async_op=True) for p, (a, b) in enumerate(bounds) if b > a]
    for w in works:
        w.wait()


def ag_padded(full, shard, bounds, rank):
    """all_gather_single into a k·m scratch (own slice written in place, no input copy), then copy out"""
    m = max(b - a for a, b in bounds)
    out = torch.empty(m * len(bounds), dtype=full.dtype)
    own = out[rank * m: (rank + 1) * m]
    own[: shard.numel()].copy_(shard)
    ALL_GATHER_SINGLE(out, own)
    for p, (a, b) in enumerate(bounds):
        full[a:b].copy_(out[p * m: p * m + b - a])


def ag_allreduce(full, shard, bounds, rank):
    """zero the other slices, all_reduce(sum) the whole buffer: one call"""
    s, e = bounds[rank]
    full.zero_()
    full[s:e].copy_(shard)
    dist.all_reduce(full)


def rs_reduce(out, full, bounds, rank):
    """one async reduce per non-empty owner into its view of full, then copy"""
    works = [dist.reduce(full[a:b], dst=p, async_op=True) for p, (a, b) in enumerate(bounds) if b > a]
    for w in works:
        w.wait()
    s, e = bounds[rank]
    out.copy_(full[s:e])


def rs_allreduce(out, full, bounds, rank):
    """all_reduce(sum) the whole buffer in place, copy the own slice: one call"""
    dist.all_reduce(full)
    s, e = bounds[rank]
    out.copy_(full[s:e])


def rs_padded(out, full, bounds, rank):
    """reduce_scatter_single of a k·m copy of full padded per slice, then copy the own part"""
    m = max(b - a for a, b in bounds)
    pad = torch.zeros(m * len(bounds), dtype=full.dtype)
    for p, (a, b) in enumerate(bounds):
        pad[p * m: p * m + b - a].copy_(full[a:b])
    o = torch.empty(m, dtype=full.dtype)
    REDUCE_SCATTER_SINGLE(o, pad)
    out.copy_(o[: out.numel()])


def rs_direct(out, full, bounds, rank):
    """point to point: every other owner's slice sent to it, the peers' parts of the own slice
    received into per-peer buffers, summed with the own part"""
    s, e = bounds[rank]
    works = [dist.isend(full[a:b], dst=p) for p, (a, b) in enumerate(bounds) if p != rank and b > a]
    bufs = [torch.empty(e - s, dtype=full.dtype) for p in range(len(bounds)) if p != rank] if e > s else []
    peers = [p for p in range(len(bounds)) if p != rank]
    works += [dist.irecv(buf, src=p) for buf, p in zip(bufs, peers)]
    for w in works:
        w.wait()
    out.copy_(full[s:e])
    for buf in bufs:
        out.add_(buf)


AG_METHODS = {"broadcast": ag_broadcast, "padded": ag_padded, "allreduce": ag_allreduce}
RS_METHODS = {"reduce": rs_reduce, "allreduce": rs_allreduce, "padded": rs_padded, "direct": rs_direct}


def ref_ag(full, shard, bounds, rank):
    ALL_GATHER_SINGLE(full, shard)


def ref_rs(out, full, bounds, rank):
    REDUCE_SCATTER_SINGLE(out, full)


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


def _sizes(bounds) -> list[int]:
    return [b - a for a, b in bounds]


def _init(rank, world, port) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _timing_worker(rank, world, port, sizes_mib, dtypes, quick, queue):
    _init(rank, world, port)
    rows = []
    try:
        for size in sizes_mib:
            numel = size * MIB // FP32_BYTES
            numel -= numel % world
            repeats, per_sample = (3, 1) if size >= 32 else (5, 2) if size >= 4 else (7, 8)
            if quick:
                repeats = 2
            for dname in dtypes:
                dtype = DTYPES[dname]
                full = torch.ones(numel, dtype=dtype)
                even = split_bounds(numel, (1 / world,) * world)
                ref = {"ag": _time(ref_ag, full, torch.ones(numel // world, dtype=dtype), even, rank, repeats,
                                   per_sample),
                       "rs": _time(ref_rs, torch.empty(numel // world, dtype=dtype), full, even, rank, repeats,
                                   per_sample)}
                for fractions in SPLITS[world]:
                    bounds = split_bounds(numel, fractions)
                    s, e = bounds[rank]
                    for kind, methods in (("ag", AG_METHODS), ("rs", RS_METHODS)):
                        for name, fn in methods.items():
                            a, b = ((full, torch.ones(e - s, dtype=dtype)) if kind == "ag"
                                    else (torch.empty(e - s, dtype=dtype), full))
                            t = _time(fn, a, b, bounds, rank, repeats, per_sample)
                            rows.append((size, dname, fractions, kind, name, _sizes(bounds), t, ref[kind]))
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def _print_timing(world, rows) -> None:
    print(f"\n== {world} gloo ranks (median ms per call, slowest rank; ratio to the even-split single-tensor "
          f"form of the same size; wire = MB the busiest rank sends; pad = padding's bytes per rank and its "
          f"time over the even form) ==")
    print(f"{'MiB':>4} {'dt':<4} {'split':<14} {'op':<3} {'method':<10} {'median_ms':>9} {'ratio':>6} "
          f"{'wire_MB':>8} {'scratch_MB':>10} {'pad_MB':>7} {'pad_ms':>7}")
    best: dict[tuple, tuple[str, float]] = {}
    for size, dname, fractions, kind, name, sizes, t, t_ref in rows:
        elem = DTYPES[dname].itemsize
        send = (wire.gather_send_bytes if kind == "ag" else wire.reduce_scatter_send_bytes)(
            sizes, elem, world, "gloo", method=name)
        scratch = (wire.gather_scratch_bytes if kind == "ag" else wire.reduce_scatter_scratch_bytes)(
            sizes, elem, world, "gloo", method=name)
        pad = f"{(world * max(sizes) - sum(sizes)) * elem / 1e6:>7.2f} {(t - t_ref) * 1e3:>7.2f}" \
            if name == "padded" else f"{'':>7} {'':>7}"
        split = "/".join(f"{f:.2f}" for f in fractions)
        print(f"{size:>4} {dname:<4} {split:<14} {kind:<3} {name:<10} {t * 1e3:>9.2f} {t / t_ref:>6.2f} "
              f"{max(send) / 1e6:>8.2f} {scratch / 1e6:>10.2f} {pad}")
        key = (size, dname, split, kind, tuple(sizes), elem)
        if key not in best or t < best[key][1]:
            best[key] = (name, t)
    agree = 0
    print("\nwinner per point (measured) vs the module's rule (contracts.wire):")
    for (size, dname, split, kind, sizes, elem), (name, t) in best.items():
        rule = (wire.gather_method(sizes, elem, world, "gloo") if kind == "ag"
                else wire.reduce_scatter_method(sizes, elem, world, "gloo"))
        runner = [r for r in rows if (r[0], r[1], r[3], tuple(r[5])) == (size, dname, kind, sizes) and r[4] == rule]
        t_rule = runner[0][6] if runner else float("nan")
        agree += rule == name
        print(f"  {size:>4} MiB {dname} {split:<14} {kind}: fastest {name:<10} {t * 1e3:8.2f} ms; rule {rule:<10} "
              f"{t_rule * 1e3:8.2f} ms ({t_rule / t:.2f}x)")
    print(f"rule = fastest at {agree} of {len(best)} points")


# ---- --wire: bytes on the sockets against contracts/wire.py ------------------------------------------


def _bytes_sent(pid: int) -> int:
    """Sum of tcp_info bytes_sent over this process's TCP sockets (`ss -tinpH`)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
        if mine:
            total += sum(int(x) for x in re.findall(r"bytes_sent:(\d+)", line))
    return total


def measure_sent_bytes(fn, repeats: int = 3) -> int:
    """Bytes this rank sends for fn(), less what a barrier sends: the median of `repeats` measurements
    (a rare stray message of the barrier's makes one of them high)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        time.sleep(0.1)
        b0 = _bytes_sent(os.getpid())
        dist.barrier()
        time.sleep(0.1)
        b1 = _bytes_sent(os.getpid())
        fn()
        dist.barrier()
        time.sleep(0.1)
        samples.append(_bytes_sent(os.getpid()) - b1 - (b1 - b0))
    return int(statistics.median(samples))


def _wire_worker(rank, world, port, sizes_mib, dtypes, queue):
    _init(rank, world, port)
    rows = []
    try:
        for size in sizes_mib:
            numel = size * MIB // FP32_BYTES
            for dname in dtypes:
                dtype = DTYPES[dname]
                for fractions in SPLITS[world][1:]:
                    bounds = split_bounds(numel, fractions)
                    s, e = bounds[rank]
                    full = torch.ones(numel, dtype=dtype)
                    for kind, methods in (("ag", AG_METHODS), ("rs", RS_METHODS)):
                        for name, fn in methods.items():
                            a, b = ((full, torch.ones(e - s, dtype=dtype)) if kind == "ag"
                                    else (torch.empty(e - s, dtype=dtype), full))
                            sent = measure_sent_bytes(lambda: fn(a, b, bounds, rank))
                            rows.append((size, dname, fractions, kind, name, _sizes(bounds), sent))
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def _print_wire(world, by_rank) -> float:
    print(f"\n== {world} gloo ranks: bytes sent per rank per call, measured (ss bytes_sent) / contracts.wire ==")
    worst = 0.0
    for i, (size, dname, fractions, kind, name, sizes, _) in enumerate(by_rank[0]):
        elem = DTYPES[dname].itemsize
        model = (wire.gather_send_bytes if kind == "ag" else wire.reduce_scatter_send_bytes)(
            sizes, elem, world, "gloo", method=name)
        measured = [by_rank[r][i][6] for r in range(world)]
        err = max(abs(m - f) / max(f, 1) for m, f in zip(measured, model))
        worst = max(worst, err)
        split = "/".join(f"{f:.2f}" for f in fractions)
        print(f"{size:>4} MiB {dname} {split:<14} {kind} {name:<10} measured {measured} model {model} "
              f"max err {err * 100:.3f} %")
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 3], choices=sorted(SPLITS))
    ap.add_argument("--dtypes", nargs="+", default=sorted(DTYPES), choices=sorted(DTYPES))
    ap.add_argument("--quick", action="store_true", help="2 repeats per point")
    ap.add_argument("--wire", action="store_true", help="measure bytes on the sockets instead of time")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    t_start = time.perf_counter()
    worst = 0.0
    for world in args.worlds:
        queue = ctx.Queue()
        if args.wire:
            procs = mp.start_processes(_wire_worker, args=(world, free_port(), args.sizes_mib, args.dtypes, queue),
                                       nprocs=world, join=False, start_method="spawn")
            got = dict(queue.get() for _ in range(world))
            procs.join()
            worst = max(worst, _print_wire(world, [got[r] for r in range(world)]))
        else:
            procs = mp.start_processes(_timing_worker, args=(world, free_port(), args.sizes_mib, args.dtypes,
                                                             args.quick, queue),
                                       nprocs=world, join=False, start_method="spawn")
            rows = queue.get()
            procs.join()
            _print_timing(world, rows)
    if args.wire:
        print(f"\nlargest error of contracts.wire against the sockets: {worst * 100:.3f} %")
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
