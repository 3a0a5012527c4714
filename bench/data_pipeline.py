"""The data pipeline against what training consumes: tokenization (once, cached) and the loader.

    python bench/data_pipeline.py [--mib 8] [--repeats 3] [--procs N] [--json]

Input: the first `--mib` MiB of the Python standard library's sources; tokenizers: byte-level and
a GPT-2 style BPE (vocabulary 8192) trained here on 1 MiB of the same text. Measured (medians of
`--repeats`, fresh cache folders): executor.corpus.build_corpus end to end in tokens/s on 1 and N
processes and a cache hit's seconds; the loader as executor.worker reads a step (the whole global
batch in one process: the worst case). Demand beside it: a measured `tiny` step on this CPU, and
`gpt2` on one and on eight H100s, predicted as peak bf16 × MFU / (6N + 12Lhs FLOPs per token).
Ratio = supply / demand: tokenizing runs once per corpus; the loader runs every step, so its ratio
must stay well above 1.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers is imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from executor.corpus import Corpus, GlobalSampler, batch_slices, build_corpus, default_corpus_dir, windows  # noqa: E402
from contracts.catalog import get_gpu_type  # noqa: E402
from contracts.specs import get_model  # noqa: E402

MIB = 2**20


def _train_tokenizer(path: str, vocab_size: int = 8192) -> None:
    """GPT-2 style byte-level BPE trained on the first MiB of the stdlib sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    root = default_corpus_dir()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and size < MIB:
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
            size += len(texts[-1])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)


def bench_tokenize(tmp: str, tokenizer: str | None, procs: int, mib: int, repeats: int) -> dict:
    times, cpus, path = [], [], ""
    for r in range(repeats):
        cache = os.path.join(tmp, f"cache-{os.path.basename(tokenizer or 'bytes')}-{procs}-{r}")
        c0, t0 = _cpu_s(), time.perf_counter()
        path = build_corpus(None, tokenizer, max_bytes=mib * MIB, cache_dir=cache, num_workers=procs)
        times.append(time.perf_counter() - t0)
        cpus.append(_cpu_s() - c0)
    c = Corpus.load(path)
    tokens = c.train.size + c.val.size
    t0 = time.perf_counter()
    build_corpus(None, tokenizer, max_bytes=mib * MIB, cache_dir=cache, num_workers=procs)
    hit_s = time.perf_counter() - t0
    s = statistics.median(times)
    return {"tokens": int(tokens), "build_s": s, "cpu_s": statistics.median(cpus), "tokens_per_s": tokens / s,
            "cache_hit_s": hit_s, "path": path}


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the tokenizer workers): with N
    processes, cpu_s / build_s near N means N cores were really had; near 1, they were busy."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def bench_loader(path: str, seq: int, global_batch: int, micro_batch: int, steps: int) -> dict:
    """The worker's read of a step (executor.worker.Worker.train_step / _tensors), whole global batch."""
    import torch

    c = Corpus.load(path)
    sampler = GlobalSampler(int(c.train.size), seq, global_batch, seed=0)
    slices = batch_slices([global_batch], 0, micro_batch)
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        starts = sampler.starts(step)
        for sl in slices:
            x, y = windows(c.train, starts[sl], seq)
            torch.from_numpy(x), torch.from_numpy(y)
        times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    return {"seq": seq, "global_batch": global_batch, "step_read_s": s,
            "windows_per_s": global_batch / s, "tokens_per_s": global_batch * seq / s}


def measured_cpu_demand(seq: int = 128, micro_batch: int = 8, steps: int = 6) -> dict:
    """Tokens/s of a real `tiny` training step on this CPU (fwd + bwd + AdamW)."""
    import torch

    from models.decoder import build_model
    from models.runtime import micro_batch_loss

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core, as the executor's CPU ranks run; steadier on shared cores
    spec = get_model("tiny")
    model = build_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, spec.vocab_size, (micro_batch, seq))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        micro_batch_loss(model, x, x, micro_batch * seq).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    s = statistics.median(times[1:])
    return {"what": f"tiny on this CPU, measured ({micro_batch} x {seq} tokens in {s * 1e3:.0f} ms)",
            "seq": seq, "global_batch": micro_batch, "tokens_per_s": micro_batch * seq / s}


def predicted_gpu_demand(model: str, gpu: str, mfu: float, seq: int, num_gpus: int) -> dict:
    spec, g = get_model(model), get_gpu_type(gpu)
    flops_per_token = 6 * spec.num_params + 12 * spec.num_layers * spec.hidden * seq
    rate = num_gpus * g.bf16_tflops * 1e12 * mfu / flops_per_token
    return {"what": f"{model} on {num_gpus} x {gpu}, predicted (MFU {mfu:.0%}, seq {seq})", "seq": seq,
            "tokens_per_s": rate}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=8, help="MiB of stdlib sources to tokenize")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--procs", type=int, default=os.cpu_count() or 2, help="N for the parallel tokenization")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--loader-steps", type=int, default=40)
    p.add_argument("--gpu", default="H100-SXM")
    p.add_argument("--mfu", type=float, default=0.5, help="model FLOPs utilization of the GPU demand rows")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tok = os.path.join(tmp, "tokenizer.json")
        t0 = time.perf_counter()
        _train_tokenizer(tok)
        train_tok_s = time.perf_counter() - t0
        tokenize = {
            "byte-level, 1 process": bench_tokenize(tmp, None, 1, args.mib, args.repeats),
            "BPE 8192, 1 process": bench_tokenize(tmp, tok, 1, args.mib, args.repeats),
            f"BPE 8192, {args.procs} processes": bench_tokenize(tmp, tok, args.procs, args.mib, args.repeats),
        }
        bpe = tokenize["BPE 8192, 1 process"]["path"]
        cpu = measured_cpu_demand()
        demand = [cpu, predicted_gpu_demand("gpt2", args.gpu, args.mfu, 1024, 1),
                  predicted_gpu_demand("gpt2", args.gpu, args.mfu, 1024, 8)]
        loaders = {d["what"]: bench_loader(bpe, d["seq"], d.get("global_batch", args.global_batch),
                                           min(args.micro_batch, d.get("global_batch", args.global_batch)),
                                           args.loader_steps) for d in demand}
    gpu1 = demand[1]["tokens_per_s"]
    result = {
        "mib": args.mib, "procs": args.procs, "tokenizer_train_s": train_tok_s,
        "tokenize": {k: {kk: vv for kk, vv in v.items() if kk != "path"} | {"ratio_to_1_gpu": v["tokens_per_s"] / gpu1}
                     for k, v in tokenize.items()},
        "parallel_speedup": (tokenize[f"BPE 8192, {args.procs} processes"]["tokens_per_s"]
                             / tokenize["BPE 8192, 1 process"]["tokens_per_s"]),
        "loader": [dict(loaders[d["what"]], demand=d["what"], demand_tokens_per_s=d["tokens_per_s"],
                        ratio=loaders[d["what"]]["tokens_per_s"] / d["tokens_per_s"]) for d in demand],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"input: {args.mib} MiB of stdlib .py sources; BPE tokenizer trained here in {train_tok_s:.1f} s; "
          f"medians of {args.repeats}")
    print(f"\n{'tokenization (once per corpus, then cached)':44} {'tokens':>10} {'build s':>8} "
          f"{'cpu s':>6} {'tokens/s':>10} {'hit s':>7} {'vs 1 GPU':>9}")
    for k, v in result["tokenize"].items():
        print(f"{k:44} {v['tokens']:>10,} {v['build_s']:>8.2f} {v['cpu_s']:>6.2f} {v['tokens_per_s']:>10.3g} "
              f"{v['cache_hit_s']:>7.3f} {v['ratio_to_1_gpu']:>8.2f}x")
    print(f"parallel speedup ({args.procs} processes / 1): {result['parallel_speedup']:.2f}x; "
          f"'vs 1 GPU' = tokens/s over {demand[1]['what']} = {gpu1:.3g} tokens/s")
    print(f"\n{'loader (every step, whole global batch, 1 process)':52} {'demand tokens/s':>15} "
          f"{'loader tokens/s':>15} {'windows/s':>10} {'ratio':>8}")
    for r in result["loader"]:
        print(f"{r['demand']:52} {r['demand_tokens_per_s']:>15.3g} {r['tokens_per_s']:>15.3g} "
              f"{r['windows_per_s']:>10.3g} {r['ratio']:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
