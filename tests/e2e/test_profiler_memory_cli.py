"""`python -m profiler memory`: the traced peaks on the command line. The traces themselves:
tests/unit/test_profiler_memory.py."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.unit.test_profiler_memory import KEYS


def test_profiler_cli():
    r = subprocess.run([sys.executable, "-m", "profiler", "memory", "--model", "tiny-llama", "--micro-batch", "2",
                        "--seq", "64", "--dp", "2", "--zero", "3", "--accum-steps", "2", "--json"],
                       capture_output=True, text=True, check=True)
    d = json.loads(r.stdout)
    assert d["measured"] is True and all(k in d for k in ("num_params", *KEYS)) and d["zero"] == 3
    for args in (["--model", "nope"], ["--model", "tiny", "--shard-fraction", "0"],
                 ["--model", "tiny", "--zero", "3", "--shard-fraction", "0.1"]):
        r = subprocess.run([sys.executable, "-m", "profiler", "memory", *args], capture_output=True, text=True)
        assert r.returncode == 2, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
