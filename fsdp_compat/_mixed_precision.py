"""FSDP1's ``MixedPrecision`` and ``CPUOffload`` on the engine's policies, plus what the engine lacks."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ._engine import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .api import CPUOffload, MixedPrecision

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel


def engine_policy(mixed_precision: MixedPrecision | None) -> MixedPrecisionPolicy:
    """The engine's policy for FSDP1's ``MixedPrecision`` (parameter and reduction dtypes)."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=mixed_precision.cast_forward_inputs,
    )


def engine_offload_policy(cpu_offload: CPUOffload, device: torch.device) -> OffloadPolicy:
    """The engine's offload policy; pinned host memory only helps (and only works) with a GPU."""
    if not cpu_offload.offload_params:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


def init_unit(wrapper: FullyShardedDataParallel) -> None:
    """Per-unit mixed-precision set-up after the engine is applied (buffers, gradient dtypes)."""


def cast_floating_tensors(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor (nested in tuples, lists, dicts, dataclasses) cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if torch.is_floating_point(value) else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floating_tensors(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating_tensors(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floating_tensors(v, dtype)) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: cast_floating_tensors(getattr(value, f.name), dtype)
                   for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def cast_root_forward_inputs(
    wrapper: FullyShardedDataParallel, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """FSDP1's ``cast_root_forward_inputs``: the root casts its inputs to ``param_dtype``."""
    policy = wrapper.mixed_precision
    if policy is None or policy.param_dtype is None or not policy.cast_root_forward_inputs:
        return args, kwargs
    return cast_floating_tensors(args, policy.param_dtype), cast_floating_tensors(kwargs, policy.param_dtype)
