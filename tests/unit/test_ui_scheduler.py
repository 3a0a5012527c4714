"""The Scheduler page on its own (AppTest): submit, a scheduler pass, the simulation.

The simulation runs in a background process (ui/background.py): `settle` reruns the page, as
its polling fragment does in a browser, until the answer is in."""
import os

from streamlit.testing.v1 import AppTest

from executor.queue import JobQueue
from testkit.apptest import settle as settle_until
from ui.charts import drawn_figures

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ui", "scheduler.py")


PENDING = "Simulating every policy"


def settle(at: AppTest) -> AppTest:
    return settle_until(at, lambda a: any(PENDING in i.value for i in a.info))


def _page():
    at = AppTest.from_file(PAGE, default_timeout=120)
    at.run()
    assert not at.exception
    return at


def test_submit_and_a_scheduler_pass_that_fails_an_unfittable_job():
    at = _page()
    at.selectbox(key="sched_model").set_value("llama2-13b")  # 13B never fits a CPU worker: no real launch
    at.number_input(key="sched_global_batch").set_value(4)
    at.number_input(key="sched_steps").set_value(2)
    at.button(key="sched_submit").click().run()
    assert not at.exception and not at.error
    [job] = JobQueue().list()
    assert (job.model, job.global_batch, job.steps, job.state) == ("llama2-13b", 4, 2, "queued")
    at.button(key="sched_tick").click().run()
    assert not at.exception
    assert JobQueue().get(job.id).state == "failed"
    assert any("fit" in str(row) for row in at.table[0].value.to_dict("records"))  # the queue: one job, static


def test_bad_submission_shows_an_error_not_a_traceback(monkeypatch):
    at = _page()
    monkeypatch.setattr(JobQueue, "submit", lambda *a, **k: (_ for _ in ()).throw(ValueError("unknown model 'x'")))
    at.button(key="sched_submit").click().run()
    assert not at.exception
    assert any("unknown model" in e.value for e in at.error)


def test_simulation_compares_gpumix_with_every_baseline():
    at = _page()
    at.number_input(key="sched_trace_seed").set_value(4)
    at.selectbox(key="sched_num_gpus").set_value(64)
    at.number_input(key="sched_num_jobs").set_value(60)
    at.button(key="sched_simulate").click().run()
    settle(at)
    assert not at.error
    table = at.dataframe[-1].value  # the simulation table (the queue is empty)
    assert list(table["policy"]) == ["gpumix", "srtf", "las", "gavel", "sjf", "fifo-backfill-sized", "frenzy",
                                     "fifo-backfill", "fifo"]
    assert (table["avg JCT (h, predicted)"] > 0).all() and (table["failed jobs"] == 0).all()
    jct = dict(zip(table["policy"], table["avg JCT (h, predicted)"]))
    strongest = min((p for p in jct if p != "gpumix"), key=jct.get)
    labels = " ".join(m.label for m in at.metric)
    assert "predicted" in labels and "measured" in labels
    assert f"vs {strongest} (strongest baseline)" in labels  # the comparison is against the strongest, named
    # the Gantt of the chosen policy (gpumix): bars from start to end (x, x2), a row per device
    fig = drawn_figures(at)[-1]
    (bars,) = fig["data"]  # one trace, a colour per job
    assert (bars["type"], bars["orientation"]) == ("bar", "h")
    assert fig["layout"]["xaxis"]["title"]["text"] == "time (h)" and fig["layout"]["yaxis"]["title"]["text"] == "device"
    assert bars["base"] and all(w >= 0 for w in bars["x"]) and all(s >= 0 for s in bars["base"])
    from ui.scheduler import MIXED_MARK

    jobs = {job for job, _, _ in bars["customdata"]}
    assert {j.removesuffix(f" {MIXED_MARK}") for j in jobs} <= {f"j{j:05d}" for j in range(60)}  # the trace's 60 jobs
    # the jobs gpumix ran on mixed-type gangs: counted in the table and the card, marked in the Gantt
    mixed = dict(zip(table["policy"], table["jobs on mixed gangs"]))["gpumix"]
    assert sum(j.endswith(MIXED_MARK) for j in jobs) == mixed
    assert f"{mixed} of 60" in " ".join(str(m.value) for m in at.metric)


def test_cancel_stops_the_simulation(monkeypatch):
    from ui import background

    at = _page()
    monkeypatch.setattr(background, "FIRST_WAIT_S", 0.0)  # answer Pending at once, however fast the call
    at.button(key="sched_simulate").click().run()
    assert any(PENDING in i.value for i in at.info)  # in flight, with a Cancel button
    [job] = [j for (_, name), j in background._jobs.items() if name == "schedule-simulation"]
    at.button(key="sched_sim_cancel").click().run()
    assert not at.exception and "sched_result" not in at.session_state
    assert job.cancel_reason == "by the user" and job.proc.returncode is not None
    assert not any(PENDING in i.value for i in at.info)
