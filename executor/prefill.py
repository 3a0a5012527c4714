"""BubbleTea for real: inference prefill run in a pipeline rank's idle time, in bounded chunks.

While a training rank of a pipeline plan waits for a receive, the worker calls `PrefillWorker.step()`
over and over; each call does ONE bounded unit of chunked prefill (one decoder layer over one token
chunk, with a KV cache per layer) and returns, so a receive that completes mid-call delays training
by at most one unit. The chunk size follows the measured unit times, aiming at half the time box
(`max_chunk_s`); every unit's duration is recorded. The worker never knows when the current wait
ends. Told where each wait begins and ends (`gap_begin(key)` / `gap_end()`, the key naming the
receive, stable across steps), it keeps each wait's measured length (planner.geo.bubbletea.GapForecast)
and starts a unit only if its predicted time fits the wait's forecast from previous steps: the rule
the simulator (planner/geo/bubbletea.py) prices. Without those calls it starts a unit whenever asked.
The inference model is a preset decoder with its own weights (drawn under `fork_rng`, so training
is the same with and without prefill); requests come from the config (a geo scenario's `inference`
keys: a Poisson rate or a backlog). Times are `time.perf_counter()`; `last_chunk` feeds the
timeline's "prefill" ops.

The chunking, the controller, the config keys and how the simulator predicts it:
docs/models/bubbletea.md.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from models.decoder import build_model, rotate_half
from planner.geo.bubbletea import CHUNK_TARGET, DEFAULT_MAX_CHUNK_S, GapForecast
from planner.geo.scenario import InferenceWorkload
from contracts.specs import get_model

log = logging.getLogger(__name__)

# DEFAULT_MAX_CHUNK_S (a few ms: the most a training op may wait behind one step()) and CHUNK_TARGET
# (each unit aimed at this fraction of the box: the next chunk has a longer context) are the
# simulator's, imported above, so both size units alike.
STEP_BOUNDS = (0.5, 1.5)  # the most one chunk's timing may shrink or grow the next chunk's size
CALIBRATION_CHUNKS = (4, 32)  # tokens of the two chunks timed at construction: a + b·tokens from both
RUNTIME_KEYS = ("max_chunk_s", "num_requests", "stages", "dtype")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class PrefillRequest:
    """One inference request; times are seconds since the worker's first step()."""

    index: int
    num_tokens: int
    arrival_s: float
    start_s: float | None = None
    end_s: float | None = None
    busy_s: float = 0.0  # the compute of its units (the time between them is training's)
    first_token: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "tokens": self.num_tokens, "arrival_s": self.arrival_s, "start_s": self.start_s,
                "end_s": self.end_s, "busy_s": self.busy_s, "first_token": self.first_token}


@dataclass
class _InFlight:
    """The request being prefilled: where it is (chunk [lo, hi), next layer) and its KV cache."""

    req: PrefillRequest
    ids: torch.Tensor  # (1, n) token ids
    rope: tuple[torch.Tensor, torch.Tensor] | None  # (n, hd) cos, sin, or None (learned positions)
    lo: int = 0
    hi: int = 0
    layer: int = 0  # next unit: layer 0..L-1 of chunk [lo, hi), L = the head (last chunk only)
    x: torch.Tensor | None = None  # (1, hi-lo, h) the chunk's residual stream
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer (1, nkv, n, hd), filled up to hi
    values: list[torch.Tensor] = field(default_factory=list)


def _percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of the values; None for none."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def parse_config(config: Any) -> tuple[InferenceWorkload, dict[str, Any]]:
    """(the workload, the runtime options) of a prefill config; ValueError naming the bad key."""
    if not isinstance(config, dict):
        raise ValueError(f"prefill: the config must be a JSON object, got {type(config).__name__}")
    workload = InferenceWorkload.from_dict({k: v for k, v in config.items() if k not in RUNTIME_KEYS}, "prefill")
    box = config.get("max_chunk_s", DEFAULT_MAX_CHUNK_S)
    if isinstance(box, bool) or not isinstance(box, (int, float)) or not 0 < box <= 1:
        raise ValueError(f"prefill: max_chunk_s must be a number of seconds in (0, 1], got {box!r}")
    limit = config.get("num_requests")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"prefill: num_requests must be a positive integer, got {limit!r}")
    stages = config.get("stages")
    if stages is not None and (not isinstance(stages, list) or
                               not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in stages)):
        raise ValueError(f"prefill: stages must be a list of stage indices, got {stages!r}")
    dtype = config.get("dtype", "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"prefill: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    spec = get_model(workload.model)
    longest = max(t for t, _ in workload.prompt_tokens)
    if longest > spec.max_seq:
        raise ValueError(f"prefill: a prompt of {longest} tokens exceeds {spec.name}'s max_seq {spec.max_seq}")
    return workload, {"max_chunk_s": float(box), "num_requests": limit,
                      "stages": None if stages is None else tuple(stages), "dtype": dtype}


def runs_on_stage(config: dict[str, Any], stage: int) -> bool:
    """Whether the ranks of pipeline stage `stage` run this prefill config (default: every stage)."""
    stages = parse_config(config)[1]["stages"]
    return stages is None or stage in stages


class PrefillWorker:
    """Real prefill of a stream of requests, one bounded unit per `step()`."""

    def __init__(self, workload: InferenceWorkload, device: torch.device, seed: int = 0,
                 max_chunk_s: float = DEFAULT_MAX_CHUNK_S, num_requests: int | None = None, dtype: str = "fp32"):
        self.workload, self.device, self.seed = workload, torch.device(device), seed
        self.max_chunk_s, self.num_requests = max_chunk_s, num_requests
        self.spec = get_model(workload.model)
        with torch.random.fork_rng(devices=[]):  # own weights; the training rank's RNG untouched
            torch.manual_seed(seed)
            self.model = build_model(self.spec).to(self.device, DTYPES[dtype]).eval()
        self._rng = random.Random(seed)
        self._tokens = torch.Generator().manual_seed(seed)
        self.t0: float | None = None  # perf_counter of the first step(): the arrival clock's zero
        self.end_wall: float | None = None
        self.requests: list[PrefillRequest] = []  # every arrival so far, in order
        self._next = 0  # index of the next request to start
        self._pending_arrival: float | None = None  # the next Poisson arrival, drawn, not yet reached
        self._current: _InFlight | None = None
        self.unit_s: list[float] = []  # every unit's measured duration (wall)
        # and the thread's CPU time in it: a unit over the box by wall time but not by CPU time was
        # preempted (other processes on the machine), not sized too large
        self.unit_cpu_s: list[float] = []
        self.last_chunk: tuple[float, float] | None = None
        self.last_logits: torch.Tensor | None = None  # (V,) of the last finished request's last position
        self.last_ids: torch.Tensor | None = None  # (1, n) that request's prompt
        self._samples: list[tuple[int, float]] = []  # (tokens, seconds) of the last chunk's layer units
        self._chunk = 1  # tokens per chunk now (the controller's state)
        self._fixed_s, self._per_token_s = 0.0, 0.0  # a layer unit ≈ fixed + per_token · tokens (calibrated)
        self.forecast = GapForecast()  # each wait's measured lengths, by its key
        self._gap: tuple[Any, float, float] | None = None  # the open wait: (key, start, deadline)
        self.skipped_units = 0  # step() calls that started no unit because it would not fit the forecast
        self._calibrate()

    @classmethod
    def from_config(cls, config: dict[str, Any], device: torch.device, seed: int) -> "PrefillWorker":
        workload, opts = parse_config(config)
        return cls(workload, device, seed, opts["max_chunk_s"], opts["num_requests"], opts["dtype"])

    # ---- requests -------------------------------------------------------------------------------

    def _draw_length(self) -> int:
        tokens, weights = zip(*self.workload.prompt_tokens)
        return self._rng.choices(tokens, weights)[0]

    def _arrive(self, now_s: float) -> None:
        """Append the arrivals up to `now_s` (a backlog: one waiting request at any time)."""
        def room() -> bool:
            return self.num_requests is None or len(self.requests) < self.num_requests

        if self.workload.backlog:
            if self._next == len(self.requests) and room():
                self.requests.append(PrefillRequest(len(self.requests), self._draw_length(), now_s))
            return
        rate = self.workload.requests_per_s
        while room():
            last = self.requests[-1].arrival_s if self.requests else 0.0
            if self._pending_arrival is None:
                self._pending_arrival = last + self._rng.expovariate(rate)
            if self._pending_arrival > now_s:
                return
            self.requests.append(PrefillRequest(len(self.requests), self._draw_length(), self._pending_arrival))
            self._pending_arrival = None

    def _start(self, req: PrefillRequest, now_s: float) -> _InFlight:
        req.start_s = now_s
        ids = torch.randint(0, self.spec.vocab_size, (1, req.num_tokens), generator=self._tokens).to(self.device)
        rope = self.model.rope(req.num_tokens, self.device)
        return _InFlight(req, ids, rope)

    # ---- the units of chunked prefill ---------------------------------------------------------------

    def _chunk_tokens(self, remaining: int) -> int:
        """Tokens in the next chunk. A controller on the measured unit time t: the chunk size is scaled
        by target / t (at most STEP_BOUNDS per chunk), target = CHUNK_TARGET of the box. With units of
        a + b·n seconds it settles where a + b·n = target (the step's slope there is a / target < 1),
        fixed cost included, which a size from time per token alone would not: that counts the fixed
        cost per token and spirals down to one-token units of pure overhead. t is the median over the
        last chunk's layers: one preempted unit (another process's time) does not halve the chunk."""
        full = [t for n, t in self._samples if n == self._chunk]  # a prompt's short remainder says nothing
        if len(full) == len(self._samples) and full:
            ratio = CHUNK_TARGET * self.max_chunk_s / max(statistics.median(full), 1e-12)
            self._chunk = max(1, round(self._chunk * min(max(ratio, STEP_BOUNDS[0]), STEP_BOUNDS[1])))
        self._samples.clear()
        return max(1, min(remaining, self._chunk))

    def _attend(self, block: Any, f: _InFlight, h: torch.Tensor) -> torch.Tensor:
        """Attention of chunk [lo, hi) at one layer: its queries on the cached keys/values of
        positions [0, lo) and its own [lo, hi), causally; appends its keys/values to the cache."""
        attn, (lo, hi) = block.attn, (f.lo, f.hi)
        B, T, _ = h.shape
        q = attn.q_proj(h).view(B, T, attn.num_heads, attn.head_dim).transpose(1, 2)  # (1, nh, T, hd)
        k = attn.k_proj(h).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # (1, nkv, T, hd)
        v = attn.v_proj(h).view(B, T, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # (1, nkv, T, hd)
        if f.rope is not None:
            cos, sin = f.rope[0][lo:hi], f.rope[1][lo:hi]  # (T, hd): positions lo..hi-1
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        i = f.layer
        if not lo:  # the request's first chunk: this layer's cache for the whole prompt, filled chunk by chunk
            n = f.req.num_tokens
            f.keys.append(k.new_empty(B, attn.num_kv_heads, n, attn.head_dim))  # (1, nkv, n, hd)
            f.values.append(v.new_empty(B, attn.num_kv_heads, n, attn.head_dim))
        f.keys[i][:, :, lo:hi], f.values[i][:, :, lo:hi] = k, v
        gqa = attn.num_kv_heads != attn.num_heads
        if lo:
            k, v = f.keys[i][:, :, :hi], f.values[i][:, :, :hi]  # (1, nkv, hi, hd): positions 0..hi-1
            # query t (position lo+t) sees keys 0..lo+t: SDPA's is_causal aligns top-left, so a mask
            mask = torch.arange(hi, device=h.device)[None, :] <= torch.arange(lo, hi, device=h.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)  # (1, nh, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # as the model's own
        return attn.o_proj(y.transpose(1, 2).reshape(B, T, attn.num_heads * attn.head_dim))

    @torch.no_grad()
    def _unit(self, f: _InFlight) -> bool:
        """One unit of `f`; True when the request is done (its first token known)."""
        m, L = self.model, self.spec.num_layers
        if f.layer == L:  # the head, on the prompt's last position only
            logits = m.head_logits(f.x[:, -1:, :])[0, -1]  # (V,)
            self.last_logits, self.last_ids = logits.float(), f.ids
            f.req.first_token = int(logits.argmax())
            return True
        if f.layer == 0:
            f.lo, f.hi = f.hi, f.hi + self._chunk_tokens(f.req.num_tokens - f.hi)
            x = m.embed(f.ids[:, f.lo:f.hi])  # (1, T, h)
            if m.pos_embed is not None:
                x = x + m.pos_embed(torch.arange(f.lo, f.hi, device=self.device))
            f.x = x
        block = m.blocks[f.layer]
        x = f.x + self._attend(block, f, block.attn_norm(f.x))
        f.x = x + block.mlp(block.mlp_norm(x))
        f.layer += 1
        if f.layer == L and f.hi < f.req.num_tokens:
            f.layer = 0  # next chunk; the head runs after the last chunk only
        return False

    def _timed_unit(self, f: _InFlight) -> tuple[bool, float, float]:
        head = f.layer == self.spec.num_layers
        start = time.perf_counter()
        done = self._unit(f)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the unit's kernels end inside the call: a real bound
        end = time.perf_counter()
        if not head:
            self._samples.append((f.hi - f.lo, end - start))
        return done, start, end

    def _calibrate(self) -> None:
        """The first chunk size, from a + b·tokens of a layer unit: a dummy prompt in a
        CALIBRATION_CHUNKS[0]-token chunk then a CALIBRATION_CHUNKS[1]-token one through every unit
        (cache-free and cached attention, the head), once to warm up, then twice timed; the least
        time of each size over layers and runs. ValueError when a one-token unit exceeds the box."""
        small, large = CALIBRATION_CHUNKS
        n = min(small + large, self.spec.max_seq)
        ids = torch.zeros((1, n), dtype=torch.long, device=self.device)
        best: dict[int, float] = {}
        for round_ in range(3):
            f, done = _InFlight(PrefillRequest(-1, n, 0.0), ids, self.model.rope(n, self.device)), False
            while not done:
                if f.layer == 0:
                    self._samples.clear()
                    self._chunk = small if f.hi == 0 else large
                seen = len(self._samples)
                done = self._timed_unit(f)[0]
                for tokens, t in self._samples[seen:] if round_ else ():  # a layer unit's (not the head's)
                    best[tokens] = min(best.get(tokens, math.inf), t)
        self._samples.clear()
        self.last_logits = self.last_ids = None  # the dummy's
        lo, hi = min(best), max(best)
        per_token = max((best[hi] - best[lo]) / (hi - lo), 1e-9) if hi > lo else best[lo] / lo
        fixed = max(best[lo] - lo * per_token, 0.0)
        if fixed + per_token > self.max_chunk_s:
            raise ValueError(f"prefill: one layer of {self.spec.name} over one token takes "
                             f"{(fixed + per_token) * 1e3:.2f} ms here, over the time box max_chunk_s "
                             f"{self.max_chunk_s * 1e3:.2f} ms")
        self._chunk = max(1, int((CHUNK_TARGET * self.max_chunk_s - fixed) / per_token))
        self._fixed_s, self._per_token_s = fixed, per_token

    # ---- what the worker knows of the waits ---------------------------------------------------------

    def gap_begin(self, key: Any, now: float | None = None) -> float:
        """A wait for receive `key` begins (now, perf_counter): its deadline is now + the forecast of
        its length from previous steps (now when never measured: no unit this time). Returns it."""
        now = time.perf_counter() if now is None else now
        f = self.forecast.forecast_s(key)
        deadline = now + (f if f is not None else 0.0)
        self._gap = (key, now, deadline)
        return deadline

    def gap_end(self, now: float | None = None) -> None:
        """The open wait ended (its receive completed): its length is measured for the next steps."""
        if self._gap is None:
            raise ValueError("prefill: gap_end() without gap_begin()")
        now = time.perf_counter() if now is None else now
        key, start, _ = self._gap
        self.forecast.record(key, now - start)
        self._gap = None

    def predicted_unit_s(self) -> float:
        """The next unit's time as the worker predicts it: the median of the last chunk's measured
        layer units, else the calibrated fixed + per-token line at the current chunk size."""
        if self._samples:
            return statistics.median(t for _, t in self._samples)
        return self._fixed_s + self._per_token_s * self._chunk

    # ---- the worker's calls -------------------------------------------------------------------------

    def step(self) -> bool:
        """One unit of prefill work (under the time box), or False at once when no request is waiting
        or, inside a wait opened by gap_begin(), when the unit's predicted time does not fit before
        the wait's forecast end."""
        now = time.perf_counter()
        if self._gap is not None and now + self.predicted_unit_s() > self._gap[2]:
            self.skipped_units += 1
            return False
        if self.t0 is None:
            self.t0 = now
        if self._current is None:
            self._arrive(now - self.t0)
            if self._next >= len(self.requests):
                return False
            self._current = self._start(self.requests[self._next], now - self.t0)
            self._next += 1
        f = self._current
        cpu0 = time.thread_time()
        done, start, end = self._timed_unit(f)
        self.unit_cpu_s.append(time.thread_time() - cpu0)
        self.unit_s.append(end - start)
        self.last_chunk = (start, end)
        f.req.busy_s += end - start
        if done:
            f.req.end_s = end - self.t0
            self._current = None
        return True

    def summary(self) -> dict[str, Any]:
        """The run's figures, measured: throughput over wall and busy time, TTFT, the units' durations."""
        end = self.end_wall if self.end_wall is not None else time.perf_counter()
        wall = 0.0 if self.t0 is None else end - self.t0
        done = [r for r in self.requests if r.end_s is not None]
        tokens = sum(r.num_tokens for r in done)
        busy_done = sum(r.busy_s for r in done)
        ttft = [r.ttft_s for r in done] if not self.workload.backlog else []
        latency = [r.end_s - r.start_s for r in done]
        return {
            "model": self.spec.name, "device": str(self.device), "seed": self.seed,
            "workload": self.workload.to_dict(), "max_chunk_s": self.max_chunk_s,
            "wall_s": wall, "busy_s": sum(self.unit_s),
            "requests_arrived": len(self.requests), "requests_done": len(done),
            "prefill_tokens": tokens,
            "prefill_tokens_per_s": tokens / wall if wall > 0 else None,
            "prefill_tokens_per_busy_s": tokens / busy_done if busy_done > 0 else None,
            # TTFT = arrival -> prefill end; a backlog has no arrivals to measure from
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p50_s": _percentile(ttft, 0.50), "ttft_p99_s": _percentile(ttft, 0.99),
            "latency_mean_s": statistics.fmean(latency) if latency else None,
            "latency_p99_s": _percentile(latency, 0.99),
            "num_chunks": len(self.unit_s), "chunk_max_s": max(self.unit_s, default=None),
            "chunk_p50_s": _percentile(self.unit_s, 0.50), "chunk_p99_s": _percentile(self.unit_s, 0.99),
            "chunks_over_box": sum(1 for u in self.unit_s if u > self.max_chunk_s),
            "units_skipped_for_forecast": self.skipped_units,
            # CPU only: on CUDA the thread waits for the kernels, so its CPU time says nothing
            "chunks_over_box_cpu_time": (sum(1 for u in self.unit_cpu_s if u > self.max_chunk_s)
                                         if self.device.type == "cpu" else None),
            "requests": [r.to_dict() for r in self.requests],
        }

    def write_summary(self, run_dir: str, rank: int) -> str:
        """Write `<run_dir>/prefill_rank<rank>.json` (the summary, `rank` added); returns its path."""
        self.end_wall = time.perf_counter()
        path = os.path.join(run_dir, f"prefill_rank{rank}.json")
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"rank": rank, **self.summary()}, fh, indent=1)
        os.replace(tmp, path)
        return path


def read_prefill_summaries(run_dir: str) -> list[dict[str, Any]]:
    """Every `prefill_rank<r>.json` of a run folder, by rank."""
    out = []
    for name in sorted(os.listdir(run_dir)):
        if name.startswith("prefill_rank") and name.endswith(".json"):
            with open(os.path.join(run_dir, name), encoding="utf-8") as fh:
                out.append(json.load(fh))
    return sorted(out, key=lambda d: d["rank"])
