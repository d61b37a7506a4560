"""``FullyShardedDataParallel``: torch FSDP1's public class over the FSDP2 engine, one engine unit
(``fully_shard``, or ``replicate`` for ``NO_SHARD``) per instance; the FSDP1 extras live in feature modules."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import (_engine, _engine_flat, _flat_param_view, _mixed_precision, _optim_state, _orig_params, _runtime,
               _state_dict)
from ._common import FSDP_PREFIX, FSDP_WRAPPED_MODULE, TrainingState, clean_name, warn_once
from ._engine import flatten_mesh
from ._init_utils import (MetaMaterializer, broadcast_from_rank0, check_module, check_not_shared_with_another_root,
                          is_forwardless_container, remember_sharded, resolve_ignored_states)
from ._mesh import build_mesh, check_hybrid_layout_given, resolve_device
from ._state_dict_load import register_load_hooks
from ._torch_fsdp1 import check_no_torch_fsdp1_inside
from ._unit_state import STATE_ATTR, UnitState, state_of, units_in, units_with_paths
from .api import (BackwardPrefetch, CPUOffload, MixedPrecision, OptimStateDictConfig, OptimStateKeyType,
                  ShardingStrategy, StateDictConfig, StateDictSettings, StateDictType, coerce_config, coerce_enum)
from .wrap import apply_wrapping, plan_wrapping

# OptimStateKeyType is re-exported: FSDP1 users import it from this module too.
__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]

# ``reshard_after_forward=None`` for these (False for the others): the engine reshards after forward
# but keeps the root unsharded (it is needed again at once in backward), as FSDP1 does.
_RESHARDING = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

# What ``dtensor_params=None`` means: ``False``, FSDP1's plain local-shard views (README, "What a parameter
# is"), unless ``FSDP_COMPAT_DTENSOR_PARAMS=1``: the engine's sharded DTensor parameters (FSDP2's model).
DTENSOR_PARAMS: bool = os.environ.get("FSDP_COMPAT_DTENSOR_PARAMS", "0") == "1"


class _OnState:
    """An FSDP1 attribute of the wrapper, held by its :class:`UnitState` (same name, no leading ``_``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name.lstrip("_")

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        return self if wrapper is None else getattr(state_of(wrapper), self.field)

    def __set__(self, wrapper: Any, value: Any) -> None:
        setattr(state_of(wrapper), self.field, value)


def _warn_about_moot_options(limit_all_gathers: bool, backward_prefetch: BackwardPrefetch | None) -> None:
    if not limit_all_gathers:
        warn_once("limit_all_gathers", "limit_all_gathers=False has no effect: the FSDP2 engine "
                  "always limits in-flight all-gathers (see README, 'Argument mapping').")
    if backward_prefetch is not BackwardPrefetch.BACKWARD_PRE:
        warn_once("backward_prefetch", f"backward_prefetch={backward_prefetch} is treated "
                  "as BACKWARD_PRE: the FSDP2 engine prefetches the next unit before the current "
                  "unit's gradient computation. Results are unchanged; only overlap differs.")


def _warn_about_no_shard(requested: ShardingStrategy, unit: UnitState) -> None:
    """FSDP1's ``NO_SHARD`` warnings, with its texts and ``stacklevel``s."""
    if unit.sharding_strategy != requested:
        warnings.warn(f"FSDP is switching to use `NO_SHARD` instead of {requested} since the world size is 1.",
                      stacklevel=2)
    elif requested == ShardingStrategy.NO_SHARD and unit.world_size > 1:
        warnings.warn("The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
                      "`DistributedDataParallel` instead.", FutureWarning, stacklevel=3)


def _wrap_child(parent: UnitState, child: nn.Module, **kwargs: Any) -> FullyShardedDataParallel:
    """Wrap a submodule chosen by the auto-wrap policy, passing the ignored states inside it as given
    (and the parent's mesh, recording whether the user gave it, as FSDP1 passes on its arguments)."""
    if parent.ignored_modules:
        ignored = parent.ignored_modules & set(child.modules()) - {child}
        top_level = [m for m in ignored if not any(m in set(o.children()) for o in ignored)]
        wrapper = FullyShardedDataParallel(child, ignored_modules=top_level or None, **kwargs)
    else:
        ignored_params = list(parent.ignored_params & set(child.parameters()))
        wrapper = FullyShardedDataParallel(child, ignored_states=ignored_params or None, **kwargs)
    wrapper._unit.device_mesh_given = parent.device_mesh_given
    # FSDP1 gives its children the ignored parameters only: their buffers get the child's
    # ``buffer_dtype`` and state-dict copies (the parent's own rule still skips them).
    wrapper._unit.buffer_ignored_modules = set()
    return wrapper


class FullyShardedDataParallel(_engine_flat.EngineParamsOnApply):
    """Drop-in replacement for ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1).

    Same constructor, attributes, names and methods as FSDP1; torch's per-parameter FSDP2 engine
    shards, communicates, prefetches and reshards. Differences from FSDP1:

    * Parameters are FSDP1's (``dtensor_params``, keyword-only, default ``None``: ``False`` unless
      ``FSDP_COMPAT_DTENSOR_PARAMS=1``): plain 1-D local-shard views (``NO_SHARD``: the parameters' own
      shapes), or one flat parameter per unit for ``use_orig_params=False``, in the engine's layout (README,
      "What a parameter is"). ``dtensor_params=True``, for code written against FSDP2, shows the engine's
      sharded ``DTensor`` parameters instead, whatever ``use_orig_params`` says.
    * A meta-device model is materialised in module order: the same seed gives eager construction's values.
    * ``limit_all_gathers=False`` and ``backward_prefetch`` other than ``BACKWARD_PRE`` warn once:
      the engine always rate-limits all-gathers and prefetches the next unit in backward.
    * Works on CPU-only machines (gloo), including ``CPUOffload``, ``sync_module_states`` and
      ``offload_to_cpu``, where FSDP1 fails.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | Any | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[nn.Parameter] | Iterable[nn.Module] | None = None,
        device_mesh: DeviceMesh | None = None,
        *,
        dtensor_params: bool | None = None,
    ) -> None:
        _engine.log_api_usage("fsdp_compat.FullyShardedDataParallel")
        super().__init__()
        check_module(module)
        check_no_torch_fsdp1_inside(module)
        # The parameter objects before wrapping: optimizers built on them are re-pointed at
        # their replacements (meta materialisation, sharding) at their next step.
        original_params = _orig_params.param_slots(module)
        nested_units = [unit.module for unit in units_in(module)]
        # Construction (of this unit, its children, the rank-0 sync) reads nested units' parameters as the
        # engine's DTensors; the units show their plain local-shard views once the outermost one is built.
        with _engine_flat.engine_params(nested_units), _engine_flat.constructing(module):
            if process_group is not None and device_mesh is not None:
                raise ValueError("Cannot pass both process_group and device_mesh at the same time. "
                                 "Please just pass only one of them.")
            strategy = coerce_enum(sharding_strategy if sharding_strategy is not None else ShardingStrategy.FULL_SHARD,
                                   ShardingStrategy, "sharding_strategy")
            cpu_offload = CPUOffload() if cpu_offload is None else coerce_config(cpu_offload, CPUOffload, "cpu_offload")
            if mixed_precision is not None:
                mixed_precision = coerce_config(mixed_precision, MixedPrecision, "mixed_precision")
            # FSDP1's attribute without mixed precision: ``MixedPrecision()`` (the argument decides the
            # auto-wrap overrides below, as in FSDP1).
            if backward_prefetch is not None:
                backward_prefetch = coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch")
            _warn_about_moot_options(bool(limit_all_gathers), backward_prefetch)
            ignored_modules, ignored_params = resolve_ignored_states(module, ignored_modules, ignored_states)
            check_not_shared_with_another_root(module, ignored_params)
            check_hybrid_layout_given(strategy, process_group, device_mesh, auto_wrap_policy)
            compute_device = resolve_device(device_id, process_group)
            mesh = build_mesh(strategy, process_group, device_mesh, compute_device)
            # Sharding over a one-rank shard group (the process group, or the intra-node one for hybrid
            # strategies) replicates: FSDP1 switches to NO_SHARD, whatever the world size.
            requested, strategy = strategy, ShardingStrategy.NO_SHARD if mesh.size(mesh.ndim - 1) == 1 else strategy
            self.__dict__[STATE_ATTR] = state = UnitState(
                wrapper=self, sharding_strategy=strategy, cpu_offload=cpu_offload,
                mixed_precision=mixed_precision if mixed_precision is not None else MixedPrecision(),
                backward_prefetch=backward_prefetch, forward_prefetch=bool(forward_prefetch),
                limit_all_gathers=bool(limit_all_gathers), use_orig_params=bool(use_orig_params),
                dtensor_params=DTENSOR_PARAMS if dtensor_params is None else bool(dtensor_params),
                sync_module_states=bool(sync_module_states), ignored_modules=ignored_modules,
                ignored_params=ignored_params, compute_device=compute_device, device_mesh=mesh,
                device_mesh_given=device_mesh is not None)

            materializer = MetaMaterializer(compute_device, ignored_modules, param_init_fn)
            if auto_wrap_policy is not None:
                child_kwargs = dict(  # the strategy asked for: FSDP1's children each decide (and warn) themselves
                    sharding_strategy=requested, cpu_offload=cpu_offload, backward_prefetch=backward_prefetch,
                    mixed_precision=mixed_precision, device_id=device_id, sync_module_states=state.sync_module_states,
                    forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                    use_orig_params=use_orig_params, device_mesh=state.device_mesh, param_init_fn=param_init_fn,
                    dtensor_params=state.dtensor_params)
                individually_wrapped = _mixed_precision.prepare_individually_wrapped(module, mixed_precision)
                targets = plan_wrapping(module, auto_wrap_policy, ignored_modules, ignored_params, child_kwargs,
                                        individually_wrapped)
                # A meta-device model is materialised module by module in pre-order while each planned
                # unit is sharded as soon as its subtree is ready: besides the root's own states, at most
                # one unit is ever unsharded.
                apply_wrapping(module, targets, functools.partial(_wrap_child, state),
                               before_visit=materializer.materialize_own_states)
            _warn_about_no_shard(requested, state)  # after the children's, as in FSDP1
            materializer.materialize_unit(module)
            if state.sync_module_states:
                broadcast_from_rank0(module, state.device_mesh, ignored_modules, ignored_params)

            self._fsdp_wrapped_module = module
            state.buffer_ignored_modules = set(ignored_modules)
            for nested in units_in(module):
                nested.is_root = False
                state.buffer_ignored_modules |= nested.buffer_ignored_modules
            # FSDP1 records these per unit, with clean names relative to the unit, before any cast.
            state.buffer_name_to_orig_dtype = {clean_name(name): buffer.dtype for name, buffer in self.named_buffers()}
            register_load_hooks(self)
            # FSDP1 lets a policy wrap a ModuleList whose children are all wrapped (the wrapper is then
            # only iterated, never called); the engine refuses such containers, and with no parameters
            # of their own they need no engine unit.
            if not is_forwardless_container(module, ignored_params):
                _engine.apply_engine(
                    module,
                    # NO_SHARD replicates over every rank of the mesh: a hybrid strategy switched to it
                    # (one-rank shard groups) still averages gradients over the replicas, where FSDP1
                    # all-reduces over the one-rank group only (README, "Differences from torch FSDP1").
                    mesh=(flatten_mesh(state.device_mesh) if strategy == ShardingStrategy.NO_SHARD
                          else state.device_mesh),
                    replicate_only=strategy == ShardingStrategy.NO_SHARD,
                    reshard_after_forward=None if strategy in _RESHARDING else False,
                    mp_policy=_mixed_precision.engine_policy(state.mixed_precision),
                    offload_policy=_mixed_precision.engine_offload_policy(state.cpu_offload, compute_device),
                    ignored_params=ignored_params,
                )
                remember_sharded(module)
            _mixed_precision.init_unit(state)
            if not state.dtensor_params:
                _engine_flat.install(module, flat_mode=not state.use_orig_params)
                _flat_param_view.flat_params(state)  # described (``_fqns``...) before anyone reads them
        _orig_params.remember_replacements(original_params)

    # FSDP1's attributes, which third-party code reads on the wrapper, held by its unit state.
    (sharding_strategy, cpu_offload, mixed_precision, backward_prefetch, forward_prefetch, limit_all_gathers,
     _use_orig_params, _sync_module_states, _ignored_modules, _ignored_params, compute_device, _device_mesh,
     process_group, rank, world_size, _is_root, training_state, _state_dict_type, _state_dict_config,
     _optim_state_dict_config, _comm_hook, _comm_hook_state,
     _buffer_name_to_orig_dtype) = (_OnState() for _ in range(23))

    @property
    def _unit(self) -> UnitState:
        return self.__dict__[STATE_ATTR]

    @property
    def module(self) -> nn.Module:
        """The wrapped module; as in FSDP1, the innermost one when activation checkpointing was
        applied after wrapping (that module is also the engine unit)."""
        return self._unit.module

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing to the wrapped module (an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def _names_cleaned_if_summoned(self, named: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        clean = self._unit.training_state == TrainingState.SUMMON_FULL_PARAMS  # read at the first item, as FSDP1
        for name, value in named:
            yield (name.replace(FSDP_PREFIX, "") if clean else name), value

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; inside ``summon_full_params`` the names are clean."""
        return self._names_cleaned_if_summoned(super().named_parameters(*args, **kwargs))

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``; inside ``summon_full_params`` the names are clean."""
        return self._names_cleaned_if_summoned(super().named_buffers(*args, **kwargs))

    # FSDP1's private flat-parameter names, which third-party code (accelerate) reads: views of
    # this unit's own sharded parameters, honouring the dtype upcast clients write (``_flat_param_view``).
    _has_params = property(lambda self: _flat_param_view.has_params(self._unit))
    _flat_param = property(lambda self: _flat_param_view.flat_param(self._unit))
    _handle = property(lambda self: _flat_param_view.handle(self._unit))
    params = property(lambda self: _flat_param_view.params(self._unit))
    # FSDP1's prefetch limits, which trainers (Composer) set on the root: mapped to the engine's prefetching.
    _exec_order_data = property(lambda self: self._unit.exec_order_data)

    @property
    def _all_handles(self) -> list[Any]:
        """FSDP1's root attribute (OLMo's checkpointers walk it): the handle of each unit in this tree
        that has parameters, pre-order. A nested unit has none, as in FSDP1."""
        if not self._unit.is_root:
            raise AttributeError("_all_handles")  # then looked up on the wrapped module, as FSDP1 does
        return _flat_param_view.all_handles(self._unit)

    def check_is_root(self) -> bool:
        """Whether this instance is a root (no enclosing ``FullyShardedDataParallel``)."""
        return bool(self._unit.is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """All ``FullyShardedDataParallel`` instances in ``module`` (itself included), pre-order."""
        return [unit.wrapper for unit in units_in(module) if not root_only or unit.is_root]  # type: ignore[misc]

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` on full parameters; edits are kept (written back to the shards).
        As FSDP1, ``ValueError`` inside ``summon_full_params`` (this wrapper's, or a nested one's)."""
        _runtime.check_idle_for_apply(self._unit)
        with _runtime.summon_full_params(self, recurse=False, writeback=True):
            nn.Module.apply(self, fn)  # nested wrappers are reached by its recursion, each summoning itself
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; the engine's hooks all-gather and reshard around it."""
        unit = self._unit
        with torch.autograd.profiler.record_function("FullyShardedDataParallel.forward"):
            args, kwargs = _runtime.pre_forward(unit, args, kwargs)
            return self._fsdp_wrapped_module(*args, **kwargs)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                            state_dict_config: StateDictConfig | None = None,
                            optim_state_dict_config: OptimStateDictConfig | None = None) -> StateDictSettings:
        """Set the type and configs on every wrapper in ``module``; return the previous settings.

        As FSDP1: a config of the wrong class raises ``RuntimeError``; a module without wrappers is
        left alone and ``StateDictSettings(None, None, None)`` returned (which, passed back, is a no-op).
        """
        return _state_dict.set_state_dict_type_on(units_in(module), state_dict_type, state_dict_config,
                                                  optim_state_dict_config)

    get_state_dict_type = staticmethod(_state_dict.get_state_dict_type)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: StateDictType,
                        state_dict_config: StateDictConfig | None = None,
                        optim_state_dict_config: OptimStateDictConfig | None = None) -> Generator[None, None, None]:
        """Context manager form of :meth:`set_state_dict_type`; restores the previous settings."""
        units = units_in(module)
        previous = _state_dict.set_state_dict_type_on(units, state_dict_type, state_dict_config,
                                                      optim_state_dict_config)
        try:
            yield
        finally:
            _state_dict.restore_state_dict_type(units, previous)

    # One signature for nn.Module's overloads, as FSDP1's (positional arguments still accepted).
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> dict[str, Any]:
        """The model state in the current state-dict type, with FSDP1's clean keys."""
        if _state_dict.collecting_entries():
            # An enclosing wrapper's state_dict() is reading this tree's module slots: it holds the engine's
            # parameters in every unit of its tree already. Entering them again here walked the tree and
            # switched each unit's views once more per nested wrapper (a third of a small model's call).
            return _state_dict.state_dict(self._unit, *args, destination=destination, prefix=prefix,
                                          keep_vars=keep_vars)
        unit_paths = units_with_paths(self)  # one walk of the tree for the whole call
        with _engine_flat.engine_params((unit.module for _, unit in unit_paths), keep_parameter_views=True):
            return _state_dict.state_dict(self._unit, *args, destination=destination, prefix=prefix,
                                          keep_vars=keep_vars, unit_paths=unit_paths)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the current type; on any error the model is left unchanged."""
        with _engine_flat.engine_params(self._engine_units()):
            return _state_dict.load_state_dict(self._unit, state_dict, strict=strict, assign=assign)

    def _engine_units(self) -> list[nn.Module]:
        """The engine units in this wrapper's tree (itself included)."""
        return [unit.module for unit in units_in(self)]

    summon_full_params = staticmethod(_runtime.summon_full_params)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally, without communication, inside the context (root only)."""
        return _runtime.no_sync(self._unit)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip gradients of all parameters (all shards) by their total norm; returns that norm."""
        return _runtime.clip_grad_norm_(self._unit, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a gradient communication hook on every unit of this root."""
        _runtime.register_comm_hook(self._unit, state, hook)

    full_optim_state_dict = staticmethod(_optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_optim_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_optim_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_optim_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(_optim_state.rekey_optim_state_dict)
    optim_state_dict = staticmethod(_optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_optim_state.optim_state_dict_to_load)
