"""A DiLoCo plan run by `executor launch` (torchrun, gloo, CPU ranks): two groups on two local node
names ("localhost" with 2 ranks of uneven shards, "127.0.0.1" with 1), made by to_diloco_plan.

  * a short run ends done, with a `diloco_sync` event (bytes, seconds) after every H-th step, its
    token-weighted loss per step, and a note instead of a final checkpoint;
  * a rank killed mid-run fails the run naming the rank, and no process of the run is left;
  * `--emulate-wan` (root, network namespaces): the same groups as two datacenters joined by a
    50 Mbit/s link run to the end.
"""

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan, WanLink
from executor import wan
from contracts.specs import get_model
from executor.launch import launch_run, start_run
from executor.store import read_events, read_metrics
from models.optim import OptimConfig
from planner.geo.diloco_plan import to_diloco_plan
from testkit.processes import kill_rank_and_wait_teardown

pytestmark = pytest.mark.slow

SEQ = 16
H = 2
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0)


def diloco_plan(names: tuple[str, str] = ("localhost", "127.0.0.1"), wan_gbps: float | None = None) -> Plan:
    """Data parallelism over node a (2 ranks, batches 2 and 1) and node b (1 rank), as DiLoCo with H = 2
    and a bf16 exchange; the default names are two names of this machine (a plain local launch)."""
    a, b = names
    nodes = (NodeSpec(a, "dc-a", (DeviceSpec("cpu"), DeviceSpec("cpu"))), NodeSpec(b, "dc-b", (DeviceSpec("cpu"),)))
    pieces = [(a, 2, 0.5), (a, 1, 0.3), (b, 1, 0.2)]
    asg = tuple(Assignment(i, node, "cpu", n, 1, n, f, 0, 0.0) for i, (node, n, f) in enumerate(pieces))
    links = (WanLink(a, b, wan_gbps, 40.0),) if wan_gbps is not None else ()
    dp = Plan(ClusterSpec("two-dc", nodes), "tiny", 4, SEQ, "fp32", "none", asg, 0.0, 0.0, zero=2, wan=links)
    return to_diloco_plan(dp, H, compress="bf16")


def test_a_diloco_launch_records_its_outer_steps(data_dir, tmp_path):
    run = str(tmp_path / "diloco")
    assert launch_run(diloco_plan(), 4, run, optim=OPTIM) == "done", read_metrics(run).get("reason")
    m = read_metrics(run)
    assert [s["step"] for s in m["steps"]] == [1, 2, 3, 4]
    syncs = read_events(run, ("diloco_sync",))
    assert [e["step"] for e in syncs] == [2, 4]
    # the bf16 exchange: 2 bytes per parameter of the model, on every rank
    assert all(e["detail"]["payload_bytes"] == 2 * get_model("tiny").num_params for e in syncs), syncs
    assert all(e["detail"]["seconds"] > 0 and e["detail"]["ranks"] == 3 for e in syncs)
    events = [e["message"] for e in m["events"]]
    assert any("no final checkpoint: a DiLoCo run" in e for e in events), events


def test_a_killed_diloco_rank_fails_the_run_and_leaves_no_process(data_dir, tmp_path):
    h = start_run(diloco_plan(), 100_000, str(tmp_path / "killed"), optim=OPTIM)
    kill_rank_and_wait_teardown(h, 2, data_dir)


@pytest.mark.skipif(wan.unavailable_reason() is not None,
                    reason=f"emulated datacenters unavailable: {wan.unavailable_reason()}")
def test_a_diloco_plan_runs_across_emulated_datacenters(data_dir, tmp_path):
    run = str(tmp_path / "wan")
    plan = diloco_plan(("dc-a", "dc-b"), wan_gbps=0.05)
    assert launch_run(plan, 4, run, optim=OPTIM, emulate_wan=True) == "done", read_metrics(run).get("reason")
    assert [e["step"] for e in read_events(run, ("diloco_sync",))] == [2, 4]
    losses = [s["loss"] for s in read_metrics(run)["steps"]]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses), losses
