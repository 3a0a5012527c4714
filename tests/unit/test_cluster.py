import json

import pytest

from contracts.catalog import CATALOG, get_gpu_type
from contracts.cluster import ClusterSpec, homogeneous_cluster

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


@pytest.mark.parametrize("doc,needle", [
    ({"nodes": [{"name": "a", "gpus": {"T4": 1}, "gpu": 3}]}, "unknown node keys"),
    ({"nodes": [{"name": "a", "gpus": {"T4": 1}}], "network": {"wan_gbps": 1}}, "unknown network keys"),
    ({"nodes": [{"name": "a", "gpus": [{"type": ["T4"]}]}]}, "unknown GPU type"),
    ({"nodes": [{"name": "", "gpus": {"T4": 1}}]}, "'name' must be a non-empty string"),
    ({"nodes": [{"name": 7, "gpus": {"T4": 1}}]}, "'name' must be a non-empty string"),
    ({"nodes": [{"name": "a", "datacenter": None, "gpus": {"T4": 1}}]}, "'datacenter' must be"),
    ({"nodes": [{"name": "a", "gpus": {"T4": 1.5}}]}, "non-negative integer"),
    ({"nodes": [{"name": "a", "gpus": {"T4": True}}]}, "non-negative integer"),
    ({"nodes": [{"name": "a", "gpus": [{"type": "cpu", "memory_gb": -2}]}]}, "memory_gb must be a positive"),
    ({"nodes": [{"name": "a", "gpus": [{"type": "cpu", "speed": 2}]}]}, "unknown device keys"),
    ({"nodes": [{"name": "a", "gpus": "T4"}]}, "'gpus' must be"),
    ({"nodes": [{"name": "a", "gpus": {"T4": 1}}], "network": {"intra_node_gbps": float("nan")}}, "intra_node_gbps"),
    ({"nodes": [{"name": "a", "gpus": {"T4": 1}}], "network": {"intra_node_gbps": 0}}, "intra_node_gbps"),
    ([1, 2], "expected a JSON object"),
])
def test_more_bad_clusters_name_the_problem(doc, needle):
    with pytest.raises(ValueError, match=needle):
        ClusterSpec.from_dict(doc)


def test_cluster_file_round_trips_through_disk(tmp_path):
    path = str(tmp_path / "lab.json")
    c = ClusterSpec.from_dict(GOOD)
    c.save(path)
    assert ClusterSpec.load(path) == c
    assert json.loads(open(path).read())["nodes"][1]["gpus"] == {"V100-32GB": 2, "T4": 2}


def test_editing_helpers_validate_and_keep_emulation():
    from contracts.cluster import DeviceSpec

    c = homogeneous_cluster("T4", 2)
    c = c.with_devices("n0", "dc0", DeviceSpec("cpu", slowdown=3.0), 1)
    c = c.with_devices("n1", "dc-b", DeviceSpec("H200"), 4)
    assert c.num_devices == 7 and c.emulated
    assert [(g.node, g.device.label, g.count) for g in c.groups()] == [
        ("n0", "T4", 2), ("n0", "cpu (emulated: slowdown 3x)", 1), ("n1", "H200", 4)]
    assert ClusterSpec.from_json(c.to_json()) == c
    assert c.without_node("n0").device_types() == ["H200"]
    assert c.renamed("lab2").name == "lab2"
    with pytest.raises(ValueError, match="datacenter 'dc0', not 'dc-x'"):
        c.with_devices("n0", "dc-x", DeviceSpec("T4"), 1)
    with pytest.raises(ValueError, match="positive integer"):
        c.with_devices("n2", "dc0", DeviceSpec("T4"), 0)
    with pytest.raises(ValueError, match="no node 'zz'"):
        c.without_node("zz")
    with pytest.raises(ValueError, match="'name' must be a non-empty string"):
        c.with_devices(" ", "dc0", DeviceSpec("T4"), 1)


@pytest.mark.parametrize("name,memory_gib,expected", [
    ("NVIDIA H200", 140, "H200"),
    ("NVIDIA H100 80GB HBM3", 80, "H100-SXM"),
    ("NVIDIA H100 PCIe", 80, "H100-PCIe"),
    ("NVIDIA A100-SXM4-80GB", None, "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", 40, "A100-40GB"),
    ("Tesla V100-SXM2-16GB", 16, "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 32, "V100-32GB"),
    ("Tesla T4", 15, "T4"),
    ("NVIDIA L4", 22, "L4"),
    ("NVIDIA GeForce RTX 4090", 24, "RTX4090"),
    ("NVIDIA RTX A6000", 48, "A6000"),
    ("AMD Instinct MI250X", 64, "MI250X"),
    ("NVIDIA B200", 180, None),
])
def test_driver_names_map_to_catalog_types(name, memory_gib, expected):
    from contracts.catalog import match_gpu_type

    assert match_gpu_type(name, memory_gib * 2**30 if memory_gib else None) == expected


def test_catalog_units_and_dtype_fallbacks():
    h200 = get_gpu_type("H200")
    assert h200.memory_bytes_per_s == 4.8e12 and h200.peak_tflops("bf16") == 989.0
    assert get_gpu_type("T4").peak_tflops("bf16") == 65.0  # no bf16: fp16 rate
    assert get_gpu_type("A100-80GB").peak_tflops("fp32") == 19.5
    # faster parts are faster in the catalog too (orders the planner relies on)
    assert get_gpu_type("H100-SXM").bf16_tflops > get_gpu_type("A100-80GB").bf16_tflops > get_gpu_type("L4").bf16_tflops
    with pytest.raises(ValueError, match="unknown GPU type 'B300'"):
        get_gpu_type("B300")


def test_cpu_share_devices_are_their_own_profile_kind_and_round_trip():
    from contracts.cluster import DeviceSpec, profile_key, split_profile_key

    c = ClusterSpec.from_dict({"nodes": [{"name": "local", "gpus": [
        {"type": "cpu", "cpu_share": 1.0}, {"type": "cpu", "cpu_share": 0.333, "memory_gb": 2}, {"type": "cpu"}]}]})
    (_, full), (_, third), (_, plain) = c.devices()
    assert full.emulated and third.emulated and not plain.emulated and c.emulated
    assert (full.profile_key, third.profile_key, plain.profile_key) == ("cpu@share1", "cpu@share0.333", "cpu")
    assert split_profile_key(third.profile_key) == ("cpu", 0.333) and split_profile_key("T4") == ("T4", None)
    assert profile_key("cpu", 0.25) == "cpu@share0.25"
    assert third.label == "cpu (emulated: 0.333 of a core, 2 GiB)"
    assert third.to_dict() == {"type": "cpu", "memory_gb": 2, "cpu_share": 0.333}
    assert ClusterSpec.from_json(c.to_json()) == c
    assert len(c.groups()) == 3  # three kinds: the ILP counts them apart
    assert DeviceSpec("cpu", cpu_share=0.5) != DeviceSpec("cpu")


@pytest.mark.parametrize("device,needle", [
    ({"type": "cpu", "cpu_share": 0}, "cpu_share must be a positive number"),
    ({"type": "cpu", "cpu_share": 1.5}, r"fraction of one core in \(0, 1\]"),
    ({"type": "cpu", "cpu_share": "half"}, "cpu_share must be a positive number"),
    ({"type": "cpu", "cpu_share": float("nan")}, "cpu_share must be a positive number"),
    ({"type": "T4", "cpu_share": 0.5}, "'T4' is not 'cpu'"),
    ({"type": "cpu", "cpu_share": 0.5, "slowdown": 2}, "either cpu_share .* or slowdown"),
])
def test_bad_cpu_shares_name_the_problem(device, needle):
    with pytest.raises(ValueError, match=needle):
        ClusterSpec.from_dict({"nodes": [{"name": "a", "gpus": [device]}]})


def test_malformed_profile_keys_are_refused():
    from contracts.cluster import split_profile_key

    for key in ("cpu@sharex", "cpu@share2", "cpu@share0"):
        with pytest.raises(ValueError, match="profile key"):
            split_profile_key(key)


def test_a_huge_cluster_file_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch):
    import builtins

    from contracts.jsonio import MAX_INPUT_FILE_BYTES

    path = tmp_path / "huge.json"
    with open(path, "wb") as fh:
        fh.truncate(MAX_INPUT_FILE_BYTES + 1)  # sparse: nothing written, the size is what counts
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    with pytest.raises(ValueError, match="over the limit"):
        ClusterSpec.load(str(path))
    assert str(path) not in opened
