"""One stage's exact split (planner/geo/scale/split.py) against exhaustive search on small instances."""
from __future__ import annotations

import itertools
import random

from planner.geo.scale.split import ReplicaGroup, largest_share, split_rows, water_level


def _group(rng: random.Random, n: int) -> ReplicaGroup:
    alpha, beta, cap = rng.uniform(0, 0.2), rng.uniform(0.1, 1.0), rng.randint(1, 4)
    return ReplicaGroup("A100-40GB", 1, n, cap, lambda r, a=alpha, b=beta: a + b * r)


def _brute_rows(groups, batch):
    slots = [g for g in groups for _ in range(g.num_replicas)]
    best = None
    for rows in itertools.product(*[range(0, g.max_rows + 1) for g in slots]):
        if sum(rows) != batch:
            continue
        t = max((g.time_s(r) for g, r in zip(slots, rows) if r > 0), default=0.0)
        best = t if best is None else min(best, t)
    return best


def test_rows_are_the_exact_min_max():
    rng = random.Random(7)
    for _ in range(60):
        groups = [_group(rng, rng.randint(1, 2)) for _ in range(rng.randint(1, 3))]
        batch = rng.randint(1, sum(g.num_replicas * g.max_rows for g in groups) + 1)
        got = split_rows(groups, batch)
        want = _brute_rows(groups, batch)
        if want is None:
            assert got is None
            continue
        assert got is not None and abs(got.time_s - want) < 1e-12
        assert sum(sum(r) for r in got.rows) == batch
        assert all(0 <= r <= g.max_rows for g, rows in zip(groups, got.rows) for r in rows)


def test_water_level_is_the_least_max_update():
    rng = random.Random(3)
    for _ in range(40):
        n = rng.randint(1, 3)
        rooms = [rng.uniform(0.1, 1.0) for _ in range(n)]
        updates = [rng.uniform(0.5, 3.0) for _ in range(n)]
        got = water_level(rooms, updates)
        if sum(rooms) < 1:
            assert got is None
            continue
        level, shares = got
        assert abs(sum(shares) - 1) < 1e-9 and all(f <= r + 1e-9 for f, r in zip(shares, rooms))
        # no grid point of feasible shares has a lower max f·u
        grid = [i / 40 for i in range(41)]
        for fs in itertools.product(grid, repeat=n - 1):
            last = 1 - sum(fs)
            cand = list(fs) + [last]
            if last < 0 or any(f > r for f, r in zip(cand, rooms)):
                continue
            assert max(f * u for f, u in zip(cand, updates)) >= level * (1 - 1e-6)


def test_largest_share_bisects_a_monotone_fit():
    assert abs(largest_share(lambda f: f <= 0.37) - 0.37) < 1e-5
    assert largest_share(lambda f: True) == 1.0
    assert largest_share(lambda f: False) == 0.0
