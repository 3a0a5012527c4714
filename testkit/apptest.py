"""Streamlit AppTest pages whose work runs in a background process (ui/background.py): `settle`
reruns the page, as its polling fragment does in a browser, until the answer is in."""
from __future__ import annotations

from typing import Any, Callable

from testkit.wait import wait_until

SETTLE_S = 120


def settle(at: Any, pending: Callable[[Any], bool], timeout_s: float = SETTLE_S) -> Any:
    """Rerun an AppTest page while `pending(at)`; no page exception at any run. Returns `at`."""
    def answered() -> bool:
        assert not at.exception
        if not pending(at):
            return True
        at.run()
        return not pending(at)

    wait_until(answered, timeout_s, "the background computation to come back")
    assert not at.exception
    return at
