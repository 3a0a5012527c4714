"""The joint search inside the one planning entry (planner/entry.py `plan_job`) and `planner plan --max-tp`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from contracts.cluster import ClusterSpec
from planner.entry import plan_job
from planner.geo.scale.job import SCALE_MIN_NODES, applies

NODES = [{"name": f"a{i}", "datacenter": "dc", "gpus": {"A100-40GB": 2}} for i in range(4)] + \
        [{"name": f"v{i}", "datacenter": "dc", "gpus": {"V100-16GB": 2}} for i in range(4)]


@pytest.fixture()
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMIX_DATA_DIR", str(tmp_path))
    return tmp_path


def test_large_clusters_ask_the_joint_search(store):
    cluster = ClusterSpec.from_dict({"name": "c8", "nodes": NODES})
    assert applies(cluster) and not applies(ClusterSpec.from_dict({"name": "c2", "nodes": NODES[:2]}))
    assert len(cluster.nodes) >= SCALE_MIN_NODES
    result = plan_job(cluster, "gpt2", 32, seq=512, time_limit_s=10)
    notes = " ".join(result.plan.notes)
    assert "joint search" in notes
    d = result.plan_dict()
    if result.plan_file is not None:  # the joint plan won: its file says where every device sits
        assert all({"stage", "tp", "tp_group"} <= set(a) for a in d["assignments"])
        assert d["tensor_parallel"] is False  # max_tp defaults to 1: the runtime runs it
    assert result.plan.predicted_iteration_s > 0


def test_max_tp_flag(store, tmp_path):
    path = tmp_path / "c8.json"
    path.write_text(json.dumps({"name": "c8", "nodes": NODES}))
    bad = subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", str(path), "--model", "gpt2",
                          "--global-batch", "32", "--max-tp", "3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--max-tp" in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", str(path), "--model", "gpt2",
                         "--global-batch", "32", "--seq", "512", "--max-tp", "2", "--json"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    if d.get("tensor_parallel"):  # a tp plan is only ever the file, marked, with its groups
        assert any(a["tp"] == 2 for a in d["assignments"])
        assert any("tensor parallel" in n for n in d["notes"])
