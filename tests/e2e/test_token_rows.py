"""The embedding unit's gradient sent as the step's rows (models/sharded.py `set_batch_split`,
contracts.wire.token_rows_exchange) on 3 real gloo ranks with uneven shards and uneven batches (one
rank without samples): the same losses as ONE rank running every micro-batch (relative <= 1e-5 over
4 steps, fp32), for a tied GPT-2 style model with learned positions and an untied Llama style one,
at zero 3 (prefetch, a reduce left in flight) and zero 2; the ranks' TCP payload of a step against
contracts.wire's bytes for the collectives it issues."""
from __future__ import annotations


import pytest
import torch

from contracts import wire
from contracts.specs import PRESETS
from contracts.units import runtime_units
from models.collectives import LocalCollectives, ProcessGroupCollectives
from models.optim import OptimConfig
from models.sharded import ShardedRuntime
from testkit.processes import gloo_rank, save_rank_result, spawn_ranks

WORLD = 3
FRACTIONS = (0.5, 0.3, 0.2)
MICRO_BATCHES = (2, 1, 0)  # per rank; a rank without samples runs the same collectives
MICRO_BATCH, SEQ, STEPS, LR = 2, 32, 4, 3e-3
CPU = torch.device("cpu")
CASES = {  # id -> (preset, ShardedRuntime options)
    "tiny_zero3": ("tiny", dict(zero=3, prefetch=1, reduce_in_flight=1)),
    "tiny_llama_zero3": ("tiny-llama", dict(zero=3, prefetch=2)),
    "tiny_llama_zero2": ("tiny-llama", dict(zero=2, reduce_in_flight=1)),
}


def batches(name: str, step: int, rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for j in range(n):
        g = torch.Generator().manual_seed(1_000 * (step % 2) + 10 * rank + j)  # the same windows every other step
        w = torch.randint(0, PRESETS[name].vocab_size, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out


NORMALIZER = sum(MICRO_BATCHES) * MICRO_BATCH * SEQ


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, port, WORLD):
        res = {}
        for case, (name, kw) in CASES.items():
            rt = ShardedRuntime(PRESETS[name], fractions=list(FRACTIONS), position=rank,
                                comm=ProcessGroupCollectives(rank, list(range(WORLD))), device=CPU,
                                optim=OptimConfig(), **kw)
            rt.set_batch_split([n * MICRO_BATCH for n in MICRO_BATCHES], SEQ)
            res[case] = {"rows": rt._rows_exchange(), "losses": [
                rt.train_step(batches(name, s, rank, MICRO_BATCHES[rank]), NORMALIZER, LR).loss
                for s in range(1, STEPS + 1)]}
            rt.settle()
        save_rank_result(res, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("token_rows"))
    return spawn_ranks(_worker, WORLD, out_dir)


def one_rank_losses(name: str, zero: int) -> list[float]:
    rt = ShardedRuntime(PRESETS[name], zero=zero, fractions=[1.0], position=0, comm=LocalCollectives(0, 1),
                        device=CPU, optim=OptimConfig())
    out = []
    for s in range(1, STEPS + 1):
        every = [b for r in range(WORLD) for b in batches(name, s, r, MICRO_BATCHES[r])]
        out.append(rt.train_step(every, NORMALIZER, LR).loss)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_rows_exchange_matches_one_rank(ranks, case):
    name, kw = CASES[case]
    assert all(r[case]["rows"] for r in ranks), "the rule should pick rows for this step"
    ref = one_rank_losses(name, kw["zero"])
    for r in ranks:
        got = r[case]["losses"]
        assert len(got) == STEPS
        for a, b in zip(got, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (case, got, ref)
    assert ref[2] < ref[0] and ref[3] < ref[1]  # it trains on the windows it saw two steps before


def test_rule_and_bytes():
    spec = PRESETS["tiny"]
    table = runtime_units(spec)[0].numel
    tokens = NORMALIZER
    assert wire.token_rows_exchange(tokens, table, spec.hidden, 4, WORLD)
    assert not wire.token_rows_exchange(tokens, table, spec.hidden, 4, 1)  # one rank: nothing to send
    assert not wire.token_rows_exchange(100 * tokens, table, spec.hidden, 4, WORLD)  # more rows than the table
    sizes = [n * MICRO_BATCH * SEQ for n in MICRO_BATCHES]
    sent = wire.token_rows_send_bytes(sizes, spec.hidden, 4, WORLD, "gloo")
    # each rank's piece reaches the two others; the empty piece sends nothing of its own
    assert sum(sent) > 2 * tokens * (spec.hidden * 4 + 8) * 0.99
    assert sent[2] < sent[0]
