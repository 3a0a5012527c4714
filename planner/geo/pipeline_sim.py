"""Discrete-event simulation of pipeline-parallel training (1F1B or GPipe).

`num_pipelines` identical pipelines (the data-parallel replicas) each run `num_microbatches`
micro-batches through `p` stages, one GPU per stage; activations and gradients cross each boundary
over a `Channel` ("dedicated", "temporal": Atlas's turn-taking WAN link, or "fair": TCP sharing).
After the backwards come the stages' gradient syncs and optimizer steps; `runtime_step` follows
models/pipeline.py's step (receives posted one op ahead, a world all-reduce before the optimizer).
`reserved` intervals (BubbleTea's prefill) block a GPU, so tests can check prefill never moves
training. `iteration_times` prices a long 1F1B iteration from bounded simulations whose recurrence
it proves, else simulates it whole.

The model, the channels and the recurrence proof: docs/models/pipeline_simulation.md.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from dataclasses import dataclass, field, replace

from contracts.constants import BITS_PER_BYTE, GBIT
from contracts.pipeline_order import schedule_order
from planner.costmodel.pipeline import SCHEDULES

SHARING = ("dedicated", "temporal", "fair")
LINK_ORDERS = ("fifo", "pipeline")
_EPS = 1e-12
EVENT_GRID_S = 2.0 ** -30  # ~0.93 ns: events this close are ordered as pushed (`_snap`)
# Every forward, backward and transfer of an iteration is a Python object: past this many
# operations (2 · micro-batches · pipelines · stages) a simulation is refused, not run for minutes
# (`iteration_times` prices longer jobs whose cycles it proves to recur).
MAX_SIMULATED_OPS = 4_000_000


@dataclass(frozen=True)
class Stage:
    forward_s: float  # one micro-batch on one GPU
    backward_s: float
    allreduce_s: float = 0.0  # DP gradient all-reduce of the stage among its replicas
    label: str = ""  # e.g. "dc-a A100-80GB layers 0-15"
    optimizer_s: float = 0.0  # the optimizer step over one replica's shard, after the all-reduce


@dataclass(frozen=True)
class Channel:
    name: str
    latency_s: float  # one way
    per_transfer_gbps: float  # what one transfer reaches alone (its k connections, or a LAN path)
    capacity_gbps: float  # per direction, shared by "temporal"/"fair" transfers
    sharing: str = "dedicated"

    def __post_init__(self) -> None:
        if self.sharing not in SHARING:
            raise ValueError(f"channel {self.name}: sharing must be one of {SHARING}, got {self.sharing!r}")
        if self.per_transfer_gbps <= 0 or self.capacity_gbps <= 0 or self.latency_s < 0:
            raise ValueError(f"channel {self.name}: rates must be positive and latency non-negative")


@dataclass(frozen=True)
class PipelineJob:
    stages: tuple[Stage, ...]
    hops: tuple[str, ...]  # channel name of the boundary between stage j and j+1
    channels: tuple[Channel, ...]
    num_pipelines: int
    num_microbatches: int  # per pipeline
    transfer_bytes: float  # activation (and its gradient) per micro-batch per boundary
    schedule: str = "1f1b"
    link_order: str = "fifo"  # temporal channels: "fifo" (first come) or "pipeline" (lower pipeline first)
    # a tied embedding's gradient summed between the first and the last stage (each replica with its
    # counterpart), once both have run their last backward and before either's own sync; 0: none
    tied_sync_s: float = 0.0
    # models/pipeline.py's own step (docs/models/pipeline_simulation.md, "runtime step"): rendezvous transfers, a rank
    # syncs once its sends are done, a world all-reduce of `world_sync_s` between the syncs and the
    # optimizer steps (then `Stage.allreduce_s` is the reduce-scatters, `optimizer_s` AdamW + all-gathers)
    runtime_step: bool = False
    world_sync_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.hops) != len(self.stages) - 1:
            raise ValueError(f"{len(self.stages)} stages need {len(self.stages) - 1} hops, got {len(self.hops)}")
        names = {c.name for c in self.channels}
        for h in self.hops:
            if h not in names:
                raise ValueError(f"hop uses unknown channel {h!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.link_order not in LINK_ORDERS:
            raise ValueError(f"link_order must be one of {LINK_ORDERS}, got {self.link_order!r}")
        if self.num_pipelines < 1 or self.num_microbatches < 1:
            raise ValueError("num_pipelines and num_microbatches must be >= 1")
        if self.tied_sync_s < 0 or (self.tied_sync_s > 0 and len(self.stages) < 2):
            raise ValueError("tied_sync_s must be >= 0, and > 0 only with two stages or more")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_gpus(self) -> int:
        return self.num_stages * self.num_pipelines


@dataclass(frozen=True)
class Op:
    pipeline: int
    stage: int
    kind: str  # "F" forward, "B" backward, "AR" gradient all-reduce, "TIED" tied-embedding sum, "SYNC" the
    # runtime step's world all-reduce, "OPT" optimizer step, "P" prefill
    microbatch: int  # -1 for AR; request index for P
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Transfer:
    pipeline: int
    hop: int  # boundary j (between stage j and j+1)
    direction: str  # "fwd" activation, "bwd" gradient
    microbatch: int
    ready_s: float  # handed to the network
    start_s: float  # first byte on the wire
    end_s: float  # arrived
    posted_s: float | None = None  # runtime step: when the receiver posted its receive


@dataclass
class SimResult:
    job: PipelineJob
    iteration_s: float
    ops: list[Op]
    transfers: list[Transfer]
    channel_bits: dict[str, float] = field(default_factory=dict)  # "name/fwd" -> bits carried
    step_ops: list[Op] = field(default_factory=list)  # the optimizer steps ("OPT"), one per GPU

    def training_ops(self) -> dict[tuple[int, int, str, int], tuple[float, float]]:
        return {(o.pipeline, o.stage, o.kind, o.microbatch): (o.start_s, o.end_s) for o in self.ops + self.step_ops}

    def worker_end_s(self) -> dict[tuple[int, int], float]:
        """(pipeline, stage) -> when that GPU's last operation (its optimizer step included) ends."""
        ends: dict[tuple[int, int], float] = {}
        for o in self.ops + self.step_ops:
            w = (o.pipeline, o.stage)
            ends[w] = max(ends.get(w, 0.0), o.end_s)
        return ends

    def compute_busy_s(self) -> float:
        return sum(o.end_s - o.start_s for o in self.ops if o.kind in ("F", "B"))

    def gpu_utilization(self) -> float:
        """Share of GPU-time spent in forward/backward compute over one iteration."""
        return self.compute_busy_s() / (self.job.num_gpus * self.iteration_s)

    def bubble_fraction(self) -> float:
        return 1.0 - self.gpu_utilization()

    def idle_intervals(self, pipeline: int, stage: int) -> list[tuple[float, float]]:
        """Gaps on one GPU in [0, iteration_s] with no training operation (compute or all-reduce)."""
        busy = sorted((o.start_s, o.end_s) for o in self.ops + self.step_ops
                      if o.pipeline == pipeline and o.stage == stage and o.kind != "P")
        gaps, t = [], 0.0
        for s, e in busy:
            if s > t + _EPS:
                gaps.append((t, s))
            t = max(t, e)
        if self.iteration_s > t + _EPS:
            gaps.append((t, self.iteration_s))
        return gaps

    def channel_utilization(self) -> dict[str, float]:
        """Bits carried / (capacity × iteration time), per WAN channel direction."""
        caps = {c.name: c.capacity_gbps for c in self.job.channels if c.sharing != "dedicated"}
        return {k: bits / (caps[k.split("/")[0]] * GBIT * self.iteration_s)
                for k, bits in self.channel_bits.items() if k.split("/")[0] in caps}


def stage_order(schedule: str, stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its micro-batches' forwards and backwards (1F1B: Narayanan
    et al. 2021, PipeDream-Flush; contracts/pipeline_order.schedule_order)."""
    return schedule_order(schedule, num_stages, stage, m)


def _snap(t: float) -> float:
    """`t` on a grid of EVENT_GRID_S, the order of events: two computed along different paths to the same
    instant (a transfer queued as its link frees) are then taken in the order they were pushed, not in
    that of their rounding errors, which changes as the clock grows."""
    return round(t / EVENT_GRID_S) * EVENT_GRID_S


def _fit(t: float, dur: float, reserved: list[tuple[float, float]]) -> float:
    """The first start >= t at which [start, start+dur) overlaps no reserved interval."""
    for s, e in reserved:
        if s < t + dur - _EPS and e > t + _EPS:
            t = e
    return t


class _Sim:
    def __init__(self, job: PipelineJob, reserved: dict[tuple[int, int], list[tuple[float, float]]]):
        self.job = job
        self.p, self.d, self.m = job.num_stages, job.num_pipelines, job.num_microbatches
        self.channels = {c.name: c for c in job.channels}
        self.reserved = {k: sorted(v) for k, v in reserved.items()}
        self.heap: list = []
        self.seq = itertools.count()
        self.orders = [stage_order(job.schedule, j, self.p, self.m) for j in range(self.p)]
        self.next_op = {(r, j): 0 for r in range(self.d) for j in range(self.p)}
        self.busy = {w: False for w in self.next_op}
        self.ready: set[tuple] = set()  # ("act"|"grad"|"fdone", r, j, mb)
        self.stage_done = [0] * self.p
        self.tied_waiting: dict[int, float] = {}  # first/last stage -> when all its replicas were done
        self.posted: dict[tuple, float] = {}  # runtime step: (direction, r, hop, mb) -> when its receive was posted
        self.parked: dict[tuple, tuple] = {}  # runtime step: sends waiting for their receive
        self.unsent = {w: 0 for w in self.next_op}  # runtime step: a worker's sends not yet arrived
        self.synced: dict[int, float] = {}  # runtime step: stage -> when its syncs ended
        self.ops: list[Op] = []
        self.step_ops: list[Op] = []
        self.transfers: list[Transfer] = []
        self.bits: dict[str, float] = {}
        # shared link state: key "channel/dir"
        self.queue: dict[str, list] = {}
        self.link_busy: dict[str, bool] = {}
        self.active: dict[str, dict] = {}  # fair sharing: transfer -> remaining bits
        self.last_update: dict[str, float] = {}
        self.version: dict[str, int] = {}

    def push(self, t: float, kind: str, payload) -> None:
        # ordered by the time on a grid, then by when pushed (`_snap`); handled at its own time
        heapq.heappush(self.heap, (_snap(t), next(self.seq), t, kind, payload))

    # --- GPUs ---
    def try_start(self, w: tuple[int, int], now: float) -> None:
        r, j = w
        if self.busy[w] or self.next_op[w] >= len(self.orders[j]):
            return
        order, i = self.orders[j], self.next_op[w]
        kind, mb = order[i]
        if self.job.runtime_step:  # the op starts: its own receive (the first op's) and the next op's are posted
            for k, m in order[i:i + 2]:
                self.post_for(now, r, j, k, m)
        if kind == "F" and j > 0 and ("act", r, j, mb) not in self.ready:
            return
        if kind == "B" and (("fdone", r, j, mb) not in self.ready
                            or (j < self.p - 1 and ("grad", r, j, mb) not in self.ready)):
            return
        stage = self.job.stages[j]
        dur = stage.forward_s if kind == "F" else stage.backward_s
        start = _fit(now, dur, self.reserved.get(w, []))
        self.busy[w] = True
        self.ops.append(Op(r, j, kind, mb, start, start + dur))
        self.push(start + dur, "op_end", (w, kind, mb))

    def op_end(self, now: float, w: tuple[int, int], kind: str, mb: int) -> None:
        r, j = w
        self.busy[w] = False
        self.next_op[w] += 1
        if kind == "F":
            self.ready.add(("fdone", r, j, mb))
            if j < self.p - 1:
                self.send(now, r, j, "fwd", mb)
        else:
            if j > 0:
                self.send(now, r, j - 1, "bwd", mb)
            if self.next_op[w] == len(self.orders[j]) and self.unsent[w] == 0:
                self.worker_done(now, w)
        self.try_start(w, now)

    def worker_done(self, now: float, w: tuple[int, int]) -> None:
        """A worker ran its last operation (and, in the runtime step, its sends arrived)."""
        j = w[1]
        self.stage_done[j] += 1
        if self.stage_done[j] == self.d:
            self.stage_finished(now, j)

    def stage_finished(self, now: float, j: int) -> None:
        """Every replica of stage j ran its last backward: its syncs, after the tied embedding's sum
        between the first and the last stage when the job has one."""
        tied_s, last = self.job.tied_sync_s, self.p - 1
        if tied_s <= 0 or j not in (0, last):
            self.allreduce(now, j)
            return
        self.tied_waiting[j] = now
        if len(self.tied_waiting) < 2:
            return
        ends = (0, last)
        start = max(_fit(now, tied_s, self.reserved.get((r, s), [])) for r in range(self.d) for s in ends)
        for s in ends:
            for r in range(self.d):
                self.ops.append(Op(r, s, "TIED", -1, start, start + tied_s))
        for s in ends:
            self.allreduce(start + tied_s, s)

    def allreduce(self, now: float, j: int) -> None:
        """The stage's collectives (all replicas at once), then each replica's optimizer step."""
        stage = self.job.stages[j]
        dur, end = stage.allreduce_s, now
        if dur > 0:
            start = max(_fit(now, dur, self.reserved.get((r, j), [])) for r in range(self.d))
            end = start + dur
            for r in range(self.d):
                self.ops.append(Op(r, j, "AR", -1, start, end))
        if self.job.runtime_step:
            self.synced[j] = end
            if len(self.synced) == self.p:
                self.world_sync(max(self.synced.values()))
            return
        self.optimizer_steps(end, j)

    def world_sync(self, now: float) -> None:
        """The runtime step's world all-reduce (every rank at once), then every rank's optimizer step."""
        dur, end = self.job.world_sync_s, now
        if dur > 0:
            workers = list(self.next_op)
            start = max(_fit(now, dur, self.reserved.get(w, [])) for w in workers)
            end = start + dur
            self.ops += [Op(r, j, "SYNC", -1, start, end) for r, j in workers]
        for j in range(self.p):
            self.optimizer_steps(end, j)

    def optimizer_steps(self, end: float, j: int) -> None:
        stage = self.job.stages[j]
        if stage.optimizer_s > 0:
            for r in range(self.d):
                start = _fit(end, stage.optimizer_s, self.reserved.get((r, j), []))
                self.step_ops.append(Op(r, j, "OPT", -1, start, start + stage.optimizer_s))

    # --- network ---
    def post_for(self, now: float, r: int, j: int, kind: str, mb: int) -> None:
        """Runtime step: post the receive op (kind, mb) of worker (r, j) needs, if any."""
        if kind == "F" and j > 0:
            self.post(now, ("fwd", r, j - 1, mb))
        elif kind == "B" and j < self.p - 1:
            self.post(now, ("bwd", r, j, mb))

    def post(self, now: float, key: tuple) -> None:
        """Runtime step: the receive of transfer `key` is posted; a parked send may move."""
        if key in self.posted:
            return
        self.posted[key] = now
        if key in self.parked:
            self.release(now, self.parked.pop(key))

    def release(self, now: float, key: tuple) -> None:
        """Runtime step: the data moves once the receiver's readiness reached the sender."""
        direction, r, hop, mb = key
        t = max(now, self.posted[key] + self.channels[self.job.hops[hop]].latency_s)
        if t > now + _EPS:
            self.push(t, "enter", key)
        else:
            self.enter(now, r, hop, direction, mb)

    def send(self, now: float, r: int, hop: int, direction: str, mb: int) -> None:
        if not self.job.runtime_step:
            self.enter(now, r, hop, direction, mb)
            return
        self.unsent[(r, hop if direction == "fwd" else hop + 1)] += 1
        key = (direction, r, hop, mb)
        if key in self.posted:
            self.release(now, key)
        else:
            self.parked[key] = key

    def enter(self, now: float, r: int, hop: int, direction: str, mb: int) -> None:
        """A transfer's data is handed to its channel."""
        ch = self.channels[self.job.hops[hop]]
        key = f"{ch.name}/{direction}"
        bits = self.job.transfer_bytes * BITS_PER_BYTE
        self.bits[key] = self.bits.get(key, 0.0) + bits
        item = (now, r, hop, direction, mb)
        if ch.sharing == "dedicated":
            end = now + bits / (ch.per_transfer_gbps * GBIT)
            self.arrive_at(item, now, end + ch.latency_s)
        elif ch.sharing == "temporal":
            self.queue.setdefault(key, []).append(item)
            if not self.link_busy.get(key):
                self.next_temporal(now, key)
        else:
            self.fair_update(now, key)
            self.active.setdefault(key, {})[item] = bits
            self.fair_schedule(now, key)

    def arrive_at(self, item, start: float, end: float) -> None:
        ready, r, hop, direction, mb = item
        self.transfers.append(Transfer(r, hop, direction, mb, ready, start, end,
                                       self.posted.get((direction, r, hop, mb))))
        self.push(end, "arrive", (r, hop, direction, mb))

    def next_temporal(self, now: float, key: str) -> None:
        q = self.queue.get(key)
        if not q:
            self.link_busy[key] = False
            return
        # handed over at one instant (on the grid, `_snap`): the lower pipeline first, as between equal times
        pick = min(q, key=(lambda it: (_snap(it[0]), it[1])) if self.job.link_order == "fifo"
                   else (lambda it: (it[1], _snap(it[0]))))
        q.remove(pick)
        ch = self.channels[key.split("/")[0]]
        wire_end = now + self.job.transfer_bytes * BITS_PER_BYTE / (ch.per_transfer_gbps * GBIT)
        self.link_busy[key] = True
        self.arrive_at(pick, now, wire_end + ch.latency_s)
        self.push(wire_end, "link_free", key)

    def fair_rate(self, key: str) -> float:
        ch = self.channels[key.split("/")[0]]
        n = len(self.active.get(key, {}))
        return min(ch.per_transfer_gbps, ch.capacity_gbps / max(n, 1)) * GBIT

    def fair_update(self, now: float, key: str) -> None:
        act = self.active.get(key, {})
        if act:
            sent = (now - self.last_update.get(key, now)) * self.fair_rate(key)
            for it in act:
                act[it] -= sent
        self.last_update[key] = now

    def fair_schedule(self, now: float, key: str) -> None:
        self.version[key] = self.version.get(key, 0) + 1
        act = self.active.get(key, {})
        if act:
            item = min(act, key=lambda it: (act[it], it[0], it[1]))
            self.push(now + max(act[item], 0.0) / self.fair_rate(key), "fair_done", (key, self.version[key], item))

    def fair_done(self, now: float, key: str, version: int, item) -> None:
        if version != self.version.get(key):
            return  # superseded by a later arrival/departure
        self.fair_update(now, key)
        del self.active[key][item]
        ch = self.channels[key.split("/")[0]]
        # the first byte left at the hand-off: fair sharing has no queue
        self.arrive_at(item, item[0], now + ch.latency_s)
        self.fair_schedule(now, key)

    def arrive(self, now: float, r: int, hop: int, direction: str, mb: int) -> None:
        if self.job.runtime_step:
            sender = (r, hop if direction == "fwd" else hop + 1)
            self.unsent[sender] -= 1
            if self.unsent[sender] == 0 and self.next_op[sender] == len(self.orders[sender[1]]):
                self.worker_done(now, sender)
        if direction == "fwd":
            self.ready.add(("act", r, hop + 1, mb))
            self.try_start((r, hop + 1), now)
        else:
            self.ready.add(("grad", r, hop, mb))
            self.try_start((r, hop), now)

    def run(self) -> SimResult:
        for w in self.next_op:
            self.try_start(w, 0.0)
        while self.heap:
            _, _, now, kind, payload = heapq.heappop(self.heap)
            if kind == "op_end":
                self.op_end(now, *payload)
            elif kind == "arrive":
                self.arrive(now, *payload)
            elif kind == "enter":
                direction, r, hop, mb = payload
                self.enter(now, r, hop, direction, mb)
            elif kind == "link_free":
                self.next_temporal(now, payload)
            else:
                self.fair_done(now, *payload)
        missing = [w for w, i in self.next_op.items() if i < len(self.orders[w[1]])]
        if missing:  # cannot happen for a valid schedule; a guard against silent deadlock
            raise RuntimeError(f"pipeline simulation deadlocked at workers {missing[:4]}")
        end = max([o.end_s for o in self.ops + self.step_ops] + [t.end_s for t in self.transfers])
        return SimResult(self.job, end, self.ops, self.transfers, self.bits, self.step_ops)


def simulate_pipeline(job: PipelineJob,
                      reserved: dict[tuple[int, int], list[tuple[float, float]]] | None = None) -> SimResult:
    """One training iteration of `job`; `reserved[(pipeline, stage)]` are intervals the GPU is taken.
    Refused (ValueError) past MAX_SIMULATED_OPS operations."""
    num_ops = 2 * job.num_microbatches * job.num_pipelines * job.num_stages
    if num_ops > MAX_SIMULATED_OPS:
        raise ValueError(f"pipeline simulation of {job.num_pipelines} pipelines × {job.num_stages} stages × "
                         f"{job.num_microbatches} micro-batches is {num_ops} operations, over the limit of "
                         f"{MAX_SIMULATED_OPS}")
    if reserved or job.num_pipelines == 1 or any(c.sharing != "dedicated" for c in job.channels):
        return _Sim(job, reserved or {}).run()
    # no shared link and nothing reserved: the pipelines are identical; simulate one, copy it
    one = _Sim(replace(job, num_pipelines=1), {}).run()
    d = job.num_pipelines
    ops = [Op(r, o.stage, o.kind, o.microbatch, o.start_s, o.end_s) for r in range(d) for o in one.ops]
    transfers = [Transfer(r, t.hop, t.direction, t.microbatch, t.ready_s, t.start_s, t.end_s, t.posted_s)
                 for r in range(d) for t in one.transfers]
    steps = [Op(r, o.stage, o.kind, o.microbatch, o.start_s, o.end_s) for r in range(d) for o in one.step_ops]
    return SimResult(job, one.iteration_s, ops, transfers, {k: v * d for k, v in one.channel_bits.items()}, steps)




# --- iteration time without simulating every micro-batch -------------------------------------------
# A 1F1B iteration is a warm-up, repeated forward/backward cycles and a cool-down. If the simulation's
# whole state at t1 recurs at t1 + Δ with every micro-batch index moved by c, M micro-batches end as
# M - n·c do, n·Δ later. `iteration_times` proves that recurrence on bounded probes (sized by the
# constants below; timestamps matched to SHIFT_TOLERANCE; events on a time grid, `_snap`) and
# extrapolates; a job it cannot prove it for (and GPipe) is simulated whole. The proof, its conditions
# and why the tolerance and the grid: docs/models/pipeline_simulation.md ("Long iterations from a short
# simulation"); bench/iteration_times.py compares it with whole simulations.
PROBE_STAGES, PROBE_EXTRA, PROBE_FACTOR, PROBES = 4, 16, 2, 2
PROBE_ALIGN = 12  # M - probe is a multiple of 12: of every cycle of 1, 2, 3, 4, 6 or 12 micro-batches
CYCLE_STAGES = 4
SHIFT_TOLERANCE = 1e-12  # relative to the probe's iteration


@dataclass(frozen=True)
class IterationTimes:
    """One iteration's end and each worker's last operation's end, from `iteration_times`."""

    iteration_s: float
    worker_end_s: dict[tuple[int, int], float]  # (pipeline, stage) -> end of its last op (step included)
    simulated_microbatches: tuple[int, ...]  # the micro-batches of each simulation behind the figures
    cycle: int | None  # the recurring cycle extrapolated over (micro-batches); None: simulated whole

    @property
    def extrapolated(self) -> bool:
        return self.cycle is not None


def _items(sim: SimResult) -> list[tuple[int, tuple, tuple[float, ...], tuple[float, float] | None]]:
    """Every forward, backward and transfer as (micro-batch, series key, timestamps, its time on the
    wire where that is on a fairly shared link, else None)."""
    fair = {c.name for c in sim.job.channels if c.sharing == "fair"}
    out = [(o.microbatch, ("op", o.pipeline, o.stage, o.kind), (o.start_s, o.end_s), None)
           for o in sim.ops if o.kind in ("F", "B")]
    for t in sim.transfers:
        stamps = (t.ready_s, t.start_s, t.end_s) + (() if t.posted_s is None else (t.posted_s,))
        wire = (t.start_s, t.end_s) if sim.job.hops[t.hop] in fair else None
        out.append((t.microbatch, ("T", t.pipeline, t.hop, t.direction), stamps, wire))
    return out


def _recurrence(sim: SimResult, tol: float) -> tuple[int, float] | None:
    """(c, Δ) of a recurrence of the probe's whole state (docs/models/pipeline_simulation.md), or None."""
    S, m = sim.job.num_stages, sim.job.num_microbatches
    items = _items(sim)
    t_div = min(o.start_s for o in sim.ops if o.kind in ("F", "B") and o.microbatch >= m - S - 1)
    late = [mb for mb, _, ts, _ in items if max(ts) >= t_div]
    b = min(late) if late else m  # every item of a micro-batch below b ends before t_div
    series: dict[tuple, dict[int, tuple[float, ...]]] = {}
    for mb, key, ts, _ in items:
        if mb < b:
            series.setdefault(key, {})[mb] = ts
    fair_spans = sorted(w for _, _, _, w in items if w is not None)
    last_by_mb, first_by_mb = [0.0] * (m + 1), [math.inf] * (m + 1)
    for mb, _, ts, _ in items:
        last_by_mb[mb] = max(last_by_mb[mb], max(ts))
        first_by_mb[mb] = min(first_by_mb[mb], min(ts))
    ends_below = list(itertools.accumulate(last_by_mb, max))  # ends_below[k]: the last end below k + 1
    starts_from = list(itertools.accumulate(reversed(first_by_mb), min))[::-1]  # the first start from k

    def ended_below(k: int) -> float:
        return ends_below[k - 1] if k > 0 else 0.0

    for c in range(1, CYCLE_STAGES * S + 1):
        if b - 2 * c < 0:
            return None
        top = b - c - 1
        delta = None
        for xs in series.values():
            if top in xs and top + c in xs:
                delta = xs[top + c][0] - xs[top][0]
                break
        if delta is None or delta <= tol:
            continue
        if not all(_moved(xs, top, c, delta, tol) for xs in series.values()):
            continue
        a = top
        while a - 1 >= 0 and all(_moved(xs, a - 1, c, delta, tol) for xs in series.values()):
            a -= 1
        lower = max(ended_below(a), ended_below(a + c) - delta)
        upper = min(starts_from[b - c], starts_from[b] - delta, t_div - delta)
        if _quiet_time(lower, upper, delta, fair_spans) is not None:
            return c, delta
    return None


def _moved(xs: dict[int, tuple[float, ...]], k: int, c: int, delta: float, tol: float) -> bool:
    """Micro-batch k + c of one series is micro-batch k moved by delta (both present or both absent)."""
    x, y = xs.get(k), xs.get(k + c)
    if x is None or y is None:
        return x is None and y is None
    return len(x) == len(y) and all(abs(v - u - delta) <= tol for u, v in zip(x, y))


def _quiet_time(lower: float, upper: float, delta: float, fair_spans: list[tuple[float, float]]) -> float | None:
    """A t1 in (lower, upper) with neither t1 nor t1 + delta inside a fair transfer's time on the wire
    (`fair_spans`, sorted by start)."""
    if upper <= lower:
        return None
    starts = [s for s, _ in fair_spans]
    reach = list(itertools.accumulate((e for _, e in fair_spans), max))  # the latest end of the first i + 1

    def inside(t: float) -> bool:
        i = bisect.bisect_right(starts, t)  # spans starting at or before t
        return i > 0 and reach[i - 1] >= t

    step = (upper - lower) * 1e-6
    candidates = [(lower + upper) / 2] + [e + step for _, e in fair_spans] + [e - delta + step for _, e in fair_spans]
    for t in candidates:
        if lower < t < upper and not inside(t) and not inside(t + delta):
            return t
    return None


def _extrapolated(job: PipelineJob) -> IterationTimes | None:
    S, m = job.num_stages, job.num_microbatches
    base = PROBE_STAGES * S + PROBE_EXTRA
    probe = base + (m - base) % PROBE_ALIGN  # a cycle dividing PROBE_ALIGN needs no copy besides the probe
    for _ in range(PROBES):
        if PROBE_FACTOR * probe > m:
            return None
        sim = simulate_pipeline(replace(job, num_microbatches=probe))
        tol = SHIFT_TOLERANCE * max(1.0, sim.iteration_s)
        found = _recurrence(sim, tol)
        if found is None:
            base *= PROBE_FACTOR
            probe = base + (m - base) % PROBE_ALIGN
            continue
        c, delta = found
        m1 = probe + (m - probe) % c
        copy = sim if m1 == probe else simulate_pipeline(replace(job, num_microbatches=m1))
        n = (m - m1) // c
        ends = {w: e + n * delta for w, e in copy.worker_end_s().items()}
        return IterationTimes(copy.iteration_s + n * delta, ends, tuple(sorted({probe, m1})), c)
    return None


@functools.lru_cache(maxsize=256)
def iteration_times(job: PipelineJob, whole_limit: int | None = None) -> IterationTimes:
    """The iteration of `job` (nothing reserved): from bounded simulations where its 1F1B cycles are
    proved to recur (docs/models/pipeline_simulation.md), else from simulating it whole, which past `whole_limit`
    micro-batches (None: MAX_SIMULATED_OPS alone) is refused with a ValueError saying so. Cached per job
    (a pure function of it): the CLI prices its chosen pipeline once for the ranking, once for the file."""
    if job.schedule == "1f1b":
        found = _extrapolated(job)
        if found is not None:
            return found
    if whole_limit is not None and job.num_microbatches > whole_limit:
        why = "a GPipe schedule" if job.schedule != "1f1b" else "its cycles were not seen to recur within the probes"
        raise ValueError(f"{job.num_microbatches} micro-batches per iteration: {why}, and more than "
                         f"{whole_limit} are not simulated whole")
    sim = simulate_pipeline(job)
    return IterationTimes(sim.iteration_s, sim.worker_end_s(), (job.num_microbatches,), None)
