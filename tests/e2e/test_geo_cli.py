"""`python -m planner geo`: JSON and table output, and bad input exits 2 with one line. The Geo search
itself: tests/unit/test_geo.py."""
import json
import subprocess
import sys

import pytest

from tests.unit.test_geo import small_dict


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "planner", "geo", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_json_and_table(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(small_dict()))
    r = run_cli("--scenario", str(path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for k in ("iteration_s", "baseline_iteration_s", "gpu_utilization", "gpu_utilization_with_prefill",
              "prefill_tokens_per_s", "plan", "baselines"):
        assert k in out
    assert out["baseline_iteration_s"] == out["baselines"]["dp_across_dcs"]["iteration_s"]
    assert out["gpu_utilization_with_prefill"] >= out["gpu_utilization"]
    assert set(out["plan"]) >= {"datacenters", "gpus_per_dc", "layers_per_dc", "dp_degree", "connections"}
    assert out["search_exact"] is True and out["slower_than"] == [] and out["chosen_from"]
    assert out["gpu_utilization_training_only"] == out["gpu_utilization"]
    assert all(out[f"speedup_vs_{k}"] >= 1 - 1e-9 for k, b in out["baselines"].items() if b["iteration_s"])
    r = run_cli("--scenario", str(path), "--no-baselines")
    assert r.returncode == 0 and "simulated" in r.stdout


@pytest.mark.parametrize("content,match", [
    ("{not json", "not valid JSON"),
    (json.dumps(small_dict(wan=[{"a": "a", "b": "z", "gbps": 1, "rtt_ms": 10}])), "unknown datacenter 'z'"),
    (None, "no such file"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, content, match):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    r = run_cli("--scenario", str(path))
    assert r.returncode == 2
    assert match in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
