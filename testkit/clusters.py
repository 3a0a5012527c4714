"""Cluster files built for tests: `many_kinds_cluster` is one whose plan takes seconds to solve
(every device kind a class of its own in the ILP), for checks that must catch a solve in flight."""
from __future__ import annotations

import json

TYPES = ("H100-SXM", "A100-80GB", "A100-40GB", "L40S", "A6000", "V100-32GB", "L4", "T4")
KINDS_PER_TYPE = 48  # 384 device kinds on 768 nodes: 9.5 s of solving on the CLI (tiny, B = 1e6)


def many_kinds_dict(kinds_per_type: int = KINDS_PER_TYPE) -> dict:
    nodes = [{"name": f"{t.lower()}-{k}-{j}", "datacenter": "dc0", "gpus": [{"type": t, "slowdown": 1.0 + 0.1 * k}] * 8}
             for t in TYPES for k in range(kinds_per_type) for j in range(2)]
    return {"name": "many-kinds", "nodes": nodes, "network": {"intra_node_gbps": 600, "inter_node_gbps": 200}}


def many_kinds_cluster(path: str) -> str:
    """Write the many-kinds cluster file to `path`; returns the path."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(many_kinds_dict(), fh)
    return path
