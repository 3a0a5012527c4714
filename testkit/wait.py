"""Waiting for a condition: the one helper every test and fixture waits with.

`wait_until(predicate, timeout_s, what)` polls until the predicate returns something truthy and
returns it; past the timeout it raises WaitTimeout (an AssertionError and a TimeoutError) that names
what was awaited and the last value the predicate returned (or the last exception it was allowed to
raise), and `detail()` where given (the state worth reading: a run's events, the processes left). A
predicate aborts the wait early by raising anything not listed in `ignore`. `pause` replaces
time.sleep where the waiting must keep a loop turning (a Playwright page: `page.wait_for_timeout`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError, TimeoutError):
    """A condition did not hold in time (fails a test like an assert; catchable as a TimeoutError)."""


def page_pause(page: Any) -> Callable[[float], object]:
    """`pause` for a Playwright page: wait on the page's own clock, its events keep coming."""
    return lambda s: page.wait_for_timeout(s * 1000)


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2,
               ignore: tuple[type[BaseException], ...] = (), detail: Callable[[], object] | None = None,
               pause: Callable[[float], object] = time.sleep) -> T:
    """Call `predicate` every `interval_s` until it returns a truthy value, which is returned.

    Exceptions of the types in `ignore` count as "not yet" (a server not answering yet). The
    predicate is always called at least once, and once more at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        expired = time.monotonic() >= deadline
        try:
            last = predicate()
        except ignore as e:
            last = e
        else:
            if last:
                return last
        if expired:
            more = f"; {detail()}" if detail is not None else ""
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}; last seen: {last!r}{more}")
        pause(max(0.0, min(interval_s, deadline - time.monotonic())))
