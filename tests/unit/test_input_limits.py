"""Planner inputs are bounded before anything is built: a cluster file by its size and the devices it
claims, a model by its layer count and widths; each refusal names its limit."""
from __future__ import annotations

import json

import pytest

from contracts.cluster import ClusterSpec, homogeneous_cluster
from contracts.constants import (MAX_CLUSTER_DEVICES, MAX_CLUSTER_FILE_BYTES, MAX_MODEL_LAYERS, MAX_MODEL_SEQ,
                                 MAX_MODEL_VOCAB)
from contracts.specs import ModelSpec, get_model, with_max_seq


def cluster(*nodes):
    return {"name": "c", "nodes": [{"name": f"n{i}", "gpus": g} for i, g in enumerate(nodes)]}


def test_device_counts_at_the_limit_pass_and_one_more_is_refused():
    assert ClusterSpec.from_dict(cluster({"T4": MAX_CLUSTER_DEVICES})).num_devices == MAX_CLUSTER_DEVICES
    with pytest.raises(ValueError, match=f"node 'n1': {MAX_CLUSTER_DEVICES + 1:,} devices, over the limit of "
                                         f"{MAX_CLUSTER_DEVICES:,} devices in a cluster"):
        ClusterSpec.from_dict(cluster({"T4": MAX_CLUSTER_DEVICES - 1}, [{"type": "cpu"}, {"type": "cpu"}]))


def test_a_count_of_a_hundred_million_is_refused_by_its_claim():
    with pytest.raises(ValueError, match="100,000,000 devices, over the limit .*MAX_CLUSTER_DEVICES"):
        ClusterSpec.from_dict(cluster({"T4": 10**8}))
    with pytest.raises(ValueError, match="MAX_CLUSTER_DEVICES"):
        homogeneous_cluster("T4", 10**8)


def test_too_many_nodes_are_refused_before_any_is_read():
    d = {"name": "c", "nodes": [{"bogus": True}] * (MAX_CLUSTER_DEVICES + 1)}  # a node error would come first
    with pytest.raises(ValueError, match=f"{MAX_CLUSTER_DEVICES + 1:,} nodes, over the limit"):
        ClusterSpec.from_dict(d)


def test_a_cluster_file_over_its_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cluster({"T4": 1})))
    assert ClusterSpec.load(str(path)).num_devices == 1
    with open(path, "ab") as fh:
        fh.truncate(MAX_CLUSTER_FILE_BYTES + 1)
    with pytest.raises(ValueError, match="over the limit of 16 MiB"):
        ClusterSpec.load(str(path))


def test_model_sizes_over_their_limits_are_refused_naming_the_limit(tmp_path):
    tiny = get_model("tiny")
    with pytest.raises(ValueError, match=f"num_layers 1,000,000,000 is over the limit of {MAX_MODEL_LAYERS:,} "
                                         r"\(MAX_MODEL_LAYERS\)"):
        ModelSpec.from_dict({**tiny.to_dict(), "num_layers": 10**9})
    with pytest.raises(ValueError, match="MAX_MODEL_VOCAB"):
        ModelSpec.from_dict({**tiny.to_dict(), "vocab_size": MAX_MODEL_VOCAB + 1})
    with pytest.raises(ValueError, match="max_seq 8,388,609 is over the limit .*MAX_MODEL_SEQ"):
        with_max_seq(tiny, MAX_MODEL_SEQ + 1)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 10**9, "n_embd": 64, "n_head": 4,
                                  "vocab_size": 256, "n_positions": 128}))
    with pytest.raises(ValueError, match="MAX_MODEL_LAYERS"):
        get_model(str(config))
    for preset in ("llama3-8b", "mistral-7b", "gpt2"):  # every real model is within the limits
        assert get_model(preset).num_layers <= MAX_MODEL_LAYERS
