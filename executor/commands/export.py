"""`python -m executor export --run-dir R --out DIR [--step K] [--tokenizer T] [--json]`: a run's
checkpoint as a Hugging Face model folder (safetensors, config.json, tokenizer) that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads with no conversion script."""
from __future__ import annotations

import argparse

HELP = "write a run's checkpoint as a Hugging Face model folder (safetensors, config.json, tokenizer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the run folder (plan.json, checkpoints/)")
    p.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face folder to write")
    p.add_argument("--step", type=int, default=None, metavar="K", help="the checkpoint of step K (default: newest)")
    p.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                   help="tokenizer.json to ship (default: the run's, recorded at launch)")
    p.add_argument("--max-shard-gb", type=float, default=None,
                   help="split the weights into files of at most this many GB, with an index (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON object: out, files, step")


def run(args: argparse.Namespace) -> int:
    import os

    from executor import checkpoint as ckpt
    from executor.hf_io import DEFAULT_MAX_SHARD_BYTES, export_run
    from contracts.cli import print_json

    if args.max_shard_gb is not None and args.max_shard_gb <= 0:
        raise ValueError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    max_shard = DEFAULT_MAX_SHARD_BYTES if args.max_shard_gb is None else int(args.max_shard_gb * 1e9)
    out = export_run(args.run_dir, args.out, step=args.step, tokenizer=args.tokenizer, max_shard_bytes=max_shard)
    files = sorted(os.listdir(out))
    step = args.step if args.step is not None else (ckpt.latest(args.run_dir) or {}).get("step")
    if args.json:
        print_json({"out": out, "files": files, "step": step})
    else:
        print(f"exported step {step} of {args.run_dir} to {out}: {', '.join(files)}")
    return 0
