"""``FullyShardedDataParallel``: torch FSDP1's public class, running on the FSDP2 engine.

The class is a thin facade. Each instance is one engine unit: its wrapped module is handed to
``fully_shard`` (or the engine's ``replicate`` for ``NO_SHARD``), and nested instances (from an
auto-wrap policy or manual nesting) become nested units, applied bottom-up. The FSDP1 extras live
in their own modules: state dicts (``_state_dict``), optimizer state (``_optim_state``), and the
runtime controls ``no_sync`` / ``clip_grad_norm_`` / ``summon_full_params`` / comm hooks
(``_runtime``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import _engine, _flat_param_view, _mixed_precision, _optim_state, _orig_params, _runtime, _state_dict
from ._common import FSDP_PREFIX, FSDP_WRAPPED_MODULE, TrainingState, warn_once
from ._init_utils import (
    MetaMaterializer,
    broadcast_from_rank0,
    check_container_has_no_own_params,
    check_module,
    check_not_shared_with_another_root,
    is_forwardless_container,
    remember_sharded,
    resolve_ignored_states,
)
from ._mesh import build_mesh, resolve_device
from ._torch_fsdp1 import check_no_torch_fsdp1_inside
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    coerce_enum,
    coerce_optional_config,
)
from .wrap import apply_wrapping, plan_wrapping

# OptimStateKeyType is re-exported: FSDP1 users import it from this module too.
__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]

# reshard_after_forward per strategy; ``None`` lets the engine keep the root unsharded after
# forward (it is needed again at once in backward), as FSDP1 does for its root.
_RESHARD_AFTER_FORWARD: dict[ShardingStrategy, bool | None] = {
    ShardingStrategy.FULL_SHARD: None,
    ShardingStrategy.HYBRID_SHARD: None,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
    ShardingStrategy.NO_SHARD: False,
}


class FullyShardedDataParallel(nn.Module):
    """Drop-in replacement for ``torch.distributed.fsdp.FullyShardedDataParallel`` (FSDP1).

    Same constructor, attributes, names and methods as FSDP1; sharding, collectives, prefetching
    and resharding are done by torch's per-parameter FSDP2 engine. Differences from FSDP1:

    * Parameters are always the original parameters (sharded as ``DTensor``), whatever
      ``use_orig_params`` says: there is no ``FlatParameter``. ``named_parameters()`` gives
      ``_fsdp_wrapped_module.``-prefixed original names for both settings.
    * A meta-device model is materialised in module order, so the same seed gives the values of
      eager construction (FSDP1 initialises unit by unit).
    * ``limit_all_gathers=False`` and ``backward_prefetch`` other than ``BACKWARD_PRE`` are accepted
      with a one-time warning: the engine always rate-limits all-gathers and prefetches the next
      unit before the current unit's gradient computation.
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
    ) -> None:
        _engine.log_api_usage("fsdp_compat.FullyShardedDataParallel")
        super().__init__()
        check_module(module)
        check_no_torch_fsdp1_inside(module)
        # The parameter objects before wrapping: optimizers built on them are re-pointed at
        # their replacements (meta materialisation, sharding) at their next step.
        original_params = _orig_params.param_slots(module)
        if process_group is not None and device_mesh is not None:
            raise ValueError(
                "Cannot pass both process_group and device_mesh at the same time. "
                "Please just pass only one of them."
            )
        self.sharding_strategy = coerce_enum(
            sharding_strategy if sharding_strategy is not None else ShardingStrategy.FULL_SHARD,
            ShardingStrategy, "sharding_strategy")
        self.cpu_offload = coerce_optional_config(cpu_offload, CPUOffload, "cpu_offload") or CPUOffload()
        self.mixed_precision = coerce_optional_config(mixed_precision, MixedPrecision, "mixed_precision")
        self.backward_prefetch = (None if backward_prefetch is None else
                                  coerce_enum(backward_prefetch, BackwardPrefetch, "backward_prefetch"))
        self.forward_prefetch = bool(forward_prefetch)
        self.limit_all_gathers = bool(limit_all_gathers)
        self._use_orig_params = bool(use_orig_params)
        self._sync_module_states = bool(sync_module_states)
        self._warn_about_moot_options()

        self._ignored_modules, self._ignored_params = resolve_ignored_states(
            module, ignored_modules, ignored_states, FullyShardedDataParallel)
        check_not_shared_with_another_root(module, self._ignored_params, FullyShardedDataParallel)
        self.compute_device = resolve_device(device_id, process_group)
        self._device_mesh = build_mesh(self.sharding_strategy, process_group, device_mesh,
                                       self.compute_device)
        self.process_group = self._device_mesh.get_group(self._device_mesh.ndim - 1)
        self.rank = self.process_group.rank()
        self.world_size = self.process_group.size()

        materializer = MetaMaterializer(self.compute_device, self._ignored_modules, param_init_fn)
        if auto_wrap_policy is not None:
            child_kwargs = dict(
                sharding_strategy=self.sharding_strategy, cpu_offload=self.cpu_offload,
                backward_prefetch=self.backward_prefetch, mixed_precision=self.mixed_precision,
                device_id=device_id, sync_module_states=self._sync_module_states,
                forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                use_orig_params=use_orig_params, device_mesh=self._device_mesh,
                param_init_fn=param_init_fn,
            )
            self._wrap_nested_units(module, auto_wrap_policy, child_kwargs, materializer)
        materializer.materialize_unit(module)
        if self._sync_module_states:
            broadcast_from_rank0(module, self._device_mesh, self._ignored_modules, self._ignored_params)

        self._fsdp_wrapped_module = module
        self._is_root: bool | None = True
        self.training_state = TrainingState.IDLE
        self._forward_order: list[FullyShardedDataParallel] | None = None
        for nested in self._nested_wrappers():
            nested._is_root = False
        _state_dict.init_state_dict_settings(self)
        _runtime.init_runtime_state(self)
        if is_forwardless_container(module):
            # FSDP1 lets a policy wrap a ModuleList whose children are all wrapped (the wrapper is
            # then only iterated, never called); the engine refuses such containers, and with no
            # parameters of their own they need no engine unit.
            check_container_has_no_own_params(module, self._ignored_params)
        else:
            self._apply_engine(module)
        _mixed_precision.init_unit(self)
        _orig_params.remember_replacements(original_params)

    def _apply_engine(self, module: nn.Module) -> None:
        _engine.apply_engine(
            module,
            mesh=self._device_mesh,
            replicate_only=self.sharding_strategy == ShardingStrategy.NO_SHARD,
            reshard_after_forward=_RESHARD_AFTER_FORWARD[self.sharding_strategy],
            mp_policy=_mixed_precision.engine_policy(self.mixed_precision),
            offload_policy=_mixed_precision.engine_offload_policy(self.cpu_offload, self.compute_device),
            ignored_params=self._ignored_params,
        )
        remember_sharded(module)

    # ------------------------------------------------------------------------------------------
    # Construction helpers
    # ------------------------------------------------------------------------------------------

    def _wrap_nested_units(self, module: nn.Module, auto_wrap_policy: Any, child_kwargs: dict[str, Any],
                           materializer: MetaMaterializer) -> None:
        """Apply the auto-wrap policy: the planned submodules become nested wrappers, bottom-up."""
        individually_wrapped = _mixed_precision.prepare_individually_wrapped(module, self.mixed_precision)
        targets = plan_wrapping(module, auto_wrap_policy, self._ignored_modules, self._ignored_params,
                                child_kwargs, individually_wrapped)
        # A meta-device model is materialised module by module in pre-order while each planned
        # unit is sharded as soon as its subtree is ready: besides the root's own states, at most
        # one unit is ever unsharded.
        apply_wrapping(module, targets, self._wrap_child, before_visit=materializer.materialize_own_states)

    def _wrap_child(self, child: nn.Module, **kwargs: Any) -> FullyShardedDataParallel:
        """Wrap a submodule chosen by the auto-wrap policy, with the ignored states inside it
        (given the way the user gave them: as modules, or as parameters)."""
        if self._ignored_modules:
            inside = set(child.modules())
            ignored = [m for m in self._ignored_modules if m in inside and m is not child]
            top_level = [m for m in ignored if not any(m in set(o.children()) for o in ignored)]
            return FullyShardedDataParallel(child, ignored_modules=top_level or None, **kwargs)
        inside_params = set(child.parameters())
        ignored_params = [p for p in self._ignored_params if p in inside_params]
        return FullyShardedDataParallel(child, ignored_states=ignored_params or None, **kwargs)

    def _warn_about_moot_options(self) -> None:
        if not self.limit_all_gathers:
            warn_once("limit_all_gathers", "limit_all_gathers=False has no effect: the FSDP2 engine "
                      "always limits in-flight all-gathers (see README, 'Argument mapping').")
        if self.backward_prefetch is not BackwardPrefetch.BACKWARD_PRE:
            warn_once("backward_prefetch", f"backward_prefetch={self.backward_prefetch} is treated "
                      "as BACKWARD_PRE: the FSDP2 engine prefetches the next unit before the current "
                      "unit's gradient computation. Results are unchanged; only overlap differs.")

    def _nested_wrappers(self) -> Iterator[FullyShardedDataParallel]:
        for submodule in self._fsdp_wrapped_module.modules():
            if isinstance(submodule, FullyShardedDataParallel):
                yield submodule

    # ------------------------------------------------------------------------------------------
    # nn.Module surface: names and attribute forwarding, as FSDP1
    # ------------------------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module; as in FSDP1, the innermost one when activation checkpointing was
        applied after wrapping (that module is also the engine unit)."""
        return _engine.engine_module(self._fsdp_wrapped_module)

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing to the wrapped module (for an ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``; inside ``summon_full_params`` the names are clean."""
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, param in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), param

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``nn.Module.named_buffers``; inside ``summon_full_params`` the names are clean."""
        clean = self.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, buffer in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_PREFIX, "") if clean else name), buffer

    # FSDP1's private flat-parameter names, which third-party code (accelerate) reads: views of
    # this unit's own sharded parameters, honouring the dtype upcast clients write (``_flat_param_view``).
    _has_params = property(_flat_param_view.has_params)
    _flat_param = property(_flat_param_view.flat_param)
    _handle = property(_flat_param_view.handle)

    def check_is_root(self) -> bool:
        """Whether this instance is a root (no enclosing ``FullyShardedDataParallel``)."""
        return bool(self._is_root)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """All ``FullyShardedDataParallel`` instances in ``module`` (itself included), pre-order."""
        return [m for m in module.modules()
                if isinstance(m, FullyShardedDataParallel) and (not root_only or m._is_root)]

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` on full parameters; edits are kept (written back to the shards)."""
        return _runtime.apply_with_full_params(self, fn)

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; the engine's hooks all-gather and reshard around it."""
        with torch.autograd.profiler.record_function("FullyShardedDataParallel.forward"):
            if self._is_root:
                args, kwargs = self._root_pre_forward(args, kwargs)
            self._record_forward_order()
            return self._fsdp_wrapped_module(*args, **kwargs)

    def _root_pre_forward(self, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        units = self.fsdp_modules(self)  # walked once per step, shared by the steps below
        _runtime.check_idle_for_forward(units)
        _runtime.recover_interrupted_iteration(self)
        if self._forward_order is None:
            # First iteration: record the units' forward order for ``forward_prefetch``.
            self._forward_order = []
            for unit in units:
                unit._order_recorder = self._forward_order
        elif any(unit.forward_prefetch for unit in units):
            _runtime.configure_forward_prefetch(self._forward_order)
        return _mixed_precision.root_pre_forward(self, units, args, kwargs)

    def _record_forward_order(self) -> None:
        recorder = self.__dict__.pop("_order_recorder", None)
        if recorder is not None:
            recorder.append(self)

    # ------------------------------------------------------------------------------------------
    # State dicts (FULL / LOCAL / SHARDED)
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state-dict type of every instance in ``module``; returns the previous settings."""
        return _state_dict.set_state_dict_type(module, state_dict_type, state_dict_config,
                                               optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state-dict settings of ``module``'s instances; raises if they disagree."""
        return _state_dict.get_state_dict_type(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator[None, None, None]:
        """Context manager form of :meth:`set_state_dict_type`; restores the previous settings."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            _state_dict.restore_state_dict_type(module, previous)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The model state in the current state-dict type, with FSDP1's clean keys."""
        return _state_dict.state_dict(self, *args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the current type; on any error the model is left unchanged."""
        return _state_dict.load_state_dict(self, state_dict, strict=strict, assign=assign)

    # ------------------------------------------------------------------------------------------
    # Runtime controls
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> contextlib.AbstractContextManager[None]:
        """Expose full (unsharded) parameters on the original modules inside the context."""
        return _runtime.summon_full_params(module, recurse=recurse, writeback=writeback,
                                           rank0_only=rank0_only, offload_to_cpu=offload_to_cpu,
                                           with_grads=with_grads)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally, without communication, inside the context (root only)."""
        return _runtime.no_sync(self)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float | int, norm_type: float | int = 2.0) -> torch.Tensor:
        """Clip gradients of all parameters (all shards) by their total norm; returns that norm."""
        return _runtime.clip_grad_norm_(self, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a gradient communication hook on every unit of this root."""
        _runtime.register_comm_hook(self, state, hook)

    # ------------------------------------------------------------------------------------------
    # Optimizer state (static, as FSDP1)
    # ------------------------------------------------------------------------------------------

    full_optim_state_dict = staticmethod(_optim_state.full_optim_state_dict)
    sharded_optim_state_dict = staticmethod(_optim_state.sharded_optim_state_dict)
    shard_full_optim_state_dict = staticmethod(_optim_state.shard_full_optim_state_dict)
    flatten_sharded_optim_state_dict = staticmethod(_optim_state.flatten_sharded_optim_state_dict)
    scatter_full_optim_state_dict = staticmethod(_optim_state.scatter_full_optim_state_dict)
    rekey_optim_state_dict = staticmethod(_optim_state.rekey_optim_state_dict)
    optim_state_dict = staticmethod(_optim_state.optim_state_dict)
    optim_state_dict_to_load = staticmethod(_optim_state.optim_state_dict_to_load)
