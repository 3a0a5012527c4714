"""Tensor parallelism without processes (models/tensor.py; the gloo runs: tests/e2e/test_tensor_parallel_runs.py):

  * the TP layout: every rank's units hold what tp_unit_numels (and planner/core/memory.tp_units, its
    rank 0) say, split parameters ÷ t and replicated ones whole, for GPT-2, Llama with GQA and Qwen2
    (q/k/v biases, tied head), an uneven vocabulary split (GPT-2's 50257 rows);
  * the weights: every TP rank's parameters are the one-rank runtime's, cut (rows, columns, vocabulary
    rows) or whole;
  * refusals: zero 2/3 with tp, heads or ffn not divisible by t;
  * the memory model: tp 2 at zero 1 is the runtime's exact model (its moments, the TP state sizes, the
    vocabulary-parallel loss), not the analytic shortcut; a stage's TP ranks hold less;
  * the cost model: Megatron's all-reduces per block, priced by the ring all-reduce.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from contracts.specs import PRESETS, with_max_seq
from models.collectives import LocalCollectives
from models.decoder import build_model
from models.sharded import ShardedRuntime
from models.tensor import (TensorParallel, apply_tp, check_tp, split_flags, tp_unit_numels,
                           vocab_bounds)
from models.tensor_runtime import TensorParallelRuntime
from planner.core.memory import FP32_BYTES, MemoryConfig, estimate_with_phases, loss_bytes, tp_units
from planner.core.stage_memory import estimate_stage_memory
from planner.costmodel.collectives import Link, all_reduce_s
from planner.costmodel.training import estimate_tp_comm
from contracts.plan import PipelineSpec, PipelineStage

CPU = torch.device("cpu")
SEQ = 32
# GPT-2 (V = 50257: an uneven vocabulary split); tiny GPT-2; Llama with GQA and SwiGLU; Qwen2 (q/k/v biases, tied)
MODELS = ["gpt2", "tiny", "tiny-llama", "qwen2-0.5b"]


def _unit_groups(m) -> list[list[nn.Module]]:
    """The runtime's units (contracts/units.py order) as module lists, as models/sharded.py cuts them."""
    embed = [m.embed] + ([m.pos_embed] if m.pos_embed is not None else [])
    head = [m.norm] + ([m.lm_head] if m.lm_head is not None else [])
    return [embed, *[[b] for b in m.blocks], head]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("t", [2, 4, 7])
def test_every_tp_rank_holds_what_the_layout_says(name, t):
    spec = PRESETS[name]
    if spec.num_heads % t or spec.num_kv_heads % t or spec.ffn_hidden % t:
        with pytest.raises(ValueError, match=f"tensor-parallel degree {t} must divide"):
            check_tp(spec, t)
        return
    replicated_total = None
    per_rank = []
    for r in range(t):
        with torch.device("meta"):
            m = apply_tp(build_model(spec), TensorParallel(t, r, None))
        counts = [sum(p.numel() for mod in g for p in mod.parameters()) for g in _unit_groups(m)]
        assert counts == tp_unit_numels(spec, t, r)
        per_rank.append(sum(counts))
        rep = sum(p.numel() for p, split in zip((p for g in _unit_groups(m) for mod in g for p in mod.parameters()),
                                                [f for g in _unit_groups(m) for f in split_flags(g)]) if not split)
        replicated_total = rep if replicated_total is None else replicated_total
        assert rep == replicated_total  # the replicated parameters are the same on every rank
    # the ranks' split parameters add up to the model: Σ_r local − (t − 1)·replicated = all
    assert sum(per_rank) - (t - 1) * replicated_total == spec.num_params
    assert [u.numel for u in tp_units(spec, t)] == tp_unit_numels(spec, t, 0)  # the planner's = rank 0's
    assert per_rank[0] == max(per_rank)  # rank 0 holds the most (its extra vocabulary row), as priced


def test_vocab_bounds_tile_the_vocabulary_rank_0_first():
    assert vocab_bounds(151936, 2) == [(0, 75968), (75968, 151936)]
    assert vocab_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_tp_weights_are_the_one_rank_weights_cut(name):
    spec = with_max_seq(PRESETS[name], SEQ)
    one = ShardedRuntime(spec, zero=1, fractions=[1.0], position=0, comm=LocalCollectives(0, 1), device=CPU, seed=5)
    full = dict(one.model.named_parameters())
    ranks = [TensorParallelRuntime(spec, zero=1, fractions=[0.7, 0.3], position=0, comm=LocalCollectives(0, 2),
                                   device=CPU, seed=5, tp=TensorParallel(2, r, None)) for r in range(2)]
    mods = [dict(rt.model.named_modules()) for rt in ranks]
    split_seen = 0
    for pname, p in full.items():
        mod_name, _, attr = pname.rpartition(".")
        parts = [dict(rt.model.named_parameters())[pname].detach() for rt in ranks]
        if attr in getattr(mods[0][mod_name], "tp_split", ()):
            dim = mods[0][mod_name].dim if p.dim() == 2 else 0  # a row-parallel weight: its columns
            assert torch.equal(torch.cat(parts, dim=dim), p.detach()), pname
            split_seen += 1
        else:
            for q in parts:
                assert torch.equal(q, p.detach()), pname
    assert split_seen >= 6 * spec.num_layers  # q, k, v, o, up, down at least: the cut was exercised


@pytest.mark.parametrize("zero", [2, 3])
def test_tp_is_refused_at_zero_2_and_3(zero):
    with pytest.raises(ValueError, match=f"tensor parallelism \\(tp 2\\) runs at zero 1 only, got zero {zero}"):
        ShardedRuntime(PRESETS["tiny"], zero=zero, fractions=[1.0], position=0, comm=LocalCollectives(0, 1),
                       device=CPU, tp=TensorParallel(2, 0, None))


def test_tp_rank_out_of_its_group_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel rank 2 is not in a group of 2"):
        TensorParallel(2, 2)


# ---- the memory model ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "llama3-8b"])
def test_tp_at_zero_1_is_the_runtime_model(name):
    spec = with_max_seq(PRESETS[name], 256)
    cfg = MemoryConfig(micro_batch=2, seq=256, accum_steps=2, tp=2, zero=1, dp=2, shard_fraction=0.25)
    b, phases = estimate_with_phases(spec, cfg)
    assert {"loss", "head", "last_block", "step"} <= set(phases)  # the runtime's moments
    local = sum(u.numel for u in tp_units(spec, 2))
    assert b.num_params == local
    assert b.params_bytes == b.grads_bytes == FP32_BYTES * local  # zero 1: full local params and grads
    owned = sum(int(u.numel * 0.25 + 0.5) for u in tp_units(spec, 2))
    assert b.optimizer_bytes == 2 * FP32_BYTES * owned
    one, _ = estimate_with_phases(spec, MemoryConfig(micro_batch=2, seq=256, accum_steps=2, zero=1, dp=2,
                                                     shard_fraction=0.25))
    assert b.peak_bytes < one.peak_bytes


def test_the_vocab_parallel_loss_holds_two_logit_slices_not_three_logits():
    assert loss_bytes(1, 1000, 64) == 3 * 4 * 1000 * 64
    assert loss_bytes(2, 500, 64) == 2 * 4 * 500 * 64 + 29 * 64


def test_a_stage_of_tp_2_holds_less_than_tp_1():
    spec = with_max_seq(PRESETS["llama3-8b"], 512)
    pipe = PipelineSpec("1f1b", 1, 4, (PipelineStage(0, 16, (0,), (1,), "a"), PipelineStage(16, 16, (1,), (1,), "a")))
    for stage in (0, 1):
        one = estimate_stage_memory(spec, pipe, stage, 0, 1.0, 512)
        two = estimate_stage_memory(spec, pipe, stage, 0, 1.0, 512, tp=2)
        # the weights, gradients and moments halve but for the replicated norms
        assert 0.49 * one.params_bytes < two.params_bytes < 0.51 * one.params_bytes
        assert two.peak_bytes < 0.6 * one.peak_bytes


# ---- the cost model --------------------------------------------------------------------------------------
def test_megatron_all_reduces_per_block_priced_by_the_ring():
    spec = PRESETS["tiny-llama"]  # 2 blocks, h 64
    N, h, L = 2 * SEQ, spec.hidden, spec.num_layers
    c = estimate_tp_comm(spec, 2, SEQ)
    # 2 per block forward + 2 backward, the embedding's forward, the head's backward, 2 small for the loss
    assert c.num_calls == 4 * L + 2 + 2
    assert c.buffer_bytes == (4 * L + 2) * N * h * 4 + 3 * N * 4
    link = Link(bandwidth_bytes_per_s=1e9, hop_latency_s=1e-5)
    expected = (4 * L + 2) * all_reduce_s(N * h * 4, 2, link) + all_reduce_s(N * 4, 2, link) \
        + all_reduce_s(2 * N * 4, 2, link)
    assert c.comm_s(2, link) == pytest.approx(expected)
    assert c.comm_s(1, link) == 0.0  # no TP group: nothing to all-reduce
    assert c.comm_s(4, link) > c.comm_s(2, link)  # 2(t−1)/t of the buffer grows with t
    full = estimate_tp_comm(spec, 2, SEQ, recompute="full")
    assert full.num_calls == c.num_calls + 2 * L  # the recomputed forward all-reduces again
    half = estimate_tp_comm(spec, 2, SEQ, dtype="bf16")
    # the forward all-reduces of the row-parallel outputs in 2 bytes; gradients and the embedding stay fp32
    assert half.buffer_bytes == c.buffer_bytes - 2 * L * N * h * 2


def test_local_rows_map_token_ids_to_this_ranks_table():
    spec = PRESETS["gpt2"]
    with torch.device("meta"):
        m = apply_tp(build_model(spec), TensorParallel(2, 1, None))
    ids = torch.tensor([[0, 25128, 25129, 50256]])
    local, keep = m.embed.local_rows(ids)
    assert keep.tolist() == [[False, False, True, True]]  # rank 1 holds rows [25129, 50257)
    assert local.tolist() == [[0, 0, 0, 25127]]


@pytest.mark.parametrize("layout,match", [
    ([[0, 1], [2]], "every data-parallel position needs a TP group of the same size"),
    ([[0, 1], [1, 2]], "a rank appears twice"),
    ([[1, 0], [2, 3]], r"TP group \[1, 0\]: list its ranks in increasing order"),
])
def test_bad_tp_dp_layouts_are_refused_before_any_group_exists(layout, match):
    from models.tensor_runtime import build_groups
    with pytest.raises(ValueError, match=match):
        build_groups(layout, 0)
