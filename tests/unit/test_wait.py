"""testkit.wait.wait_until: the value comes back, a timeout names what was awaited and what was last
seen, listed exceptions count as "not yet" and others end the wait at once."""
import time

import pytest

from testkit.wait import WaitTimeout, wait_until


def test_returns_the_first_truthy_value():
    values = iter([None, 0, [], "ready"])
    assert wait_until(lambda: next(values), 5, "ready", interval_s=0.001) == "ready"


def test_a_timeout_names_what_the_last_value_seen_and_the_detail():
    calls = []

    def never() -> int:
        calls.append(1)
        return 0

    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"0.2 s waiting for the answer; last seen: 0; 3 jobs queued") as e:
        wait_until(never, 0.2, "the answer", interval_s=0.01, detail=lambda: "3 jobs queued")
    assert 0.2 <= time.monotonic() - t0 < 5 and len(calls) >= 2
    assert isinstance(e.value, AssertionError) and isinstance(e.value, TimeoutError)


def test_listed_exceptions_mean_not_yet_and_others_end_the_wait():
    answers = iter([ConnectionRefusedError("not up"), ConnectionRefusedError("not up"), "up"])

    def probe() -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert wait_until(probe, 5, "the server", interval_s=0.001, ignore=(OSError,)) == "up"
    with pytest.raises(WaitTimeout, match="last seen: ConnectionRefusedError"):
        wait_until(lambda: probe_refused(), 0.05, "the server", interval_s=0.01, ignore=(OSError,))
    t0 = time.monotonic()
    with pytest.raises(ValueError):
        wait_until(lambda: int("x"), 30, "a number")
    assert time.monotonic() - t0 < 5


def probe_refused() -> None:
    raise ConnectionRefusedError("not up")
