"""AppTest of ui/launch.py: no plan -> a message; a plan -> its widgets; fabricated runs in
the store -> the live lines, the selector and the charts; a real launch and stop by click."""
from __future__ import annotations

import os

import pytest
from streamlit.testing.v1 import AppTest

from executor.store import read_metrics
from testkit.processes import processes_with_data_dir
from testkit.runs import fabricate_run, two_cpu_plan
from testkit.wait import wait_until
from ui.charts import drawn_figures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "ui", "launch.py")


def run_page(plan=None, run_dir=None) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    if plan is not None:
        at.session_state["plan"] = plan
    if run_dir is not None:
        at.session_state["run_dir"] = run_dir
    at.run()
    assert not at.exception, at.exception
    return at


def texts(at: AppTest) -> str:
    return "\n".join(m.value for m in at.markdown)


def test_without_a_plan_the_page_says_so(data_dir):
    at = run_page()
    assert any("No plan" in i.value for i in at.info)
    assert not [b for b in at.button if b.key == "launch_button"]
    assert "Run status" not in texts(at)


def test_with_a_plan_the_widgets_are_there_and_a_finished_run_is_shown(data_dir):
    done = fabricate_run("run-done", 6, "done", slowdown=3.0)
    at = run_page(two_cpu_plan(3.0))
    assert at.number_input(key="launch_steps").value > 0
    assert at.button(key="launch_button")
    select = at.selectbox(key="launch_run_select")
    assert select.value == done  # the only run
    body = texts(at)
    assert "Run status: done" in body and "Steps recorded: 6" in body
    assert at.button(key="stop_button").disabled  # nothing to stop
    assert at.session_state["run_dir"] == done
    assert any("emulated" in c.value for c in at.caption)  # the slowdown-3 device is marked
    assert len(drawn_figures(at)) == 4 and not at.get("vega_lite_chart")
    assert not at.error


def test_the_default_run_lasts_long_enough_to_watch_and_bad_steps_are_refused(data_dir):
    from ui.launch import MIN_DEFAULT_STEPS, WATCH_S

    plan = two_cpu_plan()
    at = run_page(plan)
    steps = at.number_input(key="launch_steps").value
    assert steps >= MIN_DEFAULT_STEPS and steps * plan.predicted_iteration_s >= 0.9 * WATCH_S
    assert at.number_input(key="launch_steps").label == "Steps (steps, 1–1,000,000)"
    assert not [n for n in at.number_input if n.key == "launch_checkpoint_every"]  # no "0 = never"
    at.checkbox(key="launch_checkpoints").check().run()
    assert at.number_input(key="launch_checkpoint_every").value == 500
    at.number_input(key="launch_steps").set_value(0).run()
    assert not at.exception
    assert [e.value for e in at.error] == ["Steps: 0 is out of range, 1–1,000,000 steps"]
    assert not [b for b in at.button if b.key == "launch_button"]  # nothing to launch with a refused value


def test_a_reloaded_session_finds_the_running_run_in_the_store(data_dir):
    fabricate_run("run-old", 3, "failed")
    live = fabricate_run("run-live", 4, None)  # running: its 'launcher' is this test process
    at = run_page(two_cpu_plan())
    assert at.selectbox(key="launch_run_select").value == live
    assert "Run status: running" in texts(at) and "Steps recorded: 4" in texts(at)
    assert not at.button(key="stop_button").disabled


def launch_by_click(steps: int = 100_000) -> tuple[AppTest, str]:
    """A session of the page that clicked Launch: (its AppTest, the run folder)."""
    at = run_page(two_cpu_plan())
    at.number_input(key="launch_steps").set_value(steps)
    at.button(key="launch_button").click().run()
    assert not at.exception, at.exception
    return at, at.session_state["run_dir"]


@pytest.mark.slow
def test_launch_and_stop_by_click(data_dir):
    at, run_dir = launch_by_click()
    assert os.path.dirname(run_dir) == os.path.join(data_dir, "runs")
    wait_until(lambda: read_metrics(run_dir)["steps"], 120, "a recorded step", interval_s=0.5)
    at.run()
    assert "Run status: running" in texts(at)
    at.button(key="stop_button").click().run()
    assert not at.exception, at.exception
    assert "Run status: stopped" in texts(at)
    assert read_metrics(run_dir)["status"] == "stopped"
    wait_until(lambda: processes_with_data_dir(data_dir) == [], 30, "every process of the run to end", interval_s=0.5,
               detail=lambda: processes_with_data_dir(data_dir))


@pytest.mark.slow
def test_two_sessions_on_the_same_devices_the_second_is_told_which_run_holds_them(data_dir):
    from executor.launch import stop_run

    first, run_dir = launch_by_click()
    try:
        second = run_page(two_cpu_plan())  # another browser tab, same devices
        assert second.button(key="launch_button").disabled
        warnings = [w.value for w in second.warning]
        assert any("Launch is disabled" in w and f"in use by run {run_dir}" in w for w in warnings), warnings
        assert first.button(key="launch_button").disabled  # the first session too: its own run holds them
        # stop once it trains (a launcher still starting is killed after 30 s)
        wait_until(lambda: read_metrics(run_dir)["steps"], 150, "a recorded step", interval_s=0.5)
    finally:
        stop_run(run_dir)
    assert not run_page(two_cpu_plan()).button(key="launch_button").disabled  # free again


def test_a_finished_dashboard_launch_leaves_no_defunct_child(data_dir):
    import psutil

    from executor.launch import start_run

    h = start_run(two_cpu_plan(), 2, seed=0)
    assert h.wait(timeout_s=150) == "done", read_metrics(h.run_dir)["reason"]

    def state() -> str:
        try:
            return psutil.Process(h.pid).status()
        except psutil.NoSuchProcess:
            return "reaped"

    # the launcher exits just after recording "done"; then its parent (this "dashboard") must reap it
    wait_until(lambda: state() in ("reaped", psutil.STATUS_ZOMBIE), 30, "the launcher to exit", interval_s=0.1)
    wait_until(lambda: state() == "reaped", 5, "the dashboard to reap its launcher", interval_s=0.1)
    zombies = [c.pid for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]
    assert state() == "reaped" and zombies == [], f"<defunct> children of the dashboard: {zombies}"


def test_gap_reasons_name_an_unprofiled_device_and_emulation(data_dir):
    from ui.launch import gap_reasons

    m = {"model": "tiny", "seq": 128, "dtype": "fp32",
         "ranks": [{"rank": 0, "type": "cpu", "slowdown": 1.0, "micro_batch": 2},
                   {"rank": 1, "type": "cpu", "slowdown": 3.0, "micro_batch": 2}]}
    reasons = gap_reasons(m)
    assert any("no measured profile of tiny at seq 128 on cpu" in r for r in reasons), reasons
    assert any("emulated slowdowns" in r for r in reasons), reasons
    assert any("collectives between this machine's CPU workers were not measured" in r for r in reasons), reasons


def test_gap_reasons_read_the_kinds_from_the_run_plan_and_name_an_extrapolated_micro_batch(data_dir):
    """A run on CPU quotas is priced by its cpu@share profiles (the store's type says only "cpu"):
    measured ones are not called estimates; a micro-batch under the sizes they timed is named."""
    from planner.core.profiles import StepProfile, save_step_profile
    from ui.launch import gap_reasons

    run_dir = os.path.join(data_dir, "runs", "mixed")
    os.makedirs(run_dir)
    plan = mixed_plan()
    plan.save(os.path.join(run_dir, "plan.json"))
    kinds = sorted({d.profile_key for _, d in plan.cluster.devices()})
    for kind in kinds:
        save_step_profile(StepProfile(kind, "tiny", 64, "fp32", "none", 0.001, 0.004, 1e-9, 0.99, True, "test", 1e6,
                                      micro_batches=(4, 8, 16, 32)))
    m = {"model": "tiny", "seq": 64, "dtype": "fp32", "run_dir": run_dir,
         "ranks": [{"rank": i, "type": "cpu", "slowdown": 1.0, "micro_batch": mb, "accum_steps": n, "median_wait_s": w}
                   for i, (mb, n, w) in enumerate(((8, 3, 0.01), (2, 20, 0.04)))]}
    reasons = gap_reasons(m)
    assert not any("no measured profile" in r for r in reasons), reasons
    quota = [r for r in reasons if "CPU quota" in r]
    assert quota == ["rank 1 runs under a CPU quota of 0.333 of a core: its part of each collective is throttled "
                     "too, which the collectives' pricing (unthrottled) does not see (its median wait in "
                     "collectives: 40.0 ms per step)"]
    assert [r for r in reasons if "micro-batches per step" in r] == []  # alpha 1 ms: priced
    assert [r for r in reasons if "micro-batch of" in r] == [
        "rank 1's micro-batch of 2 is outside the sizes its profile timed (4–32): the profile's line is "
        "extrapolated there (small micro-batches pay a per-call overhead the line does not hold)"]


def test_rolling_median_and_percent_are_what_a_person_reads():
    from ui.common import fmt_cell, fmt_percent, rolling_median

    assert rolling_median([1.0, 100.0, 2.0, 3.0, None, 4.0], 3) == [1.0, 50.5, 2.0, 3.0, 2.5, 3.5]
    assert fmt_percent(-0.001, 2, signed=True) == "0.00 %" and fmt_percent(-1.234, 1, signed=True) == "-1.2 %"
    assert [fmt_cell(None), fmt_cell(True), fmt_cell(float("nan")), fmt_cell(3, lambda x: f"{x} s")] == [
        "—", "yes", "—", "3 s"]


# ---- the charts (Plotly figures) ----------------------------------------------------------


def test_the_charts_draw_the_stored_figures():
    """Each chart's figure holds the run's own numbers, with unit axis titles."""
    from ui.charts import traces_by_name
    from ui.common import rolling_median
    from ui.launch import SMOOTH_STEPS, loss_figure, memory_figure, throughput_figure, wait_figure

    m = read_metrics(fabricate_run("run-charts", 15, "done"))
    rates = [s["samples_per_s"] for s in m["steps"]]
    fig = throughput_figure(m)
    traces = traces_by_name(fig)
    assert traces["each step (measured)"]["y"] == pytest.approx(rates)
    assert traces[f"median of {SMOOTH_STEPS}"]["y"] == pytest.approx(rolling_median(rates, SMOOTH_STEPS))
    (rule,) = fig["layout"]["shapes"]
    assert (rule["name"], rule["y0"]) == ("predicted", pytest.approx(m["predicted_samples_per_s"]))
    assert fig["layout"]["yaxis"]["title"]["text"] == "throughput (samples/s)"

    loss = loss_figure(m)
    assert loss["data"][0]["y"] == pytest.approx([s["loss"] for s in m["steps"]])
    assert loss["layout"]["yaxis"]["title"]["text"] == "loss (nats/token)"

    bars = traces_by_name(memory_figure(m))
    names = [f"rank {rank['rank']}" for rank in m["ranks"]]
    assert bars["peak (measured)"]["x"] == names
    assert bars["peak (measured)"]["y"] == pytest.approx([r["peak_memory_bytes"] / 2**20 for r in m["ranks"]])
    assert bars["predicted"]["y"] == pytest.approx([r["predicted_memory_bytes"] / 2**20 for r in m["ranks"]])
    labels = bars["peak (measured)"]["text"] + bars["predicted"]["text"]
    assert set(labels) >= {"4.8", "9.5"}  # MiB over the bars: 5,000,000 B and 10**7 B

    waits = wait_figure(m)
    assert set(traces_by_name(waits)) == {"rank 0", "rank 1"}
    assert waits["layout"]["title"]["text"] == "Per-rank wait in collectives (measured)"


# ---- against the even split ---------------------------------------------------------------


def mixed_plan():
    from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
    from planner.hetero.solve import solve_plan

    fast, slow = DeviceSpec("cpu", cpu_share=1.0), DeviceSpec("cpu", cpu_share=0.333, memory_gb=2.0)
    return solve_plan(ClusterSpec("mixed", (NodeSpec("localhost", "local", (fast, slow)),)), "tiny", 48, seq=64).plan


def store_run(run_dir: str, plan, step_s: list[float], status: str | None = "done") -> str:
    """A run of `plan` as the executor writes it, with these step times (through MetricsStore)."""
    from executor.store import MetricsStore

    os.makedirs(run_dir)
    plan.save(os.path.join(run_dir, "plan.json"))
    store = MetricsStore(run_dir)
    try:
        store.init_run(plan, steps_target=len(step_s), seed=0, backend="gloo")
        for step, t in enumerate(step_s, start=1):
            for rank in range(len(plan.used)):
                store.record_rank_step(rank, step, t, 0.0, 0.01, 0.0, 1_000_000)
            store.record_step(step, 5.0 - 0.01 * step, t, plan.global_batch, plan.seq)
        if status is not None:
            store.finish(status)
    finally:
        store.close()
    return run_dir


def test_a_planned_run_and_its_even_split_are_compared_measured(data_dir):
    from planner.entry import even_plan

    plan = mixed_plan()
    planned = store_run(os.path.join(data_dir, "runs", "run-planned"), plan, [3.0, 1.0] + [0.2] * 6 + [0.21] * 4)
    at = run_page(plan, planned)
    assert at.button(key="launch_measure_even").label == "Measure the even split"
    assert not at.button(key="launch_measure_even").disabled
    assert at.number_input(key="launch_even_steps").value >= 20
    assert not [m for m in at.metric if "even split" in m.label]  # nothing measured yet

    store_run(planned + "-even", even_plan(plan), [3.0, 1.0] + [0.5] * 10)
    at = run_page(plan, planned)
    assert not at.exception, at.exception
    values = {m.label.split(" :")[0]: m.value for m in at.metric}
    assert values["Step, planned split (median)"] == "200.0 ms"  # median of steps 3..: 6 x 0.2, 4 x 0.21
    assert values["Step, even split (median)"] == "500.0 ms"
    assert values["Speedup over the even split"] == "2.50×"
    line = next(m.value for m in at.markdown if "Median step over steps 3.." in m.value)
    assert "planned split 200.0 ms (10 steps), even split 500.0 ms (10 steps)" in line and "2.50× as fast" in line
    captions = [c.value for c in at.caption]
    assert any(c.startswith("Planned split: measured median step 200.0 ms against ") for c in captions), captions
    assert any(c.startswith("Even split: measured median step 500.0 ms against ") for c in captions), captions
    assert at.button(key="launch_measure_even").label == "Measure the even split again"
    # the even run watched: the same comparison, from its side
    at = run_page(plan, planned + "-even")
    assert {m.value for m in at.metric} >= {"2.50×"}
    shown = [c.value for c in at.caption] + [w.value for w in at.warning]  # with the planned run's reasons
    assert any(t.startswith("Planned split: measured median step 200.0 ms against ") for t in shown), shown


def test_measuring_the_even_split_waits_for_the_machine(data_dir):
    plan = mixed_plan()
    planned = store_run(os.path.join(data_dir, "runs", "run-planned"), plan, [0.2] * 12)
    fabricate_run("run-live", 4, None)  # another run is live
    at = run_page(plan, planned)
    assert at.button(key="launch_measure_even").disabled
    assert any("disabled while run `run-live` is live" in c.value for c in at.caption)


def test_a_homogeneous_plan_has_nothing_to_compare(data_dir):
    done = fabricate_run("run-done", 12, "done")  # two alike CPU workers
    at = run_page(two_cpu_plan(), done)
    assert not [b for b in at.button if b.key == "launch_measure_even"]
    assert any("an even split is already what was planned" in c.value for c in at.caption)


def test_gap_reasons_name_many_micro_batches_on_a_profile_without_a_fixed_cost(data_dir):
    from planner.core.profiles import StepProfile, save_step_profile
    from ui.launch import gap_reasons

    run_dir = os.path.join(data_dir, "runs", "mixed")
    os.makedirs(run_dir)
    plan = mixed_plan()
    plan.save(os.path.join(run_dir, "plan.json"))
    for kind in sorted({d.profile_key for _, d in plan.cluster.devices()}):
        save_step_profile(StepProfile(kind, "tiny", 64, "fp32", "none", 0.0, 0.004, 1e-9, 0.99, True, "test", 1e6,
                                      micro_batches=(4, 8, 16, 32)))
    m = {"model": "tiny", "seq": 64, "dtype": "fp32", "run_dir": run_dir,
         "ranks": [{"rank": i, "type": "cpu", "slowdown": 1.0, "micro_batch": 4, "accum_steps": n}
                   for i, n in enumerate((35, 3))]}
    assert [r for r in gap_reasons(m) if "micro-batches per step" in r] == [
        "rank 0 runs 35 micro-batches per step and its profile fitted no fixed cost per micro-batch (α = 0): what "
        "the runtime does per micro-batch (its data windows, the gradient accumulation) is not priced"]


def test_collectives_measured_between_the_quota_devices_price_the_plan_and_the_page_names_what_is_left(data_dir):
    """After "Profile now" timed the collectives between the run's emulated devices (each under its
    quota), the plan prices them from that measurement, and the page says what that pricing leaves out."""
    from planner.core.profiles import CollectiveFit, CollectiveProfile, collective_set_key, save_collective_profile
    from planner.costmodel.training import CostModel
    from contracts.specs import get_model, with_max_seq
    from ui.launch import gap_reasons

    run_dir = os.path.join(data_dir, "runs", "mixed")
    os.makedirs(run_dir)
    plan = mixed_plan()
    plan.save(os.path.join(run_dir, "plan.json"))
    m = {"model": "tiny", "seq": 64, "dtype": "fp32", "run_dir": run_dir,
         "ranks": [{"rank": i, "type": "cpu", "slowdown": 1.0, "micro_batch": 8, "accum_steps": 3, "median_wait_s": w}
                   for i, w in enumerate((0.01, 0.04))]}
    assert any("collectives' pricing (unthrottled)" in r for r in gap_reasons(m))
    kinds = collective_set_key({d.profile_key for _, d in plan.cluster.devices()})
    fits = (CollectiveFit("all_reduce", 1e-3, 4e8, 0.99), CollectiveFit("all_gather", 8e-4, 6e8, 0.99))
    save_collective_profile(CollectiveProfile(kinds, "gloo", 2, fits))
    assert [r for r in gap_reasons(m) if "collective" in r] == [
        "rank 1 runs under a CPU quota of 0.333 of a core: its part of each collective is throttled too, the plan "
        "priced them as measured under the quotas (\"Profile now\"), each call timed right after computing, its "
        "quota spent: calls that follow one another in a run may wait less (its median wait in collectives: 40.0 ms "
        "per step)"]
    spec = with_max_seq(get_model("tiny"), 64)
    cost = CostModel.build(plan.cluster, spec, 64, "fp32", "none", 0.9, zero=1)
    comm = cost.comm_model([d for _, d in plan.cluster.devices()], False)
    assert comm.source == f"measured gloo collectives, 2 ranks of {kinds}, each under its CPU quota"
    assert comm.comm_s(2) > 8 * 8e-4  # every call pays the measured latency, not the cluster file's
