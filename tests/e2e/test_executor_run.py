"""End-to-end runs with torchrun (gloo, 1 thread per rank): for every ZeRO stage the uneven
3-rank plan (with accumulation) is the same training as the 1-rank plan, with clipping and the
LR schedule on; resume on a DIFFERENT plan (other devices, fractions and stage) continues the
same curve; a model that cannot fit replicated in an emulated device's memory trains at ZeRO-3;
a killed rank or an emulated out-of-memory ends the run as failed with the rank named."""
import os
import signal
import time

import pytest
import torch

from executor import checkpoint as ckpt
from executor.launch import launch_run, start_run
from executor.store import read_metrics
from models.collectives import LocalCollectives
from models.optim import OptimConfig
from models.sharded import ShardedRuntime
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from planner.core.memory import MemoryConfig, estimate_memory
from contracts.paths import ENV_DATA_DIR
from contracts.plan import Assignment, Plan
from contracts.run import RunConfig
from contracts.specs import get_model, with_max_seq
from testkit.processes import kill_rank_and_wait_teardown, processes_with_data_dir
from testkit.wait import wait_until

pytestmark = pytest.mark.slow

SEQ = 32
SEED = 7
STEPS = 5
# clipping at 0.5 binds on this model (its first gradient norms are about 1), warmup then cosine
# (decay_steps: the resumed run's first launch trains 3 of the schedule's 5 steps)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, max_grad_norm=0.5, min_lr_ratio=0.1, decay_steps=STEPS)


def manual_plan(pieces: list[tuple[int, int, float]], devices: list[DeviceSpec] | None = None, seq: int = SEQ,
                zero: int = 1, model: str = "tiny") -> Plan:
    """A plan by hand: one (micro_batch, accum_steps, shard_fraction) per local CPU device."""
    devices = devices or [DeviceSpec("cpu")] * len(pieces)
    cluster = ClusterSpec("test", (NodeSpec("localhost", "local", tuple(devices)),))
    asg = tuple(Assignment(i, "localhost", "cpu", m, k, m * k, f, 0, 0.0, emulated=d.emulated, slowdown=d.slowdown,
                           memory_gb=d.memory_gb) for i, ((m, k, f), d) in enumerate(zip(pieces, devices)))
    return Plan(cluster, model, sum(a.batch for a in asg), seq, "fp32", "none", asg, 0.0, 0.0, zero=zero)


THREE = [(5, 1, 0.5), (1, 2, 0.3), (1, 1, 0.2)]  # batches 5/2/1, uneven shards, rank 1 accumulates
ONE = [(4, 2, 1.0)]  # the same global batch of 8 on one rank
TWO = [(3, 2, 0.15), (2, 1, 0.85)]  # another plan for the resume: other ranks, fractions, batch split
STATE_ONLY = [(4, 2, 0.6), (0, 0, 0.4)]  # rank 1 trains no sample, only holds 40 % of the state


def losses(run_dir: str) -> list[float]:
    return [s["loss"] for s in read_metrics(run_dir)["steps"]]


def final_params(run_dir: str) -> dict[str, torch.Tensor]:
    """The newest checkpoint's parameters, read back through a 1-rank runtime (resharding 3 -> 1)."""
    rt = ShardedRuntime(with_max_seq(get_model("tiny"), SEQ), zero=1, fractions=[1.0], position=0,
                        comm=LocalCollectives(0, 1), device=torch.device("cpu"), materialize=False)
    ckpt.load(run_dir, rt, 0)
    return rt.full_state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The launches shared by the tests below: 1 and 3 ranks at each stage, and a resume."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DATA_DIR, str(tmp_path_factory.mktemp("data")))
        root = tmp_path_factory.mktemp("runs")
        d, status = {}, {}
        for zero in (1, 2, 3):
            for name, pieces in (("one", ONE), ("three", THREE)):
                key = f"{name}{zero}"
                d[key] = str(root / key)
                status[key] = launch_run(manual_plan(pieces, zero=zero), STEPS, d[key], seed=SEED,
                                         checkpoint_every=STEPS, optim=OPTIM)
        for zero in (2, 3):
            key = f"state_only{zero}"
            d[key] = str(root / key)
            status[key] = launch_run(manual_plan(STATE_ONLY, zero=zero), STEPS, d[key], seed=SEED, optim=OPTIM)
        d["resumed"] = str(root / "resumed")
        status["resumed-first"] = launch_run(manual_plan(THREE, zero=3), 3, d["resumed"], seed=SEED,
                                             checkpoint_every=3, optim=OPTIM)
        # a GPU "died": two other devices with other fractions and another stage take over
        status["resumed"] = launch_run(manual_plan(TWO, zero=2), STEPS, d["resumed"], seed=SEED, resume=True,
                                       checkpoint_every=STEPS, optim=OPTIM)
        yield d, status


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_uneven_three_rank_plan_trains_exactly_like_one_rank(runs, zero):
    d, status = runs
    assert status[f"one{zero}"] == status[f"three{zero}"] == "done"
    one, three = losses(d[f"one{zero}"]), losses(d[f"three{zero}"])
    assert len(one) == len(three) == STEPS
    assert abs(one[0] - 5.545) < 0.3  # ln(256): an untrained byte model on real text
    assert one[-1] < one[0] - 0.05  # it learns
    for a, b in zip(one, three):
        assert abs(a - b) / abs(a) <= 1e-5, (one, three)
    p1, p3 = final_params(d[f"one{zero}"]), final_params(d[f"three{zero}"])
    rt = ShardedRuntime(with_max_seq(get_model("tiny"), SEQ), zero=1, fractions=[1.0], position=0,
                        comm=LocalCollectives(0, 1), device=torch.device("cpu"), seed=SEED)
    moved = max_diff(p1, rt.full_state_dict())
    assert moved > 1e-3  # 5 AdamW steps moved the weights
    # the same weights up to float summation order: AdamW's normalized update turns gradient
    # rounding (1e-7 relative) into ~1e-6 absolute on a few weights, < 1 % of the movement
    assert max_diff(p1, p3) <= 0.01 * moved


@pytest.mark.parametrize("zero", [2, 3])
def test_a_rank_that_only_holds_state_joins_every_collective(runs, zero):
    d, status = runs
    assert status[f"state_only{zero}"] == "done"
    for a, b in zip(losses(d[f"state_only{zero}"]), losses(d[f"one{zero}"]), strict=True):
        assert abs(a - b) / abs(b) <= 1e-5


def test_every_stage_is_the_same_training(runs):
    d, _ = runs
    base = losses(d["one1"])
    for zero in (2, 3):
        assert losses(d[f"one{zero}"]) == pytest.approx(base, rel=1e-5)


def test_resume_on_a_different_plan_continues_the_loss_curve(runs):
    d, status = runs
    assert status["resumed-first"] == status["resumed"] == "done"
    got, want = losses(d["resumed"]), losses(d["three3"])
    assert len(got) == STEPS
    for a, b in zip(got, want):
        assert abs(a - b) / abs(b) <= 1e-5, (got, want)
    assert max_diff(final_params(d["resumed"]), final_params(d["three3"])) < 1e-4
    kinds = [e["kind"] for e in read_metrics(d["resumed"])["events"]]
    assert "checkpoint" in kinds and "resume" in kinds
    # the run folder's run.json holds the settings of its last launch
    assert RunConfig.load(d["resumed"]) == RunConfig(steps=STEPS, run_dir=d["resumed"], seed=SEED, resume=True,
                                                     checkpoint_every=STEPS, optim=OPTIM.to_dict())


def test_metrics_record_per_rank_measurements(runs):
    d, _ = runs
    m = read_metrics(d["three1"])
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
    logs = os.listdir(os.path.join(d["three1"], "logs"))
    assert {"rank0.log", "rank1.log", "rank2.log", "torchrun.log"} <= set(logs)


def test_zero3_trains_a_model_that_cannot_fit_replicated_in_an_emulated_device(data_dir, tmp_path):
    """GPT-2 (124M) does not fit replicated into the emulated 1.2 GiB devices (1.59 GiB predicted);
    at ZeRO-3 each of the four holds a quarter of the state plus the units in flight and trains."""
    spec = with_max_seq(get_model("gpt2"), 16)
    limit_gb = 1.2
    replicated = estimate_memory(spec, MemoryConfig(micro_batch=1, seq=16, dp=4, zero=1, shard_fraction=0.25))
    sharded = estimate_memory(spec, MemoryConfig(micro_batch=1, seq=16, dp=4, zero=3, shard_fraction=0.25))
    assert replicated.peak_bytes > limit_gb * 2**30 > sharded.peak_bytes
    small = [DeviceSpec("cpu", memory_gb=limit_gb)] * 4
    run = str(tmp_path / "z3")
    plan = manual_plan([(1, 1, 0.25)] * 4, devices=small, seq=16, zero=3, model="gpt2")
    assert launch_run(plan, 2, run, seed=SEED) == "done", read_metrics(run)["reason"]
    m = read_metrics(run)
    assert len(m["steps"]) == 2 and m["emulated"]
    assert all(0 < r["peak_memory_bytes"] <= limit_gb * 2**30 for r in m["ranks"])
    # the same plan replicated (ZeRO-1) runs out of the emulated memory
    run1 = str(tmp_path / "z1")
    plan1 = manual_plan([(1, 1, 0.25)] * 4, devices=small, seq=16, zero=1, model="gpt2")
    assert launch_run(plan1, 1, run1, seed=SEED) == "failed"
    assert "out of memory (emulated)" in read_metrics(run1)["reason"]


def test_a_killed_rank_fails_the_run_within_30_s_and_leaves_no_process(data_dir, tmp_path):
    h = start_run(manual_plan([(2, 1, 0.5), (2, 1, 0.5)]), 100_000, str(tmp_path / "killed"), seed=SEED)
    kill_rank_and_wait_teardown(h, 1, data_dir)


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
    out = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", d["three1"], "--json"],
                         capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    m = json.loads(out.stdout)
    assert m["status"] == "done"
    assert len(m["steps"]) == 5 and {"step", "loss", "samples_per_s", "step_s"} <= set(m["steps"][0])
    assert len(m["ranks"]) == 3 and {"rank", "peak_memory_bytes"} <= set(m["ranks"][0])
    table = subprocess.run([sys.executable, "-m", "executor", "metrics", "--run-dir", d["three1"]],
                           capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert "done" in table.stdout and "peak_memory_bytes" in table.stdout


def test_a_killed_launchers_run_ends_with_it_and_stop_records_the_launcher_vanished(data_dir, tmp_path):
    import subprocess
    import sys

    h = start_run(manual_plan([(2, 1, 0.5), (2, 1, 0.5)]), 100_000, str(tmp_path / "orphaned"), seed=SEED)
    wait_until(lambda: len(read_metrics(h.run_dir)["steps"]) >= 1, 150, "a step")
    os.kill(h.pid, signal.SIGKILL)  # torchrun and the ranks die with their launcher (executor/lifeline.py)
    wait_until(lambda: processes_with_data_dir(data_dir) == [], 10, "torchrun and the ranks to die with it")
    out = subprocess.run([sys.executable, "-m", "executor", "stop", "--run-dir", h.run_dir], capture_output=True,
                         text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), timeout=120)
    assert out.returncode == 0 and "failed" in out.stdout, out.stderr
    m = read_metrics(h.run_dir)
    assert m["status"] == "failed" and m["reason"].startswith("launcher vanished"), m["reason"]
