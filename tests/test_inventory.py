import json
import os
import subprocess
import sys

import pytest

from planner.core.cluster import ClusterSpec
from profiler import inventory
from profiler.inventory import LocalDevice, build_local_cluster, detect_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_detect_devices_without_cuda_reports_the_cpu(monkeypatch):
    _no_cuda(monkeypatch)
    (cpu,) = detect_devices()
    assert cpu.kind == "cpu" and cpu.catalog_type == "cpu"
    assert cpu.num_cores == inventory.usable_cores() >= 1
    assert cpu.memory_bytes > 2**28 and cpu.name
    assert cpu.compute_capability is None and cpu.num_sms is None


def test_local_cluster_without_cuda_has_a_cpu_worker_per_core_but_at_least_two(monkeypatch):
    _no_cuda(monkeypatch)
    c = build_local_cluster()
    (node,) = c.nodes
    assert (node.name, node.datacenter) == ("localhost", "local")
    assert c.device_types() == ["cpu"] and not c.emulated
    assert c.num_devices == max(2, inventory.usable_cores())
    one_core = [LocalDevice("cpu", 0, "x", "cpu", 2**33, num_cores=1)]
    assert build_local_cluster(one_core).num_devices == 2
    eight = [LocalDevice("cpu", 0, "x", "cpu", 2**33, num_cores=8)]
    assert build_local_cluster(eight).num_devices == 8
    assert ClusterSpec.from_json(c.to_json()) == c


def test_gpus_become_one_device_each_with_their_catalog_type():
    gpus = [LocalDevice("cuda", i, "NVIDIA H200", "H200", 150_000_000_000, "9.0", 132) for i in range(2)]
    gpus.append(LocalDevice("cuda", 2, "Tesla T4", "T4", 15 * 2**30, "7.5", 40))
    c = build_local_cluster(gpus)
    assert [d.type for _, d in c.devices()] == ["H200", "H200", "T4"]
    assert c.nodes[0].datacenter == "local"


def test_unknown_gpu_falls_back_to_the_closest_catalog_type_by_memory():
    assert inventory._closest_catalog_type(80 * 2**30) in ("A100-80GB", "H100-SXM", "H100-PCIe")
    assert inventory._closest_catalog_type(16 * 2**30) in ("V100-16GB", "T4", "P100")


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
