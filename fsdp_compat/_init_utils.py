"""Constructor helpers: argument checks, ignored states, meta-device materialisation, rank-0 sync."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def check_module(module: Any) -> None:
    """FSDP1 fails with ``AttributeError`` on a non-module; we keep the type, with a clear message."""
    if not isinstance(module, nn.Module):
        raise AttributeError(
            f"FullyShardedDataParallel wraps an nn.Module, but got {type(module).__name__}; pass "
            "the model (or submodule) to shard as the first argument"
        )


def is_forwardless_container(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` / ``nn.ModuleDict`` that is iterated, never called."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def check_container_has_no_own_params(module: nn.Module, ignored_params: set[nn.Parameter]) -> None:
    """A container is only wrappable when all its parameters belong to nested units (or are ignored)."""
    own = [name for name, p in module.named_parameters()
           if p not in ignored_params and not isinstance(p, DTensor)]
    if own:
        raise ValueError(
            f"Cannot shard {type(module).__name__} parameters {own[:3]} directly: the container has no "
            "forward, so nothing would gather them. Wrap its children instead (e.g. "
            "ModuleWrapPolicy({YourBlock}))"
        )


def resolve_ignored_states(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter | nn.Module] | None,
    wrapper_class: type,
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules and the full set of ignored parameters, validated as FSDP1 does."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. "
            "Please just pass ignored_states."
        )
    given = list(ignored_states if ignored_states is not None else ignored_modules or [])
    if given and not (all(isinstance(s, nn.Parameter) for s in given)
                      or all(isinstance(s, nn.Module) for s in given)):
        raise ValueError(
            "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
            f"types {[type(s) for s in given]}"
        )
    inside_modules = set(module.modules())
    inside_params = set(module.parameters())
    modules: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for state in given:
        if isinstance(state, nn.Parameter):
            if state not in inside_params:
                raise ValueError("An ignored parameter is not a parameter of the wrapped module; "
                                 "pass only parameters of the module being wrapped")
            params.add(state)
            continue
        if isinstance(state, wrapper_class):
            raise ValueError("ignored_modules should not include FullyShardedDataParallel instances")
        if state not in inside_modules:
            raise ValueError(f"Ignored module {type(state).__name__} is not a submodule of the "
                             "wrapped module; pass only submodules of the module being wrapped")
        if state is module:
            raise ValueError("The wrapped module itself cannot be ignored")
        for sub in state.modules():
            modules.add(sub)
            params.update(sub.parameters(recurse=False))
    return modules, params


def has_meta_states(module: nn.Module, ignored_params: set[nn.Parameter]) -> bool:
    """Whether any not-yet-sharded parameter or buffer of ``module`` is on the meta device."""
    tensors = [p for p in module.parameters() if p not in ignored_params and not isinstance(p, DTensor)]
    tensors += list(module.buffers())
    return any(t.is_meta for t in tensors)


def materialize_meta_module(
    module: nn.Module,
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
    ignored_modules: set[nn.Module],
) -> None:
    """Give a meta-device ``module`` real storage and initial values.

    With ``param_init_fn`` it is called on ``module`` (as FSDP1 does). Otherwise each submodule with
    its own meta parameters or buffers gets storage on ``device`` and ``reset_parameters()`` is
    called in module order (pre-order): the order eager construction initialises them in, so the
    same seed gives the same values as building the model eagerly. Tied parameters stay tied and
    keep the value of their first owner, as with eager construction followed by tying.
    """
    if param_init_fn is not None:
        param_init_fn(module)
        return
    materialized: dict[int, torch.Tensor] = {}
    keep_alive: list[torch.Tensor] = []  # ids in ``materialized`` must not be reused
    for submodule in module.modules():
        if submodule in ignored_modules:
            continue
        already_initialized = _materialize_direct_states(submodule, device, materialized, keep_alive)
        if already_initialized is None:
            continue
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
                # A tied tensor was initialised by its first owner; restore that value.
                for tensor, value in already_initialized:
                    tensor.copy_(value)


def _materialize_direct_states(
    submodule: nn.Module,
    device: torch.device,
    materialized: dict[int, torch.Tensor],
    keep_alive: list[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Replace ``submodule``'s own meta tensors by empty ones on ``device``, reusing tied ones.

    Returns the (tensor, saved value) pairs of tensors materialised earlier by another module, or
    ``None`` when the module had no meta tensor of its own.
    """
    found_meta = False
    already_initialized: list[tuple[torch.Tensor, torch.Tensor]] = []
    for registry in (submodule._parameters, submodule._buffers):
        for name, tensor in registry.items():
            if tensor is None or not tensor.is_meta:
                continue
            found_meta = True
            if id(tensor) in materialized:
                replacement = materialized[id(tensor)]
                already_initialized.append((replacement, replacement.detach().clone()))
            else:
                replacement = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    replacement = nn.Parameter(replacement, requires_grad=tensor.requires_grad)
                materialized[id(tensor)] = replacement
                keep_alive.append(tensor)
            registry[name] = replacement
    return already_initialized if found_meta else None


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, mesh: DeviceMesh, ignored_params: set[nn.Parameter]) -> None:
    """``sync_module_states``: give every rank mesh-rank 0's parameters and buffers.

    Only tensors not yet sharded by a nested unit are sent (those were synced by that unit). Works
    on CPU tensors with gloo, where FSDP1 refuses.
    """
    tensors = [p.data for p in module.parameters() if p not in ignored_params and not isinstance(p, DTensor)]
    tensors += [b for b in module.buffers() if not isinstance(b, DTensor)]
    if not tensors:
        return
    # Along the replicate dimension first, then within each shard group: all end with (0, 0)'s.
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        source = dist.get_global_rank(group, 0)
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=group)
