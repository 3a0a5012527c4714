"""Pipeline-parallel runs through executor.launch.launch_run (torchrun, gloo, 1 thread per rank): 2 stages
of 3 and 1 layers of `small`, 4 micro-batches, data parallel 2 inside one stage (uneven rows and shard
fractions), are the same training as 1 rank: steps 1-2 1F1B on DP 2 -> 1, then resumed from their
checkpoint for steps 3-4 GPipe on DP 1 -> 2 with BubbleTea's prefill on stage 1 (two launches and the
1-rank reference: a launch is mostly torch's start-up, so each one checks as much as it can); the last
step's timeline holds every op of every micro-batch, each receive posted one op ahead, prefill only
inside receive waits; the schedules' orders and in-flight counts by hand."""
import json
import os

import pytest
import torch

from executor import checkpoint as ckpt
from executor.launch import launch_run
from executor.store import read_metrics
from models.collectives import LocalCollectives
from models.optim import OptimConfig
from models.pipeline import schedule_ops
from models.sharded import ShardedRuntime
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.paths import ENV_DATA_DIR
from contracts.plan import Assignment, PipelineSpec, PipelineStage, Plan
from contracts.specs import get_model, with_max_seq

SEQ = 64
SEED = 3
STEPS = 4
HALF = 2  # steps 1-2 on the first layout, 3-4 resumed on the second
M = 4  # micro-batches per step
MB = 3  # samples per micro-batch
OPTIM = OptimConfig(lr=1e-3, warmup_steps=1, max_grad_norm=0.5, decay_steps=STEPS)


def plan_of(stages: list[tuple[int, list[int], list[float]]], schedule: str = "1f1b", model: str = "small",
            micro_batch: int = MB, num_microbatches: int = M, seq: int = SEQ, recompute: str = "none") -> Plan:
    """A local CPU plan; one (num_layers, rows per device, shard fractions) per stage. A single stage of
    one device with pipeline=None when `schedule` is None (the 1-rank reference)."""
    n = sum(len(r) for _, r, _ in stages)
    cluster = ClusterSpec("test", (NodeSpec("localhost", "local", tuple([DeviceSpec("cpu")] * n)),))
    asg, pstages, d, first = [], [], 0, 0
    for layers, rows, fracs in stages:
        devs = []
        for r, f in zip(rows, fracs):
            k = num_microbatches
            asg.append(Assignment(d, "localhost", "cpu", r, k, r * k, f, 0, 0.0))
            devs.append(d)
            d += 1
        pstages.append(PipelineStage(first, layers, tuple(devs), tuple(rows), "local"))
        first += layers
    pipe = None if schedule is None else PipelineSpec(schedule, micro_batch, num_microbatches, tuple(pstages))
    return Plan(cluster, model, micro_batch * num_microbatches, seq, "fp32", recompute, tuple(asg), 0.0, 0.0,
                pipeline=pipe)


PREFILL = {"model": "tiny", "prompt_tokens": 32, "backlog": True, "stages": [1], "max_chunk_s": 0.002}
ONE = [(4, [MB], [1.0])]
DP2_THEN_1 = [(3, [2, 1], [0.6, 0.4]), (1, [MB], [1.0])]
DP1_THEN_2 = [(3, [MB], [1.0]), (1, [1, 2], [0.3, 0.7])]


def losses(run_dir: str) -> list[float]:
    return [s["loss"] for s in read_metrics(run_dir)["steps"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_DATA_DIR, str(tmp_path_factory.mktemp("data")))
        root = tmp_path_factory.mktemp("runs")
        d1, d = str(root / "one"), str(root / "pipe")
        one = launch_run(plan_of(ONE, None), STEPS, d1, seed=SEED, optim=OPTIM, checkpoint_every=STEPS)
        st = launch_run(plan_of(DP2_THEN_1, "1f1b"), HALF, d, seed=SEED, optim=OPTIM, checkpoint_every=HALF)
        if st == "done":  # stage 1's 2 ranks wait for stage 0's forwards: prefill runs in those waits
            st = launch_run(plan_of(DP1_THEN_2, "gpipe"), STEPS, d, seed=SEED, optim=OPTIM, checkpoint_every=STEPS,
                            resume=True, prefill=PREFILL)
        yield {"one": (d1, one), "pipe": (d, st)}


def test_pipeline_trains_exactly_like_one_rank(runs):
    """Steps 1-2: 1F1B, DP 2 -> 1; steps 3-4: GPipe, DP 1 -> 2, prefill on stage 1 (the prefill model
    draws its weights under its own RNG), resumed from step 2's checkpoint on the other layout."""
    (d1, st1), (d, st) = runs["one"], runs["pipe"]
    assert st1 == st == "done", read_metrics(d)["reason"]
    one, pipe = losses(d1), losses(d)
    assert len(one) == len(pipe) == STEPS
    assert one[-1] < one[0]  # it learns
    rel = [abs(a - b) / abs(a) for a, b in zip(one, pipe)]
    print(f"1-rank {one} pipeline {pipe} relative difference 1F1B DP 2->1 {max(rel[:HALF]):.2e}, "
          f"GPipe DP 1->2 {max(rel[HALF:]):.2e}")
    assert max(rel) <= 1e-5, (one, pipe)
    m, m1 = read_metrics(d), read_metrics(d1)
    assert m["world_size"] == 3
    assert m["steps"][-1]["val_loss"] == pytest.approx(m1["steps"][-1]["val_loss"], rel=1e-5)


def final_params(run_dir: str) -> dict[str, torch.Tensor]:
    """The newest checkpoint's parameters, read back through a 1-rank data-parallel runtime."""
    rt = ShardedRuntime(with_max_seq(get_model("small"), SEQ), zero=1, fractions=[1.0], position=0,
                        comm=LocalCollectives(0, 1), device=torch.device("cpu"), materialize=False)
    ckpt.load(run_dir, rt, 0)
    return rt.full_state_dict()


def test_a_pipeline_checkpoint_resumes_on_another_layout_and_is_a_data_parallel_checkpoint(runs):
    """Step 2's 1F1B DP 2 -> 1 checkpoint resumed on GPipe DP 1 -> 2 (the loss test above holds for all
    four steps); its step-4 checkpoint, read by a data-parallel runtime, is the 1-rank run's weights."""
    (d1, _), (d, st) = runs["one"], runs["pipe"]
    assert st == "done"
    assert "resume" in [e["kind"] for e in read_metrics(d)["events"]]
    p1, pp = final_params(d1), final_params(d)
    rt = ShardedRuntime(with_max_seq(get_model("small"), SEQ), zero=1, fractions=[1.0], position=0,
                        comm=LocalCollectives(0, 1), device=torch.device("cpu"), seed=SEED)
    init = rt.full_state_dict()
    moved = max((p1[k] - init[k]).abs().max().item() for k in p1)
    diff = max((p1[k] - pp[k]).abs().max().item() for k in p1)
    print(f"weights moved {moved:.2e}, pipeline vs 1 rank {diff:.2e}")
    assert moved > 1e-3 and diff <= 0.01 * moved


def test_timeline_has_every_op_of_every_micro_batch_and_prefill_only_in_receive_waits(runs):
    """The last step's timeline (GPipe, DP 1 -> 2, prefill on stage 1)."""
    d, st = runs["pipe"]
    assert st == "done", read_metrics(d)["reason"]
    tl = json.load(open(os.path.join(d, "timeline.json")))
    assert tl["step"] == STEPS and len(tl["ranks"]) == 3
    for r in tl["ranks"]:
        ops = r["ops"]
        assert all(0 <= o["start_s"] <= o["end_s"] for o in ops)
        kinds = {"forward", "backward"} | ({"recv_fwd", "send_bwd"} if r["stage"] == 1 else {"send_fwd", "recv_bwd"})
        for kind in kinds:
            assert sorted(o["mb"] for o in ops if o["op"] == kind) == list(range(M)), (r["rank"], kind)
        assert [o["op"] for o in ops if o["mb"] == -1] == ["grad_sync", "optimizer"]
        # the forward of micro-batch k ends before its backward starts
        f = {o["mb"]: o for o in ops if o["op"] == "forward"}
        assert all(o["start_s"] >= f[o["mb"]]["end_s"] for o in ops if o["op"] == "backward")
        # receives are posted one op ahead: op i+1's receive starts before op i's compute does
        comp = {(o["op"][0].upper(), o["mb"]): o for o in ops if o["op"] in ("forward", "backward")}
        recv = {("F" if o["op"] == "recv_fwd" else "B", o["mb"]): o for o in ops if o["op"].startswith("recv")}
        order = schedule_ops("gpipe", 2, r["stage"], M)
        ahead = [(a, b) for a, b in zip(order, order[1:]) if b in recv]
        assert ahead and all(recv[b]["start_s"] <= comp[a]["start_s"] for a, b in ahead), r["rank"]

    stage1 = next(r for r in tl["ranks"] if r["stage"] == 1)
    fills = [o for o in stage1["ops"] if o["op"] == "prefill"]
    summary_path = os.path.join(d, f"prefill_rank{stage1['rank']}.json")
    assert os.path.exists(summary_path)
    if not fills:
        # the worker starts a unit only where it fits the wait's forecast from earlier steps
        # (executor/prefill.py): waits shorter than a unit get none, and it counts what it skipped
        with open(summary_path, encoding="utf-8") as fh:
            skipped = json.load(fh)["units_skipped_for_forecast"]
        assert skipped > 0, "stage 1 waits for stage 0's forwards: prefill must run in those waits or skip by forecast"
        return
    recvs = [o for o in stage1["ops"] if o["op"].startswith("recv")]
    for f in fills:  # each piece starts inside a receive of the same micro-batch, never after it completed
        assert any(r["mb"] == f["mb"] and r["start_s"] <= f["start_s"] <= r["end_s"] for r in recvs), f
    # the training op after a receive waits for one piece at most: the last piece's overrun
    overrun = [max(f["end_s"] for f in fills if f["mb"] == r["mb"] and r["start_s"] <= f["start_s"] <= r["end_s"])
               - r["end_s"] for r in recvs if any(f["mb"] == r["mb"] and r["start_s"] <= f["start_s"] <= r["end_s"]
                                                  for f in fills)]
    pieces = sorted(f["end_s"] - f["start_s"] for f in fills)
    print(f"prefill: {len(fills)} pieces, median {pieces[len(pieces) // 2] * 1e3:.2f} ms, overrun past the receive "
          f"max {max(overrun) * 1e3:.2f} ms")
    assert max(overrun) <= max(pieces) + 1e-3
    assert not any(o["op"] == "prefill" for r in tl["ranks"] if r["stage"] == 0 for o in r["ops"])
    assert os.path.exists(os.path.join(d, f"prefill_rank{stage1['rank']}.json"))


