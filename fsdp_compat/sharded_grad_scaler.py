"""``ShardedGradScaler``: FSDP1's loss scaler for fp16 training when every rank holds only a shard.

``torch.amp.GradScaler`` does the scaling, skipped steps, growth and backoff; this subclass changes
only what it cannot do with our gradients (sharded ``DTensor`` ones, plain ones for ignored
parameters, a mix, on the compute device or the CPU):

* the inf/NaN verdict is agreed by every rank of ``process_group`` (one MAX all-reduce per
  ``unscale_``). torch's checks DTensor gradients with one collective per device and dtype and
  plain ones not at all, so one rank could skip a step the others take: replicas drift apart;
* fp16 gradients may be unscaled (torch's refuses them);
* ``scale(loss)`` keeps each tensor's dtype (an fp16 loss stays fp16, as in FSDP1).
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _orig_params
from ._engine import GradScalerBase, sparse_values

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScalerBase):
    """``torch.amp.GradScaler`` whose inf/NaN verdict is agreed across ranks (FSDP1's API).

    ``device``: the scale's device type (``"cuda"`` by default, as in FSDP1); ``process_group``: the
    ranks that must agree, every rank that shards or replicates the model's parameters (default: all).
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, backoff_factor: float = 0.5,
                 growth_factor: float = 2.0, growth_interval: int = 2000, enabled: bool = True,
                 process_group: dist.ProcessGroup | None = dist.group.WORLD) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self.process_group = process_group

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """``torch.amp.GradScaler.scale``, keeping each tensor's dtype."""
        if not self.is_enabled():
            return outputs
        if isinstance(outputs, torch.Tensor):
            return super().scale(outputs).type(outputs.dtype)
        if isinstance(outputs, abc.Iterable):
            scaled = map(self.scale, outputs)
            return type(outputs)(scaled) if isinstance(outputs, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def unscale_local_grads(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                            found_inf: torch.Tensor, allow_fp16: bool = True) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's gradient shards in place; return per-device found-inf flags, each
        holding every rank's verdict (fp16 is always allowed)."""
        _orig_params.rebind_optimizer(optimizer)  # unscaling precedes the step's own re-pointing
        # ``found_inf`` lies where the scale does; a rank without gradients still takes part.
        flags = {found_inf.device: found_inf.clone()}
        with torch.no_grad():
            for (device, _dtype), grads in _local_grads_by_device_and_dtype(optimizer).items():
                flag = flags.setdefault(device, found_inf.to(device, copy=True))
                self.unscale_and_check_(grads, flag, inv_scale.to(device))
        # One MAX all-reduce, whatever the devices, so every rank issues the same collective.
        verdict = torch.stack([flag.to(found_inf.device).reshape(()) for flag in flags.values()]).amax()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.process_group)
        for flag in flags.values():
            flag.copy_(verdict.to(flag.device).reshape(flag.shape))
        return flags


def _local_grads_by_device_and_dtype(
        optimizer: torch.optim.Optimizer) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The tensors to check and unscale: each gradient's local shard (its values if sparse)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                grad = grad.to_local()
            if grad.is_sparse:
                # Duplicate indices of an fp16 gradient would be summed (and may overflow) by the
                # optimizer: check the coalesced values, via fp32 as fp16 has no coalesce kernel.
                if grad.dtype is torch.float16:
                    param.grad = grad = grad.type(torch.float32).coalesce().type(torch.float16)
                grad = sparse_values(grad)
            if grad.numel() > 0:
                groups[(grad.device, grad.dtype)].append(grad)
    return groups
