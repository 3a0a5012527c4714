"""Emulated links without starting anything (executor/links.py, executor/netns.py): the namespaces,
bridge, veths and tc commands of a layout, the torchrun agent per rank inside its namespace, the
payload count of interface counters, the refusals of bad combinations, and the rank_steps columns
an older run store lacks (read as None, added by `db upgrade`)."""
import os
import sqlite3

import pytest

from contracts.cluster import ClusterSpec
from contracts.plan import Assignment, Plan
from contracts.run import RunConfig
from executor import checks, db, links, netns
from executor.local import link_agent_commands, link_env
from executor.rank_commands import launcher_command
from executor.store import RUNS, MetricsStore, RankStep, read_metrics
from testkit.runs import two_cpu_plan


def _setup(num_ranks: int = 3, gbps: float = 0.5) -> links.LinksSetup:
    return links.layout(num_ranks, gbps, "run-7", 4242, "10.79.3")


def test_layout_a_namespace_per_rank_and_a_hub():
    setup = _setup()
    assert setup.names() == [f"gpumix-lnk.run-7.4242.{i}" for i in range(3)] + ["gpumix-lnk.run-7.4242.hub"]
    assert [setup.addr(i) for i in range(3)] == ["10.79.3.100", "10.79.3.101", "10.79.3.102"]
    assert setup.exec_prefix(1) == ["nsenter", "--net=/var/run/netns/gpumix-lnk.run-7.4242.1"]
    assert links.LinksSetup(**{k: v for k, v in setup.to_dict().items()
                               if k in ("run_id", "owner_pid", "subnet", "num_ranks", "gbps")}) == setup


def test_build_commands_bridge_veth_per_rank_tbf_both_directions():
    setup = _setup()
    cmds = links.build_commands(setup)
    assert all(isinstance(c, list) and all(isinstance(x, str) for x in c) for c in cmds)
    hub = setup.netns(links.HUB)
    assert ["ip", "netns", "add", hub] == cmds[0]
    assert ["ip", "-n", hub, "link", "add", links.BRIDGE, "type", "bridge"] in cmds
    for i in range(3):
        veth = ["ip", "-n", hub, "link", "add", f"r{i}", "mtu", "1500", "type", "veth", "peer", "name", "gmx0",
                "netns", setup.netns(i), "mtu", "1500"]
        assert veth in cmds
        assert ["ip", "-n", hub, "link", "set", f"r{i}", "master", links.BRIDGE] in cmds
        assert ["ip", "-n", setup.netns(i), "addr", "add", f"10.79.3.{100 + i}/24", "dev", "gmx0"] in cmds
    tbf = [c for c in cmds if "tbf" in c]
    # every rank's link shaped both ways: the rank's own end (what it sends), the hub's port (what it receives)
    assert sorted((c[2], c[6]) for c in tbf) == sorted(
        [(setup.netns(i), "gmx0") for i in range(3)] + [(hub, f"r{i}") for i in range(3)])
    rates = {int(c[c.index("rate") + 1].removesuffix("bit")) for c in tbf}
    assert rates == {round(0.5e9 * 1514 / 1448)}  # frames, so that TCP's payload gets 500 Mbit/s
    text = "\n".join(setup.describe())
    assert "500 Mbit/s of TCP payload" in text and "rank 2 = gpumix-lnk.run-7.4242.2 at 10.79.3.102" in text


def test_one_agent_per_rank_inside_its_namespace():
    setup = _setup()
    cmds = link_agent_commands(setup, ["-m", "executor.worker", "--plan", "p.json"], python="python")
    assert len(cmds) == 3
    for i, cmd in enumerate(cmds):
        assert cmd[:2] == setup.exec_prefix(i)
        assert cmd[2:5] == ["python", "-m", "torch.distributed.run"]
        assert {"--nnodes=3", "--nproc-per-node=1", f"--node-rank={i}", "--rdzv-backend=c10d",
                "--rdzv-endpoint=10.79.3.100:29500", "--rdzv-id=run-7", f"--local-addr=10.79.3.{100 + i}",
                f"--rdzv-conf=is_host={int(i == 0)}"} <= set(cmd)
        assert cmd[-4:] == ["-m", "executor.worker", "--plan", "p.json"]
    env = link_env({"PATH": "/bin"})
    assert env["GLOO_SOCKET_IFNAME"] == "gmx0" and env[links.ENV_LINK_IF] == "gmx0" and env["PATH"] == "/bin"


def test_the_launcher_command_carries_the_rate():
    config = RunConfig(steps=3, run_dir="/tmp/r", emulate_links_gbps=0.25)
    cmd = launcher_command("/tmp/r/plan.json", config)
    assert cmd[cmd.index("--emulate-links") + 1] == "0.25"
    assert "--emulate-links" not in launcher_command("/tmp/r/plan.json", RunConfig(steps=3, run_dir="/tmp/r"))


def test_payload_of_counters_subtracts_one_header_per_packet(tmp_path):
    assert netns.PAYLOAD_BYTES == 1448 and netns.HEADER_BYTES == 66
    assert netns.payload_bytes(10 * 1514 + 5 * 66, 15) == 10 * 1448  # 10 full segments, 5 pure ACKs
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive                            |  Transmit\n"
                   " face |bytes packets errs drop fifo frame compressed multicast|bytes packets errs drop fifo\n"
                   "    lo:     100       2    0    0    0     0          0         0      100       2    0    0\n"
                   "  gmx0: 5000 40 0 0 0 0 0 0 5223306 3383 0 0 0 0 0 0\n")
    assert netns.read_tx_counters("gmx0", str(dev)) == (5223306, 3383)
    assert netns.read_tx_counters("eth9", str(dev)) is None
    assert links.LinkCounter(None).stop() is None  # a rank without emulated links records nothing


# ---- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("gbps, match", [(0, r"link rate in Gbit/s in \(0, 100\], got 0"),
                                         (-1.0, "got -1.0"), (1000.0, "got 1000.0"), (True, "got True")])
def test_a_bad_rate_is_refused(gbps, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(steps=1, emulate_links_gbps=gbps)


def test_links_and_wan_exclude_each_other():
    with pytest.raises(ValueError, match="emulate_links_gbps and emulate_wan exclude each other"):
        RunConfig(steps=1, emulate_wan=True, emulate_links_gbps=1.0)


def test_a_plan_links_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)
    checks.check_emulate_links(two_cpu_plan(), 1.0)
    cluster = ClusterSpec.from_dict({"name": "two", "nodes": [{"name": n, "gpus": {"cpu": 1}} for n in ("a", "b")]})
    two_nodes = Plan(cluster, "tiny", 4, 32, "fp32", "none", (Assignment(0, "a", "cpu", 2, 1, 2, 0.5, 0, 0.0),
                                                            Assignment(1, "b", "cpu", 2, 1, 2, 0.5, 0, 0.0)), 0.0, 0.0)
    with pytest.raises(ValueError, match="runs every rank on this machine; the plan spans nodes a, b"):
        checks.check_emulate_links(two_nodes, 1.0)
    one = Plan(ClusterSpec.from_dict({"name": "one", "nodes": [{"name": "localhost", "gpus": {"cpu": 1}}]}), "tiny",
               2, 32, "fp32", "none", (Assignment(0, "localhost", "cpu", 2, 1, 2, 1.0, 0, 0.0),), 0.0, 0.0)
    with pytest.raises(ValueError, match="links join at least 2 ranks"):
        checks.check_emulate_links(one, 1.0)
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "not root (network namespaces, veth links and tc need root)")
    with pytest.raises(ValueError, match=r"^--emulate-links: not root"):
        checks.check_emulate_links(two_cpu_plan(), 1.0)


def test_without_root_the_real_check_says_so(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=r"--emulate-links: not root \(network namespaces"):
        checks.check_local(two_cpu_plan(), RunConfig(steps=1, emulate_links_gbps=1.0))


# ---- where the figures are kept ---------------------------------------------------------------------


def test_figures_of_a_step_and_the_links_summary(tmp_path):
    run = str(tmp_path / "r")
    os.makedirs(run)
    plan = two_cpu_plan()
    store = MetricsStore(run)
    store.init_run(plan, 3, 0, "gloo")
    for step, sent in ((1, (700, 500)), (2, (600, 400)), (3, (610, 400))):
        store.record_steps_of_all_ranks(step, [RankStep(r, 0.1, 0.0, 0.01, 0.02, None, 0.005 * (r + step), sent[r])
                                               for r in (0, 1)], 4.0, 0.2, plan.global_batch, plan.seq)
    store.close()
    assert read_metrics(run)["links"] == {"gbps": None, "bytes_per_step": 1010}  # no links.json: rate unknown
    links.LinksSetup("r", 1, "10.79.0", 2, 0.5).save(os.path.join(run, links.LINKS_FILE))
    m = read_metrics(run)
    assert m["links"] == {"gbps": 0.5, "bytes_per_step": 1010}  # totals 1200, 1000, 1010: the median
    assert [r["comm_wait_s"] for r in m["ranks"]] == [pytest.approx(0.01), pytest.approx(0.015)]


def test_an_older_run_store_reads_the_new_figures_as_none_and_upgrade_adds_them(tmp_path):
    run = str(tmp_path / "old")
    os.makedirs(run)
    store = MetricsStore(run)
    store.init_run(two_cpu_plan(), 2, 0, "gloo")
    store.close()
    conn = sqlite3.connect(os.path.join(run, "metrics.sqlite"))  # as schema version 1 wrote rank_steps
    conn.execute("ALTER TABLE rank_steps DROP COLUMN comm_wait_s")
    conn.execute("ALTER TABLE rank_steps DROP COLUMN link_tx_bytes")
    conn.commit()
    conn.close()
    store = MetricsStore(run)  # a writer of the older store leaves the columns it lacks out
    store.record_rank_step(0, 1, 0.1, 0.0, 0.01, 0.02, 123, comm_wait_s=0.5, link_tx_bytes=99)
    store.record_rank_step(1, 1, 0.1, 0.0, 0.01, 0.02, 123)
    store.close()
    m = read_metrics(run)
    assert m["rank_steps"][0]["comm_wait_s"] is None and m["rank_steps"][0]["peak_memory_bytes"] == 123
    assert m["ranks"][0]["comm_wait_s"] is None and m["links"] is None
    url = db.StoreURL("sqlite", os.path.join(run, "metrics.sqlite"), False)
    conn = db.Database(url, "run store")
    try:
        assert db.missing_optional(conn, RUNS) == [("rank_steps", "comm_wait_s", "{real}"),
                                                   ("rank_steps", "link_tx_bytes", "{int}")]
        assert db.upgrade(conn, RUNS) == (1, 1)
        assert db.missing_optional(conn, RUNS) == []
    finally:
        conn.close()
    store = MetricsStore(run)
    store.record_rank_step(0, 2, 0.1, 0.0, 0.01, 0.02, None, comm_wait_s=0.25, link_tx_bytes=7)
    store.close()
    assert read_metrics(run)["rank_steps"][-1]["comm_wait_s"] == 0.25


# ---- the cluster file's field ---------------------------------------------------------------------


def test_a_cluster_file_asks_emulated_links_and_prices_the_machine_at_their_rate(monkeypatch, tmp_path):
    d = {"name": "lab", "emulate_links_gbps": 0.5, "nodes": [{"name": "localhost", "gpus": {"cpu": 2}}]}
    cluster = ClusterSpec.from_dict(d)
    assert cluster.emulate_links_gbps == 0.5 and cluster.network.intra_node_gbps == 0.5
    assert ClusterSpec.from_dict(cluster.to_dict()) == cluster
    assert cluster.with_devices("localhost", "dc0", cluster.nodes[0].devices[0], 1).emulate_links_gbps == 0.5
    assert "emulate_links_gbps" not in two_cpu_plan().cluster.to_dict()  # older files stay as they were
    with pytest.raises(ValueError, match="cluster: emulate_links_gbps must be a positive number, got 0"):
        ClusterSpec.from_dict({**d, "emulate_links_gbps": 0})
    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)
    from executor.local import LocalBackend

    plan = Plan.from_dict({**two_cpu_plan().to_dict(), "cluster": {**two_cpu_plan().cluster.to_dict(),
                                                                   "emulate_links_gbps": 0.5}})
    assert LocalBackend().check(plan, RunConfig(steps=1, run_dir=str(tmp_path))).emulate_links_gbps == 0.5
    assert LocalBackend().check(plan, RunConfig(steps=1, run_dir=str(tmp_path),
                                                emulate_links_gbps=2.0)).emulate_links_gbps == 2.0


def test_the_worker_hands_the_plans_precision_to_the_runtime():
    import dataclasses
    from types import SimpleNamespace

    import torch

    from executor.worker import runtime_precision

    assert runtime_precision(two_cpu_plan()) == {"param_dtype": torch.float32, "reduce_dtype": torch.float32,
                                                 "prefetch": 1, "reduce_in_flight": 0}
    plan = dataclasses.replace(two_cpu_plan(), zero=3, param_dtype="bf16", reduce_dtype="bf16", prefetch=2,
                               reduce_in_flight=1)
    assert runtime_precision(plan) == {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16, "prefetch": 2,
                                       "reduce_in_flight": 1}
    # a plan object from before the field (a stand-in without it): every reduce-scatter waited as issued
    old = SimpleNamespace(param_dtype="fp32", reduce_dtype="fp32", prefetch=1)
    assert runtime_precision(old)["reduce_in_flight"] == 0
