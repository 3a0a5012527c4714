"""`python -m profiler inventory`: JSON and the cluster file, the SLURM flags, and the landing page's
path importing no torch without a GPU driver (fresh interpreters). The parsers:
tests/unit/test_inventory.py."""
import json
import os
import subprocess
import sys

import pytest

from contracts.cluster import ClusterSpec
from profiler import inventory
from testkit import ROOT


def test_landing_page_path_does_not_import_torch_without_a_gpu_driver():
    if any(os.path.exists(p) for p in inventory._GPU_DRIVER_PATHS):
        pytest.skip("this machine has a GPU driver: listing its GPUs needs torch")
    code = "import sys; from profiler.inventory import build_local_cluster; build_local_cluster(); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_inventory_cli_json_and_cluster_file(tmp_path, data_dir):
    out_file = tmp_path / "local.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "profiler", "inventory", "--json", "--out", str(out_file)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["devices"][0]["kind"] == "cpu" and doc["devices"][0]["num_cores"] >= 1
    loaded = ClusterSpec.load(str(out_file))
    assert loaded.to_dict() == doc["cluster"] and loaded.num_devices >= 2
    assert doc["measured"] == {"cpu": None}  # nothing benchmarked in this fresh data dir
    r = subprocess.run([sys.executable, "-m", "profiler", "inventory", "--out", str(tmp_path / "no" / "x.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr


def test_inventory_slurm_flags_need_slurm():
    r = subprocess.run([sys.executable, "-m", "profiler", "inventory", "--gres-name", "gpu"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "go with --slurm" in r.stderr and "Traceback" not in r.stderr
