"""FSDP1's ``MixedPrecision`` and ``CPUOffload`` on the engine's policies, plus what the engine lacks.

The engine does ``param_dtype``, ``reduce_dtype`` and ``cast_forward_inputs``; this module does the rest
as FSDP1: ``cast_root_forward_inputs`` and ``buffer_dtype`` at the root's forward, ``keep_low_precision_grads``
with post-accumulate-grad hooks, ``_module_classes_to_ignore`` as units of their own, and
``FSDP_USE_FULL_PREC_IN_EVAL=1`` by switching a unit's engine precision (``_engine.set_full_precision``).
"""

from __future__ import annotations

import functools
import os
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from . import _engine
from ._common import clean_name
from ._unit_state import UnitState, units_with_paths
from .api import CPUOffload, MixedPrecision

# FSDP1's switch for full-precision evaluation: units with mixed precision whose module is in eval mode
# gather, compute and reduce in their parameters' own dtype, with uncast inputs and buffers.
_FULL_PRECISION_IN_EVAL_ENV = "FSDP_USE_FULL_PREC_IN_EVAL"
# The dtype a sharded parameter's gradients are kept in; an attribute of the parameter, like its
# hooks, so a tensor swap removes both together.
_LOW_PRECISION_GRAD_MARK = "_fsdp_compat_low_precision_grad_dtype"


def engine_policy(mixed_precision: MixedPrecision) -> MixedPrecisionPolicy:
    """The engine's policy for FSDP1's ``MixedPrecision`` (defaults differ, so all passed; FSDP1's
    ``reduce_dtype=None`` means ``param_dtype``, the engine's only before torch 2.15)."""
    return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                reduce_dtype=mixed_precision.reduce_dtype or mixed_precision.param_dtype,
                                cast_forward_inputs=mixed_precision.cast_forward_inputs)


def engine_offload_policy(cpu_offload: CPUOffload, device: torch.device) -> OffloadPolicy:
    """The engine's offload policy; pinned host memory only helps (and only works) with a GPU."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload.offload_params else OffloadPolicy()


# Input dtype of each overridden module's last forward, to cast its outputs back (as FSDP1).
_input_dtype_of: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()


def prepare_individually_wrapped(module: nn.Module,
                                 mixed_precision: MixedPrecision | None) -> tuple[type[nn.Module], ...]:
    """FSDP1's ``_module_classes_to_ignore`` under an auto-wrap policy: the classes to wrap on their
    own with ``mixed_precision=None``. As in FSDP1, every instance (ignored ones too) gets
    ``_wrap_overrides`` and hooks that run it on fp32 inputs and cast outputs to the input dtype."""
    classes = tuple(set(mixed_precision._module_classes_to_ignore)) if mixed_precision is not None else ()
    overridden: set[type[nn.Module]] = set()
    for submodule in module.modules():
        if isinstance(submodule, classes):
            overridden.add(type(submodule))
            submodule._wrap_overrides = {"mixed_precision": None}  # type: ignore[assignment]
            # Appended, so they run after every other hook, as in FSDP1.
            submodule.register_forward_pre_hook(_cast_inputs_to_full_precision)
            submodule.register_forward_hook(_cast_outputs_to_input_dtype)
    if overridden:
        warnings.warn("Both mixed precision and an auto_wrap_policy were specified to FSDP, where the wrapped "
                      f"module has submodules of type:\n{overridden}\nThese modules will be wrapped as "
                      "separate FSDP instances with mixed precision disabled.", stacklevel=3)
    return classes


@torch.compiler.disable  # outside any compiled graph, as every hook of ours (README: `torch.compile`)
def _cast_inputs_to_full_precision(module: nn.Module, args: Any) -> Any:
    return _cast_floating_tensors(args, torch.float32, recording_for=module)


@torch.compiler.disable  # outside any compiled graph, as every hook of ours (README: `torch.compile`)
def _cast_outputs_to_input_dtype(module: nn.Module, args: Any, output: Any) -> Any:
    dtype = _input_dtype_of.get(module)  # None: no floating-point input was ever cast (FSDP1 too)
    return None if dtype is None else _cast_floating_tensors(output, dtype, recording_for=module)


def init_unit(unit: UnitState) -> None:
    """Per-unit set-up after the engine is applied."""
    _install_low_precision_grad_hooks(unit)
    unit.full_precision_in_eval = os.environ.get(_FULL_PRECISION_IN_EVAL_ENV, "") == "1"
    if unit.full_precision_in_eval and (unit.mixed_precision.param_dtype or unit.mixed_precision.reduce_dtype):
        _engine.follow_precision_at_each_unshard(unit.module, functools.partial(_forces_full_precision, unit))


def _forces_full_precision(unit: UnitState) -> bool:
    """FSDP1's ``_force_full_precision`` outside ``summon_full_params``: ``FSDP_USE_FULL_PREC_IN_EVAL=1``,
    the unit's module in eval mode, and its parameters computed or reduced in another dtype than their own."""
    policy = unit.mixed_precision
    if not unit.full_precision_in_eval or unit.module.training:
        return False
    params = _engine.sharded_params(unit.module)
    if not params:  # FSDP1: no handle, nothing to force
        return False
    own = params[0].dtype
    compute = policy.param_dtype or own
    return compute != own or (policy.reduce_dtype or compute) != own


def root_pre_forward(root: UnitState, units: list[UnitState], args: tuple[Any, ...], kwargs: dict[str, Any],
                     recompute: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """FSDP1's root before each forward: the first time, cast the buffers (its lazy init); every
    time, re-install low-precision-gradient hooks where missing (``module.to()`` and the flat-
    parameter upcast swap parameters' contents, taking the hooks), switch each unit to full precision
    or back (``FSDP_USE_FULL_PREC_IN_EVAL=1``; not in an activation-checkpoint ``recompute``, which
    repeats its forward's precision) and cast the root's inputs."""
    if not root.buffers_cast_for_computation:
        _cast_buffers_for_computation(units)
        root.buffers_cast_for_computation = True
    for unit in units:
        _install_low_precision_grad_hooks(unit)
    if root.full_precision_in_eval and not recompute:
        _full_precision_in_eval(root, units)
    policy = root.mixed_precision
    if (policy.param_dtype is None or not policy.cast_root_forward_inputs
            or (root.full_precision_in_eval and not root.wrapper.training)):
        return args, kwargs
    return _cast_floating_tensors((args, kwargs), policy.param_dtype)


def _full_precision_in_eval(root: UnitState, units: list[UnitState]) -> None:
    """FSDP1's ``FSDP_USE_FULL_PREC_IN_EVAL=1`` at the root's forward: each unit it forces (module in eval
    mode, mixed precision) gathers, computes and reduces in its parameters' dtype, without casting its
    inputs; the others, and all once back in training, in their policy. When the root unit is forced
    (without parameters of its own: any unit), every buffer is cast to its dtype at construction,
    and back to the computation dtypes at the first forward that is not."""
    forced = {id(unit) for unit in units if _forces_full_precision(unit)}
    for unit in units:
        if unit.full_precision_in_eval:
            _engine.set_full_precision(unit.module, id(unit) in forced)
    root_forced = id(root) in forced if _engine.sharded_params(root.module) else bool(forced)
    if root_forced:
        _cast_buffers_to_original_dtypes(root)
        root.buffers_in_full_precision = True
    elif root.buffers_in_full_precision:
        _cast_buffers_for_computation(units)
        root.buffers_in_full_precision = False


@torch.no_grad()
def _cast_buffers_to_original_dtypes(root: UnitState) -> None:
    for name, buffer in root.wrapper.named_buffers():
        dtype = root.buffer_name_to_orig_dtype.get(clean_name(name))
        if dtype is not None and buffer.is_floating_point() and buffer.dtype != dtype:
            buffer.data = buffer.to(dtype)


@torch.no_grad()
def _cast_buffers_for_computation(units: list[UnitState]) -> None:
    """Cast each floating-point buffer, except ignored modules' (``buffer_ignored_modules``, as FSDP1),
    to the ``buffer_dtype`` of the innermost unit holding it (``units`` is in pre-order: reversed, inner
    ones first)."""
    visited: set[int] = set()
    for unit in reversed(units):
        dtype = unit.mixed_precision.buffer_dtype
        skip = visited | _ignored_buffer_ids(unit)  # a unit's buffers() are distinct
        for buffer in unit.wrapper.buffers():
            if dtype is not None and id(buffer) not in skip and buffer.is_floating_point():
                buffer.data = buffer.to(dtype)
            visited.add(id(buffer))


def original_buffer_dtypes(root: nn.Module,
                           unit_paths: list[tuple[str, UnitState]] | None = None) -> dict[str, torch.dtype]:
    """Clean buffer FQN -> dtype that FULL / SHARDED state dicts restore (on a clone), as FSDP1:
    buffers under a unit with ``buffer_dtype``, except ignored modules' (``buffer_ignored_modules``).
    ``unit_paths``: :func:`units_with_paths` of ``root``, where the caller has it."""
    restored: dict[str, torch.dtype] = {}
    for path, unit in unit_paths if unit_paths is not None else units_with_paths(root):
        if unit.mixed_precision.buffer_dtype is None:
            continue
        ignored = _ignored_buffer_ids(unit)
        ignored_names = {clean_name(name) for name, b in unit.wrapper.named_buffers() if id(b) in ignored} \
            if ignored else set()
        for name, dtype in unit.buffer_name_to_orig_dtype.items():
            if name not in ignored_names:
                restored.setdefault(f"{path}.{name}" if path else name, dtype)
    return restored


def _ignored_buffer_ids(unit: UnitState) -> set[int]:
    return {id(buffer) for module in unit.buffer_ignored_modules for buffer in module.buffers(recurse=False)}


def _install_low_precision_grad_hooks(unit: UnitState) -> None:
    """``keep_low_precision_grads``: a post-accumulate-grad hook casts ``.grad`` to ``param_dtype``
    after the engine writes it (a later backward adds in fp32 and rounds once, as FSDP1)."""
    policy = unit.mixed_precision
    if not policy.keep_low_precision_grads or policy.param_dtype is None:
        return
    for param in _engine.sharded_params(unit.module):
        if (not (param.requires_grad and param.is_floating_point())
                or getattr(param, _LOW_PRECISION_GRAD_MARK, None) == policy.param_dtype):
            continue
        param.grad_dtype = None  # allow a .grad whose dtype differs from the parameter's
        param.register_post_accumulate_grad_hook(functools.partial(_cast_grad, dtype=policy.param_dtype))
        setattr(param, _LOW_PRECISION_GRAD_MARK, policy.param_dtype)


@torch.compiler.disable  # outside any compiled graph, as every hook of ours (README: `torch.compile`)
def _cast_grad(param: torch.Tensor, dtype: torch.dtype) -> None:
    if param.grad is not None and param.grad.dtype != dtype:
        param.grad = param.grad.to(dtype)


def _cast_floating_tensors(value: Any, dtype: torch.dtype, recording_for: nn.Module | None = None) -> Any:
    """``value`` with every floating-point tensor not in ``dtype`` cast to it, walking containers
    with the function FSDP1 (and the engine) use. Like FSDP1, it records for ``recording_for`` the
    dtype of every tensor it casts, outputs included."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
            return tensor
        if recording_for is not None:
            _input_dtype_of[recording_for] = tensor.dtype
        return tensor.to(dtype)

    return _engine.apply_to_tensors(cast, value)
