"""Emulated datacenters (executor/wan.py, `executor launch --emulate-wan`): a 2-datacenter
data-parallel run of the tiny model and a 2-stage pipeline (stage 0 in dc-a, stage 1 in dc-b, with
prefill) finish `done` and leave no namespace, link, qdisc or process behind, also when a rank or
the launcher is SIGKILLed mid-run; a plain-socket transfer through a link shaped at 20 Mbit/s
measures within 10 % of it; `connections` > 1 really opens more TCP connections between the
datacenters; bad requests get one-line errors."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from executor import netns, wan
from executor.launch import launch_run, start_run, stop_run
from executor.store import pid_alive, read_metrics
from contracts.cluster import ClusterSpec
from contracts.plan import Assignment, PipelineSpec, PipelineStage, Plan, WanLink, link_key
from testkit.processes import processes_with_data_dir
from testkit.wait import wait_until

needs_wan = pytest.mark.skipif(wan.unavailable_reason() is not None,
                               reason=f"emulated datacenters unavailable: {wan.unavailable_reason()}")
SEQ = 32
RUN_TIMEOUT_S = 120.0


def geo_plan(gbps: float, connections: int = 1, nodes: tuple[str, ...] = ("dc-a", "dc-b"),
             wan_links: tuple[tuple[str, str], ...] | None = None) -> Plan:
    """Data parallelism of `tiny` over one CPU device per datacenter, from a cluster file."""
    cluster = ClusterSpec.from_dict({"name": "geo", "nodes": [{"name": n, "datacenter": n, "gpus": {"cpu": 1}}
                                                               for n in nodes]})
    share = 1 / len(nodes)
    asg = tuple(Assignment(i, n, "cpu", 2, 1, 2, share, 0, 0.0) for i, n in enumerate(nodes))
    pairs = wan_links if wan_links is not None else tuple(zip(nodes, nodes[1:]))
    return Plan(cluster, "tiny", 2 * len(nodes), SEQ, "fp32", "none", asg, 0.0, 0.0,
                wan=tuple(WanLink(a, b, gbps, 40.0) for a, b in pairs),
                connections={link_key(a, b): connections for a, b in pairs})


def _established(setup: wan.WanSetup) -> int:
    """TCP connections between the two datacenters' host addresses, the rendezvous store's aside."""
    out = subprocess.run([*setup.exec_prefix(0), "ss", "-tnH", "state", "established"], capture_output=True,
                         text=True, timeout=10).stdout
    a, b = setup.addr(0), setup.addr(1)
    n = 0
    for line in out.splitlines():
        local, peer = line.split()[-2:]
        hosts = {local.rsplit(":", 1)[0], peer.rsplit(":", 1)[0]}
        if hosts == {a, b} and not {local, peer} & {f"{a}:29500"}:
            n += 1
    return n


def _watch_run(run_dir: str, steps_before: int | None = None, until=None) -> dict:
    """While the run runs: its setup (wan.json), namespace inodes, the qdiscs seen and the most
    inter-datacenter connections at once; returns when the run has `steps_before` steps, when
    `until(setup)` holds, or when the run ends."""
    seen = {"inodes": set(), "qdiscs": "", "connections": 0}
    wait_until(lambda: os.path.exists(os.path.join(run_dir, wan.WAN_FILE)) or read_metrics(run_dir)["status"] != "running",
          RUN_TIMEOUT_S, "the emulated datacenters")
    setup = seen["setup"] = wan.WanSetup.load(os.path.join(run_dir, wan.WAN_FILE))
    netns = [setup.netns(i) for i in range(len(setup.nodes))]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        m = read_metrics(run_dir)
        seen["inodes"] |= {i for i in map(wan.netns_inode, netns) if i is not None}
        if m["status"] != "running" or (steps_before is not None and len(m["steps"]) >= steps_before) or (
                until is not None and until(setup)):
            break
        if not seen["qdiscs"]:
            seen["qdiscs"] = subprocess.run(["tc", "-n", netns[0], "qdisc", "show"], capture_output=True,
                                            text=True, timeout=10).stdout
        seen["connections"] = max(seen["connections"], _established(setup))
        time.sleep(0.2)
    return seen


def _assert_torn_down(seen: dict, data_dir: str, launcher_pid: int) -> None:
    """Nothing of the run is left once its launcher has exited (it records the end first): no
    namespace by name or mount, no process of the run (they all carry the test's data dir), none in
    the run's namespaces; so the kernel has freed the namespaces with their veths and qdiscs."""
    wait_until(lambda: not pid_alive(launcher_pid), 30, "the launcher to exit")
    setup = seen["setup"]
    assert seen["inodes"], "the namespaces were never seen"
    assert wan.leftovers(setup) == []
    assert wan.find(wan.run_prefix(setup.run_id)) == []
    ours = {p.pid for p in processes_with_data_dir(data_dir)}
    assert not ours, ours
    assert not set(wan.pids_in(seen["inodes"])) & ours


def _events(run_dir: str) -> list[str]:
    return [e["message"] for e in read_metrics(run_dir)["events"] if e["kind"] == "emulation"]


# ---- the layout (no root needed) -------------------------------------------------------------


def test_layout_one_namespace_per_node_a_link_per_pair_unshaped_where_the_plan_has_none():
    plan = geo_plan(0.05, connections=2, nodes=("dc-a", "dc-b", "dc-c"), wan_links=(("dc-a", "dc-b"),))
    plan = Plan.from_dict({**plan.to_dict(), "connections": {"dc-a|dc-b": 2, "dc-b|dc-c": 4}})
    setup = wan.layout(plan, ["dc-a", "dc-b", "dc-c"], "run-7", 4242, "10.78.3", "Error: unknown qdisc")
    assert [setup.netns(i) for i in range(3)] == [f"gpumix-wan.run-7.4242.{i}" for i in range(3)]
    assert [setup.addr(i) for i in range(3)] == ["10.78.3.100", "10.78.3.101", "10.78.3.102"]
    assert [(ln.a, ln.b, ln.gbps) for ln in setup.links] == [("dc-a", "dc-b", 0.05), ("dc-a", "dc-c", None),
                                                             ("dc-b", "dc-c", None)]
    assert setup.connections == 4 and setup.gloo_ifname == "gmx0,gmx0,gmx0,gmx0"  # the most any link asks
    text = "\n".join(setup.describe())
    assert "link dc-a–dc-c: the plan has no wan link for this pair: unshaped veth" in text
    assert "RTT 40 ms modelled, not added (netem unavailable: Error: unknown qdisc)" in text
    tbf = [c for c in wan.build_commands(setup) if "tbf" in c]
    assert len(tbf) == 2  # both ends of the one shaped link
    rate = int(tbf[0][tbf[0].index("rate") + 1].removesuffix("bit"))
    assert rate == round(0.05e9 * 1514 / 1448)  # frames, so that TCP's payload gets 50 Mbit/s
    assert all(isinstance(c, list) and all(isinstance(x, str) for x in c) for c in wan.build_commands(setup))
    with_netem = wan.layout(plan, ["dc-a", "dc-b", "dc-c"], "run-7", 4242, "10.78.3", None)
    delays = [c[c.index("delay") + 1] for c in wan.build_commands(with_netem) if "netem" in c]
    assert delays == ["20ms", "20ms"] and "RTT 40 ms added" in "\n".join(with_netem.describe())
    with pytest.raises(ValueError, match="one node"):
        wan.layout(plan, ["dc-a"], "run-7", 1, "10.78.3", None)


# ---- the machine's part ----------------------------------------------------------------------


@needs_wan
def test_a_link_shaped_at_20_mbit_carries_20_mbit_of_payload():
    """A plain TCP bulk transfer between two of the module's namespaces, timed at the receiver
    (first to last byte): no cost model involved."""
    setup = wan.create(geo_plan(0.02), ["dc-a", "dc-b"], f"shape-{os.getpid()}")
    nbytes = 5_000_000  # 2 s at 20 Mbit/s
    server = ("import socket, sys, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              f"s.bind(('{setup.addr(1)}', 5001)); s.listen(1); print('ready', flush=True)\n"
              "c, _ = s.accept(); n = 0; t0 = t1 = None\nwhile True:\n    b = c.recv(1 << 16)\n"
              "    if not b: break\n    t1 = time.monotonic(); t0 = t0 or t1; n += len(b)\n"
              "print(n, t1 - t0)")
    client = (f"import socket\ns = socket.create_connection(('{setup.addr(1)}', 5001))\n"
              f"s.sendall(b'x' * {nbytes}); s.close()")
    try:
        rx = subprocess.Popen([*setup.exec_prefix(1), sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        subprocess.run([*setup.exec_prefix(0), sys.executable, "-c", client], check=True, timeout=60)
        got, seconds = rx.communicate(timeout=60)[0].split()
        mbit_s = int(got) * 8 / float(seconds) / 1e6
    finally:
        wan.remove(setup)
    print(f"shaped 20 Mbit/s: measured {mbit_s:.2f} Mbit/s of payload")
    assert int(got) == nbytes
    assert abs(mbit_s - 20.0) <= 2.0, mbit_s
    assert wan.leftovers(setup) == []


@needs_wan
def test_an_emulated_two_datacenter_run_finishes_and_leaves_nothing(data_dir, tmp_path):
    run = str(tmp_path / "geo")
    h = start_run(geo_plan(0.1, connections=3), 6, run, seed=1, emulate_wan=True)
    seen = _watch_run(run)
    assert h.wait(RUN_TIMEOUT_S) == "done", read_metrics(run)["reason"]
    m = read_metrics(run)
    assert len(m["steps"]) == 6
    assert [(r["rank"], r["node"]) for r in m["ranks"]] == [(0, "dc-a"), (1, "dc-b")]
    events = "\n".join(_events(run))
    assert "link dc-a–dc-b: tc tbf each direction, 100 Mbit/s of TCP payload" in events
    assert ("RTT modelled, not added" in events) == (seen["setup"].rtt_mode == "modelled")
    assert "tbf" in seen["qdiscs"] and "104558Kbit" in seen["qdiscs"].replace(" ", ""), seen["qdiscs"]
    # gloo opened one mesh per GLOO_SOCKET_IFNAME entry: at least 3 connections between the two datacenters
    assert seen["connections"] >= 3, seen["connections"]
    print(f"connections between the datacenters (connections=3): {seen['connections']}")
    _assert_torn_down(seen, data_dir, h.pid)


@needs_wan
def test_a_two_stage_pipeline_across_two_emulated_datacenters_with_prefill(data_dir, tmp_path):
    """Stage 0 (layer 0) in dc-a, stage 1 (layer 1) in dc-b, 1F1B over 4 micro-batches: every
    activation and its gradient crosses the 50 Mbit/s link; stage 1 runs prefill in its bubbles
    (the --prefill object reaches the ranks through start_run's prefill.json)."""
    cluster = ClusterSpec.from_dict({"name": "geo", "nodes": [{"name": n, "datacenter": n, "gpus": {"cpu": 1}}
                                                               for n in ("dc-a", "dc-b")]})
    stages = (PipelineStage(0, 1, (0,), (2,), "dc-a"), PipelineStage(1, 1, (1,), (2,), "dc-b"))
    asg = (Assignment(0, "dc-a", "cpu", 2, 4, 8, 1.0, 0, 0.0), Assignment(1, "dc-b", "cpu", 2, 4, 8, 1.0, 0, 0.0))
    plan = Plan(cluster, "tiny", 8, SEQ, "fp32", "none", asg, 0.0, 0.0, pipeline=PipelineSpec("1f1b", 2, 4, stages),
                wan=(WanLink("dc-a", "dc-b", 0.05, 40.0),), connections={"dc-a|dc-b": 2})
    run = str(tmp_path / "pipe")
    prefill = {"model": "tiny", "prompt_tokens": 32, "backlog": True, "stages": [1], "max_chunk_s": 0.002}
    h = start_run(plan, 3, run, seed=1, emulate_wan=True, prefill=prefill)
    seen = _watch_run(run)
    assert h.wait(RUN_TIMEOUT_S) == "done", read_metrics(run)["reason"]
    timeline = json.load(open(os.path.join(run, "timeline.json")))
    assert {(r["stage"], r["datacenter"]) for r in timeline["ranks"]} == {(0, "dc-a"), (1, "dc-b")}
    ops = {op["op"] for r in timeline["ranks"] for op in r["ops"]}
    assert {"send_fwd", "recv_fwd", "send_bwd", "recv_bwd"} <= ops, ops
    assert os.path.exists(os.path.join(run, "prefill_rank1.json")) and not os.path.exists(
        os.path.join(run, "prefill_rank0.json"))
    assert "link dc-a–dc-b: tc tbf each direction, 50 Mbit/s" in "\n".join(_events(run))
    _assert_torn_down(seen, data_dir, h.pid)


@needs_wan
def test_a_rank_killed_mid_run_fails_the_run_and_everything_is_torn_down(data_dir, tmp_path):
    run = str(tmp_path / "killed")
    h = start_run(geo_plan(0.1, connections=1), 10_000, run, seed=1, emulate_wan=True)
    seen = _watch_run(run, steps_before=1)
    pid = next(r["pid"] for r in read_metrics(run)["ranks"] if r["rank"] == 1)
    os.kill(pid, signal.SIGKILL)
    assert h.wait(RUN_TIMEOUT_S) == "failed"
    m = read_metrics(run)
    assert m["failed_rank"] == 1 and "rank 1" in m["reason"] and "SIGKILL" in m["reason"], m["reason"]
    print(f"connections between the datacenters (connections=1): {seen['connections']}")
    assert 1 <= seen["connections"] < 3
    _assert_torn_down(seen, data_dir, h.pid)


@needs_wan
def test_a_killed_launcher_leaves_nothing_its_guard_removes_it(data_dir, tmp_path):
    run = str(tmp_path / "launcher")
    h = start_run(geo_plan(0.1), 10_000, run, seed=1, emulate_wan=True)
    seen = _watch_run(run, until=lambda setup: len(wan.pids_in({wan.netns_inode(setup.netns(1))})) > 0)
    os.kill(h.pid, signal.SIGKILL)  # its torchrun agents are up inside the namespaces
    wait_until(lambda: not wan.leftovers(seen["setup"]) and not processes_with_data_dir(data_dir), 30,
          "the guard's tear-down")
    assert any("the guard removed" in e for e in _events(run))
    _assert_torn_down(seen, data_dir, h.pid)
    # the store reads a run whose launcher is gone as failed; with nothing of it left, stop_run keeps that
    assert read_metrics(run)["status"] == "failed" and stop_run(run, timeout_s=5) == "failed"


@needs_wan
def test_the_next_launch_removes_a_dead_launchers_namespaces(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = wan.layout(geo_plan(0.1), ["dc-a", "dc-b"], "stale", dead.pid, "10.78.250", "no netem")
    alive = wan.layout(geo_plan(0.1), ["dc-a", "dc-b"], "other", os.getpid(), "10.78.251", "no netem")
    try:
        for setup in (stale, alive):
            for cmd in wan.build_commands(setup):
                subprocess.run(cmd, check=True, capture_output=True)
        removed = wan.remove_stale("mine")
        assert removed == [stale.netns(0), stale.netns(1)]
        assert wan.leftovers(stale) == [] and len(wan.leftovers(alive)) == 2  # a live launcher's stay
    finally:
        wan.remove(stale)
        wan.remove(alive)


# ---- refusals --------------------------------------------------------------------------------


def test_one_node_and_emulate_wan_is_a_clear_error(tmp_path):
    plan = geo_plan(0.1, nodes=("dc-a",), wan_links=())
    path = str(tmp_path / "one.json")
    plan.save(path)
    r = subprocess.run([sys.executable, "-m", "executor", "launch", "--plan", path, "--steps", "1", "--run-dir",
                        str(tmp_path / "r"), "--emulate-wan"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "sit on one node (dc-a)" in r.stderr and "at least 2 nodes" in r.stderr and len(r.stderr.splitlines()) == 1


def test_without_root_or_tools_the_error_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=r"--emulate-wan: not root \(network namespaces"):
        launch_run(geo_plan(0.1), 1, str(tmp_path / "r"), emulate_wan=True)
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda b: None if b == "tc" else "/usr/sbin/" + b)
    with pytest.raises(ValueError, match="--emulate-wan: missing tc"):
        launch_run(geo_plan(0.1), 1, str(tmp_path / "r"), emulate_wan=True)


def test_a_networked_store_is_refused_a_unix_socket_is_not(tmp_path, monkeypatch):
    from executor.checks import check_emulate_wan

    monkeypatch.setattr(wan, "unavailable_reason", lambda: None)
    monkeypatch.setenv("GPUMIX_DB", "postgresql://gpumix@127.0.0.1:5432/runs")
    with pytest.raises(ValueError, match="reach no network outside them, so not the PostgreSQL store at 127.0.0.1"):
        check_emulate_wan(geo_plan(0.1))
    monkeypatch.setenv("GPUMIX_DB", "postgresql://gpumix@/runs?host=/var/run/postgresql")
    check_emulate_wan(geo_plan(0.1))


def test_a_prefill_file_that_is_not_an_object_is_refused(tmp_path):
    plan_path, bad = str(tmp_path / "p.json"), str(tmp_path / "prefill.json")
    geo_plan(0.1).save(plan_path)
    with open(bad, "w") as fh:
        fh.write("[1, 2]")
    r = subprocess.run([sys.executable, "-m", "executor", "launch", "--plan", plan_path, "--steps", "1", "--run-dir",
                        str(tmp_path / "r"), "--emulate-wan", "--prefill", bad], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "must hold a JSON object, not a list" in r.stderr, r.stderr
