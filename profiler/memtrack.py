"""Measured per-rank peak memory.

CUDA: `torch.cuda.max_memory_allocated` (bytes held by live tensors, not the reserved pool). CPU
has no allocator statistics and RSS is noise at this scale, so `LiveTensorBytes` counts live
tensor bytes itself: the resident storages the step uses, then, through a TorchDispatchMode, every
new storage an op creates until it dies, and storages resized in place. It is independent of the
planner's memory model: it counts what the code allocates, not what a formula says.

What it counts and misses: docs/executor.md ("Measured peak memory").
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
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [its current nbytes]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._orig_resize = None
        for t in resident:
            self._track(t)

    def _free(self, cell: list[int]) -> None:
        self.live_bytes -= cell[0]

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _track_storage(self, st: torch.UntypedStorage) -> list[int] | None:
        if st in self._seen:
            return None
        cell = [st.nbytes()]
        self._seen[st] = cell
        weakref.finalize(st, self._free, cell)
        self._add(cell[0])
        return cell

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        self._track_storage(t.untyped_storage())

    def _resized(self, st: torch.UntypedStorage, nbytes: int) -> None:
        cell = self._seen.get(st)
        if cell is None:  # a storage born before the mode and not named resident: count it from now
            cell = self._track_storage(st)
        delta = nbytes - cell[0]
        cell[0] = nbytes
        self._add(delta)

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(st: torch.UntypedStorage, size: int):
            out = orig(st, size)
            mode._resized(st, st.nbytes())
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any):
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
            self._orig_resize = None
        return super().__exit__(*exc)

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
