"""Runtime controls around training steps: no_sync, clip_grad_norm_, summon_full_params, comm hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from . import _engine
from ._common import TrainingState

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel


def init_runtime_state(wrapper: FullyShardedDataParallel) -> None:
    """Per-wrapper runtime attributes (FSDP1 names where third-party code reads them)."""
    wrapper._comm_hook = None
    wrapper._comm_hook_state = None


def check_idle_for_forward(wrapper: FullyShardedDataParallel) -> None:
    """FSDP1 forbids forward inside ``summon_full_params``."""
    if wrapper.training_state == TrainingState.SUMMON_FULL_PARAMS:
        raise AssertionError("Cannot run forward inside summon_full_params; exit the context first")


def configure_forward_prefetch(forward_order: list[FullyShardedDataParallel]) -> None:
    """``forward_prefetch=True``: each unit all-gathers the next unit (in the first iteration's
    forward order) as it starts its own forward, as FSDP1 does."""
    for current, following in zip(forward_order, forward_order[1:]):
        if current.forward_prefetch:
            current.module.set_modules_to_forward_prefetch([following.module])


@contextlib.contextmanager
def no_sync(wrapper: FullyShardedDataParallel) -> Generator[None, None, None]:
    """Skip gradient reduction inside the context; the next synced backward reduces the total."""
    if not wrapper._is_root:
        raise RuntimeError("`no_sync()` on inner FSDP instances is not supported. Please call "
                           "`no_sync()` on root FSDP module.")
    units = [unit.module for unit in wrapper.fsdp_modules(wrapper)]
    previous = [group.reduce_grads for unit in units for group in _engine.param_groups(unit)]
    for unit in units:
        unit.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        groups = [group for unit in units for group in _engine.param_groups(unit)]
        for group, reduce in zip(groups, previous):
            group.reduce_grads = reduce


def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                       rank0_only: bool = False, offload_to_cpu: bool = False,
                       with_grads: bool = False) -> contextlib.AbstractContextManager[None]:
    raise NotImplementedError


def clip_grad_norm_(wrapper: FullyShardedDataParallel, max_norm: float | int,
                    norm_type: float | int = 2.0) -> torch.Tensor:
    raise NotImplementedError


def register_comm_hook(wrapper: FullyShardedDataParallel, state: object, hook: Callable[..., Any]) -> None:
    raise NotImplementedError


def apply_with_full_params(wrapper: FullyShardedDataParallel, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
    raise NotImplementedError
