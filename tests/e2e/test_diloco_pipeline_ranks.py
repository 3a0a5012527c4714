"""models/diloco.py over models/pipeline.py on 4 real gloo ranks: two groups, each a 2-stage pipeline of
`tiny` (ranks 0 -> 1 and 2 -> 3; 1 layer per stage, 2 micro-batches of 2 rows), whose tied embedding
has a copy on both stages. After H = 2 inner AdamW steps and at the end (sync_all):

  * int8 deltas with Nesterov momentum: every copy of the embedding (2 stages x 2 groups) and each
    stage's other units agree across the groups exactly; the embedding's exchange (its 4 copies, each
    half a delta, so levels of 127 // 4) and the stage's own units' are separate payloads;
  * bf16 deltas whose exchange overlaps the next inner step: the same agreement at the end.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from contracts.plan import DilocoSpec, PipelineSpec, PipelineStage
from contracts.specs import PRESETS
from contracts.units import runtime_units
from models.collectives import ProcessGroupCollectives
from models.diloco import DilocoRuntime
from models.optim import OptimConfig
from models.pipeline import PipelineRuntime, build_pipeline_groups
from testkit.processes import gloo_rank, save_rank_result, spawn_ranks

WORLD = 4
SPEC = PRESETS["tiny"]
SEQ, M, ROWS = 16, 2, 2
PIPELINES = ((0, 1), (2, 3))  # each group's ranks by stage
ADAMW = OptimConfig(lr=3e-3, max_grad_norm=1.0)
STEPS = 5
CPU = torch.device("cpu")
SUB = PipelineSpec("1f1b", ROWS, M, (PipelineStage(0, 1, (0,), (ROWS,)), PipelineStage(1, 1, (1,), (ROWS,))))


def batches(step: int, group: int, stage: int) -> list:
    """The group's micro-batches of `step`: tokens on stage 0, targets on stage 1."""
    g = torch.Generator().manual_seed(1_000 * (step % 2) + 10 * group)
    w = torch.randint(0, SPEC.vocab_size, (M, ROWS, SEQ + 1), generator=g)
    return [(w[k, :, :-1].contiguous() if stage == 0 else None, w[k, :, 1:].contiguous() if stage == 1 else None)
            for k in range(M)]


def collectives(pg) -> ProcessGroupCollectives:
    return ProcessGroupCollectives(dist.get_rank(pg), list(range(dist.get_world_size(pg))), group=pg)


def run(rank: int, spec: DilocoSpec) -> dict:
    """This rank's stage of its group's pipeline under DiLoCo for STEPS steps and sync_all: its losses,
    the syncs (step, payload bytes) and its units' parameters at the end."""
    groups = [build_pipeline_groups(SPEC, [[r] for r in ranks], own_world=True) for ranks in PIPELINES]
    stage_pgs = [dist.new_group(sorted(p[s] for p in PIPELINES)) for s in range(2)]
    tied_pg = dist.new_group(list(range(WORLD)))  # both stages of both groups hold the embedding
    g, s = divmod(rank, 2)
    inner = PipelineRuntime(SPEC, SUB, stage=s, dp_index=0, stage_ranks=[[r] for r in PIPELINES[g]],
                            fractions=[1.0], device=CPU, seq=SEQ, optim=ADAMW, groups=groups[g])
    rt = DilocoRuntime(inner, spec, group=g, weight=0.5, outer=collectives(stage_pgs[s]), tied=collectives(tied_pg))
    losses, syncs = [], []
    for step in range(1, STEPS + 1):
        losses.append(rt.train_step(batches(step, g, s), M * ROWS * SEQ, ADAMW.lr).loss)
        syncs += [(o.step, o.payload_bytes) for o in rt.syncs]
    syncs += [(o.step, o.payload_bytes) for o in rt.sync_all()]
    rt.settle()
    return {"losses": losses, "syncs": syncs, "params": {u.index: u.master.clone() for u in rt.units}}


def _worker(rank: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, port, WORLD):
        groups = (("a",), ("b",))
        res = {"int8": run(rank, DilocoSpec(groups, 2, compress="int8")),
               "overlap": run(rank, DilocoSpec(groups, 2, compress="bf16", overlap=True))}
        save_rank_result(res, out_dir, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("diloco_pipeline")))


@pytest.mark.parametrize("case", ["int8", "overlap"])
def test_every_copy_agrees_after_the_last_outer_step(ranks, case):
    by_rank = [r[case]["params"] for r in ranks]
    assert sorted(by_rank[0]) == [0, 1] and sorted(by_rank[1]) == [0, 2, 3]  # stage 1: the tied copy too
    embed = [p[0] for p in by_rank]
    assert all(torch.equal(e, embed[0]) for e in embed)
    for s in (0, 1):  # stage s of group 0 (rank s) and of group 1 (rank 2 + s)
        a, b = by_rank[s], by_rank[2 + s]
        assert all(torch.equal(a[i], b[i]) for i in a)
    # the two groups trained different samples: their own losses differ, so agreement is the outer step's
    assert ranks[1][case]["losses"][0] != ranks[3][case]["losses"][0]


def test_int8_exchange_payloads_and_steps(ranks):
    numels = [u.numel for u in runtime_units(SPEC)]
    # stage 0: block 0 (+ its scale) and the embedding (+ its scale); stage 1: block 1 and the head, and
    # its embedding copy; an outer step after steps 2 and 4, and the last one (step 5) from sync_all
    want = {0: numels[1] + 4 + numels[0] + 4, 1: numels[2] + numels[3] + 4 + numels[0] + 4}
    for rank in range(WORLD):
        syncs = ranks[rank]["int8"]["syncs"]
        assert [s for s, _ in syncs] == [2, 4, 5], syncs
        assert all(b == want[rank % 2] for _, b in syncs), (syncs, want)
    losses = ranks[1]["int8"]["losses"]
    assert losses[-1] < losses[0], losses
