"""Logical checkpoints: save under one plan's slices, load under another's (executor/checkpoint.py).

The runtime is faked with the duck-typed shape executor/checkpoint.py reads (units with
.name/.numel/.start/.end/.master/.exp_avg/.exp_avg_sq, scalar_state, load_scalar_state,
after_load). The expected values come from whole per-unit tensors drawn here, never from
the checkpoint code: a slice is cut from them, saved, and whatever slice is loaded must equal
the same cut of the whole tensors.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from executor import checkpoint as ckpt
from executor.checkpoint import CKPT_DIR, LATEST, check_resumable, checkpoint_meta, latest, load, save
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan
from testkit.processes import leave_rank

FIELDS = ("master", "exp_avg", "exp_avg_sq")


def make_plan(fractions: tuple[float, ...], types: tuple[str, ...] | None = None, model: str = "tiny",
              global_batch: int = 12, seq: int = 16, zero: int = 1) -> Plan:
    types = types or ("cpu",) * len(fractions)
    n = len(fractions)
    batches = [global_batch // n + (1 if i < global_batch % n else 0) for i in range(n)]
    devs = tuple(DeviceSpec(t) for t in types)
    cluster = ClusterSpec("t", (NodeSpec("localhost", "local", devs),))
    asg = tuple(Assignment(i, "localhost", t, b, 1, b, f, 10**6, 0.1) for i, (t, b, f) in
                enumerate(zip(types, batches, fractions)))
    return Plan(cluster, model, global_batch, seq, "fp32", "none", asg, 0.1, 1.0, zero=zero)


def bounds(numel: int, fractions: tuple[float, ...], position: int) -> tuple[int, int]:
    """[start, end) of `position` when `numel` is cut by cumulative fractions (as a runtime would)."""
    edges = [0] + [round(numel * sum(fractions[:i + 1])) for i in range(len(fractions))]
    edges[-1] = numel
    return edges[position], edges[position + 1]


def whole_state(units: dict[str, int], seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """The logical state: per unit, whole master / moments (distinct random values everywhere)."""
    g = torch.Generator().manual_seed(seed)
    return {name: {f: torch.randn(n, generator=g) for f in FIELDS} for name, n in units.items()}


@dataclass
class FakeUnit:
    name: str
    numel: int
    start: int
    end: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class FakeRuntime:
    """One position's slices, each a view into one flat buffer per field (as a real runtime's
    flat shard would be: saving must not write the whole buffer, loading must fill it in place)."""

    def __init__(self, units: dict[str, int], fractions: tuple[float, ...], position: int,
                 whole: dict[str, dict[str, torch.Tensor]] | None = None, scalar: dict[str, Any] | None = None):
        spans = {name: bounds(n, fractions, position) for name, n in units.items()}
        total = sum(e - s for s, e in spans.values())
        self.flat = {f: torch.full((total,), float("nan")) for f in FIELDS}
        self.units, off = [], 0
        for name, n in units.items():
            s, e = spans[name]
            views = {f: self.flat[f][off:off + e - s] for f in FIELDS}
            if whole is not None:
                for f in FIELDS:
                    views[f].copy_(whole[name][f][s:e])
            self.units.append(FakeUnit(name, n, s, e, **views))
            off += e - s
        self.scalar = dict(scalar or {})
        self.loaded_scalar: dict[str, Any] | None = None
        self.after_load_calls = 0

    def scalar_state(self) -> dict[str, Any]:
        return dict(self.scalar)

    def load_scalar_state(self, d: dict[str, Any]) -> None:
        self.loaded_scalar = dict(d)

    def after_load(self) -> None:
        self.after_load_calls += 1


def assert_holds(rt: FakeRuntime, whole: dict[str, dict[str, torch.Tensor]]) -> None:
    for u in rt.units:
        for f in FIELDS:
            assert torch.equal(getattr(u, f), whole[u.name][f][u.start:u.end]), (u.name, f, u.start, u.end)


def save_all(run: str, plan: Plan, whole: dict, step: int, scalar: dict[str, Any] | None = None,
             positions: list[int] | None = None) -> str:
    fractions = tuple(a.shard_fraction for a in plan.used)
    units = ckpt.plan_units(plan)
    path = ""
    for p in positions if positions is not None else range(len(fractions)):
        path = save(run, FakeRuntime(units, fractions, p, whole, scalar or {"step": step}), p, step, plan)
    return path


OLD = (0.5, 0.3, 0.2)
SCALAR = {"step": 7, "loss_scale": 1024.0, "good_steps": 3, "note": "x"}


@pytest.mark.parametrize("new", [(0.15, 0.85), (0.7, 0.3), (1.0,), (0.1, 0.2, 0.3, 0.4)])
def test_save_on_three_uneven_positions_load_on_another_plan_is_exact(tmp_path, new):
    run = str(tmp_path)
    plan = make_plan(OLD)
    units = ckpt.plan_units(plan)
    whole = whole_state(units)
    path = save_all(run, plan, whole, 7, SCALAR)
    assert sorted(os.listdir(path)) == ["meta_0.json", "meta_1.json", "meta_2.json",
                                        "shard_0.bin", "shard_1.bin", "shard_2.bin"]
    for p, frac in enumerate(new):
        rt = FakeRuntime(units, new, p)
        assert load(run, rt, p) == 7
        assert_holds(rt, whole)
        assert not torch.isnan(rt.flat["master"]).any()  # every element of the new slice was filled
        assert rt.loaded_scalar == SCALAR and rt.after_load_calls == 1


def test_shard_files_hold_only_the_slice_not_the_flat_buffer(tmp_path):
    plan = make_plan(OLD)
    path = save_all(str(tmp_path), plan, whole_state(ckpt.plan_units(plan)), 3)
    for p in range(3):
        n = sum(e - s for s, e in (bounds(v, OLD, p) for v in ckpt.plan_units(plan).values()))
        assert os.path.getsize(os.path.join(path, f"shard_{p}.bin")) == 3 * 4 * n  # 3 fp32 fields


def test_latest_names_the_checkpoint_with_the_logical_layout(tmp_path):
    run = str(tmp_path)
    plan = make_plan(OLD, zero=2)
    path = save_all(run, plan, whole_state(ckpt.plan_units(plan)), 5)
    meta = latest(run)
    assert meta["step"] == 5 and meta["path"] == path and meta["num_positions"] == 3
    assert meta["units"] == {"embed": 24576, "block.0": 49984, "block.1": 49984, "head": 128}
    assert (meta["model"], meta["global_batch"], meta["seq"], meta["zero"]) == ("tiny", 12, 16, 2)
    assert meta["shard_fractions"] == list(OLD)


def test_a_save_cut_short_is_never_named_by_latest(tmp_path):
    run = str(tmp_path)
    plan = make_plan(OLD)
    units = ckpt.plan_units(plan)
    first, second = whole_state(units, seed=1), whole_state(units, seed=2)
    save_all(run, plan, first, 4)
    save_all(run, plan, second, 8, positions=[0, 1])  # position 2 died before writing its shard
    assert latest(run)["step"] == 4
    rt = FakeRuntime(units, (1.0,), 0)
    assert load(run, rt, 0) == 4
    assert_holds(rt, first)
    save_all(run, plan, second, 8, positions=[2])  # the last position completes the set
    assert latest(run)["step"] == 8


def test_a_stale_meta_of_another_attempt_does_not_complete_a_save(tmp_path):
    run = str(tmp_path)
    two = make_plan((0.5, 0.5))
    units = ckpt.plan_units(two)
    save_all(run, make_plan(OLD), whole_state(units, 1), 6, positions=[1])  # a 3-position attempt died
    save_all(run, two, whole_state(units, 2), 6, positions=[0])  # the 2-position retry: meta_1 is stale
    assert latest(run) is None
    save_all(run, two, whole_state(units, 2), 6, positions=[1])
    assert latest(run)["num_positions"] == 2


def test_load_maps_and_reads_only_the_overlapping_ranges(tmp_path, monkeypatch):
    run = str(tmp_path)
    plan = make_plan(OLD)
    units = ckpt.plan_units(plan)
    whole = whole_state(units)
    path = save_all(run, plan, whole, 2)
    reads: list[tuple[int, str, str, int, int]] = []
    real_read = ckpt._ShardReader.read

    def spy(self, s, field, lo, hi):
        view = real_read(self, s, field, lo, hi)
        assert isinstance(view, np.memmap) and view.shape == (hi - lo,)  # a mapped window, not a loaded file
        assert s.start <= lo < hi <= s.end  # inside the old slice it maps
        reads.append((s.position, s.unit, field, lo, hi))
        return view

    monkeypatch.setattr(ckpt._ShardReader, "read", spy)
    new = (0.4, 0.6)
    rt = FakeRuntime(units, new, 1)
    load(run, rt, 1)
    assert_holds(rt, whole)
    for u in rt.units:
        for f in FIELDS:
            got = sorted((lo, hi) for _, name, field, lo, hi in reads if (name, field) == (u.name, f))
            assert all(u.start <= lo and hi <= u.end for lo, hi in got)  # nothing outside the new slice
            assert sum(hi - lo for lo, hi in got) == u.end - u.start  # each element read exactly once
    assert {q for q, *_ in reads} == {0, 1, 2}  # [0.4, 1.0) overlaps old 0 (0.4-0.5), 1 and 2

    # new position 0 holds [0, 0.4): inside old position 0, so the other shards are never opened
    os.remove(os.path.join(path, "shard_1.bin"))
    os.remove(os.path.join(path, "shard_2.bin"))
    reads.clear()
    rt0 = FakeRuntime(units, new, 0)
    load(run, rt0, 0)
    assert_holds(rt0, whole)
    assert {q for q, *_ in reads} == {0}
    with pytest.raises(FileNotFoundError):
        load(run, FakeRuntime(units, new, 1), 1)


def test_load_refuses_a_runtime_of_another_model(tmp_path):
    run = str(tmp_path)
    plan = make_plan(OLD)
    save_all(run, plan, whole_state(ckpt.plan_units(plan)), 1)
    other = ckpt.plan_units(make_plan((1.0,), model="tiny-llama"))
    with pytest.raises(ValueError, match="cannot load"):
        load(run, FakeRuntime(other, (1.0,), 0), 0)


def test_resume_accepts_other_devices_fractions_and_stage(tmp_path):
    run = str(tmp_path)
    with pytest.raises(ValueError, match="no checkpoint"):
        check_resumable(run, make_plan(OLD))
    plan = make_plan(OLD)
    save_all(run, plan, whole_state(ckpt.plan_units(plan)), 9)
    assert check_resumable(run, plan)["step"] == 9
    for other in (make_plan((0.25, 0.75)), make_plan((1.0,), types=("A100-80GB",)),
                  make_plan((0.2, 0.2, 0.6), types=("T4", "cpu", "H100-SXM"), zero=3)):
        assert check_resumable(run, other)["step"] == 9
        assert ckpt.plan_fingerprint(other) != latest(run)["plan_fingerprint"]


@pytest.mark.parametrize("kwargs, key", [({"model": "tiny-llama"}, "model"), ({"seq": 32}, "seq"),
                                         ({"global_batch": 24}, "global_batch")])
def test_resume_refuses_another_model_seq_or_global_batch(tmp_path, kwargs, key):
    run = str(tmp_path)
    plan = make_plan(OLD)
    save_all(run, plan, whole_state(ckpt.plan_units(plan)), 9)
    other = make_plan((0.5, 0.5), **kwargs)
    with pytest.raises(ValueError, match=f"checkpoint's {key} ") as e:
        check_resumable(run, other)
    msg = str(e.value)
    assert "\n" not in msg
    old_val, new_val = {"model": ("tiny", "tiny-llama"), "seq": (16, 32), "global_batch": (12, 24)}[key]
    assert repr(old_val) in msg and repr(new_val) in msg


def test_resume_refuses_an_old_format_checkpoint(tmp_path):
    run = str(tmp_path)
    os.makedirs(os.path.join(run, CKPT_DIR))
    old = {k: v for k, v in checkpoint_meta(make_plan(OLD), 3, "/x/step_000003").items() if k != "format"}
    with open(os.path.join(run, CKPT_DIR, LATEST), "w") as fh:
        json.dump(old, fh)
    with pytest.raises(ValueError, match="format"):
        check_resumable(run, make_plan(OLD))


# ---- two real ranks (gloo): the barrier orders position 0's latest.json after every shard ----


def _two_rank_worker(rank: int, run: str, init_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        plan = make_plan((0.8, 0.2))
        units = ckpt.plan_units(plan)
        whole = whole_state(units, seed=5)
        save(run, FakeRuntime(units, (0.8, 0.2), rank, whole, {"step": 11}), rank, 11, plan)
        assert latest(run)["step"] == 11  # after save returns, on every rank
        rt = FakeRuntime(units, (0.3, 0.7), rank)  # resume on other fractions
        assert load(run, rt, rank) == 11
        assert_holds(rt, whole)
        assert rt.after_load_calls == 1 and rt.loaded_scalar == {"step": 11}
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.mark.slow
def test_two_gloo_ranks_save_and_reload_resharded(tmp_path):
    import torch.multiprocessing as mp

    run = str(tmp_path / "run")
    mp.spawn(_two_rank_worker, args=(run, str(tmp_path / "pg_init")), nprocs=2, join=True)
    units = ckpt.plan_units(make_plan((1.0,)))
    rt = FakeRuntime(units, (1.0,), 0)
    assert load(run, rt, 0) == 11
    assert_holds(rt, whole_state(units, seed=5))
