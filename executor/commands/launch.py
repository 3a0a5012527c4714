"""`python -m executor launch --plan P --steps N --run-dir R [--seed K] [--resume | --overwrite] [--checkpoint-every K]
[--keep-checkpoints N] [--stall-timeout S] [--val-every K]
[--data PATH] [--tokenizer TOKENIZER_JSON] [--init-from HF_DIR] [optimizer flags] [--emulate-wan | --emulate-links GBPS]
[--prefill FILE] [--rebalance auto|off]
[--backend local|slurm [--gres-name NAME] [--partition P] [--time-limit MIN] [--type-map T=CATALOG] [--elastic]]`

Runs the plan and returns when the run ends (exit 0: done or stopped, 1: failed; 2: refused before any
rank starts: a bad plan or flag, a run folder holding an earlier run without --resume or --overwrite).
The flags become one RunConfig (contracts/run.py), checked before anything starts and kept as the run
folder's run.json.
`local` (the default): torchrun here; a plan spanning several nodes prints the per-node
torchrun commands instead, or with `--emulate-wan` runs here with each node a datacenter in its
own network namespace behind links shaped to the plan's `wan` (executor/wan.py); `--emulate-links
GBPS` puts every rank in its own namespace behind a link of GBPS each way (executor/links.py), so
communication takes wire time on CPU ranks. `--prefill FILE`:
a JSON object every rank gets as `--prefill` (executor.prefill). `slurm`: the plan as one SLURM job (executor/slurm.py), one
torchrun agent per node, followed until SLURM says it ended; with `--elastic` (and `--checkpoint-every`) a
run that loses a node goes on on the nodes left from its last checkpoint (executor/elastic.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

HELP = "run a plan for real with torchrun (uneven batches and shards); blocks until it ends"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from contracts.run import VAL_EVERY

    p.add_argument("--plan", required=True, help="plan file (python -m planner plan --out P)")
    p.add_argument("--steps", type=int, required=True, help="global steps to train")
    p.add_argument("--run-dir", required=True, help="run folder: plan.json, logs/, metrics.sqlite, checkpoints/")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's last checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="checkpoint every K steps (0: only the final one; a finished run always keeps it)")
    p.add_argument("--keep-checkpoints", type=int, default=0, metavar="N",
                   help="keep the newest N checkpoints, removing an older one only once a newer one is whole "
                        "(default 0: keep every one)")
    p.add_argument("--overwrite", action="store_true",
                   help="the run folder holds an earlier run: remove its checkpoints, logs and metrics first "
                        "(without it or --resume such a folder is refused)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="fail the run, naming the rank, when no step completes for S seconds (default: derived "
                        "from the plan's predicted step time)")
    p.add_argument("--val-every", type=int, default=VAL_EVERY, metavar="K",
                   help=f"the validation loss every K steps and at the last step (0: at the last only; default "
                        f"{VAL_EVERY})")
    p.add_argument("--data", "--corpus", dest="corpus", default=None, metavar="PATH",
                   help="training data: a folder of text files, a JSON Lines file with a 'text' field, or "
                        "pre-tokenized token files (default: the Python standard library's sources)")
    p.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON",
                   help="a Hugging Face tokenizer.json (default: bytes, vocabulary 256)")
    p.add_argument("--init-from", default=None, metavar="HF_DIR",
                   help="start from a local Hugging Face model folder (safetensors); each rank reads its slices")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear LR warmup steps (default: 5%% of --steps, at most 2000)")
    p.add_argument("--min-lr-ratio", type=float, default=None,
                   help="the cosine decay ends at lr x this at the last step (default 0.1)")
    p.add_argument("--decay-steps", type=int, default=None,
                   help="the step the cosine ends at (default: --steps; set it when a run is resumed to go on)")
    p.add_argument("--weight-decay", type=float, default=None, help="AdamW decay on matrices only (default 0.1)")
    p.add_argument("--max-grad-norm", default=None, metavar="N|none",
                   help="clip gradients by their global norm (default 1.0; 'none': no clipping)")
    p.add_argument("--emulate-wan", action="store_true",
                   help="run every node of the plan here, each a datacenter in its own network namespace, the "
                        "links between them shaped with tc to the plan's wan (needs root, ip, tc, nsenter)")
    p.add_argument("--emulate-links", type=float, default=None, metavar="GBPS",
                   help="run every rank in its own network namespace, joined through a bridge by links shaped "
                        "with tc to GBPS Gbit/s each way (CPU ranks on this machine; needs root, ip, tc, nsenter)")
    p.add_argument("--prefill", default=None, metavar="FILE",
                   help="a JSON object passed to every rank as --prefill (prefill work in pipeline bubbles)")
    p.add_argument("--rebalance", choices=("auto", "off"), default=None,
                   help="auto: re-split the batch at a step boundary when a rank's measured rate departs from its "
                        "profile (no restart; same samples, same losses); off: keep the plan's split (default: the "
                        "plan's 'rebalance' field, itself auto)")
    p.add_argument("--json", action="store_true", help="print the final metrics as one JSON object")
    add_backend_arguments(p)
    p.add_argument("--elastic", action="store_true", default=None,
                   help="slurm: a run that loses a node goes on on the nodes left, re-split, from its last "
                        "checkpoint (needs --checkpoint-every; executor/elastic.py)")


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """--backend and the SLURM settings (also taken by `executor orchestrate`)."""
    from contracts.cli import int_arg

    p.add_argument("--backend", choices=("local", "slurm"), default="local",
                   help="local: torchrun on this machine (default); slurm: one SLURM job (sbatch/srun)")
    p.add_argument("--gres-name", default=None, metavar="NAME",
                   help="slurm: the site's GRES name of its accelerators (default $GPUMIX_SLURM_GRES, else gpu)")
    p.add_argument("--partition", default=None, help="slurm: the partition to submit to (default: SLURM's)")
    p.add_argument("--time-limit", type=int_arg(1, 10**7), default=None, metavar="MIN",
                   help="slurm: the job's time limit in minutes (default: the partition's)")
    p.add_argument("--rdzv-port", type=int_arg(1024, 55535), default=None, metavar="PORT",
                   help="slurm: the base of the c10d rendezvous port on the first node (default 29500)")
    p.add_argument("--type-map", action="append", default=None, metavar="GRES_TYPE=CATALOG_TYPE",
                   help="slurm: a GRES type that names no single catalog type, e.g. a100=A100-80GB")


def slurm_settings(args: argparse.Namespace):
    """The SlurmSettings of the flags (ValueError naming a bad one)."""
    from executor.slurm_job import SlurmSettings
    from profiler.slurm_inventory import parse_type_map

    kw = {"gres_name": args.gres_name, "partition": args.partition, "time_limit_min": args.time_limit,
          "rdzv_port_base": args.rdzv_port, "elastic": getattr(args, "elastic", None),
          "type_map": tuple(sorted(parse_type_map(args.type_map).items())) or None}
    return SlurmSettings(**{k: v for k, v in kw.items() if v is not None})


def tokenize_with_progress(data: str | None, tokenizer: str | None, model: str) -> None:
    """Tokenize (or find cached) the run's data, with a progress bar on stderr."""
    import sys

    from executor.corpus import build_corpus
    from contracts.specs import get_model

    def bar(fraction: float, message: str) -> None:
        done = int(30 * min(max(fraction, 0.0), 1.0))
        sys.stderr.write(f"\rtokenizing [{'#' * done}{'.' * (30 - done)}] {100 * fraction:5.1f} % {message[:40]:40s}")
        sys.stderr.flush()

    build_corpus(data, tokenizer, progress=bar, vocab_size=get_model(model).vocab_size)
    sys.stderr.write("\n")


def optim_from_args(args: argparse.Namespace):
    """An OptimConfig from the flags (ValueError naming a bad value), or None for the defaults."""
    given = {k: getattr(args, k) for k in ("lr", "warmup_steps", "min_lr_ratio", "decay_steps", "weight_decay",
                                                "max_grad_norm")
             if getattr(args, k) is not None}
    if not given:
        return None
    from executor.rank_commands import default_optim
    from models.optim import OptimConfig

    if "max_grad_norm" in given:
        v = str(given["max_grad_norm"]).strip().lower()
        try:
            given["max_grad_norm"] = None if v == "none" else float(v)
        except ValueError:
            raise ValueError(f"--max-grad-norm must be a number or 'none', got {given['max_grad_norm']!r}") from None
    base = default_optim(args.steps).to_dict()
    base.update(given)
    return OptimConfig.from_dict(base)


def read_prefill(path: str | None) -> dict | None:
    """The --prefill file's JSON object (ValueError naming the file when it is not one)."""
    if path is None:
        return None
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            d = json.load(fh)
    except OSError as e:
        raise ValueError(f"--prefill {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--prefill {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(d, dict):
        raise ValueError(f"--prefill {path}: must hold a JSON object, not a {type(d).__name__}")
    return d


def run_config_of(args: argparse.Namespace):
    """The RunConfig of the flags (ValueError naming a bad value), before the plan is read."""
    from contracts.run import RunConfig

    config = RunConfig(steps=args.steps, run_dir=args.run_dir, seed=args.seed, resume=args.resume,
                       checkpoint_every=args.checkpoint_every, corpus_dir=args.corpus, tokenizer=args.tokenizer,
                       init_from=args.init_from, emulate_wan=args.emulate_wan,
                       emulate_links_gbps=args.emulate_links, keep_checkpoints=args.keep_checkpoints,
                       overwrite=args.overwrite, stall_timeout_s=args.stall_timeout, val_every=args.val_every)  # the numbers first: optim uses steps
    optim = optim_from_args(args)
    return replace(config, optim=None if optim is None else optim.to_dict(), prefill=read_prefill(args.prefill))


def run(args: argparse.Namespace) -> int:
    from contracts.cli import print_json
    from contracts.plan import Plan
    from executor.checks import check_store_safe
    from executor.launch import backend_for, node_command_lines, runs_here

    config = run_config_of(args)  # on every path, multi-node included
    if args.emulate_links is not None and args.backend != "local":
        raise ValueError(f"--emulate-links runs every rank on this machine; not with --backend {args.backend}")
    if args.elastic and args.backend != "slurm":
        raise ValueError("--elastic goes on after a lost node on the nodes SLURM still has: use it with "
                         "--backend slurm")
    plan = Plan.load(args.plan)
    if args.rebalance is not None:
        plan = replace(plan, rebalance=args.rebalance)
    backend = backend_for(args.backend, slurm_settings(args) if args.backend == "slurm" else None)
    if args.backend == "local" and not runs_here(plan) and not args.emulate_wan:
        run_dir = os.path.abspath(args.run_dir)
        check_store_safe(plan, run_dir)  # every node's ranks write the store
        os.makedirs(run_dir, exist_ok=True)
        plan_path = os.path.join(run_dir, "plan.json")
        plan.save(plan_path)
        lines = node_command_lines(plan_path, plan, replace(config, run_dir=run_dir))
        if args.json:
            print_json({"status": "not started", "multinode_commands": lines})
        else:
            print(f"# plan spans {len(lines)} nodes: run one line on each node (first node = rendezvous host)")
            print("\n".join(lines))
        return 0
    backend.check(plan, config)  # before the tokenizing: a refused launch says so at once
    if args.corpus or args.tokenizer:
        tokenize_with_progress(args.corpus, args.tokenizer, plan.model)  # once; the launch then hits the cache
    from executor.db import DiskFull

    try:
        status = backend.launch(plan, config)
    except DiskFull as e:  # the run ended (ranks stopped, booking released) without room to record it
        print(f"run {os.path.abspath(config.run_dir)}: failed ({e})", file=sys.stderr)
        return 1
    return _report(args, status)


def _report(args: argparse.Namespace, status: str) -> int:
    from executor.store import read_metrics
    from contracts.cli import print_json

    m = read_metrics(args.run_dir)
    if args.json:
        print_json(m)
    else:
        last = m["steps"][-1] if m["steps"] else None
        print(f"run {m['run_dir']}: {status}" + (f" ({m['reason']})" if m["reason"] else ""))
        if last:
            print(f"steps {last['step']}/{m['steps_target']}  loss {last['loss']:.4f}  "
                  f"median step {m['median_step_s']:.3f} s (measured)  "
                  f"predicted iteration {m['predicted_iteration_s']:.3f} s")
    return 0 if status in ("done", "stopped") else 1
