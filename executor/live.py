"""A run followed live at a cost per refresh that does not grow with its length (the Launch page).

`RunFollower(run_dir).refresh()` returns executor.store.read_metrics' dict, bounded:
- "steps" and "rank_steps": the newest WINDOW_STEPS steps in full (the last step, and the medians:
  a long run's are over its newest steps); "steps_recorded" counts every step, and each rank's
  peak memory and step count cover every row;
- "history", the charts' series: {"loss", "val_loss", "samples_per_s": (steps, values), "wait_s":
  {rank: (steps, values)}, "width": steps a bucket spans}, the newest CHART_TAIL_STEPS steps in
  full after at most HISTORY_BUCKETS means of the older ones (each drawn at its mean step);
- "events": none (the panel shows none).
The first refresh reads the older rows bucketed in SQL (one pass); each later one reads only the
rows after the newest it holds. A relaunch or a resume (the run's start time changes) starts over.
bench/live_panel.py measures a refresh at 100 to 100k steps.
"""
from __future__ import annotations

import collections
import math
from typing import Any

from executor import db, store

WINDOW_STEPS = 500  # the newest steps held in full: the medians' sample
CHART_TAIL_STEPS = 50  # the newest steps the charts draw one by one
HISTORY_BUCKETS = 150  # the most points a chart draws for the older steps (its width: ~2 px a point)
STEP_SERIES = ("loss", "val_loss", "samples_per_s")
RANK_SERIES = "wait_s"


class Buckets:
    """Means of named series over buckets of `width` steps (a power of two; step s in bucket
    s // width), at most HISTORY_BUCKETS of them: one more doubles the width, merging neighbours."""

    def __init__(self, width: int = 1):
        self.width = width
        self.sums: dict[int, dict[Any, list[float]]] = {}  # bucket -> series -> [points, step sum, value sum]

    def add(self, bucket: int, name: Any, n: int, step_sum: float | None, value_sum: float | None) -> None:
        if n:
            acc = self.sums.setdefault(bucket, {}).setdefault(name, [0, 0.0, 0.0])
            acc[0] += n
            acc[1] += step_sum
            acc[2] += value_sum

    def add_point(self, step: int, name: Any, value: float | None) -> None:
        if value is not None:
            self.add(step // self.width, name, 1, step, value)
            self.coarsen()

    def coarsen(self) -> None:
        while len(self.sums) > HISTORY_BUCKETS:
            old, self.sums = self.sums, {}
            self.width *= 2
            for bucket, series in old.items():
                for name, (n, steps, values) in series.items():
                    self.add(bucket // 2, name, n, steps, values)

    def series(self, name: Any) -> tuple[list[float], list[float]]:
        """(mean step, mean value) of each bucket that holds points of `name`, in step order."""
        xs, ys = [], []
        for bucket in sorted(self.sums):
            acc = self.sums[bucket].get(name)
            if acc:
                xs.append(acc[1] / acc[0])
                ys.append(acc[2] / acc[0])
        return xs, ys


def width_for(last_step: int) -> int:
    """The smallest power of two that puts steps 0..last_step in at most HISTORY_BUCKETS buckets."""
    return 1 << max(0, math.ceil(math.log2((last_step + 1) / HISTORY_BUCKETS)))


class RunFollower:
    """One viewer's copy of a run's newest rows and older means (keep one per run per session)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._start_over(None)

    def _start_over(self, started_s: float | None) -> None:
        self.started_s = started_s
        self.last_step: int | None = None
        self.steps_recorded = 0
        self.window: collections.deque[tuple[dict, list[dict]]] = collections.deque()  # (step row, its rank rows)
        self.buckets = Buckets()
        self.totals: dict[int, tuple[int | None, int]] = {}  # rank -> (peak bytes, rows) of rows out of the window

    def refresh(self) -> dict[str, Any]:
        """The run's bounded metrics (module docstring). ValueError when there is no run."""
        conn, key = store._open_reader(self.run_dir)
        try:
            run, ranks = store.read_run_and_ranks(conn, key, self.run_dir)
            if self.last_step is None or run["started_s"] != self.started_s:
                self._start_over(run["started_s"])
                self._read_history(conn, key, run)
            self._read_newer(conn, key, run, ranks)
        except db.errors() as e:
            raise ValueError(f"run store {conn.url.describe()}: {db.error_line(e)}") from None
        finally:
            conn.close()
        m = store.metrics_of(self.run_dir, run, [s for s, _ in self.window], ranks,
                             [r for _, rows in self.window for r in rows], [], self.steps_recorded, self.totals)
        m["history"] = self._history()
        return m

    # ---- reading -------------------------------------------------------------------------
    def _read_history(self, conn: db.Database, key: str, run: dict[str, Any]) -> None:
        """Every step but the newest WINDOW_STEPS as bucket means (two grouped queries)."""
        self.last_step = -1
        row = conn.one("SELECT step FROM steps WHERE run_key = ? ORDER BY step DESC LIMIT 1 OFFSET ?",
                       (key, WINDOW_STEPS))
        if row is None:
            return
        cut = int(row[0])
        self.buckets = Buckets(width_for(cut))
        picks = ", ".join(f"COUNT({c}), SUM(CASE WHEN {c} IS NOT NULL THEN step END), SUM({c})" for c in STEP_SERIES)
        for r in conn.all(f"SELECT step / ?, COUNT(*), {picks} FROM steps WHERE run_key = ? AND step <= ? "
                          "GROUP BY 1", (self.buckets.width, key, cut)):
            self.steps_recorded += int(r[1])
            for k, name in enumerate(STEP_SERIES):
                self.buckets.add(int(r[0]), name, *r[2 + 3 * k:5 + 3 * k])
        c = RANK_SERIES
        for r in conn.all(f"SELECT rank, step / ?, COUNT({c}), SUM(CASE WHEN {c} IS NOT NULL THEN step END), "
                          f"SUM({c}), MAX(peak_memory_bytes), COUNT(*) FROM rank_steps WHERE run_key = ? "
                          "AND step <= ? GROUP BY 1, 2", (self.buckets.width, key, cut)):
            rank = int(r[0])
            self.buckets.add(int(r[1]), (c, rank), *r[2:5])
            self._fold_totals(rank, r[5], int(r[6]))
        self.buckets.coarsen()
        self.last_step = cut

    def _read_newer(self, conn: db.Database, key: str, run: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
        after = self.last_step
        steps = [dict(r) for r in conn.all(
            f"SELECT {', '.join(store.STEP_FIELDS)} FROM steps WHERE run_key = ? AND step > ? ORDER BY step",
            (key, after))]
        if not steps:
            return
        last = steps[-1]["step"]
        # by rank (the primary key's order: an index range per rank, never a scan of the run's rows)
        members = sorted({r["rank"] for r in ranks} | set(range(run["world_size"] or 0)))
        by_step: dict[int, list[dict]] = {}
        if members:
            for r in store.read_rank_steps(conn, key, f"rank IN ({', '.join('?' * len(members))}) AND step > ? "
                                                      "AND step <= ?", (*members, after, last)):
                by_step.setdefault(r["step"], []).append(r)
        for s in steps:
            self._take(s, by_step.get(s["step"], []))
        self.last_step = last

    def _take(self, step: dict, rank_rows: list[dict]) -> None:
        """A new step: into the window; the one it pushes out of the charts' tail into the buckets,
        the one it pushes out of the window into the totals."""
        self.window.append((step, rank_rows))
        self.steps_recorded += 1
        if len(self.window) > CHART_TAIL_STEPS:
            old, old_ranks = self.window[-CHART_TAIL_STEPS - 1]
            for name in STEP_SERIES:
                self.buckets.add_point(old["step"], name, old[name])
            for r in old_ranks:
                self.buckets.add_point(r["step"], (RANK_SERIES, r["rank"]), r[RANK_SERIES])
        if len(self.window) > WINDOW_STEPS:
            _, gone = self.window.popleft()
            for r in gone:
                self._fold_totals(r["rank"], r["peak_memory_bytes"], 1)

    def _fold_totals(self, rank: int, peak: int | None, n: int) -> None:
        before, count = self.totals.get(rank, (None, 0))
        self.totals[rank] = (max((p for p in (before, peak) if p is not None), default=None), count + n)

    # ---- the charts' series -------------------------------------------------------------------
    def _history(self) -> dict[str, Any]:
        tail = list(self.window)[-CHART_TAIL_STEPS:]
        out: dict[str, Any] = {}
        for name in STEP_SERIES:
            xs, ys = self.buckets.series(name)
            for s, _ in tail:
                if s[name] is not None:
                    xs.append(s["step"])
                    ys.append(s[name])
            out[name] = (xs, ys)
        ranks = sorted({n[1] for b in self.buckets.sums.values() for n in b if isinstance(n, tuple)}
                       | {r["rank"] for _, rows in tail for r in rows})
        waits = {rank: self.buckets.series((RANK_SERIES, rank)) for rank in ranks}
        for _, rows in tail:
            for r in rows:
                if r[RANK_SERIES] is not None:
                    waits[r["rank"]][0].append(r["step"])
                    waits[r["rank"]][1].append(r[RANK_SERIES])
        out[RANK_SERIES] = waits
        out["width"] = self.buckets.width
        return out
