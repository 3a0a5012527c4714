"""Measured per-rank peak memory.

CUDA: `torch.cuda.max_memory_allocated` — the caching allocator's own count of the bytes
held by live tensors (not the reserved pool).

CPU has no allocator statistics, and RSS deltas are dominated by glibc arenas and the
torch libraries (hundreds of MiB of noise against a few MiB of training state). So on
CPU we count live tensor bytes ourselves, the same quantity the CUDA counter reports:

- at the start of the measured step, the storages already alive that the step uses
  (parameters, gradients, the optimizer's state: passed in as `resident` tensors),
  each storage counted once;
- during the step, a `TorchDispatchMode` sees every op; each output whose storage is
  new is added with its `nbytes`, and a weakref finalizer subtracts it when the last
  tensor on that storage dies (autograd's saved activations included, since backward
  runs inside the mode).

Accuracy: exact for tensors allocated by torch ops; misses tensors created outside the
dispatcher (`torch.from_numpy` inputs: a few KiB here) and allocator rounding/fragmentation
(which CUDA's counter includes at 512-byte granularity). It is independent of the
planner's memory model: it counts what the code allocates, not what a formula says.
The tracker slows the ops it watches, so the worker measures one step (the first) and
not the others; shapes are the same every step, so the peak is too.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

METHOD_CPU = "live tensor bytes (TorchDispatchMode storage tracker)"
METHOD_CUDA = "torch.cuda.max_memory_allocated"


class LiveTensorBytes(TorchDispatchMode):
    """Peak of the bytes held by live tensor storages while the mode is active."""

    def __init__(self, resident: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live_bytes = 0
        self.peak_bytes = 0
        for t in resident:
            self._track(t)

    def _free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st in self._seen:
            return
        nbytes = st.nbytes()
        self._seen[st] = nbytes
        weakref.finalize(st, self._free, nbytes)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out


class PeakMemory:
    """`with PeakMemory(device, resident) as pm: ...; pm.peak_bytes` on CPU or CUDA."""

    def __init__(self, device: torch.device, resident: Iterable[torch.Tensor] = ()):
        self.device = device
        self._resident = list(resident)
        self._mode: LiveTensorBytes | None = None
        self.peak_bytes = 0

    @property
    def method(self) -> str:
        return METHOD_CUDA if self.device.type == "cuda" else METHOD_CPU

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = LiveTensorBytes(self._resident)
            self._mode.__enter__()
        self._resident = []
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        else:
            assert self._mode is not None
            self._mode.__exit__(*exc)
            self.peak_bytes = int(self._mode.peak_bytes)
