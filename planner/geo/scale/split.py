"""One stage's exact split: its micro-batch's rows over its TP groups, then its state over them.

A stage holds groups of identical replicas (`ReplicaGroup`: the TP groups of one GPU type at one TP
degree on some nodes). Per micro-batch of B rows each replica i computes r_i rows in c_i(r_i) seconds
(forward + backward through the stage's units); the stage's time is max_i c_i(r_i).

* rows (`split_rows`): the least T with Σ_i max{r ≤ cap_i : c_i(r) ≤ T} ≥ B is the exact min-max
  (c_i is non-decreasing in r); T is one of the finitely many c_i(r), so a bisection over their sorted
  list finds it. The surplus rows are then taken off the replicas with the most rows (then the
  slowest), never raising the max. A replica left with 0 rows is left out of the stage.
* shards (`split_shards`): ZeRO-1 inside the stage: replica i holds a share f_i of the stage's state
  (each TP rank f_i of its slice), Σ f_i = 1; its update costs f_i·u_i; its memory grows with f_i.
  The least max_i f_i·u_i under f_i ≤ room_i is the water level U with Σ min(room_i, U/u_i) = 1
  (each term non-decreasing in U: a bisection to 1e-9 of the level), room_i the largest share the
  rank's exact memory admits at its rows (a bisection on the memory model).

docs/models/scale.md ("One stage").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ReplicaGroup:
    device_type: str
    tp: int
    num_replicas: int
    max_rows: int  # the most rows one replica may take (memory and the measured range)
    time_s: Callable[[int], float]  # forward + backward of r rows, r in 1..max_rows


@dataclass(frozen=True)
class RowSplit:
    time_s: float  # the stage's time per micro-batch: its slowest replica's
    rows: tuple[tuple[int, ...], ...]  # per group, per replica (0: left out)


def split_rows(groups: list[ReplicaGroup], batch: int) -> RowSplit | None:
    """The min-max split of `batch` rows over the groups' replicas (module docstring); None when even
    every replica at its largest rows cannot take the batch."""
    if batch < 1:
        raise ValueError(f"a micro-batch needs at least 1 row, got {batch}")
    live = [g for g in groups if g.num_replicas > 0 and g.max_rows > 0]
    if sum(g.num_replicas * g.max_rows for g in live) < batch:
        return None
    times = {id(g): [g.time_s(r) for r in range(1, g.max_rows + 1)] for g in live}
    cands = sorted({t for ts in times.values() for t in ts})

    def rows_at(g: ReplicaGroup, t: float) -> int:
        ts = times[id(g)]
        r = 0
        while r < len(ts) and ts[r] <= t:
            r += 1
        return r

    lo, hi = 0, len(cands) - 1  # cands[hi] is feasible (every replica at its cap)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(g.num_replicas * rows_at(g, cands[mid]) for g in live) >= batch:
            hi = mid
        else:
            lo = mid + 1
    t = cands[lo]
    per = {id(g): [rows_at(g, t)] * g.num_replicas for g in live}
    surplus = sum(sum(v) for v in per.values()) - batch
    while surplus > 0:  # rows off the replicas with the most rows (ties: the slowest group), a level at a time
        g = max((g for g in live if per[id(g)][0] > 0),
                key=lambda g: (per[id(g)][0], times[id(g)][per[id(g)][0] - 1]))
        v = per[id(g)]
        top = v[0]
        at_top = [i for i, r in enumerate(v) if r == top]
        for i in reversed(at_top[-surplus:]):  # the last ones at the top level lose a row each
            v[i] -= 1
            surplus -= 1
        v.sort(reverse=True)
    rows = tuple(tuple(sorted(per[id(g)], reverse=True)) if id(g) in per else (0,) * g.num_replicas for g in groups)
    used = [times[id(g)][r - 1] for g in live for r in per[id(g)] if r > 0]
    return RowSplit(max(used), rows)


def water_level(rooms: list[float], update_s: list[float], tol: float = 1e-9) -> tuple[float, list[float]] | None:
    """Shares f_i ≤ rooms[i] summing to 1 with the least max f_i·update_s[i] (module docstring); None
    when the rooms cannot hold the state."""
    if sum(rooms) < 1.0 - 1e-12:
        return None
    if all(u <= 0 for u in update_s):
        total = sum(rooms)
        return 0.0, [r / total for r in rooms]

    def shares(level: float) -> list[float]:
        return [min(r, level / u) if u > 0 else r for r, u in zip(rooms, update_s)]

    lo, hi = 0.0, max(r * u for r, u in zip(rooms, update_s))
    while hi - lo > tol * max(hi, 1e-12):
        mid = (lo + hi) / 2
        if sum(shares(mid)) >= 1.0:
            hi = mid
        else:
            lo = mid
    f = shares(hi)
    total = sum(f)
    return hi, [x / total for x in f]


def largest_share(fits: Callable[[float], bool], tol: float = 1e-6) -> float:
    """The largest f in [0, 1] with fits(f) (memory grows with the share: a bisection; 0 when not even 0)."""
    if fits(1.0):
        return 1.0
    if not fits(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


__all__ = ["ReplicaGroup", "RowSplit", "split_rows", "water_level", "largest_share"]
