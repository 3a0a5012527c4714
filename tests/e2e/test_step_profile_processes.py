"""Step profiles that start processes: workers timed beside a running companion, and `python -m
profiler profile` (JSON, bad input). The rest: tests/unit/test_step_profile.py."""
import contextlib

import pytest

from profiler.step_profile import profile_local


def test_concurrent_workers_time_under_a_running_companion(data_dir):
    """workers=2: a companion process computes while every timing round runs (seen from the
    progress callback), the clock is wall time, and the companion is gone afterwards."""
    import psutil

    def companions():  # spawned multiprocessing children (not its resource tracker)
        out = []
        for c in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if c.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(c.cmdline()):
                    out.append(c)
        return out

    alive_during_timing = []

    def progress(fraction, message):
        if message.startswith("timing round"):
            alive_during_timing.append(len(companions()))

    p = profile_local("tiny", 32, micro_batches=(1, 2, 3, 4), repeats=2, warmup=1, save=False, workers=2,
                      progress=progress)
    assert alive_during_timing and min(alive_during_timing) >= 1, alive_during_timing
    assert "wall time with 2 concurrent workers" in p.source and p.beta_s > 0
    assert not companions()
    with pytest.raises(ValueError, match="workers"):
        profile_local("tiny", 32, micro_batches=(1, 2, 3, 4), save=False, workers=0)


def test_profile_cli_json_and_bad_input(data_dir):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "profiler", "profile", "--model", "tiny", "--seq", "32",
                        "--micro-batches", "1,2,3,4", "--repeats", "1", "--json"],
                       cwd=root, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["measured"] is True and doc["model"] == "tiny" and doc["micro_batches"] == [1, 2, 3, 4]
    assert doc["store_path"].startswith(data_dir) and os.path.exists(doc["store_path"])
    r = subprocess.run([sys.executable, "-m", "profiler", "profile", "--model", "tiny", "--micro-batches", "x"],
                       cwd=root, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2 and "Traceback" not in r.stderr
