"""``ShardedGradScaler``: loss scaling for fp16 training when every rank holds only a shard.

A plain ``torch.amp.GradScaler`` looks for inf/NaN in the gradients it can see. Under FSDP each
rank sees only its shards, so one rank may find an overflow that the others do not; if it then
skips ``optimizer.step()`` while they step, the replicas drift apart for good. This scaler checks
its local shards and then agrees with every rank of ``process_group`` (one all-reduce, MAX) before
deciding, so all ranks skip the same steps and update the scale identically.

Same constructor and behaviour as torch FSDP1's
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (which we do not import), with
gradients that are the engine's sharded ``DTensor`` gradients, plain tensors (ignored parameters,
``NO_SHARD``), or a mix, on the compute device or on the CPU (``CPUOffload``).
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _orig_params

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN verdict is agreed across ranks (FSDP1's API).

    Args:
        device: device type of the scale (``"cuda"`` by default, as in FSDP1; ``"cpu"`` for CPU
            training).
        init_scale, backoff_factor, growth_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        process_group: the ranks that must agree (default: all ranks). It must contain every rank
            that shards or replicates the model's parameters.

    Unlike ``torch.amp.GradScaler``, ``scale(loss)`` keeps the loss dtype (an fp16 loss stays
    fp16, as in FSDP1) and fp16 gradients may be unscaled (``keep_low_precision_grads``).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = dist.group.WORLD,
    ) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply ``outputs`` (a tensor or nested iterables of tensors) by the scale, keeping
        each tensor's dtype."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return self._scale_one(outputs)
        return self._scale_nested(outputs)

    def _scale_one(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(tensor.device)
        assert self._scale is not None
        scaled = tensor * self._scale.to(device=tensor.device, non_blocking=True)
        return scaled.type(tensor.dtype)

    def _scale_nested(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._scale_one(value)
        if isinstance(value, abc.Iterable):
            scaled = map(self._scale_nested, value)
            return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
        raise ValueError("outputs must be a Tensor or an iterable of Tensors")

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this rank's gradient shards in place; return the *agreed* found-inf flags.

        Called by ``unscale_`` (and, for optimizers that unscale inside ``step``, by the base
        class's inf check). The returned per-device flags all hold the verdict of every rank.
        ``allow_fp16`` is ignored: FSDP gradients may legitimately be fp16.
        """
        _orig_params.rebind_optimizer(optimizer)  # unscaling precedes the step's own re-pointing
        per_device_found_inf: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _dtype), grads in _local_grads_by_device_and_dtype(optimizer).items():
                if device not in per_device_found_inf:
                    per_device_found_inf[device] = found_inf.to(device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, per_device_found_inf[device], inv_scale.to(device))
        assert self._scale is not None
        # Ranks whose shards are all empty still take part (and need a flag for step/update).
        per_device_found_inf.setdefault(self._scale.device, found_inf.to(self._scale.device, copy=True))
        self._agree_across_ranks(per_device_found_inf)
        return per_device_found_inf

    def _agree_across_ranks(self, per_device_found_inf: dict[torch.device, torch.Tensor]) -> None:
        """One MAX all-reduce, whatever the devices, so every rank issues the same collective."""
        assert self._scale is not None
        verdict = torch.stack([flag.to(self._scale.device).reshape(()) for flag in
                               per_device_found_inf.values()]).amax()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.process_group)
        for flag in per_device_found_inf.values():
            flag.copy_(verdict.to(flag.device).reshape(flag.shape))


def _local_grads_by_device_and_dtype(optimizer: torch.optim.Optimizer) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The tensors to check and unscale: each gradient's local shard (its ``_values()`` if sparse)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                grad = grad.to_local()
            if grad.is_sparse:
                grad = _coalesced_values(param, grad)
            if grad.numel() > 0:
                groups[(grad.device, grad.dtype)].append(grad)
    return groups


def _coalesced_values(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    # Duplicate indices of an fp16 gradient would be summed (and may overflow) by the optimizer:
    # check the coalesced values, via fp32 as fp16 has no coalesce kernel (torch's scalers too).
    if grad.dtype is torch.float16:
        grad = grad.type(torch.float32).coalesce().type(torch.float16)
        param.grad = grad
    return grad._values()
