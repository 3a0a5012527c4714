"""One rank of bench/sharded_runtime.py: trains the systems a job file names, side by side, and
writes what it measured.

    RANK=r WORLD_SIZE=n MASTER_ADDR=.. MASTER_PORT=.. [GLOO_SOCKET_IFNAME=..] [GPUMIX_CGROUPS=..] \
        python bench/_sharded_rank.py JOB.json

The launcher (bench/sharded_runtime.py) starts it inside the rank's network namespace. After its
imports the rank joins its cgroups (profiler/cgroups.py: a CPU quota, and a memory limit of its
baseline then plus the emulated device memory), then joins the gloo group. Each system of the job
(`ours`: models.sharded.ShardedRuntime; `fsdp2`: torch's fully_shard on a plain Decoder) trains
`warmup + steps` steps on the same token windows, steps alternating the systems' order (AB/BA);
the last warm-up step is traced for peak live tensor bytes (profiler.memtrack). Writes
`<out>.rank<r>.json`: per system, every timed step's wall seconds, its compute seconds and the
time it waited on communication (ours: StepResult.compute_s and comm_wait_s), the TCP payload it
sent on its emulated link (executor.links.LinkCounter), the losses, the peak.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from contracts.specs import ModelSpec  # noqa: E402
from profiler.memtrack import LiveTensorBytes  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class LocalLiveTensorBytes(LiveTensorBytes):
    """LiveTensorBytes that counts a DTensor by its local tensor (FSDP2's sharded parameters,
    gradients and optimizer state are DTensors; their wrappers have no storage of their own)."""

    def _track(self, t):
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):
            t = t._local_tensor
        super()._track(t)


def rank_batches(seed: int, step: int, rank: int, batches: list[int], micro_batch: int, seq: int, vocab: int):
    """This rank's micro-batches [(tokens, targets), ...], (m, T) each: slices of one global set of
    windows per step, so every split of the global batch trains on the same samples."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    w = torch.randint(0, vocab, (sum(batches), seq + 1), generator=g)  # (B, T + 1)
    lo = sum(batches[:rank])
    mine = w[lo:lo + batches[rank]]
    return [(mine[i:i + micro_batch, :-1].contiguous(), mine[i:i + micro_batch, 1:].contiguous())
            for i in range(0, batches[rank], micro_batch)]


# ---- the two systems -----------------------------------------------------------------------------


class Ours:
    """models.sharded.ShardedRuntime at the job's ZeRO stage and shard fractions."""

    def __init__(self, spec: ModelSpec, sys_cfg: dict, rank: int, world: int, optim, seed: int, dtype: str):
        from models.collectives import ProcessGroupCollectives
        from models.sharded import ShardedRuntime

        kwargs = dict(zero=sys_cfg["zero"], fractions=sys_cfg["fractions"], position=rank,
                      comm=ProcessGroupCollectives(rank, list(range(world))), device=torch.device("cpu"),
                      recompute=sys_cfg["recompute"], autocast_dtype=DTYPES[dtype], optim=optim, seed=seed)
        # mixed precision like FSDP2's MixedPrecisionPolicy: the gathered parameters in `param_dtype`
        # (the compute dtype unless the job names one), gradients reduced in `reduce_dtype` (fp32
        # unless the job names one),
        # `prefetch` gathers and `reduce_in_flight` reduce-scatters in flight (the runtime's defaults
        # unless named). Passed only where the
        # runtime takes them: `missing` says which it does not.
        names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        wanted = {"param_dtype": names[sys_cfg.get("param_dtype") or dtype],
                  "reduce_dtype": names[sys_cfg.get("reduce_dtype") or "fp32"]}
        for k in ("prefetch", "reduce_in_flight"):
            if sys_cfg.get(k) is not None:
                wanted[k] = sys_cfg[k]
        accepted = inspect.signature(ShardedRuntime.__init__).parameters
        kwargs.update({k: v for k, v in wanted.items() if k in accepted})
        self.missing = sorted(k for k in wanted if k not in accepted)
        self.rt = ShardedRuntime(spec, **kwargs)

    def resident(self):
        return self.rt.resident_tensors()

    def step(self, mbs, normalizer: int, lr: float) -> tuple[float, float | None, float | None, dict | None]:
        """(global loss, seconds compute waited on communication, seconds of compute, the waits by
        site: gather / reduce / tail)."""
        r = self.rt.train_step(mbs, normalizer, lr)
        return r.loss, getattr(r, "comm_wait_s", None), r.compute_s, getattr(r, "comm_wait_by", None)

    def settle(self) -> None:
        self.rt.settle()  # the next step's gathers, issued beside the last update

    def full_params(self):
        return self.rt.full_state_dict()


class Fsdp2:
    """FSDP2 (`fully_shard` per block, then the root; even shards), mixed precision through its
    MixedPrecisionPolicy (parameters in the compute dtype, gradients reduced in the system's
    `reduce_dtype`, fp32 unless named), its default
    prefetching; gradients summed as ours are, the same AdamW groups, LR and clipping. `sync`:
    "every" reduce-scatters after every micro-batch (FSDP2's default), "last" only after the last
    (`set_requires_gradient_sync(False)` before: unsharded gradients held across micro-batches)."""

    def __init__(self, spec: ModelSpec, sys_cfg: dict, world: int, optim, initial_state, dtype: str):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        from models.decoder import build_model
        model = build_model(spec, sys_cfg["recompute"])
        if initial_state is not None:
            model.load_state_dict(initial_state, strict=False)
        mesh = init_device_mesh("cpu", (world,))
        reduce = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys_cfg.get("reduce_dtype") or "fp32"]
        mp = (MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=reduce)
              if DTYPES[dtype] is not None else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not average: the loss is already / global tokens
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
        self.model, self.cfg, self.dtype = model, optim, DTYPES[dtype]
        self.sync = sys_cfg.get("sync", "every")
        params = list(model.parameters())
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)

    def resident(self):
        out = []
        for p in self.model.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def step(self, mbs, normalizer: int, lr: float) -> tuple[float, None, None, None]:
        total = 0.0
        for i, (x, y) in enumerate(mbs):
            if self.sync == "last":
                self.model.set_requires_gradient_sync(i == len(mbs) - 1)
            with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
                logits = self.model(x)  # (m, T, V)
            V = logits.shape[-1]
            loss = F.cross_entropy(logits.float().view(-1, V), y.reshape(-1), reduction="sum") / normalizer
            del logits
            loss.backward()
            total += float(loss.detach())
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t = torch.tensor(total, dtype=torch.float64)  # this rank's part; ours' loss is already global
        dist.all_reduce(t)
        return float(t), None, None, None

    def full_params(self):
        return {n: p.full_tensor() for n, p in self.model.named_parameters()}


# ---- one rank -----------------------------------------------------------------------------------


def join_cgroups(rank: int) -> dict:
    """Join this rank's cgroups (if the launcher made any) and set the memory limit over the
    baseline now: the interpreter, torch and both systems' modules imported, nothing built (a
    memory cgroup is charged only what the rank allocates after it joins)."""
    import torch.distributed.fsdp  # noqa: F401  (imported before joining: its files' pages are no device memory)
    import models.sharded  # noqa: F401
    from profiler import cgroups
    cg = cgroups.rank_cgroup(rank)
    if cg is None:
        return {}
    cgroups.join(cg)
    baseline = cgroups.apply_memory_limit(cg)
    return {"cgroup": cg.name, "memory_baseline_bytes": baseline,
            "memory_limit_bytes": cgroups.memory_limit_bytes(cg)}


def cgroup_peak_bytes(rank: int) -> int | None:
    """The memory cgroup's peak charge so far (RSS and page cache), None without one."""
    from profiler import cgroups
    cg = cgroups.rank_cgroup(rank)
    if cg is None or cg.memory_dir is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(cg.memory_dir, "memory.max_usage_in_bytes")) as fh:
            return int(fh.read())
    return None


def run(job: dict) -> dict:
    from models.optim import OptimConfig, lr_at

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    info = join_cgroups(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = ModelSpec.from_dict(job["model"])
    optim = OptimConfig(warmup_steps=job["warmup"])
    total, seq, dtype = job["warmup"] + job["steps"], job["seq"], job["dtype"]
    systems, notes = {}, {}
    for s in job["systems"]:
        if s["kind"] == "ours":
            systems[s["name"]] = Ours(spec, s, rank, world, optim, job["seed"], dtype)
            systems[s["name"]].rt.set_batch_split(s["batches"], seq)  # the plan's split of the global batch
            notes[s["name"]] = {"runtime_lacks": systems[s["name"]].missing}
        else:
            init = next((o.full_params() for o in systems.values() if isinstance(o, Ours)), None)
            if init is None:
                torch.manual_seed(job["seed"])
            systems[s["name"]] = Fsdp2(spec, s, world, optim, init, dtype)
            notes[s["name"]] = {}
    cfg = {s["name"]: s for s in job["systems"]}
    normalizer = job["global_batch"] * seq  # the global token count
    out = {k: {"step_s": [], "comm_wait_s": [], "comm_wait_by": [], "compute_s": [], "wire_bytes": [], "losses": [],
               "peak_bytes": None,
               **notes[k]} for k in systems}
    from executor.links import ENV_LINK_IF, LinkCounter
    counter = LinkCounter(os.environ.get(ENV_LINK_IF))  # the bytes this rank sends on its emulated link
    names = list(systems)
    for step in range(1, total + 1):
        lr = lr_at(step, total, optim)
        for name in (names if step % 2 == 0 else names[::-1]):  # AB / BA
            c = cfg[name]
            mbs = rank_batches(job["seed"], step, rank, c["batches"], c["micro_batch"][rank], seq, spec.vocab_size)
            dist.barrier()  # both ranks start the system's step together
            if step == job["warmup"]:  # the last warm-up step: memory (the tracker slows it)
                with LocalLiveTensorBytes(systems[name].resident()) as mode:
                    loss = systems[name].step(mbs, normalizer, lr)[0]
                out[name]["peak_bytes"] = mode.peak_bytes
            else:
                counter.start()
                t0 = time.perf_counter()
                loss, wait, compute, wait_by = systems[name].step(mbs, normalizer, lr)
                dt = time.perf_counter() - t0
                sent = counter.stop()
                if step > job["warmup"]:
                    out[name]["step_s"].append(dt)
                    out[name]["comm_wait_s"].append(wait)
                    out[name]["comm_wait_by"].append(wait_by)
                    out[name]["compute_s"].append(compute)
                    out[name]["wire_bytes"].append(sent)
            out[name]["losses"].append(loss)
    for system in systems.values():
        if hasattr(system, "settle"):
            system.settle()
    diff = None
    if len(systems) == 2 and job.get("compare_params"):
        a, b = (systems[n].full_params() for n in names)
        diff = max(float((a[n].detach().float() - b[n].detach().float()).abs().max()) for n in a if n in b)
    info["cgroup_peak_bytes"] = cgroup_peak_bytes(rank)
    return {"rank": rank, "systems": out, "param_max_abs_diff": diff, **info}


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as fh:
        job = json.load(fh)
    try:
        res = run(job)
        with open(f"{job['out']}.rank{res['rank']}.json", "w", encoding="utf-8") as fh:
            json.dump(res, fh)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # leave without the interpreter's teardown: torch 2.13's gloo threads can abort in C++ static
    # destructors at exit ("terminate called without an active exception"), as executor.worker notes
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
