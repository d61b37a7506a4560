"""Runtime controls around training steps: ``no_sync``, ``clip_grad_norm_``, ``summon_full_params``,
comm hooks, forward prefetch and recovery after a step that raised."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _engine, _engine_flat, _mixed_precision
from ._collectives import agreement_codes, all_ranks_agree, failure_code, raise_agreed
from ._tensor_layout import gather_full_tensors, shard_like
from ._common import TrainingState, warn_once
from ._mesh import HYBRID_STRATEGIES
from ._unit_state import UnitState, state_of, units_in
from .api import ShardingStrategy


# Everything our forward does around the engine's hooks runs outside a ``torch.compile`` graph, as the
# engine's own hooks (dynamo would trace into the views' bookkeeping: tensor identities, ``.data`` swaps).
@torch.compiler.disable
def pre_forward(unit: UnitState, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A wrapper's work before its wrapped module runs: the root's :func:`root_pre_forward`, and in the
    first forward, this unit's place in the forward order."""
    if unit.is_root:
        args, kwargs = root_pre_forward(unit, args, kwargs)
    if unit.order_recorder is not None:  # the first forward: record the order
        unit.order_recorder.append(unit)
        unit.order_recorder = None
    return args, kwargs


def root_pre_forward(root: UnitState, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    units = units_in(root.wrapper)  # walked once per step, shared by the steps below
    if _engine.in_backward():
        # Activation-checkpoint recompute of the root's forward: as in FSDP1, only the inputs are cast
        # again; the writeback, recovery and prefetch set-up belong to the forward it repeats.
        return _mixed_precision.root_pre_forward(root, units, args, kwargs, recompute=True)
    _engine_flat.writeback(unit.module for unit in units)  # users' edits on plain views reach the engine
    # FSDP1 runs a forward inside summon_full_params, but reshards the parameters under the open
    # context and trains wrongly afterwards; a clear error is better.
    if any(unit.training_state == TrainingState.SUMMON_FULL_PARAMS for unit in units):
        raise AssertionError("Cannot run forward inside summon_full_params(); exit the context first "
                             "(inside it the parameters are full copies, for reading or editing)")
    # After a forward or backward that raised midway (FSDP1 stays mid-iteration), the engine is reset: that
    # step's unreduced gradients (and no_sync accumulation) are dropped, reduced ones stay until zero_grad().
    if _engine.recover_interrupted_iteration(root.module):
        _engine_flat.forget_given(unit.module for unit in units)
        warn_once("recovered_iteration", "A previous forward or backward raised midway; "
                  "fsdp_compat reset the FSDP engine and dropped that step's unreduced gradients. "
                  "Call optimizer.zero_grad() after such a step if it may have reduced some.")
    if root.forward_order is None:  # the first forward: the units record their order in it
        root.forward_order = []
        for unit in units:
            unit.order_recorder = root.forward_order
            unit.exec_order_data = root.exec_order_data  # shared from now on, as FSDP1's lazy init does
    else:
        _prefetch_in_recorded_order(root, units)
    return _mixed_precision.root_pre_forward(root, units, args, kwargs)


def _prefetch_in_recorded_order(root: UnitState, units: list[UnitState]) -> None:
    """FSDP1's ``forward_prefetch``: a unit all-gathers the next ``_forward_prefetch_limit`` units (first
    forward's order) as it starts. A ``_backward_prefetch_limit`` above 1 (FSDP1 prefetches one unit
    ahead, as the engine does by itself) makes each unit all-gather that many preceding ones in backward."""
    limits = root.exec_order_data
    forward_limit, backward_limit = int(limits._forward_prefetch_limit), int(limits._backward_prefetch_limit)
    prefetch_forward = forward_limit > 0 and any(unit.forward_prefetch for unit in units)
    if not prefetch_forward and backward_limit <= 1:
        return
    order = [unit for unit in root.forward_order or [] if _engine.engine_state(unit.module) is not None]
    for index, current in enumerate(order):
        engine_unit = cast(_engine.FSDPModule, current.module)
        if prefetch_forward and current.forward_prefetch:
            following = order[index + 1:index + 1 + forward_limit]
            engine_unit.set_modules_to_forward_prefetch([cast(_engine.FSDPModule, u.module) for u in following])
        if backward_limit > 1 and current.backward_prefetch is not None:
            preceding = order[max(index - backward_limit, 0):index][::-1]  # backward runs them last first
            engine_unit.set_modules_to_backward_prefetch([cast(_engine.FSDPModule, u.module) for u in preceding])


@contextlib.contextmanager
def no_sync(root: UnitState) -> Generator[None, None, None]:
    """Skip gradient reduction inside the context; the next synced backward reduces the total.
    The flags are restored on exit, so nested use keeps syncing off until the outermost exit."""
    if not root.is_root:
        raise RuntimeError("`no_sync()` on inner FSDP instances is not supported. Please call "
                           "`no_sync()` on root FSDP module.")
    with _engine.gradient_sync_suspended([unit.module for unit in units_in(root.wrapper)]):
        yield


def _as_float(value: Any, name: str, expected: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name} must be {expected}, got {value!r}") from error


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) gradient; an alias, so in-place ops reach it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class _Agreement:
    """A check's outcome on this rank, to be agreed on by every rank of ``group`` (the unit's whole mesh)
    inside the first all-reduce the norm makes over that group, instead of an all-reduce of its own."""

    code: int  # _collectives.failure_code
    group: Any
    codes: torch.Tensor | None = None  # every global rank's code, once exchanged


def _total_norm(grads: list[tuple[torch.Tensor, torch.Tensor]], norm_type: float,
                device: torch.device, agreement: _Agreement | None = None) -> torch.Tensor:
    """FSDP1's total norm over every rank's gradients, in FP32. ``grads``: ``(local part, gradient it belongs
    to)``; each group sharded on the same mesh dims is reduced over those dims only (a hybrid replica's
    copy counts once); replicated and plain ones (``NO_SHARD``, ignored parameters) are added locally,
    last, as in FSDP1. Not ``torch.nn.utils.get_total_norm`` (measured): it computes in the gradients'
    dtype, cannot mix DTensors of different meshes or with plain tensors, and its inf norm fails on an
    empty shard. ``agreement``: its codes ride along in the first all-reduce over its group, if any."""
    infinite = math.isinf(norm_type)
    by_sharding: dict[tuple[Any, tuple[int, ...]], list[torch.Tensor]] = {}
    for part, grad in grads:
        dims = tuple(i for i, p in enumerate(grad.placements) if p.is_shard()) if isinstance(grad, DTensor) else ()
        mesh = cast(DTensor, grad).device_mesh if dims else None
        by_sharding.setdefault((mesh, dims), []).append(part.detach())
    by_sharding[(None, ())] = by_sharding.pop((None, ()), [])  # the unreduced ones last
    total = torch.zeros((), dtype=torch.float32, device=device)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    for (mesh, dims), parts in by_sharding.items():
        norms = [torch.linalg.vector_norm(part, norm_type, dtype=torch.float32).to(device)
                 for part in parts if part.numel() > 0]  # an empty shard adds nothing
        local = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros_like(total)
        local = local if infinite else local ** norm_type
        for dim in dims:
            group = mesh.get_group(dim)
            if agreement is not None and agreement.codes is None and group is agreement.group:
                # [this rank's norm part, every rank's code]: each code is set by its own rank only, so
                # the sum and the maximum alike deliver it (also if a failing rank's op differs).
                packed = torch.zeros(1 + dist.get_world_size(), dtype=torch.float32, device=device)
                packed[0], packed[1 + dist.get_rank()] = local, agreement.code
                dist.all_reduce(packed, op=op, group=group)
                local, agreement.codes = packed[0], packed[1:].round().to(torch.int32).cpu()
            else:
                dist.all_reduce(local, op=op, group=group)
        total = torch.maximum(total, local) if infinite else total + local
    return total if infinite else total ** (1.0 / norm_type)


@torch.no_grad()
def _clip_whole_gradients(params: Iterable[nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    """FSDP1's clipping where no unit shards (``NO_SHARD``, one rank: every gradient whole on every
    rank): ``torch.nn.utils.clip_grad_norm_`` over ``parameters()``, in their order, on each gradient's
    local tensor (a replicated ``DTensor``'s would make the total a ``DTensor``). Unlike the sharded
    rule, the norms and the total are in the gradients' dtype and the coefficient is not rounded to
    it: with BF16 gradients the results differ visibly (TinyGPT's losses 3e-3 apart after 20 clipped
    steps, measured), so it is matched to the bit."""
    grads = [_local(param.grad) for param in params if param.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type)
    _engine.multiply_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # torch's foreach multiply
    return total


def _check_clip_arguments(unit: UnitState, max_norm: Any, norm_type: Any) -> tuple[float, float]:
    if not unit.is_root:
        raise RuntimeError("`clip_grad_norm_()` should only be called on the root FSDP instance")
    max_norm = _as_float(max_norm, "max_norm", "a non-negative number")
    norm_type = _as_float(norm_type, "norm_type", "a positive number or 'inf'")
    if not max_norm >= 0:  # also catches NaN
        raise ValueError(f"max_norm must be a non-negative number, got {max_norm}: a negative bound "
                         "would flip the gradients' sign")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type}")
    return max_norm, norm_type


def clip_grad_norm_(unit: UnitState, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
    """Clip all gradients in place by their total norm over every rank; return that norm. FSDP1's two
    rules: where no unit shards, ``torch.nn.utils.clip_grad_norm_`` (:func:`_clip_whole_gradients`);
    otherwise its own: per-gradient FP32 norms (per flat gradient with ``use_orig_params=False``), their
    ``norm_type`` powers all-reduced, the coefficient ``min(max_norm / (total + 1e-6), 1)`` cast to each
    gradient's dtype (``clip_grads_with_norm_`` does not, so bf16 results would differ, and it refuses
    DTensor and plain gradients together), and FSDP1's return dtype (FP32, with a warning, without
    gradients). Each rank's elements are the engine's (each parameter's dim-0 chunk), not FSDP1's flat
    chunk: the total differs from FSDP1's by float32 rounding (README, "Runtime controls")."""
    units = units_in(unit.wrapper)
    if all(each.sharding_strategy == ShardingStrategy.NO_SHARD for each in units):
        # FSDP1 communicates nothing here (every gradient is whole on every rank): checked on this rank alone.
        max_norm, norm_type = _check_clip_arguments(unit, max_norm, norm_type)
        # No writeback first: the gradients the user sees are scaled in place, and a gradient the user
        # replaced reaches the engine, scaled, at the next writeback (forward, entry points).
        return _clip_whole_gradients(unit.wrapper.parameters(), max_norm, norm_type)
    # Arguments computed per rank may be bad on one rank only: all ranks raise, no gradient changes. On a
    # 1-D mesh the ranks agree inside the norm's own all-reduce (FSDP1's one collective), else beforehand.
    subject, consequence = "The clip_grad_norm_() arguments", "no gradient was clipped on any rank"
    groups = unit.device_mesh.get_all_groups()
    agreement: _Agreement | None = None
    if len(groups) != 1 or not dist.is_initialized():
        with all_ranks_agree(groups, subject, consequence):
            max_norm, norm_type = _check_clip_arguments(unit, max_norm, norm_type)
    else:
        error: Exception | None = None
        try:
            max_norm, norm_type = _check_clip_arguments(unit, max_norm, norm_type)
        except Exception as caught:  # noqa: BLE001 - agreed on below, then re-raised
            error, max_norm, norm_type = caught, 0.0, 2.0  # this rank still takes part in the all-reduce
        agreement = _Agreement(failure_code(error), groups[0])
    # The engine's DTensor gradients (sharded ones are counted once per shard group); plain views and flat
    # parameters alias them, so clipping those clips these.
    engine_grads, shown = _engine_flat.engine_grads((each.module, not each.use_orig_params) for each in units)
    # Beside the engine's: the ignored parameters' gradients. With plain views everywhere those are all
    # (every other parameter is shown by its unit), read without walking the model's parameters.
    others = (unit.wrapper.parameters() if any(each.dtensor_params for each in units)
              else {id(param): param for each in units for param in each.ignored_params}.values())
    grads = [*engine_grads, *((_local(param.grad), param.grad) for param in others
                              if param.grad is not None and id(param) not in shown)]
    total = _total_norm(grads, norm_type, unit.compute_device, agreement)
    if agreement is not None:
        codes = agreement.codes if agreement.codes is not None else agreement_codes(error, groups)
        raise_agreed(codes, error, groups, subject, consequence)
    if unit.cpu_offload.offload_params:
        total = total.cpu()
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    cast_coefficients: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for part, _ in grads:
        key = (part.device, part.dtype)
        if key not in cast_coefficients:
            cast_coefficients[key] = coefficient.to(part.device, part.dtype)
        part.mul_(cast_coefficients[key])
    if not grads:
        warnings.warn(f"Called FSDP.clip_grad_norm_() on rank {unit.rank} with no gradients -- "
                      f"returning the total norm in the default dtype {total.dtype}", stacklevel=3)
        return total
    return total.to(functools.reduce(torch.promote_types, [part.dtype for part, _ in grads]))


@dataclass
class _SummonedParam:
    """One managed parameter while its unit is summoned."""

    sharded: DTensor                      # the engine's sharded parameter: the truth
    slots: list[_engine.ParamSlot]        # where it is registered (several for a tied weight)
    registered: nn.Parameter              # what the slots held before (restored on exit)
    full: nn.Parameter | None = None      # what they hold inside; None where this rank keeps shards
    keeps_grad_edits: bool = False        # NO_SHARD: gradient edits persist whatever ``writeback`` says

    def restore(self, writeback: bool, with_grads: bool) -> None:
        """Write the (possibly edited or replaced) full parameter back, then restore the shards.
        Gradient edits persist with ``writeback`` and, as in FSDP1 (whose ``NO_SHARD`` gradients
        inside are the unit's own), under ``NO_SHARD`` whatever ``writeback`` says."""
        if self.full is not None:
            current = getattr(*self.slots[0])  # ``fn`` in ``apply`` may have assigned a new one
            # Only a plain tensor of the full shape can be written back. Every rank holds the same
            # full values and copies its own part into its shard: no communication.
            if (isinstance(current, torch.Tensor) and not isinstance(current, DTensor)
                    and current.shape == self.sharded.shape):
                with torch.no_grad():
                    if writeback:
                        self.sharded.to_local().copy_(shard_like(current, self.sharded).to_local())
                    grad = cast(DTensor | None, self.sharded.grad)
                    if (with_grads and (writeback or self.keeps_grad_edits) and current.grad is not None
                            and grad is not None):
                        grad.to_local().copy_(shard_like(current.grad, grad).to_local())
            _engine.register_param(self.slots, self.registered)
        # A rank that kept its shards (``rank0_only``) replaced nothing: its slots hold what the user sees
        # (with ``use_orig_params=False``, plain tensor attributes that registering would turn into parameters).


def _validate_summon_args(units: list[UnitState], writeback: bool, rank0_only: bool,
                          offload_to_cpu: bool, with_grads: bool) -> None:
    """FSDP1's rejected combinations, with its exception types and order."""
    if with_grads and offload_to_cpu:
        raise NotImplementedError("with_grads=True together with offload_to_cpu=True is not "
                                  "supported (as in FSDP1); pass offload_to_cpu=False to see gradients")
    if offload_to_cpu and any(u.sharding_strategy == ShardingStrategy.NO_SHARD for u in units):
        raise NotImplementedError("offload_to_cpu=True and NO_SHARD is not supported (as in FSDP1); "
                                  "NO_SHARD parameters are already full: pass offload_to_cpu=False")
    if writeback and rank0_only:
        raise NotImplementedError("writeback=True and rank0_only=True is not supported (as in FSDP1): "
                                  "only rank 0 would hold the edits. Pass writeback=False to read on "
                                  "rank 0, or rank0_only=False to edit")
    if offload_to_cpu and not rank0_only:  # FSDP1 warns on every such call too
        warnings.warn("offload_to_cpu=True and rank0_only=False copy the full parameters to CPU "
                      "memory on every rank, which risks CPU OOM where ranks share a host; "
                      "offload_to_cpu=True is meant for rank0_only=True.", stacklevel=4)


def _summon_unit(unit: UnitState, keep_shards: bool, offload_to_cpu: bool,
                 with_grads: bool, summoned: list[_SummonedParam]) -> None:
    """Gather the unit's parameters (every rank takes part) in their own precision, as FSDP1 shows
    them (the engine's unshard gathers in ``param_dtype``, into its own buffers), and register the full
    ones; each is in ``summoned`` before it is replaced, so that a failure midway still restores it."""
    # NO_SHARD: also under rank0_only, where the other ranks edit their (whole) gradients in place.
    keeps_grad_edits = unit.sharding_strategy == ShardingStrategy.NO_SHARD
    items = []
    for engine_sharded, slots in _engine.unit_param_slots(unit.module):
        registered = getattr(*slots[0])
        # Normally the same object; the registered one wins if the user swapped in a new DTensor.
        items.append(_SummonedParam(registered if isinstance(registered, DTensor) else engine_sharded,
                                    slots, registered, keeps_grad_edits=keeps_grad_edits))
    summoned.extend(items)
    # One all-gather for the whole unit (per dtype), not one per parameter.
    values = gather_full_tensors([item.sharded for item in items], unit.compute_device)
    with_grad = [item for item in items if with_grads and item.sharded.grad is not None]
    grads = gather_full_tensors([cast(DTensor, item.sharded.grad) for item in with_grad], unit.compute_device)
    grad_of = {id(item): grad for item, grad in zip(with_grad, grads)}
    for item, value in zip(items, [] if keep_shards else values):
        value = value.cpu() if offload_to_cpu else value.to(unit.compute_device)
        item.full = nn.Parameter(value, requires_grad=item.sharded.requires_grad)
        item.full.grad = grad_of.get(id(item))
        _engine.register_param(item.slots, item.full)


def check_idle_for_apply(unit: UnitState) -> None:
    """``apply`` summons the unit itself: FSDP1's ``ValueError`` (its text) when it is not idle."""
    if unit.training_state != TrainingState.IDLE:
        raise ValueError(f"expected to be in states {[TrainingState.IDLE]} but current state is "
                         f"{unit.training_state}: apply() gathers the full parameters itself, so call it "
                         "outside summon_full_params()")


@contextlib.contextmanager
def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                       rank0_only: bool = False, offload_to_cpu: bool = False,
                       with_grads: bool = False) -> Generator[None, None, None]:
    """Full parameters on the original modules inside the context, as FSDP1's static method.

    ``recurse=False`` summons only ``module``'s own unit (nothing when ``module`` is not a
    wrapper). With ``rank0_only``, ranks other than 0 keep their shards.
    """
    own = state_of(module)
    units = units_in(module) if recurse else [own] if own is not None else []
    # Arguments bad on one rank only must not leave the others waiting in the gathers.
    with all_ranks_agree(units[0].device_mesh.get_all_groups() if units else [],
                         "The summon_full_params() arguments", "no parameters were gathered on any rank"):
        _validate_summon_args(units, writeback, rank0_only, offload_to_cpu, with_grads)
        for unit in units:
            if unit.training_state == TrainingState.SUMMON_FULL_PARAMS:
                raise AssertionError("Cannot manually unshard parameters when already unsharding parameters "
                                     "(this module is inside an open summon_full_params(); use recurse=False "
                                     "on the outer call to summon inner modules separately)")
            if _engine.iteration_in_progress(unit.module):
                raise AssertionError("Cannot manually unshard parameters during forward/backward; call "
                                     "summon_full_params() before the forward or after the backward")
    summoned: list[_SummonedParam] = []
    # The engine's DTensors registered throughout (plain views come back after the restore below), but
    # where a rank keeps its shards (``rank0_only``): there the user sees its plain views, as in FSDP1.
    _engine_flat.writeback(unit.module for unit in units)
    with _engine_flat.engine_params(unit.module for unit in units if not (rank0_only and unit.rank != 0)):
        try:
            with contextlib.ExitStack() as hooks_suspended:
                for unit in units:
                    unit.training_state = TrainingState.SUMMON_FULL_PARAMS
                    keep_shards = rank0_only and unit.rank != 0
                    _summon_unit(unit, keep_shards, offload_to_cpu, with_grads, summoned)
                    if not keep_shards:
                        # A forward of the inner modules (``generate`` on ``model.module``) runs on
                        # the full parameters in their own precision, as in FSDP1.
                        hooks_suspended.enter_context(_engine.forward_hooks_suspended(unit.module))
                yield
        finally:
            for item in summoned:
                item.restore(writeback, with_grads)
            for unit in units:
                unit.training_state = TrainingState.IDLE


def register_comm_hook(root: UnitState, state: object, hook: Callable[..., Any]) -> None:
    """FSDP1's ``register_comm_hook``: ``hook`` replaces the gradient communication of every unit,
    once per unit per synced backward: ``hook(state, grad, output)`` for sharded units (the unit's
    flat, padded local gradient; this rank's reduced chunk), ``hook(state, grad)`` for ``NO_SHARD``
    ones (all-reduce in place). The hook does its own averaging, as torch's default hooks do."""
    units = units_in(root.wrapper)
    # A hook registered on some ranks only would pair its collectives with the engine's default
    # ones on the others: all ranks check first, with FSDP1's checks, order and types.
    with all_ranks_agree(root.device_mesh.get_all_groups(), "The register_comm_hook() arguments",
                         "no hook was registered on any rank"):
        if not root.is_root:
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        for unit in units:
            if unit.sharding_strategy in HYBRID_STRATEGIES:
                raise AssertionError(f"Communication hook is not supported for hybrid strategies: "
                                     f"{unit.sharding_strategy}")
            if unit.comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
        if not callable(hook):
            raise ValueError(f"The communication hook must be callable but got {hook}")
    for unit in units:
        unit.comm_hook = hook
        unit.comm_hook_state = state
        _engine.install_comm_hook(unit.module, hook, state)
