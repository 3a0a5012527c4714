"""The training worker: one process per used device, started by torchrun.

    python -m torch.distributed.run --nproc_per_node=R -m executor.worker --plan P --steps N \
        --run-dir D --tokens T.npy [--seed K] [--resume] [--checkpoint-every K] [--keep-checkpoints N]

Rank r trains the plan's r-th used assignment (on several nodes: the LOCAL_RANK-th used device of
the node named by GPUMIX_NODE). One step: the global sampler gives the step's windows, the same for
any plan, and this rank takes its consecutive piece in `accum_steps` micro-batches; the sharded
runtime (models/sharded.py) trains them at the plan's ZeRO stage and uneven shards. A pipeline plan
runs models/pipeline.py instead (the rank's stage and rows; `--timeline-step`, `--prefill` with
executor/prefill.py). A tensor-parallel plan (tp > 1) runs models/tensor_runtime.py, or the pipeline
with its TP groups: every TP group is one data-parallel position whose t ranks take its rows
(docs/executor.md "Tensor-parallel plans"). Rank 0 gathers every rank's figures and peak memory each
step into the store, with the runtime's `comm_wait_s` and, on emulated links (executor/links.py), the
TCP payload the rank sent on its link during the step, and (a data-parallel plan) each rank's predicted
compute and wait beside them; rank 0 names a straggler (executor/straggler.py) and, with the plan's
`rebalance` auto, decides a new batch split from the measured rates, which every rank applies at the
next step (executor/rebalance.py). The last step is always checkpointed (executor/checkpoint.py).
Emulated devices run inside the cgroups the launcher made (profiler/cgroups.py), or sleep (`slowdown`)
and check the measured peak against `memory_gb`. A DiLoCo plan (`diloco`) runs models/diloco.py: each
group of nodes trains on its own process group, normalising its loss by its own tokens, with an
outer step every H inner steps (a `diloco_sync` event each) and one at the last step, so every group
ends with the same parameters; the step's loss is the groups' token-weighted mean. With a pipeline,
each group runs a whole pipeline and the outer step is exchanged per stage. It writes no
checkpoint (the format holds one layout, not the outer state). More: docs/executor.md,
docs/models/diloco.md, docs/models/pipeline_simulation.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from profiler import cgroups
from executor import checkpoint as ckpt
from executor.checks import check_diloco, check_tensor_parallel
from contracts.run import VAL_EVERY
from executor.links import ENV_LINK_IF, LinkCounter
from executor.corpus import NUM_VAL_WINDOWS, Corpus, build_corpus, GlobalSampler, batch_slices, val_starts, windows
from profiler.memtrack import PeakMemory
from executor.stall import collective_timeout
from executor.store import MetricsStore, RankStep
from models.collectives import ProcessGroupCollectives
from models.diloco import DilocoRuntime
from models.optim import OptimConfig, lr_at
from models.pipeline import PipelineRuntime, build_pipeline_groups
from models.tensor_runtime import TensorParallelRuntime, build_groups
from models.runtime import use_tf32_as_priced
from models.sharded import ShardedRuntime
from contracts.attention import select_kernel
from contracts.catalog import GIB
from contracts.plan import Assignment, Plan
from contracts.specs import get_model, with_max_seq

log = logging.getLogger("executor.worker")

ENV_NODE = "GPUMIX_NODE"  # multi-node runs: which plan node this torchrun agent is
ENV_LAUNCHED = "GPUMIX_LAUNCHED"  # set by executor.launch; without it (multi-node) rank 0 keeps the run row
# what each rank sends rank 0 every step (Trainer.gather_figures)
FIGURES = ("compute_s", "emulated_delay_s", "optimizer_s", "wait_s", "peak_memory_bytes", "loss", "step_s", "val_loss",
           "comm_wait_s", "link_tx_bytes")
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class EmulatedOutOfMemory(RuntimeError):
    pass


def relays() -> bool:
    """A multi-node run (every agent names its node): only rank 0's process writes the store; the
    other ranks' one-time rows reach it through torch.distributed (Trainer.relay)."""
    return bool(os.environ.get(ENV_NODE))


class RelayedStore:
    """The store of a rank that does not write it (a multi-node run's ranks but rank 0): its
    ranks row and events wait here until rank 0 gathers them (Trainer.relay). An event of a
    rank that dies before the next gather is lost: the launcher's failure path names the rank."""

    def __init__(self) -> None:
        self.row: dict | None = None
        self.events: list[tuple[float, int | None, str, str]] = []

    def register_rank(self, rank: int, position: int, a: Assignment, pid: int, shard_numel: int,
                      memory_method: str) -> None:
        self.row = {"rank": rank, "position": position, "pid": pid, "shard_numel": shard_numel,
                    "started_s": time.time(), "memory_method": memory_method}

    def add_event(self, kind: str, message: str, rank: int | None = None) -> None:
        self.events.append((time.time(), rank, kind, message))

    def take(self) -> dict:
        out = {"row": self.row, "events": self.events}
        self.row, self.events = None, []
        return out

    def finish(self, *args, **kwargs) -> None:  # rank 0 or the launcher records the end
        pass

    def close(self) -> None:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="executor.worker")
    p.add_argument("--plan", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--tokens", help="the corpus token array (.npy), built by the launcher")
    p.add_argument("--corpus", help="training data (multi-node runs: each node builds its own token cache)")
    p.add_argument("--tokenizer", help="tokenizer.json for --corpus (default: bytes)")
    p.add_argument("--init-from", help="a Hugging Face model folder: each rank reads its own slices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also a checkpoint every K steps (the last: always)")
    p.add_argument("--keep-checkpoints", type=int, default=0, help="keep the newest N checkpoints (0: every one)")
    p.add_argument("--val-every", type=int, default=VAL_EVERY, help="validation loss every K steps (and at the last)")
    p.add_argument("--optim", default=None, help="OptimConfig as JSON (models/optim.py); default: its defaults")
    p.add_argument("--measure-memory-every", type=int, default=0,
                   help="measure peak memory every K steps (0: the first step of the process only)")
    p.add_argument("--prefill", default=None,
                   help="pipeline plans: a JSON object for executor.prefill.PrefillWorker, run while a rank waits")
    p.add_argument("--timeline-step", type=int, default=None,
                   help="pipeline plans: the step whose timeline rank 0 writes to timeline.json (default: the last)")
    return p.parse_args(argv)


def _redirect_output(run_dir: str, rank: int) -> None:
    """Everything this rank prints (Python and C++) goes to logs/rank<r>.log."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    fd = os.open(os.path.join(run_dir, "logs", f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s",
                        stream=sys.stderr, force=True)


def _exit_when_orphaned() -> None:
    """torchrun starts every worker in its own session, so killing torchrun's group does not
    reach us: if our parent (the torchrun agent) goes away, leave instead of hanging in a
    collective forever."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(70)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


def my_position(plan: Plan, rank: int) -> int:
    node = os.environ.get(ENV_NODE)
    if not node:
        return rank
    local = int(os.environ.get("LOCAL_RANK", "0"))
    on_node = [i for i, a in enumerate(plan.used) if a.node == node]
    if local >= len(on_node):
        raise ValueError(f"node {node!r} has {len(on_node)} used devices, no local rank {local}")
    return on_node[local]


def runtime_precision(plan: Plan) -> dict[str, object]:
    """ShardedRuntime's keywords of the plan's `param_dtype`, `reduce_dtype` (as torch dtypes),
    `prefetch` and `reduce_in_flight` (0 for a plan object without it) (contracts/plan.py checks
    their values and combinations)."""
    return {"param_dtype": TORCH_DTYPES[plan.param_dtype], "reduce_dtype": TORCH_DTYPES[plan.reduce_dtype],
            "prefetch": int(plan.prefetch), "reduce_in_flight": int(getattr(plan, "reduce_in_flight", 0))}


DILOCO_NO_CHECKPOINT = ("no final checkpoint: a DiLoCo run writes none yet (the checkpoint format holds one "
                        "layout of the state, not each group's slices nor the outer state: synced parameters "
                        "and outer momentum)")




def _is_emulated(a: Assignment) -> bool:
    return a.emulated or a.slowdown != 1.0 or a.memory_gb is not None


class Trainer:
    def __init__(self, args: argparse.Namespace, plan: Plan, rank: int, world: int, store: MetricsStore):
        self.args, self.plan, self.rank, self.store = args, plan, rank, store
        used = plan.used
        if len(used) != world:
            raise ValueError(f"plan has {len(used)} used devices but torchrun started {world} ranks")
        my_type = used[my_position(plan, rank)].type
        self.cuda = my_type != "cpu"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.cuda and local_rank >= torch.cuda.device_count():
            # never pretend: a plan for GPUs does not silently train on this CPU
            raise ValueError(f"plan device {my_type!r} needs CUDA device {local_rank}, this machine has "
                             f"{torch.cuda.device_count()}; plan for the 'cpu' type to run on CPU workers")
        self.autocast, loss_scaling = None, False
        if self.cuda:
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            use_tf32_as_priced()
            if plan.dtype == "bf16" and not torch.cuda.is_bf16_supported():
                # never train silently in another precision than the plan says
                raise ValueError(f"plan dtype bf16 but {torch.cuda.get_device_name(self.device)} has no bf16: "
                                 "re-plan (the planner picks fp16 with loss scaling for such GPUs)")
            self.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.dtype)
            loss_scaling = plan.dtype == "fp16"  # dynamic loss scaling keeps fp16 gradients finite
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)  # one core per rank: ranks must not fight over threads
        dist.init_process_group("nccl" if self.cuda else "gloo", timeout=collective_timeout(plan, args.run_dir))
        self.position = my_position(plan, rank)
        owners: list[int] = [0] * world
        dist.all_gather_object(owners, self.position)
        if sorted(owners) != list(range(world)):
            raise ValueError(f"ranks claim plan positions {owners}: each used device must be taken once")
        self.owner = {pos: r for r, pos in enumerate(owners)}  # plan position -> rank
        self.position_of = dict(enumerate(owners))  # rank -> plan position
        self.a = used[self.position]
        self.batches = [u.batch for u in used]
        # tensor parallel: a TP group of `tp` ranks is one data-parallel position (set by _build_tensor_parallel)
        self.tp, self.dp_position = plan.tp_degree, self.position
        check_tensor_parallel(plan, init_from=args.init_from, resume=args.resume,
                              checkpoint_every=args.checkpoint_every)  # a multi-node run has no launcher's door

        spec = with_max_seq(get_model(plan.model), plan.seq)
        self.optim = OptimConfig.from_dict(json.loads(args.optim)) if args.optim else OptimConfig()
        comm = ProcessGroupCollectives(self.position, [self.owner[p] for p in range(world)])
        kernel = select_kernel(my_type if self.cuda else "cpu", plan.dtype if self.cuda else "fp32",
                               spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.pipe = plan.pipeline
        self.diloco = plan.diloco
        self.global_tokens = plan.global_batch * plan.seq
        self.step_tokens = self.global_tokens  # the loss normaliser of a step (DiLoCo: the group's tokens)
        self.row_offset = 0  # DiLoCo over pipelines: where this group's rows start in every micro-batch
        if self.diloco is not None:
            check_diloco(plan, resume=args.resume, checkpoint_every=args.checkpoint_every)
            if self.pipe is not None:
                self._build_diloco_pipeline(args, spec, kernel.expand_kv, loss_scaling)
            else:
                self._build_diloco(args, spec, kernel.expand_kv, loss_scaling, comm)
        elif self.pipe is not None:
            self._build_pipeline(args, spec, kernel.expand_kv, loss_scaling)
        elif self.tp > 1:
            self._build_tensor_parallel(args, spec, kernel.expand_kv, loss_scaling)
        else:
            self._build_sharded(args, spec, kernel.expand_kv, loss_scaling, comm)
        if args.init_from and not args.resume:  # each rank reads only its slices (a pipeline's replica too)
            from executor.hf_io import HFWeights

            self.runtime.load_parameters(HFWeights(args.init_from, spec).read)
        shard = self.runtime.shard_numel()

        corpus = Corpus.load(args.tokens or build_corpus(args.corpus, args.tokenizer, vocab_size=spec.vocab_size))
        self.train_tokens, self.val_tokens = corpus.train, corpus.val
        self.sampler = GlobalSampler(int(self.train_tokens.size), plan.seq, plan.global_batch, args.seed)
        if self.pipe is None:
            self.slices = batch_slices(self.batches, self.dp_position, self.a.micro_batch) if self.a.batch else []
        else:  # micro-batch k = windows [k·mb, (k+1)·mb) of the step; this rank takes its rows of each
            off, mb = self.row_offset + self.pipe_rt.my_rows[0], self.pipe.micro_batch
            self.slices = [slice(k * mb + off, k * mb + off + self.a.micro_batch)
                           for k in range(self.pipe.num_microbatches)]
        self.memory_limit_bytes = int(self.a.memory_gb * GIB) if self.a.memory_gb is not None else None
        self.standalone = os.environ.get(ENV_LAUNCHED) != "1"
        if self.standalone and rank == 0:  # no launcher on this node: rank 0 writes the run row
            store.init_run(plan, args.steps, args.seed, backend="nccl" if self.cuda else "gloo", resume=True,
                           prefill_ranks=False)
        store.register_rank(rank, self.position, self.a, os.getpid(), shard,
                            PeakMemory(self.device).method)
        self.relay()  # a multi-node run: every rank's row written by rank 0 before the first step
        where = "" if self.pipe is None else f", pipeline stage {self.pipe_rt.stage} dp {self.pipe_rt.dp_index}"
        if self.tp > 1:
            where += f", tp {self.runtime.tp.rank} of {self.tp} (data-parallel position {self.dp_position})"
        log.info("rank %d = plan device %d (%s, micro_batch %d x %d, zero %d, %d of %d parameters%s)%s", rank,
                 self.a.device_index, self.a.type, self.a.micro_batch, self.a.accum_steps, plan.zero, shard,
                 spec.num_params, where, " EMULATED" if _is_emulated(self.a) else "")
        self.prefill = self._build_prefill(args) if args.prefill else None
        self.link = LinkCounter(os.environ.get(ENV_LINK_IF))  # emulated links: what this rank sends per step
        # live rebalancing (executor/rebalance.py): data-parallel plans of two ranks or more
        self.rebalance = (plan.rebalance == "auto" and self.pipe is None and world > 1 and self.tp == 1
                          and self.diloco is None)
        if plan.rebalance == "auto" and self.tp > 1 and rank == 0:
            log.info("no live rebalancing: a tensor-parallel plan's split is per TP group, which the rebalancer "
                     "(one rank per position) does not move")
        self.monitor = self._build_monitor(world) if rank == 0 else None

    def _build_monitor(self, world: int):
        """Rank 0's SplitMonitor (predictions, straggler, rebalancing) of a data-parallel plan; None
        for a pipeline plan or one rank, or when the plan's cost model cannot be built (said in an
        event: the run goes on without them)."""
        if self.pipe is not None or world < 2 or self.tp > 1 or self.diloco is not None:
            return None  # TP: its cost model prices one rank per position; DiLoCo: one copy of the state
        from executor.rebalance import SplitMonitor

        try:
            return SplitMonitor(self.plan, self.args.run_dir, self.store, self.owner, auto=self.rebalance,
                                last_step=self.args.steps)
        except (ValueError, KeyError, OSError) as e:
            self.store.add_event("note", f"no straggler detection or rebalancing: the plan's cost model: {e}", 0)
            if self.rebalance:
                raise ValueError(f"--rebalance auto needs the plan's cost model ({e}); launch with --rebalance off")
            return None

    def apply_split(self, pieces: list[tuple[int, int]]) -> None:
        """Train the next steps on a new split (every rank the same, at the same step): each position's
        (micro_batch, accum_steps); the shards, the global batch and the sample order stay."""
        self.batches = [m * n for m, n in pieces]
        m, n = pieces[self.position]
        self.a = replace(self.a, micro_batch=m, accum_steps=n, batch=m * n)
        self.slices = batch_slices(self.batches, self.position, m) if self.a.batch else []
        if self.pipe is None:  # the runtime sends the embedding's gradient as rows by this split
            self.runtime.set_batch_split(self.batches, self.plan.seq)

    def agree_split(self, step: int, figures: list[dict[str, float | None]], observe: bool = True) -> None:
        """Rank 0 decides (SplitMonitor.observe; not on a step that measured memory, slowed by the
        tracker) and broadcasts whether, and to what, the split changes from the next step; every rank
        applies the same split at the same step boundary."""
        world = len(self.plan.used)
        t = torch.zeros(1 + 2 * world, dtype=torch.int64, device=self.device)
        if self.rank == 0 and self.monitor is not None and observe:
            decision = self.monitor.observe(step, self._computes(figures), figures[self.owner[0]]["step_s"])
            if decision is not None:
                t[0] = 1
                t[1:] = torch.tensor([v for p in decision.pieces for v in p], dtype=torch.int64)
        dist.broadcast(t, src=0)
        if int(t[0]):
            flat = t[1:].tolist()
            self.apply_split([(flat[2 * p], flat[2 * p + 1]) for p in range(world)])
            log.info("step %d: new split from step %d: batches %s", step, step + 1, self.batches)

    def _computes(self, figures: list[dict[str, float | None]]) -> list[float | None]:
        """Each position's measured compute of the step: the runtime's compute plus any emulated sleep."""
        out = []
        for p in range(len(self.plan.used)):
            f = figures[self.owner[p]]
            out.append(None if f["compute_s"] is None else f["compute_s"] + (f["emulated_delay_s"] or 0.0))
        return out

    def _build_sharded(self, args, spec, expand_kv: bool, loss_scaling: bool, comm) -> None:
        plan, used = self.plan, self.plan.used
        self.runtime = ShardedRuntime(spec, zero=plan.zero, fractions=[u.shard_fraction for u in used],
                                      position=self.position, comm=comm, device=self.device,
                                      recompute=plan.recompute, autocast_dtype=self.autocast, optim=self.optim,
                                      seed=args.seed, loss_scaling=loss_scaling, expand_kv=expand_kv,
                                      materialize=not (args.resume or args.init_from),  # both overwrite every slice
                                      **runtime_precision(plan))
        # the plan's split of the global batch: the embedding's gradient goes out as rows where that pays
        self.runtime.set_batch_split([u.batch for u in used], plan.seq)

    def _build_diloco(self, args, spec, expand_kv: bool, loss_scaling: bool, world_comm) -> None:
        """This rank's DiLoCo group (models/diloco.py): the uneven sharded runtime on the group's own
        process group (its positions, in plan order, with their fractions and batches), the outer
        exchange over the world. Every rank creates every group's process group, in group order."""
        plan, d, used = self.plan, self.diloco, self.plan.used
        world = len(used)
        group_of = [d.group_of(a.node) for a in used]
        pgs = [dist.new_group(sorted(self.owner[p] for p in range(world) if group_of[p] == g),
                              timeout=collective_timeout(plan, args.run_dir)) for g in range(d.num_groups)]
        g = group_of[self.position]
        members = [p for p in range(world) if group_of[p] == g]
        pg = pgs[g]
        comm = ProcessGroupCollectives(members.index(self.position),
                                       [dist.get_group_rank(pg, self.owner[p]) for p in members], group=pg)
        inner = ShardedRuntime(spec, zero=plan.zero, fractions=[used[p].shard_fraction for p in members],
                               position=members.index(self.position), comm=comm, device=self.device,
                               recompute=plan.recompute, autocast_dtype=self.autocast, optim=self.optim,
                               seed=args.seed, loss_scaling=loss_scaling, expand_kv=expand_kv,
                               materialize=not args.init_from, **runtime_precision(plan))
        inner.set_batch_split([used[p].batch for p in members], plan.seq)
        group_batch = sum(used[p].batch for p in members)
        self.step_tokens = group_batch * plan.seq
        self.group_weights = [sum(a.batch for a, h in zip(used, group_of) if h == k) / plan.global_batch
                              for k in range(d.num_groups)]
        self.group_leads = [next(p for p in range(world) if group_of[p] == k) for k in range(d.num_groups)]
        self.runtime = DilocoRuntime(inner, d, group=g, weight=group_batch / plan.global_batch, outer=world_comm)

    def _build_diloco_pipeline(self, args, spec, expand_kv: bool, loss_scaling: bool) -> None:
        """DiLoCo over pipeline replicas: this rank's stage of its group's own pipeline (Plan.diloco_pipeline;
        models/pipeline.py, on the pipeline's own process groups), the outer exchange of the stage among
        the ranks holding it in every group, and a tied embedding's among every group's first and last
        stages. Every rank creates every process group, in the same order: the pipelines' in group
        order, then one per stage, then the tied one."""
        plan, d, pipe, used = self.plan, self.diloco, self.pipe, self.plan.used
        if plan.zero != 1:
            raise ValueError(f"pipeline plans run ZeRO-1 inside each stage; this plan says zero {plan.zero}")
        timeout = collective_timeout(plan, args.run_dir)
        rank_of = {a.device_index: self.owner[p] for p, a in enumerate(used)}
        subs = [plan.diloco_pipeline(g) for g in range(d.num_groups)]
        stage_ranks = [[[rank_of[x] for x in st.devices] for st in sub.stages] for sub, _ in subs]
        groups = [build_pipeline_groups(spec, sr, own_world=True, timeout=timeout) for sr in stage_ranks]
        stage_pgs = [dist.new_group(sorted(rank_of[x] for x in st.devices), timeout=timeout) for st in pipe.stages]
        ends = sorted(rank_of[x] for x in pipe.stages[0].devices + pipe.stages[-1].devices)
        tied_pg = dist.new_group(ends, timeout=timeout) if spec.tied_embeddings and len(pipe.stages) > 1 else None
        g = d.group_of(self.a.node)
        sub, self.row_offset = subs[g]
        s, i = sub.stage_of(self.a.device_index)
        by_index = {a.device_index: a for a in used}
        inner = PipelineRuntime(
            spec, sub, stage=s, dp_index=i, stage_ranks=stage_ranks[g],
            fractions=[by_index[x].shard_fraction for x in sub.stages[s].devices], device=self.device, seq=plan.seq,
            recompute=plan.recompute, autocast_dtype=self.autocast, optim=self.optim, seed=args.seed,
            loss_scaling=loss_scaling, expand_kv=expand_kv, materialize=not args.init_from, groups=groups[g])
        group_batch = sub.micro_batch * sub.num_microbatches
        self.step_tokens = group_batch * plan.seq
        self.group_weights = [p.micro_batch * p.num_microbatches / plan.global_batch for p, _ in subs]
        position = {a.device_index: p for p, a in enumerate(used)}
        self.group_leads = [position[p.stages[0].devices[0]] for p, _ in subs]
        tied = self._group_collectives(tied_pg) if tied_pg is not None and (inner.first or inner.last) else None
        self.runtime = DilocoRuntime(inner, d, group=g, weight=group_batch / plan.global_batch,
                                     outer=self._group_collectives(stage_pgs[s]), tied=tied)

    def _group_collectives(self, pg) -> ProcessGroupCollectives:
        """Collectives over `pg`, its ranks' positions in increasing global rank."""
        n = dist.get_world_size(pg)
        return ProcessGroupCollectives(dist.get_rank(pg), list(range(n)), group=pg)

    @property
    def pipe_rt(self) -> PipelineRuntime:
        """A pipeline plan's PipelineRuntime (DiLoCo's inner one over pipelines)."""
        return self.runtime.inner if self.diloco is not None else self.runtime

    def _record_syncs(self, syncs) -> None:
        """World rank 0: one `diloco_sync` event per outer step of a fragment, with its bytes and time
        (over pipelines: rank 0's stage's, named in `stage`)."""
        if self.rank != 0:
            return
        for o in syncs:
            detail = {"fragment": o.fragment, "units": o.num_units, "payload_bytes": o.payload_bytes,
                      "seconds": o.seconds, "ranks": len(self.plan.used), "compress": self.diloco.compress}
            if self.pipe is not None:
                detail["stage"] = self.pipe_rt.stage
            self.store.add_step_event("diloco_sync", o.step, detail,
                                      f"outer step of fragment {o.fragment} ({o.num_units} units) after inner step "
                                      f"{o.step}: {o.payload_bytes} bytes per rank ({self.diloco.compress}), "
                                      f"{o.seconds:.3f} s", self.rank)

    def _tp_ranks(self) -> dict[int, list[int]]:
        """Each TP group's global ranks, increasing (= TP index order), by the group's first device."""
        position_of = {a.device_index: p for p, a in enumerate(self.plan.used)}
        return {g[0].device_index: sorted(self.owner[position_of[a.device_index]] for a in g)
                for g in self.plan.tp_groups()}

    def _build_tensor_parallel(self, args, spec, expand_kv: bool, loss_scaling: bool) -> None:
        """TP × uneven DP (models/tensor_runtime.py): layout[p] = the ranks of position p's TP group, every
        position's t ranks with its rows and its share of their TP index's parameters."""
        plan = self.plan
        groups = plan.tp_groups()
        ranks = self._tp_ranks()
        layout = [ranks[g[0].device_index] for g in groups]
        self.dp_position, tp, comm = build_groups(layout, dist.get_rank())
        self.batches = [g[0].batch for g in groups]  # per data-parallel position (TP group)
        self.runtime = TensorParallelRuntime(
            spec, zero=1, fractions=[g[0].shard_fraction for g in groups], position=self.dp_position, comm=comm,
            device=self.device, recompute=plan.recompute, autocast_dtype=self.autocast, optim=self.optim,
            seed=args.seed, loss_scaling=loss_scaling, expand_kv=expand_kv, tp=tp, **runtime_precision(plan))

    def _build_pipeline(self, args, spec, expand_kv: bool, loss_scaling: bool) -> None:
        """This rank's (stage, data-parallel index) of the plan's pipeline (models/pipeline.py); with tensor
        parallelism each stage entry is a TP group (its first device), stage_ranks[s][j] its ranks."""
        plan, pipe = self.plan, self.pipe
        if plan.zero != 1:
            raise ValueError(f"pipeline plans run ZeRO-1 inside each stage; this plan says zero {plan.zero}")
        by_index = {a.device_index: a for a in plan.used}
        ranks = self._tp_ranks()
        s, i = pipe.stage_of(self.a.leader)
        tp_kw = {}
        if self.tp > 1:
            stage_ranks = [[ranks[d] for d in st.devices] for st in pipe.stages]
            tp_kw = {"tp_size": self.tp, "tp_index": stage_ranks[s][i].index(self.rank)}
        else:
            stage_ranks = [[ranks[d][0] for d in st.devices] for st in pipe.stages]
        self.runtime = PipelineRuntime(
            spec, pipe, stage=s, dp_index=i, stage_ranks=stage_ranks,
            fractions=[by_index[d].shard_fraction for d in pipe.stages[s].devices], device=self.device,
            seq=plan.seq, recompute=plan.recompute, autocast_dtype=self.autocast, optim=self.optim, seed=args.seed,
            loss_scaling=loss_scaling, expand_kv=expand_kv, materialize=not (args.resume or args.init_from), **tp_kw)

    def _checkpointable(self, save: bool):
        """What executor/checkpoint.py saves and loads: the runtime, or a pipeline rank's view of all units."""
        return self.runtime if self.pipe is None else self.runtime.checkpoint_view(save)

    def _build_prefill(self, args):
        """The BubbleTea prefill worker of `--prefill JSON` on the stages it names (default: all)."""
        if self.pipe is None:
            raise ValueError("--prefill needs a pipeline plan: prefill runs while a stage waits for a receive")
        if self.diloco is not None:
            raise ValueError("--prefill does not run with DiLoCo (its inner steps take no idle callback)")
        try:
            config = json.loads(args.prefill)
        except json.JSONDecodeError as e:
            raise ValueError(f"--prefill is not JSON: {e}") from None
        from executor.prefill import PrefillWorker, runs_on_stage

        if not runs_on_stage(config, self.runtime.stage):  # also checks the config (one-line ValueError)
            return None
        return PrefillWorker.from_config(config, self.device, args.seed)

    # ---- one step ------------------------------------------------------------------------
    def _tensors(self, starts: np.ndarray, data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = windows(data, starts, self.plan.seq)
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def _batches(self, starts: np.ndarray) -> list:
        """This rank's micro-batches: (tokens, targets) pairs; a pipeline stage gets tokens only on the
        first stage and targets only on the last (None elsewhere)."""
        out = [self._tensors(starts[sl], self.train_tokens) for sl in self.slices]
        if self.pipe is None:
            return out
        rt = self.pipe_rt
        return [(x if rt.first else None, y if rt.last else None) for x, y in out]

    def train_step(self, step: int, measure_memory: bool, timeline: bool = False) -> dict[str, float | int | None]:
        starts = self.sampler.starts(step)
        rt = self.runtime
        tracker = PeakMemory(self.device, rt.resident_tensors()) if measure_memory else contextlib.nullcontext()
        delay = [0.0]

        def slow_down(work_s: float) -> None:
            if self.a.slowdown > 1.0:
                # emulate a slower device: it would have worked s x as long. One sleep for all
                # micro-batches: a core that idles between them comes back cold (caches, clock)
                # and would inflate the next micro-batch's time, and so the delay, again.
                delay[0] = (self.a.slowdown - 1.0) * work_s
                time.sleep(delay[0])

        self.link.start()
        t0 = time.perf_counter()
        with tracker:
            batches = self._batches(starts)
            lr = lr_at(step, self.args.steps, self.optim)
            if self.diloco is not None:
                r = rt.train_step(batches, self.step_tokens, lr, after_compute=slow_down)
                syncs = rt.syncs + (rt.sync_all() if step == self.args.steps else [])
            elif self.pipe is None:
                r = rt.train_step(batches, self.global_tokens, lr, after_compute=slow_down)
            else:
                t_start = time.time()
                r = rt.train_step(batches, self.global_tokens, lr, after_compute=slow_down,
                                  idle=self.prefill.step if self.prefill is not None else None, timeline=timeline,
                                  gaps=self.prefill)
        step_s = time.perf_counter() - t0
        link_tx_bytes = self.link.stop()
        if self.diloco is not None:
            self._record_syncs(syncs)
        peak = tracker.peak_bytes if measure_memory else None
        if peak is not None and self.memory_limit_bytes is not None and peak > self.memory_limit_bytes:
            raise EmulatedOutOfMemory(
                f"out of memory (emulated): rank {self.rank} ({self.a.type}, memory_gb {self.a.memory_gb:g}) "
                f"measured peak {peak / GIB:.3f} GiB > limit {self.memory_limit_bytes / GIB:.3f} GiB")
        if r.skipped and self.rank == 0:  # every rank skips the step alike: one note
            self.store.add_event("note", f"step {step}: fp16 overflow, step skipped (loss scale {r.loss_scale:g})",
                                 self.rank)
        wait_s = max(0.0, step_s - r.compute_s - delay[0] - r.optimizer_s)
        out = {"loss": r.loss, "step_s": step_s, "compute_s": r.compute_s, "delay_s": delay[0],
               "optimizer_s": r.optimizer_s, "wait_s": wait_s, "peak": peak,
               "comm_wait_s": getattr(r, "comm_wait_s", None), "link_tx_bytes": link_tx_bytes}
        if timeline:
            out["timeline"] = (t_start, list(r.ops))
        return out

    def write_timeline(self, step: int, start_s: float, ops: list[dict]) -> None:
        """Gather every rank's ops of `step` to rank 0, which writes <run_dir>/timeline.json (times relative
        to the earliest rank's step start: one machine clock on a local run)."""
        rt, dev = self.runtime, self.a
        mine = {"rank": self.rank, "stage": rt.stage, "dp_index": rt.dp_index, "device_index": dev.device_index,
                "datacenter": self.pipe.stages[rt.stage].datacenter, "start": start_s, "ops": ops}
        got = [None] * len(self.plan.used) if self.rank == 0 else None
        dist.gather_object(mine, got, dst=0)
        if self.rank != 0:
            return
        t0 = min(g["start"] for g in got)
        ranks = [{**{k: v for k, v in g.items() if k not in ("start", "ops")},
                  "ops": [{"op": o["op"], "mb": o["mb"], "start_s": o["start_s"] - t0, "end_s": o["end_s"] - t0}
                          for o in g["ops"]]} for g in sorted(got, key=lambda g: g["rank"])]
        path = os.path.join(self.args.run_dir, "timeline.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step, "ranks": ranks}, f)
        os.replace(path + ".tmp", path)

    @torch.no_grad()
    def val_loss(self) -> float:
        starts = val_starts(int(self.val_tokens.size), self.plan.seq, NUM_VAL_WINDOWS)
        x, y = self._tensors(starts, self.val_tokens)
        return self.runtime.eval_loss(x, y)

    # ---- the step's figures: gathered to rank 0, written by rank 0 alone -----------------
    def gather_figures(self, m: dict[str, float | int | None], val: float | None) -> list[dict[str, float | None]]:
        """One gather of every rank's FIGURES to rank 0 (their values by rank there, [] elsewhere):
        rank 0 then writes the whole step, so no other rank needs the store for its metrics, nor a
        filesystem shared with rank 0. A missing value (peak memory not measured this step, no
        validation loss) travels as NaN; float64 holds every byte count below 2**53 exactly."""
        mine = dict(m, emulated_delay_s=m["delay_s"], peak_memory_bytes=m["peak"], val_loss=val)
        t = torch.tensor([math.nan if mine[k] is None else float(mine[k]) for k in FIGURES], dtype=torch.float64,
                         device=self.device)  # NCCL gathers device tensors
        gathered = [torch.empty_like(t) for _ in self.plan.used] if self.rank == 0 else None
        dist.gather(t, gathered, dst=0)
        return [{k: None if math.isnan(x) else x for k, x in zip(FIGURES, g.tolist())} for g in gathered or ()]

    def record(self, step: int, figures: list[dict[str, float | None]]) -> None:
        """Rank 0: every rank's row and the step's row (the lead rank's loss, step time and
        validation loss), one transaction; with the monitor, each rank's predicted compute and wait
        of the split it trained (before any change this step decides)."""
        pred_compute = pred_wait = [None] * len(figures)
        if self.monitor is not None:
            by_position = self.monitor.predictions()
            pred_compute = [by_position[0][self.position_of[r]] for r in range(len(figures))]
            pred_wait = [by_position[1][self.position_of[r]] for r in range(len(figures))]
        ranks = [RankStep(r, f["compute_s"], f["emulated_delay_s"], f["optimizer_s"], f["wait_s"],
                          None if f["peak_memory_bytes"] is None else int(f["peak_memory_bytes"]), f["comm_wait_s"],
                          None if f["link_tx_bytes"] is None else int(f["link_tx_bytes"]), pred_compute[r],
                          pred_wait[r])
                 for r, f in enumerate(figures)]
        lead = figures[self.owner[0]]
        loss = lead["loss"]
        if self.diloco is not None:  # each group's loss is its own tokens' mean: weigh them by tokens
            loss = sum(w * figures[self.owner[p]]["loss"] for w, p in zip(self.group_weights, self.group_leads))
        self.store.record_steps_of_all_ranks(step, ranks, loss, lead["step_s"], self.plan.global_batch,
                                             self.plan.seq, lead["val_loss"])

    def relay(self, done: bool = False) -> None:
        """A multi-node run (relays()): gather every rank's waiting rows (its ranks row, its
        events; `done`: its "rank_done" too) to rank 0, which writes them in one transaction. A
        collective: every rank calls it at the same points (start, checkpoint steps, the end)."""
        if not relays():
            return
        if done and isinstance(self.store, RelayedStore):
            self.store.add_event("rank_done", f"rank {self.rank}: all steps done", self.rank)
        mine = self.store.take() if isinstance(self.store, RelayedStore) else {"row": None, "events": []}
        got = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, got, dst=0)
        if self.rank != 0:
            return
        rows = [(g["row"], self.plan.used[g["row"]["position"]]) for g in got if g and g["row"]]
        events = [e for g in got if g for e in g["events"]]
        if done:
            events.append((time.time(), 0, "rank_done", "rank 0: all steps done"))
        self.store.record_relayed(rows, events)

    def save_checkpoint(self, step: int, required: bool) -> None:
        """Start `step`'s checkpoint (executor/checkpoint.py's AsyncSaver): the previous save is waited
        for first (one host copy of the shard at a time), the slices are copied to host memory, and a
        background thread writes and commits them while the next steps train. The last step's save is
        waited for here: the run reports done only once it is committed."""
        self.finish_checkpoint()
        self.saver.start(self._checkpointable(save=True), step)
        self._checkpoint_required = required
        if step == self.args.steps:
            self.finish_checkpoint()

    def finish_checkpoint(self) -> None:
        """Wait for the save in flight, if any, and raise its failure. The final one nobody asked for
        does not fail a run whose nodes keep separate run folders (each sees only its own positions' files)."""
        if not self.saver.in_flight:
            return
        step = self.saver.step
        try:
            self.saver.wait()
        except ckpt.CheckpointIncomplete as e:
            if self._checkpoint_required:
                raise
            self.store.add_event("note", f"final {e}", self.rank)
            return
        if self.position == 0:
            self.store.add_event("checkpoint", f"checkpoint of step {step}", self.rank)

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        args = self.args
        first = 1
        self.saver = ckpt.AsyncSaver(args.run_dir, self.position, self.plan, keep=args.keep_checkpoints,
                                     timeout=collective_timeout(self.plan, args.run_dir))
        self._checkpoint_required = False
        if args.resume:
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one per node: what saves cut short left
                ckpt.remove_uncommitted(args.run_dir)
            done = ckpt.load(args.run_dir, self._checkpointable(save=False), self.position)
            first = done + 1
            log.info("resumed from the checkpoint of step %d", done)
        for step in range(first, args.steps + 1):
            every = args.measure_memory_every
            measure = step == first or (every > 0 and step % every == 0)
            timeline = self.pipe is not None and self.diloco is None and step == (args.timeline_step or args.steps)
            m = self.train_step(step, measure, timeline)
            if timeline:
                self.write_timeline(step, *m.pop("timeline"))
            val = None
            if (step == args.steps or (args.val_every > 0 and step % args.val_every == 0)) and (
                    self.dp_position == 0 or self.plan.zero == 3 or self.pipe is not None):
                # zero 3 gathers the units, a pipeline passes stages: every rank takes part; TP: position 0's group
                val = self.val_loss()
            figures = self.gather_figures(m, val)
            if self.rank == 0:
                self.record(step, figures)
            if self.rebalance:  # a collective: every rank learns the split of the next step
                self.agree_split(step, figures, observe=not measure)
            elif self.monitor is not None and not measure:  # rank 0 alone: the straggler, no change of split
                self.monitor.observe(step, self._computes(figures), figures[self.owner[0]]["step_s"])
            asked = args.checkpoint_every > 0 and step % args.checkpoint_every == 0
            if step == args.steps and self.tp > 1:  # the door refuses asked ones (check_tensor_parallel)
                if self.position == 0:
                    self.store.add_event("note", "no final checkpoint: a tensor-parallel run writes none yet "
                                         "(the checkpoint format has no TP layout)", self.rank)
            elif step == args.steps and self.diloco is not None:  # asked ones: refused at start
                if self.position == 0:
                    self.store.add_event("note", DILOCO_NO_CHECKPOINT, self.rank)
            elif asked or step == args.steps:  # the last step's state is always kept: export, continue
                self.save_checkpoint(step, required=asked)
                if step != args.steps:
                    self.relay()  # its events (a position-0 rank need not be rank 0)
        self.finish_checkpoint()  # a resumed run with no step left saved nothing; else already waited for
        if self.prefill is not None:
            self.prefill.write_summary(args.run_dir, self.rank)
        self.relay(done=True)
        dist.barrier()
        if self.standalone and self.rank == 0:
            self.store.finish("done")


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    _redirect_output(args.run_dir, rank)
    _exit_when_orphaned()
    store = RelayedStore() if relays() and rank != 0 else MetricsStore(args.run_dir)
    try:
        cg, baseline = cgroups.start_rank(rank)  # before anything is built: the memory limit's baseline
        if cg is not None:
            store.add_event("emulation", f"rank {rank}: cgroup {cg.name}: {cg.limits.describe()}"
                            + (f" (baseline {baseline / 2**20:.0f} MiB)" if baseline is not None else ""), rank)
        plan = Plan.load(args.plan)  # validated as it is read (contracts/plan.py), as the launcher did
        trainer = Trainer(args, plan, rank, world, store)
        if cg is not None and cg.memory_dir is not None:
            trainer.memory_limit_bytes = None  # the kernel enforces memory_gb: no measured-peak check
        trainer.run()
        if not relays():  # else written with every rank's by Trainer.relay
            store.add_event("rank_done", f"rank {rank}: all steps done", rank)
    except BaseException as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.exception("rank %d failed", rank)
        with contextlib.suppress(Exception):
            store.add_event("rank_failed", f"rank {rank}: {type(e).__name__}: {msg}", rank)
            if os.environ.get(ENV_LAUNCHED) != "1":
                store.finish("failed", f"rank {rank}: {type(e).__name__}: {msg}", rank)
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        store.close()
    # Leave without the interpreter's teardown: torch 2.13's gloo threads sometimes abort in
    # C++ static destructors at exit ("terminate called without an active exception") after
    # all work is done. Everything is written: the store is closed, the logs are flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
