"""A run on several nodes writes its store through rank 0 (real processes, the tiny model, two
emulated datacenters, `executor launch --emulate-wan`): every rank's row and end are recorded,
while only the launcher and rank 0's process ever open the store (db's GPUMIX_DEBUG_STORE_OPENS
log of every connection, with its pid)."""
from __future__ import annotations

import os
import subprocess
import sys

from contracts.paths import PROJECT_ROOT
from executor import db, wan
from executor.store import DB_NAME, read_metrics
from testkit.processes import processes_with_data_dir
from testkit.wait import wait_until
from tests.e2e.test_wan import geo_plan, needs_wan

STEPS = 4


@needs_wan
def test_only_rank_0_and_the_launcher_open_the_store_of_a_two_node_run(data_dir, tmp_path, monkeypatch):
    opens = str(tmp_path / "opens.log")
    monkeypatch.setenv(db.ENV_OPENS_LOG, opens)
    plan = str(tmp_path / "plan.json")
    geo_plan(1.0).save(plan)
    run_dir = str(tmp_path / "geo")
    launcher = subprocess.Popen([sys.executable, "-m", "executor", "launch", "--plan", plan, "--steps", str(STEPS),
                                 "--run-dir", run_dir, "--emulate-wan", "--checkpoint-every", "2"],
                                cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)
    try:
        out, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, out
    monkeypatch.delenv(db.ENV_OPENS_LOG)
    m = read_metrics(run_dir)
    assert m["status"] == "done" and len(m["steps"]) == STEPS, m["reason"]
    ranks = {r["rank"]: r for r in m["ranks"]}
    assert sorted(ranks) == [0, 1] and [ranks[r]["node"] for r in (0, 1)] == ["dc-a", "dc-b"]
    assert all(r["pid"] and r["started_s"] and r["shard_numel"] for r in ranks.values()), m["ranks"]
    done = {e["rank"] for e in m["events"] if e["kind"] == "rank_done"}
    assert done == {0, 1}, m["events"]
    assert {r["rank"] for r in m["rank_steps"]} == {0, 1}

    store = os.path.join(run_dir, DB_NAME)
    openers = {int(line.split()[0]) for line in open(opens) if line.rstrip("\n").endswith(" " + store)}
    assert ranks[0]["pid"] in openers, (openers, ranks)
    assert openers <= {launcher.pid, ranks[0]["pid"]}, (openers, launcher.pid, ranks)
    assert ranks[1]["pid"] not in openers
    wait_until(lambda: not processes_with_data_dir(data_dir), 10, "every process of the run to end")
    assert wan.leftovers(wan.WanSetup.load(os.path.join(run_dir, wan.WAN_FILE))) == []
