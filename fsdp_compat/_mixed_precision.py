"""FSDP1's ``MixedPrecision`` and ``CPUOffload`` on the engine's policies, plus what the engine lacks.

Field by field (FSDP1 semantics, and who implements them):

* ``param_dtype`` / ``reduce_dtype``: the engine's ``MixedPrecisionPolicy`` (``reduce_dtype=None``
  is passed as ``param_dtype``, FSDP1's meaning); sharded master parameters keep their dtype.
* ``cast_forward_inputs``: the engine's per-unit input cast. ``cast_root_forward_inputs``: ours,
  at the root wrapper (:func:`root_pre_forward`).
* ``buffer_dtype``: ours. Like FSDP1, buffers are cast once, when the root runs its first forward,
  each to the ``buffer_dtype`` of the innermost unit that holds it; their original dtypes are
  recorded at construction for state dicts (:func:`original_buffer_dtypes`).
* ``keep_low_precision_grads``: ours. The engine always hands the optimizer gradients in the
  parameter dtype; a post-accumulate-grad hook on each sharded parameter (the engine calls these
  after it writes ``.grad``) turns them into ``param_dtype`` gradients.
* ``_module_classes_to_ignore``: with an auto-wrap policy, modules of those classes become their
  own units with ``mixed_precision=None`` and run on fp32 inputs (:func:`prepare_individually_wrapped`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
import weakref
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn
from torch.nn.utils.rnn import PackedSequence

from . import _engine
from ._common import clean_name, warn_once
from ._engine import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ._unit_state import UnitState, units_with_paths
from .api import CPUOffload, MixedPrecision

# FSDP1's switch for running eval-mode forwards in full precision; the engine fixes the compute
# dtype of a unit at its first all-gather, so we can only say that it is not honoured.
_FULL_PRECISION_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"
# Marks a sharded parameter whose gradients are kept in low precision (and in which dtype). It is
# a Python attribute of the parameter, like its hooks, so a tensor swap removes both together.
_LOW_PRECISION_GRAD_MARK = "_fsdp_compat_low_precision_grad_dtype"


def engine_policy(mixed_precision: MixedPrecision | None) -> MixedPrecisionPolicy:
    """The engine's policy for FSDP1's ``MixedPrecision`` (parameter and reduction dtypes).

    FSDP2 defaults ``cast_forward_inputs`` to True; FSDP1 to False, so it is always passed.
    FSDP1's ``reduce_dtype=None`` reduces (and accumulates ``no_sync`` gradients) in
    ``param_dtype``; the engine's ``None`` means that only before torch 2.15 (from 2.15 it means
    the parameter's own dtype), so ``param_dtype`` is passed explicitly: the same on every torch.
    """
    if mixed_precision is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype or mixed_precision.param_dtype,
        cast_forward_inputs=mixed_precision.cast_forward_inputs,
    )


def engine_offload_policy(cpu_offload: CPUOffload, device: torch.device) -> OffloadPolicy:
    """The engine's offload policy; pinned host memory only helps (and only works) with a GPU."""
    if not cpu_offload.offload_params:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.type == "cuda")


# Input dtype of each overridden module's last forward, to cast its outputs back (as FSDP1).
_input_dtype_of: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()


def prepare_individually_wrapped(module: nn.Module,
                                 mixed_precision: MixedPrecision | None) -> tuple[type[nn.Module], ...]:
    """FSDP1's treatment of ``_module_classes_to_ignore`` under an auto-wrap policy.

    Returns the classes that the wrap planner must wrap on their own with ``mixed_precision=None``.
    Like FSDP1, every instance of them (ignored ones too) gets ``_wrap_overrides`` (read by
    :func:`fsdp_compat.wrap.wrap`) and forward hooks that run it on fp32 inputs and cast its
    outputs back to the input dtype, so the low-precision modules around it see what they expect.
    FSDP1 does this only with an auto-wrap policy; without one such modules run in ``param_dtype``.
    """
    if mixed_precision is None:
        return ()
    classes = tuple(set(mixed_precision._module_classes_to_ignore))
    if not classes:
        return ()
    overridden: set[type[nn.Module]] = set()
    for submodule in module.modules():
        if isinstance(submodule, classes):
            overridden.add(type(submodule))
            submodule._wrap_overrides = {"mixed_precision": None}  # type: ignore[assignment]
            # Appended, so they run after every other hook, as in FSDP1.
            submodule.register_forward_pre_hook(_cast_inputs_to_full_precision)
            submodule.register_forward_hook(_cast_outputs_to_input_dtype)
    if overridden:
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
            f"module has submodules of type:\n{overridden}\nThese modules will be wrapped as "
            "separate FSDP instances with mixed precision disabled.",
            stacklevel=3,
        )
    return classes


def _cast_inputs_to_full_precision(module: nn.Module, args: Any) -> Any:
    return _map_floating_tensors(args, functools.partial(_cast_and_record, module, torch.float32),
                                 skip_dtype=torch.float32)


def _cast_outputs_to_input_dtype(module: nn.Module, args: Any, output: Any) -> Any:
    dtype = _input_dtype_of.get(module)
    if dtype is None:  # no floating-point input was ever cast: nothing to restore (FSDP1 too)
        return None
    return _map_floating_tensors(output, functools.partial(_cast_and_record, module, dtype),
                                 skip_dtype=dtype)


def _cast_and_record(module: nn.Module, dtype: torch.dtype, tensor: torch.Tensor) -> torch.Tensor:
    # FSDP1 records the dtype of every tensor it casts, outputs included: the next forward with
    # fp32 inputs then leaves the outputs in fp32. Same bookkeeping, same behaviour.
    _input_dtype_of[module] = tensor.dtype
    return tensor.to(dtype)


def init_unit(unit: UnitState) -> None:
    """Per-unit set-up after the engine is applied."""
    _install_low_precision_grad_hooks(unit)
    if os.environ.get(_FULL_PRECISION_IN_EVAL_ENV) == "1" and unit.mixed_precision is not None:
        warn_once(_FULL_PRECISION_IN_EVAL_ENV, f"{_FULL_PRECISION_IN_EVAL_ENV}=1 is not honoured: "
                  "eval-mode forwards run in MixedPrecision.param_dtype like training ones "
                  "(see README, 'Mixed precision and CPU offload').")


def root_pre_forward(root: UnitState, units: list[UnitState], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What FSDP1's root does for mixed precision before each forward.

    The first time, buffers get their computation dtype (FSDP1's lazy initialisation); every
    time, low-precision-gradient hooks are re-installed where missing (``module.to()`` and the
    flat-parameter upcast swap fresh contents into the parameters, and the hooks leave with the
    old ones) and the root's floating-point inputs are cast.
    """
    if not root.buffers_cast_for_computation:
        _cast_buffers_for_computation(units)
        root.buffers_cast_for_computation = True
    for unit in units:
        _install_low_precision_grad_hooks(unit)
    policy = root.mixed_precision  # FSDP1's cast_root_forward_inputs: to param_dtype, at the root
    if policy is None or policy.param_dtype is None or not policy.cast_root_forward_inputs:
        return args, kwargs
    return cast_floating_tensors(args, policy.param_dtype), cast_floating_tensors(kwargs, policy.param_dtype)


@torch.no_grad()
def _cast_buffers_for_computation(units: list[UnitState]) -> None:
    """Cast each floating-point buffer to the ``buffer_dtype`` of the innermost unit holding it.

    ``units`` is in pre-order; walking it backwards visits inner units first, so the owning
    unit's setting wins (a batch-norm unit with ``mixed_precision=None`` keeps fp32 buffers).
    Buffers of ignored modules are left alone, as in FSDP1.
    """
    visited: set[int] = set()
    for unit in reversed(units):
        dtype = unit.mixed_precision.buffer_dtype if unit.mixed_precision is not None else None
        ignored = {id(buffer) for module in unit.ignored_modules for buffer in module.buffers(recurse=False)}
        for buffer in unit.wrapper.buffers():
            if id(buffer) in visited:
                continue
            visited.add(id(buffer))
            if dtype is not None and id(buffer) not in ignored and buffer.is_floating_point():
                buffer.data = buffer.to(dtype)


def original_buffer_dtypes(root: nn.Module) -> dict[str, torch.dtype]:
    """Clean buffer FQN (relative to ``root``) -> dtype to restore in FULL / SHARDED state dicts.

    FSDP1 restores a buffer's original dtype in those state dicts when buffer mixed precision is
    enabled for a unit whose subtree holds it (it clones the buffer first: the live buffer stays
    in ``buffer_dtype``). Buffers of ignored modules are not listed (FSDP1 skips them too).
    """
    restored: dict[str, torch.dtype] = {}
    for path, unit in units_with_paths(root):
        if unit.mixed_precision is None or unit.mixed_precision.buffer_dtype is None:
            continue
        ignored = {id(b) for module in unit.ignored_modules for b in module.buffers(recurse=False)}
        ignored_names = {clean_name(name) for name, b in unit.wrapper.named_buffers() if id(b) in ignored}
        for name, dtype in unit.buffer_name_to_orig_dtype.items():
            if name not in ignored_names:
                restored.setdefault(f"{path}.{name}" if path else name, dtype)
    return restored


def _install_low_precision_grad_hooks(unit: UnitState) -> None:
    """With ``keep_low_precision_grads``, make the unit's gradients ``param_dtype`` after backward.

    The engine reduces in ``reduce_dtype``, casts to the parameter dtype and then runs the
    parameter's post-accumulate-grad hooks; ours casts to ``param_dtype`` (FSDP1 leaves ``.grad``
    in ``param_dtype`` too). A later backward without ``zero_grad`` adds the new full-precision
    gradient into the low-precision one, computing in fp32 and rounding once: what FSDP1 does
    by upcasting, adding and casting down.
    """
    policy = unit.mixed_precision
    if policy is None or not policy.keep_low_precision_grads or policy.param_dtype is None:
        return
    for param in _engine.sharded_params(unit.module):
        if not (param.requires_grad and param.is_floating_point()):
            continue
        if getattr(param, _LOW_PRECISION_GRAD_MARK, None) == policy.param_dtype:
            continue
        param.grad_dtype = None  # allow a .grad whose dtype differs from the parameter's
        param.register_post_accumulate_grad_hook(
            functools.partial(_cast_grad, dtype=policy.param_dtype))
        setattr(param, _LOW_PRECISION_GRAD_MARK, policy.param_dtype)


def _cast_grad(param: torch.Tensor, dtype: torch.dtype) -> None:
    if param.grad is not None and param.grad.dtype != dtype:
        param.grad = param.grad.to(dtype)


def cast_floating_tensors(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor not already in ``dtype`` cast to it.

    Containers are walked as FSDP1 (and the engine, for non-root units) walk them: dataclasses,
    ``OrderedDict`` and other dicts, namedtuples, lists, tuples and sets; a ``PackedSequence``
    is passed through unchanged, as FSDP1 does. Autograd history is kept.
    """
    return _map_floating_tensors(value, lambda tensor: tensor.to(dtype), skip_dtype=dtype)


def _map_floating_tensors(value: Any, fn: Any, skip_dtype: torch.dtype) -> Any:
    def visit(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return fn(item) if torch.is_floating_point(item) and item.dtype != skip_dtype else item
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            changes = {f.name: visit(getattr(item, f.name)) for f in dataclasses.fields(item) if f.init}
            return dataclasses.replace(item, **changes)
        if isinstance(item, OrderedDict):
            return type(item)((key, visit(element)) for key, element in item.items())
        if isinstance(item, PackedSequence):
            return item
        if isinstance(item, dict):
            return {key: visit(element) for key, element in item.items()}
        if isinstance(item, tuple) and hasattr(item, "_fields"):  # namedtuple
            return type(item)(*(visit(element) for element in item))
        if isinstance(item, (list, tuple, set)):
            return type(item)(visit(element) for element in item)
        return item

    return visit(value)
