"""The embedding's gradient as rows on the wire: a zero-3 plan of the tiny model on 2 CPU ranks whose
step is fewer bytes as rows (contracts.wire.token_rows_exchange), run over emulated 1 Gbit/s links
(`executor launch --emulate-links`): the TCP payload its ranks put on their links per step is within
5 % of the plan's predicted_wire_bytes_per_step (the cost model's, rows included), and below what the
same step would send with the table reduce-scattered."""
import json
import subprocess
import sys

from contracts import wire
from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from contracts.specs import get_model
from contracts.units import runtime_units
from models.runtime import shard_bounds
from tests.e2e.test_emulate_links import needs_netns

STEPS = 4
GLOBAL_BATCH, SEQ = 4, 64


@needs_netns
def test_rows_on_the_links_match_the_plan(data_dir, tmp_path):
    cluster, plan_path = str(tmp_path / "cluster.json"), str(tmp_path / "plan.json")
    ClusterSpec.from_dict({"name": "lab", "nodes": [{"name": "localhost", "gpus": {"cpu": 2}}]}).save(cluster)
    r = subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", cluster, "--model", "tiny",
                        "--global-batch", str(GLOBAL_BATCH), "--seq", str(SEQ), "--zero", "3", "--out", plan_path],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # prefetch 0: every byte of a step is sent inside it (with prefetch the update already gathers the
    # next step's first units, between the per-step windows of the link counters); the bytes are the same
    with open(plan_path, encoding="utf-8") as fh:
        d = json.load(fh)
    d["prefetch"] = 0
    with open(plan_path, "w", encoding="utf-8") as fh:
        json.dump(d, fh)
    plan = Plan.load(plan_path)
    assert len(plan.used) == 2 and plan.zero == 3, plan.used
    spec = get_model("tiny")
    table = runtime_units(spec)[0]
    assert wire.token_rows_exchange(GLOBAL_BATCH * SEQ, table.numel, spec.hidden, 4, 2)
    run = str(tmp_path / "rows")
    r = subprocess.run([sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", str(STEPS),
                        "--run-dir", run, "--seed", "1", "--emulate-links", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", run, "--json"],
                                  capture_output=True, text=True, timeout=60, check=True).stdout)
    assert m["status"] == "done" and len(m["steps"]) == STEPS, m["reason"]
    measured, predicted = m["links"]["bytes_per_step"], plan.predicted_wire_bytes_per_step
    # the table's reduce-scatter the rows replace, and the rows' own gathers
    sizes = [e - s for s, e in shard_bounds(table.numel, [a.shard_fraction for a in plan.used])]
    table_bytes = sum(wire.reduce_scatter_send_bytes(sizes, 4, 2, "gloo"))
    rows_bytes = sum(wire.token_rows_send_bytes([a.batch * SEQ for a in plan.used], spec.hidden, 4, 2, "gloo"))
    print(f"rows on the links: measured {measured:,.0f} bytes per step, predicted {predicted:,} "
          f"(ratio {measured / predicted:.4f}); rows {rows_bytes:,} in place of the table's {table_bytes:,}")
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)
    assert measured < predicted - rows_bytes + table_bytes  # what the table would have cost is more
