"""Asynchronous, atomic checkpoints (executor/checkpoint.py's AsyncSaver; docs/executor.md, "Checkpoints").

In one process (no torch.distributed, the fake runtime of the checkpoint tests): `start` returns
before the write ends and what it saves is the state at `start` (a host copy), not the state the
training goes on changing; a save is committed only once written (a `.tmp` folder until then), a
failed write surfaces at `wait` with the previous checkpoint still the one to resume; a start's
cleaning removes what saves cut short left.

With real ranks (torchrun, gloo): a rank SIGKILLed while its background writer is mid-save (held
there by the tests-only GPUMIX_TEST_CHECKPOINT_PAUSE) leaves the previous checkpoint committed, and
`--resume` continues from it with the losses of the uninterrupted run.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from executor import checkpoint as ckpt
from executor.launch import launch_run, start_run
from executor.store import read_metrics
from models.optim import OptimConfig
from testkit.wait import wait_until
from tests.e2e.test_executor_checkpoint import FakeRuntime, assert_holds, make_plan, save_all, whole_state
from tests.e2e.test_executor_run import final_params, losses, manual_plan, max_diff

ONE = (1.0,)


def _tmp(run: str, step: int) -> str:
    return ckpt.step_folder(run, step) + ckpt.TMP_SUFFIX


def test_start_returns_before_the_write_and_saves_the_state_at_start(tmp_path, monkeypatch):
    run, plan = str(tmp_path), make_plan(ONE)
    units = ckpt.plan_units(plan)
    save_all(run, plan, whole_state(units, 1), 1)
    gate, writing = threading.Event(), threading.Event()
    real = ckpt._write_shard

    def held(folder, shard):  # the disk is slow: the writer waits until the test lets it go
        writing.set()
        assert gate.wait(30)
        return real(folder, shard)

    monkeypatch.setattr(ckpt, "_write_shard", held)
    saver = ckpt.AsyncSaver(run, 0, plan)
    rt = FakeRuntime(units, ONE, 0, whole_state(units, 2), {"step": 2})
    saver.start(rt, 2)
    assert writing.wait(30) and saver.in_flight
    for f in rt.flat.values():  # the training goes on changing the state in place
        f.add_(1.0)
    assert ckpt.latest(run)["step"] == 1 and ckpt.saved_steps(run) == [1]  # nothing committed yet
    assert os.path.isdir(_tmp(run, 2))
    gate.set()
    saver.wait()
    assert not saver.in_flight and not os.path.exists(_tmp(run, 2))
    assert ckpt.latest(run)["step"] == 2 and ckpt.saved_steps(run) == [1, 2]
    back = FakeRuntime(units, ONE, 0)
    assert ckpt.load(run, back, 0) == 2
    assert_holds(back, whole_state(units, 2))  # the values at start, not the ones changed after it


def test_a_failed_background_write_is_raised_by_wait_and_commits_nothing(tmp_path, monkeypatch):
    run, plan = str(tmp_path), make_plan(ONE)
    units = ckpt.plan_units(plan)
    save_all(run, plan, whole_state(units, 1), 1)

    def broken(folder, shard):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(ckpt, "_write_shard", broken)
    saver = ckpt.AsyncSaver(run, 0, plan)
    saver.start(FakeRuntime(units, ONE, 0, whole_state(units, 2)), 2)
    with pytest.raises(OSError, match="Input/output error"):
        saver.wait()
    saver.wait()  # raised once
    assert ckpt.latest(run)["step"] == 1 and ckpt.saved_steps(run) == [1]
    back = FakeRuntime(units, ONE, 0)
    assert ckpt.load(run, back, 0) == 1
    assert_holds(back, whole_state(units, 1))


def test_a_start_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    """One host copy at a time: the next save's copy is taken only once the previous save ended."""
    run, plan = str(tmp_path), make_plan(ONE)
    units = ckpt.plan_units(plan)
    order: list[str] = []
    real_write, real_snap = ckpt._write_shard, ckpt.snapshot

    def write(folder, shard):
        order.append(f"write {shard.step}")
        return real_write(folder, shard)

    def snap(runtime, position, step):
        order.append(f"copy {step}")
        return real_snap(runtime, position, step)

    monkeypatch.setattr(ckpt, "_write_shard", write)
    monkeypatch.setattr(ckpt, "snapshot", snap)
    saver = ckpt.AsyncSaver(run, 0, plan, keep=1)
    for step in (1, 2, 3):
        saver.start(FakeRuntime(units, ONE, 0, whole_state(units, step)), step)
    saver.wait()
    assert order == ["copy 1", "write 1", "copy 2", "write 2", "copy 3", "write 3"]
    assert ckpt.latest(run)["step"] == 3 and ckpt.saved_steps(run) == [3]


def test_a_start_removes_what_saves_cut_short_left(tmp_path, caplog):
    run, plan = str(tmp_path), make_plan((0.5, 0.5))
    units = ckpt.plan_units(plan)
    save_all(run, plan, whole_state(units, 2), 2)
    save_all(run, plan, whole_state(units, 4), 4, positions=[0])  # position 1 died mid-save: a .tmp folder
    os.makedirs(ckpt.step_folder(run, 6))  # renamed, killed before latest.json named it: not committed
    assert ckpt.latest(run)["step"] == 2 and os.path.isdir(_tmp(run, 4))
    with caplog.at_level(logging.INFO, logger="executor.checkpoint"):
        gone = ckpt.remove_uncommitted(run)
    assert gone == ["step_000004.tmp", "step_000006"]
    assert "uncommitted checkpoint folders removed" in caplog.text
    assert sorted(os.listdir(os.path.join(run, ckpt.CKPT_DIR))) == ["latest.json", "step_000002"]
    assert ckpt.remove_uncommitted(run) == []


def test_the_pause_hook_is_inert_without_its_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(ckpt.ENV_TEST_PAUSE, raising=False)
    run, plan = str(tmp_path), make_plan(ONE)
    units = ckpt.plan_units(plan)
    monkeypatch.setattr(ckpt.time, "sleep", lambda s: pytest.fail("the writer paused"))
    save_all(run, plan, whole_state(units, 3), 3)
    monkeypatch.setenv(ckpt.ENV_TEST_PAUSE, "4:1")  # another position's: no pause either
    save_all(run, plan, whole_state(units, 4), 4)
    assert ckpt.latest(run)["step"] == 4
    assert not any(n.startswith("paused_") for n in os.listdir(ckpt.step_folder(run, 4)))


# ---- real ranks: a rank killed while its save is in flight ------------------------------------------

STEPS = 6
EVERY = 2
SEED = 3
OPTIM = OptimConfig(lr=1e-3, warmup_steps=2, max_grad_norm=0.5, min_lr_ratio=0.1, decay_steps=STEPS)
PIECES = [(2, 1, 0.6), (1, 2, 0.4)]  # uneven shards, rank 1 accumulates


@pytest.mark.slow
def test_a_rank_killed_mid_save_resumes_from_the_previous_checkpoint_with_the_same_losses(
        data_dir, tmp_path, monkeypatch):
    plan = manual_plan(PIECES)
    whole = str(tmp_path / "uninterrupted")
    assert launch_run(plan, STEPS, whole, seed=SEED, checkpoint_every=EVERY, optim=OPTIM) == "done", \
        read_metrics(whole)["reason"]
    want = losses(whole)
    assert len(want) == STEPS

    run = str(tmp_path / "killed")
    monkeypatch.setenv(ckpt.ENV_TEST_PAUSE, "4:1")  # position 1's writer of step 4 stops mid-shard
    h = start_run(plan, STEPS, run, seed=SEED, checkpoint_every=EVERY, optim=OPTIM)
    monkeypatch.delenv(ckpt.ENV_TEST_PAUSE)
    marker = os.path.join(_tmp(run, 4), "paused_1")
    wait_until(lambda: os.path.isfile(marker) and open(marker).read(), 240, "rank 1's save of step 4 to pause")
    pid = int(open(marker).read())
    pids = {r["rank"]: r["pid"] for r in read_metrics(run)["ranks"]}
    assert pid == pids[1]
    assert ckpt.latest(run)["step"] == 2  # step 4's save is in flight: not committed
    os.kill(pid, signal.SIGKILL)
    assert h.wait(timeout_s=60) == "failed"
    assert ckpt.latest(run)["step"] == 2 and ckpt.saved_steps(run) == [2]
    assert os.path.isdir(_tmp(run, 4))  # the partial save, left as it was

    assert launch_run(plan, STEPS, run, seed=SEED, resume=True, checkpoint_every=EVERY, optim=OPTIM) == "done", \
        read_metrics(run)["reason"]
    log0 = open(os.path.join(run, "logs", "rank0.log")).read()
    assert "resumed from the checkpoint of step 2" in log0
    assert "uncommitted checkpoint folders removed" in log0 and "step_000004.tmp" in log0
    got = losses(run)
    assert len(got) == STEPS
    for a, b in zip(got, want):
        assert abs(a - b) / abs(b) <= 1e-5, (got, want)
    assert ckpt.latest(run)["step"] == STEPS and ckpt.saved_steps(run) == [2, 4, 6]
    assert not any(n.endswith(ckpt.TMP_SUFFIX) for n in os.listdir(os.path.join(run, ckpt.CKPT_DIR)))
    # the resumed run's final parameters are the uninterrupted run's (up to float summation order)
    assert max_diff(final_params(run), final_params(whole)) < 1e-4
