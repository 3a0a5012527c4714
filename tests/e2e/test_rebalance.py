"""Live rebalancing on real cgroup-emulated devices (executor/rebalance.py, executor/straggler.py).

Two ranks, each in its own CPU cgroup (kinds cpu@share1 and cpu@share0.9), an even split. At step
K the test drops rank 0's quota from one core to a third (cpu.cfs_quota_us, found through the run's
emulation.json). Checked:
- the straggler is named within 5 steps: rank 0, on its device, slower than its profile (measured);
- with `--rebalance auto` the split changes at a step boundary and, within 20 steps of the change,
  the step time is within 10 % of a fresh plan's measured step time on the new speeds (the
  planner's plan for a cluster whose rank 0 has a third of a core, run under that quota);
- the losses equal those of a `--rebalance off` run of the same plan (relative <= 1e-5): every sample
  of a step is still used once, only summed in another order.
The fresh plan runs first, on the data folder's unlearned profiles (the auto run writes its learned
rates back to the profile store)."""
from __future__ import annotations

import json
import os
import statistics

import pytest

from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan
from executor.launch import EMULATION_FILE, launch_run, start_run
from executor.store import read_metrics
from executor.straggler import WINDOW_STEPS
from profiler import cgroups
from testkit.wait import wait_until

pytestmark = pytest.mark.skipif(cgroups.unavailable_reason() is not None,
                                reason=f"cgroups unavailable: {cgroups.unavailable_reason()}")

SEQ = 128  # tiny's longest: ~50 ms of compute per rank and step, several CFS periods (10 ms)
GLOBAL_BATCH = 32
CHANGE_AT = 6  # the quota drops once this step is recorded
AFTER = 20  # steps after the change the run goes on (the bound of "within 20 steps")
STEPS = CHANGE_AT + AFTER
NAMED_WITHIN = 5
STEP_TOLERANCE = 0.10
LOSS_TOLERANCE = 1e-5


def cluster(share0: float) -> ClusterSpec:
    return ClusterSpec("rebalance", (NodeSpec("localhost", "local", (DeviceSpec("cpu", cpu_share=share0),
                                                                     DeviceSpec("cpu", cpu_share=0.9))),))


def even_plan(rebalance: str) -> Plan:
    c = cluster(1.0)
    asg = tuple(Assignment(i, "localhost", "cpu", 8, 2, 16, 0.5, 0, 0.0, True) for i in range(2))
    return Plan(c, "tiny", GLOBAL_BATCH, SEQ, "fp32", "none", asg, 0.0, 0.0, rebalance=rebalance)


def cpu_dir_of(run_dir: str, rank: int) -> str:
    """Rank `rank`'s CPU cgroup from emulation.json (`{"ranks": [{"rank", "cpu_cgroup", ...}]}`)."""
    with open(os.path.join(run_dir, EMULATION_FILE), encoding="utf-8") as fh:
        return next(r["cpu_cgroup"] for r in json.load(fh)["ranks"] if r["rank"] == rank)


def set_share(run_dir: str, rank: int, share: float) -> None:
    d = cpu_dir_of(run_dir, rank)
    with open(os.path.join(d, "cpu.cfs_period_us"), encoding="utf-8") as fh:
        period = int(fh.read())
    with open(os.path.join(d, "cpu.cfs_quota_us"), "w", encoding="utf-8") as fh:
        fh.write(str(max(1000, round(period * share))))


def fresh_run(plan: Plan, run_dir: str) -> list[float]:
    """Step times of steps 3-10 of `plan` run with rank 0 at a third of a core from its start."""
    assert launch_run(plan, 10, run_dir, seed=1, rebalance="off") == "done", read_metrics(run_dir)["reason"]
    return [s["step_s"] for s in read_metrics(run_dir)["steps"] if s["step"] >= 3]


def test_a_slowed_rank_is_named_and_the_split_follows_it_with_the_same_losses(data_dir, tmp_path):
    from planner.entry import plan_job

    # the fresh plan on the new speeds, measured first (the profiles are not yet learned)
    fresh = plan_job(cluster(1 / 3), "tiny", GLOBAL_BATCH, seq=SEQ, zero=1, pipeline=False).plan
    fresh_steps = fresh_run(fresh, str(tmp_path / "fresh-before"))

    off_dir = str(tmp_path / "off")
    assert launch_run(even_plan("auto"), STEPS, off_dir, seed=1, rebalance="off") == "done", \
        read_metrics(off_dir)["reason"]

    auto_dir = str(tmp_path / "auto")
    h = start_run(even_plan("auto"), STEPS, auto_dir, seed=1)
    wait_until(lambda: len(read_metrics(auto_dir)["steps"]) >= CHANGE_AT or read_metrics(auto_dir)["status"] != "running",
               180, f"step {CHANGE_AT} of the auto run", interval_s=0.05)
    set_share(auto_dir, 0, 1 / 3)
    changed = read_metrics(auto_dir)["steps"][-1]["step"] + 1  # the first step run (partly) at a third
    wait_until(lambda: read_metrics(auto_dir)["status"] != "running", 300, "the auto run to end", interval_s=0.5)
    auto = read_metrics(h.run_dir)
    assert auto["status"] == "done", auto["reason"]
    assert changed <= STEPS - AFTER + 2, "the run outpaced the test: the change came too late to judge"

    # the straggler, named within 5 steps: rank 0, its device, measured slower than its profile
    named = [e for e in auto["events"] if e["kind"] == "straggler" and e["step"] >= changed]
    assert named, [(e["kind"], e["step"], e["message"]) for e in auto["events"]]
    s = named[0]["detail"]
    assert s["rank"] == 0 and named[0]["step"] <= changed + NAMED_WITHIN, named[0]
    # since: the first step of its run of steps at or above the threshold; on two shared cores a step or
    # two before the change can read 1.3x already (noise), at most the detector's window before it
    assert s["device"].startswith("cpu@share1 ") and s["slowdown"] >= 1.3
    assert changed - WINDOW_STEPS <= s["since_step"] <= changed + NAMED_WITHIN, (s, changed)
    assert s["cost_s"] > 0, [(e["kind"], e["step"], e["message"]) for e in auto["events"]]
    assert auto["straggler"] is None or auto["straggler"]["rank"] == 0

    # rebalanced at a step boundary: rank 0 now has fewer samples than rank 1, every sample kept
    moves = [e for e in auto["events"] if e["kind"] == "rebalance" and e["step"] >= changed]
    assert moves and moves[0]["step"] <= changed + AFTER, [e["message"] for e in auto["events"]]
    last = moves[-1]["detail"]
    assert [r["batch"] for r in last["old_split"]] != [r["batch"] for r in last["new_split"]]
    assert sum(r["batch"] for r in last["new_split"]) == GLOBAL_BATCH
    assert last["new_split"][0]["batch"] < last["new_split"][1]["batch"]
    ranks = {r["rank"]: r for r in auto["ranks"]}
    assert ranks[0]["micro_batch"] * ranks[0]["accum_steps"] == last["new_split"][0]["batch"]

    # within 20 steps of the change the step time is a fresh plan's, within 10 %: the newest 10 of
    # those 20 steps (the first step of each new split aside: it warms up its shapes) against the fresh
    # plan's steps, measured before and after the auto run (the machine's load drifts)
    assert moves[0]["step"] <= changed + AFTER - 10, f"first rebalance at step {moves[0]['step']}: too late"
    firsts = {e["step"] for e in moves}
    rebalanced = statistics.median(s["step_s"] for s in auto["steps"]
                                   if changed + AFTER - 10 < s["step"] <= changed + AFTER and s["step"] not in firsts)
    after_steps = fresh_run(fresh, str(tmp_path / "fresh-after"))
    fresh_step = statistics.median(fresh_steps + after_steps)
    before, after = statistics.median(fresh_steps), statistics.median(after_steps)  # printed: the drift
    print(f"step time: rebalanced {rebalanced:.4f} s, fresh plan {fresh_step:.4f} s (before {before:.4f}, after "
          f"{after:.4f}; ratio {rebalanced / fresh_step:.3f}); straggler named at step {named[0]['step']} (change at {changed}); "
          f"rebalances at {[e['step'] for e in moves]} to {[r['batch'] for r in last['new_split']]}; fresh plan "
          f"{[a.batch for a in fresh.used]}")
    tail = range(changed + AFTER - 9, changed + AFTER + 1)
    for name, m in (("rebalanced", auto), ("fresh after", read_metrics(str(tmp_path / "fresh-after")))):
        rows = [r for r in m["rank_steps"] if (r["step"] in tail or (name != "rebalanced" and r["step"] >= 3))
                and r.get("compute_s") is not None and r.get("optimizer_s") is not None]
        print(f"{name}: " + "; ".join(
            f"rank {k} compute {statistics.median(r['compute_s'] for r in rows if r['rank'] == k):.4f} s, optimizer "
            f"{statistics.median(r['optimizer_s'] for r in rows if r['rank'] == k):.4f} s"
            for k in (0, 1) if any(r["rank"] == k for r in rows)))
    assert rebalanced <= (1 + STEP_TOLERANCE) * fresh_step, (rebalanced, fresh_step)

    # the same losses as the static split: every sample used once per step
    off = {s["step"]: s["loss"] for s in read_metrics(off_dir)["steps"]}
    worst = max(abs(s["loss"] - off[s["step"]]) / abs(off[s["step"]]) for s in auto["steps"])
    print(f"largest relative loss difference, auto against off: {worst:.2e}")
    assert len(off) == len(auto["steps"]) == STEPS
    assert worst <= LOSS_TOLERANCE

    # the learned rates went to the profile store, labelled measured in the run
    from contracts.specs import get_model, with_max_seq
    from planner.core.profiles import find_measured

    learned = find_measured("cpu@share1", with_max_seq(get_model("tiny"), SEQ), SEQ, "fp32")
    assert learned is not None and "measured in a run" in learned.source and auto_dir in learned.source
