"""Heavy page computations in a process the server owns, so that they can be cancelled.

A page's library call (a plan solve, a Geo simulation, a schedule simulation) can run for
minutes on a huge input, and a solver's own children (`cbc`) can outlive the call that
started them. Here it runs in a child process `python -m ui.background <folder>`, in its own
process group (the child and its `cbc` die together), killed when a newer request of the same
session and name replaces it, when its session ends or stops polling (the server's reaper
thread), or when the server dies (the child watches its heartbeat file and its parent).

A page calls `result_of(name, fn, *args)`: the value once the child is done, `Pending` while
it runs (raise it out of an `st.cache_data` function: exceptions are not cached). The call, its
arguments and the result travel as pickles through files in a temporary folder; `fn` must be
a module-level function. `run_bounded(fn, *args)` is the short-lived kind: one call (parsing an
upload) that must answer within a time and memory bound, or fail with one line. Tests:
tests/e2e/test_ui_background.py, tests/e2e/test_upload_bounded.py.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S = 20.0  # a page polls every POLL_S; a tab hidden by the browser polls less often
POLL_S = 0.5  # how often a waiting page asks (st.fragment run_every)
# result_of waits this long before it answers Pending, so a quick call looks synchronous;
# GPUMIX_UI_FIRST_WAIT_S overrides it (0: every call shows its progress and Cancel at once)
FIRST_WAIT_S = float(os.environ.get("GPUMIX_UI_FIRST_WAIT_S", "5.0"))
REAP_S = 0.5  # how often the server's reaper looks at its children
CHILD_CHECK_S = 0.5  # how often a child looks at its heartbeat and its parent
CALL_FILE, RESULT_FILE, HEARTBEAT_FILE, LOG_FILE = "call.pkl", "result.pkl", "heartbeat", "child.log"


class Pending(Exception):
    """The computation is still running (not an error: the page shows a progress line)."""

    def __init__(self, job: "Job"):
        super().__init__(f"still running after {job.elapsed_s:.0f} s")
        self.job = job


class ChildFailed(RuntimeError):
    """The child died without a result (killed from outside, out of memory): one line on the page."""


class Cancelled(RuntimeError):
    """The computation was cancelled (by the user, a newer request, or its session ending)."""


class Job:
    """One call `fn(*args, **kwargs)` in a child process (its own process group)."""

    def __init__(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
                 heartbeat_s: float = HEARTBEAT_S, owner: str | None = None, key: Any = None,
                 memory_bytes: int | None = None):
        """`memory_bytes`: the child's address-space limit (None: unlimited)."""
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.owner, self.key, self.heartbeat_s = owner, key, heartbeat_s
        self.folder = tempfile.mkdtemp(prefix="gpumix-job-")
        with open(os.path.join(self.folder, CALL_FILE), "wb") as fh:
            pickle.dump((fn, tuple(args), dict(kwargs or {})), fh)
        self._touch()
        self.started = time.monotonic()
        self.cancel_reason: str | None = None
        self._outcome: tuple[str, Any] | None = None
        self._lock = threading.Lock()
        with open(os.path.join(self.folder, LOG_FILE), "wb") as err:
            # own session = own process group: killpg ends the child and its cbc together
            self.proc = subprocess.Popen([sys.executable, "-m", "ui.background", self.folder, str(heartbeat_s),
                                          str(memory_bytes or 0)],
                                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        self.last_poll = time.monotonic()
        log.debug("job %s started: pid %d", getattr(fn, "__qualname__", fn), self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def _touch(self) -> None:
        path = os.path.join(self.folder, HEARTBEAT_FILE)
        with open(path, "a", encoding="utf-8"):
            os.utime(path)

    def poll(self) -> bool:
        """True once finished (done, failed or cancelled); a poll is also the owner's heartbeat."""
        with self._lock:
            if self._outcome is None:
                self.last_poll = time.monotonic()
                with contextlib.suppress(OSError):
                    self._touch()
                if self.proc.poll() is not None:
                    self._collect()
            return self._outcome is not None

    @property
    def finished(self) -> bool:
        """Answered (done, failed or cancelled) as of the last poll."""
        return self._outcome is not None

    def poll_quietly(self) -> bool:
        """Finished? Without counting as the owner's heartbeat (the reaper's look)."""
        with self._lock:
            if self._outcome is None and self.proc.poll() is not None:
                self._collect()
            return self._outcome is not None

    def _collect(self) -> None:  # under self._lock, the child has exited
        path = os.path.join(self.folder, RESULT_FILE)
        if self.cancel_reason is not None:
            self._outcome = ("error", Cancelled(f"cancelled: {self.cancel_reason}"))
        elif os.path.exists(path):
            with open(path, "rb") as fh:
                self._outcome = pickle.load(fh)
        else:
            with contextlib.suppress(OSError), open(os.path.join(self.folder, LOG_FILE), "rb") as fh:
                log.warning("job pid %d ended with code %s: %s", self.pid, self.proc.returncode,
                            fh.read()[-2000:].decode("utf-8", "replace"))
            self._outcome = ("error", ChildFailed(f"the computation ended with exit code {self.proc.returncode} "
                                                   "(out of memory or killed?)"))
        shutil.rmtree(self.folder, ignore_errors=True)

    def wait(self, timeout_s: float) -> bool:
        """Poll until finished or `timeout_s` has passed; True when finished."""
        deadline = time.monotonic() + timeout_s
        while not self.poll():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def result(self) -> Any:
        """The value, or the child's exception raised again (Cancelled after a cancel); Pending while it runs."""
        if not self.poll():
            raise Pending(self)
        kind, value = self._outcome
        if kind == "error":
            raise value
        return value

    def cancel(self, reason: str = "by the user") -> None:
        """Kill the child's process group (the child and every process it started) and reap it."""
        with self._lock:
            if self._outcome is not None:
                return
            self.cancel_reason = reason
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._collect()
        log.info("job pid %d cancelled: %s", self.pid, reason)


# ---- jobs owned by Streamlit sessions ---------------------------------------------------

_jobs: dict[tuple[str | None, str], Job] = {}  # (session id, name) -> its newest job
_jobs_lock = threading.Lock()
_reaper: threading.Thread | None = None


def session_id() -> str | None:
    """The running script's Streamlit session, None outside one."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else None


def _session_active(owner: str | None) -> bool:
    if owner is None:
        return True
    from streamlit import runtime

    if not runtime.exists():
        return True
    # a real bool only from the real runtime (AppTest's is a mock: the heartbeat decides there)
    return runtime.get_instance().is_active_session(owner) is not False


def _reap_forever() -> None:
    while True:
        time.sleep(REAP_S)
        try:
            reap_once()
        except Exception:  # noqa: BLE001 - the reaper must outlive any one odd job
            log.exception("reaping the background jobs failed")


def reap_once() -> None:
    """Reap finished children; cancel and forget every job whose session has ended or whose page
    stopped polling it for its heartbeat_s (a finished one too: nobody will read its result)."""
    with _jobs_lock:
        jobs = list(_jobs.items())
    now = time.monotonic()
    for slot, job in jobs:
        job.poll_quietly()  # a child that has exited is waited for: no <defunct> left
        if not _session_active(job.owner):
            job.cancel("the session ended")
        elif now - job.last_poll > job.heartbeat_s:
            job.cancel(f"no page polled it for {job.heartbeat_s:g} s")
        else:
            continue
        with _jobs_lock:
            if _jobs.get(slot) is job:
                del _jobs[slot]


def _ensure_reaper() -> None:
    global _reaper
    with _jobs_lock:
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap_forever, name="gpumix-job-reaper", daemon=True)
            _reaper.start()


def submit(name: str, fn: Callable[..., Any], *args: Any, key: Any = None, heartbeat_s: float = HEARTBEAT_S,
           **kwargs: Any) -> Job:
    """Start `fn(*args, **kwargs)` for this session under `name`, killing the session's older job of that name."""
    owner = session_id()
    _ensure_reaper()
    job = Job(fn, args, kwargs, heartbeat_s=heartbeat_s, owner=owner, key=key)
    with _jobs_lock:
        old, _jobs[(owner, name)] = _jobs.get((owner, name)), job
    if old is not None:
        old.cancel("a newer request replaced it")
    return job


def current(name: str) -> Job | None:
    """This session's newest job under `name` (running or finished), if any."""
    with _jobs_lock:
        return _jobs.get((session_id(), name))


def cancel(name: str, reason: str = "by the user") -> None:
    with _jobs_lock:
        job = _jobs.pop((session_id(), name), None)
    if job is not None:
        job.cancel(reason)


def result_of(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` computed in this session's background job `name`.

    Returns the value once done; raises Pending while running, or the call's own exception.
    A new job gets FIRST_WAIT_S to answer before Pending (the page then shows a spinner, as a
    synchronous call would). A call with other arguments replaces the job; a cancelled job is
    started again."""
    key = (fn.__module__, fn.__qualname__, args, tuple(sorted(kwargs.items())))
    job = current(name)
    if job is None or job.key != key or (job.poll() and job.cancel_reason is not None):
        job = submit(name, fn, *args, key=key, **kwargs)
        job.wait(FIRST_WAIT_S)
    try:
        return job.result()
    finally:
        if job.finished:  # answered (a value or an error): from now on the page's cache holds it
            with _jobs_lock:
                if _jobs.get((job.owner, name)) is job:
                    del _jobs[(job.owner, name)]


def run_bounded(fn: Callable[..., Any], *args: Any, timeout_s: float, memory_bytes: int) -> Any:
    """`fn(*args)` in a child process of its own that may use `memory_bytes` of address space and
    `timeout_s` of time: the value, or the call's own exception (ValueError: bad input) raised
    again; ChildFailed, one line, when it ran out of either. The server's own memory and time
    never depend on what `fn` meets (a huge or hostile upload)."""
    job = Job(fn, args, memory_bytes=memory_bytes)  # not a session's: waited for here, never reaped
    if not job.wait(timeout_s):
        job.cancel(f"took longer than {timeout_s:g} s")
        raise ChildFailed(f"took longer than {timeout_s:g} s (too large?)")
    try:
        return job.result()
    except MemoryError:
        raise ChildFailed(f"needs more than {memory_bytes / 2**20:,.0f} MiB to read (too large?)") from None


# ---- the page's side -------------------------------------------------------------------


def show_pending(name: str, label: str, cancel_key: str, on_cancel: Callable[[], None] | None = None) -> None:
    """While this session's job `name` runs: "<label> 12 s" and a Cancel button; the page reruns
    when the job finishes. `on_cancel` forgets the page's request (so that it is not started again)."""
    import streamlit as st

    def cancel_now() -> None:
        cancel(name)
        if on_cancel is not None:
            on_cancel()

    text, button = st.columns([5, 1])
    button.button("Cancel", key=cancel_key, on_click=cancel_now, icon=":material/cancel:")

    @st.fragment(run_every=POLL_S)
    def waiting() -> None:
        job = current(name)
        if job is None or job.poll():
            st.rerun(scope="app")
        st.info(f"{label} {job.elapsed_s:.0f} s (Cancel stops it)", icon=":material/hourglass_top:")

    with text:
        waiting()


# ---- the child --------------------------------------------------------------------------


def _watch_owner(folder: str, heartbeat_s: float, parent: int) -> None:
    """Kill this process group once the owner stops heartbeating or the server is gone."""
    while True:
        time.sleep(CHILD_CHECK_S)
        try:
            stale = time.time() - os.stat(os.path.join(folder, HEARTBEAT_FILE)).st_mtime > heartbeat_s
        except OSError:
            stale = True  # the folder is gone: the owner forgot this job
        if stale or os.getppid() != parent:
            os.killpg(os.getpgid(0), signal.SIGKILL)


def _child_main(folder: str, heartbeat_s: float, memory_bytes: int = 0) -> int:
    threading.Thread(target=_watch_owner, args=(folder, heartbeat_s, os.getppid()), daemon=True).start()
    if memory_bytes > 0:  # after the watcher's thread (its stack counts too), before the call's pickle is read
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    with open(os.path.join(folder, CALL_FILE), "rb") as fh:
        fn, args, kwargs = pickle.load(fh)
    try:
        outcome: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - the page shows it (ValueError: bad input)
        outcome = ("error", e)
    tmp = os.path.join(folder, RESULT_FILE + ".tmp")
    with open(tmp, "wb") as fh:
        try:
            pickle.dump(outcome, fh)
        except Exception as e:  # noqa: BLE001 - an unpicklable exception still reaches the page
            fh.seek(0)
            fh.truncate()
            pickle.dump(("error", ChildFailed(f"{type(outcome[1]).__name__}: {outcome[1]} ({e})")), fh)
    os.replace(tmp, os.path.join(folder, RESULT_FILE))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(_child_main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0))
