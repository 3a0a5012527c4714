"""What models/sharded.py is checked against, for tests and benches: FSDP2 beside it, and the rule
that a step never waits on the device.

`no_host_sync(device)` wraps the issuing of a step: on CUDA `torch.cuda.set_sync_debug_mode("error")`
(any synchronizing call raises); on a CPU, where nothing synchronizes, a TorchDispatchMode that
raises on the reads that would (`.item()`, `float(t)`, `bool(t)`: aten._local_scalar_dense) and a
`Tensor.tolist` that raises, so the rule is checked without a GPU.

FSDP2 (`torch.distributed.fsdp.fully_shard`):
`Fsdp2Reference` builds a plain Decoder from a ModelSpec, loads the runtime's initial weights
(`ShardedRuntime.full_state_dict()`), shards each block then the root over a 1-D mesh of the
default process group, and trains it as the runtime trains: gradients SUMMED across ranks (the
loss is already divided by the global token count), torch.optim.AdamW with the runtime's groups
(weight decay on matrices and embeddings only, `models/optim.decay_ranges`), clipping by the
global norm, the LR the caller passes per step. `param_dtype` / `reduce_dtype` become
`MixedPrecisionPolicy(param_dtype, reduce_dtype)`; `autocast_dtype` wraps the forward as the
runtime's does (models/runtime.micro_batch_loss).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from contracts.specs import ModelSpec
from models.optim import OptimConfig


class _NoHostRead(TorchDispatchMode):
    """Raises on every op that reads a tensor's value to the host."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
             torch.ops.aten.is_nonzero.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise RuntimeError(f"host read inside the step: {func}")
        return func(*args, **(kwargs or {}))


def _no_tolist(self, *args, **kwargs):
    raise RuntimeError("host read inside the step: Tensor.tolist")


@contextlib.contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """Inside: any synchronization with the device (CUDA) or read of a tensor's value (CPU) raises
    RuntimeError; the previous sync-debug mode is restored on the way out."""
    if device.type == "cuda":
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)
        return
    with _NoHostRead(), mock.patch.object(torch.Tensor, "tolist", _no_tolist):
        yield


class Fsdp2Reference:
    """One rank of FSDP2 on `spec`, starting from `initial_state` (decoder names, full fp32)."""

    def __init__(self, spec: ModelSpec, initial_state: dict[str, torch.Tensor], optim: OptimConfig,
                 device: torch.device, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, autocast_dtype: torch.dtype | None = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        from models.decoder import build_model
        with torch.device(device):
            model = build_model(spec)
        model.load_state_dict(initial_state)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
        for m in model.modules():
            if isinstance(m, FSDPModule):  # sum, not average: the loss is already / global tokens
                if hasattr(m, "set_force_sum_reduction_for_comms"):  # torch >= 2.8 (older: no-op at 1.0)
                    m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)
        self.model, self.cfg, self.device, self.autocast_dtype = model, optim, device, autocast_dtype
        params = list(model.parameters())
        self.opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
                                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                     lr=optim.lr, betas=optim.betas, eps=optim.eps, foreach=False)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], normalizer: int, lr: float) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; this rank's summed loss, a device
        scalar (the caller all-reduces it for the global loss)."""
        from models.runtime import micro_batch_loss
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for x, y in batches:
            loss = micro_batch_loss(self.model, x, y, normalizer, self.autocast_dtype)
            loss.backward()
            total += loss.detach()
        if self.cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def resident(self) -> list[torch.Tensor]:
        """The sharded parameters, gradients and optimizer state this rank keeps between steps."""
        out = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        for st in self.opt.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter by its decoder name, full (collective)."""
        return {n: p.full_tensor() for n, p in self.model.named_parameters()}
