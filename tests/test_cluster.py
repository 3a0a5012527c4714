import json

import pytest

from planner.catalog import CATALOG, get_gpu_type
from planner.cluster import ClusterSpec, homogeneous_cluster

GOOD = {"name": "lab",
        "nodes": [{"name": "n0", "datacenter": "dc-a", "gpus": {"A100-80GB": 4}},
                  {"name": "n1", "datacenter": "dc-a", "gpus": {"V100-32GB": 2, "T4": 2}}],
        "network": {"intra_node_gbps": 300, "inter_node_gbps": 100}}


def test_catalog_has_the_required_types_with_sane_numbers():
    required = ["A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "V100-16GB", "V100-32GB", "T4", "L4",
                "A10G", "L40S", "A6000", "RTX3090", "RTX4090", "P100", "P40", "MI250X", "cpu"]
    for name in required:
        g = get_gpu_type(name)
        assert g.memory_bytes > 0 and g.fp32_tflops > 0 and g.fp16_tflops > 0 and g.memory_gbps > 0
    assert len(CATALOG) >= 16
    assert not get_gpu_type("V100-32GB").supports_bf16
    assert get_gpu_type("V100-32GB").peak_tflops("bf16") == get_gpu_type("V100-32GB").fp16_tflops


def test_good_cluster_parses_groups_and_round_trips():
    c = ClusterSpec.from_dict(GOOD)
    assert c.num_devices == 8
    groups = c.groups()
    assert [(g.node, g.device.type, g.count) for g in groups] == [
        ("n0", "A100-80GB", 4), ("n1", "V100-32GB", 2), ("n1", "T4", 2)]
    assert ClusterSpec.from_json(c.to_json()) == c


def test_emulated_devices_are_labelled():
    c = ClusterSpec.from_dict({"nodes": [{"name": "local", "gpus": [{"type": "cpu"}, {"type": "cpu", "slowdown": 3.0,
                                                                                   "memory_gb": 2}]}]})
    assert c.emulated
    (_, fast), (_, slow) = c.devices()
    assert not fast.emulated and slow.emulated
    assert "emulated" in slow.label and slow.memory_bytes == 2 * 2**30
    assert ClusterSpec.from_json(c.to_json()) == c


@pytest.mark.parametrize("doc,needle", [
    ({"nodes": []}, "non-empty"),
    ({"nodes": [{"name": "a", "gpus": {"B300": 1}}]}, "unknown GPU type 'B300'"),
    ({"nodes": [{"name": "a", "gpus": {}}]}, "has no devices"),
    ({"nodes": [{"name": "a", "gpus": {"T4": -1}}]}, "non-negative integer"),
    ({"nodes": [{"name": "a", "gpus": [{"type": "cpu", "slowdown": 0}]}]}, "slowdown must be a positive"),
    ({"nodes": [{"name": "a", "gpus": {"T4": 1}}], "network": {"inter_node_gbps": "fast"}}, "inter_node_gbps"),
    ({"nodes": [{"name": "a", "gpus": {"T4": 1}}, {"name": "a", "gpus": {"T4": 1}}]}, "duplicate node"),
])
def test_bad_clusters_name_the_problem(doc, needle):
    with pytest.raises(ValueError, match=needle):
        ClusterSpec.from_dict(doc)


def test_malformed_json_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="malformed JSON"):
        ClusterSpec.from_json("{\"nodes\": [")
    with pytest.raises(ValueError, match="cannot read cluster file"):
        ClusterSpec.load(str(tmp_path / "nope.json"))


def test_homogeneous_helper():
    c = homogeneous_cluster("T4", 3)
    assert c.num_devices == 3 and c.device_types() == ["T4"]
    assert json.loads(c.to_json())["nodes"][0]["gpus"] == {"T4": 3}
