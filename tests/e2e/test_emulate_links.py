"""Emulated links (executor/links.py, `executor launch --emulate-links GBPS`): a 2-rank run of the
tiny model with each rank in its own namespace finishes `done`, `executor metrics --json` reports
the links and every rank's comm_wait_s, the TCP payload the ranks put on their links per step is
within 5 % of what the collectives send (the plan's predicted_wire_bytes_per_step, else
contracts/wire.py's exact gloo bytes of the runtime's collectives), and nothing is left behind,
also when the launcher is SIGKILLed; bad combinations get one-line errors."""
import dataclasses
import json
import os
import signal
import subprocess
import sys

import pytest

from contracts.cluster import ClusterSpec
from contracts.plan import Plan
from contracts.specs import get_model
from contracts.units import runtime_units, step_collectives
from executor import links, netns
from executor.launch import start_run
from executor.store import has_run, pid_alive, read_metrics
from testkit.processes import processes_with_data_dir
from testkit.runs import two_cpu_plan
from testkit.wait import wait_until

needs_netns = pytest.mark.skipif(netns.unavailable_reason() is not None,
                                 reason=f"emulated links unavailable: {netns.unavailable_reason()}")
RUN_TIMEOUT_S = 180.0
GBPS = 1.0
STEPS = 6


def wire_bytes_of_collectives(plan) -> int:
    """Bytes one step puts on the network, every rank together: the gloo bytes (payload and gloo's
    framing) of every unit's all-gather and reduce-scatter, once each per step at ZeRO 1 and 2,
    from contracts/wire.py (the step's 24-byte statistics all-reduce left out)."""
    from contracts import wire
    from models.runtime import shard_bounds

    assert plan.zero in (1, 2), "each unit gathered and reduced once per step (contracts.units.step_collectives)"
    spec = get_model(plan.model)
    sc = step_collectives(spec, plan.zero)
    assert sc.gather_numel == sc.reduce_numel == spec.num_params
    world, fractions, total = len(plan.used), [a.shard_fraction for a in plan.used], 0
    for unit in runtime_units(spec):
        sizes = [e - s for s, e in shard_bounds(unit.numel, fractions)]
        total += sum(wire.gather_send_bytes(sizes, 4, world, "gloo")) + sum(
            wire.reduce_scatter_send_bytes(sizes, 4, world, "gloo"))
    return total


def _metrics_json(run_dir: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", run_dir, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _running(run_dir: str) -> bool:
    """The run has not ended (a launcher from the CLI writes its store only once it has started)."""
    return not has_run(run_dir) or read_metrics(run_dir)["status"] == "running"


def _watch(run_dir: str, until=None) -> dict:
    """The run's links (links.json) and every namespace inode seen while it runs; returns when
    `until(setup)` holds or the run ends."""
    path = os.path.join(run_dir, links.LINKS_FILE)
    wait_until(lambda: os.path.exists(path) or not _running(run_dir), RUN_TIMEOUT_S,
               "the emulated links")
    setup = links.LinksSetup.load(path)
    seen = {"setup": setup, "inodes": set(), "qdiscs": ""}

    def look() -> bool:
        seen["inodes"] |= {i for i in map(netns.netns_inode, setup.names()) if i is not None}
        if not seen["qdiscs"]:
            seen["qdiscs"] = subprocess.run(["tc", "-n", setup.netns(links.HUB), "qdisc", "show"],
                                            capture_output=True, text=True, timeout=10).stdout
        return not _running(run_dir) or (until is not None and until(setup))

    wait_until(look, RUN_TIMEOUT_S, "the run")
    return seen


def _assert_torn_down(seen: dict, data_dir: str, launcher_pid: int) -> None:
    """No namespace of the run by name or mount (so with no process left in them the kernel freed
    them with their veths, bridge and qdiscs), no process of the run."""
    wait_until(lambda: not pid_alive(launcher_pid), 30, "the launcher to exit")
    setup = seen["setup"]
    assert len(seen["inodes"]) == setup.num_ranks + 1, "the namespaces were never all seen"
    assert links.leftovers(setup) == []
    assert netns.find(links.run_prefix(setup.run_id)) == []
    ours = {p.pid for p in processes_with_data_dir(data_dir)}
    assert not ours, ours
    assert not set(netns.pids_in(seen["inodes"])) & ours


def planned(tmp_path) -> tuple[str, Plan]:
    """A plan of the tiny model on 2 CPU ranks at ZeRO 1 by `python -m planner plan` (step times
    estimated), with its predicted_wire_bytes_per_step."""
    cluster, plan_path = str(tmp_path / "cluster.json"), str(tmp_path / "plan.json")
    ClusterSpec.from_dict({"name": "lab", "nodes": [{"name": "localhost", "gpus": {"cpu": 2}}]}).save(cluster)
    r = subprocess.run([sys.executable, "-m", "planner", "plan", "--cluster", cluster, "--model", "tiny",
                        "--global-batch", "4", "--seq", "64", "--zero", "1", "--out", plan_path],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = Plan.load(plan_path)
    assert len(plan.used) == 2, plan.used
    return plan_path, plan


@needs_netns
def test_a_two_rank_run_over_emulated_links_puts_the_collectives_bytes_on_them(data_dir, tmp_path):
    plan_path, plan = planned(tmp_path)
    run = str(tmp_path / "links")
    launcher = subprocess.Popen([sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps",
                                 str(STEPS), "--run-dir", run, "--seed", "1", "--emulate-links", str(GBPS)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = _watch(run)
    out, err = launcher.communicate(timeout=RUN_TIMEOUT_S)
    assert launcher.returncode == 0, err[-2000:]
    m = _metrics_json(run)
    assert m["status"] == "done" and len(m["steps"]) == STEPS, m["reason"]
    assert m["links"]["gbps"] == GBPS
    # the hub shapes what each rank receives: 1 Gbit/s of payload is 1045.58 Mbit/s of frames
    assert seen["qdiscs"].count("tbf") == 2 and seen["qdiscs"].count("rate 1045Mbit") == 2, seen["qdiscs"]
    # every rank's figure of every step was recorded: the link counters were read inside the namespaces
    assert all(rs["link_tx_bytes"] > 0 for rs in m["rank_steps"]), m["rank_steps"]
    exact, predicted = wire_bytes_of_collectives(plan), plan.predicted_wire_bytes_per_step
    measured = m["links"]["bytes_per_step"]
    print(f"emulated links {GBPS:g} Gbit/s, tiny, 2 ranks, zero {plan.zero}: measured {measured:,.0f} bytes of TCP "
          f"payload per step; contracts/wire.py {exact:,} (ratio {measured / exact:.4f}); the plan's "
          f"predicted_wire_bytes_per_step {predicted:,} (ratio {measured / predicted:.4f})")
    assert abs(measured / exact - 1) <= 0.05, (measured, exact)
    from models.sharded import StepResult

    runtime_reports = "comm_wait_s" in {f.name for f in dataclasses.fields(StepResult)}
    for r in m["ranks"]:
        assert "comm_wait_s" in r
        if runtime_reports:
            assert r["comm_wait_s"] is not None and r["comm_wait_s"] >= 0, r
    _assert_torn_down(seen, data_dir, launcher.pid)
    assert abs(measured / predicted - 1) <= 0.05, (measured, predicted)  # the cost model's figure


@needs_netns
def test_a_killed_launcher_leaves_nothing_its_guard_removes_it(data_dir, tmp_path):
    run = str(tmp_path / "killed")
    h = start_run(two_cpu_plan(), 10_000, run, seed=1, emulate_links_gbps=GBPS)
    seen = _watch(run, until=lambda setup: all(r["pid"] for r in read_metrics(run)["ranks"]))
    setup = seen["setup"]
    for r in read_metrics(run)["ranks"]:  # rank i trains plan position i inside namespace i
        assert r["position"] == r["rank"]
        assert os.readlink(f"/proc/{r['pid']}/ns/net") == f"net:[{netns.netns_inode(setup.netns(r['rank']))}]"
    os.kill(h.pid, signal.SIGKILL)  # its torchrun agents and ranks are up inside the namespaces
    wait_until(lambda: not links.leftovers(seen["setup"]) and not processes_with_data_dir(data_dir), 30,
               "the guard's tear-down")
    assert any("the guard removed" in e["message"] for e in read_metrics(run)["events"])
    _assert_torn_down(seen, data_dir, h.pid)


@pytest.mark.parametrize("extra, message", [
    (["--emulate-wan"], "emulate_links_gbps and emulate_wan exclude each other"),
    (["--backend", "slurm"], "--emulate-links runs every rank on this machine; not with --backend slurm"),
])
def test_bad_combinations_are_one_line_errors(tmp_path, extra, message):
    plan_path = str(tmp_path / "p.json")
    two_cpu_plan().save(plan_path)
    r = subprocess.run([sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", "1", "--run-dir",
                        str(tmp_path / "r"), "--emulate-links", "1", *extra], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
