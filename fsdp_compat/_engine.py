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

# Runtime-control internals (comm hooks, summon_full_params, recovery): private engine pieces.
import copy
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, _from_local_no_grad
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState as _EngineTrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import unsafe_setattr_param

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


def sharded_params(module: nn.Module) -> list[nn.Parameter]:
    """The unit's sharded parameters (``DTensor`` nn.Parameters), in the engine's order."""
    return [fsdp_param.sharded_param for fsdp_param in managed_params(module)]


@torch.no_grad()
def set_sharded_param_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Re-type the unit's floating-point sharded parameters (and their gradients) to ``dtype``.

    Each ``nn.Parameter`` keeps its identity (``swap_tensors``, as ``nn.Module.to`` does for
    DTensor parameters), so optimizers holding it stay valid; the engine then re-pads the new
    local shard and re-derives its mixed-precision dtypes, which it otherwise does only at lazy
    initialisation. Callers must reject units that already ran forward (all-gather buffers are
    sized for the old dtype).
    """
    for fsdp_param in managed_params(module):
        param = fsdp_param.sharded_param
        if param.dtype == dtype or not param.is_floating_point():
            continue
        grad, param.grad = param.grad, None  # a live .grad reference blocks swap_tensors
        torch.utils.swap_tensors(param, nn.Parameter(param.to(dtype), requires_grad=param.requires_grad))
        fsdp_param.reset_sharded_param()
        if grad is not None:
            param.grad = grad.to(dtype)
    for group in param_groups(module):
        group._init_mp_dtypes()


# ---- runtime controls: no_sync, summon_full_params, comm hooks, recovery (``_runtime``) ----

GradientSyncFlags = tuple[bool, bool]


def gradient_sync_flags(module: nn.Module) -> list[GradientSyncFlags]:
    """``(reduce_grads, all_reduce_grads)`` of each parameter group of the unit ``module``."""
    return [(group.reduce_grads, group.all_reduce_grads) for group in param_groups(module)]


def set_gradient_sync_flags(module: nn.Module, flags: list[GradientSyncFlags]) -> None:
    """Restore what :func:`gradient_sync_flags` returned (both flags: HSDP and ``replicate`` need
    ``all_reduce_grads`` back, or their gradients are never written)."""
    for group, (reduce_grads, all_reduce_grads) in zip(param_groups(module), flags):
        group.reduce_grads = reduce_grads
        group.all_reduce_grads = all_reduce_grads


ParamSlot = tuple[nn.Module, str]


def unit_param_slots(module: nn.Module) -> list[tuple[nn.Parameter, list[ParamSlot]]]:
    """Each parameter the unit ``module`` manages: its sharded (DTensor) parameter and every
    ``(submodule, attribute name)`` it is registered under (several for a tied weight)."""
    result = []
    for fsdp_param in managed_params(module):
        info = fsdp_param._module_info
        slots = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
        result.append((fsdp_param.sharded_param, slots))
    return result


def register_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<name>`` the way the engine swaps sharded/unsharded ones."""
    unsafe_setattr_param(module, name, param)


def iteration_in_progress(module: nn.Module) -> bool:
    """Whether the engine is inside a forward or backward of ``module``'s tree, or one raised and
    left its per-iteration state behind (between a forward and its backward is idle)."""
    state = engine_state(module)
    if state is None:
        return False
    context = state._state_ctx
    if context.iter_forward_root is not None or context.post_backward_final_callback_queued:
        return True
    idle = _EngineTrainingState.IDLE
    return any(s._training_state != idle or any(g._training_state != idle for g in s._fsdp_param_groups)
               for s in context.all_states or [state])


def recover_interrupted_iteration(module: nn.Module) -> bool:
    """If a forward or backward of the root unit ``module`` raised midway, reset the engine's
    per-iteration state and drop the interrupted iteration's unreduced gradients (which the next
    backward would otherwise add to). Returns whether there was anything to recover.

    Not while autograd runs: a root forward inside backward is activation-checkpoint recompute.
    """
    state = engine_state(module)
    if (state is None or state._is_root is not True or torch._C._current_graph_task_id() != -1
            or not iteration_in_progress(module)):
        return False
    reset_iteration(module)
    for unit_state in state._state_ctx.all_states:
        for group in unit_state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param._unsharded_param.grad = None
                fsdp_param.unsharded_accumulated_grad = None
    return True


class _CommHookReduceScatter(ReduceScatter):
    """Runs an FSDP1 comm hook ``hook(state, grad, output)`` in place of the reduce-scatter.

    ``grad`` is the unit's flat gradient, padded so that chunk ``r`` of it belongs to rank ``r``,
    and ``output`` receives this rank's reduced chunk: the same contract as FSDP1's flat
    parameter, so FSDP1 hooks (``reduce_scatter_hook``, ``fp16_compress_hook``...) work unchanged.
    """

    def __init__(self, hook: Callable[..., Any], state: object) -> None:
        self._hook = hook
        self._state = state

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> None:
        self._hook(self._state, input_tensor, output_tensor)
        return None


_this_rank_group: tuple[Any, Any] = (None, None)  # (default group it was made in, the group)


def _group_of_this_rank_only() -> Any:
    """A one-rank process group: the engine's own all-reduce over it is a no-op. Made once per
    default process group (a re-initialised world gets a new one)."""
    global _this_rank_group
    world, group = _this_rank_group
    if world is not dist.group.WORLD:
        group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        _this_rank_group = (dist.group.WORLD, group)
    return group


def install_comm_hook(module: nn.Module, hook: Callable[..., Any], state: object) -> None:
    """Make ``hook`` do the gradient communication of the unit ``module``, as FSDP1 calls it:
    ``hook(state, grad, output)`` for sharded units, ``hook(state, grad)`` (all-reduce in place)
    for replicated (``NO_SHARD``) ones. The engine no longer averages: the hook does."""
    for group in param_groups(module):
        group.gradient_divide_factor = 1.0
        group.force_sum_reduction_for_comms = True  # with factor 1: no pre/post division at all
        if isinstance(group.mesh_info, FSDPMeshInfo):
            group._reduce_scatter_comm = _CommHookReduceScatter(hook, state)
            continue
        # ``replicate`` has no pluggable all-reduce, only a hook run after it: point its
        # all-reduce at a one-rank group and let the FSDP1 hook be the real communication.
        mesh_info = copy.copy(group.mesh_info)
        mesh_info.replicate_process_group = _group_of_this_rank_only()
        group.mesh_info = mesh_info
        group._all_reduce_hook = lambda grad, hook=hook, state=state: hook(state, grad)


# ---- state dicts (``_state_dict``) ----


def engine_module(module: nn.Module) -> nn.Module:
    """The engine unit a wrapper holds: ``wrapper.module`` itself, or the module inside the
    activation-checkpoint wrappers that ``apply_activation_checkpointing`` put around it after
    wrapping (FSDP1 recipes do this); the engine's state lives on the inner module."""
    while not isinstance(module, FSDPModule) and hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor laid out exactly as ``like`` (no copy).

    The engine's own no-grad constructor reuses ``like``'s sharding spec: no autograd node, no
    spec rebuilt from placements (``DTensor.from_local`` costs ~4x as much per tensor, which
    dominates loading an optimizer state of small tensors). A different dtype needs its own spec.
    """
    if local.dtype == like.dtype and not local.requires_grad:
        return _from_local_no_grad(local, like._spec)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())
