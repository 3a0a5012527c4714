"""Checkpoints on a bounded disk (executor/checkpoint.py): keep-last-N pruning only after a newer
checkpoint is whole, the free-space check before a save, and a disk that fills during a save (a
small tmpfs, mounted here when root) reported as DiskFull with the previous checkpoint still loading.
One process saves for every position (no torch.distributed), with the fake runtime of the
checkpoint tests."""
from __future__ import annotations

import os
import subprocess

import pytest

from executor import checkpoint as ckpt
from tests.e2e.test_executor_checkpoint import FakeRuntime, assert_holds, make_plan, save_all, whole_state

FRACTIONS = (0.5, 0.5)


def test_keep_n_prunes_older_checkpoints_once_a_newer_one_is_whole(tmp_path):
    run, plan = str(tmp_path), make_plan(FRACTIONS)
    units = ckpt.plan_units(plan)
    for step in (1, 2, 3):
        for p in range(2):
            ckpt.save(run, FakeRuntime(units, FRACTIONS, p, whole_state(units, step)), p, step, plan, keep=2)
    assert ckpt.saved_steps(run) == [2, 3]
    # position 0 of step 4 written, position 1 not yet: latest still names 3, nothing pruned, and the
    # save in progress is its .tmp folder, not yet a step folder
    ckpt.save(run, FakeRuntime(units, FRACTIONS, 0, whole_state(units, 4)), 0, 4, plan, keep=1)
    assert ckpt.latest(run)["step"] == 3 and ckpt.saved_steps(run) == [2, 3]
    assert os.path.isdir(os.path.join(run, ckpt.CKPT_DIR, "step_000004" + ckpt.TMP_SUFFIX))
    ckpt.save(run, FakeRuntime(units, FRACTIONS, 1, whole_state(units, 4)), 1, 4, plan, keep=1)
    assert ckpt.latest(run)["step"] == 4 and ckpt.saved_steps(run) == [4]
    rt = FakeRuntime(units, FRACTIONS, 1)
    assert ckpt.load(run, rt, 1) == 4
    assert_holds(rt, whole_state(units, 4))


def test_keep_0_keeps_every_checkpoint(tmp_path):
    run, plan = str(tmp_path), make_plan(FRACTIONS)
    for step in (1, 2, 3):
        save_all(run, plan, whole_state(ckpt.plan_units(plan), step), step)
    assert ckpt.saved_steps(run) == [1, 2, 3]


def test_a_save_without_room_is_refused_before_writing(tmp_path, monkeypatch):
    run, plan = str(tmp_path), make_plan(FRACTIONS)
    units = ckpt.plan_units(plan)
    save_all(run, plan, whole_state(units, 1), 1)
    monkeypatch.setattr(ckpt, "checkpoint_bytes", lambda plan: 10**18)
    with pytest.raises(ckpt.DiskFull) as e:
        ckpt.save(run, FakeRuntime(units, FRACTIONS, 0, whole_state(units, 2)), 0, 2, plan)
    assert str(e.value).startswith("disk full: the checkpoint of step 2 needs")
    assert os.path.join(run, "checkpoints") in str(e.value)
    assert ckpt.saved_steps(run) == [1] and ckpt.latest(run)["step"] == 1


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only): room for one checkpoint of the fake model's half, not two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_disk_that_fills_during_a_save_is_reported_and_the_previous_checkpoint_loads(small_disk, monkeypatch):
    plan = make_plan(FRACTIONS)
    units = dict(ckpt.plan_units(plan))
    need = sum(units.values()) * 12
    assert 2**20 < need < 1.8 * 2**20, need  # one checkpoint fits the 2 MiB disk, two do not
    monkeypatch.setattr(ckpt, "checkpoint_bytes", lambda plan: 0)  # past the check: the write itself fails
    save_all(small_disk, plan, whole_state(units, 1), 1)
    with pytest.raises(ckpt.DiskFull, match="disk full while writing the checkpoint of step 2 to .*step_000002"):
        save_all(small_disk, plan, whole_state(units, 2), 2)
    assert ckpt.latest(small_disk)["step"] == 1
    rt = FakeRuntime(units, FRACTIONS, 0)
    assert ckpt.load(small_disk, rt, 0) == 1
    assert_holds(rt, whole_state(units, 1))
