"""BubbleTea: run inference prefill requests in the idle compute of a training pipeline.

Given one simulated training iteration, prefill requests fill the GPU time training's compute does
not use (bubbles and collective waits), on the GPUs whose stage leaves enough memory free for the
inference model, or, in a split group, for its share of the layers; no training operation moves (the
caller re-simulates with the prefill as reserved intervals to prove it). Prefill is chunked as
executor/prefill.py runs it: one unit is one decoder layer over one token chunk, the chunk sized to
the worker's time box (not to the gap), priced from the profile store's forward time. The worker
does not know when the current gap ends: it starts a unit only if the unit fits the gap's
*forecast* (`GapForecast`: the same gap's length measured in previous iterations), and a unit that
runs past the gap's true end is counted as an overrun (`PrefillResult.overrun_s`), which delays
training. Requests arrive as a seeded Poisson process or a
backlog. `simulate_bubbletea` tries whole copies and each kind of split group and keeps the one
serving the most prompt tokens.

The fillable time, the unit-time and memory formulas, split groups and the request model:
docs/models/bubbletea.md.
"""
from __future__ import annotations

import bisect
import heapq
import random
import statistics
from dataclasses import dataclass, field
from typing import Hashable

from planner.geo.scenario import InferenceWorkload
from planner.geo.pipeline_sim import SimResult, simulate_pipeline
from contracts.specs import ModelSpec, with_max_seq
from contracts.constants import DTYPE_BYTES

LOOKAHEAD = 32  # how far down the queue a free GPU looks for a request whose memory fits it
# Requests simulated in one iteration (offered in rate mode, started with a backlog): each is a
# Python object and its pieces reserved intervals in the re-simulation, so the work stays bounded.
MAX_PREFILL_REQUESTS = 100_000
CHUNK_LADDER = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)  # chunk sizes (tokens) below a whole prompt
COMPUTE_KINDS = ("F", "B", "OPT")  # the GPU's training compute; every other op (collectives) leaves it idle
# The prefill worker's time box (executor/prefill.py imports these): a training op waits behind at
# most one unit, and the worker's controller sizes each chunk so a unit takes CHUNK_TARGET of it.
DEFAULT_MAX_CHUNK_S = 0.005
CHUNK_TARGET = 0.5
FORECAST_WINDOW = 3  # a gap's forecast: the shortest of its lengths in the last this many iterations


class GapForecast:
    """What a prefill worker can know of its GPU's idle gaps at run time: each gap's length as
    measured in previous iterations (the schedule repeats every iteration), never the current gap's
    end. A gap is named by a key stable across iterations (its index in the iteration here; the
    receive it waits for in executor/prefill.py). `forecast_s(key)` is the shortest of the gap's last
    FORECAST_WINDOW measured lengths (None before any measurement: the worker then starts no unit)."""

    def __init__(self, window: int = FORECAST_WINDOW):
        if window < 1:
            raise ValueError(f"GapForecast: window must be >= 1, got {window}")
        self.window = window
        self._seen: dict[Hashable, list[float]] = {}

    def record(self, key: Hashable, length_s: float) -> None:
        """Gap `key` of the iteration just run lasted `length_s` (measured)."""
        if length_s < 0:
            raise ValueError(f"GapForecast: gap {key!r} measured {length_s} s long")
        seen = self._seen.setdefault(key, [])
        seen.append(length_s)
        del seen[:-self.window]

    def forecast_s(self, key: Hashable) -> float | None:
        seen = self._seen.get(key)
        return min(seen) if seen else None


def chunk_for_box(units: "UnitTimes", lo: int, left: int, box_s: float = DEFAULT_MAX_CHUNK_S) -> int:
    """The chunk the worker's controller settles on: the largest of (the rest of the prompt, the
    CHUNK_LADDER sizes below it) whose layer unit at context `lo` takes at most CHUNK_TARGET × the
    box; the smallest of them when none does. Independent of the gap it runs in."""
    sizes = (left, *(k for k in CHUNK_LADDER if k < left))
    return next((k for k in sizes if units.unit_s(lo, k) <= CHUNK_TARGET * box_s), sizes[-1])


@dataclass(frozen=True)
class PrefillPlacement:
    """One contiguous piece of a request's prefill on one GPU (its units back to back in one gap);
    `done` on the request's last piece (its first token is out at end_s)."""
    request: int
    tokens: int
    pipeline: int
    stage: int
    arrival_s: float
    start_s: float
    end_s: float
    done: bool = True
    units: int = 0  # layer x chunk units in this piece


@dataclass
class PrefillResult:
    iteration_s: float
    num_gpus: int
    training_busy_s: float
    eligible_stages: tuple[int, ...]
    placements: list[PrefillPlacement] = field(default_factory=list)
    requests_offered: int = 0  # arrivals in the iteration (rate mode); 0 with a backlog
    backlog: bool = False
    note: str = ""
    fillable_s: float = 0.0  # compute-idle GPU time on the eligible GPUs (what prefill may take)
    split_groups: list = field(default_factory=list)  # [{"stages", "layers"}]: one model copy split per group
    overrun_s: float = 0.0  # unit time past the true end of a gap (a forecast too long): training delayed
    queue_ran_dry: bool = False  # rate mode: every servable request offered was started
    # per split group (its members): ([(start, end, tokens)] of the requests it admitted, its token bound)
    group_logs: dict = field(default_factory=dict, repr=False)

    @property
    def prefill_busy_s(self) -> float:
        return sum(p.end_s - p.start_s for p in self.placements)

    @property
    def served(self) -> list[PrefillPlacement]:
        return [p for p in self.placements if p.done]

    def gpu_utilization_with_prefill(self, num_gpus: int | None = None) -> float:
        """Training and prefill GPU time over `num_gpus` (default: the plan's) × the iteration."""
        n = self.num_gpus if num_gpus is None else num_gpus
        if n < self.num_gpus:
            raise ValueError(f"utilization over {n} GPUs, fewer than the plan's {self.num_gpus}")
        return (self.training_busy_s + self.prefill_busy_s) / (n * self.iteration_s)

    def prefill_tokens_per_s(self) -> float:
        """Tokens of the requests completed in the iteration per second (unfinished ones not counted)."""
        return sum(p.tokens for p in self.served) / self.iteration_s

    def ttft_s(self) -> list[float]:
        """Time to first token of each served request: queueing plus prefill (rate mode only)."""
        return [] if self.backlog else sorted(p.end_s - p.arrival_s for p in self.served)

    def arrival_limited(self) -> bool:
        """Rate mode: the queue ran dry while fillable time remained (too few requests arrive)."""
        return (not self.backlog and self.queue_ran_dry
                and self.prefill_busy_s < self.fillable_s * (1 - 1e-9))

    def summary(self) -> dict:
        ttft = self.ttft_s()
        served = [p.tokens for p in self.served]
        started = len({p.request for p in self.placements})
        return {
            "served_mean_prompt_tokens": statistics.fmean(served) if served else None,
            "prefill_requests_served": len(served),
            "prefill_requests_started": started,
            "prefill_requests_offered": None if self.backlog else self.requests_offered,
            "prefill_offered_share_served": (len(served) / self.requests_offered
                                             if not self.backlog and self.requests_offered else None),
            "prefill_arrival_limited": self.arrival_limited(),
            "prefill_tokens_per_s": self.prefill_tokens_per_s(),
            "prefill_busy_s": self.prefill_busy_s,
            "prefill_fillable_s": self.fillable_s,
            "prefill_units": sum(p.units for p in self.placements),
            "prefill_overrun_s": self.overrun_s,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "eligible_stages": list(self.eligible_stages),
            "split_groups": self.split_groups,
            "note": self.note,
        }


def prefill_memory_bytes(spec: ModelSpec, tokens: int, dtype: str = "bf16") -> int:
    w = DTYPE_BYTES[dtype]
    kv = 2 * spec.num_layers * tokens * spec.num_kv_heads * spec.head_dim
    work = tokens * (4 * spec.hidden + 2 * spec.ffn_hidden)
    return int((spec.num_params + kv + work) * w + 4 * spec.vocab_size)


def prefill_time_s(spec: ModelSpec, tokens: int, gpu_type: str, dtype: str = "bf16") -> float:
    from planner.core.profiles import get_step_profile

    prof = get_step_profile(gpu_type, with_max_seq(spec, tokens), tokens, dtype, "none")
    return prof.step_time_s(1) / 3.0


class UnitTimes:
    """One-layer unit times of chunked prefill on one GPU type (docs/models/bubbletea.md's formula), with
    the forward times P(n) cached per token count."""

    def __init__(self, spec: ModelSpec, gpu_type: str, dtype: str):
        self.spec, self.gpu_type, self.dtype = spec, gpu_type, dtype
        self._p: dict[int, float] = {0: 0.0}
        self._u: dict[tuple[int, int], float] = {}

    def forward_s(self, n: int) -> float:
        if n not in self._p:
            self._p[n] = prefill_time_s(self.spec, n, self.gpu_type, self.dtype)
        return self._p[n]

    def unit_s(self, lo: int, c: int) -> float:
        """One decoder layer over tokens [lo, lo + c) of a prompt, the earlier ones cached."""
        key = (lo, c)
        if key not in self._u:
            self._u[key] = max(self.forward_s(c), self.forward_s(lo + c) - self.forward_s(lo)) / self.spec.num_layers
        return self._u[key]


def _request_lengths(workload: InferenceWorkload):
    """An endless deterministic sequence following the distribution (largest deficit first)."""
    counts = [0] * len(workload.prompt_tokens)
    i = 0
    while True:
        i += 1
        k = max(range(len(counts)), key=lambda j: workload.prompt_tokens[j][1] * i - counts[j])
        counts[k] += 1
        yield workload.prompt_tokens[k][0]


def compute_idle_gaps(sim: SimResult, pipeline: int, stage: int) -> list[tuple[float, float]]:
    """A GPU's intervals in [0, iteration_s] with no forward, backward or optimizer step (the
    collectives count as idle compute), joined across the iteration boundary (steady state)."""
    busy = sorted((o.start_s, o.end_s) for o in sim.ops + sim.step_ops
                  if o.pipeline == pipeline and o.stage == stage and o.kind in COMPUTE_KINDS)
    gaps, t = [], 0.0
    for s, e in busy:
        if s > t + 1e-12:
            gaps.append((t, s))
        t = max(t, e)
    if sim.iteration_s > t + 1e-12:
        gaps.append((t, sim.iteration_s))
    return steady_state_gaps(gaps, sim.iteration_s)


class _Gpu:
    """One eligible GPU's walk through its gaps: `at` is the time it is free, inside gap `gi`. The
    walk knows each gap's start (the worker is waiting) and its forecast end (`ends`), not its true
    end; a unit past the true end is an overrun."""

    def __init__(self, key: tuple[int, int], gaps: list[tuple[float, float]], units: UnitTimes, fits: set[int],
                 ends: list[float] | None = None, box_s: float = DEFAULT_MAX_CHUNK_S):
        self.key, self.gaps, self.units, self.fits = key, gaps, units, fits
        self.ends = [e for _, e in gaps] if ends is None else ends  # the forecast end of each gap
        self.box_s = box_s
        self.gi, self.at = 0, gaps[0][0]
        self.overrun_s = 0.0

    def seek(self, t: float) -> bool:
        """Move to the first free time >= t; False when the iteration's gaps are used up."""
        t = max(t, self.at)
        while self.gi < len(self.gaps) and min(self.gaps[self.gi][1], self.ends[self.gi]) <= t + 1e-12:
            self.gi += 1
        if self.gi >= len(self.gaps):
            return False
        self.at = max(t, self.gaps[self.gi][0])
        return True

    def run(self, idx: int, n: int, arrival: float, out: list[PrefillPlacement]) -> None:
        """Prefill request idx (n tokens) from `at` on, unit by unit across gaps, to its end or the
        iteration's; appends its pieces. A unit starts when it fits the gap's forecast rest; its
        chunk is the box's (`chunk_for_box`)."""
        L = self.units.spec.num_layers
        lo, layer, c = 0, 0, 0
        piece_start, piece_units = None, 0

        def close(done: bool) -> None:
            nonlocal piece_start, piece_units
            if piece_start is not None:
                out.append(PrefillPlacement(idx, n, self.key[0], self.key[1], arrival, piece_start, self.at,
                                            done, piece_units))
            piece_start, piece_units = None, 0

        def next_gap() -> bool:
            close(False)
            self.gi += 1
            if self.gi >= len(self.gaps):
                return False
            self.at = self.gaps[self.gi][0]
            return True

        while True:
            if layer == 0:  # a new chunk: the box's size, whatever the gap
                c = chunk_for_box(self.units, lo, n - lo, self.box_s)
            took = self.units.unit_s(lo, c)
            if took > self.ends[self.gi] - self.at + 1e-12:  # not within the forecast: wait for the next gap
                if not next_gap():
                    return
                continue
            if piece_start is None:
                piece_start = self.at
            self.at += took
            piece_units += 1
            layer += 1
            over = self.at - self.gaps[self.gi][1]
            if layer == L:
                lo, layer = lo + c, 0
            if over > 1e-12:  # the gap really ended inside this unit: training waits for it
                self.overrun_s += over
                if lo >= n:
                    close(True)
                    return
                if not next_gap():
                    return
                continue
            if layer == 0 and lo >= n:
                close(True)
                return


def forecast_gap_ends(gaps: list[tuple[float, float]], forecast: GapForecast | None) -> list[float]:
    """Each gap's forecast end: its start plus `forecast`'s length for it. None: the steady state,
    where the previous iterations' gaps are this one's (the simulated timeline repeats), so the
    forecast is the gap's own length, fed to a GapForecast as the measurements it would have."""
    if forecast is None:
        forecast = GapForecast()
        for i, (s, e) in enumerate(gaps):
            forecast.record(i, e - s)
    out = []
    for i, (s, _) in enumerate(gaps):
        f = forecast.forecast_s(i)
        out.append(s if f is None else s + f)
    return out


SPLIT_CHUNK = 512  # tokens per chunk in a split group (its units cross GPUs whose gaps differ)
SPLIT_INFLIGHT = 16  # requests a split group can hold at once at least (each stage holds their KV caches)


def split_memory_bytes(spec: ModelSpec, layers: int, tokens: int, ends: bool, dtype: str = "bf16",
                       inflight: int = SPLIT_INFLIGHT) -> int:
    """One GPU of a split group: its `layers` decoder layers' 16-bit weights, their KV cache for
    `inflight` requests of `tokens`, one layer's work space, and (`ends`: the first or last
    layer's owner) the embeddings and LM head with one position's fp32 logits (charged whole to both
    ends, an upper bound)."""
    w = DTYPE_BYTES[dtype]
    per_layer = spec.block_params()
    kv = inflight * 2 * layers * tokens * spec.num_kv_heads * spec.head_dim
    work = min(tokens, SPLIT_CHUNK) * (4 * spec.hidden + 2 * spec.ffn_hidden)
    out = (layers * per_layer + kv + work) * w
    if ends:
        out += (spec.embedding_params() + spec.final_norm_params()) * w + 4 * spec.vocab_size
    return int(out)


def split_kv_tokens(spec: ModelSpec, layers: list[int], free: list[int], tokens: int, dtype: str = "bf16") -> int:
    """How many prompt tokens of KV cache a group with this layer split holds at once, summed over
    the requests in flight: the most every GPU's free memory holds beside its layers and one chunk's
    work space for prompts up to `tokens` (split_memory_bytes), at least SPLIT_INFLIGHT requests of
    `tokens` (split_layers placed the layers for that many)."""
    last, caps = len(layers) - 1, []
    for j, n in enumerate(layers):
        if n:
            base = split_memory_bytes(spec, n, tokens, j in (0, last), dtype, inflight=0)
            caps.append((free[j] - base) // (2 * n * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[dtype]))
    return max(SPLIT_INFLIGHT * tokens, int(min(caps)))


def split_layers(spec: ModelSpec, free: list[int], idle: list[float], tokens: int, dtype: str) -> list[int] | None:
    """The inference model's layers over a group's GPUs in order, in proportion to each GPU's idle
    compute time, none over its free memory; None when the group's memory cannot hold them."""
    L, k = spec.num_layers, len(free)
    cap = []
    for j in range(k):
        ends = j in (0, k - 1)
        n = 0
        while n < L and split_memory_bytes(spec, n + 1, tokens, ends, dtype) <= free[j]:
            n += 1
        cap.append(n)
    if sum(cap) < L or cap[0] == 0 or cap[-1] == 0:
        return None
    total = sum(idle) or 1.0
    want = [L * t / total for t in idle]
    got = [min(cap[j], int(want[j])) for j in range(k)]
    got[0], got[-1] = max(got[0], 1), max(got[-1], 1)  # the ends hold the embeddings and the head
    while sum(got) < L:  # the largest shortfall first, where memory allows
        j = max((j for j in range(k) if got[j] < cap[j]), key=lambda j: want[j] - got[j])
        got[j] += 1
    while sum(got) > L:
        j = max((j for j in range(k) if got[j] > (1 if j in (0, k - 1) else 0)), key=lambda j: got[j] - want[j])
        got[j] -= 1
    return got


class _FreeList:
    """A GPU's free compute intervals (its gaps minus what prefill took), sorted and disjoint. With
    `period` (the iteration, repeated back to back) a unit that finds no room before the iteration's
    end may take room at the start of the next one, which is the same free time of every iteration
    (steady state): it is returned as an absolute time past the end, at most one iteration later."""

    def __init__(self, gaps: list[tuple[float, float]], period: float | None = None):
        self.iv = [list(g) for g in gaps]
        self.period = period

    def place(self, ready: float, dur: float) -> float | None:
        """The earliest start >= ready of a `dur`-long unit inside one free interval; taken."""
        tries = [(ready, 0.0)]
        if self.period is not None and ready < 2 * self.period:
            tries.append((max(0.0, ready - self.period), self.period))
        for base, shift in tries:
            for i, (s, e) in enumerate(self.iv):
                start = max(s, base)
                if e - start >= dur - 1e-12:
                    rest = [x for x in ([s, start], [start + dur, e]) if x[1] - x[0] > 1e-12]
                    self.iv[i:i + 1] = rest
                    return start + shift
        return None


class _Group:
    """A pipeline's stages in one datacenter holding ONE copy of the inference model between them
    (stage j its `layers[j]` consecutive layers, docs/models/bubbletea.md): a request's chunk runs layer by
    layer across the GPUs, unit (c, l) after unit (c, l-1) (plus the hidden state's hop to the next
    GPU) and after unit (c-1, l) (that layer's KV cache); each unit at its GPU's earliest free time."""

    def __init__(self, members: list[tuple[int, int]], layers: list[int], gaps: list[list[tuple[float, float]]],
                 units: list[UnitTimes], fits: set[int], hop_s, kv_tokens: int, period: float | None = None,
                 tails: list[tuple[float, int]] = ()):
        self.members, self.layers, self.units, self.fits = members, layers, units, fits
        self.kv_tokens = kv_tokens  # prompt tokens whose KV caches the group holds at once (split_kv_tokens)
        # (end, tokens) of the requests holding caches, by end; `tails`: the previous iteration's
        # requests that run into this one (steady state), ends in this iteration's time
        self.holding: list[tuple[float, int]] = sorted(tails)
        self.log: list[tuple[float, float, int]] = []  # (start, end, tokens) of every request admitted
        self.free = [_FreeList(g, period) for g in gaps]
        self.period = period
        self.owner = [i for i, n in enumerate(layers) for _ in range(n)]
        self.hop_s = hop_s  # hop_s(tokens): the hidden state of a chunk to the next GPU of the group
        self.at = min(g[0][0] for g in gaps if g)
        self.exhausted = False

    def seek(self, t: float) -> bool:
        self.at = max(self.at, t)
        return not self.exhausted

    def run(self, idx: int, n: int, arrival: float, out: list[PrefillPlacement]) -> bool:
        """Prefill request idx (n tokens) chunk by chunk across the group; False when it would start
        past the iteration (with a period), so this iteration starts no more requests here."""
        # starts never decrease: wait until the requests still holding caches leave room for n tokens
        start = max(self.at, arrival)
        self.holding = [(e, m) for e, m in self.holding if e > start]
        held = sum(m for _, m in self.holding)
        while held + n > self.kv_tokens:
            e, m = self.holding.pop(0)
            start, held = max(start, e), held - m
        if self.period is not None and start >= self.period:  # the next iteration's request, not this one's
            self.exhausted = True
            return False
        L = len(self.owner)
        prev_layer = [start] * L  # end of unit (c-1, l)
        pieces: dict[int, list] = {}
        first_end = None
        lo, end = 0, start
        while lo < n:
            c = min(SPLIT_CHUNK, n - lo)
            ready = start if lo == 0 else prev_layer[0]
            for layer in range(L):
                i = self.owner[layer]
                if layer > 0 and self.owner[layer - 1] != i:
                    ready += self.hop_s(c)
                took = self.units[i].unit_s(lo, c)
                at = self.free[i].place(max(ready, prev_layer[layer]), took)
                if at is None:  # no room left in this iteration: the request stays unfinished
                    self.exhausted = True
                    self.log.append((start, float("inf"), n))
                    self._flush(idx, n, arrival, pieces, out, False)
                    return True
                ready = prev_layer[layer] = at + took
                run = pieces.setdefault(i, [])
                if run and abs(run[-1][1] - at) < 1e-12:
                    run[-1][1] = ready
                    run[-1][2] += 1
                else:
                    run.append([at, ready, 1])
            end = ready
            if first_end is None:
                first_end = prev_layer[0]
            lo += c
        self.at = first_end  # the next request enters once this one's first chunk left the first GPU
        bisect.insort(self.holding, (end, n))
        self.log.append((start, end, n))
        self._flush(idx, n, arrival, pieces, out, True, end)
        return True

    def _flush(self, idx, n, arrival, pieces, out, done, end=None) -> None:
        for i, runs in pieces.items():
            for s, e, k in runs:
                out.append(PrefillPlacement(idx, n, *self.members[i], arrival, s, e,
                                            done and e == end, k))


def simulate_bubbletea(sim: SimResult, stage_gpu_types: list[str], stage_free_bytes: list[int],
                       workload: InferenceWorkload, spec: ModelSpec, dtype: str = "bf16",
                       seed: int = 0, forecasts: dict[tuple[int, int], GapForecast] | None = None,
                       box_s: float = DEFAULT_MAX_CHUNK_S) -> PrefillResult:
    """Prefill `workload`'s requests, chunked, in `sim`'s idle compute (one iteration). Where a
    stage cannot hold the whole inference model, also simulated with split groups (each run of a
    pipeline's stages inside one datacenter that has such a stage shares one copy, `_Group`); the
    variant serving more prompt tokens is kept, the other named in the note. `forecasts`: per
    (pipeline, stage) GPU what its worker knows of its gaps (default: the steady state's, each gap's
    length in the previous iterations; `forecast_gap_ends`); `box_s`: the worker's time box."""
    if box_s <= 0:
        raise ValueError(f"bubbletea: the time box must be > 0 s, got {box_s}")
    whole = _simulate(sim, stage_gpu_types, stage_free_bytes, workload, spec, dtype, seed, split=None,
                      forecasts=forecasts, box_s=box_s)
    if set(whole.eligible_stages) == set(range(sim.job.num_stages)):
        return whole
    variants = [(whole, "whole copies only")]
    for how in SPLIT_MODES:
        res = _steady(sim, stage_gpu_types, stage_free_bytes, workload, spec, dtype, seed, how, forecasts)
        if res.split_groups and res.split_groups not in [v.split_groups for v, _ in variants]:
            variants.append((res, f"split groups ({how})"))
    keep, _ = max(variants, key=lambda v: v[0].prefill_tokens_per_s())  # the first of equals: whole copies
    others = "; ".join(f"{how}: {v.prefill_tokens_per_s():.4g} prefill tokens/s (not kept)"
                       for v, how in variants if v is not keep)
    if others:
        keep.note = (keep.note + "; " if keep.note else "") + others
    return keep


def _same_dc_runs(sim: SimResult) -> list[list[int]]:
    """Maximal runs of consecutive stages joined by dedicated (intra-datacenter) hops."""
    kind = {c.name: c.sharing for c in sim.job.channels}
    runs = [[0]]
    for j, hop in enumerate(sim.job.hops):
        if kind[hop] == "dedicated":
            runs[-1].append(j + 1)
        else:
            runs.append([j + 1])
    return runs


SPLIT_MODES = ("run", "minimal", "replicas", "replicas_rich_ends")


def _replica_windows(members: list[tuple[int, int]], holds, free: list[int] | None) -> list[list[tuple[int, int]]]:
    """Groups across a datacenter's pipeline replicas: the (pipeline, stage) GPUs that hold no whole
    copy, in stage order, cut into consecutive windows each just large enough that `holds` finds a
    layer split; GPUs left over join the last window. With `free` (stage free bytes), in each window
    the two GPUs with the most free memory take the ends (the embeddings and the head), so the
    others hold more layers (more work where the idle time is, more hops between GPUs)."""
    out, window = [], []
    for m in members:
        window.append(m)
        if len(window) >= 2 and holds(window):
            out.append(window)
            window = []
    if window and out:
        out[-1] += window
    for i, w in enumerate(out if free is not None else []):
        a, b = sorted(sorted(w, key=lambda m: -free[m[1]])[:2])
        ends = [a] + [m for m in w if m not in (a, b)] + [b]
        if holds(ends):
            out[i] = ends
    return out


def _split_windows(runs: list[list[int]], whole: set[int], free: list[int], holds, mode: str) -> list[list[int]]:
    """The stages that share one copy of the inference model, in groups of consecutive stages inside
    one datacenter (`runs`) that have a stage unable to hold a whole copy (not in `whole`). `run`:
    each such run is one group. `minimal`: from each such stage, the group grows by one neighbour at
    a time (one that holds no whole copy first, then the one with more free memory, then the next
    stage) until `holds(window)` finds a layer split, so the run's other stages keep their whole
    copies."""
    if mode == "run":
        return [run for run in runs if len(run) >= 2 and not set(run) <= whole and holds(run)]
    out, used = [], set()
    for run in runs:
        for j in run:
            if j in whole or j in used:
                continue
            lo = hi = run.index(j)
            while True:
                window = run[lo:hi + 1]
                if len(window) >= 2 and holds(window):
                    out.append(window)
                    used.update(window)
                    break
                grow = [(run[hi + 1] not in whole, free[run[hi + 1]], 1, "hi")] \
                    if hi + 1 < len(run) and run[hi + 1] not in used else []
                grow += [(run[lo - 1] not in whole, free[run[lo - 1]], 0, "lo")] \
                    if lo > 0 and run[lo - 1] not in used else []
                if not grow:
                    break
                side = max(grow)[3]
                lo, hi = (lo - 1, hi) if side == "lo" else (lo, hi + 1)
    return out


def _simulate(sim: SimResult, stage_gpu_types: list[str], stage_free_bytes: list[int],
              workload: InferenceWorkload, spec: ModelSpec, dtype: str, seed: int, split: str | None,
              period: float | None = None, tails: dict | None = None,
              forecasts: dict[tuple[int, int], GapForecast] | None = None,
              box_s: float = DEFAULT_MAX_CHUNK_S) -> PrefillResult:
    T = sim.iteration_s
    lengths = sorted({t for t, _ in workload.prompt_tokens})
    need = {n: prefill_memory_bytes(spec, n, dtype) for n in lengths}
    fits = {j: {n for n in lengths if need[n] <= free} for j, free in enumerate(stage_free_bytes)}
    fits = {j: f for j, f in fits.items() if f}
    units = {g: UnitTimes(spec, g, dtype) for g in set(stage_gpu_types)}
    # (members (pipeline, stage) in layer order, layers per member, prompt lengths, hop channel)
    groups: list[tuple[list[tuple[int, int]], list[int], set[int], object]] = []
    P = sim.job.num_pipelines
    if split:
        chan = {c.name: c for c in sim.job.channels}
        idle = {(r, j): sum(e - s for s, e in compute_idle_gaps(sim, r, j)) for r in range(P)
                for j in range(sim.job.num_stages)}

        def holds(members: list[tuple[int, int]]) -> dict[int, list[int]]:
            ok = {n: split_layers(spec, [stage_free_bytes[j] for _, j in members], [idle[m] for m in members], n, dtype)
                  for n in lengths}
            return {n: l for n, l in ok.items() if l is not None}

        dedicated = [c for c in sim.job.channels if c.sharing == "dedicated"]
        for run in _same_dc_runs(sim):
            hops = [chan[sim.job.hops[j]] for j in run[:-1]] or dedicated  # one datacenter's links
            if split.startswith("replicas"):
                some = [j for j in run if j not in fits  # a GPU that can hold a layer of the model
                        and split_memory_bytes(spec, 1, min(lengths), False, dtype) <= stage_free_bytes[j]]
                windows = _replica_windows([(r, j) for j in some for r in range(P)], holds,
                                           stage_free_bytes if split == "replicas_rich_ends" else None) \
                    if P > 1 and hops else []
            else:
                windows = [[(r, j) for j in w] for w in _split_windows(
                    [run], set(fits), stage_free_bytes, lambda w: holds([(0, j) for j in w]), split)
                    for r in range(P)]
            for members in windows:
                ok = holds(members)  # the layer split for the longest prompt it holds (it holds every shorter one)
                groups.append((members, ok[max(ok)], set(ok), hops))
        if groups:
            fits = {j: f for j, f in fits.items() if not any(j == m[1] for g in groups for m in g[0])}
    gpus: list = []
    for r in range(P):
        for j in sorted(fits):
            gaps = compute_idle_gaps(sim, r, j)
            if gaps:
                ends = forecast_gap_ends(gaps, (forecasts or {}).get((r, j)))
                gpus.append(_Gpu((r, j), gaps, units[stage_gpu_types[j]], fits[j], ends, box_s))
    for members, layers, ns, hops in groups:
        lat, gbps = max(c.latency_s for c in hops), min(c.per_transfer_gbps for c in hops)
        act = spec.hidden * DTYPE_BYTES[dtype] * 8  # bits of one token's hidden state
        # a split group's units go where the forecast and the gap agree (its overrun is not modelled)
        gaps = []
        for r, j in members:
            true = compute_idle_gaps(sim, r, j)
            ends = forecast_gap_ends(true, (forecasts or {}).get((r, j)))
            gaps.append([(s, min(e, f)) for (s, e), f in zip(true, ends) if min(e, f) > s])
        if all(gaps[i] for i, n in enumerate(layers) if n):
            gpus.append(_Group(members, layers, gaps, [units[stage_gpu_types[j]] for _, j in members], ns,
                               lambda c, lat=lat, gbps=gbps, act=act: lat + c * act / (gbps * 1e9),
                               split_kv_tokens(spec, layers, [stage_free_bytes[j] for _, j in members], max(ns),
                                               dtype), period, (tails or {}).get(tuple(members), ())))
    eligible = set(fits) | {j for g in groups for _, j in g[0]}
    res = PrefillResult(T, sim.job.num_gpus, sim.compute_busy_s(), tuple(sorted(eligible)), backlog=workload.backlog)
    res.split_groups = [{"stages": [j for _, j in members], "layers": layers}
                        | ({"pipelines": [r for r, _ in members]} if split.startswith("replicas") else {})
                        for members, layers, _, _ in groups if split.startswith("replicas") or members[0][0] == 0]
    res.fillable_s = sum(e - s for r in range(sim.job.num_pipelines) for j in eligible
                         for s, e in compute_idle_gaps(sim, r, j))
    servable = set().union(*fits.values(), *(g[2] for g in groups))
    if not servable or not gpus:
        res.note = (f"no stage has {min(need.values()) / 2**30:.1f} GiB free for {spec.name} prefill"
                    if not servable else "no eligible GPU has idle compute")
        return res
    if servable != set(lengths):
        res.note = f"prompt lengths {sorted(set(lengths) - servable)} fit no GPU's free memory"

    # the queue: (arrival, index, tokens), in arrival order
    gen = _request_lengths(workload)
    queue: list[tuple[float, int, int]] = []
    if not workload.backlog:
        expected = workload.requests_per_s * T
        if expected > MAX_PREFILL_REQUESTS:
            raise ValueError(f"inference: requests_per_s {workload.requests_per_s:g} over a {T:.3g} s iteration is "
                             f"{expected:.3g} requests, over the simulator's limit of {MAX_PREFILL_REQUESTS}")
        rng, t = random.Random(seed), 0.0
        while True:
            t += rng.expovariate(workload.requests_per_s)
            if t >= T:
                break
            queue.append((t, len(queue), next(gen)))
        res.requests_offered = len(queue)
        queue = [q for q in queue if q[2] in servable]  # unservable lengths stay unserved (counted offered)
    next_index = len(queue)

    def backlog_fill() -> None:
        nonlocal next_index
        while len(queue) < LOOKAHEAD:
            n = next(gen)
            if n in servable:
                queue.append((0.0, next_index, n))
            next_index += 1

    heap = [(g.at, i) for i, g in enumerate(gpus)]
    heapq.heapify(heap)
    started = 0
    while heap:
        if workload.backlog:
            backlog_fill()
        elif not queue:
            res.queue_ran_dry = True
            break
        t, i = heapq.heappop(heap)
        g = gpus[i]
        pick = next((qi for qi, (a, _, n) in enumerate(queue[:LOOKAHEAD]) if a <= t and n in g.fits), None)
        if pick is None:  # nothing waiting that this GPU can hold: wait for the next such arrival
            later = next((a for a, _, n in queue if a > t and n in g.fits), None)
            if later is not None and g.seek(later):
                heapq.heappush(heap, (g.at, i))
            continue
        if started >= MAX_PREFILL_REQUESTS:
            res.note = (res.note + "; " if res.note else "") + \
                f"stopped at {MAX_PREFILL_REQUESTS} started requests (the simulator's limit): a lower bound"
            break
        arrival, idx, n = queue.pop(pick)
        if g.run(idx, n, arrival, res.placements) is False:  # it starts no request this iteration any more
            queue.insert(pick, (arrival, idx, n))
            continue
        started += 1
        if g.seek(g.at):
            heapq.heappush(heap, (g.at, i))
    res.group_logs = {tuple(g.members): (g.log, g.kv_tokens) for g in gpus if isinstance(g, _Group)}
    res.overrun_s = sum(g.overrun_s for g in gpus if isinstance(g, _Gpu))
    return res


WRAP_PASSES = 3  # simulations that look for a steady state of split groups running past the iteration's end


def _steady(sim: SimResult, stage_gpu_types: list[str], stage_free_bytes: list[int], workload: InferenceWorkload,
            spec: ModelSpec, dtype: str, seed: int, split: str,
            forecasts: dict[tuple[int, int], GapForecast] | None = None) -> PrefillResult:
    """`_simulate` with split groups whose requests may run past the iteration's end into the start of
    the next (iterations repeat back to back: the same free time, `_FreeList`). Those requests hold
    their caches at the next iteration's start too, so each pass admits requests beside the previous
    pass's tails, and a pass is kept once its own schedule, repeated, never holds more cache tokens
    than a group's bound (`_peak_tokens`); after WRAP_PASSES without, no group runs past the end."""
    T, tails = sim.iteration_s, {}
    for _ in range(WRAP_PASSES):
        res = _simulate(sim, stage_gpu_types, stage_free_bytes, workload, spec, dtype, seed, split, T, tails,
                        forecasts)
        if all(_peak_tokens(log, T) <= cap for log, cap in res.group_logs.values()):
            return res
        tails = {k: [(e - T, n) for _, e, n in log if e > T] for k, (log, _) in res.group_logs.items()}
    return _simulate(sim, stage_gpu_types, stage_free_bytes, workload, spec, dtype, seed, split, forecasts=forecasts)


def _peak_tokens(log: list[tuple[float, float, int]], period: float) -> int:
    """The most prompt tokens whose caches a group holds at once when the iteration repeats: each
    request over [start, end) of its iteration, the part past the end over the next one's start."""
    events = []
    for s, e, n in log:
        events += [(s, n), (min(e, period), -n)]
        if e > period:
            events += [(0.0, n), (min(e - period, period), -n)]
    peak = held = 0
    for _, d in sorted(events):  # at one instant the ends (negative) before the starts
        held += d
        peak = max(peak, held)
    return peak


def steady_state_gaps(gaps: list[tuple[float, float]], iteration_s: float) -> list[tuple[float, float]]:
    """Iterations repeat back to back, so a GPU idle at the end of one and at the start of the next
    has one idle interval across the boundary: [last gap's start, T + first gap's end)."""
    if len(gaps) > 1 and gaps[0][0] <= 0.0 and gaps[-1][1] >= iteration_s:
        return gaps[1:-1] + [(gaps[-1][0], iteration_s + gaps[0][1])]
    return gaps


def reservations(result: PrefillResult) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """The placements as intervals each GPU is taken (pipeline_sim's `reserved`); a prefill that
    runs past the iteration's end continues at the start of the next (same timeline)."""
    T = result.iteration_s
    out: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for p in result.placements:
        took = out.setdefault((p.pipeline, p.stage), [])
        if p.end_s <= T:
            took.append((p.start_s, p.end_s))
        else:
            took += [(p.start_s, T)] if p.start_s < T else []
            took.append((max(p.start_s, T) - T, p.end_s - T))
    return out


def _subtract(iv: tuple[float, float], cuts: list[tuple[float, float]]) -> tuple[list, list]:
    """(parts of iv outside every cut, parts inside one); cuts sorted and disjoint."""
    s, e = iv
    outside, inside = [], []
    for cs, ce in cuts:
        if ce <= s or cs >= e:
            continue
        if cs > s:
            outside.append((s, cs))
        inside.append((max(s, cs), min(e, ce)))
        s = ce
        if s >= e:
            break
    if s < e:
        outside.append((s, e))
    return outside, inside


def split_reservations(result: PrefillResult, sim: SimResult) -> tuple[dict, dict]:
    """`reservations(result)` split per GPU into (the parts over no training operation: pass them to
    the simulator as reserved, the parts over a collective: they must overlap no compute operation,
    which the caller checks on the re-simulated timeline)."""
    comm: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for o in sim.ops + sim.step_ops:
        if o.kind not in COMPUTE_KINDS and o.kind != "P" and o.end_s > o.start_s:
            comm.setdefault((o.pipeline, o.stage), []).append((o.start_s, o.end_s))
    merged: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for k, ivs in comm.items():
        m: list[list[float]] = []
        for s, e in sorted(ivs):
            if m and s <= m[-1][1]:
                m[-1][1] = max(m[-1][1], e)
            else:
                m.append([s, e])
        merged[k] = [(s, e) for s, e in m]
    free, during = {}, {}
    for k, ivs in reservations(result).items():
        for iv in ivs:
            out, inside = _subtract(iv, merged.get(k, []))
            free.setdefault(k, []).extend(out)
            if inside:
                during.setdefault(k, []).extend(inside)
    return free, during


def training_unchanged(sim: SimResult, result: PrefillResult) -> bool:
    """Whether `result`'s prefill leaves `sim`'s training as it was: re-simulated with the prefill
    outside the collectives reserved, every training op at the same times, and the prefill inside a
    collective overlapping no compute op of that timeline."""
    reserved, during = split_reservations(result, sim)
    again = simulate_pipeline(sim.job, reserved)
    before, after = sim.training_ops(), again.training_ops()
    if before.keys() != after.keys() or any(abs(before[k][0] - after[k][0]) >= 1e-9 or
                                            abs(before[k][1] - after[k][1]) >= 1e-9 for k in before):
        return False
    for o in again.ops + again.step_ops:
        if o.kind in COMPUTE_KINDS:
            if any(s < o.end_s - 1e-9 and e > o.start_s + 1e-9 for s, e in during.get((o.pipeline, o.stage), [])):
                return False
    return True
