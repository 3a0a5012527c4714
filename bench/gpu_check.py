"""GPU check of the sharded runtime (run by bench/gpu_check.sh on a lent GPU machine; never in CI).

    python bench/gpu_check.py [--model llama2-7b] [--layers 4] [--micro-batch 2] [--seq 1024]
                              [--steps 4] [--fsdp-steps 6] [--overlap-steps 6] [--device cuda|cpu]
                              [--only overlap] [--json-out PATH]

1. Memory, time, no host sync. One GPU stands in for rank 0 of a 4-rank run holding a quarter of
   the state (models.collectives.LocalCollectives: the same allocations as a real rank), bf16
   autocast, for ZeRO 1, 2, 3 (fp32 gathers, as before) and ZeRO 3 with bf16 gathers at prefetch 1
   and 2, and at prefetch 1 with the embedding's gradient sent as the step's rows (set_batch_split). Per configuration `--steps` steps: the second-to-last measures
   `torch.cuda.max_memory_allocated` against planner/core/memory.py's prediction (independent code
   paths) and the median step time against the planner's step-time profile; the last is issued
   under `torch.cuda.set_sync_debug_mode("error")` (testkit.fsdp2.no_host_sync): any host
   synchronization inside the step fails the check; its statistics are read after.
2. FSDP2 side by side: one process, a one-rank NCCL group; the runtime (zero 3, bf16 gathers,
   fp32 reduce, prefetch 1) and FSDP2 `fully_shard` per block and root with
   MixedPrecisionPolicy(bf16, fp32), both under bf16 autocast from the same initial weights on the
   same batches, steps alternating AB/BA: median step time, peak memory, every step's loss.
3. With 2+ GPUs, uneven NCCL all-gather / reduce-scatter (0.7/0.3 split) in fp32 and bf16.
4. Overlap on CPU ranks (any machine): 2 gloo ranks, 1 thread each, uneven shards (0.6/0.4), the
   `small` preset at zero 3 with 2 micro-batches per rank, per (prefetch, reduce_in_flight,
   param_dtype) the median step time and comm_wait_s (the time compute waited in Work.wait())
   of the slowest rank, configurations interleaved step by step. Reported, not judged.

Prints one table and one JSON line (also written to --json-out). Exit 1 when a memory prediction
is off by more than 3 %, a step synchronizes with the host, or the FSDP2 losses differ by more
than 1e-2 (relative, any step). `--device cpu` is the dry run of every part on a CPU (a small
model, gloo instead of NCCL, the host-read guard instead of the sync-debug mode, no memory
figures), so the script is tested before its one run on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from contracts.attention import select_kernel  # noqa: E402
from contracts.catalog import CATALOG  # noqa: E402
from contracts.specs import get_model, with_max_seq  # noqa: E402
from models.collectives import LocalCollectives  # noqa: E402
from models.sharded import DTYPE_NAMES, ShardedRuntime  # noqa: E402
from planner.core.memory import MemoryConfig, estimate_memory  # noqa: E402
from testkit.fsdp2 import Fsdp2Reference, no_host_sync  # noqa: E402

TOL_PCT = 3.0
FSDP2_LOSS_REL = 1e-2
BF16 = torch.bfloat16
# (zero, gathered parameter dtype, prefetch, the embedding's gradient as rows) of part 1
CONFIGS = ((1, torch.float32, 1, False), (2, torch.float32, 1, False), (3, torch.float32, 1, False),
           (3, BF16, 1, False), (3, BF16, 2, False), (3, BF16, 1, True))


class ZeroedOthers(LocalCollectives):
    """LocalCollectives whose gathers zero the other ranks' slices first (in place, as
    profiler/tracing.py's traced rank does): finite numbers where a real run has their values."""

    def all_gather(self, full, shard, bounds, async_op=False):
        s, e = bounds[self.position]
        full[:s].zero_()
        full[e:].zero_()
        return super().all_gather(full, shard, bounds, async_op)


def catalog_type(device: torch.device) -> str:
    """The catalog name of the device (H200 here), by a substring of torch's device name."""
    if device.type == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(device).upper().replace(" ", "-")
    for key in sorted(CATALOG, key=len, reverse=True):
        if key != "cpu" and key.upper() in name:
            return key
    raise SystemExit(f"GPU {name!r} is not in contracts/catalog.py")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def random_batch(spec, micro_batch: int, seq: int, device: torch.device, gen: torch.Generator):
    x = torch.randint(0, spec.vocab_size, (micro_batch, seq + 1), device=device, generator=gen)
    return [(x[:, :-1], x[:, 1:])]


def synced_step(rt: ShardedRuntime, batches, normalizer: int, device: torch.device) -> tuple[float, str | None]:
    """One step issued under no_host_sync, its result read after: (seconds, None) or (nan, the
    first line of the error) when something in the step synchronized."""
    sync(device)
    t0 = time.perf_counter()
    try:
        with no_host_sync(device):
            pending = rt.start_step(batches, normalizer, lr=1e-4)
    except RuntimeError as e:
        return float("nan"), str(e).strip().splitlines()[0][:300]
    pending.result()
    sync(device)
    return time.perf_counter() - t0, None


def check_stage(spec, gpu: str, device: torch.device, zero: int, param_dtype: torch.dtype, prefetch: int,
                rows: bool, micro_batch: int, seq: int, steps: int) -> dict:
    """Part 1 for one configuration (module docstring)."""
    kernel = select_kernel(gpu, "bf16", spec.num_heads, spec.num_kv_heads, spec.head_dim)
    rt = ShardedRuntime(spec, zero=zero, fractions=[0.25] * 4, position=0, comm=ZeroedOthers(0, 4),
                        device=device, autocast_dtype=BF16, expand_kv=kernel.expand_kv, param_dtype=param_dtype,
                        prefetch=prefetch)
    if rows:  # the runtime sends the embedding's gradient as rows where contracts.wire's rule says so
        rt.set_batch_split([micro_batch] * 4, seq)
    rows = rows and rt._rows_exchange()
    gen = torch.Generator(device=device).manual_seed(0)
    normalizer = micro_batch * seq * 4
    times, peak = [], None
    for step in range(1, steps):  # the last step is the sync check
        batches = random_batch(spec, micro_batch, seq, device, gen)
        reset_peak(device)
        t0 = time.perf_counter()
        rt.train_step(batches, normalizer, lr=1e-4)
        sync(device)
        times.append(time.perf_counter() - t0)
        peak = peak_bytes(device)
    sync_s, sync_error = synced_step(rt, random_batch(spec, micro_batch, seq, device, gen), normalizer, device)
    cfg = MemoryConfig(micro_batch=micro_batch, seq=seq, dtype="bf16", dp=4, zero=zero, shard_fraction=0.25,
                       device_type=gpu, param_dtype=DTYPE_NAMES[param_dtype], prefetch=prefetch,
                       step_tokens=4 * micro_batch * seq if rows else 0)
    pred = estimate_memory(spec, cfg).peak_bytes
    from planner.core.profiles import get_step_profile

    prof = get_step_profile(gpu, spec, seq, "bf16", recompute="none")
    predicted_s = prof.alpha_s + prof.beta_s * micro_batch + prof.optimizer_s_per_param * spec.num_params * 0.25
    del rt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"zero": zero, "param_dtype": DTYPE_NAMES[param_dtype], "prefetch": prefetch, "rows": rows,
            "measured_peak_bytes": peak, "predicted_peak_bytes": int(pred),
            "memory_err_pct": None if peak is None else 100.0 * (pred - peak) / peak,
            "kernel": kernel.name, "expand_kv": kernel.expand_kv,
            "median_step_s": statistics.median(times[1:] or times), "profile_step_s": predicted_s,
            "profile_measured": bool(prof.measured), "sync_free": sync_error is None, "sync_error": sync_error,
            "synced_step_s": sync_s}


def init_one_rank_group(device: torch.device) -> None:
    import torch.distributed as dist
    from testkit.processes import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def compare_fsdp2(spec, device: torch.device, micro_batch: int, seq: int, steps: int) -> dict:
    """Part 2 (module docstring): ours and FSDP2 on a one-rank group, AB/BA alternating."""
    import torch.distributed as dist
    from models.collectives import ProcessGroupCollectives
    from models.optim import OptimConfig

    init_one_rank_group(device)
    try:
        optim = OptimConfig()
        ours = ShardedRuntime(spec, zero=3, fractions=[1.0], position=0, comm=ProcessGroupCollectives(0, [0]),
                              device=device, autocast_dtype=BF16, optim=optim, param_dtype=BF16,
                              reduce_dtype=torch.float32, prefetch=1)
        fsdp = Fsdp2Reference(spec, ours.full_state_dict(), optim, device, param_dtype=BF16,
                              reduce_dtype=torch.float32, autocast_dtype=BF16)
        normalizer = micro_batch * seq
        gen = torch.Generator(device=device).manual_seed(1)
        runs = {"ours": lambda b: ours.train_step(b, normalizer, 1e-4).loss,
                "fsdp2": lambda b: float(fsdp.step(b, normalizer, 1e-4))}
        times = {k: [] for k in runs}
        losses = {k: [] for k in runs}
        peaks = {k: 0 for k in runs}
        for step in range(steps):
            batches = random_batch(spec, micro_batch, seq, device, gen)
            for name in (("ours", "fsdp2") if step % 2 == 0 else ("fsdp2", "ours")):
                reset_peak(device)
                t0 = time.perf_counter()
                losses[name].append(runs[name](batches))
                sync(device)
                times[name].append(time.perf_counter() - t0)
                peaks[name] = max(peaks[name], peak_bytes(device) or 0)
        _, sync_error = synced_step(ours, random_batch(spec, micro_batch, seq, device, gen), normalizer, device)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["fsdp2"]))
        out = {name: {"median_step_s": statistics.median(times[name][1:] or times[name]),
                      "peak_bytes": peaks[name] or None, "losses": losses[name]} for name in runs}
        del ours, fsdp
        return {**out, "max_loss_rel_diff": rel, "ours_over_fsdp2_step_time":
                out["ours"]["median_step_s"] / out["fsdp2"]["median_step_s"],
                "sync_free_process_group": sync_error is None, "sync_error_process_group": sync_error}
    finally:
        dist.destroy_process_group()


NCCL_CODE = """
import torch, torch.distributed as d
from models.collectives import ProcessGroupCollectives as P
d.init_process_group('nccl'); r = d.get_rank(); torch.cuda.set_device(r)
b = [(0, 700), (700, 1000)]
for dt in (torch.float32, torch.bfloat16):
    f = torch.zeros(1000, device='cuda', dtype=dt); s = torch.full((b[r][1] - b[r][0],), r + 1., device='cuda', dtype=dt)
    c = P(r, [0, 1]); c.all_gather(f, s, b).wait(); assert f[:700].eq(1).all() and f[700:].eq(2).all()
    o = torch.empty(b[r][1] - b[r][0], device='cuda', dtype=dt); g = torch.ones(1000, device='cuda', dtype=dt)
    c.reduce_scatter(o, g, b, async_op=True).wait(); assert o.eq(2).all()
print('ok')
"""


def check_nccl_uneven() -> dict:
    """Part 3 (module docstring)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return {"nccl_uneven": "skipped: fewer than 2 GPUs (NCCL needs a device per rank)"}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(NCCL_CODE)
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", fh.name],
                       capture_output=True, text=True, timeout=120, env=env)
    return {"nccl_uneven": "ok" if r.returncode == 0 and "ok" in r.stdout else f"FAILED: {r.stderr[-300:]}"}


OVERLAP_CONFIGS = ((0, 0, "fp32"), (1, 0, "fp32"), (1, 1, "fp32"), (2, 1, "fp32"), (1, 1, "bf16"))
OVERLAP_WORLD = 2


def _overlap_rank(rank: int, port: int, steps: int, out_dir: str) -> None:
    import torch.distributed as dist
    from models.collectives import ProcessGroupCollectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=OVERLAP_WORLD)
    try:
        spec, seq, mb = get_model("small"), 128, 2
        rts = {cfg: ShardedRuntime(spec, zero=3, fractions=[0.6, 0.4], position=rank,
                                   comm=ProcessGroupCollectives(rank, list(range(OVERLAP_WORLD))),
                                   device=torch.device("cpu"), prefetch=cfg[0], reduce_in_flight=cfg[1],
                                   param_dtype=BF16 if cfg[2] == "bf16" else torch.float32,
                                   autocast_dtype=BF16 if cfg[2] == "bf16" else None)
               for cfg in OVERLAP_CONFIGS}
        gen = torch.Generator().manual_seed(rank)
        res = {str(cfg): {"step_s": [], "comm_wait_s": []} for cfg in OVERLAP_CONFIGS}
        for _ in range(steps + 1):  # the first step of each is a warm-up
            batches = [random_batch(spec, mb, seq, torch.device("cpu"), gen)[0] for _ in range(2)]
            for cfg, rt in rts.items():
                dist.barrier()
                t0 = time.perf_counter()
                r = rt.train_step(batches, OVERLAP_WORLD * 2 * mb * seq, lr=1e-4)
                res[str(cfg)]["step_s"].append(time.perf_counter() - t0)
                res[str(cfg)]["comm_wait_s"].append(r.comm_wait_s)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(res, fh)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo threads can abort in static destructors


def check_overlap(steps: int) -> list[dict]:
    """Part 4 (module docstring)."""
    import torch.multiprocessing as mp
    from testkit.processes import free_port

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_overlap_rank, args=(free_port(), steps, d), nprocs=OVERLAP_WORLD, start_method="spawn")
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(OVERLAP_WORLD)]
    rows = []
    for cfg in OVERLAP_CONFIGS:
        per = [r[str(cfg)] for r in ranks]
        step_s = [max(p["step_s"][i] for p in per) for i in range(1, steps + 1)]
        wait_s = [max(p["comm_wait_s"][i] for p in per) for i in range(1, steps + 1)]
        rows.append({"prefetch": cfg[0], "reduce_in_flight": cfg[1], "param_dtype": cfg[2],
                     "median_step_s": statistics.median(step_s), "median_comm_wait_s": statistics.median(wait_s)})
    return rows


def _gib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**30:.3f} GiB"


def print_stage(r: dict) -> None:
    if "error" in r:
        print(f"zero {r['zero']} gather {r['param_dtype']} prefetch {r['prefetch']}: FAILED: {r['error']}")
        return
    err = "" if r["memory_err_pct"] is None else f" ({r['memory_err_pct']:+.2f} %)"
    print(f"zero {r['zero']} gather {r['param_dtype']} prefetch {r['prefetch']}"
          f"{', embedding gradient as rows' if r.get('rows') else ''}: peak measured "
          f"{_gib(r['measured_peak_bytes'])}, predicted {_gib(r['predicted_peak_bytes'])}{err}; step measured "
          f"{r['median_step_s'] * 1e3:.1f} ms, profile {r['profile_step_s'] * 1e3:.1f} ms "
          f"({'measured' if r['profile_measured'] else 'estimated'} profile); SDPA {r['kernel']}; "
          f"host sync in step: {'none' if r['sync_free'] else 'YES: ' + r['sync_error']}", flush=True)


def print_fsdp2(fsdp: dict) -> None:
    if "error" in fsdp:
        print(f"FSDP2 side by side: FAILED: {fsdp['error']}")
        return
    o, f = fsdp["ours"], fsdp["fsdp2"]
    print(f"FSDP2 side by side (one rank, bf16 gathers, fp32 reduce): step ours {o['median_step_s'] * 1e3:.1f} ms, "
          f"fsdp2 {f['median_step_s'] * 1e3:.1f} ms (ours/fsdp2 {fsdp['ours_over_fsdp2_step_time']:.3f}); peak ours "
          f"{_gib(o['peak_bytes'])}, fsdp2 {_gib(f['peak_bytes'])}; max loss rel diff {fsdp['max_loss_rel_diff']:.2e}; "
          f"host sync in step (process group): "
          f"{'none' if fsdp['sync_free_process_group'] else 'YES: ' + fsdp['sync_error_process_group']}", flush=True)


def guarded(fn, *args, **labels) -> Any:
    """fn(*args), or `labels` with the error's first line when it raises (the other parts still run)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one chance to run: report and go on
        traceback.print_exc()
        return {**labels, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''}"}


def print_overlap(rows: list[dict]) -> None:
    print(f"overlap, {OVERLAP_WORLD} gloo CPU ranks (small, zero 3, shards 0.6/0.4, 2 micro-batches), slowest rank:")
    for r in rows:
        print(f"  prefetch {r['prefetch']} reduce_in_flight {r['reduce_in_flight']} gather {r['param_dtype']}: "
              f"step {r['median_step_s'] * 1e3:.1f} ms, compute waited on communication "
              f"{r['median_comm_wait_s'] * 1e3:.1f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a planner preset (default llama2-7b; tiny-llama with --device cpu)")
    p.add_argument("--layers", type=int, default=None, help="blocks kept of the model (its real widths; default 4)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="default 1024 (64 with --device cpu)")
    p.add_argument("--steps", type=int, default=4, help="per configuration of part 1 (>= 3)")
    p.add_argument("--fsdp-steps", type=int, default=6, help="steps of each system in part 2 (>= 2)")
    p.add_argument("--overlap-steps", type=int, default=6, help="timed steps per configuration of part 4 (>= 1)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--only", choices=("overlap",), default=None, help="run part 4 alone (CPU ranks)")
    p.add_argument("--json-out", default=None, help="also write the JSON object to this file")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    a.model = a.model or ("tiny-llama" if cpu else "llama2-7b")
    a.layers = a.layers or (2 if cpu else 4)
    a.seq = a.seq or (64 if cpu else 1024)
    if a.steps < 3 or a.fsdp_steps < 2 or a.overlap_steps < 1:
        p.error("need --steps >= 3, --fsdp-steps >= 2 and --overlap-steps >= 1")
    if a.only == "overlap":
        overlap = check_overlap(a.overlap_steps)
        print_overlap(overlap)
        print(json.dumps({"overlap": overlap}))
        return 0
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check runs on a lent GPU machine only (--device cpu: the dry run)")
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(device)
    gpu = catalog_type(device)
    spec = replace(with_max_seq(get_model(a.model), a.seq), num_layers=a.layers)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU dry run"
    print(f"{gpu} ({name}), torch {torch.__version__}, {a.model} x {a.layers} blocks, bf16 autocast, "
          f"mb {a.micro_batch}, seq {a.seq}, rank 0 of 4 (shard 1/4)", flush=True)
    rows = []
    for z, pd, k, as_rows in CONFIGS:
        rows.append(guarded(check_stage, spec, gpu, device, z, pd, k, as_rows, a.micro_batch, a.seq, a.steps,
                            zero=z, param_dtype=DTYPE_NAMES[pd], prefetch=k))
        print_stage(rows[-1])
    fsdp = guarded(compare_fsdp2, spec, device, a.micro_batch, a.seq, a.fsdp_steps)
    print_fsdp2(fsdp)
    nccl = guarded(check_nccl_uneven, nccl_uneven="FAILED")
    print(nccl["nccl_uneven"], nccl.get("error", ""), flush=True)
    overlap = guarded(check_overlap, a.overlap_steps)
    if isinstance(overlap, dict):
        print(f"overlap: FAILED: {overlap['error']}")
    else:
        print_overlap(overlap)
    ok = [r for r in rows if "error" not in r]
    memory_ok = len(ok) == len(rows) and all(
        r["memory_err_pct"] is None or abs(r["memory_err_pct"]) <= TOL_PCT for r in ok)
    sync_ok = all(r["sync_free"] for r in ok) and fsdp.get("sync_free_process_group", False)
    loss_ok = fsdp.get("max_loss_rel_diff", float("inf")) <= FSDP2_LOSS_REL
    nccl_ok = not nccl["nccl_uneven"].startswith("FAILED")
    verdict = {"memory": memory_ok, "no_host_sync": sync_ok, "fsdp2_losses": loss_ok, "nccl_uneven": nccl_ok,
               "overlap_ran": not isinstance(overlap, dict)}
    out = {"gpu": gpu, "device": str(device), "torch": torch.__version__, "stages": rows, "fsdp2": fsdp, **nccl,
           "overlap": overlap, "pass": verdict}
    print(json.dumps(out))
    print("PASS" if all(verdict.values()) else f"FAIL: {[k for k, v in verdict.items() if not v]}")
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if all(verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
