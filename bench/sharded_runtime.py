"""The sharded runtime at ZeRO-3 against FSDP2 (`torch.distributed.fsdp.fully_shard`), side by side.

    python bench/sharded_runtime.py [--model bench-gpt2] [--micro-batch 2] [--seq 128]
                                    [--warmup 3] [--steps 16] [--json]

Two gloo CPU ranks, one process group for both systems: ours (models.sharded.ShardedRuntime,
zero 3, fractions [0.5, 0.5], one micro-batch per rank) and FSDP2 on a plain Decoder loaded with
ours' initial weights (`fully_shard` per block then the root, fp32, gradients summed as ours are,
the same AdamW groups, LR schedule and clipping). Both see the same token windows; steps alternate
AB/BA so machine noise hits both. Prints per system the median step time (slowest rank), the
throughput, the peak live tensor bytes (profiler.memtrack, from what each keeps between steps), and
every step's loss with the final parameters' largest difference. The default `bench-gpt2` (6 layers,
hidden 384, 13.8 M parameters) is small enough to time on a CPU core and large enough that
communication and memory show.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from executor.launch import free_port  # noqa: E402
from profiler.memtrack import LiveTensorBytes  # noqa: E402
from contracts.specs import ModelSpec, get_model  # noqa: E402

WORLD = 2
MIB = 2**20
TARGET_THROUGHPUT_RATIO = 0.9  # ours / FSDP2, at least
TARGET_PEAK_RATIO = 1.05  # ours / FSDP2, at most
TARGET_LOSS_REL = 1e-5  # max relative loss difference, at most

BENCH_SPECS = {
    "bench-gpt2": ModelSpec("bench-gpt2", "gpt2", 6, 384, 6, 6, 4 * 384, 8192, 128,
                            tied_embeddings=True, linear_bias=True),
}


def resolve_spec(name: str) -> ModelSpec:
    return BENCH_SPECS[name] if name in BENCH_SPECS else get_model(name)


class LocalLiveTensorBytes(LiveTensorBytes):
    """LiveTensorBytes that counts a DTensor by its local tensor (FSDP2's sharded parameters,
    gradients and optimizer state are DTensors; their wrappers have no storage of their own)."""

    def _track(self, t):
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):
            t = t._local_tensor
        super()._track(t)


def batch_for(seed: int, step: int, rank: int, micro_batch: int, seq: int, vocab: int):
    """(tokens, targets), (B, T) each: the same windows for both systems."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * WORLD + rank)
    w = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# ---- the two systems -----------------------------------------------------------------------------


class Ours:
    def __init__(self, spec, rank, optim, seed):
        from models.collectives import ProcessGroupCollectives
        from models.sharded import ShardedRuntime
        self.rt = ShardedRuntime(spec, zero=3, fractions=[1 / WORLD] * WORLD, position=rank,
                                 comm=ProcessGroupCollectives(rank, list(range(WORLD))),
                                 device=torch.device("cpu"), optim=optim, seed=seed)

    def resident(self):
        return self.rt.resident_tensors()

    def step(self, x, y, normalizer, lr) -> float:
        return self.rt.train_step([(x, y)], normalizer, lr).loss

    def full_params(self):
        return self.rt.full_state_dict()


class Fsdp2:
    def __init__(self, spec, initial_state, optim):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from models.decoder import build_model
        model = build_model(spec)
        model.load_state_dict(initial_state)
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not average: the loss is already / global tokens
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
        self.model, self.cfg = model, optim
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

    def step(self, x, y, normalizer, lr) -> float:
        logits = self.model(x)  # (B, T, V)
        V = logits.shape[-1]
        loss = F.cross_entropy(logits.view(-1, V), y.reshape(-1), reduction="sum") / normalizer
        del logits
        loss.backward()
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def full_params(self):
        return {n: p.full_tensor() for n, p in self.model.named_parameters()}


# ---- one rank -----------------------------------------------------------------------------------


def _rank(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    from models.optim import OptimConfig, lr_at
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        spec = resolve_spec(args.model)
        optim = OptimConfig(warmup_steps=args.warmup)
        total = args.warmup + args.steps
        ours = Ours(spec, rank, optim, args.seed)
        fsdp = Fsdp2(spec, ours.full_params(), optim)
        systems = {"ours": ours, "fsdp2": fsdp}
        normalizer = WORLD * args.micro_batch * args.seq  # the global token count
        times = {k: [] for k in systems}
        losses = {k: [] for k in systems}
        peak = {}
        for step in range(1, total + 1):
            x, y = batch_for(args.seed, step, rank, args.micro_batch, args.seq, spec.vocab_size)
            lr = lr_at(step, total, optim)
            order = ["ours", "fsdp2"] if step % 2 == 0 else ["fsdp2", "ours"]
            for name in order:
                system = systems[name]
                dist.barrier()  # both ranks start the system's step together
                if step == args.warmup:  # the last warm-up step: memory (the tracker slows it)
                    with LocalLiveTensorBytes(system.resident()) as mode:
                        loss = system.step(x, y, normalizer, lr)
                    peak[name] = mode.peak_bytes
                    dt = float("nan")
                else:
                    t0 = time.perf_counter()
                    loss = system.step(x, y, normalizer, lr)
                    dt = time.perf_counter() - t0
                if name == "fsdp2":  # its loss is this rank's part; ours' is already global
                    t = torch.tensor(loss, dtype=torch.float64)
                    dist.all_reduce(t)
                    loss = float(t)
                losses[name].append(loss)
                if step > args.warmup:
                    times[name].append(dt)
        a, b = ours.full_params(), fsdp.full_params()
        param_diff = max(float((a[n].detach() - b[n].detach()).abs().max()) for n in a)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"times_s": times, "losses": losses, "peak_bytes": peak, "param_max_abs_diff": param_diff}, f)
    finally:
        dist.destroy_process_group()
    # leave without the interpreter's teardown: torch 2.13's gloo threads can abort in C++ static
    # destructors at exit ("terminate called without an active exception"), as executor.worker notes
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the report ---------------------------------------------------------------------------------


def compare(args: argparse.Namespace) -> dict:
    """Run both systems on WORLD ranks; the figures and verdicts as one dict."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_rank, args=(free_port(), args, d), nprocs=WORLD, start_method="spawn")
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(WORLD)]
    spec = resolve_spec(args.model)
    samples = WORLD * args.micro_batch
    out: dict = {"model": spec.name, "num_params": spec.num_params, "ranks": WORLD, "micro_batch": args.micro_batch,
                 "seq": args.seq, "warmup_steps": args.warmup, "timed_steps": args.steps, "systems": {}}
    for name in ("ours", "fsdp2"):
        step_s = [max(r["times_s"][name][i] for r in ranks) for i in range(args.steps)]  # slowest rank
        med = statistics.median(step_s) if step_s else float("nan")
        out["systems"][name] = {
            "median_step_s": med,
            "samples_per_s": samples / med if step_s else float("nan"),
            "per_rank_median_step_s": [statistics.median(r["times_s"][name]) if step_s else float("nan")
                                       for r in ranks],
            "peak_mib_per_rank": [r["peak_bytes"][name] / MIB for r in ranks],
            "losses": ranks[0]["losses"][name],
        }
    o, f = out["systems"]["ours"], out["systems"]["fsdp2"]
    loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(o["losses"], f["losses"]))
    thr = o["samples_per_s"] / f["samples_per_s"]
    peak = max(a / b for a, b in zip(o["peak_mib_per_rank"], f["peak_mib_per_rank"]))
    out["ratios"] = {"throughput_ours_over_fsdp2": thr, "peak_ours_over_fsdp2": peak, "max_loss_rel_diff": loss_rel,
                     "param_max_abs_diff": max(r["param_max_abs_diff"] for r in ranks)}
    out["pass"] = {"throughput": thr >= TARGET_THROUGHPUT_RATIO, "peak_memory": peak <= TARGET_PEAK_RATIO,
                   "losses": loss_rel <= TARGET_LOSS_REL}
    return out


def print_report(r: dict) -> None:
    print(f"model {r['model']} ({r['num_params'] / 1e6:.1f} M params), {r['ranks']} gloo CPU ranks x 1 thread, "
          f"micro-batch {r['micro_batch']} x seq {r['seq']} per rank, {r['warmup_steps']} warm-up + "
          f"{r['timed_steps']} timed steps, order AB/BA alternating")
    print(f"{'system':<8} {'median step s':>13} {'samples/s':>10} {'peak MiB per rank':>22}")
    for name, s in r["systems"].items():
        peaks = " / ".join(f"{p:.1f}" for p in s["peak_mib_per_rank"])
        print(f"{name:<8} {s['median_step_s']:>13.4f} {s['samples_per_s']:>10.2f} {peaks:>22}")
    print("losses (global, every step):")
    for i, (a, b) in enumerate(zip(r["systems"]["ours"]["losses"], r["systems"]["fsdp2"]["losses"]), 1):
        print(f"  step {i:>2}  ours {a:.8f}  fsdp2 {b:.8f}  rel diff {abs(a - b) / abs(b):.2e}")
    q, p = r["ratios"], r["pass"]
    verdict = {True: "PASS", False: "FAIL"}
    print(f"throughput ours/fsdp2 {q['throughput_ours_over_fsdp2']:.3f} (target >= {TARGET_THROUGHPUT_RATIO}) "
          f"{verdict[p['throughput']]}")
    print(f"peak memory ours/fsdp2 {q['peak_ours_over_fsdp2']:.3f} (target <= {TARGET_PEAK_RATIO}, worst rank) "
          f"{verdict[p['peak_memory']]}")
    print(f"max relative loss difference {q['max_loss_rel_diff']:.2e} (target <= {TARGET_LOSS_REL:g}) "
          f"{verdict[p['losses']]}; final parameters max |diff| {q['param_max_abs_diff']:.2e}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench-gpt2", help=f"{sorted(BENCH_SPECS)} or a planner preset / config.json")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps; the last one measures memory (>= 1)")
    p.add_argument("--steps", type=int, default=16, help="timed steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 0 or args.micro_batch < 1:
        p.error("need --warmup >= 1, --steps >= 0, --micro-batch >= 1")
    if args.seq > resolve_spec(args.model).max_seq:
        p.error(f"--seq {args.seq} exceeds the model's max_seq {resolve_spec(args.model).max_seq}")
    r = compare(args)
    if args.json:
        print(json.dumps(r))
    else:
        print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
