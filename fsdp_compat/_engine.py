"""The one place that talks to torch's FSDP2 engine.

Everything here may depend on FSDP2 internals (``FSDPState``, ``FSDPParamGroup``, ``FSDPParam`` and
their private attributes). The rest of the package goes through these functions, so a torch
upgrade that moves the internals breaks this file only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# Public FSDP2 entry points. ``replicate`` (the FSDP2-based one) lives in a private package.
from torch.distributed.fsdp._fully_shard import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed._composable.replicate_with_fsdp import replicate

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "apply_engine",
    "engine_state",
    "param_groups",
    "managed_params",
    "is_sharded_param",
]


def apply_engine(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    replicate_only: bool,
    reshard_after_forward: bool | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter],
) -> FSDPModule:
    """Make ``module`` one engine unit (one parameter group) over ``mesh``.

    ``replicate_only`` selects the engine's replicate (all-reduce, no sharding) for ``NO_SHARD``.
    ``reshard_after_forward=None`` lets the engine decide: resharded unless it is the root.
    """
    if replicate_only:
        return replicate(module, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                         ignored_params=ignored_params)
    return fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward,
                       mp_policy=mp_policy, offload_policy=offload_policy,
                       ignored_params=ignored_params)


def engine_state(module: nn.Module) -> Any | None:
    """The engine's per-unit state of ``module`` (an ``FSDPState``), or ``None``."""
    if not isinstance(module, FSDPModule):
        return None
    return module._get_fsdp_state()


def param_groups(module: nn.Module) -> list[Any]:
    """The engine parameter groups (``FSDPParamGroup``) of the unit ``module`` (may be empty)."""
    state = engine_state(module)
    return list(state._fsdp_param_groups) if state is not None else []


def managed_params(module: nn.Module) -> Iterator[Any]:
    """The engine's per-parameter records (``FSDPParam``) of the unit ``module``."""
    for group in param_groups(module):
        yield from group.fsdp_params


def is_sharded_param(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an engine-managed (DTensor) parameter."""
    return isinstance(tensor, DTensor)


def is_root_state_initialized(module: nn.Module) -> bool:
    """Whether the engine has run its lazy initialisation (root chosen) for ``module``'s unit."""
    state = engine_state(module)
    return state is not None and state._is_root is not None


def lazy_init(module: nn.Module) -> None:
    """Run the engine's lazy initialisation with ``module``'s unit as root (idempotent)."""
    state = engine_state(module)
    if state is not None:
        state._lazy_init()


def reset_iteration(module: nn.Module) -> None:
    """Recover the engine's per-iteration state after a forward or backward raised."""
    if isinstance(module, FSDPModule):
        module.reset_iter_state()
