"""BubbleTea: run inference prefill requests in the bubbles of a training pipeline.

Given one simulated training iteration, place prefill requests into the idle
intervals of the GPUs whose stage leaves enough memory free for the inference
model, each request on one GPU and entirely inside one idle interval, so no
training operation moves (the caller re-simulates with the placements as
reserved intervals to prove it). A free GPU takes, among the first LOOKAHEAD
waiting requests, the longest that fits the rest of its gap (best fit, oldest on
a tie). With `requests_per_s`, requests arrive as a Poisson process with lengths in
the distribution's proportions, and the time to first token is measured. With a
backlog, requests of every listed length are always waiting: the bubbles take
what fits, so the served mix (reported) leans to the shorter prompts.

Prefill time: the profile store's forward time of one sequence of the prompt's
length on that GPU type (a third of `get_step_profile(...).step_time_s(1)`; the
profile counts the LM head over every position, a slight over-estimate).
Prefill memory (per GPU, documented formula): the 16-bit weights, the KV cache
`2 · L · n · kv_heads · head_dim` elements, and one layer's transient work
space `n · (4·h + 2·ffn)` elements, plus one position's fp32 logits.
"""
from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, field

from planner.geo.scenario import InferenceWorkload
from planner.geo.pipeline_sim import SimResult
from planner.core.specs import ModelSpec, with_max_seq
from planner.core.constants import DTYPE_BYTES

LOOKAHEAD = 32  # how far down the queue a free GPU looks for a request that fits its gap
# Requests simulated in one iteration (offered in rate mode, placed with a backlog): each is a
# Python object and a reserved interval in the re-simulation, so the work stays bounded.
MAX_PREFILL_REQUESTS = 100_000


@dataclass(frozen=True)
class PrefillPlacement:
    request: int
    tokens: int
    pipeline: int
    stage: int
    arrival_s: float
    start_s: float
    end_s: float


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

    @property
    def prefill_busy_s(self) -> float:
        return sum(p.end_s - p.start_s for p in self.placements)

    def gpu_utilization_with_prefill(self) -> float:
        return (self.training_busy_s + self.prefill_busy_s) / (self.num_gpus * self.iteration_s)

    def prefill_tokens_per_s(self) -> float:
        return sum(p.tokens for p in self.placements) / self.iteration_s

    def ttft_s(self) -> list[float]:
        """Time to first token of each served request: queueing plus prefill (rate mode only)."""
        return [] if self.backlog else sorted(p.end_s - p.arrival_s for p in self.placements)

    def summary(self) -> dict:
        ttft = self.ttft_s()
        served = [p.tokens for p in self.placements]
        return {
            "served_mean_prompt_tokens": statistics.fmean(served) if served else None,
            "prefill_requests_served": len(self.placements),
            "prefill_requests_offered": None if self.backlog else self.requests_offered,
            "prefill_tokens_per_s": self.prefill_tokens_per_s(),
            "prefill_busy_s": self.prefill_busy_s,
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p99_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
            "eligible_stages": list(self.eligible_stages),
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


def _request_lengths(workload: InferenceWorkload):
    """An endless deterministic sequence following the distribution (largest deficit first)."""
    counts = [0] * len(workload.prompt_tokens)
    i = 0
    while True:
        i += 1
        k = max(range(len(counts)), key=lambda j: workload.prompt_tokens[j][1] * i - counts[j])
        counts[k] += 1
        yield workload.prompt_tokens[k][0]


def simulate_bubbletea(sim: SimResult, stage_gpu_types: list[str], stage_free_bytes: list[int],
                       workload: InferenceWorkload, spec: ModelSpec, dtype: str = "bf16",
                       seed: int = 0) -> PrefillResult:
    """Place `workload`'s prefill requests into `sim`'s idle intervals (one iteration)."""
    T = sim.iteration_s
    lengths = sorted({t for t, _ in workload.prompt_tokens})
    need = {n: prefill_memory_bytes(spec, n, dtype) for n in lengths}
    # per stage: prefill time of each prompt length that fits the memory training leaves free
    dur: dict[int, dict[int, float]] = {}
    took = {(g, n): prefill_time_s(spec, n, g, dtype) for g in set(stage_gpu_types) for n in lengths}
    for j, (g, free) in enumerate(zip(stage_gpu_types, stage_free_bytes)):
        fits = {n: took[(g, n)] for n in lengths if need[n] <= free}
        if fits:
            dur[j] = fits
    gaps = {(r, j): steady_state_gaps(sim.idle_intervals(r, j), T) for r in range(sim.job.num_pipelines) for j in dur}
    # a prompt length that fits no GPU's memory or no gap can never be served by this job
    longest = {j: max((e - s for (_, jj), g in gaps.items() if jj == j for s, e in g), default=0.0) for j in dur}
    servable = {n for j in dur for n, t in dur[j].items() if t <= longest[j]}
    res = PrefillResult(T, sim.job.num_gpus, sim.compute_busy_s(), tuple(sorted(dur)), backlog=workload.backlog)
    if not servable:
        res.note = (f"no stage has both {min(need.values()) / 2**30:.1f} GiB free for {spec.name} prefill "
                    f"and an idle interval long enough")
        return res
    if servable != set(lengths):
        res.note = f"prompt lengths {sorted(set(lengths) - servable)} fit no GPU's free memory or idle interval"

    # the queue: (arrival, index, tokens); a backlog holds one of each servable length, refilled
    queue: list[tuple[float, int, int]] = []
    if workload.backlog:
        queue = [(0.0, i, n) for i, n in enumerate(sorted(servable))]
    else:
        expected = workload.requests_per_s * T
        if expected > MAX_PREFILL_REQUESTS:
            raise ValueError(f"inference: requests_per_s {workload.requests_per_s:g} over a {T:.3g} s iteration is "
                             f"{expected:.3g} requests, over the simulator's limit of {MAX_PREFILL_REQUESTS}")
        gen = _request_lengths(workload)
        rng, t = random.Random(seed), 0.0
        while True:
            t += rng.expovariate(workload.requests_per_s)
            if t >= T:
                break
            queue.append((t, len(queue), next(gen)))
        res.requests_offered = len(queue)
    next_index = len(queue)

    queue = [q for q in queue if q[2] in servable]  # unservable lengths stay unserved (rate mode: counted)
    # a heap of (time the GPU is free for prefill, gpu, gap index) over every eligible GPU's gaps
    heap = [(g[0][0], w, 0) for w, g in gaps.items() if g]
    heapq.heapify(heap)
    while heap and queue:
        if len(res.placements) >= MAX_PREFILL_REQUESTS:
            res.note = (res.note + "; " if res.note else "") + \
                f"stopped at {MAX_PREFILL_REQUESTS} placed requests (the simulator's limit): a lower bound"
            break
        t, w, gi = heapq.heappop(heap)
        gap_end = gaps[w][gi][1]
        pick, longest_fit = None, 0.0
        for qi, (arrival, idx, n) in enumerate(queue[:LOOKAHEAD]):
            if arrival > t:
                break  # the queue is in arrival order
            took = dur[w[1]].get(n)
            if took is not None and t + took <= gap_end and took > longest_fit:
                pick, longest_fit = qi, took  # best fit: the longest waiting request the gap holds
        if pick is not None:
            arrival, idx, n = queue.pop(pick)
            end = t + dur[w[1]][n]
            res.placements.append(PrefillPlacement(idx, n, w[0], w[1], arrival, t, end))
            heapq.heappush(heap, (end, w, gi))
            if workload.backlog:
                queue.insert(pick, (0.0, next_index, n))
                next_index += 1
            continue
        later = next((a for a, _, _ in queue[:LOOKAHEAD] if a > t), None)
        if later is not None and later < gap_end:
            heapq.heappush(heap, (later, w, gi))  # wait inside the gap for the next arrival
        elif gi + 1 < len(gaps[w]):
            heapq.heappush(heap, (gaps[w][gi + 1][0], w, gi + 1))
    return res


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
