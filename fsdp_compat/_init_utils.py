"""Constructor helpers: argument checks, ignored states, meta-device materialisation, rank-0 sync."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _engine, _engine_flat
from ._unit_state import state_of


def check_module(module: Any) -> None:
    """FSDP1 fails with ``AttributeError`` on a non-module; we keep the type, with a clear message."""
    if not isinstance(module, nn.Module):
        raise AttributeError(f"FullyShardedDataParallel wraps an nn.Module, but got {type(module).__name__}; pass "
                             "the model (or submodule) to shard as the first argument")


# The unit that sharded each parameter, by the parameter's id (a weak reference would make
# ``swap_tensors`` refuse the parameter; a stale id is harmless: the check confirms the parameter).
_sharding_unit: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()


def remember_sharded(unit: nn.Module) -> None:
    """Record the parameters the engine unit ``unit`` shards (see :func:`check_not_shared_with_another_root`)."""
    _sharding_unit.update((id(param), unit) for param in _engine.sharded_params(unit))


def check_not_shared_with_another_root(module: nn.Module, ignored_params: set[nn.Parameter]) -> None:
    """Refuse, before anything is touched, a parameter already sharded by another root's unit (the
    engine would take it for tensor-parallel and fail deep inside); nested units' are this root's."""
    nested = {id(param) for sub in module.modules() if state_of(sub) is not None for param in sub.parameters()}
    for name, param in module.named_parameters():
        sharded_of_view = _engine_flat.sharded_of_view(param)  # a plain local-shard view: its DTensor
        shown: torch.Tensor = param if sharded_of_view is None else sharded_of_view
        unit = _sharding_unit.get(id(shown))
        if unit is not None and id(param) not in nested and param not in ignored_params and any(
                sharded is shown for sharded in _engine.sharded_params(unit)):
            raise ValueError(
                f"Parameter {name!r} is already sharded by another FullyShardedDataParallel root: "
                "one parameter cannot be sharded by two separately wrapped roots. Wrap a common "
                "parent of both modules in one FullyShardedDataParallel (a parameter tied "
                "between its submodules is supported), or tie the parameter inside one root")


def is_forwardless_container(module: nn.Module, ignored_params: set[nn.Parameter]) -> bool:
    """An ``nn.ModuleList`` / ``nn.ModuleDict`` that is iterated, never called; one is only wrappable
    when all its parameters belong to nested units (or are ignored)."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or type(module).forward is not nn.Module.forward:
        return False
    own = [name for name, p in module.named_parameters() if p not in ignored_params and not isinstance(p, DTensor)]
    if own:
        raise ValueError(f"Cannot shard {type(module).__name__} parameters {own[:3]} directly: the container has no "
                         "forward, so nothing would gather them. Wrap its children instead (e.g. "
                         "ModuleWrapPolicy({YourBlock}))")
    return True


def resolve_ignored_states(module: nn.Module, ignored_modules: Iterable[nn.Module] | None,
                           ignored_states: Iterable[nn.Parameter | nn.Module] | None,
                           ) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (with their submodules) and the full set of ignored parameters, by
    FSDP1's rules: states outside ``module`` are accepted (they change nothing here; an auto-wrap
    policy hands one ignore list to sibling units) and ignoring ``module`` itself ignores all of
    its parameters, with FSDP1's warning."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError("Cannot pass both ignored_modules and ignored_states at the same time. "
                         "Please just pass ignored_states.")
    given = list(ignored_states if ignored_states is not None else ignored_modules or [])
    _check_ignored_kinds(given, passed_as_ignored_states=ignored_states is not None)
    modules: set[nn.Module] = set()
    params: set[nn.Parameter] = set()
    for state in given:
        if isinstance(state, nn.Parameter):
            params.add(state)
            continue
        if state_of(state) is not None:
            raise ValueError("`ignored_modules` should not include FSDP modules: pass the module it wraps, "
                             "or leave the already wrapped submodule out of the ignored list")
        for sub in state.modules():
            modules.add(sub)
            params.update(sub.parameters(recurse=False))
    if module in modules:
        # FSDP1's text, naming the module its loop saw last (its last submodule).
        *_, last = module.modules()
        warnings.warn("Trying to ignore the top-level module passed into the FSDP constructor itself will "
                      f"result in all parameters being ignored and is not well-supported: {last}", stacklevel=3)
    return modules, params


def _check_ignored_kinds(given: list[Any], passed_as_ignored_states: bool) -> None:
    """FSDP1's ``ValueError``s: ``ignored_states`` all parameters or all modules, ``ignored_modules`` all modules."""
    if not given:
        return
    types = sorted({type(state) for state in given}, key=repr)  # sorted as FSDP1 does
    if passed_as_ignored_states:
        if not (all(isinstance(s, nn.Parameter) for s in given) or all(isinstance(s, nn.Module) for s in given)):
            raise ValueError(f"ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                             f"types {types}")
    elif not all(isinstance(s, nn.Module) for s in given):
        raise ValueError(f"ignored_modules expects nn.Module list elements but got types {types}; pass "
                         "parameters to ignore as ignored_states=[...] instead")


def unit_modules(root: nn.Module, ignored_modules: set[nn.Module], breadth_first: bool = False) -> list[nn.Module]:
    """``root`` and its descendants, stopping at nested wrappers and ignored modules."""
    order: list[nn.Module] = []
    pending = [root]
    while pending:
        module = pending.pop(0) if breadth_first else pending.pop()
        order.append(module)
        children = [child for child in module.children()
                    if child not in ignored_modules and state_of(child) is None]
        pending.extend(children if breadth_first else reversed(children))
    return order


class MetaMaterializer:
    """Gives meta-device modules real storage and initial values: without ``param_init_fn``, each
    module's own meta tensors get storage on ``device`` and its ``reset_parameters()`` runs, in pre-order
    (eager construction's order: the same seed gives the same values; a tied tensor keeps its first
    owner's value); with it (FSDP1's semantics), it runs on every module of a unit, breadth-first, when
    that unit is built."""

    def __init__(self, device: torch.device, ignored_modules: set[nn.Module],
                 param_init_fn: Callable[[nn.Module], None] | None) -> None:
        if param_init_fn is not None and not callable(param_init_fn):
            raise ValueError(f"Expected param_init_fn to be callable but got {type(param_init_fn)}")
        self.device = device
        self.ignored_modules = ignored_modules
        self.param_init_fn = param_init_fn
        # Weak references: a strong one would keep every unit's full tensors alive until the
        # root is built, long after the engine replaced them by shards (a tie lives in one unit).
        self._materialized: dict[int, weakref.ref[torch.Tensor]] = {}
        self._keep_alive: list[torch.Tensor] = []  # ids in ``_materialized`` must not be reused

    def materialize_own_states(self, module: nn.Module) -> None:
        """``reset_parameters()`` path: materialise ``module``'s own meta tensors (no-op otherwise)."""
        if self.param_init_fn is not None or module in self.ignored_modules:
            return
        own = [*module.named_parameters(recurse=False, remove_duplicate=False),
               *module.named_buffers(recurse=False, remove_duplicate=False)]
        meta = [(name, tensor) for name, tensor in own if tensor.is_meta]
        if not meta:
            return
        already_initialized = []  # (tensor materialised by an earlier owner, its value)
        for name, tensor in meta:
            earlier = self._materialized.get(id(tensor))
            replacement = earlier() if earlier is not None else None
            if replacement is not None:
                already_initialized.append((replacement, replacement.detach().clone()))
            else:
                replacement = torch.empty_like(tensor, device=self.device)
                if isinstance(tensor, nn.Parameter):
                    replacement = nn.Parameter(replacement, requires_grad=tensor.requires_grad)
                self._materialized[id(tensor)] = weakref.ref(replacement)
                self._keep_alive.append(tensor)
            setattr(module, name, replacement)  # re-registers under the same kind and name
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            with torch.no_grad():
                reset()
                for tensor, value in already_initialized:
                    tensor.copy_(value)

    def materialize_unit(self, root: nn.Module) -> None:
        """Materialise whatever of ``root``'s unit is still on the meta device."""
        modules = unit_modules(root, self.ignored_modules, breadth_first=self.param_init_fn is not None)
        if self.param_init_fn is None:
            for module in modules:
                self.materialize_own_states(module)
        elif any(t.is_meta for m in modules for t in _own_tensors(m)):
            for module in modules:
                self.param_init_fn(module)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module, mesh: DeviceMesh, ignored_modules: set[nn.Module],
                         ignored_params: set[nn.Parameter]) -> None:
    """``sync_module_states``: every rank gets mesh-rank 0's parameters and buffers of this unit
    (nested units synced before they were sharded). Works on CPU with gloo, unlike FSDP1."""
    tensors = [t.data if isinstance(t, nn.Parameter) else t
               for m in unit_modules(module, ignored_modules) for t in _own_tensors(m)
               if t not in ignored_params and not isinstance(t, DTensor)]
    if not tensors:
        return
    # Along the replicate dimension first, then within each shard group: all end with (0, 0)'s.
    for group in mesh.get_all_groups():
        source = dist.get_global_rank(group, 0)
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=group)
