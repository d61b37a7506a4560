"""Optimizers built before wrapping keep training the wrapped model.

FSDP1 with ``use_orig_params=True`` keeps every ``nn.Parameter`` object, so an optimizer built on the
unwrapped model (Fabric's ``setup``, accelerate's ``prepare``) keeps training it. The engine's
``DTensor`` parameters cannot take the originals' place (``__slots__``: ``swap_tensors`` refuses), so
we record which parameter replaced which, and before an optimizer steps (a global step pre-hook) or
exports its state, point its ``param_groups`` (and state) at the current ones.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from . import _engine_flat
from ._tensor_layout import shard_like

# Weak on the parameter: a strong one would keep each unit's full tensors alive after sharding.
ParamSlots = list[tuple[nn.Module, str, "weakref.ref[nn.Parameter]"]]

# original parameter -> the parameter that replaced it (the entry goes with the original).
_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()
_generation = 0  # bumped on every new replacement, so checked optimizers are checked again
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_hook_handle: Any = None


def param_slots(module: nn.Module) -> ParamSlots:
    """Every ``(module, attribute, parameter)`` in ``module``'s tree (a tied weight once per slot)."""
    return [(owner, name, weakref.ref(param)) for owner in module.modules()
            for name, param in owner.named_parameters(recurse=False, remove_duplicate=False)]


def remember_replacements(before: ParamSlots) -> None:
    """Record, for each slot of ``before``, the parameter the module holds there now."""
    global _generation, _hook_handle
    for owner, name, reference in before:
        original = reference()
        current = dict(owner.named_parameters(recurse=False, remove_duplicate=False)).get(name)
        if original is None or current is None or current is original or original in _replaced:
            continue
        _replaced[original] = current
        _generation += 1
    if _generation and _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: rebind_optimizer(optimizer))


def rebind_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point ``optimizer`` at the parameters the wrapped models hold now (no-op when it does)."""
    if not _generation or _checked.get(optimizer) == _generation:
        return
    for group in optimizer.param_groups:
        params = group["params"]
        for index, param in enumerate(params):
            current = param
            while current in _replaced:  # a replacement may have been replaced since (rewrapping)
                current = _replaced[current]
            view = _engine_flat.view_of_sharded(current)
            if view is not None:  # FSDP1's plain local-shard view shows that DTensor now
                current = view
            elif _engine_flat.hidden_in_flat_parameter(current):
                # FSDP1's flat parameters replace the originals: an optimizer built on those before
                # wrapping steps nothing (FSDP1's behaviour; README, limits). Re-pointing it at the
                # hidden DTensors would step them behind the flat parameters' back.
                continue
            if current is param:
                continue
            params[index] = current
            if param in optimizer.state:
                optimizer.state[current] = _moved_state(optimizer.state.pop(param), current)
    _checked[optimizer] = _generation


def _moved_state(state: dict[str, Any], new: torch.Tensor) -> dict[str, Any]:
    """A replaced parameter's state (stepped before wrapping) in ``new``'s layout: per-element
    tensors cut to this rank's shard (no communication), the rest kept."""
    view_of = _engine_flat.sharded_of_view(new) if isinstance(new, nn.Parameter) else None
    if view_of is not None:  # FSDP1's plain local-shard view: the state of its 1-D local piece
        return {key: _engine_flat.as_plain_value(value) for key, value in _moved_state(state, view_of).items()}
    if not isinstance(new, DTensor):
        return state
    return {key: shard_like(value.to(new.dtype) if value.is_floating_point() else value, new)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            and value.shape == new.shape and value.dim() > 0 else value
            for key, value in state.items()}
