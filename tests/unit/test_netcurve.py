"""Measured bandwidth curves (planner/costmodel/netcurve.py) against hand-computed values of their polynomial,
the ring collectives priced with them, and Sailor's bandwidth files imported into the store."""
from __future__ import annotations

import json
import math
import os

import pytest

from contracts.cli import main
from planner.costmodel.netcurve import (BandwidthCurve, NetworkProfile, all_reduce_time_s, list_network_profiles,
                                        load_network_profile, ring_time_s, save_network_profile)
from profiler.__main__ import COMMANDS

SAILOR_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "sailor")
# bandwidth(x MB) = 0.5·log2(x)² + 2·log2(x) + 10 GB/s, capped at 40 GB/s
CURVE = BandwidthCurve("A100-40GB", 4, "A100-40GB", 4, (0.5, 2.0, 10.0), 40e9)


def test_bandwidth_is_the_polynomial_in_log2_megabytes():
    # 4 MB: x = 2 -> 0.5·4 + 2·2 + 10 = 16 GB/s
    assert CURVE.bandwidth_bytes_per_s(4e6) == pytest.approx(16e9)
    assert CURVE.bandwidth_gbps(4e6) == pytest.approx(128.0)  # Gbit/s, as cluster files quote links
    # 2 MB: x = 1 -> 12.5 GB/s; 1 MB: the constant term
    assert CURVE.bandwidth_bytes_per_s(2e6) == pytest.approx(12.5e9)
    assert CURVE.bandwidth_bytes_per_s(1e6) == pytest.approx(10e9)
    # below the fit's 1 MB floor: the 1 MB bandwidth
    assert CURVE.bandwidth_bytes_per_s(1e3) == pytest.approx(10e9)
    # 64 MB: x = 6 -> 18 + 12 + 10 = 40 GB/s; 256 MB: x = 8 -> 58 GB/s, capped at the measured 40
    assert CURVE.bandwidth_bytes_per_s(64e6) == pytest.approx(40e9)
    assert CURVE.bandwidth_bytes_per_s(256e6) == pytest.approx(40e9)
    assert CURVE.message_time_s(4e6) == pytest.approx(4e6 / 16e9)


def test_ring_collectives_send_chunks_of_n_over_k_at_the_chunk_bandwidth():
    # 8 MB over 4 GPUs: chunks of 2 MB at 12.5 GB/s = 160 µs each
    chunk_s = 2e6 / 12.5e9
    assert ring_time_s("all_reduce", 8e6, 4, CURVE) == pytest.approx(2 * 3 * chunk_s)
    assert ring_time_s("all_gather", 8e6, 4, CURVE) == pytest.approx(3 * chunk_s)
    assert ring_time_s("reduce_scatter", 8e6, 4, CURVE) == pytest.approx(3 * chunk_s)
    assert ring_time_s("all_reduce", 8e6, 1, CURVE) == 0.0
    # a mixed ring runs at its slowest link
    slow = BandwidthCurve("V100-16GB", 4, "V100-16GB", 4, (0.0, 0.0, 5.0), 40e9)
    assert ring_time_s("all_reduce", 8e6, 4, [CURVE, slow]) == pytest.approx(6 * 2e6 / 5e9)
    # 20 MB in 8 MB buckets: two full buckets and one of 4 MB (1 MB chunks at 10 GB/s)
    assert all_reduce_time_s(20e6, 4, CURVE, bucket_bytes=8e6) == pytest.approx(2 * 6 * chunk_s + 6 * 1e6 / 10e9)
    with pytest.raises(ValueError, match="op must be one of"):
        ring_time_s("broadcast", 8e6, 4, CURVE)


def test_a_curve_without_positive_bandwidth_is_refused():
    with pytest.raises(ValueError, match="no positive bandwidth at 1 MB"):
        BandwidthCurve("A100-40GB", 1, "A100-40GB", 1, (1.0, -3.0), 1e9)
    with pytest.raises(ValueError, match="maximum bandwidth must be > 0"):
        BandwidthCurve("A100-40GB", 1, "A100-40GB", 1, (1.0,), 0.0)


def test_network_profile_store_round_trip():
    profile = NetworkProfile("lab", "intra_node", "test curves", (CURVE,))
    save_network_profile(profile)
    assert list_network_profiles() == ["lab"] and load_network_profile("lab") == profile
    assert profile.curve("A100-40GB", 4) == CURVE
    with pytest.raises(ValueError, match="no curve for V100-16GBx4"):
        profile.curve("V100-16GB", 4)


def test_sailor_style_file_import(tmp_path, capsys):
    inter = {"zone-a": {"A100-40": {"4": {"zone-a": {"A100-40": {"4": [[0.5, 2.0, 10.0], 40e9]},
                                                     "V100-16": {"4": [[0.0, 1.0, 3.0], 9e9]}}}}}}
    path = tmp_path / "net.json"
    path.write_text(json.dumps(inter))
    assert main("python -m profiler", COMMANDS, ["import", "--format", "sailor", "--network", str(path)]) == 0
    profile = load_network_profile("net")
    assert profile.kind == "inter_node" and len(profile.curves) == 2 and "imported from Sailor net.json" in profile.source
    c = profile.curve("A100-40GB", 4, "V100-16GB", 4, zone_a="zone-a")
    assert c.bandwidth_bytes_per_s(8e6) == pytest.approx(6e9)  # x = 3 -> 3 + 3 GB/s
    path.write_text(json.dumps({"zone-a": {"A100-40": {"4": {"zone-a": {"A100-40": {"4": [[1.0], "fast"]}}}}}}))
    assert main("python -m profiler", COMMANDS, ["import", "--format", "sailor", "--network", str(path)]) == 2
    assert "expected [[coefficients...], maximum bytes/s]" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(os.path.join(SAILOR_DIR, "multizone_bandwidths_het.json")),
                    reason="Sailor's data (../shared/sailor) is not here")
def test_sailor_measured_curves_priced_as_their_polynomial():
    for name in ("multizone_bandwidths_het", "intra_node_bandwidths"):
        assert main("python -m profiler", COMMANDS, ["import", "--format", "sailor", "--network",
                                                     os.path.join(SAILOR_DIR, name + ".json")]) == 0
    with open(os.path.join(SAILOR_DIR, "multizone_bandwidths_het.json")) as fh:
        raw = json.load(fh)
    coeffs, cap = raw["us-central1-a"]["A100-40"]["4"]["us-central1-a"]["V100-16"]["4"]
    inter = load_network_profile("multizone_bandwidths_het")
    c = inter.curve("A100-40GB", 4, "V100-16GB", 4, zone_a="us-central1-a")
    x = math.log2(125e6 / 1e6)  # a 500 MB bucket over a ring of 4: 125 MB chunks
    expected = min(sum(k * x ** (len(coeffs) - 1 - i) for i, k in enumerate(coeffs)) * 1e9, cap)
    assert c.bandwidth_bytes_per_s(125e6) == pytest.approx(expected)
    assert ring_time_s("all_reduce", 500e6, 4, c) == pytest.approx(6 * 125e6 / expected)
    intra = load_network_profile("intra_node_bandwidths")
    assert intra.kind == "intra_node" and intra.curve("A100-40GB", 4).max_bytes_per_s == pytest.approx(243214602913.5)


def test_scale_costs_read_the_inter_node_curves_per_gpu_flows_or_as_sailor_does():
    """"flows": a node's traffic as one flow per GPU at the curve of that many GPUs (their aggregate);
    "sailor": a ring step one flow at the one-GPU curve, point-to-point one flow per replica at it."""
    from contracts.specs import get_model
    from planner.geo.scale.costs import ScaleCosts

    flat = lambda n, gbs: BandwidthCurve("A100-40GB", n, "A100-40GB", n, (gbs,), 100e9, "z", "z")  # noqa: E731
    inter = NetworkProfile("lab", "inter_node", "test curves", (flat(1, 2.0), flat(4, 6.0)))
    costs = ScaleCosts(get_model("tiny"), 32, "fp32", {}, inter, None, "z")
    gb = 1e9
    assert costs.inter_s("A100-40GB", "A100-40GB", 4, 12 * gb) == pytest.approx(2.0)  # 12 GB at 6 GB/s
    assert costs.inter_s("A100-40GB", "A100-40GB", 4, 12 * gb, ring=True) == pytest.approx(2.0)
    costs.network_reading = "sailor"
    assert costs.inter_s("A100-40GB", "A100-40GB", 4, 12 * gb, ring=True) == pytest.approx(6.0)  # one flow, 2 GB/s
    assert costs.inter_s("A100-40GB", "A100-40GB", 4, 12 * gb) == pytest.approx(1.5)  # 4 flows of 3 GB at 2 GB/s
    # a TP-4 stage's step: 4 rings side by side, each its rank's quarter as one flow at 2 GB/s
    assert costs.inter_s("A100-40GB", "A100-40GB", 4, 12 * gb, ring=True, rings=4) == pytest.approx(1.5)
    costs.network_reading = "flows"  # there the node's traffic is its GPUs' flows at their aggregate already
    assert costs.inter_s("A100-40GB", "A100-40GB", 4, 12 * gb, ring=True, rings=4) == pytest.approx(2.0)


def test_a_tensor_parallel_stage_s_sync_read_as_sailor_is_one_ring_per_tp_rank_over_its_slice():
    """Sailor's simulator prices a TP-t stage's data-parallel all-reduce as a ring over the stage's
    bytes / t at the one-GPU curve (its rings, one per TP rank, side by side): a TP-4 stage of two nodes
    syncs its state in a quarter of a TP-1 stage's time on the same nodes."""
    from contracts.specs import get_model
    from planner.geo.scale.costs import ScaleCosts
    from planner.geo.scale.structure import StageLayout, StagePart, ring_s

    flat = lambda n, gbs: BandwidthCurve("A100-40GB", n, "A100-40GB", n, (gbs,), 100e9, "z", "z")  # noqa: E731
    costs = ScaleCosts(get_model("tiny"), 32, "fp32", {}, NetworkProfile("lab", "inter_node", "t", (flat(1, 2.0),)),
                       None, "z", network_reading="sailor")
    tp1 = StageLayout((StagePart("A100-40GB", 4, 1, (0, 1)),))
    tp4 = StageLayout((StagePart("A100-40GB", 4, 4, (0, 1)),))
    mixed = StageLayout((StagePart("A100-40GB", 4, 4, (0,)), StagePart("A100-40GB", 4, 2, (1,))))
    gb = 1e9
    assert ring_s(costs, tp1, 8, 1 / 8, 16 * gb) == pytest.approx(7 * 1.0)  # 7 steps of 2 GB at 2 GB/s
    assert ring_s(costs, tp4, 2, 1 / 2, 16 * gb) == pytest.approx(1 * 8 / 4 / 2.0)
    assert ring_s(costs, mixed, 3, 1 / 3, 12 * gb) == pytest.approx(2 * 4 / 2 / 2.0)  # its smallest TP, 2
