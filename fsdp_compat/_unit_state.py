"""What one wrapper (one engine unit) is, in one dataclass: feature modules take a :class:`UnitState`
(or a root's list of them), never the wrapper class, and ask "is this a wrapper?" only through :func:`state_of`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import _engine
from ._common import FSDP_WRAPPED_MODULE, TrainingState, clean_module_path
from .api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision,
                  OptimStateDictConfig, ShardingStrategy, StateDictConfig, StateDictType)

# Looked up in the instance's own ``__dict__``: modules that forward unknown attributes to an inner
# module (PEFT's, accelerate's) must not pass for the wrapper they hold.
STATE_ATTR = "_fsdp_compat_state"


@dataclasses.dataclass(eq=False)
class ExecOrderData:
    """FSDP1's ``_exec_order_data`` as trainers (Composer) tune it: how many units ahead to all-gather
    in forward (with ``forward_prefetch``) and in backward (with a ``backward_prefetch``). A root shares
    its own with its units at its first forward, as FSDP1 does; ``_runtime`` maps the root's onto the
    engine's explicit prefetching."""

    _forward_prefetch_limit: int = 1
    _backward_prefetch_limit: int = 1


@dataclasses.dataclass(slots=True, eq=False)
class UnitState:
    """One wrapper's state, as FSDP2's ``FSDPState`` is one ``fully_shard`` unit's."""

    wrapper: nn.Module  # the FullyShardedDataParallel instance: its tree's names carry the prefixes
    sharding_strategy: ShardingStrategy
    cpu_offload: CPUOffload
    mixed_precision: MixedPrecision  # FSDP1's: ``MixedPrecision()`` when none was given
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool  # FSDP1 checkpoint layouts; with plain views (dtensor_params False) also views vs flat
    dtensor_params: bool  # the engine's DTensor parameters shown, not FSDP1's plain local views (_engine_flat)
    sync_module_states: bool
    ignored_modules: set[nn.Module]
    ignored_params: set[nn.Parameter]
    compute_device: torch.device
    device_mesh: DeviceMesh
    # Whether the user built the wrapper (or the auto-wrapping root) with a ``device_mesh``: FSDP1
    # then gives SHARDED state as ``DTensor``, else as ``ShardedTensor``.
    device_mesh_given: bool
    process_group: dist.ProcessGroup = dataclasses.field(init=False)  # the shard group (last mesh dim)
    rank: int = dataclasses.field(init=False)  # in the shard group
    world_size: int = dataclasses.field(init=False)
    is_root: bool | None = True  # False once an enclosing wrapper is built around this one
    training_state: TrainingState = TrainingState.IDLE
    # forward_prefetch: the root's units in its first forward's order, each appending itself to
    # the list its ``order_recorder`` names once.
    forward_order: list[UnitState] | None = None
    order_recorder: list[UnitState] | None = None
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config: StateDictConfig = dataclasses.field(default_factory=FullStateDictConfig)
    optim_state_dict_config: OptimStateDictConfig = dataclasses.field(default_factory=FullOptimStateDictConfig)
    comm_hook: Callable[..., Any] | None = None
    comm_hook_state: object = None
    # The modules whose buffers FSDP1 leaves alone in this unit (no ``buffer_dtype`` cast, the buffer
    # itself in FULL / SHARDED state dicts): its ignored modules and, as FSDP1 collects them, those of
    # the units nested in it. Set by the constructor; empty for a unit an auto-wrap policy made, since
    # FSDP1 passes such units the ignored parameters only, not the modules.
    buffer_ignored_modules: set[nn.Module] = dataclasses.field(default_factory=set)
    # Clean buffer name (relative to the unit) -> dtype at construction, before any buffer_dtype cast.
    buffer_name_to_orig_dtype: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    buffers_cast_for_computation: bool = False  # the root's: done at its first forward
    # FSDP1's ``FSDP_USE_FULL_PREC_IN_EVAL=1``, read at construction as FSDP1 does: a unit with mixed
    # precision computes in full precision while its module is in eval mode (``_mixed_precision``).
    full_precision_in_eval: bool = False
    buffers_in_full_precision: bool = False  # the root's: cast to their original dtypes for such a forward
    handle_view: Any = None  # FSDP1's ``_flat_param``/``_handle`` stand-in (``_flat_param_view``), made on first use
    exec_order_data: ExecOrderData = dataclasses.field(default_factory=ExecOrderData)  # FSDP1's prefetch limits

    def __post_init__(self) -> None:
        self.process_group = self.device_mesh.get_group(self.device_mesh.ndim - 1)
        self.rank, self.world_size = self.process_group.rank(), self.process_group.size()

    @property
    def module(self) -> nn.Module:
        """The engine unit: the wrapped module (read each time: activation checkpointing may replace
        it), inside any activation-checkpoint wrappers."""
        return _engine.engine_module(getattr(self.wrapper, FSDP_WRAPPED_MODULE))


def state_of(module: Any) -> UnitState | None:
    """The unit state of ``module`` if it is a wrapper, else ``None``."""
    return getattr(module, "__dict__", {}).get(STATE_ATTR)


def units_in(module: nn.Module) -> list[UnitState]:
    """The states of every wrapper in ``module`` (itself included), pre-order."""
    return [state for sub in module.modules() if (state := state_of(sub)) is not None]


def units_with_paths(root: nn.Module) -> list[tuple[str, UnitState]]:
    """Each unit in ``root`` with its clean module path relative to ``root`` (``""``: root), pre-order."""
    return [(clean_module_path(path), state) for path, sub in root.named_modules()
            if (state := state_of(sub)) is not None]
