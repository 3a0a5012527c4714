"""The memory model through a fresh interpreter: `python -m planner memory` (JSON, bad input) and its
torch-free import. The model itself: tests/unit/test_memory.py."""
from __future__ import annotations

import subprocess
import sys

from tests.unit.test_memory import S4


def test_planner_memory_imports_no_torch():
    code = "import sys, planner.core.memory, planner.core.memory_command; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_json_and_bad_input():
    import json

    out = subprocess.run([sys.executable, "-m", "planner", "memory", "--model", "tiny", "--dp", "4", "--json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["optimizer_bytes"] == 8 * S4 and d["measured"] is False
    for args in (["--model", "nope"], ["--model", "tiny", "--shard-fraction", "1.5"],
                 ["--model", "tiny", "--tp", "3"], ["--model", "tiny", "--micro-batch", "x"],
                 ["--model", "tiny", "--seq", "4096"]):
        r = subprocess.run([sys.executable, "-m", "planner", "memory", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
