"""models/sharded.py's gather/reduce options: bad values are refused with a one-line message naming
them, before anything is built; the defaults are fp32 gathers and reduces with one unit prefetched;
a bf16 gather makes the parameters bf16 views while the master slices and moments stay fp32; issuing
a step (`start_step`) reads no tensor to the host, its `result()` does (testkit.fsdp2.no_host_sync)."""
from __future__ import annotations

import time
from unittest import mock

import pytest
import torch

from contracts.specs import PRESETS
from models.collectives import LocalCollectives
from models.sharded import ShardedRuntime
from testkit.fsdp2 import no_host_sync

CPU = torch.device("cpu")
TINY = PRESETS["tiny"]


def _runtime(zero: int = 3, fractions=(0.6, 0.4), **kwargs) -> ShardedRuntime:
    return ShardedRuntime(TINY, zero=zero, fractions=list(fractions), position=0,
                          comm=LocalCollectives(0, len(fractions)), device=CPU, **kwargs)


@pytest.mark.parametrize("zero,kwargs,match", [
    (2, dict(param_dtype=torch.bfloat16), r"param_dtype bf16 needs zero 3 \(got zero 2\)"),
    (1, dict(param_dtype=torch.float16), r"param_dtype fp16 needs zero 3 \(got zero 1\)"),
    (3, dict(param_dtype=torch.float64), r"param_dtype must be one of fp32, bf16, fp16, got 'torch.float64'"),
    (3, dict(reduce_dtype=torch.float16), r"reduce_dtype must be one of fp32, bf16, got 'fp16'"),
    (3, dict(prefetch=-1), r"prefetch must be an integer >= 0 .* got -1"),
    (3, dict(prefetch=1.5), r"prefetch must be an integer >= 0 .* got 1.5"),
    (3, dict(prefetch=True), r"prefetch must be an integer >= 0 .* got True"),
    (3, dict(reduce_in_flight=2), r"reduce_in_flight must be 0 or 1 .* got 2"),
    (3, dict(param_dtype=torch.bfloat16), r"param_dtype bf16 needs autocast_dtype bf16 \(got None\)"),
    (3, dict(param_dtype=torch.bfloat16, autocast_dtype=torch.float16), r"needs autocast_dtype bf16"),
])
def test_bad_options_are_refused_with_their_name(zero, kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        _runtime(zero, **kwargs)
    assert "\n" not in str(e.value)


def test_defaults_are_fp32_gathers_and_reduces_with_one_unit_prefetched():
    rt = _runtime()
    assert (rt.param_dtype, rt.reduce_dtype, rt.prefetch, rt.reduce_depth) == (torch.float32, torch.float32, 1, 0)
    assert all(p.dtype == torch.float32 for p in rt.model.parameters())


def test_a_bf16_gather_keeps_fp32_masters_and_state():
    bf16 = dict(param_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)
    rt = _runtime(**bf16)
    fp32 = _runtime()
    for u, v in zip(rt.units, fp32.units):
        assert u.full.dtype == torch.bfloat16 and u.full.untyped_storage().nbytes() == 0  # not held
        assert all(p.dtype == torch.bfloat16 and p.untyped_storage().data_ptr() == u.full.untyped_storage().data_ptr()
                   for p in u.params)
        assert {u.master.dtype, u.exp_avg.dtype, u.exp_avg_sq.dtype, u.grad.dtype} == {torch.float32}
        assert torch.equal(u.master, v.master)  # the same initial weights as an fp32 run
    one_rank = (1.0,)  # LocalCollectives fills only the own slice of a gather
    sd, ref = _runtime(fractions=one_rank, **bf16).full_state_dict(), \
        _runtime(fractions=one_rank).full_state_dict()
    assert all(sd[k].dtype == torch.float32 and torch.equal(sd[k], ref[k]) for k in ref)


@pytest.mark.parametrize("zero,kwargs", [
    (1, {}), (2, {}), (3, {}), (3, dict(param_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16, prefetch=2)),
    (3, dict(reduce_dtype=torch.bfloat16, reduce_in_flight=1)),
    (3, dict(param_dtype=torch.float16, autocast_dtype=torch.float16, reduce_in_flight=1)),
])
def test_a_step_reads_nothing_to_the_host_until_its_result(zero, kwargs):
    rt = _runtime(zero, fractions=(1.0,), **kwargs)
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, TINY.vocab_size, (2, 2, 17), generator=g)
    batches = [(w[j, :, :-1], w[j, :, 1:]) for j in range(2)]
    with no_host_sync(CPU):
        pending = rt.start_step(batches, 2 * 2 * 16, lr=1e-3)
    r = pending.result()
    assert r.grad_norm > 0 and 0 < r.loss < 10 and rt.step_count == 1


def test_the_host_read_guard_catches_reads():
    t = torch.ones(2)
    for read in (lambda: float(t.sum()), lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t.sum() > 0)):
        with pytest.raises(RuntimeError, match="host read inside the step"), no_host_sync(CPU):
            read()


class _StubEvent:
    """torch.cuda.Event on a CPU: records perf_counter; counts the reads of elapsed time."""
    reads = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_StubEvent") -> float:
        _StubEvent.reads += 1
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("zero", [1, 3])
def test_cuda_timers_are_event_pairs_read_only_by_the_result(zero):
    """The CUDA bookkeeping (no GPU here): compute, waits and the update are timed by event pairs,
    none read while the step is issued."""
    rt = _runtime(zero, fractions=(1.0,), reduce_in_flight=1)
    rt._cuda = True  # the runtime's CUDA paths, with the events stubbed
    x = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with mock.patch.object(torch.cuda, "Event", _StubEvent):
        _StubEvent.reads = 0
        pending = rt.start_step([(x[:, :-1], x[:, 1:])], 32, lr=1e-3)
        assert _StubEvent.reads == 0
        r = pending.result()
    assert _StubEvent.reads > 3
    assert r.compute_s > 0 and r.work_s == r.compute_s and r.optimizer_s > 0 and r.comm_wait_s > 0
