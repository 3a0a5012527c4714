"""One profiling path: `profiler profile --plan` and the Plan page's "Profile now" measure the same
kinds alike; profiles record when and how they were taken and the plan names the one it used (old
profiles still read); `executor metrics` sets a real run's measured steps against the plan's."""
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 64


def _cli(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _old_profile(kind: str, model: str = "tiny", seq: int = SEQ, alpha: float = 0.001, beta: float = 0.002) -> dict:
    """A profile file as the store held it before profiles recorded their provenance."""
    return {"device_type": kind, "model": model, "seq": seq, "dtype": "fp32", "recompute": "none", "alpha_s": alpha,
            "beta_s": beta, "optimizer_s_per_param": 1e-9, "r2": 0.99, "measured": True, "source": "measured (old)",
            "flops_per_sample": 1e6, "num_params": 0, "num_layers": 2, "micro_batches": [1, 2, 4, 8],
            "step_times_s": [alpha + beta * m for m in (1, 2, 4, 8)], "host": "h", "created": "2026-01-01T00:00:00+00:00"}


def _write_old(kind: str, **kw) -> str:
    from planner.core.profiles import step_profile_path

    path = step_profile_path(kind, "tiny", SEQ, "fp32", "none")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(_old_profile(kind, **kw), fh)
    return path


def _two_cpus():
    from contracts.cluster import ClusterSpec

    return ClusterSpec.from_dict({"name": "two", "nodes": [{"name": "localhost", "gpus": [{"type": "cpu"},
                                                                                          {"type": "cpu"}]}]})


def test_an_old_profile_still_reads_and_the_plan_names_the_profile_it_used(data_dir, monkeypatch):
    from dataclasses import replace

    from planner.core.profiles import HOW_TOGETHER, PROFILE_AGAIN, get_step_profile, save_step_profile
    from planner.entry import plan_job
    from contracts.specs import get_model

    spec = get_model("tiny")
    _write_old("cpu")
    old = get_step_profile("cpu", spec, SEQ, "fp32")
    assert old.measured and old.how == "" and old.load_avg is None and old.together_with == ()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    notes = plan_job(_two_cpus(), "tiny", 8, seq=SEQ, time_limit_s=5).plan.notes
    mine = [n for n in notes if n.startswith("profile cpu:")]
    assert mine == ["profile cpu: measured 2026-01-01T00:00:00+00:00, how not recorded, load not recorded, "
                    "noise not recorded"], notes

    new = replace(old, created="2026-02-02T00:00:00+00:00", how=HOW_TOGETHER, load_avg=0.4, num_cpus=2, noise=0.05,
                  noise_alpha_s=1e-4, together_with=("cpu", "cpu"))
    save_step_profile(new)  # the newer measurement replaces the old one under its key
    note = next(n for n in plan_job(_two_cpus(), "tiny", 8, seq=SEQ, time_limit_s=5).plan.notes
                if n.startswith("profile cpu:"))
    assert note.startswith("profile cpu: measured 2026-02-02T00:00:00+00:00, together, load 0.40 on 2 CPUs, "
                           "β noise 5.0%") and PROFILE_AGAIN not in note, note

    monkeypatch.setattr(os, "getloadavg", lambda: (2.9, 2.0, 1.0))  # 2.5 above the recorded 0.4: flagged
    note = next(n for n in plan_job(_two_cpus(), "tiny", 8, seq=SEQ, time_limit_s=5).plan.notes
                if n.startswith("profile cpu:"))
    assert "profiled at load 0.40, now 2.90" in note and note.endswith(PROFILE_AGAIN), note
    monkeypatch.setattr(os, "getloadavg", lambda: (1.3, 1.0, 1.0))  # 0.9 away: within the rule
    save_step_profile(replace(new, together_with=("cpu", "cpu", "cpu")))  # timed beside three, the plan runs two
    note = next(n for n in plan_job(_two_cpus(), "tiny", 8, seq=SEQ, time_limit_s=5).plan.notes
                if n.startswith("profile cpu:"))
    assert "profiled at load" not in note and "beside other devices (cpu + cpu + cpu) than the run's (cpu + cpu)" in note


def _within_noise(a, b, what: str) -> None:
    """α and β of two profiles of one kind agree within the spread each measured of itself."""
    assert a.noise is not None and b.noise is not None and a.noise_alpha_s is not None, (a, b)
    beta_tol = a.noise * a.beta_s + b.noise * b.beta_s
    alpha_tol = a.noise_alpha_s + b.noise_alpha_s
    assert abs(a.beta_s - b.beta_s) <= beta_tol, (what, "β", a.beta_s, b.beta_s, beta_tol)
    assert abs(a.alpha_s - b.alpha_s) <= alpha_tol, (what, "α", a.alpha_s, b.alpha_s, alpha_tol)


@pytest.mark.timeout(600)
def test_cli_profile_and_the_plan_page_s_profile_of_the_same_kinds_agree_within_their_noise(mixed_page_profiled,
                                                                                            tmp_path):
    at, plan = mixed_page_profiled.at, mixed_page_profiled.plan_before  # the page's profile (tests/e2e/conftest.py)
    assert [a.used for a in plan.assignments] == [True, True]
    plan_path = str(tmp_path / "plan.json")
    plan.save(plan_path)
    assert not at.exception and not at.error
    page = mixed_page_profiled.profiles

    r = _cli("-m", "profiler", "profile", "--plan", plan_path, "--no-save", "--json")  # the command line's
    assert r.returncode == 0, r.stderr[-2000:]
    cli = {d["device_type"]: d for d in json.loads(r.stdout)["profiles"]}
    assert set(page) == set(cli) == {"cpu@share1", "cpu@share0.33"}, (page, cli)
    from planner.core.profiles import StepProfile

    for kind in cli:  # the figures, shown when an assertion below fails
        c, p = StepProfile.from_dict(cli[kind]), page[kind]
        print(f"{kind}: cli α={c.alpha_s:.4g} β={c.beta_s:.4g} noise={c.noise} ±α={c.noise_alpha_s}; "
              f"page α={p.alpha_s:.4g} β={p.beta_s:.4g} noise={p.noise} ±α={p.noise_alpha_s}")
    for kind in cli:
        c, p = StepProfile.from_dict(cli[kind]), page[kind]
        assert c.how == p.how == "together" and c.together_with == p.together_with == ("cpu@share1", "cpu@share0.33")
        assert c.cpu_share == p.cpu_share and c.load_avg is not None and c.taken_at > p.taken_at
        _within_noise(c, p, kind)
    # the quota is visible in both: a third of a core is measurably slower per sample than a whole one
    for profiles in (page, {k: StepProfile.from_dict(v) for k, v in cli.items()}):
        assert profiles["cpu@share0.33"].beta_s > 1.5 * profiles["cpu@share1"].beta_s, profiles


def test_executor_metrics_prints_measured_against_predicted_per_rank_with_its_profile(data_dir, tmp_path):
    from planner.core.profiles import load_step_profiles
    from planner.entry import plan_job

    _write_old("cpu", alpha=0.002, beta=0.003)
    plan = plan_job(_two_cpus(), "tiny", 8, seq=SEQ, time_limit_s=5).plan
    used = [a for a in plan.assignments if a.used]
    assert len(used) == 2 and load_step_profiles()[0].measured
    plan_path, run_dir = str(tmp_path / "plan.json"), str(tmp_path / "run")
    plan.save(plan_path)
    r = _cli("-m", "executor", "launch", "--plan", plan_path, "--steps", "8", "--run-dir", run_dir, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]

    r = _cli("-m", "executor", "metrics", "--run-dir", run_dir, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout)
    assert {"status", "steps", "ranks", "rank_steps", "straggler"} <= set(m)  # the keys it always had
    p = m["predicted"]
    measured = statistics.median(s["step_s"] for s in m["steps"][3:])  # the store's own rows, steps 4..8
    assert p["iteration"]["measured_s"] == pytest.approx(measured)
    assert p["iteration"]["predicted_s"] == pytest.approx(plan.predicted_iteration_s)
    assert p["iteration"]["error"] == pytest.approx((measured - plan.predicted_iteration_s) / plan.predicted_iteration_s)
    assert [x["rank"] for x in p["ranks"]] == [0, 1] and p["stages"] == []
    for x, a in zip(p["ranks"], used):
        rows = [rs for rs in m["rank_steps"] if rs["rank"] == x["rank"] and rs["step"] > 3]
        own = statistics.median(rs["compute_s"] + rs["emulated_delay_s"] + rs["optimizer_s"] + rs["wait_s"]
                                for rs in rows)
        assert x["measured_step_s"] == pytest.approx(own) and x["predicted_step_s"] == pytest.approx(a.predicted_step_s)
        assert x["kind"] == "cpu" and x["profile"].startswith("cpu: measured 2026-01-01T00:00:00+00:00")

    r = _cli("-m", "executor", "metrics", "--run-dir", run_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "measured vs predicted (medians of steps 4+, 5 steps): iteration" in out, out
    assert f"{plan.predicted_iteration_s * 1e3:.1f} ms predicted" in out
    assert "predicted from profile cpu: measured 2026-01-01T00:00:00+00:00" in out
    table = out[out.index("measured vs predicted"):].splitlines()
    assert table[1].split()[:6] == ["rank", "device", "kind", "measured_step_ms", "predicted_step_ms", "error"]
    assert table[2].split()[0] == "0" and table[3].split()[0] == "1"


def test_plain_cpu_workers_are_profiled_together_with_their_collectives_and_bad_flags_exit_2(data_dir, tmp_path):
    from planner.core.profiles import StepProfile, get_collective_profile

    r = _cli("-m", "profiler", "profile", "--model", "tiny", "--seq", "32", "--micro-batches", "1,2,3,4", "--repeats",
             "3", "--workers", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    (p,) = [StepProfile.from_dict(d) for d in doc["profiles"]]  # two devices of one kind pool their rounds
    assert p.device_type == "cpu" and p.how == "together" and p.together_with == ("cpu", "cpu")
    assert p.cpu_share is None and p.noise is not None and "profiled together" in p.source
    assert doc["collectives_key"] == "cpu" and get_collective_profile("cpu").world_size == 2

    plan = str(tmp_path / "p.json")
    with open(plan, "w", encoding="utf-8") as fh:
        fh.write("{}")
    for args, why in ((["--plan", plan, "--workers", "2"], "do not go with them"),
                      (["--plan", plan, "--cluster", plan], "not both"),
                      (["--seq", "32"], "--model is required"),
                      (["--model", "tiny", "--companion-cpu-share", "0.5"], "--companion-cpu-share goes with")):
        r = _cli("-m", "profiler", "profile", *args)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
