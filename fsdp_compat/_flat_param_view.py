"""FSDP1's private ``FlatParameter`` names, given a meaning on a per-parameter engine unit.

accelerate (1.x, ``Accelerator.prepare_model``) with mixed precision upcasts master weights through
them: for each unit with ``_has_params`` whose ``_flat_param`` is low-precision, it logs
``_flat_param._fqns``, assigns ``_flat_param.data = _flat_param.data.to(torch.float32)`` and sets
``_handle._orig_param_dtype = torch.float32``. :class:`FlatParamView` stands in for both objects,
presenting the unit's *local shards* as one flat parameter and honouring both writes by re-typing
the shards (``MixedPrecision.param_dtype`` still decides the compute dtype); as in FSDP1, only
before the first forward.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import torch.nn as nn

from . import _engine, _engine_flat
from ._common import clean_name
from ._unit_state import UnitState, units_in
from .api import ShardingStrategy


class FlatParamView:
    """FSDP1's ``FlatParameter`` and ``FlatParamHandle`` of one unit (``_orig_param_dtype`` is the handle's)."""

    def __init__(self, unit: UnitState) -> None:
        self._unit = unit

    def _params(self) -> list[DTensor]:
        return _engine.sharded_params(self._unit.module)

    def _local_shards(self) -> list[torch.Tensor]:
        return [param.to_local() for param in self._params()]

    @property
    def flat_param(self) -> FlatParamView:  # FSDP1 code reaches the flat parameter as ``_handle.flat_param``
        return self

    # The handle's configuration, which trainers walking ``_all_handles`` read (FSDP1's names).
    _offload_params = property(lambda self: bool(self._unit.cpu_offload.offload_params))
    _use_orig_params = property(lambda self: self._unit.use_orig_params)
    _fully_sharded_module = property(lambda self: self._unit.module)
    process_group = property(lambda self: self._unit.process_group)
    rank = property(lambda self: self._unit.rank)
    world_size = property(lambda self: self._unit.world_size)

    @property
    def uses_sharded_strategy(self) -> bool:
        """FSDP1's: anything but ``NO_SHARD`` (also a strategy switched to it on a one-rank shard group)."""
        return self._unit.sharding_strategy != ShardingStrategy.NO_SHARD

    @property
    def dtype(self) -> torch.dtype:
        """The narrowest floating-point dtype of the unit's parameters (FSDP1 has one; the engine allows
        frozen ones of another): ``dtype != torch.float32`` still tells whether any is in low precision."""
        dtypes = {param.dtype for param in self._params()}
        floating = [dtype for dtype in dtypes if dtype.is_floating_point]
        return min(floating or dtypes, key=lambda dtype: dtype.itemsize)

    @property
    def _orig_param_dtype(self) -> torch.dtype:  # the dtype the master weights are kept and stepped in
        return self.dtype

    @_orig_param_dtype.setter
    def _orig_param_dtype(self, dtype: torch.dtype) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"The flat parameter can only be re-typed to a floating-point dtype, not {dtype}")
        if all(param.dtype == dtype for param in self._params()):
            return
        if _engine.is_root_state_initialized(self._unit.module):
            raise RuntimeError("Cannot change the parameter dtype of an FSDP unit after its first forward (FSDP1 "
                               "fixes it at lazy initialisation too); change it right after wrapping")
        _engine.set_sharded_param_dtype(self._unit.module, dtype)

    @property
    def device(self) -> torch.device:  # the CPU under ``CPUOffload(offload_params=True)``
        return self._params()[0].device

    @property
    def requires_grad(self) -> bool:
        """Whether any of the unit's parameters does (FSDP1's rule for ``use_orig_params=True``;
        with ``False`` FSDP1 insists that all or none do)."""
        return any(param.requires_grad for param in self._params())

    @property
    def _fqns(self) -> list[str]:
        """The unit's own parameters' clean names relative to the wrapped module, each shared one once."""
        owned = {id(param) for param in self._params()}
        return [clean_name(name) for name, param in self._unit.module.named_parameters() if id(param) in owned]

    @property
    def data(self) -> torch.Tensor:
        """The local shards, flattened and concatenated into one new 1-D tensor (a copy)."""
        return torch.cat([shard.detach().reshape(-1).to(self.dtype) for shard in self._local_shards()])

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if value.dim() != 1 or value.numel() != self.numel():
            raise ValueError(f"The flat parameter of this unit has {self.numel()} local elements; assign a 1-D "
                             f"tensor of that size (for example `flat_param.data.to(dtype)`), not shape "
                             f"{tuple(value.shape)}")
        if value.is_floating_point() and value.dtype != self.dtype:
            self._orig_param_dtype = value.dtype
        shards = self._local_shards()  # re-typed above if need be
        with torch.no_grad():
            for shard, piece in zip(shards, value.split([shard.numel() for shard in shards])):
                shard.copy_(piece.view(shard.shape))

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.numel()])

    def numel(self) -> int:
        """Elements in this rank's shards of the unit's parameters."""
        return sum(shard.numel() for shard in self._local_shards())


class LocalFlatHandle(FlatParamView):
    """FSDP1's ``FlatParamHandle`` of a unit with plain local-shard views (``dtensor_params=False``): its
    ``flat_param`` is a real plain ``nn.Parameter``, the unit's flat local shard itself."""

    @property
    def flat_param(self) -> nn.Parameter:  # type: ignore[override]
        return flat_params(self._unit)[0]


def flat_params(unit: UnitState) -> list[nn.Parameter]:
    """The unit's flat local shards (one per dtype), each described as FSDP1's ``FlatParameter`` is:
    ``_fqns``, ``_shard_param_infos``, ``_numels``, ``_shapes``, ``_params`` over the engine's layout
    (each parameter's padded dim-0 chunk, concatenated; README, "What a parameter is")."""
    shards = _engine_flat.local_shards(unit.module)
    if shards is None:
        return []
    params = shards.flat_parameters()
    module_paths = {id(sub): path for path, sub in unit.module.named_modules()}
    names = [clean_name(f"{module_paths[id(slots[0][0])]}.{slots[0][1]}".lstrip("."))
             for _, slots in _engine.unit_param_slots(unit.module)]
    infos, buffers = shards.shard_infos(), shards.buffer_of()
    sharded, views = _engine.sharded_params(unit.module), shards.views()
    for index, param in enumerate(params):
        members = [i for i, buffer in enumerate(buffers) if buffer == index]
        attributes = dict(_is_flat_param=True, _fqns=[names[i] for i in members],
                          _shard_param_infos=[infos[i] for i in members],
                          _numels=[sharded[i].numel() for i in members],
                          _shapes=[sharded[i].shape for i in members],
                          _params=[views[i] for i in members] if unit.use_orig_params else None)
        for name, value in attributes.items():
            setattr(param, name, value)
    return params


def has_params(unit: UnitState) -> bool:
    """FSDP1's ``_has_params``: whether this unit manages any parameter of its own."""
    return bool(_engine.sharded_params(unit.module))


def handle(unit: UnitState) -> FlatParamView | None:
    """FSDP1's ``_handle`` (and, for DTensor parameters, its ``_flat_param``): ``None`` for a unit without
    parameters, as in FSDP1."""
    if unit.handle_view is None and has_params(unit):
        local = _engine_flat.local_shards(unit.module) is not None
        unit.handle_view = LocalFlatHandle(unit) if local else FlatParamView(unit)
    return unit.handle_view


def all_handles(root: UnitState) -> list[FlatParamView]:
    """FSDP1's ``_all_handles`` of a root: the handle of every unit in its tree with parameters, pre-order."""
    return [view for unit in units_in(root.wrapper) if (view := handle(unit)) is not None]


def flat_param(unit: UnitState) -> FlatParamView | nn.Parameter | None:
    """FSDP1's ``_flat_param``: the unit's (first) flat local shard, or the read-only stand-in."""
    view = handle(unit)
    return view.flat_param if view is not None else None


def params(unit: UnitState) -> list[FlatParamView] | list[nn.Parameter]:
    """FSDP1's ``params``: the unit's flat parameters (one per dtype with local-shard views)."""
    if _engine_flat.local_shards(unit.module) is not None:
        return flat_params(unit)
    view = handle(unit)
    return [view] if view is not None else []
