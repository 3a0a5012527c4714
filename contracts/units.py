"""How the sharded runtime (models/sharded.py) cuts a model into units, and what it sends per step.

One definition, pure Python, read by the runtime (which builds its flat buffers from it), the
memory model (gather and reduce-scatter buffers) and the planner's time model (the bytes each
ZeRO stage moves). Change the runtime's schedule and this module must follow.

Units, in forward order: "embed", "block.0" .. "block.L-1", "head"; each one flat parameter,
sharded unevenly by the plan's shard fractions. `step_collectives(spec, zero)` lists the
all-gathers and reduce-scatters one optimizer step issues at each ZeRO stage (every unit gathered
and reduced once per step: layer-wise accumulation). The table of units and of each stage's
collectives: docs/models/memory.md ("Units and the collectives of a step").
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from contracts.specs import ModelSpec
from contracts.constants import FP32_BYTES, check_zero


@dataclass(frozen=True)
class Unit:
    name: str
    numel: int


@lru_cache(maxsize=256)  # the memory model asks it on every evaluation; a spec is frozen
def runtime_units(spec: ModelSpec) -> tuple[Unit, ...]:
    """The runtime's units in forward order with their parameter counts (sum = spec.num_params)."""
    head = spec.final_norm_params() + (0 if spec.tied_embeddings else spec.vocab_size * spec.hidden)
    embed = spec.embedding_params() - (0 if spec.tied_embeddings else spec.vocab_size * spec.hidden)
    units = [Unit("embed", embed)]
    units += [Unit(f"block.{i}", spec.block_params()) for i in range(spec.num_layers)]
    units.append(Unit("head", head))
    assert sum(u.numel for u in units) == spec.num_params, "unit layout must cover every parameter once"
    return tuple(units)


def max_unit_numel(spec: ModelSpec) -> int:
    return max(u.numel for u in runtime_units(spec))


@dataclass(frozen=True)
class StepCollectives:
    """Elements each rank's collectives move per optimizer step, as the runtime issues them:
    `gather_numel` elements all-gathered in the compute dtype, `reduce_numel` elements
    reduce-scattered in fp32, in `num_calls` collective calls (each pays a latency)."""

    gather_numel: int
    reduce_numel: int
    num_calls: int

    def bytes(self, compute_bytes: int) -> tuple[int, int]:
        """(all-gather bytes, reduce-scatter bytes) of the full buffers (before the (k-1)/k factor)."""
        return self.gather_numel * compute_bytes, self.reduce_numel * FP32_BYTES


def step_collectives(spec: ModelSpec, zero: int) -> StepCollectives:
    """What one optimizer step all-gathers and reduce-scatters (docs/models/memory.md): every unit
    once; at zero 3 each block twice (forward and backward; a tied embedding unit stays gathered from
    its forward to the head's); at zero 2 and 3 a tied embedding unit's gradient reduced once more
    (after the head)."""
    check_zero(zero)
    units = runtime_units(spec)
    n = sum(u.numel for u in units)
    tied = spec.tied_embeddings
    embed = units[0].numel if tied else 0
    if zero == 1:
        return StepCollectives(gather_numel=n, reduce_numel=n, num_calls=2 * len(units))
    if zero == 2:
        return StepCollectives(gather_numel=n, reduce_numel=n + embed, num_calls=2 * len(units) + int(tied))
    blocks = sum(u.numel for u in units[1:-1])
    gather = n + blocks
    calls = len(units) + spec.num_layers  # gathers
    calls += len(units) + int(tied)  # reduce-scatters
    return StepCollectives(gather_numel=gather, reduce_numel=n + embed, num_calls=calls)
