"""models/sharded.py with prefetch, reduce-scatters in flight and bf16 gathers, on 3 real gloo ranks.

One 3-rank job (spawned once per module) trains the `tiny` preset (GPT-2 style, tied embedding) in
several configurations from the same initial weights and saves every step's global loss:

  * fp32 zero 3, uneven fractions (0.5, 0.3, 0.2), 2 micro-batches per rank, prefetch 1 and 2
    (the latter with a reduce-scatter left in flight): against ONE rank running all 6 micro-batches
    here in the test process (LocalCollectives), relative loss difference <= 1e-5 over 5 steps;
  * param_dtype bf16 (gathers in bf16, reduce in fp32, bf16 autocast) against FSDP2 `fully_shard`
    per block and root with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the same
    weights, data, AdamW groups and clipping (testkit/fsdp2.py): <= 1e-3 per step over 10 steps;
  * reduce_dtype bf16 on top: it trains and stays within 1e-2 of the fp32 reduce;
  * comm_wait_s, the time compute waited on gloo, is reported (> 0).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from contracts.specs import PRESETS
from models.collectives import LocalCollectives, ProcessGroupCollectives
from models.optim import OptimConfig
from models.sharded import ShardedRuntime
from testkit.processes import gloo_rank, save_rank_result, spawn_ranks

WORLD = 3
SPEC = PRESETS["tiny"]
FRACTIONS = (0.5, 0.3, 0.2)
SEQ = 32
MICRO_BATCH = 2
LR = 3e-3
FP32_STEPS, BF16_STEPS = 5, 10
OPTIM = OptimConfig()  # AdamW, clipping at 1.0
CPU = torch.device("cpu")


def batches(step: int, rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s n micro-batches of `step`, (B, T) tokens and targets each: the same windows
    every other step, so the loss falls within a few steps."""
    out = []
    for j in range(n):
        g = torch.Generator().manual_seed(1_000 * (step % 2) + 10 * rank + j)
        w = torch.randint(0, SPEC.vocab_size, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


def normalizer(n: int) -> int:
    return WORLD * n * MICRO_BATCH * SEQ  # the global token count of a step


def _train(rt: ShardedRuntime, rank: int, steps: int, n: int) -> dict:
    losses, waits, by = [], [], []
    for step in range(1, steps + 1):
        r = rt.train_step(batches(step, rank, n), normalizer(n), LR)
        losses.append(r.loss)
        waits.append(r.comm_wait_s)
        by.append(r.comm_wait_by)
    rt.settle()
    return {"losses": losses, "comm_wait_s": waits, "comm_wait_by": by}


def _worker(rank: int, port: int, out_dir: str) -> None:
    from testkit.fsdp2 import Fsdp2Reference
    with gloo_rank(rank, port, WORLD):
        def runtime(**kw) -> ShardedRuntime:
            return ShardedRuntime(SPEC, zero=3, fractions=list(FRACTIONS), position=rank,
                                  comm=ProcessGroupCollectives(rank, list(range(WORLD))), device=CPU, optim=OPTIM,
                                  **kw)
        res = {
            "prefetch1": _train(runtime(prefetch=1), rank, FP32_STEPS, 2),
            "prefetch2": _train(runtime(prefetch=2, reduce_in_flight=1), rank, FP32_STEPS, 2),
        }
        bf16 = dict(param_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16, reduce_in_flight=1)
        ours = runtime(**bf16)
        fsdp = Fsdp2Reference(SPEC, ours.full_state_dict(), OPTIM, CPU, param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32, autocast_dtype=torch.bfloat16)
        res["bf16"] = _train(ours, rank, BF16_STEPS, 1)
        fsdp_losses = []
        for step in range(1, BF16_STEPS + 1):
            loss = fsdp.step(batches(step, rank, 1), normalizer(1), LR)
            dist.all_reduce(loss)
            fsdp_losses.append(float(loss))
        res["fsdp2"] = {"losses": fsdp_losses}
        res["bf16_reduce_bf16"] = _train(runtime(reduce_dtype=torch.bfloat16, **bf16), rank, BF16_STEPS, 1)
        save_rank_result(res, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("sharded_overlap"))
    return spawn_ranks(_worker, WORLD, out_dir)


def one_rank_losses(steps: int, n: int) -> list[float]:
    """The same steps on ONE rank holding everything, running every rank's micro-batches."""
    rt = ShardedRuntime(SPEC, zero=3, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU,
                        optim=OPTIM)
    return [rt.train_step([b for r in range(WORLD) for b in batches(step, r, n)], normalizer(n), LR).loss
            for step in range(1, steps + 1)]


def rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("config", ["prefetch1", "prefetch2"])
def test_fp32_zero3_with_prefetch_trains_like_one_rank(ranks, config):
    ref = one_rank_losses(FP32_STEPS, 2)
    assert ref[-1] < ref[0] - 0.01  # it trains: the comparison is not of constants
    for r in ranks:  # every rank reports the same global loss
        assert rel(r[config]["losses"], ref) <= 1e-5, (config, r[config]["losses"], ref)


def test_bf16_gathers_give_fsdp2_mixed_precision_losses(ranks):
    ours, fsdp = ranks[0]["bf16"]["losses"], ranks[0]["fsdp2"]["losses"]
    assert rel(ours, fsdp) <= 1e-3, (ours, fsdp)
    assert fsdp[-1] < fsdp[0]
    # and bf16 is really in play: the runtime is much closer to FSDP2's bf16 than to an fp32 run
    # (measured: 6e-5 against 3e-4)
    fp32 = one_rank_losses(BF16_STEPS, 1)
    assert rel(ours, fsdp) < rel(ours, fp32) / 2, (rel(ours, fsdp), rel(ours, fp32))


def test_bf16_reduce_scatter_trains_and_stays_close(ranks):
    a, b = ranks[0]["bf16_reduce_bf16"]["losses"], ranks[0]["bf16"]["losses"]
    assert a[-1] < a[0]
    assert rel(a, b) <= 1e-2, (a, b)


def test_comm_wait_is_reported(ranks):
    for r in ranks:
        for config in ("prefetch1", "prefetch2", "bf16"):
            waits = r[config]["comm_wait_s"]
            assert all(w >= 0 for w in waits) and sum(waits) > 0, (config, waits)
            # by site: gathers, reduces inside backward, the tail drained for the update; they add up
            for w, by in zip(waits, r[config]["comm_wait_by"]):
                assert set(by) == {"gather", "reduce", "tail"} and sum(by.values()) == pytest.approx(w)
            assert sum(by["gather"] for by in r[config]["comm_wait_by"]) > 0  # zero 3 gathers every unit
