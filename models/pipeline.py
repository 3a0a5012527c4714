"""Pipeline-parallel training: one rank = (stage s, data-parallel index i) of a plan's PipelineSpec.

Written with `dist.isend` / `dist.irecv` rather than torch.distributed.pipelining, which cannot give
stages different data-parallel degrees. Stage s holds its units (contracts/units.py), built and
seeded as models/sharded.py does (the last stage of a tied model keeps a replica of "embed"); each
stage splits a micro-batch's rows over its ranks, which exchange the intersecting pieces with the
neighbouring stages; inside a stage ZeRO-1 with the plan's uneven shards. Schedules "gpipe" and
"1f1b" (contracts/pipeline_order.py); receives are posted one op ahead so a transfer overlaps
compute, and a pending receive calls `idle()` (BubbleTea's prefill worker). `timeline=True` records
every op's start and end. Tensor parallel (tp_size > 1): each (stage, DP index) is a TP group
(models/tensor.py), the ranks of one TP index a pipeline of their own (docs/models/tensor_parallel.md).

Why each choice, and how the planner predicts this runtime: docs/models/pipeline_simulation.md
("The runtime being modelled"); its memory: docs/models/memory.md.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from models.collectives import ProcessGroupCollectives
from models.optim import OptimConfig
from models.sharded import StepResult, UnitState, host_float
from models.tensor import TensorParallel
from models.tensor_runtime import TensorParallelRuntime
from contracts.plan import PIPELINE_SCHEDULES, PipelineSpec
from contracts.specs import ModelSpec
from contracts.pipeline_order import schedule_in_flight, schedule_order
from contracts.units import runtime_units

log = logging.getLogger(__name__)

SCHEDULES = PIPELINE_SCHEDULES


def stage_unit_indices(spec: ModelSpec, pipeline: PipelineSpec, stage: int) -> list[int]:
    """Global unit indices (contracts/units.py order) stage `stage` holds, the tied replica included."""
    S, L = len(pipeline.stages), spec.num_layers
    st = pipeline.stages[stage]
    out = [0] if stage == 0 or (stage == S - 1 and spec.tied_embeddings) else []
    out += [1 + l for l in range(st.first_layer, st.first_layer + st.num_layers)]
    if stage == S - 1:
        out.append(L + 1)
    return out


def schedule_ops(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The (op, micro-batch) order of one stage: op "F" or "B" (docs/models/pipeline_simulation.md). One definition,
    pure Python, shared with the memory model, the cost model and the simulator
    (contracts/pipeline_order.schedule_order)."""
    return schedule_order(schedule, num_stages, stage, num_microbatches)


def in_flight(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Most micro-batches whose activations stage `stage` holds at once (planner/core/stage_memory)."""
    return schedule_in_flight(schedule, num_stages, stage, num_microbatches)


def row_offsets(rows: Sequence[int]) -> list[int]:
    out, o = [], 0
    for r in rows:
        out.append(o)
        o += r
    return out


def row_pieces(mine: tuple[int, int], rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(peer dp index, start, end) in MY local row coordinates for every peer range intersecting `mine`
    (mine = (offset, count) in micro-batch rows; rows = the peer stage's row counts)."""
    a0, n = mine
    out = []
    for j, (o, r) in enumerate(zip(row_offsets(rows), rows)):
        a, b = max(a0, o), min(a0 + n, o + r)
        if a < b:
            out.append((j, a - a0, b - a0))
    return out


def _by_tp_index(stage_ranks, tp_size: int) -> list[list[list[int]]]:
    """By TP index k: the ranks of every (stage, dp index) with that index (tp 1: stage_ranks itself)."""
    if tp_size == 1:
        return [[list(r) for r in stage_ranks]]
    return [[[g[k] for g in r] for r in stage_ranks] for k in range(tp_size)]


@dataclass(frozen=True)
class PipelineGroups:
    """The process groups of one pipeline: per TP index each stage's data-parallel group and the tied
    embedding's group (first and last stages; None without one), the TP groups per (stage, dp index)
    (None at tp 1), and `everyone`, all the pipeline's ranks (None: the world), over which the step's
    norm, overflow flag and loss are summed."""
    dp: list[list[Any]]
    tied: list[Any]
    tp: list[list[Any]] | None
    everyone: Any = None


def build_pipeline_groups(spec: ModelSpec, stage_ranks, tp_size: int = 1, own_world: bool = False,
                          timeout: Any = None) -> PipelineGroups:
    """Create a pipeline's process groups (`stage_ranks` as PipelineRuntime takes it); every rank of
    the world calls this for every pipeline, in the same order (torch.distributed requires it).
    `own_world`: the pipeline is one of several in the world (DiLoCo's groups), so it gets a group of
    its own ranks for the step's sums."""
    kw = {} if timeout is None else {"timeout": timeout}
    S = len(stage_ranks)
    dp, tied = [], []
    for ranks in _by_tp_index(stage_ranks, tp_size):
        dp.append([dist.new_group(r, **kw) for r in ranks])
        both = sorted(set(ranks[0]) | set(ranks[-1]))
        tied.append(dist.new_group(both, **kw) if spec.tied_embeddings and S > 1 else None)
    tp = [[dist.new_group(list(g), **kw) for g in r] for r in stage_ranks] if tp_size > 1 else None
    everyone = None
    if own_world:
        flat = [x for r in stage_ranks for g in r for x in ([g] if tp_size == 1 else g)]
        everyone = dist.new_group(sorted(flat), **kw)
    return PipelineGroups(dp, tied, tp, everyone)


class _Transfer:
    """The works of one send or receive. gloo's point-to-point Work.is_completed() stays False until
    wait() is called (measured on torch 2.13), so polling it cannot see a receive land: with
    watch=True a daemon thread waits for the works (gloo's wait releases the GIL) and records when
    they completed; the main thread then polls that and never waits on the works itself (two
    waiters on one gloo buffer would each wait for a completion of their own)."""

    def __init__(self, works: list, watch: bool, keep: torch.Tensor | None = None):
        self.works, self.keep, self.start_s, self.done_at = works, keep, time.time(), None
        self._done = threading.Event() if watch else None
        if watch:
            threading.Thread(target=self._watch, name="pipeline-transfer", daemon=True).start()

    def _watch(self) -> None:
        for w in self.works:
            w.wait()
        self.done_at = time.time()
        self._done.set()

    def completed(self) -> bool:
        return self._done.is_set() if self._done is not None else all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        if self._done is not None:
            self._done.wait()
        else:
            for w in self.works:
                w.wait()
            self.done_at = time.time()
        self.keep = None


@dataclass(frozen=True)
class _Absent:
    """A unit this rank does not hold: the empty slice [numel, numel) (nothing saved, nothing loaded;
    at the end, so the checkpoint's sort by start still tiles the owners' slices)."""
    name: str
    numel: int
    master: torch.Tensor = torch.empty(0)
    exp_avg: torch.Tensor = torch.empty(0)
    exp_avg_sq: torch.Tensor = torch.empty(0)

    @property
    def start(self) -> int:
        return self.numel

    end = start


class _CheckpointView:
    """PipelineRuntime.checkpoint_view: the runtime's scalar state and after_load, all units listed."""

    def __init__(self, rt: "PipelineRuntime", save: bool):
        mine = {u.index: u for u in rt.units if not (save and rt.replica and u.index == 0)}
        self.units = [mine.get(i, _Absent(lu.name, lu.numel)) for i, lu in enumerate(runtime_units(rt.spec))]
        self.scalar_state, self.load_scalar_state, self.after_load = rt.scalar_state, rt.load_scalar_state, rt.after_load


@dataclass(frozen=True)
class PipelineStepResult(StepResult):
    ops: tuple[dict, ...] = ()  # the timeline: {"op", "mb", "start_s", "end_s"} (time.time())


class PipelineRuntime(TensorParallelRuntime):
    """One rank (stage, dp_index) of a pipeline plan (docs/models/pipeline_simulation.md). `stage_ranks[s]` are the global
    ranks of stage s in data-parallel order; every rank must construct it (it creates process groups).

    Tensor parallel (tp_size t > 1, docs/models/tensor_parallel.md): each (stage, dp index) is a TP group
    of t ranks, `stage_ranks[s][j]` the list of its t global ranks by TP index (increasing), this rank
    its `tp_index`-th. The ranks of TP index k form a pipeline of their own (DP groups, point-to-point
    peers and the tied embedding's group per k); the activations sent between stages are the full
    (rows, T, h) residual stream, the same on every TP rank."""

    def __init__(self, spec: ModelSpec, pipeline: PipelineSpec, *, stage: int, dp_index: int,
                 stage_ranks: Sequence[Sequence[int] | Sequence[Sequence[int]]], fractions: Sequence[float],
                 device: torch.device, seq: int, recompute: str = "none", autocast_dtype: torch.dtype | None = None,
                 optim: OptimConfig | None = None, seed: int = 0, loss_scaling: bool = False,
                 materialize: bool = True, expand_kv: bool = False, tp_size: int = 1, tp_index: int = 0,
                 groups: PipelineGroups | None = None):
        S = len(pipeline.stages)
        if len(stage_ranks) != S or any(len(r) != len(st.devices) for r, st in zip(stage_ranks, pipeline.stages)):
            raise ValueError("stage_ranks must list one rank per device of every pipeline stage")
        if not 0 <= tp_index < tp_size:
            raise ValueError(f"tp_index {tp_index} is not in a TP group of {tp_size}")
        if tp_size > 1 and any(len(g) != tp_size for r in stage_ranks for g in r):
            raise ValueError(f"with tp_size {tp_size} every stage_ranks[s][j] lists the {tp_size} ranks of a TP group")
        if pipeline.num_layers != spec.num_layers:
            raise ValueError(f"pipeline stages cover {pipeline.num_layers} layers, model {spec.name} has "
                             f"{spec.num_layers}")
        if not 0 <= stage < S or not 0 <= dp_index < len(stage_ranks[stage]):
            raise ValueError(f"no rank (stage {stage}, dp index {dp_index}) in this pipeline")
        self.pipeline, self.stage, self.dp_index, self.num_stages = pipeline, stage, dp_index, S
        self.stage_ranks = _by_tp_index(stage_ranks, tp_size)[tp_index]  # this rank's pipeline: its TP index
        self.seq = seq
        self.first, self.last = stage == 0, stage == S - 1
        self.replica = self.last and not self.first and spec.tied_embeddings
        # None: this is the world's only pipeline, so every rank is building it and creates its groups now
        groups = groups if groups is not None else build_pipeline_groups(spec, stage_ranks, tp_size)
        self.everyone = groups.everyone
        tp = TensorParallel(tp_size, tp_index, groups.tp[stage][dp_index]) if tp_size > 1 else None
        self.tied_group = groups.tied[tp_index] if (self.first or self.last) else None
        group = groups.dp[tp_index][stage]
        order = sorted(self.stage_ranks[stage])
        comm = ProcessGroupCollectives(dp_index, [order.index(r) for r in self.stage_ranks[stage]], group=group)
        self._unit_ids = stage_unit_indices(spec, pipeline, stage)
        super().__init__(spec, zero=1, fractions=fractions, position=dp_index, comm=comm, device=device,
                         recompute=recompute, autocast_dtype=autocast_dtype, optim=optim, seed=seed,
                         loss_scaling=loss_scaling, materialize=materialize, expand_kv=expand_kv, tp=tp)
        st = pipeline.stages[stage]
        self.rows = st.rows[dp_index]
        self.my_rows = (row_offsets(st.rows)[dp_index], self.rows)
        self.blocks = [self.model.blocks[l] for l in range(st.first_layer, st.first_layer + st.num_layers)]
        self.prev = row_pieces(self.my_rows, pipeline.stages[stage - 1].rows) if not self.first else []
        self.next = row_pieces(self.my_rows, pipeline.stages[stage + 1].rows) if not self.last else []
        self.comm_done, self._t_sync = 0.0, 0.0
        self.ops_order = schedule_ops(pipeline.schedule, S, stage, pipeline.num_microbatches)

    def __repr__(self) -> str:
        return (f"PipelineRuntime({self.spec.name!r}, stage {self.stage} of {self.num_stages}, dp {self.dp_index}, "
                f"units {[u.name for u in self.units]})")

    # ---- layout: ShardedRuntime's units, only this stage's --------------------------------------
    def _unit_indices(self) -> list[int]:
        return self._unit_ids

    # ---- communication ----------------------------------------------------------------------------
    def _peer(self, stage: int, j: int) -> int:
        return self.stage_ranks[stage][j]

    def _note(self, op: str, mb: int, t0: float, t1: float) -> None:
        if self._ops is not None:
            self._ops.append({"op": op, "mb": mb, "start_s": t0, "end_s": t1})

    def _wait_send(self, key: tuple[str, int]) -> None:
        """Wait for the send `key` = (op, mb) and drop it (its tensor with it), recording its interval."""
        t = self._sends.pop(key, None)
        if t is not None:
            t.wait()
            self._note(key[0], key[1], t.start_s, t.done_at)

    def _send(self, t: torch.Tensor, pieces, stage: int, op: str, mb: int, tag: int) -> None:
        works = [dist.isend(t[a:b].contiguous(), dst=self._peer(stage, j), tag=tag) for j, a, b in pieces]
        self._sends[(op, mb)] = _Transfer(works, watch=self._ops is not None, keep=t)

    def _needs_recv(self, op: str) -> bool:
        return (op == "F" and not self.first) or (op == "B" and not self.last)

    def _post(self, op: str, k: int) -> None:
        """Post the receive op (op, k) needs, if it needs one and it is not posted yet: its rows
        (rows, T, h) fp32 from the peers of the previous stage (a forward's input) or of the next
        stage (a backward's incoming gradient: the next stage's fp32 input gradient)."""
        if not self._needs_recv(op) or (op, k) in self._posted:
            return
        M = self.pipeline.num_microbatches
        pieces, stage, tag = (self.prev, self.stage - 1, k) if op == "F" else (self.next, self.stage + 1, M + k)
        buf = torch.empty(self.rows, self.seq, self.spec.hidden, dtype=torch.float32, device=self.device)
        works = [dist.irecv(buf[a:b], src=self._peer(stage, j), tag=tag) for j, a, b in pieces]
        self._posted[(op, k)] = _Transfer(works, watch=self._idle is not None or self._ops is not None, keep=buf)

    def _recv(self, op: str, k: int) -> torch.Tensor:
        """The receive of op (op, k), posted now if it was not (the step's first op): wait for it,
        calling idle() between polls, and return its buffer."""
        self._post(op, k)
        t = self._posted.pop((op, k))
        buf = t.keep
        # the wait's begin and end, told to `gaps` (the prefill worker: it learns each wait's length)
        opened = self._gaps is not None and not t.completed()
        if opened:
            self._gaps.gap_begin((op, k))
        while self._idle is not None and not t.completed():  # never starts a piece after completion
            t1 = time.time()
            if not self._idle():
                break
            self._note("prefill", k, t1, time.time())  # one row per piece: each starts inside the wait
        t.wait()
        if opened:
            self._gaps.gap_end()
        self._note("recv_fwd" if op == "F" else "recv_bwd", k, t.start_s, t.done_at)
        return buf

    # ---- one step ---------------------------------------------------------------------------------
    def _forward(self, k: int, batch: tuple[torch.Tensor | None, torch.Tensor | None], rope, normalizer: int,
                 scale: float, ctx: dict) -> None:
        if self.first:
            inp = None
        else:
            inp = self._recv("F", k).requires_grad_()
        t0 = time.time()

        def fwd():
            with self._autocast():
                h = self.model.embed_tokens(batch[0]) if self.first else inp
                for block in self.blocks:
                    h = (checkpoint(block, h, rope, use_reentrant=False) if self.recompute == "full"
                         else block(h, rope))
                if not self.last:
                    return h
                logits = self.model.head_logits(h)
            del h
            loss = self._loss(logits, batch[1], normalizer)
            del logits
            return loss
        out = self._timed(fwd)
        self._note("forward", k, t0, time.time())
        ctx[k] = (inp, out)  # the stage's input leaf (its .grad goes back) and its output (or loss)
        if not self.last:
            self._send(out.detach(), self.next, self.stage + 1, "send_fwd", k, k)

    def _backward(self, k: int, scale: float, ctx: dict) -> float:
        M = self.pipeline.num_microbatches
        inp, out = ctx.pop(k)
        self._wait_send(("send_fwd", k))  # done: stage s+1 used it before sending this gradient back
        dy = None if self.last else self._recv("B", k).to(out.dtype)
        t0 = time.time()

        def bwd() -> float:
            if self.last:
                (out * scale if scale != 1.0 else out).backward()
                return host_float(out.detach())
            out.backward(dy)
            return 0.0
        loss = self._timed(bwd)
        del out, dy
        self._note("backward", k, t0, time.time())
        if not self.first:
            # at most one gradient send in flight: the previous micro-batch's must be done
            self._wait_send(("send_bwd", k - 1))  # at most one gradient send in flight
            self._send(inp.grad, self.prev, self.stage - 1, "send_bwd", k, M + k)
        return loss

    def train_step(self, batches: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]], token_normalizer: int,
                   lr: float, after_compute: Callable[[float], None] | None = None,
                   idle: Callable[[], bool] | None = None, timeline: bool = False,
                   gaps: Any = None) -> PipelineStepResult:
        """One optimizer step over the pipeline's micro-batches. `batches[k]` = (tokens, targets) of this
        rank's rows of micro-batch k (tokens on the first stage, targets on the last, else None);
        `token_normalizer` the GLOBAL token count; `idle` runs between polls of a pending receive."""
        if token_normalizer <= 0:
            raise ValueError(f"token_normalizer must be > 0, got {token_normalizer}")
        if len(batches) != self.pipeline.num_microbatches:
            raise ValueError(f"{len(batches)} micro-batches given, the pipeline runs {self.pipeline.num_microbatches}")
        self._clock, self._ops, self._idle, self._gaps = [0.0, 0.0], ([] if timeline else None), idle, gaps
        self._sends: dict[tuple[str, int], _Transfer] = {}
        scale = self.scaler.scale
        for u in self.units:
            u.grad_fresh = True
            self._grad_buffer(u)
        with self._autocast():
            rope = self.model.rope(self.seq, self.device) if self.blocks else None
        ctx: dict[int, Any] = {}
        total = 0.0
        self._posted: dict[tuple[str, int], _Transfer] = {}
        for i, (op, k) in enumerate(self.ops_order):
            self._post(op, k)  # the step's first op: nothing posted it
            if i + 1 < len(self.ops_order):  # the next op's receive, so its transfer overlaps this op
                self._post(*self.ops_order[i + 1])
            if op == "F":
                self._forward(k, batches[k], rope, token_normalizer, scale, ctx)
            else:
                total += self._backward(k, scale, ctx)
        del rope
        for key in list(self._sends):
            self._wait_send(key)
        if after_compute is not None:
            after_compute(self._clock[1])
        t0 = time.time()
        self._sync_grads()
        r = self._finish(total, lr, scale, t0)
        ops = tuple(self._ops or ())
        self._ops, self._idle, self._gaps = None, None, None
        return r if not timeline else PipelineStepResult(**{**r.__dict__, "ops": ops})

    def _sync_grads(self) -> None:
        """Tied embedding: all-reduce its full gradient over the first and last stages' ranks (every one
        then holds the sum of all contributions) and keep this rank's slice; the other units:
        reduce-scatter inside the stage."""
        for u in self.units:
            if u.index == 0 and self.tied_group is not None:
                dist.all_reduce(u.full_grad, group=self.tied_group)
                st = u.grad.untyped_storage()
                st.resize_(u.grad.numel() * u.grad.element_size())
                u.grad.copy_(u.full_grad[u.start:u.end])
                for p in u.params:
                    p.grad = None
                u.full_grad = None
            else:
                self._reduce(u)

    def _finish(self, loss: float, lr: float, scale: float, t_sync: float) -> PipelineStepResult:
        """ShardedRuntime's step end (norm, overflow, clipping, AdamW, the all-gathers inside the stage)
        with this runtime's `_norm_units` and `_reduce_stats`."""
        self._t_sync = t_sync
        r = self._finish_step(loss, lr, scale)
        self._note("optimizer", -1, self.comm_done, time.time())  # AdamW and the all-gather
        return PipelineStepResult(**r.__dict__)

    def _norm_units(self) -> list:
        """The global norm counts the tied replica once: on the first stage, not on the last (and, tensor
        parallel, the replicated parameters once per TP group)."""
        return self._tp_norm_views([u for u in self.units if not (self.replica and u.index == 0)])

    def _reduce_stats(self, stats: torch.Tensor) -> None:
        """The step's (squared norm, overflow flag, loss) summed over the pipeline's ranks (`everyone`:
        the world, or its own group when it is one of DiLoCo's pipelines): every stage's squares
        and the last stage's losses (the all-gathers of the updated slices stay inside the stage); every
        rank of a TP group computed the same loss, TP index 0 adds it."""
        if self.tp is not None and self.tp.rank:
            stats[2].zero_()
        dist.all_reduce(stats, group=self.everyone)
        self.comm_done = time.time()
        self._note("grad_sync", -1, self._t_sync, self.comm_done)

    # ---- checkpoints (executor/checkpoint.py's logical format) ------------------------------------
    def checkpoint_view(self, save: bool) -> "_CheckpointView":
        """This rank as executor/checkpoint.py sees a runtime: every unit of the model in order, the
        stage's own with their slices, the others (and, when saving, the tied replica: the first stage
        saves that unit) as empty slices; so a pipeline's checkpoint is the same logical checkpoint as a
        data-parallel run's, and either resumes the other."""
        if self.tp is not None:
            raise NotImplementedError("checkpoints of a tensor-parallel pipeline are not implemented")
        return _CheckpointView(self, save)

    # ---- evaluation ---------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean next-token loss of one batch through the pipeline (collective: every rank calls it; the
        data-parallel index 0 rank(s: its TP group) of each stage computes, the others only join the final
        all-reduce)."""
        out = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.dp_index == 0:
            B, T = targets.shape
            with self._autocast():
                if self.first:
                    h = self.model.embed_tokens(tokens)
                else:
                    h = torch.empty(B, T, self.spec.hidden, dtype=torch.float32, device=self.device)
                    dist.recv(h, src=self._peer(self.stage - 1, 0), tag=2 * self.pipeline.num_microbatches)
                rope = self.model.rope(T, self.device) if self.blocks else None
                for block in self.blocks:
                    h = block(h, rope)
                if not self.last:
                    dist.send(h.float().contiguous(), dst=self._peer(self.stage + 1, 0),
                              tag=2 * self.pipeline.num_microbatches)
                else:
                    logits = self.model.head_logits(h)
            if self.last:
                loss = float(self._loss(logits, targets, targets.numel()))
                out += loss if self.tp is None or self.tp.rank == 0 else 0.0
        dist.all_reduce(out, group=self.everyone)
        return float(out)


__all__ = ["PipelineGroups", "PipelineRuntime", "PipelineStepResult", "build_pipeline_groups", "schedule_ops",
           "in_flight", "stage_unit_indices", "row_pieces"]
