import pytest

from contracts.cluster import ClusterSpec
from contracts.jobs import JobSpec
from planner.costmodel.training import resolve_param_dtype
from planner.schedule.simulate import POLICIES, ClusterState, simulate_schedule
from planner.schedule.state import checkpoint_save_s
from contracts.specs import get_model
from planner.schedule.trace import generate_trace

CLUSTER = ClusterSpec.from_dict({"name": "mix", "nodes": [
    {"name": "a0", "gpus": {"A100-80GB": 8}},
    {"name": "v0", "gpus": {"V100-32GB": 8}}, {"name": "v1", "gpus": {"V100-32GB": 8}},
    {"name": "t0", "gpus": {"T4": 8}}, {"name": "t1", "gpus": {"T4": 8}}]})
DEVICES = [d for _, d in CLUSTER.devices()]
PREEMPTIVE = ("gpumix", "srtf", "las", "gavel")  # they suspend jobs: a start may wait out a checkpoint's save


@pytest.fixture(scope="module")
def trace():
    return generate_trace(seed=3, num_jobs=120, cluster=CLUSTER, load=0.8)


@pytest.fixture(scope="module")
def results(trace):
    return {p: simulate_schedule(trace, CLUSTER, p) for p in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
def test_every_job_finishes_after_it_arrives(results, trace, policy):
    r = results[policy]
    assert r.num_failed == 0 and len(r.records) == len(trace)
    for rec in r.records:
        assert rec.status == "done"
        assert rec.job.submit_s <= rec.start_s < rec.end_s
        run_s = rec.job.steps * rec.option.iteration_s * rec.error_factor  # the prediction times the job's error
        if rec.num_restarts == 0 and policy not in PREEMPTIVE:
            assert rec.end_s - rec.start_s == pytest.approx(run_s)
        elif rec.num_restarts == 0:  # it may first wait out a preempted job's checkpoint save on its devices
            assert run_s - 1e-6 <= rec.end_s - rec.start_s <= run_s + max(checkpoint_save_s(j) for j in trace) + 1e-6
    assert r.makespan_s >= max(rec.end_s for rec in r.records) - min(j.submit_s for j in trace) - 1e-6
    assert 0 < r.gpu_utilization <= 1


@pytest.mark.parametrize("policy", POLICIES)
def test_no_device_is_double_booked(results, policy):
    by_device: dict[int, list[tuple[float, float]]] = {}
    for rec in results[policy].records:
        assert len(set(rec.devices)) == len(rec.devices) == rec.option.num_gpus
        if rec.num_restarts:
            continue  # it left its first devices when suspended (test_schedule_policies checks those runs)
        for i in rec.devices:
            assert DEVICES[i].type in {d.type for d, _ in rec.option.parts}  # of the option's type(s)
            by_device.setdefault(i, []).append((rec.start_s, rec.end_s))
    for spans in by_device.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start + 1e-9


@pytest.mark.parametrize("policy", POLICIES)
def test_every_placement_fits_in_memory(results, policy):
    memory = pytest.importorskip("planner.core.memory")
    from planner.schedule.options import option_plan

    for rec in results[policy].records:
        o = rec.option
        if o.mix:  # a mixed gang: the heterogeneous planner's plan, each device's own prediction
            plan = option_plan(rec.job, o)
            for a, i in zip(plan.assignments, rec.devices):
                assert a.type == DEVICES[i].type and a.predicted_memory_bytes <= DEVICES[i].memory_bytes
            continue
        # the options are priced as planner plan runs them: zero 3 gathers in the compute dtype (auto)
        cfg = memory.MemoryConfig(micro_batch=o.micro_batch, accum_steps=o.accum_steps, seq=rec.job.seq,
                                  dtype=o.dtype, recompute=o.recompute, dp=o.num_gpus, zero=o.zero,
                                  device_type=o.gpu_type,
                                  param_dtype=resolve_param_dtype("auto", o.zero, o.dtype, [o.gpu_type]))
        peak = memory.estimate_memory(get_model(rec.job.model), cfg).peak_bytes
        assert peak <= min(DEVICES[i].memory_bytes for i in rec.devices)


def test_fifo_serves_in_arrival_order_with_the_users_request(results):
    recs = sorted(results["fifo"].records, key=lambda r: (r.job.submit_s, r.job.job_id))
    starts = [r.start_s for r in recs]
    assert starts == sorted(starts)  # head-of-line: nobody overtakes
    for r in recs:
        assert r.option.gpu_type == r.job.requested_type
        if r.request_adjusted:
            assert r.option.num_gpus > r.job.requested_gpus  # it OOMed at the requested count
        else:
            assert r.option.num_gpus == r.job.requested_gpus


def test_frenzy_beats_fifo_on_average_jct(results):
    assert results["frenzy"].avg_jct_s < 0.82 * results["fifo"].avg_jct_s


def test_cluster_state_refuses_double_booking():
    state = ClusterState(CLUSTER)
    pool = next(p for p in state.pools if p.device.type == "T4")
    devs = state.pick(pool, 4)
    assert len({state._node_of[i] for i in devs}) == 1  # fits on one node: kept on one node
    state.assign("a", devs)
    with pytest.raises(RuntimeError, match="double booking"):
        state.assign("b", devs[:1])
    assert state.free_count(pool) == 12
    assert state.release("a") == devs and state.free_count(pool) == 16


def test_unfittable_job_fails_cleanly():
    cluster = ClusterSpec.from_dict({"nodes": [{"name": "n", "gpus": {"T4": 1}}]})
    r = simulate_schedule([JobSpec("x", "llama2-13b", 8, 4096, 10, 0.0), JobSpec("y", "gpt2", 8, 512, 10, 1.0)],
                          cluster, "frenzy")
    assert [x.status for x in r.records] == ["failed", "done"]
    assert "memory" in r.records[0].reason


def test_bad_policy_and_empty_trace():
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_schedule([JobSpec("x", "gpt2", 8, 512, 10, 0.0)], CLUSTER, "lottery")
    with pytest.raises(ValueError, match="no jobs"):
        simulate_schedule([], CLUSTER, "fifo")


@pytest.mark.parametrize("policy", POLICIES)
def test_cli_schedule_json_keeps_the_design_keys_for_every_policy(tmp_path, capsys, policy):
    import json

    from planner.schedule.trace import save_trace

    cluster_path, trace_path = str(tmp_path / "c.json"), str(tmp_path / "t.csv")
    CLUSTER.save(cluster_path)
    save_trace(generate_trace(5, 30, CLUSTER), trace_path)
    assert _main(["schedule", "--cluster", cluster_path, "--trace", trace_path, "--policy", policy,
                  "--error-seed", "2", "--json"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    for key in ("avg_jct_s", "p99_jct_s", "makespan_s", "gpu_utilization", "scheduling_overhead_ms_per_job"):
        assert out[key] >= 0
    assert len(out["jobs"]) == 30 and out["policy"] == policy and out["error_seed"] == 2
    for row in out["jobs"]:
        for key in ("job_id", "model", "status", "submit_s", "start_s", "end_s", "jct_s"):
            assert key in row
        for key in ("num_gpus", "zero", "micro_batch", "accum_steps", "dtype"):
            assert key in row["option"]
        placements = [row["option"]] + ([row["final_option"]] if "final_option" in row else [])
        for o in placements:  # a mixed gang names its parts, one pool option its type
            if "pools" in o:
                assert len(o["pools"]) >= 2 and sum(p["num_gpus"] for p in o["pools"]) == o["num_gpus"]
                assert {"gpu_type", "num_gpus"} <= set(o["pools"][0]) and "gpu_type" not in o
            else:
                assert "gpu_type" in o
        assert row["mixed_gang"] == any("pools" in o for o in placements)  # first or final placement
    assert out["num_mixed_gang_jobs"] == sum(row["mixed_gang"] for row in out["jobs"])


def test_cli_schedule_bad_trace(tmp_path, capsys):
    from planner.schedule.trace import save_trace

    cluster_path, trace_path = str(tmp_path / "c.json"), str(tmp_path / "t.csv")
    CLUSTER.save(cluster_path)
    save_trace(generate_trace(5, 30, CLUSTER), trace_path)
    with open(trace_path, "a") as fh:
        fh.write("zz,1,gpt2,8,128,ten,,\n")
    assert _main(["schedule", "--cluster", cluster_path, "--trace", trace_path]) == 2
    assert "column 'steps'" in capsys.readouterr().err


def _main(argv):
    from planner.__main__ import COMMANDS
    from contracts.cli import main

    return main("python -m planner", COMMANDS, argv)


def test_cli_schedule_json_is_strict_with_null_when_every_job_fails(tmp_path, capsys):
    """With no job done the mean and p99 JCT are undefined; the JSON says null, not NaN."""
    import json

    cluster_path, trace_path = str(tmp_path / "c.json"), str(tmp_path / "t.csv")
    ClusterSpec.from_dict({"name": "one-t4", "nodes": [{"name": "n", "gpus": {"T4": 1}}]}).save(cluster_path)
    with open(trace_path, "w") as fh:
        fh.write("job_id,submit_s,model,global_batch,seq,steps,requested_type,requested_gpus\n"
                 "a,0,llama2-13b,8,4096,10,,\nb,1,llama2-13b,16,4096,10,,\n")
    assert _main(["schedule", "--cluster", cluster_path, "--trace", trace_path, "--json"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    out = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert out["num_failed"] == 2 and {j["status"] for j in out["jobs"]} == {"failed"}
    assert out["avg_jct_s"] is None and out["p99_jct_s"] is None


@pytest.mark.parametrize("argv, flag", [
    (["--generate", "1", "--num-jobs", "0"], "--num-jobs"),
    (["--generate", "1", "--num-jobs", "1000000000"], "--num-jobs"),
    (["--generate", "1", "--load", "nan"], "--load"),
    (["--generate", "1", "--load", "-1"], "--load"),
    (["--generate", "-3"], "--generate"),
    (["--generate", "1", "--error-sigma", "nan"], "--error-sigma"),
    (["--generate", "1", "--error-sigma", "5"], "--error-sigma"),
])
def test_cli_schedule_refuses_bad_numbers_with_one_line(tmp_path, capsys, argv, flag):
    cluster_path = str(tmp_path / "c.json")
    CLUSTER.save(cluster_path)
    with pytest.raises(SystemExit) as e:
        _main(["schedule", "--cluster", cluster_path, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and len(err.strip().splitlines()) == 1


def test_trace_cells_past_their_limits_and_huge_files_are_refused(tmp_path, capsys):
    from planner.schedule.trace import parse_trace_csv

    head = "job_id,submit_s,model,global_batch,seq,steps,requested_type,requested_gpus\n"
    with pytest.raises(ValueError, match="global_batch.*over the limit"):
        parse_trace_csv(head + "a,0,gpt2,10000000000,128,10,,\n")
    with pytest.raises(ValueError, match="submit_s"):
        parse_trace_csv(head + "a,1e300,gpt2,8,128,10,,\n")
    with pytest.raises(ValueError, match="malformed CSV"):
        parse_trace_csv(head + "a,0,gpt2,8,128,10,," + "x" * 200_000 + "\n")
    cluster_path, big = str(tmp_path / "c.json"), tmp_path / "big.json"
    CLUSTER.save(cluster_path)
    with open(big, "wb") as fh:  # sparse: 200 MB on paper, nothing on disk; must be refused unread
        fh.truncate(200 * 2**20)
    assert _main(["schedule", "--cluster", str(big), "--generate", "1"]) == 2
    assert "over the limit" in capsys.readouterr().err
    big_csv = tmp_path / "big.csv"
    with open(big_csv, "wb") as fh:
        fh.truncate(200 * 2**20)
    assert _main(["schedule", "--cluster", cluster_path, "--trace", str(big_csv)]) == 2
    assert "over the limit" in capsys.readouterr().err


def test_fragmented_free_devices_are_those_no_pool_alone_holds_for_a_waiting_job():
    from dataclasses import dataclass

    from planner.schedule.simulate import fragmented

    @dataclass(frozen=True)
    class Opt:  # what `fragmented` reads of an option
        pool: str
        num_gpus: int
        mix: tuple = ()

    job = JobSpec("j", "tiny", 8, 32, 1, 0.0)
    four_a = lambda j: [Opt("A", 4)]  # noqa: E731 - the job's one option: 4 devices of pool A
    assert fragmented({"A": 2, "B": 2}, [job], four_a)  # 4 free, none of the pools holds 4
    assert not fragmented({"A": 4, "B": 0}, [job], four_a)  # it fits: nothing to mix
    assert not fragmented({"A": 1, "B": 2}, [job], four_a)  # 3 free: no gang of 4 either
    assert not fragmented({"A": 2, "B": 2}, [], four_a)  # nobody waits
    both = lambda j: [Opt("A", 4), Opt("B", 2)]  # noqa: E731
    assert not fragmented({"A": 2, "B": 2}, [job], both)  # its option on B fits now
    gang_only = lambda j: [Opt("A", 4, mix=(("A", 2), ("B", 2)))]  # noqa: E731
    assert not fragmented({"A": 2, "B": 2}, [job], gang_only)  # only one-pool options count


def test_a_gang_that_rebalances_runs_at_its_parts_summed_rates():
    from dataclasses import dataclass

    from contracts.cluster import DeviceSpec
    from planner.schedule.simulate import gang_factor

    @dataclass(frozen=True)
    class Gang:  # what `gang_factor` reads of an option
        parts: tuple
        per_device: tuple

    a, b = DeviceSpec("A100-80GB"), DeviceSpec("V100-32GB")
    gang = Gang(((a, 1), (b, 1)), ((3, 1, 0.7), (1, 1, 0.3)))  # batches 3 and 1: shares 3/4, 1/4
    far = {"A100-80GB": 1.0, "V100-32GB": 2.0}.get
    assert gang_factor(lambda j, t: far(t), "j", gang) == 2.0  # the planned split: the slowest sets the pace
    # re-split by the measured rates: 1 / (3/4 / 1 + 1/4 / 2) = 8/7
    assert gang_factor(lambda j, t: far(t), "j", gang, rebalance=True) == pytest.approx(8 / 7)
    near = {"A100-80GB": 1.0, "V100-32GB": 1.2}.get  # within the rebalancer's threshold: no re-split
    assert gang_factor(lambda j, t: near(t), "j", gang, rebalance=True) == 1.2
