"""End-to-end runs with torchrun (gloo, 1 thread per rank): the uneven 3-rank plan is the
same training as the 1-rank plan; resume continues the same curve; a killed rank or an
emulated out-of-memory ends the run as failed with the rank named and nothing left running."""
import os
import signal
import time

import psutil
import pytest
import torch

from executor.launch import launch_run, start_run
from executor.store import read_metrics
from models.decoder import build_model, num_parameters
from planner.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.paths import ENV_DATA_DIR
from planner.plan import Assignment, Plan
from planner.specs import get_model
from tests.conftest import processes_with_data_dir

pytestmark = pytest.mark.slow

SEQ = 32
SEED = 7


def manual_plan(pieces: list[tuple[int, int, float]], devices: list[DeviceSpec] | None = None, seq: int = SEQ) -> Plan:
    """A plan by hand: one (micro_batch, accum_steps, shard_fraction) per local CPU device."""
    devices = devices or [DeviceSpec("cpu")] * len(pieces)
    cluster = ClusterSpec("test", (NodeSpec("localhost", "local", tuple(devices)),))
    asg = tuple(Assignment(i, "localhost", "cpu", m, k, m * k, f, 0, 0.0, emulated=d.emulated, slowdown=d.slowdown,
                           memory_gb=d.memory_gb) for i, ((m, k, f), d) in enumerate(zip(pieces, devices)))
    return Plan(cluster, "tiny", sum(a.batch for a in asg), seq, "fp32", "none", asg, 0.0, 0.0)


PLAN_3 = manual_plan([(5, 1, 0.5), (1, 2, 0.3), (1, 1, 0.2)])  # batches 5/2/1, uneven shards
PLAN_1 = manual_plan([(4, 2, 1.0)])  # the same global batch of 8 on one rank


def losses(run_dir: str) -> list[float]:
    return [s["loss"] for s in read_metrics(run_dir)["steps"]]


def final_params(run_dir: str, step: int) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    flat = torch.empty(num_parameters(build_model(get_model("tiny"))))
    sd = {"flat_params": flat}
    dcp.load(sd, checkpoint_id=os.path.join(run_dir, "checkpoints", f"step_{step:06d}"))
    return sd["flat_params"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four launches shared by the tests below."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DATA_DIR, str(tmp_path_factory.mktemp("data")))
        root = tmp_path_factory.mktemp("runs")
        d = {name: str(root / name) for name in ("one", "three", "resumed")}
        status = {
            "one": launch_run(PLAN_1, 5, d["one"], seed=SEED, checkpoint_every=5),
            "three": launch_run(PLAN_3, 5, d["three"], seed=SEED, checkpoint_every=5),
            "resumed-first": launch_run(PLAN_3, 3, d["resumed"], seed=SEED, checkpoint_every=3),
        }
        status["resumed"] = launch_run(PLAN_3, 5, d["resumed"], seed=SEED, resume=True, checkpoint_every=5)
        yield d, status


def test_uneven_three_rank_plan_trains_exactly_like_one_rank(runs):
    d, status = runs
    assert status["one"] == status["three"] == "done"
    one, three = losses(d["one"]), losses(d["three"])
    assert len(one) == len(three) == 5
    assert abs(one[0] - 5.545) < 0.3  # ln(256): an untrained byte model on real text
    for a, b in zip(one, three):
        assert abs(a - b) / abs(a) <= 1e-5, (one, three)
    p1, p3 = final_params(d["one"], 5), final_params(d["three"], 5)
    init = torch.cat([p.detach().reshape(-1) for p in _init_model().parameters()])
    moved = (p1 - init).abs().max().item()
    assert moved > 1e-3  # 5 AdamW steps of lr 3e-4 moved the weights
    # the same weights up to float summation order: AdamW's normalized update turns gradient
    # rounding (1e-7 relative) into ~1e-6 absolute on a few weights, < 1 % of the movement
    assert (p1 - p3).abs().max().item() <= 0.01 * moved, (p1 - p3).abs().max()


def _init_model():
    torch.manual_seed(SEED)
    return build_model(get_model("tiny"))


def test_resume_after_a_checkpoint_continues_the_identical_loss_curve(runs):
    d, status = runs
    assert status["resumed-first"] == status["resumed"] == "done"
    assert losses(d["resumed"]) == pytest.approx(losses(d["three"]), rel=1e-6)
    assert torch.equal(final_params(d["resumed"], 5), final_params(d["three"], 5))
    kinds = [e["kind"] for e in read_metrics(d["resumed"])["events"]]
    assert "checkpoint" in kinds and "resume" in kinds


def test_metrics_record_per_rank_measurements(runs):
    d, _ = runs
    m = read_metrics(d["three"])
    assert m["status"] == "done" and m["world_size"] == 3 and not m["emulated"]
    assert all(s["step_s"] > 0 and s["samples_per_s"] == pytest.approx(8 / s["step_s"]) for s in m["steps"])
    assert m["steps"][-1]["val_loss"] is not None
    r0, r1, r2 = m["ranks"]
    total = sum(r["shard_numel"] for r in m["ranks"])
    assert [r["shard_numel"] / total for r in m["ranks"]] == pytest.approx([0.5, 0.3, 0.2], abs=1e-4)
    # rank 0 holds the largest shard and micro-batch: the largest measured peak
    assert r0["peak_memory_bytes"] > r1["peak_memory_bytes"] > r2["peak_memory_bytes"] > 0
    assert r0["shard_numel"] > r1["shard_numel"] > r2["shard_numel"] > 0
    assert all(r["median_wait_s"] is not None and r["median_compute_s"] > 0 for r in m["ranks"])
    logs = os.listdir(os.path.join(d["three"], "logs"))
    assert {"rank0.log", "rank1.log", "rank2.log", "torchrun.log"} <= set(logs)


def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_a_killed_rank_fails_the_run_within_30_s_and_leaves_no_process(data_dir, tmp_path):
    h = start_run(manual_plan([(2, 1, 0.5), (2, 1, 0.5)]), 100_000, str(tmp_path / "killed"), seed=SEED)
    m = _wait(lambda: (lambda m: m if len(m["steps"]) >= 2 else None)(read_metrics(h.run_dir)), 150, "2 steps")
    pids = {r["rank"]: r["pid"] for r in m["ranks"]}
    torchrun_pid = int(open(os.path.join(h.run_dir, "torchrun.pid")).read())
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    assert h.wait(timeout_s=30) == "failed"
    assert time.monotonic() - t0 < 30
    m = read_metrics(h.run_dir)
    assert m["failed_rank"] == 1 and "rank 1" in m["reason"] and "SIGKILL" in m["reason"], m["reason"]
    _wait(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                          for p in [*pids.values(), torchrun_pid, h.pid]), 30, "every process to end")
    assert processes_with_data_dir(data_dir) == []


def test_emulated_memory_limit_fails_the_rank_with_an_out_of_memory_message(data_dir, tmp_path):
    small = DeviceSpec("cpu", memory_gb=0.001)  # 1 MiB: less than the tiny model's state
    plan = manual_plan([(2, 1, 1.0)], devices=[small])
    assert launch_run(plan, 3, str(tmp_path / "oom"), seed=SEED) == "failed"
    m = read_metrics(str(tmp_path / "oom"))
    assert m["emulated"] and m["failed_rank"] == 0 and m["ranks"][0]["emulated"]
    assert "out of memory (emulated)" in m["reason"] and "rank 0" in m["reason"], m["reason"]
    assert m["steps"] == []  # the step that ran over the limit is not recorded as trained
    assert processes_with_data_dir(data_dir) == []


def test_metrics_cli_prints_the_design_json_shape(runs):
    import json
    import subprocess
    import sys

    d, _ = runs
    out = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", d["three"], "--json"],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    m = json.loads(out.stdout)
    assert m["status"] == "done"
    assert len(m["steps"]) == 5 and {"step", "loss", "samples_per_s", "step_s"} <= set(m["steps"][0])
    assert len(m["ranks"]) == 3 and {"rank", "peak_memory_bytes"} <= set(m["ranks"][0])
    table = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", d["three"]],
                           capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "done" in table.stdout and "peak_memory_bytes" in table.stdout


def test_stop_cleans_up_ranks_left_behind_by_a_killed_launcher(data_dir, tmp_path):
    import subprocess
    import sys

    h = start_run(manual_plan([(2, 1, 0.5), (2, 1, 0.5)]), 100_000, str(tmp_path / "orphaned"), seed=SEED)
    m = _wait(lambda: (lambda m: m if len(m["steps"]) >= 1 else None)(read_metrics(h.run_dir)), 150, "a step")
    os.kill(h.pid, signal.SIGKILL)  # the launcher dies; torchrun and the ranks live in their own sessions
    _wait(lambda: read_metrics(h.run_dir)["status"] == "failed", 10, "the store to notice the launcher is gone")
    assert all(psutil.pid_exists(r["pid"]) for r in m["ranks"])
    out = subprocess.run([sys.executable, "-m", "executor", "stop", "--run-dir", h.run_dir], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert out.returncode == 0 and "stopped" in out.stdout, out.stderr
    assert read_metrics(h.run_dir)["status"] == "stopped"
    _wait(lambda: processes_with_data_dir(data_dir) == [], 30, "every process to end")
