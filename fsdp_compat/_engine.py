"""The one place that uses torch-private names (FSDP2's internals and a few others), so a torch
upgrade that moves them breaks this file only."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import re
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# FSDP1's and the engine's walk over forward inputs and outputs: the same walk casts the same tensors.
from torch.distributed.utils import _apply_to_tensors as apply_to_tensors  # noqa: F401 (re-exported)

# FSDP1's ``MixedPrecision._module_classes_to_ignore`` default: the base of every batch norm.
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: F401 (re-exported)

# What ``nn.Module.load_state_dict`` returns (a named tuple of missing and unexpected keys).
from torch.nn.modules.module import _IncompatibleKeys as IncompatibleKeys  # noqa: F401 (re-exported)

from ._torch_fsdp1 import TORCH_FSDP1_CLASS

# ---- torch versions: the tested range, and the engine pieces this adapter needs ----

# [first, end) of (major, minor) the whole suite passes on; ``setup.cfg`` states the same range.
TESTED_TORCH = ((2, 13), (2, 16))
_SUPPORTED = "torch>={}.{},<{}.{}".format(*TESTED_TORCH[0], *TESTED_TORCH[1])


def warn_if_untested(version: str = torch.__version__) -> bool:
    """Warn when ``version`` (``2.15.0+cu132``, ``2.16.0a0``...) is outside :data:`TESTED_TORCH`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if TESTED_TORCH[0] <= release < TESTED_TORCH[1]:
        return False
    warnings.warn(f"fsdp_compat is tested with {_SUPPORTED}, not torch {version}. It runs as long "
                  "as torch's FSDP2 engine has what it needs, but compare your training (losses, "
                  "gradient dtypes) with a tested torch before relying on it.", UserWarning,
                  stacklevel=2)
    return True


def _missing_engine_piece(piece: str) -> ImportError:
    return ImportError(f"fsdp_compat cannot run on torch {torch.__version__}: its FSDP2 engine "
                       f"lacks {piece}. fsdp_compat supports {_SUPPORTED}; install one of those.")


def _require_methods(cls: type, *names: str) -> None:
    """Fail at import, naming what is missing, when ``cls`` lacks a method this adapter calls."""
    for name in names:
        if not callable(getattr(cls, name, None)):
            raise _missing_engine_piece(f"{cls.__module__}.{cls.__qualname__}.{name}")


warn_if_untested()

try:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # ``replicate`` (the FSDP2-based one) lives in a private package.
    from torch.distributed._composable.replicate_with_fsdp import replicate

    # Runtime-control internals (comm hooks, summon_full_params, recovery): private engine pieces.
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState as _EngineTrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import (FSDPParam, alloc_storage, free_storage,
                                                                  unsafe_setattr_param)
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
except ImportError as _error:
    raise _missing_engine_piece(f"a piece fsdp_compat imports ({_error})") from _error

_require_methods(FSDPModule, "reset_iter_state", "set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch",
                 "set_requires_gradient_sync", "set_requires_all_reduce", "set_gradient_divide_factor",
                 "set_force_sum_reduction_for_comms", "set_custom_reduce_scatter", "set_all_reduce_hook",
                 "_get_fsdp_state")
_require_methods(FSDPParam, "reset_sharded_param", "init_unsharded_param", "to_unsharded", "init_all_gather_outputs")
_require_methods(FSDPParamGroup, "_init_mp_dtypes", "unshard", "wait_for_unshard")

try:  # FSDP1 checkpoints hold ShardedTensor; torch may drop it one day, and FSDP1 with it.
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
except ImportError:  # pragma: no cover - depends on the torch version
    ShardedTensor = None  # type: ignore[assignment, misc]


def apply_engine(module: nn.Module, *, mesh: DeviceMesh, replicate_only: bool, reshard_after_forward: bool | None,
                 mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                 ignored_params: set[nn.Parameter]) -> FSDPModule:
    """Make ``module`` one engine unit (one parameter group) over ``mesh``: ``replicate`` for
    ``NO_SHARD``, else ``fully_shard`` (``reshard_after_forward=None``: all but the root reshard)."""
    options: dict[str, Any] = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                                   ignored_params=ignored_params)
    unit: FSDPModule = (replicate(module, **options) if replicate_only
                        else fully_shard(module, reshard_after_forward=reshard_after_forward, **options))
    for group in param_groups(unit):
        _accumulate_in_compute_dtype(group)
        _unshard_in_place_on_one_rank(group)
        _reduce_in_place_on_one_rank(group)
        for fsdp_param in group.fsdp_params:
            _keep_own_mesh(fsdp_param)
    return unit


def _keep_own_mesh(fsdp_param: FSDPParam) -> None:
    """Make the sharded parameter carry its unit's mesh, now and after every ``reset_sharded_param``.

    DTensor takes an operator's output layout, ``nn.Parameter(dtensor)``'s (the engine's sharded parameter)
    and ``.to()``'s (``nn.Module._apply``) included, from a cache keyed by meshes, which compare by ranks,
    not by process groups. A unit over a second group of the same ranks (a second model, a ``dist.new_group``
    with another timeout or options) would carry the first group's mesh, and so would its state dicts'
    ``ShardedTensor``s and ``DTensor``s (FSDP1's are over the unit's own group), its gathers, and the
    ``DTensor``s its specs build (gradients): a group the user may destroy. The engine's collectives use
    the unit's mesh either way."""
    _own_mesh_on_specs(fsdp_param)
    reset_sharded_param = fsdp_param.reset_sharded_param

    @functools.wraps(reset_sharded_param)
    def reset_sharded_param_on_own_mesh() -> None:
        reset_sharded_param()
        _own_mesh_on_specs(fsdp_param)

    fsdp_param.reset_sharded_param = reset_sharded_param_on_own_mesh  # type: ignore[method-assign]


def _own_mesh_on_specs(fsdp_param: FSDPParam) -> None:
    """The unit's mesh (the engine's ``_spmd_mesh``) on the sharded parameter's spec and on the spec the
    engine builds its DTensors from, where they hold an equal mesh (same ranks) of another group."""
    mesh = getattr(fsdp_param, "_spmd_mesh", None)  # the unit's mesh, or with a DTensor (TP) parameter its 2-D one
    if mesh is None:
        mesh = fsdp_param.mesh_info.mesh
    for owner, attribute in ((fsdp_param.sharded_param, "_spec"), (fsdp_param, "_sharding_spec")):
        spec = getattr(owner, attribute, None)
        if spec is not None and spec.mesh is not mesh and spec.mesh == mesh:
            setattr(owner, attribute, dataclasses.replace(spec, mesh=mesh))


def _accumulate_in_compute_dtype(group: FSDPParamGroup) -> None:
    """Make ``group`` accumulate unreduced (``no_sync``) gradients in the compute dtype, as FSDP1
    (it casts to ``reduce_dtype`` only to reduce). ``_init_mp_dtypes`` derives the accumulation dtype
    from ``FSDPParam.reduce_dtype`` (< 2.15: ``unsharded_accumulated_grad``'s; 2.15: the unsharded
    parameter's ``grad_dtype``, upcast for ``_fsdp_params_with_wider_grad_dtype``): we set the compute
    dtype right after it; the copy into the reduce buffer still casts. No public setter reaches these."""
    init_mp_dtypes = group._init_mp_dtypes

    @functools.wraps(init_mp_dtypes)
    def init_mp_dtypes_then_compute_dtype_accumulation() -> None:
        init_mp_dtypes()
        changed = set()
        for fsdp_param in group.fsdp_params:
            compute_dtype = fsdp_param.param_dtype or fsdp_param.orig_dtype
            if fsdp_param.reduce_dtype in (None, compute_dtype) or not compute_dtype.is_floating_point:
                continue
            fsdp_param.reduce_dtype = compute_dtype
            changed.add(id(fsdp_param))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:  # made before this re-derivation: 2.15 set its grad_dtype
                unsharded.grad_dtype = compute_dtype
        wider = getattr(group, "_fsdp_params_with_wider_grad_dtype", None)  # torch >= 2.15
        if wider is not None:
            group._fsdp_params_with_wider_grad_dtype = [  # type: ignore[attr-defined]
                p for p in wider if id(p) not in changed]

    group._init_mp_dtypes = init_mp_dtypes_then_compute_dtype_accumulation  # type: ignore[method-assign]


# On an engine state: ``{full precision?: policy}``, the unit's own policy under ``False``.
_PRECISION_POLICIES = "_fsdp_compat_precision_policies"
# On an FSDPParam: ``{full precision?: (all-gather outputs, unsharded parameter or None, inner tensors)}``
# for the precision it is not computing in now.
_PRECISION_BUFFERS = "_fsdp_compat_precision_buffers"


def computes_in_full_precision(module: nn.Module) -> bool:
    """Whether the engine unit ``module`` gathers and computes in its parameters' own dtype although its
    policy says otherwise (:func:`set_full_precision`)."""
    state = engine_state(module)
    policies = getattr(state, _PRECISION_POLICIES, None)
    return policies is not None and state is not None and state._mp_policy is policies[True]


def set_full_precision(module: nn.Module, full: bool) -> None:
    """Make the engine unit ``module`` all-gather and compute in its parameters' own dtype (``full``), its
    gradients reduced in it, its forward inputs not cast; or in its mixed-precision policy again. FSDP1's
    ``FSDP_USE_FULL_PREC_IN_EVAL``: FSDP1 keeps a full-precision unsharded flat parameter beside the
    low-precision one; so does this, per parameter: each precision keeps its own all-gather buffers and
    unsharded parameter (the engine fixes them at its first all-gather). A unit holding the other
    precision's unsharded parameters is resharded first (no communication: they are freed). Only between
    iterations (the caller's concern)."""
    state = engine_state(module)
    if state is None or computes_in_full_precision(module) == full:
        return
    policies = getattr(state, _PRECISION_POLICIES, None)
    if policies is None:
        own = state._mp_policy
        policies = {False: own, True: MixedPrecisionPolicy(output_dtype=own.output_dtype,
                                                           cast_forward_inputs=own.cast_forward_inputs)}
        setattr(state, _PRECISION_POLICIES, policies)
    policy = policies[full]
    for group in state._fsdp_param_groups:
        if group.is_unsharded:
            group.reshard()
        for fsdp_param in group.fsdp_params:
            stash = fsdp_param.__dict__.setdefault(_PRECISION_BUFFERS, {})
            stash[not full] = (fsdp_param.all_gather_outputs, fsdp_param.__dict__.pop("_unsharded_param", None),
                               fsdp_param._unsharded_inner_tensors)
            outputs, unsharded, inner = stash.pop(full, ([], None, []))
            fsdp_param.all_gather_outputs, fsdp_param._unsharded_inner_tensors = outputs, inner
            if unsharded is not None:
                fsdp_param._unsharded_param = unsharded
            fsdp_param.mp_policy = policy
        if hasattr(group, "mp_policy"):  # torch 2.13's groups read the policy here, 2.15's from each parameter
            group.mp_policy = policy
        group._init_mp_dtypes()  # each parameter's param_dtype / reduce_dtype, the group's from them
    state._mp_policy = policy


def follow_precision_at_each_unshard(module: nn.Module, wants_full: Callable[[], bool]) -> None:
    """Before each all-gather of the engine unit ``module`` (its forward, a prefetch, its backward), the
    precision ``wants_full()`` names (:func:`set_full_precision`), as FSDP1 decides at each unshard: a
    backward after the module changed mode since its forward gathers in the forward's precision again,
    into the buffers that forward's autograd graph holds."""
    for group in param_groups(module):
        unshard = group.unshard

        @functools.wraps(unshard)
        def unshard_in_precision(*args: Any, _group: FSDPParamGroup = group, _unshard: Any = unshard,
                                 **kwargs: Any) -> Any:
            if _group._all_gather_result is None:  # not prefetched already (in the precision of that time)
                set_full_precision(module, wants_full())
            return _unshard(*args, **kwargs)

        group.unshard = unshard_in_precision  # type: ignore[method-assign]


_IN_PLACE = "_fsdp_compat_in_place"  # on an unsharded parameter that views the sharded storage
_PLAIN_ON_ONE_RANK = "_fsdp_compat_plain_on_one_rank"  # on an FSDPParam: (weak ref to its stored data, the answer)


def _unshard_in_place_on_one_rank(group: FSDPParamGroup) -> None:
    """Where ``group`` gathers over one rank (``NO_SHARD``: ``replicate``; any unit at world size 1), make its
    unsharded parameters views of the sharded storage instead of copies, as FSDP1's ``NO_SHARD`` computes on
    its flat parameter itself. The engine copies every parameter into a buffer of its own there
    (``wait_for_unshard``'s one-rank branch), kept from forward to the end of backward: one more copy of the
    parameters at the step's peak, and a pass over them per unshard. Where the unsharded form differs from the
    stored one (a ``param_dtype`` cast, storage on the CPU under CPU offload) it is written by one copy from
    the stored data, cast and moved at once, where the engine casts (or moves) into a temporary first and
    then copies that: FSDP1's one cast per unshard. A tensor subclass's pre-all-gather, a padded or a
    ``DTensor`` parameter keep the engine's path."""
    wait_for_unshard = group.wait_for_unshard

    @functools.wraps(wait_for_unshard)
    def wait_for_unshard_in_place() -> None:
        if group._all_gather_result is None or group.is_unsharded or _gathers_over_ranks(group):
            wait_for_unshard()
            return
        params = group.fsdp_params
        casts = False
        mine: list[FSDPParam] = []
        others: list[FSDPParam] = []
        for fsdp_param in params:  # one pass: this runs twice a step per unit
            casts = casts or fsdp_param.param_dtype not in (None, fsdp_param._sharded_param_data.dtype)
            (mine if _plain_on_one_rank(fsdp_param) else others).append(fsdp_param)
        # FSDP1's NO_SHARD frees its low-precision copy after forward and casts again before backward (its
        # ``post_reshard``), the stored parameters being full already: the same here, for units that cast.
        # (compared with ``mesh_info`` only, never gathered over)
        group.post_forward_mesh_info = cast(FSDPMeshInfo, group.mesh_info) if casts else None
        if not mine:
            wait_for_unshard()
            return
        # The engine's own path for the others (and its bookkeeping: events, state), then these.
        group.fsdp_params = others
        try:
            wait_for_unshard()
        finally:
            group.fsdp_params = params
        copied = []
        for fsdp_param in mine:
            if _unshardable_in_place(fsdp_param):
                _view_sharded_storage(fsdp_param)
            else:
                copied.append(fsdp_param)
        _copy_sharded_storage(copied)
        for fsdp_param in mine:
            fsdp_param.to_unsharded()

    group.wait_for_unshard = wait_for_unshard_in_place  # type: ignore[method-assign]
    for fsdp_param in group.fsdp_params:
        _leave_engine_copy_when_not_in_place(fsdp_param)


class _ReduceInPlaceOnOneRank(ReduceScatter):
    """The reduce-scatter of a group that scatters over one rank (``NO_SHARD``: ``replicate``; world size 1).
    There the engine allocates its reduce-scatter output, the size of the input, and copies the input into
    it in place of a collective: the gradients held twice and one more pass over them per unit and step
    (FSDP1's ``NO_SHARD`` all-reduces its flat gradient in place). Handing the input back as that output
    makes the copy a no-op (``copy_`` of a tensor onto itself returns at once); the all-reduce and the
    sharded gradients then use the input's buffer. Never called as a collective: the engine only calls it
    over more than one rank."""

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        reduce_input, self._input = self._input, None
        if (reduce_input is not None and reduce_input.shape == torch.Size(size) and reduce_input.dtype == dtype
                and reduce_input.device == device):
            return reduce_input  # the output, asked for right after the input
        self._input = torch.empty(size, dtype=dtype, device=device)
        return self._input

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> None:
        raise AssertionError("a reduce-scatter over one rank is a copy, not a collective")


def _reduce_in_place_on_one_rank(group: FSDPParamGroup) -> None:
    if not isinstance(group.mesh_info, FSDPMeshInfo) or group._reduce_scatter_process_group.size() == 1:
        group._reduce_scatter_comm = _ReduceInPlaceOnOneRank()
    if not isinstance(group.mesh_info, FSDPMeshInfo):
        _reduce_over_replicas(group)


def _reduce_over_replicas(group: FSDPParamGroup) -> None:
    """The post-backward of a ``replicate`` (``NO_SHARD``) group, with two changes to the engine's.

    Over one rank (world size 1, no comm hook) the all-reduce is skipped: it reduces with no other rank, and
    on gloo its hand-off to the worker thread and back cost more host time per unit than the rest of the
    reduction's tensor work. The engine's own one-rank path does it: for that call the group reduces as a
    ``fully_shard`` group over the same one-rank mesh would (the reduce-scatter's copy, which
    :class:`_ReduceInPlaceOnOneRank` makes a no-op, then the cast and the sharded gradients), the same values
    (factor 1, nothing divided) and no collective. FSDP1 calls its all-reduce there too; no rank waits on it.

    ``replicate`` keeps each unit's reduce buffer (``_all_reduce_state``; over one rank without an all-reduce,
    the engine's reduce-scatter state) until the end of backward, so that the allocator does not hand it to
    another unit while the all-reduce may still run on its stream. Under ``reduce_dtype`` the gradients are
    cast out of it right away, so every unit's buffer in the reduce dtype stays alive through the rest of
    backward (FSDP1 frees its reduced flat gradient once cast). Released after each unit's post-backward
    instead; on a GPU the all-reduce buffer is recorded on the all-reduce stream first, so the allocator still
    waits for that stream's work before reusing it (FSDP1's way); on a CPU, with no streams, nothing can still
    use it, and its memory is freed at once where no gradient views it: gloo's worker thread may hold the
    tensor a moment longer, and the next unit's buffer then lived beside it (one unit's gradients in the
    reduce dtype at the step's peak, in some runs). The state's event stays for the engine's waits."""
    post_backward = group.post_backward
    over_one_rank: list[FSDPMeshInfo] = []  # made at the first backward: the mesh info the engine reduces with

    @functools.wraps(post_backward)
    def post_backward_then_release(*args: Any, **kwargs: Any) -> Any:
        replicate_info = group.mesh_info
        skip_all_reduce = _all_reduce_spans_one_rank(group)
        if skip_all_reduce:
            if not over_one_rank:
                over_one_rank.append(FSDPMeshInfo(replicate_info.mesh, shard_mesh_dim=0))
            group.mesh_info = over_one_rank[0]
        reduce_states = group.comm_ctx.reduce_scatter_states
        last_before = reduce_states[-1] if reduce_states else None
        try:
            result = post_backward(*args, **kwargs)
        finally:
            group.mesh_info = replicate_info
        state = group._all_reduce_state
        if state is not None and state.all_reduce_input.numel() > 0:
            buffer = state.all_reduce_input
            if buffer.device.type != "cpu":
                buffer.record_stream(group.comm_ctx.all_reduce_stream)  # where replicate all-reduces
            elif not _holds_gradients(buffer, group.fsdp_params):
                free_storage(buffer)
            group._all_reduce_state = state._replace(all_reduce_input=buffer.new_empty(0))
        elif skip_all_reduce and reduce_states and reduce_states[-1] is not last_before:
            buffer = reduce_states[-1].reduce_scatter_input  # this call's (no stream on a CPU to record it on)
            if buffer.device.type == "cpu" and not _holds_gradients(buffer, group.fsdp_params):
                free_storage(buffer)
        return result

    group.post_backward = post_backward_then_release  # type: ignore[method-assign]


def _all_reduce_spans_one_rank(group: FSDPParamGroup) -> bool:
    """Whether the ``replicate`` group's all-reduce is over one rank and nothing else is asked of it (a comm
    hook, accumulation without all-reduce)."""
    mesh_info: Any = group.mesh_info
    return (group._all_reduce_hook is None and group.all_reduce_grads
            and mesh_info.replicate_process_group.size() == 1)


def _holds_gradients(buffer: torch.Tensor, fsdp_params: list[FSDPParam]) -> bool:
    """Whether a sharded gradient of ``fsdp_params`` views ``buffer``'s storage (reduce dtype = parameter dtype)."""
    address = buffer.untyped_storage().data_ptr()
    return any(param.sharded_param.grad is not None
               and local_tensor(cast(DTensor, param.sharded_param.grad)).untyped_storage().data_ptr() == address
               for param in fsdp_params)


def _gathers_over_ranks(group: FSDPParamGroup) -> bool:
    # The engine's own test (``replicate``'s mesh info is no ``FSDPMeshInfo``: no gather at all).
    return isinstance(group.mesh_info, FSDPMeshInfo) and group._all_gather_process_group.size() > 1


def _plain_on_one_rank(fsdp_param: FSDPParam) -> bool:
    """Its unsharded parameter is its stored data, whole, possibly in another dtype or on another device.
    Read once per stored data (asked at every unshard; a new layout or local tensor comes with new data)."""
    data = fsdp_param._sharded_param_data
    known: tuple[weakref.ref[torch.Tensor], bool] | None = fsdp_param.__dict__.get(_PLAIN_ON_ONE_RANK)
    if known is not None and known[0]() is data:
        return known[1]
    plain = (not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
             and fsdp_param._unsharded_dtensor_spec is None
             and data.numel() == fsdp_param._orig_size.numel())
    fsdp_param.__dict__[_PLAIN_ON_ONE_RANK] = (weakref.ref(data), plain)  # weak: the data's memory is not held
    return plain


def _unshardable_in_place(fsdp_param: FSDPParam) -> bool:
    data = fsdp_param._sharded_param_data
    return fsdp_param.param_dtype in (None, data.dtype) and data.device == fsdp_param.device


def _copy_sharded_storage(fsdp_params: list[FSDPParam]) -> None:
    """Each parameter's unsharded buffer, written by one cast-and-move copy of its stored data: the copies of
    a unit in one ``_foreach_copy_`` call (per ``non_blocking``), the same copies as one ``copy_`` each, for
    a tenth of the host time (the per-call overhead dominated small units' unshards)."""
    batches: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for fsdp_param in fsdp_params:
        data = fsdp_param._sharded_param_data
        fsdp_param.init_all_gather_outputs([data.numel()], [fsdp_param.param_dtype or data.dtype], 1,
                                           fsdp_param.device)
        output = fsdp_param.all_gather_outputs[0]
        alloc_storage(output)
        outputs, sources = batches.setdefault(bool(fsdp_param.offload_to_cpu), ([], []))
        outputs.append(output)
        sources.append(data)
    for non_blocking, (outputs, sources) in batches.items():
        # As the engine: autograd must not see a new version (a recompute saves the same parameter again).
        with torch.autograd._unsafe_preserve_version_counter(tuple(outputs)):
            torch._foreach_copy_(outputs, sources, non_blocking=non_blocking)
    for fsdp_param in fsdp_params:
        # Built once (and again after an in-place one, :func:`_leave_engine_copy_when_not_in_place`); the engine's
        # own call would only find it built, these parameters having no post-all-gather (:func:`_plain_on_one_rank`).
        unsharded = fsdp_param.__dict__.get("_unsharded_param")
        if unsharded is None or getattr(unsharded, _IN_PLACE, False):
            fsdp_param.init_unsharded_param()


def _view_sharded_storage(fsdp_param: FSDPParam) -> None:
    """Register (once per storage) an unsharded parameter viewing the sharded data. Nothing is left in
    ``all_gather_outputs`` for the reshard to free: the storage is the sharded parameter's."""
    data = fsdp_param._sharded_param_data
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if (unsharded is None or not getattr(unsharded, _IN_PLACE, False) or unsharded.dtype != data.dtype
            or unsharded.data_ptr() != data.data_ptr()):  # new storage: after ``_apply``, a load, a re-point
        unsharded = nn.Parameter(data.view(fsdp_param._orig_size), requires_grad=fsdp_param.sharded_param.requires_grad)
        setattr(unsharded, _IN_PLACE, True)
        fsdp_param._unsharded_param = unsharded
        fsdp_param.all_gather_outputs = []


def _leave_engine_copy_when_not_in_place(fsdp_param: FSDPParam) -> None:
    """A parameter that stops being unshardable in place (its dtype or device changed) gets the engine's
    own unsharded parameter back: ``init_unsharded_param`` builds one only where none exists."""
    init_unsharded_param = fsdp_param.init_unsharded_param

    @functools.wraps(init_unsharded_param)
    def init_unsharded_param_over_engine_copy() -> None:
        if getattr(getattr(fsdp_param, "_unsharded_param", None), _IN_PLACE, False):
            del fsdp_param._unsharded_param
        init_unsharded_param()

    fsdp_param.init_unsharded_param = init_unsharded_param_over_engine_copy  # type: ignore[method-assign]


def engine_state(module: nn.Module | FSDPModule) -> FSDPState | None:
    """The engine's per-unit state of ``module``, or ``None``."""
    return module._get_fsdp_state() if isinstance(module, FSDPModule) else None


def param_groups(module: nn.Module | FSDPModule) -> list[FSDPParamGroup]:
    """The engine parameter groups of the unit ``module`` (may be empty)."""
    state = engine_state(module)
    return list(state._fsdp_param_groups) if state is not None else []


def managed_params(module: nn.Module) -> list[FSDPParam]:
    """The engine's per-parameter records of the unit ``module``."""
    return [fsdp_param for group in param_groups(module) for fsdp_param in group.fsdp_params]


def is_root_state_initialized(module: nn.Module) -> bool:
    """Whether the engine has run its lazy initialisation (root chosen) for ``module``'s unit."""
    state = engine_state(module)
    return state is not None and state._is_root is not None


def sharded_params(module: nn.Module) -> list[DTensor]:
    """The unit's sharded parameters (``DTensor`` nn.Parameters), in the engine's order."""
    return [cast(DTensor, fsdp_param.sharded_param) for fsdp_param in managed_params(module)]


@torch.no_grad()
def set_sharded_param_dtype(module: nn.Module, dtype: torch.dtype) -> None:
    """Re-type the unit's floating-point sharded parameters (and gradients) to ``dtype``, each
    ``nn.Parameter`` keeping its identity (``swap_tensors``, as ``nn.Module.to``). Callers reject
    units that already ran forward (all-gather buffers are sized for the old dtype)."""
    for fsdp_param in managed_params(module):
        param = fsdp_param.sharded_param
        if param.dtype == dtype or not param.is_floating_point():
            continue
        grad, param.grad = param.grad, None  # a live .grad reference blocks swap_tensors
        torch.utils.swap_tensors(param, nn.Parameter(param.to(dtype), requires_grad=param.requires_grad))
        fsdp_param.reset_sharded_param()
        if grad is not None:
            param.grad = grad.to(dtype)
    rederive_dtypes(module)  # lazy init (still to come) re-runs it; meanwhile the dtypes must be right for readers


def rederive_dtypes(module: nn.Module) -> None:
    """After the parameters' dtype changed on the engine unit ``module`` (:func:`set_sharded_param_dtype`,
    ``_apply``: ``.double()``, ``.half()``, ``.to(dtype)``). The engine
    derives each parameter's dtypes at its lazy init only and keeps its gather buffers and unsharded parameters
    in the dtype of that time: after a change past the first forward, the next backward assigned gradients of
    the old dtype (a ``RuntimeError``). The dtypes are derived again, and where a parameter's changed, its
    buffers of the old dtype are dropped (the engine's ``_apply`` resharded first: nothing holds them), to be
    re-made at the next unshard. Training then goes on as the unsharded model's (FSDP1 raises at its next
    forward there with a sharded strategy)."""
    for group in param_groups(module):
        before = [getattr(fsdp_param, "orig_dtype", None) for fsdp_param in group.fsdp_params]
        group._init_mp_dtypes()
        for fsdp_param, dtype in zip(group.fsdp_params, before):
            if dtype is None or dtype == fsdp_param.orig_dtype:
                continue
            fsdp_param.all_gather_outputs = []
            fsdp_param.__dict__.pop("_unsharded_param", None)
            fsdp_param.__dict__.pop(_PRECISION_BUFFERS, None)


# ---- runtime controls: no_sync, summon_full_params, comm hooks, recovery (``_runtime``) ----


@contextlib.contextmanager
def gradient_sync_suspended(modules: list[nn.Module]) -> Iterator[None]:
    """No gradient reduction in the units ``modules`` (one group each) for the duration, then both flags
    restored: HSDP and ``replicate`` need ``all_reduce_grads`` back, or their gradients are never written."""
    saved = [(cast(FSDPModule, unit), groups[0].reduce_grads, groups[0].all_reduce_grads)
             for unit in modules if (groups := param_groups(unit))]
    for unit, _, _ in saved:
        unit.set_requires_gradient_sync(False, recurse=False)  # both flags off
    try:
        yield
    finally:
        for unit, reduce_grads, all_reduce_grads in saved:
            unit.set_requires_gradient_sync(reduce_grads, recurse=False)
            unit.set_requires_all_reduce(all_reduce_grads, recurse=False)


ParamSlot = tuple[nn.Module, str]


def unit_param_slots(module: nn.Module) -> list[tuple[DTensor, list[ParamSlot]]]:
    """Each parameter the unit ``module`` manages: its sharded (DTensor) parameter and every
    ``(submodule, attribute name)`` it is registered under (several for a tied weight)."""
    infos = [(cast(DTensor, param.sharded_param), param._module_info) for param in managed_params(module)]
    return [(sharded, [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)])
            for sharded, info in infos]


def register_param(slots: list[ParamSlot], param: nn.Parameter | DTensor) -> None:
    """Register ``param`` in every ``(module, name)`` slot the way the engine swaps sharded/unsharded ones."""
    for module, name in slots:
        unsafe_setattr_param(module, name, cast(nn.Parameter, param))


@contextlib.contextmanager
def forward_hooks_suspended(module: nn.Module) -> Iterator[None]:
    """The engine's forward hooks of the unit ``module`` made no-ops, in place, for the duration:
    inside ``summon_full_params`` a forward runs on the full parameters in their own precision, as
    in FSDP1, where the hooks would cast inputs and all-gather over them. No public way exists."""
    state = engine_state(module)
    taken = []
    for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
        handle: Any = getattr(state, name, None)  # grouped units use another handle type: left alone
        hooks = getattr(handle, "hooks_dict_ref", lambda: None)()
        if hooks is not None and handle.id in hooks:
            taken.append((hooks, handle.id, hooks[handle.id]))
            hooks[handle.id] = lambda *args, **kwargs: None  # same key: keeps its place in the order
    try:
        yield
    finally:
        for hooks, hook_id, hook in taken:
            hooks[hook_id] = hook


def iteration_in_progress(module: nn.Module) -> bool:
    """Whether the engine is inside a forward or backward of ``module``'s tree, or one raised and
    left its per-iteration state behind (between a forward and its backward is idle)."""
    state = engine_state(module)
    if state is None:
        return False
    context = state._state_ctx
    if context.iter_forward_root is not None or context.post_backward_final_callback_queued:
        return True
    idle = _EngineTrainingState.IDLE
    return any(s._training_state != idle or any(g._training_state != idle for g in s._fsdp_param_groups)
               for s in context.all_states or [state])


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a forward now is activation-checkpoint
    recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


def recover_interrupted_iteration(module: nn.Module) -> bool:
    """If a forward or backward of the root unit ``module`` raised midway, reset the engine's
    per-iteration state and drop that iteration's unreduced gradients; return whether it did. Not
    while autograd runs: a root forward inside backward is activation-checkpoint recompute."""
    state = engine_state(module)
    if state is None or state._is_root is not True or in_backward() or not iteration_in_progress(module):
        return False
    fsdp_params = [fsdp_param for unit_state in state._state_ctx.all_states
                   for group in unit_state._fsdp_param_groups for fsdp_param in group.fsdp_params]
    # Reduced gradients stay until ``zero_grad()`` (2.15's reset drops them, earlier ones don't).
    reduced = [(fsdp_param.sharded_param, fsdp_param.sharded_param.grad) for fsdp_param in fsdp_params]
    cast(FSDPModule, module).reset_iter_state()
    # torch < 2.15 may keep ``no_sync`` accumulation apart from ``.grad`` (2.15: a read-only view of it).
    separate_accumulation = not isinstance(getattr(FSDPParam, "unsharded_accumulated_grad", None), property)
    for fsdp_param in fsdp_params:
        if hasattr(fsdp_param, "_unsharded_param"):
            fsdp_param._unsharded_param.grad = None
        if separate_accumulation:
            fsdp_param.unsharded_accumulated_grad = None
    for param, grad in reduced:
        param.grad = grad
    return True


class _CommHookReduceScatter(ReduceScatter):
    """Runs an FSDP1 comm hook ``hook(state, grad, output)`` as the reduce-scatter, with FSDP1's
    flat-parameter contract: ``grad`` the unit's flat gradient (chunk ``r`` rank ``r``'s),
    ``output`` this rank's reduced chunk."""

    def __init__(self, hook: Callable[..., Any], state: object) -> None:
        self._hook = hook
        self._state = state

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> None:
        self._hook(self._state, input_tensor, output_tensor)


@functools.lru_cache(maxsize=1)
def _group_of_this_rank_only(world: Any) -> dist.ProcessGroup | None:
    """A one-rank process group (an all-reduce over it is a no-op), made once per default group."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def install_comm_hook(module: nn.Module, hook: Callable[..., Any], state: object) -> None:
    """Make ``hook`` do the gradient communication of the unit ``module``, as FSDP1 calls it:
    ``hook(state, grad, output)`` for sharded units, ``hook(state, grad)`` (all-reduce in place)
    for replicated (``NO_SHARD``) ones. The engine no longer averages: the hook does."""
    groups = param_groups(module)
    if not groups:
        return
    unit = cast(FSDPModule, module)
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)  # with factor 1: no pre/post division at all
    if all(isinstance(group.mesh_info, FSDPMeshInfo) for group in groups):
        unit.set_custom_reduce_scatter(_CommHookReduceScatter(hook, state))
        return
    # ``replicate`` has no pluggable all-reduce, only a hook run after it: point its
    # all-reduce at a one-rank group and let the FSDP1 hook be the real communication.
    for group in groups:
        mesh_info: Any = copy.copy(group.mesh_info)
        mesh_info.replicate_process_group = _group_of_this_rank_only(dist.group.WORLD)
        group.mesh_info = mesh_info
    unit.set_all_reduce_hook(functools.partial(hook, state))


def engine_module(module: nn.Module) -> nn.Module:
    """The engine unit a wrapper holds: ``wrapper.module``, or the module inside activation-
    checkpoint wrappers put around it after wrapping (FSDP1 recipes do this)."""
    while not isinstance(module, FSDPModule) and hasattr(module, "_checkpoint_wrapped_module"):
        module = cast(nn.Module, module._checkpoint_wrapped_module)
    return module


# ---- torch-private names outside FSDP2, each with why no public API serves ----


def torch_wrap_policy_argument(policy: Any) -> Any:
    """What torch's FSDP1 ``ModuleWrapPolicy`` (its module classes) or ``CustomPolicy`` (its
    lambda) was built with: torch keeps both only as private attributes."""
    return policy._module_classes if hasattr(policy, "_module_classes") else policy._lambda_fn


def log_api_usage(event: str) -> None:
    """Record ``event`` in torch's API-usage log, as torch's own modules (and FSDP1) do."""
    torch._C._log_api_usage_once(event)


def flatten_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over all ranks of ``mesh``, itself if 1-D (``DeviceMesh`` has no public flatten; torch caches it)."""
    return mesh if mesh.ndim == 1 else mesh._flatten()


def local_shape_and_offset(like: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of ``like``'s local shard on this rank (uneven, empty included).
    ``distribute_tensor`` would first move the whole tensor to the mesh's device (CPU offload)."""
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return tuple(shape), tuple(offset)


def new_sharded_tensor(local: torch.Tensor, size: torch.Size,
                       pieces: list[tuple[tuple[int, ...], tuple[int, ...], int]], group: dist.ProcessGroup,
                       requires_grad: bool = False) -> Any:
    """FSDP1's ``ShardedTensor`` of global ``size`` over ``group``: ``pieces`` lists the ``(offsets,
    sizes, global rank)`` of every rank holding a piece; ``local`` is this rank's, kept as it is (no
    copy), if this rank is among them. Built from metadata alone, as FSDP1's own
    ``_create_chunk_sharded_tensor``: the public ``init_from_local_shards`` all-gathers every rank's
    metadata to check it, once per tensor. ``requires_grad``: recorded in the metadata (FSDP1's
    LOCAL flat parameters record their parameter's ``True``)."""
    device = local.device
    devices = max(torch.accelerator.device_count(), 1)

    def placement(rank: int) -> str:
        return f"rank:{rank}/cpu" if device.type == "cpu" else f"rank:{rank}/{device.type}:{rank % devices}"

    shards = [ShardMetadata(list(offsets), list(sizes), placement(rank)) for offsets, sizes, rank in pieces]
    me = dist.get_rank()
    local_shards = [Shard(local, ShardMetadata(list(offsets), list(sizes), f"rank:{dist.get_rank()}/{device}"))
                    for offsets, sizes, rank in pieces if rank == me]
    metadata = ShardedTensorMetadata(shards_metadata=shards, size=size,
                                     tensor_properties=TensorProperties(dtype=local.dtype, requires_grad=requires_grad))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, metadata, process_group=group)


def sharded_tensor_group(value: Any) -> dist.ProcessGroup:
    """The process group an FSDP1 ``ShardedTensor`` is sharded over (not exposed publicly)."""
    return value._process_group


def registered_child(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s child registered as ``name``, or ``None``: exactly the registry that state-dict
    keys come from (``getattr`` would also find plain attributes and properties)."""
    return module._modules.get(name)


def sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """A sparse ``grad``'s values, coalesced or not (public ``values()`` requires coalesced)."""
    return grad._values()


class GradScalerBase(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose private ``_unscale_grads_`` (unscale ``optimizer``'s gradients
    in place, return each device's found-inf flag) a subclass defines as ``unscale_local_grads``."""

    unscale_local_grads: Callable[..., dict[torch.device, torch.Tensor]]

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        return self.unscale_local_grads(optimizer, inv_scale, found_inf, allow_fp16)

    @staticmethod
    def unscale_and_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        """``grads`` (one device and dtype) times ``inv_scale`` in place; ``found_inf`` set to 1
        on any inf/NaN (torch's fused kernel; no public entry point)."""
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# ---- torch.distributed.checkpoint.state_dict interop ----
# torch's ``get_state_dict`` / ``set_state_dict`` family (``dsd``) recognises FSDP1 only by its class (it sets
# FSDP1's state-dict type in ``_StateDictInfo.fsdp_context`` and drops ``_fsdp_wrapped_module.`` in ``_get_fqns``);
# nothing public lets another class take part (``_fqn_modifiers`` renames model entries only, not optimizer
# ones). So, at import, we wrap ``_verify_options`` (its ``fsdp_context`` then also publishes the call's
# options: :func:`distributed_checkpoint_request`) and ``_get_fqns`` (names lose the wrapper segment).
# Under ``fsdp_compat.patch_torch()`` torch's ``FSDP`` is our class: torch then runs its FSDP1 path on our
# units through our public API, and ``_verify_state_dict`` is wrapped to skip its FSDP1-state check on them.
# ``tests/test_dcp_state_dict_api.py`` fails loudly when a torch upgrade moves them.

_WRAPPER_SEGMENT = "_fsdp_wrapped_module"
_INTEROP_MARK = "_fsdp_compat_interop"
_dcp_request: contextvars.ContextVar[Any | None] = contextvars.ContextVar("fsdp_compat_dcp_request", default=None)


def distributed_checkpoint_request() -> Any | None:
    """The ``StateDictOptions`` of the ``dsd`` call running the model's (load_)state_dict now, or ``None``."""
    return _dcp_request.get()


@contextlib.contextmanager
def _publishing(options: Any, inner: Callable[[], Any]) -> Iterator[None]:
    with inner():
        token = _dcp_request.set(options)
        try:
            yield
        finally:
            _dcp_request.reset(token)


def _install_distributed_checkpoint_interop() -> bool:
    """Wrap ``dsd._verify_options``, ``dsd._get_fqns`` and the others above once; ``False`` if torch lacks them."""
    try:
        from torch.distributed.checkpoint import state_dict as dsd
        verify_options, get_fqns, info_class = dsd._verify_options, dsd._get_fqns, dsd._StateDictInfo
        dsd._get_optim_state_dict, dsd._load_optim_state_dict, dsd._load_model_state_dict  # noqa: B018 (wrapped below)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the torch version
        return False
    # Only needed while switched: its absence leaves the rest of the interop in place.
    verify_state_dict = getattr(dsd, "_verify_state_dict", None)
    if "fsdp_context" not in {field.name for field in dataclasses.fields(info_class)}:
        return False
    if getattr(verify_options, _INTEROP_MARK, False):
        return True

    @functools.wraps(verify_options)
    def verify_options_publishing(*args: Any, **kwargs: Any) -> Any:
        info = verify_options(*args, **kwargs)
        info.fsdp_context = functools.partial(_publishing, info, info.fsdp_context)
        return info

    @functools.wraps(get_fqns)
    def get_fqns_without_wrappers(model: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
        fqns = get_fqns(model, name, *args, **kwargs)
        if _WRAPPER_SEGMENT not in name:
            return fqns
        return {".".join(part for part in fqn.split(".") if part != _WRAPPER_SEGMENT) for fqn in fqns}

    get_optim, load_optim = dsd._get_optim_state_dict, dsd._load_optim_state_dict

    @functools.wraps(get_optim)
    def get_optim_in_layout(model: nn.Module, optimizers: Any, *args: Any, **kwargs: Any) -> Any:
        with _optimizers_in_layout(dsd, model, optimizers, (*args, *kwargs.values())) as translated:
            state_dict = get_optim(model, optimizers, *args, **kwargs)
            return _copies_of_live_state(state_dict, optimizers) if translated else state_dict

    @functools.wraps(load_optim)
    def load_optim_in_layout(model: nn.Module, optimizers: Any, *args: Any, **kwargs: Any) -> Any:
        with _optimizers_in_layout(dsd, model, optimizers, (*args, *kwargs.values())):
            return load_optim(model, optimizers, *args, **kwargs)

    load_model = dsd._load_model_state_dict

    @functools.wraps(load_model)
    def load_model_in_layout(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # It reads the model's parameters (``named_parameters``) for the local values to load into.
        with contextlib.ExitStack() as stack:
            for layout in _dcp_model_layout:
                stack.enter_context(layout(model))
            return load_model(model, *args, **kwargs)

    for wrapped in (verify_options_publishing, get_fqns_without_wrappers, get_optim_in_layout, load_optim_in_layout,
                    load_model_in_layout):
        setattr(wrapped, _INTEROP_MARK, True)
    dsd._verify_options = verify_options_publishing
    dsd._get_fqns = get_fqns_without_wrappers
    dsd._get_optim_state_dict = get_optim_in_layout
    dsd._load_optim_state_dict = load_optim_in_layout
    dsd._load_model_state_dict = load_model_in_layout
    if verify_state_dict is not None:
        dsd._verify_state_dict = _verifying_torch_units_only(verify_state_dict)
    return True


def _verifying_torch_units_only(verify_state_dict: Callable[..., Any]) -> Callable[..., Any]:
    """``dsd._verify_state_dict`` checking torch's own FSDP1 units only. Under ``fsdp_compat.patch_torch()``
    torch's ``FSDP`` name is our class, so our units join ``info.fsdp_modules`` and torch runs its FSDP1 path
    on them (through our public FSDP1 API); this check would then ask each for FSDP1's private state object,
    which ours never have (and while switched no torch unit can be in the model: the classes never mix)."""

    @functools.wraps(verify_state_dict)
    def verify_state_dict_of_torch_units(model_state_dict: Any, optim_state_dict: Any, info: Any) -> Any:
        units = info.fsdp_modules
        info.fsdp_modules = [unit for unit in units if _is_torch_fsdp1_unit(unit)]
        try:
            return verify_state_dict(model_state_dict, optim_state_dict, info)
        finally:
            info.fsdp_modules = units

    setattr(verify_state_dict_of_torch_units, _INTEROP_MARK, True)
    return verify_state_dict_of_torch_units


def _is_torch_fsdp1_unit(module: nn.Module) -> bool:
    return TORCH_FSDP1_CLASS is not None and isinstance(module, TORCH_FSDP1_CLASS)


# How ``dsd`` sees a model and its optimizers: FSDP1's plain parameters put them in the engine's DTensor
# layout for the call (``_engine_flat.engine_params`` and ``_optim_views.engine_layout``, registered through
# :func:`set_dcp_model_layout` and :func:`set_dcp_optimizer_layout`).
_dcp_model_layout: list[Callable[[nn.Module], contextlib.AbstractContextManager[Any]]] = []
_dcp_optimizer_layout: list[Callable[[nn.Module, Any], contextlib.AbstractContextManager[Any]]] = []


def set_dcp_model_layout(layout: Callable[[nn.Module], contextlib.AbstractContextManager[Any]]) -> None:
    """Make torch's ``set_state_dict`` family load a model inside ``layout(model)``."""
    _dcp_model_layout[:] = [layout]


def set_dcp_optimizer_layout(layout: Callable[[nn.Module, Any], contextlib.AbstractContextManager[Any]]) -> None:
    """Make torch's ``get_state_dict`` / ``set_state_dict`` run each optimizer inside ``layout(model, optim)``."""
    _dcp_optimizer_layout[:] = [layout]


@contextlib.contextmanager
def _optimizers_in_layout(dsd: Any, model: nn.Module, optimizers: Any, args: tuple[Any, ...]) -> Iterator[bool]:
    """Each optimizer in its layout; the call's parameter-name maps (``_verify_options`` built them from
    the parameters shown before) rebuilt from the parameters the model holds now, as it builds them.
    Yields whether a layout translated an optimizer (its state, for the call, views of its own)."""
    if not _dcp_optimizer_layout:
        yield False
        return
    translated = False
    with contextlib.ExitStack() as stack:
        for optim in optimizers:
            for layout in _dcp_optimizer_layout:
                translated |= bool(getattr(stack.enter_context(layout(model, optim)), "active", False))
        info = next((arg for arg in args if isinstance(arg, dsd._StateDictInfo)), None)
        saved = (info.fqn_param_mapping, info.shared_params_mapping) if info is not None else None
        if info is not None:
            info.fqn_param_mapping, info.shared_params_mapping = _param_name_maps(dsd, model)
        try:
            yield translated
        finally:
            if info is not None and saved is not None:
                info.fqn_param_mapping, info.shared_params_mapping = saved


def _copies_of_live_state(state_dict: Any, optimizers: Any) -> Any:
    """``state_dict`` (torch's, taken in the layout) with each tensor that is an optimizer's own state
    object replaced by a copy, in new containers. torch returns ``optim.state_dict()``'s tensors as they
    are (SHARDED; ``step`` even when FULL), and a translated optimizer's are, for the call, views of its
    live plain state: the caller would hold tensors the next step changes, and a flat parameter's pieces
    are DTensors over slices at an offset, which ``copy.deepcopy`` and ``torch.save`` cannot handle
    (the wrapper's storage offset is the local's, over no storage). FSDP1 returns state of its own."""
    live = {id(value) for optim in optimizers for param_state in optim.state.values()
            for value in param_state.values() if isinstance(value, torch.Tensor)}
    copies: dict[int, torch.Tensor] = {}

    def own(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: own(item) for key, item in value.items()}
        if isinstance(value, list):
            return [own(item) for item in value]
        if isinstance(value, torch.Tensor) and id(value) in live:
            if id(value) not in copies:  # one copy for an object met twice, as deepcopy would
                copies[id(value)] = value.detach().clone()
            return copies[id(value)]
        return value

    return own(state_dict)


def _param_name_maps(dsd: Any, model: nn.Module) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``dsd._verify_options``'s ``fqn_param_mapping`` and ``shared_params_mapping``, built the same way."""
    fqn_param_mapping: dict[Any, Any] = {}
    shared_params_mapping: dict[Any, Any] = {}
    for name, param in dsd._iterate_valid_model_state(model):
        if isinstance(param, dsd._EXTRA_STATE):
            continue
        fqns = dsd._get_fqns(model, name)
        if param in fqn_param_mapping:
            fqn_param_mapping[param].update(fqns)
            shared_params_mapping[param] = fqn_param_mapping[param]
        else:
            fqn_param_mapping[param] = set(fqns)
        for fqn in fqns:
            fqn_param_mapping[fqn] = param
    for param, fqns in list(shared_params_mapping.items()):
        for fqn in fqns:
            shared_params_mapping[fqn] = param
    return fqn_param_mapping, shared_params_mapping


DISTRIBUTED_CHECKPOINT_INTEROP: bool = _install_distributed_checkpoint_interop()


def multiply_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply each of ``tensors`` in place by the one-element ``factor``, with torch's foreach kernel per
    device and dtype: what ``torch.nn.utils.clip_grad_norm_`` does to the gradients (one rounding per
    element, the same values as a ``mul_`` each), one call per group instead of one per tensor."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for (device, _), group in groups.items():
        torch._foreach_mul_(group, factor.to(device))


def local_tensor(value: DTensor) -> torch.Tensor:
    """``value``'s local shard, for reading its device and shape: ``to_local()`` builds an
    autograd node each call (~10 us), which adds up over every optimizer-state tensor."""
    return value._local_tensor


# DTensor's C++ constructor proper, where it is DTensor's ``__new__`` (torch 2.13 and 2.15): its
# Python ``__init__`` only sits behind dynamo-disabling wrappers (2-5 us a tensor).
_DTENSOR_NEW = getattr(torch.Tensor, "_dtensor__new__", None)
if DTensor.__dict__.get("__new__") is not _DTENSOR_NEW:
    _DTENSOR_NEW = None


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's piece of a DTensor laid out exactly as ``like`` (no copy). Reusing
    ``like``'s spec (same dtype) builds no autograd node and no spec: ``DTensor.from_local`` costs
    ~4x as much, which dominates loading many small optimizer-state tensors."""
    if _DTENSOR_NEW is not None and local.dtype == like.dtype and not local.requires_grad:
        return _DTENSOR_NEW(DTensor, local, like._spec, requires_grad=False)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def forget_dtensor_layout_caches() -> None:
    """Empty DTensor's caches of operator output layouts (Python and C++ fast path), as after a new
    default process group: they are keyed by meshes, which compare by ranks and dimension names,
    not by process groups, so they would give new tensors a mesh of the destroyed groups (and torch
    names new groups "1", "2"... again, so such a mesh may even resolve to other ranks' groups).
    torch has only a debugging helper for this (``torch.distributed.tensor.debug._clear_sharding_prop_cache``),
    whose package imports torch's memory and runtime estimators: 2.7 MB of resident memory in every process
    that wraps a model. Its two calls are made here; the helper only where they are missing."""
    propagate = getattr(getattr(DTensor._op_dispatcher, "sharding_propagator", None), "propagate_op_sharding", None)
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if callable(getattr(propagate, "cache_clear", None)) and callable(clear_fast_path):
        propagate.cache_clear()  # type: ignore[union-attr]
        clear_fast_path()
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def optimizer_param_groups(optim: Any) -> list[dict[str, Any]]:
    """Every param group dict that ``optim`` steps: its own, and for torch's ``_NamedOptimizer`` (TorchRec)
    those of the optimizer it wraps (``_optimizer``), which ``load_state_dict`` replaces with new dicts, so
    that the two lists stop sharing them. Each dict once."""
    groups = list(optim.param_groups)
    inner = getattr(optim, "_optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        groups += inner.param_groups
    return list({id(group): group for group in groups}.values())
