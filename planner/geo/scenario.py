"""The geo scenario file and the WAN link model (DESIGN.md, "Geo scenario").

A scenario names datacenters (GPU types and counts, intra-DC bandwidth), the WAN
links between them, the model and batch to train, and an optional inference
workload whose prefill requests BubbleTea runs in the pipeline bubbles.

Link model (DESIGN.md, "Geo"): one TCP connection moves at most `window / RTT`
(the bandwidth-delay product limit), so `k` connections move
`min(link, k · window / RTT)`. A link may give `per_connection_gbps` directly
(measured, e.g. with iperf) instead of a window.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from contracts.catalog import get_gpu_type
from contracts.jsonio import load_json_file
from contracts.specs import get_model
from contracts.constants import BITS_PER_BYTE, GBIT

# Linux's default maximum TCP receive window (net.ipv4.tcp_rmem max = 6 MiB):
# what one untuned connection can keep in flight.
DEFAULT_TCP_WINDOW_BYTES = 6 * 2**20
# One NIC-class path inside a datacenter (InfiniBand HDR is 200 Gbit/s; half of it
# for a GPU that shares its NIC) and its one-way latency.
DEFAULT_INTRA_DC_GBPS = 100.0
INTRA_DC_LATENCY_S = 10e-6
# The 1F1B simulator (planner/geo/pipeline_sim.py) builds every forward, backward and transfer of
# an iteration for each of its best candidates, so time and memory grow with the micro-batches
# (tens of seconds at this limit). Past this many micro-batches per iteration a scenario is refused
# (raise micro_batch), so a typo'd batch of 1e9 answers in milliseconds instead of filling memory.
MAX_MICROBATCHES = 2048
# Every ordered chain of datacenters is searched (permutations): past this many the search
# alone runs for minutes.
MAX_DATACENTERS = 6
MAX_SEQ = 10**7  # tokens per sample; no model has positions past this
MAX_COUNT = 10**9  # GPUs of one type in one DC, prompt lengths: larger is a typo
MAX_RATE = 1e6  # Gbit/s, ms, requests/s: six orders of magnitude past any real link or service


def _number(value: Any, what: str, *, positive: bool = True, integer: bool = False,
            high: float | None = None) -> float:
    """A JSON number that is finite, positive (or non-negative), an integer if asked, and at most
    `high` (default MAX_COUNT for integers, MAX_RATE for reals); ValueError naming `what` otherwise."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and (isinstance(value, int) or math.isfinite(value))
    if ok and integer:
        ok = isinstance(value, int) or float(value).is_integer()
    if not ok or (value <= 0 if positive else value < 0):
        kind = "integer" if integer else "number"
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"{what} must be a {sign} {kind}, got {value!r}")
    high = (MAX_COUNT if integer else MAX_RATE) if high is None else high
    if value > high:
        raise ValueError(f"{what} is {value:g}, over the limit of {high:g}")
    return int(value) if integer else float(value)


def _only_keys(d: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
    return d


def _dtype(value: Any) -> str:
    if value not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"scenario: dtype must be fp32, bf16 or fp16, got {value!r}")
    return value


@dataclass(frozen=True)
class Datacenter:
    name: str
    gpus: tuple[tuple[str, int], ...]  # (GPU type, count), catalog names
    intra_dc_gbps: float = DEFAULT_INTRA_DC_GBPS

    @property
    def num_gpus(self) -> int:
        return sum(n for _, n in self.gpus)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "gpus": dict(self.gpus), "intra_dc_gbps": self.intra_dc_gbps}

    @classmethod
    def from_dict(cls, d: Any, where: str = "datacenter") -> "Datacenter":
        d = _only_keys(d, {"name", "gpus", "intra_dc_gbps"}, where)
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}: 'name' must be a non-empty string")
        gpus = d.get("gpus")
        if not isinstance(gpus, dict) or not gpus:
            raise ValueError(f"datacenter {name!r}: 'gpus' must be an object {{type: count}} with at least one type")
        pairs = []
        for gtype, count in gpus.items():
            get_gpu_type(gtype)  # unknown type -> ValueError naming the known ones
            pairs.append((gtype, _number(count, f"datacenter {name!r}: count of {gtype}", integer=True)))
        bw = _number(d.get("intra_dc_gbps", DEFAULT_INTRA_DC_GBPS), f"datacenter {name!r}: intra_dc_gbps")
        return cls(name, tuple(pairs), bw)


@dataclass(frozen=True)
class WanLink:
    """A full-duplex WAN link: `gbps` in each direction."""

    a: str
    b: str
    gbps: float
    rtt_ms: float
    per_connection_gbps: float | None = None  # measured single-connection rate; else window / RTT
    tcp_window_bytes: int = DEFAULT_TCP_WINDOW_BYTES

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1000.0

    @property
    def one_way_latency_s(self) -> float:
        return self.rtt_s / 2

    def single_connection_gbps(self) -> float:
        """One TCP connection: min(link, window / RTT)."""
        window_gbps = self.tcp_window_bytes * BITS_PER_BYTE / self.rtt_s / GBIT
        cap = self.per_connection_gbps if self.per_connection_gbps is not None else window_gbps
        return min(self.gbps, cap)

    def throughput_gbps(self, connections: int) -> float:
        """k parallel connections of one transfer: min(link, k · per-connection)."""
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        return min(self.gbps, connections * self.single_connection_gbps())

    def connections_to_saturate(self) -> int:
        """The fewest connections that reach the link rate (more only add overhead)."""
        return max(1, math.ceil(self.gbps / self.single_connection_gbps() - 1e-9))

    def transfer_time_s(self, num_bytes: float, connections: int = 1) -> float:
        """One transfer alone on the link: propagation plus serialisation."""
        return self.one_way_latency_s + num_bytes * BITS_PER_BYTE / (self.throughput_gbps(connections) * GBIT)

    def joins(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"a": self.a, "b": self.b, "gbps": self.gbps, "rtt_ms": self.rtt_ms}
        if self.per_connection_gbps is not None:
            d["per_connection_gbps"] = self.per_connection_gbps
        if self.tcp_window_bytes != DEFAULT_TCP_WINDOW_BYTES:
            d["tcp_window_bytes"] = self.tcp_window_bytes
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "wan link") -> "WanLink":
        d = _only_keys(d, {"a", "b", "gbps", "rtt_ms", "per_connection_gbps", "tcp_window_bytes"}, where)
        a, b = d.get("a"), d.get("b")
        if not isinstance(a, str) or not isinstance(b, str) or not a or not b:
            raise ValueError(f"{where}: 'a' and 'b' must name datacenters")
        if a == b:
            raise ValueError(f"{where}: a link joins two different datacenters, got {a!r} twice")
        name = f"wan link {a}-{b}"
        pc = d.get("per_connection_gbps")
        return cls(
            a, b, _number(d.get("gbps"), f"{name}: gbps"), _number(d.get("rtt_ms"), f"{name}: rtt_ms"),
            None if pc is None else _number(pc, f"{name}: per_connection_gbps"),
            _number(d.get("tcp_window_bytes", DEFAULT_TCP_WINDOW_BYTES), f"{name}: tcp_window_bytes", integer=True),
        )


@dataclass(frozen=True)
class InferenceWorkload:
    """Prefill requests for BubbleTea: a prompt-length distribution and an arrival rate
    (`requests_per_s`) or a standing `backlog` (as many requests as the bubbles take)."""

    model: str
    prompt_tokens: tuple[tuple[int, float], ...]  # (tokens, probability), probabilities sum to 1
    requests_per_s: float | None = None
    backlog: bool = False

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(t * w for t, w in self.prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        if len(self.prompt_tokens) == 1:
            pt: Any = self.prompt_tokens[0][0]
        else:
            pt = {"tokens": [t for t, _ in self.prompt_tokens], "weights": [w for _, w in self.prompt_tokens]}
        d: dict[str, Any] = {"model": self.model, "prompt_tokens": pt}
        if self.backlog:
            d["backlog"] = True
        else:
            d["requests_per_s"] = self.requests_per_s
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "inference") -> "InferenceWorkload":
        d = _only_keys(d, {"model", "prompt_tokens", "requests_per_s", "backlog"}, where)
        model = d.get("model")
        if not isinstance(model, str):
            raise ValueError(f"{where}: 'model' must be a model name")
        get_model(model)
        pt = d.get("prompt_tokens")
        if isinstance(pt, dict):
            pt = _only_keys(pt, {"tokens", "weights"}, f"{where}.prompt_tokens")
            tokens, weights = pt.get("tokens"), pt.get("weights")
            if not isinstance(tokens, list) or not tokens:
                raise ValueError(f"{where}.prompt_tokens: 'tokens' must be a non-empty list")
            weights = [1.0] * len(tokens) if weights is None else weights
            if not isinstance(weights, list) or len(weights) != len(tokens):
                raise ValueError(f"{where}.prompt_tokens: 'weights' must be a list as long as 'tokens'")
        elif isinstance(pt, list) and pt:
            tokens, weights = pt, [1.0] * len(pt)
        else:
            tokens, weights = [pt], [1.0]
        toks = [_number(t, f"{where}: prompt length", integer=True) for t in tokens]
        ws = [_number(w, f"{where}: prompt weight") for w in weights]
        total = sum(ws)
        dist = tuple((t, w / total) for t, w in zip(toks, ws))
        backlog = d.get("backlog", False)
        rate = d.get("requests_per_s")
        if backlog not in (True, False, None):
            raise ValueError(f"{where}: 'backlog' must be true or false, got {backlog!r}")
        if backlog:
            if rate is not None:
                raise ValueError(f"{where}: give either 'requests_per_s' or 'backlog', not both")
            return cls(model, dist, None, True)
        if rate is None:
            raise ValueError(f"{where}: give 'requests_per_s' (arrival rate) or 'backlog': true")
        return cls(model, dist, _number(rate, f"{where}: requests_per_s"), False)


@dataclass(frozen=True)
class GeoScenario:
    datacenters: tuple[Datacenter, ...]
    wan: tuple[WanLink, ...]
    model: str
    global_batch: int
    micro_batch: int = 1
    seq: int = 2048
    dtype: str = "bf16"
    inference: InferenceWorkload | None = None
    name: str = "scenario"
    # micro-batches per iteration past which the scenario is refused (None: no limit), because the geo
    # report, its baselines and BubbleTea simulate every one; planner/geo/cluster_plan.py's scenarios
    # price only iteration times (pipeline_sim.iteration_times) and lift it
    microbatch_limit: ClassVar[int | None] = MAX_MICROBATCHES

    def __post_init__(self) -> None:
        names = [dc.name for dc in self.datacenters]
        if not names:
            raise ValueError("scenario: at least one datacenter is needed")
        if len(names) > MAX_DATACENTERS:
            raise ValueError(f"scenario: {len(names)} datacenters, over the search's limit of {MAX_DATACENTERS}")
        for what in ("global_batch", "micro_batch", "seq"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"scenario: {what} must be a positive integer, got {v!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"scenario: datacenter names repeat: {names}")
        for link in self.wan:
            for end in (link.a, link.b):
                if end not in names:
                    raise ValueError(f"wan link {link.a}-{link.b}: unknown datacenter {end!r} (known: {names})")
        pairs = [frozenset((l.a, l.b)) for l in self.wan]
        if len(set(pairs)) != len(pairs):
            raise ValueError("scenario: two wan links join the same pair of datacenters")
        reach, frontier = {names[0]}, [names[0]]  # every DC must be reachable over the WAN
        while frontier:
            x = frontier.pop()
            for link in self.wan:
                for y in ((link.b,) if link.a == x else (link.a,) if link.b == x else ()):
                    if y not in reach:
                        reach.add(y)
                        frontier.append(y)
        if len(reach) < len(names):
            lost = [n for n in names if n not in reach]
            raise ValueError(f"scenario: no wan link connects datacenters {lost} to {names[0]!r}: add a link")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"scenario: global_batch {self.global_batch} is not a multiple of micro_batch {self.micro_batch}"
            )
        num_mb = self.global_batch // self.micro_batch
        limit = self.microbatch_limit
        if limit is not None and num_mb > limit:
            raise ValueError(
                f"scenario: global_batch / micro_batch = {num_mb} micro-batches per iteration, over the simulator's "
                f"limit of {limit} (raise micro_batch to at least {-(-self.global_batch // limit)})"
            )
        if self.seq > MAX_SEQ:
            raise ValueError(f"scenario: seq {self.seq} is over the limit of {MAX_SEQ}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"scenario: dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        spec = get_model(self.model)
        if self.seq > spec.max_seq and spec.positional == "learned":
            raise ValueError(f"scenario: seq {self.seq} exceeds {self.model}'s {spec.max_seq} positions")

    def datacenter(self, name: str) -> Datacenter:
        for dc in self.datacenters:
            if dc.name == name:
                return dc
        raise ValueError(f"unknown datacenter {name!r}")

    def link(self, x: str, y: str) -> WanLink:
        """The link between two datacenters; a missing one is a scenario error."""
        for link in self.wan:
            if link.joins(x, y):
                return link
        raise ValueError(f"no wan link between datacenters {x!r} and {y!r}: add one to 'wan'")

    def has_link(self, x: str, y: str) -> bool:
        return any(link.joins(x, y) for link in self.wan)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "datacenters": [dc.to_dict() for dc in self.datacenters],
            "wan": [link.to_dict() for link in self.wan],
            "model": self.model, "global_batch": self.global_batch,
            "micro_batch": self.micro_batch, "seq": self.seq, "dtype": self.dtype,
        }
        if self.inference is not None:
            d["inference"] = self.inference.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Any) -> "GeoScenario":
        allowed = {"name", "datacenters", "wan", "model", "global_batch", "micro_batch", "seq", "dtype", "inference"}
        d = _only_keys(d, allowed, "scenario")
        dcs = d.get("datacenters")
        if not isinstance(dcs, list) or not dcs:
            raise ValueError("scenario: 'datacenters' must be a non-empty list")
        wan = d.get("wan", [])
        if not isinstance(wan, list):
            raise ValueError("scenario: 'wan' must be a list of links")
        model = d.get("model")
        if not isinstance(model, str):
            raise ValueError("scenario: 'model' must be a model name or config path")
        spec = get_model(model)
        inf = d.get("inference")
        return cls(
            tuple(Datacenter.from_dict(x, f"datacenters[{i}]") for i, x in enumerate(dcs)),
            tuple(WanLink.from_dict(x, f"wan[{i}]") for i, x in enumerate(wan)),
            model,
            _number(d.get("global_batch"), "scenario: global_batch", integer=True, high=10**12),
            _number(d.get("micro_batch", 1), "scenario: micro_batch", integer=True, high=10**12),
            _number(d.get("seq", min(spec.max_seq, 2048)), "scenario: seq", integer=True, high=MAX_SEQ),
            _dtype(d.get("dtype", "bf16")),
            None if inf is None else InferenceWorkload.from_dict(inf),
            str(d.get("name", "scenario")),
        )

    @classmethod
    def load(cls, path: str) -> "GeoScenario":
        raw = load_json_file(path, "scenario file")
        if isinstance(raw, dict) and "name" not in raw:
            raw = {**raw, "name": os.path.splitext(os.path.basename(path))[0]}
        return cls.from_dict(raw)
