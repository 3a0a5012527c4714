"""GPU check of the sharded runtime (run by bench/gpu_check.sh on a lent GPU machine; never in CI).

For ZeRO 1, 2 and 3 on ONE GPU, the GPU stands in for rank 0 of a 4-rank run holding a quarter of
the state (models.collectives.LocalCollectives: the same allocations as a real rank): three
training steps of a Llama-shaped model in bf16, then
  * measured `torch.cuda.max_memory_allocated` of the third step (peak stats reset before it)
    against planner/core/memory.py's prediction for that device type (independent code paths);
  * the measured median step time against the planner's step-time profile for the type
    (planner/profiles.get_step_profile: measured if `profiler profile` ran here, else estimated);
and, with 2+ GPUs, uneven NCCL all-gather / reduce-scatter (0.7/0.3 split) checked for values.
Prints one table and one JSON line; exit 1 when a memory prediction is off by more than 3 %.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.collectives import LocalCollectives  # noqa: E402
from models.sharded import ShardedRuntime  # noqa: E402
from contracts.attention import select_kernel  # noqa: E402
from contracts.catalog import CATALOG  # noqa: E402
from planner.core.memory import MemoryConfig, estimate_memory  # noqa: E402
from contracts.specs import get_model, with_max_seq  # noqa: E402

TOL_PCT = 3.0


def catalog_type() -> str:
    """The catalog name of GPU 0 (H200 here), by a substring of torch's device name."""
    name = torch.cuda.get_device_name(0).upper().replace(" ", "-")
    for key in sorted(CATALOG, key=len, reverse=True):
        if key != "cpu" and key.upper() in name:
            return key
    raise SystemExit(f"GPU {name!r} is not in contracts/catalog.py")


def check_stage(spec, gpu: str, zero: int, micro_batch: int, seq: int, steps: int) -> dict:
    dev = torch.device("cuda", 0)
    kernel = select_kernel(gpu, "bf16", spec.num_heads, spec.num_kv_heads, spec.head_dim)
    rt = ShardedRuntime(spec, zero=zero, fractions=[0.25] * 4, position=0, comm=LocalCollectives(0, 4), device=dev,
                        autocast_dtype=torch.bfloat16, expand_kv=kernel.expand_kv)
    gen = torch.Generator(device=dev).manual_seed(0)
    times, peak = [], 0
    for step in range(1, steps + 1):
        x = torch.randint(0, spec.vocab_size, (micro_batch, seq + 1), device=dev, generator=gen)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        rt.train_step([(x[:, :-1], x[:, 1:])], micro_batch * seq * 4, lr=1e-4)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(dev)
    cfg = MemoryConfig(micro_batch=micro_batch, seq=seq, dtype="bf16", dp=4, zero=zero, shard_fraction=0.25,
                       device_type=gpu)
    pred = estimate_memory(spec, cfg).peak_bytes
    from planner.core.profiles import get_step_profile

    prof = get_step_profile(gpu, spec, seq, "bf16", recompute="none")
    predicted_s = prof.alpha_s + prof.beta_s * micro_batch + prof.optimizer_s_per_param * spec.num_params * 0.25
    del rt
    torch.cuda.empty_cache()
    return {"zero": zero, "measured_peak_bytes": int(peak), "predicted_peak_bytes": int(pred),
            "memory_err_pct": 100.0 * (pred - peak) / peak, "kernel": kernel.name, "expand_kv": kernel.expand_kv,
            "median_step_s": statistics.median(times[1:]), "profile_step_s": predicted_s,
            "profile_measured": bool(prof.measured)}


def check_nccl_uneven() -> dict:
    if torch.cuda.device_count() < 2:
        return {"nccl_uneven": "skipped: one GPU (NCCL needs a device per rank)"}
    import subprocess

    code = ("import os,torch,torch.distributed as d;from models.collectives import ProcessGroupCollectives as P;"
            "d.init_process_group('nccl');r=d.get_rank();torch.cuda.set_device(r);b=[(0,700),(700,1000)];"
            "f=torch.zeros(1000,device='cuda');s=torch.full((b[r][1]-b[r][0],),r+1.,device='cuda');"
            "c=P(r,[0,1]);c.all_gather(f,s,b).wait();assert f[:700].eq(1).all() and f[700:].eq(2).all();"
            "o=torch.empty(b[r][1]-b[r][0],device='cuda');g=torch.ones(1000,device='cuda');"
            "c.reduce_scatter(o,g,b).wait();assert o.eq(2).all();print('ok')")
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(code.replace(";", "\n"))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", fh.name],
                       capture_output=True, text=True, timeout=120, env=env)
    return {"nccl_uneven": "ok" if r.returncode == 0 and "ok" in r.stdout else f"FAILED: {r.stderr[-300:]}"}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--layers", type=int, default=4, help="blocks kept of the model (its real widths)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this check runs on a lent GPU machine only")
    gpu = catalog_type()
    spec = replace(with_max_seq(get_model(a.model), a.seq), num_layers=a.layers)
    rows = [check_stage(spec, gpu, z, a.micro_batch, a.seq, a.steps) for z in (1, 2, 3)]
    print(f"{gpu} ({torch.cuda.get_device_name(0)}), {a.model} x {a.layers} blocks, bf16, mb {a.micro_batch}, "
          f"seq {a.seq}, rank 0 of 4 (shard 1/4)")
    for r in rows:
        print(f"zero {r['zero']}: peak measured {r['measured_peak_bytes'] / 2**30:.3f} GiB, predicted "
              f"{r['predicted_peak_bytes'] / 2**30:.3f} GiB ({r['memory_err_pct']:+.2f} %); step measured "
              f"{r['median_step_s'] * 1e3:.1f} ms, profile {r['profile_step_s'] * 1e3:.1f} ms "
              f"({'measured' if r['profile_measured'] else 'estimated'} profile); SDPA {r['kernel']}")
    nccl = check_nccl_uneven()
    print(nccl["nccl_uneven"])
    print(json.dumps({"gpu": gpu, "stages": rows, **nccl}))
    return 0 if all(abs(r["memory_err_pct"]) <= TOL_PCT for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
