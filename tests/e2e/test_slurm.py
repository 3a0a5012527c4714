"""GPUMix on a real SLURM cluster (testkit/slurm.py: slurmctld, two slurmd in their own
network namespaces, munged): a 2-node, 3-rank CPU run through `sbatch`/`srun` trains exactly like
one rank, its metrics reach the store, `scancel` and a killed node end it cleanly, the inventory
parsers read the real cluster, and the orchestrator survives its own restart."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from executor.launch import launch_run
from executor.slurm import launch_slurm
from executor.slurm_job import (Component, SlurmSettings, batch_script, node_requests, read_job_file,
                                sbatch_command)
from executor.store import read_metrics
from models.optim import OptimConfig
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan
from profiler.slurm_inventory import SlurmNode
from testkit.wait import wait_until
from testkit.slurm import GRES_NAME

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQ = 32
SEED = 7
STEPS = 3
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, max_grad_norm=0.5, min_lr_ratio=0.1, decay_steps=STEPS)
THREE = [("n1", 5, 1, 0.5), ("n1", 1, 2, 0.3), ("n2", 1, 1, 0.2)]  # batches 5/2/1 over two nodes
ONE = [("localhost", 4, 2, 1.0)]  # the same global batch of 8 on one rank


def node_plan(pieces: list[tuple[str, int, int, float]]) -> Plan:
    """A plan by hand: one (node, micro_batch, accum_steps, shard_fraction) per CPU device."""
    nodes: dict[str, int] = {}
    for node, *_ in pieces:
        nodes[node] = nodes.get(node, 0) + 1
    cluster = ClusterSpec("slurm-test", tuple(NodeSpec(n, "slurm", (DeviceSpec("cpu"),) * k) for n, k in nodes.items()))
    asg = tuple(Assignment(i, node, "cpu", m, k, m * k, f, 0, 0.0) for i, (node, m, k, f) in enumerate(pieces))
    return Plan(cluster, "tiny", sum(a.batch for a in asg), SEQ, "fp32", "none", asg, 0.0, 0.0)


@pytest.fixture
def settings(slurm_cluster, monkeypatch):
    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    return SlurmSettings(gres_name=GRES_NAME)


def losses(run_dir: str) -> list[float]:
    return [s["loss"] for s in read_metrics(run_dir)["steps"]]


# ---- the job's shape, without a cluster -------------------------------------------------------


def _node(name: str, count: int, state: str = "IDLE") -> SlurmNode:
    return SlurmNode(name, f"10.0.0.{len(name)}", state, "", {"cpu": count}, {}, 2, 1000, ("debug",))


def test_one_component_per_group_of_nodes_asking_the_same_gres():
    nodes = {"n1": _node("n1", 2), "n2": _node("n2", 1)}
    got = node_requests(node_plan(THREE), nodes, SlurmSettings(gres_name=GRES_NAME))
    assert got == [Component(("n1",), (("cpu", 2),)), Component(("n2",), (("cpu", 1),))]
    even = node_plan([("n1", 1, 1, 0.5), ("n2", 1, 1, 0.5)])
    assert node_requests(even, nodes, SlurmSettings(gres_name=GRES_NAME)) == [Component(("n1", "n2"), (("cpu", 1),))]


@pytest.mark.parametrize("nodes, message", [
    ({"n1": _node("n1", 2)}, "'n2' is not a SLURM node"),
    ({"n1": _node("n1", 2), "n2": _node("n2", 1, "DOWN+NOT_RESPONDING")}, "n2 is DOWN"),
    ({"n1": _node("n1", 1), "n2": _node("n2", 1)}, "n1 has 1 gpumix GRES of type cpu .* the plan uses 2"),
])
def test_a_plan_slurm_cannot_run_is_refused_before_submitting(nodes, message):
    with pytest.raises(ValueError, match=message):
        node_requests(node_plan(THREE), nodes, SlurmSettings(gres_name=GRES_NAME))


def test_the_batch_script_quotes_every_value_and_sbatch_gets_an_argument_list():
    comps = [Component(("n1",), (("cpu", 2),)), Component(("n2",), (("cpu", 1),))]
    odd = "/tmp/a run; rm -rf $HOME 'x'"
    script = batch_script(comps, ["--run-dir", odd, "--", "--seed", "0"])
    sruns = [shlex.split(line.removesuffix(" &")) for line in script.splitlines() if line.startswith("srun")]
    assert [a[1] for a in sruns] == ["--het-group=0", "--het-group=1"]
    assert all(a[a.index("--run-dir") + 1] == odd for a in sruns)  # one argument, as given
    cmd = sbatch_command(comps, "/r/slurm.sbatch", "/r", SlurmSettings(gres_name=GRES_NAME, partition="debug"))
    assert cmd[0] == "sbatch" and cmd.count(":") == 1 and "--gres=gpumix:cpu:2" in cmd and cmd[-1] == "/r/slurm.sbatch"
    assert "--nodelist=n2" in cmd[cmd.index(":"):]
    with pytest.raises(ValueError, match="'%'"):
        sbatch_command(comps, "/r/s", "/r%j", SlurmSettings(gres_name=GRES_NAME))
    with pytest.raises(ValueError, match="GRES name"):
        SlurmSettings(gres_name="gpu;reboot")


def test_inventory_reads_the_real_cluster(slurm_cluster, settings, tmp_path):
    out = str(tmp_path / "cluster.json")
    r = subprocess.run([sys.executable, "-m", "profiler", "inventory", "--slurm", "--gres-name", GRES_NAME, "--out",
                        out, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [(n["name"], n["addr"], n["gres"], n["partitions"]) for n in got["nodes"]] == [
        ("n1", "10.77.0.2", {"cpu": 2}, ["debug"]), ("n2", "10.77.0.3", {"cpu": 1}, ["debug"])]
    cluster = ClusterSpec.load(out)
    assert cluster.name == "slurm-gpumix"
    assert [(n.name, len(n.devices), {d.type for d in n.devices}) for n in cluster.nodes] == [
        ("n1", 2, {"cpu"}), ("n2", 1, {"cpu"})]
    r = subprocess.run([sys.executable, "-m", "profiler", "inventory", "--slurm", "--gres-name", "gpu"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no usable SLURM node" in r.stderr and "Traceback" not in r.stderr


def test_the_readme_recipe_inventory_plan_launch_metrics(slurm_cluster, settings, tmp_path, monkeypatch):
    """README "On a SLURM cluster", command by command (the GRES name from the environment)."""
    monkeypatch.setenv("GPUMIX_SLURM_GRES", GRES_NAME)
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT)

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, (args, r.stderr[-2000:])
        return r.stdout

    cli("profiler", "inventory", "--slurm", "--out", "cluster.json")
    cli("planner", "plan", "--cluster", "cluster.json", "--model", "tiny", "--global-batch", "8", "--seq", "32",
        "--out", "plan.json")
    plan = Plan.load("plan.json")
    assert {a.node for a in plan.used} <= {"n1", "n2"}  # the plan names SLURM's nodes
    assert "done" in cli("executor", "launch", "--plan", "plan.json", "--steps", "3", "--run-dir", "runs/first",
                         "--backend", "slurm")
    m = json.loads(cli("executor", "metrics", "--run-dir", "runs/first", "--json"))
    assert m["status"] == "done" and len(m["steps"]) == 3 and m["world_size"] == len(plan.used)
    assert any(e["kind"] == "slurm_job" for e in m["events"])


def test_a_device_type_is_profiled_as_a_slurm_job_into_the_store(slurm_cluster, settings, tmp_path):
    from planner.core.profiles import load_step_profiles

    r = subprocess.run([sys.executable, "-m", "profiler", "inventory", "--slurm", "--gres-name", GRES_NAME,
                        "--profile", "tiny", "--seq", "32", "--micro-batches", "1,2,3,4", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    stored = json.loads(r.stdout)["profiles"]["cpu"]["store_path"]
    assert os.path.isfile(stored)
    (p,) = [p for p in load_step_profiles() if p.model == "tiny" and p.seq == 32]
    assert p.device_type == "cpu" and p.measured and p.micro_batches == (1, 2, 3, 4) and p.beta_s > 0
    assert "JobName=gpumix-profile-cpu" in slurm_cluster.cmd("scontrol", "show", "job", "-o")  # it ran in SLURM


def test_two_node_three_rank_run_trains_like_one_rank(slurm_cluster, settings, tmp_path):
    t0 = time.monotonic()
    status = launch_slurm(node_plan(THREE), STEPS, str(tmp_path / "three"), settings, seed=SEED, optim=OPTIM)
    slurm_s = time.monotonic() - t0
    m = read_metrics(str(tmp_path / "three"))
    assert status == "done", (m["reason"], m["events"])
    assert launch_run(node_plan(ONE), STEPS, str(tmp_path / "one"), seed=SEED, optim=OPTIM) == "done"
    one, three = losses(str(tmp_path / "one")), losses(str(tmp_path / "three"))
    print(f"\n1 rank (local)  : {one}\n3 ranks (SLURM) : {three}  ({slurm_s:.1f} s)")
    assert len(one) == len(three) == STEPS
    for a, b in zip(one, three):
        assert abs(a - b) / abs(a) <= 1e-5, (one, three)
    # the ranks ran where the plan put them, across the link, and wrote their own rows
    assert sorted((r["node"], r["rank"] is not None) for r in m["ranks"]) == [("n1", True), ("n1", True),
                                                                             ("n2", True)]
    assert {r["steps_recorded"] for r in m["ranks"]} == {STEPS}
    job = read_job_file(str(tmp_path / "three"))
    assert job and job["nodes"] == ["n1", "n2"]
    kinds = [e["kind"] for e in m["events"]]
    assert "slurm_job" in kinds and kinds.count("node_up") == 2 and kinds.count("node_exit") == 2
    assert any("10.77.0.3" in e["message"] for e in m["events"] if e["kind"] == "node_up")
    r = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", str(tmp_path / "three"), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["steps"][-1]["loss"] == three[-1]
    slurm_cluster.wait_no_jobs()


LONG = 400  # steps: the run is stopped or broken long before it ends


def wait_for_steps(run_dir: str, n: int, timeout_s: float = 120.0) -> dict:
    def trained_or_ended() -> dict | None:
        m = read_metrics(run_dir)
        return m if len(m["steps"]) >= n or m["status"] != "running" else None

    return wait_until(trained_or_ended, timeout_s, f"{n} steps", interval_s=0.3, ignore=(ValueError,),
                      detail=lambda: read_metrics(run_dir)["events"])


def wait_status(run_dir: str, timeout_s: float = 120.0) -> dict:
    return wait_until(lambda: (lambda m: m if m["status"] != "running" else None)(read_metrics(run_dir)), timeout_s,
                      "the run to end", interval_s=0.3, detail=lambda: read_metrics(run_dir)["events"])


def processes_of(run_dir: str) -> list[str]:
    """Processes still running for this run (launcher, agents, torchrun, ranks), on every node."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if run_dir in cmd and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
            out.append(f"{p.pid} {cmd[:120]}")
    return out


def start_background(tmp_path, name: str, settings: SlurmSettings, pieces=THREE) -> str:
    from executor.slurm import start_slurm_run

    return start_slurm_run(node_plan(pieces), LONG, str(tmp_path / name), settings, seed=SEED, optim=OPTIM).run_dir


def wait_training(run_dir: str) -> None:
    m = wait_for_steps(run_dir, 2)
    assert m["status"] == "running", (m["reason"], m["events"])


def assert_nothing_left(cluster, run_dir: str) -> None:
    cluster.wait_no_jobs()
    wait_until(lambda: not processes_of(run_dir), 15, "no process of the run left", interval_s=0.3,
               detail=lambda: processes_of(run_dir))


def test_executor_stop_and_an_outside_scancel_end_runs_as_stopped(slurm_cluster, settings, tmp_path):
    # side by side: a one-node job on n1 (a plain job, one srun) and one on n2
    on_n1 = start_background(tmp_path, "stopped", settings, [("n1", 2, 1, 0.5), ("n1", 2, 1, 0.5)])
    on_n2 = start_background(tmp_path, "scancelled", settings, [("n2", 4, 1, 1.0)])
    wait_training(on_n1)
    wait_training(on_n2)
    # the outside scancel first: the executor's stop of the other run may take long enough (a loaded
    # machine) for this one to reach its last step before it is cancelled
    slurm_cluster.cmd("scancel", read_job_file(on_n2)["job_id"])
    job = read_job_file(on_n1)["job_id"]
    r = subprocess.run([sys.executable, "-m", "executor", "stop", "--run-dir", on_n1], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    m = read_metrics(on_n1)
    assert m["status"] == "stopped" and f"scancel of SLURM job {job}" in m["reason"]
    assert 2 <= len(m["steps"]) < LONG
    m = wait_status(on_n2)
    assert m["status"] == "stopped" and "cancelled outside GPUMix" in m["reason"], m["reason"]
    assert len(m["steps"]) < LONG
    assert_nothing_left(slurm_cluster, on_n1)
    assert_nothing_left(slurm_cluster, on_n2)


@pytest.mark.parametrize("node, ranks", [("n2", {2}), ("n1", {0, 1})])  # n1 also hosts the batch script
def test_a_killed_node_fails_the_run_naming_the_node(slurm_cluster, settings, tmp_path, node, ranks):
    run_dir = start_background(tmp_path, "node-died", settings)
    wait_training(run_dir)
    try:
        slurm_cluster.kill_node(node)
        m = wait_status(run_dir)
        assert m["status"] == "failed", m["reason"]
        assert m["reason"].startswith(f"node {node} died"), m["reason"]
        assert m["failed_rank"] in ranks  # a rank the plan put on that node
        assert_nothing_left(slurm_cluster, run_dir)
        print(f"\n{m['reason']}")
    finally:
        slurm_cluster.revive_node(node)


STEPS_ORCH = 25  # each job still runs when the orchestrator is killed (three start together)


def _orchestrator(cluster_file: str, log_path: str) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "executor", "orchestrate", "--backend", "slurm", "--gres-name",
                                 GRES_NAME, "--cluster", cluster_file, "--poll-s", "0.5"], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_a_killed_orchestrator_restarted_loses_no_job_and_double_books_no_device(slurm_cluster, settings,
                                                                                 tmp_path):
    from executor.queue import JobQueue
    from contracts.paths import runs_dir

    cluster_file = str(tmp_path / "cluster.json")
    subprocess.run([sys.executable, "-m", "profiler", "inventory", "--slurm", "--gres-name", GRES_NAME, "--out",
                    cluster_file], check=True, capture_output=True, timeout=60)
    q = JobQueue()
    # global batch 1: one device per job, so three run at once on n1's two and n2's one device,
    # and the fourth must wait for one of them, across the restart too
    ids = [q.submit("tiny", 1, STEPS_ORCH, seq=32) for _ in range(4)]
    orch = _orchestrator(cluster_file, str(tmp_path / "orch1.log"))
    try:
        wait_until(lambda: len(q.list(["running"])) == 3 and len(slurm_cluster.cmd("squeue", "-h", "-t", "R", "-o",
                                                                               "%i").split()) >= 3,
              120, "three jobs running in SLURM")
        before = {j.id: j.run_dir for j in q.list(["running"])}
    finally:
        os.killpg(orch.pid, 9)  # the orchestrator only: each launcher leads its own session
        orch.wait(timeout=10)
    assert q.get(ids[3]).state == "queued"
    orch = _orchestrator(cluster_file, str(tmp_path / "orch2.log"))
    try:
        wait_until(lambda: all(q.get(i).state not in ("queued", "running") for i in ids), 300, "every job to end")
    finally:
        os.killpg(orch.pid, 9)
        orch.wait(timeout=10)
    jobs = [q.get(i) for i in ids]
    assert [j.state for j in jobs] == ["done"] * 4, [j.reason for j in jobs]
    for job_id, run_dir in before.items():
        assert q.get(job_id).run_dir == run_dir  # re-attached, not started again
    for j in jobs:  # each job ran exactly once: one run folder, one SLURM job
        assert len([d for d in os.listdir(runs_dir()) if d.startswith(f"job-{j.id}-")]) == 1
        assert len(read_metrics(j.run_dir)["steps"]) == STEPS_ORCH
    assert len({read_job_file(j.run_dir)["job_id"] for j in jobs}) == 4
    for a in jobs:  # never two jobs on one device at the same time
        for b in jobs:
            if a.id < b.id and a.started_s < b.ended_s and b.started_s < a.ended_s:
                assert not set(a.devices) & set(b.devices), (a, b)
    waited = jobs[3].started_s
    assert waited >= min(j.ended_s for j in jobs[:3]) - 1.0  # the fourth started once a device was free
    slurm_cluster.wait_no_jobs()


def test_a_dashboard_launch_on_slurm_shows_live_metrics_and_is_stopped_from_the_page(slurm_cluster, settings,
                                                                                       data_dir):
    """The Launch page with the slurm backend: Launch submits the job, the live panel shows its steps
    as they come, Stop scancels it, nothing is left on any node."""
    from tests.e2e.test_ui_launch import run_page, texts

    at = run_page(node_plan([("n1", 2, 1, 0.5), ("n1", 2, 1, 0.5)]))
    at.radio(key="launch_backend").set_value("slurm").run()
    at.text_input(key="launch_gres_name").set_value(GRES_NAME).run()
    assert not [w for w in at.warning if "several nodes" in w.value]  # SLURM runs it: no commands to paste
    at.number_input(key="launch_steps").set_value(LONG).run()
    at.button(key="launch_button").click().run()
    assert not at.exception, at.exception
    run_dir = at.session_state["run_dir"]
    wait_training(run_dir)
    assert read_job_file(run_dir)["job_id"]  # it went through sbatch
    at.run()
    assert "Run status: running" in texts(at)
    at.button(key="stop_button").click().run()
    assert not at.exception, at.exception
    assert wait_status(run_dir)["status"] == "stopped"
    assert_nothing_left(slurm_cluster, run_dir)
