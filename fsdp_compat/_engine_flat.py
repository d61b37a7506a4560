"""FSDP1's parameter model on the engine's storage: plain local-shard views, the engine's DTensors kept inside.

FSDP1 never shows a ``DTensor``: outside forward and backward every parameter a user reaches is a plain
tensor holding this rank's shard (``use_orig_params=True``: a 1-D view into the unit's flat local shard).
The engine keeps each parameter's local rows in its own padded 1-D buffer (``FSDPParam._sharded_param_data``)
behind a sharded ``DTensor``. Per unit and dtype, :class:`LocalShards` copies those buffers into one flat
buffer, points the engine's storage at slices of it, and registers, wherever the engine would register its
sharded ``DTensor`` (after init, after each reshard), a plain ``nn.Parameter`` viewing this rank's unpadded
piece. The layout is the engine's: each parameter's dim-0 chunk (``ceil(rows / world)`` rows, padded with
zeros on the ranks whose chunk is short), concatenated in the engine's order. FSDP1 splits the concatenation
evenly instead; :attr:`LocalShards.shard_infos` describe ours truthfully.

Gradients follow the same layout: after the root's post-backward (the engine's final callback) each view's
``.grad`` is a 1-D view into one flat local gradient per unit and dtype, which is also the engine's sharded
gradient (so the next backward accumulates into it). Flat mode shows only the flat parameters' ``.grad``
(that flat gradient); its views, which no user reaches, hold none: the engine's sharded gradients are the
pieces' state there. Writes reach the engine: in-place updates alias its
storage; a replaced ``.data`` or ``.grad``, or ``.grad = None``, is written back (:meth:`LocalShards.writeback`)
before the next forward and before any internal entry point reads the engine's parameters
(:func:`engine_params`). Where the engine re-allocates its storage (``reset_sharded_param`` after ``_apply``,
``load_state_dict(assign=True)``, dtype changes, meta-device materialisation) the flat buffer is rebuilt
and the views re-pointed (:meth:`LocalShards.follow`), each view keeping its identity.

Torch-private names used here (``test_the_engine_still_has_the_storage_names_the_views_rely_on`` in
``tests/test_local_shard_params.py`` fails when a torch upgrade moves them):
``FSDPParam._sharded_param_data``, ``padded_sharded_param_size``, ``sharded_size``, ``sharded_state``,
``_setattr_on_modules``, ``reset_sharded_param``, ``to_sharded_dtensor``, ``_module_info``;
``DTensor._local_tensor``; ``FSDPState._root_post_backward_final_callback``, ``_pre_backward`` and
``_state_ctx.all_states``; ``FSDPParamGroup._partial_reduce_output``. Around forward and in ``no_sync``
(issue 29): ``FSDPState._fsdp_param_groups``, ``_state_ctx.iter_forward_root``; ``FSDPParamGroup.is_unsharded``,
``reshard``; ``FSDPParam.unsharded_param``, ``_unsharded_param``, ``unsharded_accumulated_grad``,
``_sharded_post_forward_param``, ``_param_fqn``; ``torch._C._current_graph_task_id`` (``_engine.in_backward``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState
from torch.utils.weak import WeakIdKeyDictionary

from . import _engine

_ATTR = "_fsdp_compat_local_shards"  # on the engine's FSDPState: its unit's LocalShards
# view -> the engine's sharded DTensor it shows (weak on the view: the entry goes with it).
_sharded_of_view: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The reverse, by the DTensor's id (a weak reference to it would make ``swap_tensors`` refuse it: ``_apply``);
# a stale id is harmless, the lookup confirms. Flat mode: no entry (its views are no parameters).
_view_of_sharded: dict[int, weakref.ref[nn.Parameter]] = {}
_flat_owner: WeakIdKeyDictionary = WeakIdKeyDictionary()  # flat parameter -> (LocalShards, buffer index)
# Flat mode's sharded DTensors, by id (as above; the lookup confirms) -> their unit's LocalShards: hidden
# behind the flat parameters, no optimizer's to step.
_hidden_in_flat: dict[int, weakref.ref[LocalShards]] = {}
# The engine's own parameter objects a module slot may hold (not a user's replacement).
_ENGINE_PARAM_ATTRS = ("sharded_param", "_unsharded_param", "_sharded_post_forward_param")
_constructing = 0  # wrappers being built: until the outermost is, the engine's DTensors stay registered

ENGINE_NAMES = {
    FSDPParam: ("_setattr_on_modules", "reset_sharded_param", "to_sharded_dtensor"),
    _engine.FSDPState: ("_root_post_backward_final_callback", "_pre_backward"),
}


@dataclasses.dataclass(frozen=True)
class ShardParamInfo:
    """FSDP1's ``_ShardParamInfo``: where one parameter's piece lies in this rank's flat shard. A value, as
    FSDP1's named tuple: checkpointers (OLMo's) compare the saved ones with the model's."""

    in_shard: bool
    offset_in_shard: int | None  # into the flat shard (its dtype's buffer)
    numel_in_shard: int | None
    intra_param_start_idx: int | None  # into the flattened full parameter, inclusive
    intra_param_end_idx: int | None  # inclusive, as FSDP1's


class _FlatGrad(NamedTuple):
    """A flat parameter's ``.grad`` as a writeback gave it to the engine."""

    grad: torch.Tensor | None  # (held no longer than ours: ``None`` or the flat gradient the unit keeps)
    address: int | None  # a ``.data`` swap keeps the object
    dtype: torch.dtype | None

    @staticmethod
    def of(param: nn.Parameter) -> _FlatGrad:
        grad = param.grad
        return _FlatGrad(grad, None, None) if grad is None else _FlatGrad(grad, grad.data_ptr(), grad.dtype)


def _same_grads(asked: list[_FlatGrad], given: list[_FlatGrad] | None) -> bool:
    """Whether ``asked`` is what ``given`` records (the gradients compared as objects, never by value)."""
    return given is not None and len(asked) == len(given) and all(
        now.grad is then.grad and now.address == then.address and now.dtype == then.dtype
        for now, then in zip(asked, given))


@dataclasses.dataclass(eq=False)
class _Piece:
    """One engine parameter: its slice of its dtype's flat buffer and the plain view over it."""

    fsdp_param: FSDPParam
    buffer: int  # index into LocalShards.flats
    offset: int
    padded_numel: int
    numel: int  # this rank's unpadded elements
    shape: tuple[int, ...]  # the view's: 1-D on sharded units, the parameter's own on replicated ones
    view: nn.Parameter
    data: torch.Tensor | None = None  # the slice handed to the engine as ``_sharded_param_data``
    data_ptr: int = 0  # its address: a view still over it was not replaced (checked without a tensor op)
    sharded: Any = None  # the engine's sharded DTensor parameter at the last (re)build
    local: torch.Tensor | None = None  # and its local tensor
    shown: torch.Tensor | None = None  # flat mode: the plain tensor last registered in its slots
    slots_of: Any = None  # the engine's ``_module_info`` that ``slots`` were read from
    slots: list[tuple[nn.Module, str]] = dataclasses.field(default_factory=list)

    def module_slots(self) -> list[tuple[nn.Module, str]]:
        """:func:`_slots` of its parameter, read once per ``_module_info`` (twice a step per parameter)."""
        info = self.fsdp_param._module_info
        if self.slots_of is not info:
            self.slots_of, self.slots = info, _slots(self.fsdp_param)
        return self.slots


def _check_supported(fsdp_param: FSDPParam) -> None:
    if fsdp_param.fsdp_placement.dim != 0 or fsdp_param.is_dtensor or hasattr(
            _local(fsdp_param.sharded_param), "fsdp_pre_all_gather"):
        raise ValueError(
            f"Plain local-shard parameters need the engine's default layout (Shard(0) over plain tensors); "
            f"{fsdp_param._param_fqn or 'a parameter'} is sharded otherwise. Pass dtensor_params=True to "
            "keep the engine's DTensor parameters")


class LocalShards:
    """One unit's flat local shard(s) (one per dtype) and the plain parameter views over them."""

    def __init__(self, module: nn.Module, flat_mode: bool = False) -> None:
        self.module = module
        # ``use_orig_params=False``: the module tree's parameters are the flat ones (registered on ``module``
        # as ``_flat_param``), each original slot a plain tensor attribute viewing its piece.
        self.flat_mode = flat_mode
        self.fsdp_params: list[FSDPParam] = _engine.managed_params(module)
        self.groups = _engine.param_groups(module)  # fixed once the engine built the unit
        for fsdp_param in self.fsdp_params:
            _check_supported(fsdp_param)
        self.engine_depth = 0  # >0: the engine's DTensors stay registered (internal entry points)
        self.flats: list[torch.Tensor] = []
        self.grad_flats: list[torch.Tensor | None] = []
        self.pieces: list[_Piece] = []
        self.members: list[list[_Piece]] = []  # the pieces of each dtype buffer, in ``pieces``' order
        self.flat_params: list[nn.Parameter] = []
        # ``no_sync``: the unreduced gradients shown (FSDP1's): flat mode's per buffer, and the pieces showing one.
        self.unreduced_flats: list[torch.Tensor | None] = []
        self.unreduced_pieces: set[int] = set()
        # Flat mode: the flat parameters' flags and gradients the engine was last given (:meth:`writeback`),
        # while nothing else changed its side since; ``None`` where something may have.
        self.flat_flags_given: list[bool] | None = None
        self.flat_grads_given: list[_FlatGrad] | None = None
        self.flat_params_stale = True  # the pieces were (re)pointed since the flat parameters last looked
        self._build()
        for piece in self.pieces:
            self._intercept(piece.fsdp_param)
        state = _engine.engine_state(module)
        setattr(state, _ATTR, self)
        _sync_grads_after_backward(cast(_engine.FSDPState, state))
        _writeback_before_backward(cast(_engine.FSDPState, state), self)

    # ---- layout ----

    def _build(self) -> None:
        """(Re)build the flat buffers from the engine's sharded parameters' local tensors (the truth the
        engine re-pads from, also between ``_apply`` and ``reset_sharded_param``) and point it at slices."""
        old = {id(piece.fsdp_param): piece for piece in self.pieces}
        locals_ = [_local(fsdp_param.sharded_param) for fsdp_param in self.fsdp_params]
        dtypes = list(dict.fromkeys(local.dtype for local in locals_))
        self.flats, self.grad_flats, pieces = [], [], []
        self.forget_given()  # new pieces, their flags the engine's
        for index, dtype in enumerate(dtypes):
            members = [(p, local) for p, local in zip(self.fsdp_params, locals_) if local.dtype == dtype]
            sizes = [math.prod(p.padded_sharded_param_size) for p, _ in members]
            source = members[0][1]
            pinned = source.device.type == "cpu" and not source.is_meta and source.is_pinned()
            flat = torch.zeros(sum(sizes), dtype=dtype, device=source.device, pin_memory=pinned)
            offset = 0
            for (fsdp_param, local), padded in zip(members, sizes):
                numel = local.numel()
                with torch.no_grad():
                    flat[offset:offset + numel].copy_(local.reshape(-1))
                shape = _view_shape(fsdp_param, numel)
                previous = old.get(id(fsdp_param))
                view = previous.view if previous is not None else nn.Parameter(
                    flat[offset:offset + numel].view(shape), requires_grad=fsdp_param.sharded_param.requires_grad)
                pieces.append(_Piece(fsdp_param, index, offset, padded, numel, shape, view))
                offset += padded
            self.flats.append(flat)
            self.grad_flats.append(None)
        order = {id(p): i for i, p in enumerate(self.fsdp_params)}
        self.pieces = sorted(pieces, key=lambda piece: order[id(piece.fsdp_param)])
        # Read on every step (writeback, gradient sync): built with the pieces, not filtered each time.
        self.members = [[piece for piece in self.pieces if piece.buffer == index] for index in range(len(self.flats))]
        # The engine's registrations (:meth:`_intercept`) find the current piece here: a rebuild makes new ones.
        self.piece_of = {id(piece.fsdp_param): piece for piece in self.pieces}
        for piece in self.pieces:
            self._repoint(piece)
        self.flat_params_stale = True  # :meth:`_ensure_flat_params` reads the re-pointed pieces again
        if len(self.flat_params) != len(self.flats):
            self.flat_params = []
        for param, flat in zip(self.flat_params, self.flats):  # same objects over the new buffers
            param.data = flat

    def _repoint(self, piece: _Piece) -> None:
        fsdp_param = piece.fsdp_param
        data = self.flats[piece.buffer][piece.offset:piece.offset + piece.padded_numel]
        rows = fsdp_param.sharded_size[0] if piece.numel > 0 else 0
        fsdp_param._sharded_param_data = data
        local = data.view(fsdp_param.padded_sharded_param_size).narrow(0, 0, rows)
        cast(Any, fsdp_param.sharded_param)._local_tensor = local
        piece.data, piece.sharded, piece.local = data, fsdp_param.sharded_param, local
        piece.data_ptr = data.data_ptr()
        _sharded_of_view[piece.view] = fsdp_param.sharded_param
        if not self.flat_mode:
            _view_of_sharded[id(fsdp_param.sharded_param)] = weakref.ref(piece.view)
        else:
            _hidden_in_flat[id(fsdp_param.sharded_param)] = weakref.ref(self)
        target = data[:piece.numel].view(piece.shape)
        if piece.view.data_ptr() != target.data_ptr() or piece.view.dtype != target.dtype or piece.numel == 0:
            piece.view.data = target
        piece.view.requires_grad_(fsdp_param.sharded_param.requires_grad)
        if getattr(fsdp_param.sharded_param, "grad_dtype", "absent") is None:  # keep_low_precision_grads
            piece.view.grad_dtype = None

    def _grad_slice(self, piece: _Piece, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``piece``'s slice of its flat gradient, in ``dtype`` (default: the buffer's, else the parameter's:
        ``keep_low_precision_grads`` keeps gradients in another dtype than the parameters)."""
        flat = self.grad_flats[piece.buffer]
        if flat is None or (dtype is not None and flat.dtype != dtype):
            flat = self._new_grad_flat(piece.buffer, dtype or self.flats[piece.buffer].dtype)
        return _slice(flat, piece)

    def _new_grad_flat(self, buffer: int, dtype: torch.dtype) -> torch.Tensor:
        """Allocate buffer ``buffer``'s flat gradient in ``dtype``, the gradients already there carried over."""
        old = self.grad_flats[buffer]
        flat = self.grad_flats[buffer] = torch.zeros_like(self.flats[buffer], dtype=dtype)
        if old is not None:
            flat.copy_(old)
            for piece in self.members[buffer]:
                if self._has_grad(piece):
                    self._set_engine_grad(piece, _slice(flat, piece))
                    if not self.flat_mode:
                        piece.view.grad = _slice(flat, piece)
        return flat

    def _has_grad(self, piece: _Piece) -> bool:
        """Whether ``piece`` holds a gradient: its view's (flat mode: the engine's, its views hold none)."""
        return (piece.fsdp_param.sharded_param.grad if self.flat_mode else piece.view.grad) is not None

    def follow(self) -> None:
        """Rebuild when the engine re-allocated a parameter's storage (views keep their identity)."""
        for piece in self.pieces:  # several times a step per unit: a plain loop, each object compared once
            fsdp_param, sharded = piece.fsdp_param, piece.sharded
            if (sharded._local_tensor is not piece.local or fsdp_param._sharded_param_data is not piece.data
                    or fsdp_param.sharded_param is not sharded):
                break
        else:
            return
        grads = [(piece, piece.fsdp_param.sharded_param.grad) for piece in self.pieces]
        self._build()
        for piece, grad in grads:
            piece.view.grad = None
            if grad is not None:
                self._set_engine_grad(piece, _local(grad))
                if not self.flat_mode:
                    piece.view.grad = self._grad_slice(piece, grad.dtype)
            else:
                piece.fsdp_param.sharded_param.grad = None

    # ---- registration ----

    def _intercept(self, fsdp_param: FSDPParam) -> None:
        """Per instance: the engine's registrations of its sharded DTensor register the view instead,
        and ``reset_sharded_param`` (which reads the module slot) sees the DTensor."""
        setattr_on_modules = fsdp_param._setattr_on_modules
        reset_sharded_param = fsdp_param.reset_sharded_param

        def register(param: nn.Parameter) -> None:
            if param is fsdp_param.sharded_param and self.engine_depth == 0 and not _constructing:
                self._register_view(self.piece_of[id(fsdp_param)], setattr_on_modules)
                return
            if self.flat_mode:  # (only flat mode registers plain attributes: four times a step per parameter)
                _drop_plain_attributes(self.piece_of[id(fsdp_param)].module_slots())
            setattr_on_modules(param)

        def reset() -> None:
            piece = self.piece_of[id(fsdp_param)]
            showing_view = self._shows_view(piece)
            if showing_view:
                _drop_plain_attributes(piece.module_slots())
                setattr_on_modules(fsdp_param.sharded_param)
            reset_sharded_param()
            self.follow()
            if showing_view and self.engine_depth == 0 and not _constructing:
                self._register_view(self.piece_of[id(fsdp_param)], setattr_on_modules)  # (rebuilt by follow)

        fsdp_param._setattr_on_modules = register  # type: ignore[method-assign]
        fsdp_param.reset_sharded_param = reset  # type: ignore[method-assign]

    def _register_view(self, piece: _Piece, setattr_on_modules: Any) -> None:
        """What the user sees in ``piece``'s slots: its view as the parameter, or (flat mode) as a plain
        tensor attribute, the unit's flat parameters being the module tree's parameters."""
        if not self.flat_mode:
            setattr_on_modules(piece.view)
            return
        plain = piece.shown
        # One object for every slot (a tied weight stays one tensor), re-made only where the storage moved
        # or the user marked it: registered again at every reshard, twice a step per parameter.
        if plain is None or plain.requires_grad or plain.data_ptr() != piece.data_ptr or piece.numel == 0 \
                or piece.view.data_ptr() != piece.data_ptr or plain.dtype != piece.view.dtype:
            plain = piece.shown = piece.view.data
        for module, name in piece.module_slots():
            module._parameters.pop(name, None)
            module.__dict__[name] = plain

    def _shows_view(self, piece: _Piece) -> bool:
        if not self.flat_mode:
            return _slot_value(piece.fsdp_param) is piece.view
        module, name = piece.module_slots()[0]
        return name in module.__dict__ and name not in module._parameters

    def _shows_current_view(self, piece: _Piece) -> bool:
        """Whether every slot of ``piece`` shows what :meth:`_register_view` would register now: its view, or
        (flat mode) a plain tensor over the view's current storage, the same object in every slot."""
        info = piece.fsdp_param._module_info
        if not self.flat_mode:
            return self._shows_view(piece) and (not info.shared_modules or all(
                module._parameters.get(name) is piece.view
                for module, name in zip(info.shared_modules, info.shared_param_names)))
        shown = piece.shown
        # A re-pointed view (``_repoint``) or a user's ``.data`` swap moves the address.
        if shown is None or piece.numel == 0 or shown.data_ptr() != piece.data_ptr \
                or piece.view.data_ptr() != piece.data_ptr or info.module.__dict__.get(info.param_name) is not shown:
            return False
        # A tied weight's other slots (looked at only where there are some: this runs twice a step per piece).
        return not info.shared_modules or all(
            module.__dict__.get(name) is shown for module, name in zip(info.shared_modules, info.shared_param_names))

    def show(self) -> None:
        """Register in the module slots what the user should see outside forward and backward: the views,
        also of parameters the engine keeps unsharded for the backward to come (those are registered
        again before that backward and before its activation-checkpoint recompute: :meth:`show_unsharded`,
        no communication); in flat mode, the flat parameters on
        the unit's module. Mid-iteration (an entry point called from a forward hook) only the sharded
        ones: the rest of that forward reads the unsharded parameters."""
        registers_views = self.engine_depth == 0 and not _constructing
        mid_iteration: bool | None = None  # asked only where a slot needs registering: it walks every unit
        for piece in self.pieces:
            if registers_views and self._shows_current_view(piece):
                continue  # the engine's reshard registered it already (twice a step, for every piece)
            if mid_iteration is None:
                mid_iteration = _engine.iteration_in_progress(self.module)
            if not mid_iteration or piece.fsdp_param.sharded_state == ShardedState.SHARDED:
                piece.fsdp_param._setattr_on_modules(piece.fsdp_param.sharded_param)
        if self.flat_mode:
            self._ensure_flat_params()
            for index, param in enumerate(self.flat_params):
                self.module._parameters[_flat_name(index)] = param

    def show_unsharded(self) -> None:
        """The engine's unsharded parameters in the slots of the pieces it holds unsharded, where the
        views were shown since the forward: what the unit's backward and its activation-checkpoint
        recompute read (FSDP1 holds its unsharded views there then). No communication."""
        for piece in self.pieces:
            fsdp_param = piece.fsdp_param
            if (fsdp_param.sharded_state == ShardedState.UNSHARDED
                    and _slot_value(fsdp_param) is not fsdp_param.unsharded_param):
                fsdp_param._setattr_on_modules(fsdp_param.unsharded_param)

    def hide(self) -> None:
        """The engine's DTensors in every slot showing a view; flat parameters unregistered."""
        for index in range(len(self.flats)):
            self.module._parameters.pop(_flat_name(index), None)
        for piece in self.pieces:
            if self._shows_view(piece):
                piece.fsdp_param._setattr_on_modules(piece.fsdp_param.sharded_param)

    # ---- writes in both directions ----

    def _set_engine_grad(self, piece: _Piece, values: torch.Tensor) -> None:
        """The engine's sharded gradient becomes (a DTensor over) ``piece``'s gradient slice holding ``values``."""
        self.flat_grads_given = None
        target = self._grad_slice(piece, values.dtype)
        if values.data_ptr() != target.data_ptr() or piece.numel == 0:
            with torch.no_grad():
                target.copy_(values.reshape(target.shape))
        fsdp_param = piece.fsdp_param
        fsdp_param.sharded_param.grad = fsdp_param.to_sharded_dtensor(target.view(fsdp_param.sharded_size))

    def writeback(self) -> None:
        """What the user changed on a view (``.data`` replaced, ``.grad`` replaced or ``None``,
        ``requires_grad``) reaches the engine."""
        self.absorb_flat_writes()
        if self.flat_mode:
            # No user reaches flat mode's views (its slots show plain tensors, its parameters are the flat
            # ones): only the flat parameters' flags and gradients can have changed. The engine's side (an
            # object per parameter) is read only where they differ from what it was last given: the flags
            # change where the user freezes, the gradients at ``zero_grad()`` and in backward, not from a
            # forward to its backward nor over an evaluation loop's forwards.
            flags = [param.requires_grad for param in self.flat_params]
            if flags != self.flat_flags_given:
                self._flat_requires_grad_to_engine()
                self.flat_flags_given = flags
            if _same_grads([_FlatGrad.of(param) for param in self.flat_params], self.flat_grads_given):
                return
        self._write_grads()

    @torch.no_grad()
    def _write_grads(self) -> None:
        """The gradients written to the engine (``use_orig_params=True``: every change on the views), and
        each buffer whose gradients are all cleared freed."""
        if self.flat_mode:
            self._flat_grads_to_engine()
        else:
            self._views_to_engine()
        for index in range(len(self.grad_flats)):
            if self.grad_flats[index] is None or (
                    index < len(self.flat_params) and self.flat_params[index].grad is not None):
                continue
            if not any(self._has_grad(piece) for piece in self.members[index]):
                self.grad_flats[index] = None
        if self.flat_mode:  # (its flat gradients may have become the ``.grad``s; inside ``no_sync``, where
            # the unreduced gradients are shown, the full path each time)
            self.flat_grads_given = None if any(flat is not None for flat in self.unreduced_flats) else [
                _FlatGrad.of(param) for param in self.flat_params]

    def forget_given(self) -> None:
        """The engine's side may have changed outside :meth:`writeback` (its parameters re-laid out, or used
        directly by an entry point, an iteration reset): the next writeback reads it all again."""
        self.flat_flags_given = self.flat_grads_given = None

    def _views_to_engine(self) -> None:
        """``use_orig_params=True``: each view's ``.data``, ``requires_grad`` and ``.grad`` (``None``, its slice
        of the flat gradient, or one the user assigned) decide the engine's."""
        self._adopt_replaced_parameters()
        self._unreduced_grads_from_views()
        unreduced_pieces = self.unreduced_pieces
        for piece in self.pieces:
            view, sharded, data = piece.view, piece.fsdp_param.sharded_param, cast(torch.Tensor, piece.data)
            if piece.numel and (view.data_ptr() != piece.data_ptr or view.dtype != data.dtype):
                target = data[:piece.numel].view(piece.shape)
                if view.numel() != piece.numel:
                    raise ValueError(f"A parameter's local shard has {piece.numel} elements here; its .data was "
                                     f"replaced by one of shape {tuple(view.shape)}. Assign a tensor of the shard's "
                                     "size (or copy_ into it)")
                target.copy_(view.detach().reshape(piece.shape))
                view.data = target
            if sharded.requires_grad != view.requires_grad:
                sharded.requires_grad_(view.requires_grad)
            if unreduced_pieces and id(piece) in unreduced_pieces:
                continue  # its gradient is the engine's unreduced one (``no_sync``), aliased
            grad = view.grad
            if grad is None:
                if sharded.grad is not None:  # (reading is a tenth of the cost of setting, per piece and call)
                    sharded.grad = None
                continue
            engine_grad = sharded.grad
            if (engine_grad is None or grad.data_ptr() != _local(engine_grad).data_ptr()
                    or piece.numel == 0):
                self._set_engine_grad(piece, grad)
                view.grad = self._grad_slice(piece, grad.dtype)

    def _flat_requires_grad_to_engine(self) -> None:
        """Flat mode: the flat parameters' ``requires_grad`` (the user's freezing) decides the pieces' views'
        and the engine's parameters'."""
        for index, param in enumerate(self.flat_params):
            requires_grad = param.requires_grad
            for piece in self.members[index]:
                if piece.view.requires_grad != requires_grad:
                    piece.view.requires_grad_(requires_grad)
                sharded = piece.fsdp_param.sharded_param
                if sharded.requires_grad != requires_grad:
                    sharded.requires_grad_(requires_grad)

    def _flat_grads_to_engine(self) -> None:
        """Flat mode: each flat parameter's ``.grad`` (``None``, the flat gradient, or one the user assigned)
        decides its pieces' engine gradients: none, or each its slice of the flat gradient (zeros where it had
        none: FSDP1's flat gradient covers every parameter)."""
        for index, param in enumerate(self.flat_params):
            members = self.members[index]
            grad = param.grad
            unreduced = self.unreduced_flats[index] if index < len(self.unreduced_flats) else None
            if unreduced is not None:  # ``no_sync``: the flat unreduced gradient shown
                if grad is not None and grad.data_ptr() == unreduced.data_ptr():
                    continue
                self.unreduced_flats[index] = None
                self.unreduced_pieces.difference_update(id(piece) for piece in members)
                if grad is not None and grad.numel() == unreduced.numel():  # replaced: its values kept
                    unreduced.copy_(grad.reshape(-1))
                    _set_grad_unchecked(param, unreduced)
                    self.unreduced_flats[index] = unreduced
                    self.unreduced_pieces.update(id(piece) for piece in members)
                    continue
                for piece in members:  # ``.grad = None``: FSDP1 zeroes it; the engine's is dropped
                    _drop_unreduced_grad(piece.fsdp_param)
            if grad is None:
                for piece in members:
                    sharded = piece.fsdp_param.sharded_param
                    if sharded.grad is not None:  # (reading is a tenth of the cost of setting)
                        sharded.grad = None
                self.grad_flats[index] = None  # no piece holds a gradient now: its memory freed
                continue
            flat = self.grad_flats[index]
            if flat is None or grad.data_ptr() != flat.data_ptr() or grad.dtype != flat.dtype:
                flat = self._new_grad_flat(index, grad.dtype)
                flat.copy_(grad)
                param.grad = flat
            for piece in members:  # each piece's engine gradient its slice of it (kept where it is already)
                engine_grad = piece.fsdp_param.sharded_param.grad
                if engine_grad is None or piece.numel == 0 or not _in_flat(_local(engine_grad), flat, piece):
                    self._set_engine_grad(piece, _slice(flat, piece))

    def _replaced_parameters(self) -> list[tuple[_Piece, nn.Parameter]]:
        """The pieces whose module slot the user re-assigned (``module.weight = nn.Parameter(...)``), with
        the new parameter; FSDP1's errors, before anything changes: ``RuntimeError`` for a shape other than
        the local shard's, ``NotImplementedError`` for a shared (tied) parameter."""
        if self.engine_depth or _constructing:
            return []
        replaced = []
        for piece in self.pieces:
            fsdp_param = piece.fsdp_param
            current = _slot_value(fsdp_param)
            if not isinstance(current, nn.Parameter) or current is piece.view or isinstance(current, DTensor) \
                    or any(current is getattr(fsdp_param, name, None) for name in _ENGINE_PARAM_ATTRS):
                continue
            if piece.numel == 0:  # FSDP1 writes nothing back where this rank holds none of it
                fsdp_param._setattr_on_modules(fsdp_param.sharded_param)
                continue
            if len(_slots(fsdp_param)) > 1:
                raise NotImplementedError(f"Changing shared parameters is not supported yet (as in FSDP1): "
                                          f"{fsdp_param._param_fqn or 'a tied parameter'} is registered under "
                                          "several names. Write its values in place (p.data.copy_(...)) instead")
            if current.shape != piece.view.shape:
                raise RuntimeError(f"Cannot writeback when the parameter shape changes\nExpects {piece.view.shape} "
                                   f"but got {current.shape}: a parameter assigned as a module attribute replaces "
                                   "this rank's local shard (FSDP1's rule); assign one of the local shard's shape, "
                                   "or copy full values inside summon_full_params()")
            replaced.append((piece, current))
        return replaced

    def _adopt_replaced_parameters(self) -> None:
        """A parameter the user assigned as a module attribute becomes the piece's view, its values written to
        the engine (FSDP1's ``_writeback_orig_params`` keeps the new object)."""
        for piece, new in self._replaced_parameters():
            target = cast(torch.Tensor, piece.data)[:piece.numel].view(piece.shape)
            target.copy_(new.detach())
            new.data = target
            _sharded_of_view.pop(piece.view, None)
            piece.view = new
            _sharded_of_view[new] = piece.fsdp_param.sharded_param
            _view_of_sharded[id(piece.fsdp_param.sharded_param)] = weakref.ref(new)
            piece.fsdp_param._setattr_on_modules(piece.fsdp_param.sharded_param)  # the new view, in every slot

    def _unreduced_grads_from_views(self) -> None:
        """``no_sync``: a view showing its unreduced gradient that the user replaced (the values written to the
        engine's) or set to ``None`` (FSDP1 zeroes it: the engine's is dropped)."""
        for piece in self.pieces:
            if id(piece) not in self.unreduced_pieces:
                continue
            unreduced, grad = _unreduced_grad(piece.fsdp_param), piece.view.grad
            if unreduced is not None and grad is not None and grad.data_ptr() == unreduced.data_ptr():
                continue
            self.unreduced_pieces.discard(id(piece))
            if unreduced is not None and grad is not None and grad.shape == unreduced.shape:
                unreduced.copy_(grad)
                _set_grad_unchecked(piece.view, unreduced)
                self.unreduced_pieces.add(id(piece))
            elif grad is None:
                _drop_unreduced_grad(piece.fsdp_param)
                piece.fsdp_param.sharded_param.grad = None

    def _show_unreduced_grads(self, reduced: bool = False) -> None:
        """After a backward inside ``no_sync`` the engine holds each parameter's gradient unreduced and
        unsharded (this rank's own accumulation): FSDP1 shows that as ``p.grad``, in the parameter's full
        shape (``use_orig_params=False``: the flat parameter's ``.grad`` is the unit's unpadded full flat
        gradient), until a synced backward reduces it. Shown aliased: writes reach what the engine reduces.
        ``reduced``: known to be none, the engine's parameters not read."""
        self.unreduced_pieces.clear()
        self.unreduced_flats = [None] * len(self.flats)
        if reduced:
            return
        if not self.flat_mode:
            for piece in self.pieces:
                if (unreduced := _unreduced_grad(piece.fsdp_param)) is not None:
                    _set_grad_unchecked(piece.view, unreduced)
                    self.unreduced_pieces.add(id(piece))
            return
        for index, param in enumerate(self.flat_params):
            members = self.members[index]
            grads = [_unreduced_grad(piece.fsdp_param) for piece in members]
            present = [grad for grad in grads if grad is not None]
            if not present or len({grad.dtype for grad in present}) != 1:
                continue
            full = torch.zeros(sum(piece.fsdp_param.sharded_param.numel() for piece in members),
                               dtype=present[0].dtype, device=present[0].device)
            offset = 0
            for piece, grad in zip(members, grads):
                numel = piece.fsdp_param.sharded_param.numel()
                if grad is not None:
                    part = full[offset:offset + numel].view(grad.shape)
                    part.copy_(grad)
                    _repoint_unreduced_grad(piece.fsdp_param, part)
                offset += numel
            _set_grad_unchecked(param, full)
            self.unreduced_flats[index] = full
            self.unreduced_pieces.update(id(piece) for piece in members)

    @torch.no_grad()
    def sync_grads(self, reduced: bool = False) -> None:
        """After backward: each engine gradient a slice of the flat local gradient, and each view's ``.grad``
        that slice (flat mode: each flat parameter's ``.grad`` the flat gradient); inside ``no_sync``: the
        unreduced gradient, :meth:`_show_unreduced_grads`. ``reduced``: the engine holds no unreduced
        gradient (every group of the unit reduced in the backward that just ended)."""
        flat_mode = self.flat_mode
        self.flat_grads_given = None  # the engine's gradients are new
        adopted = [self._adopt_engine_grads(index) for index in range(len(self.flats))]
        for piece in self.pieces:
            if flat_mode and piece.numel and adopted[piece.buffer]:
                continue  # its engine gradient is its slice of the flat gradient; its view shows none
            grad = piece.fsdp_param.sharded_param.grad
            if grad is None:
                if not flat_mode:
                    piece.view.grad = None
                continue
            flat, local = self.grad_flats[piece.buffer], _local(grad)
            if flat is not None and piece.numel and _in_flat(local, flat, piece) and local.is_contiguous():
                # The engine's gradient is the piece's slice of the flat gradient (every step: the flat gradient
                # is its reduce output, adopted): the view's is then that slice too, made from it (one view op).
                if not flat_mode and not _is_slice(piece.view.grad, flat, piece):
                    piece.view.grad = local.view(piece.shape)
                continue
            target = self._grad_slice(piece, grad.dtype)
            if local.data_ptr() != target.data_ptr() or piece.numel == 0:
                self._set_engine_grad(piece, local)
            if not flat_mode and (piece.view.grad is None or piece.view.grad.data_ptr() != target.data_ptr()
                                  or piece.numel == 0):
                piece.view.grad = target
        if flat_mode:
            for index, param in enumerate(self.flat_params):
                members = self.members[index]
                flat = self.grad_flats[index]
                without = [] if adopted[index] else [
                    piece for piece in members if piece.fsdp_param.sharded_param.grad is None]
                if flat is None or len(without) == len(members):
                    param.grad = None
                    continue
                for piece in without:  # no gradient this time: zeros in the flat gradient, as FSDP1
                    flat[piece.offset:piece.offset + piece.numel].zero_()
                param.grad = flat
        self._show_unreduced_grads(reduced)

    def _adopt_engine_grads(self, index: int) -> bool:
        """Where the engine's new gradients of buffer ``index`` are views of one 1-D buffer in exactly our
        layout (its reduce-scatter output: each parameter's padded chunk, in order, padding reduced from
        zeros), that buffer becomes the flat gradient: no copy, and not two copies of the gradients alive.
        Not while the engine keeps that output to add to later (HSDP without all-reduce). Returns whether it
        did (each engine gradient is then its piece's slice of the flat gradient, contiguous)."""
        members = self.members[index]
        grads = [piece.fsdp_param.sharded_param.grad for piece in members]
        if not members or any(grad is None for grad in grads):
            return False
        locals_ = [_local(grad) for grad in grads]
        base = locals_[0]._base if locals_[0]._base is not None else locals_[0]
        current = self.grad_flats[index]
        if (current is not None and base.data_ptr() == current.data_ptr()) or base.dim() != 1 \
                or base.numel() != self.flats[index].numel():
            return False
        if all(_in_flat(local, base, piece) and local.is_contiguous() for piece, local in zip(members, locals_)) \
                and not any(getattr(group, "_partial_reduce_output", None) is not None for group in self.groups):
            self.grad_flats[index] = base
            return True
        return False

    # ---- FSDP1's flat-parameter description ----

    def shard_infos(self) -> list[ShardParamInfo]:
        """Each parameter's :class:`ShardParamInfo` in this rank's flat shard, in the engine's order."""
        infos = []
        for piece in self.pieces:
            fsdp_param = piece.fsdp_param
            if piece.numel == 0:
                infos.append(ShardParamInfo(False, None, None, None, None))
                continue
            start = _shard_rank(fsdp_param) * piece.padded_numel  # rank r holds the r-th padded chunk
            infos.append(ShardParamInfo(True, piece.offset, piece.numel, start, start + piece.numel - 1))
        return infos

    def flat_parameters(self) -> list[nn.Parameter]:
        """One plain ``nn.Parameter`` per dtype buffer, the buffer itself (FSDP1's ``FlatParameter``):
        writes reach the engine; its ``.grad`` is the flat local gradient after backward."""
        self.follow()
        self.writeback()
        self._ensure_flat_params()
        for index, param in enumerate(self.flat_params):
            with_grad = any(self._has_grad(piece) for piece in self.members[index])
            param.grad = self.grad_flats[index] if with_grad else None
        return self.flat_params

    def _ensure_flat_params(self) -> None:
        """The flat parameter objects exist, each over its current buffer (identity kept)."""
        fresh = len(self.flat_params) != len(self.flats) or self.flat_params_stale
        self.flat_params_stale = False
        if len(self.flat_params) != len(self.flats):
            self.flat_params = [nn.Parameter(flat, requires_grad=False) for flat in self.flats]
            for index, param in enumerate(self.flat_params):
                _flat_owner[param] = (weakref.ref(self), index)  # weak: the entry must not keep the unit
                # Made from the pieces' flags; from then on the user's ``requires_grad_`` on the flat
                # parameter decides (FSDP1's freezing after wrapping), written to the pieces (writeback).
                param.requires_grad_(any(piece.view.requires_grad for piece in self.pieces if piece.buffer == index))
        for index, (param, flat) in enumerate(zip(self.flat_params, self.flats)):
            if param.data_ptr() != flat.data_ptr() or param.dtype != flat.dtype or param.shape != flat.shape:
                param.data = flat
            # The pieces' ``grad_dtype`` changes only where they are (re)pointed: looked at after that only.
            if fresh and any(getattr(piece.view, "grad_dtype", "absent") is None for piece in self.members[index]):
                param.grad_dtype = None  # keep_low_precision_grads: a gradient in another dtype than the buffer

    def absorb_flat_writes(self) -> None:
        """A flat parameter whose ``.data`` was replaced (same size): its values written to the engine."""
        for param, flat in zip(self.flat_params, self.flats):
            if param.data_ptr() != flat.data_ptr() and param.shape == flat.shape:
                with torch.no_grad():
                    flat.copy_(param.detach())
                param.data = flat

    def buffer_of(self) -> list[int]:
        """Each parameter's dtype buffer (index into :meth:`flat_parameters`), in the engine's order."""
        return [piece.buffer for piece in self.pieces]

    def views(self) -> list[nn.Parameter]:
        return [piece.view for piece in self.pieces]

    def sharded_of(self) -> dict[int, DTensor]:
        """id(view) -> the engine's sharded DTensor parameter it shows."""
        return {id(piece.view): cast(DTensor, piece.fsdp_param.sharded_param) for piece in self.pieces}


def _local(tensor: Any) -> torch.Tensor:
    """A sharded DTensor's local tensor (no autograd node, unlike ``to_local()``)."""
    return tensor._local_tensor  # type: ignore[no-any-return]  # (no ``cast`` call: read several times a step per piece)


def _view_shape(fsdp_param: FSDPParam, numel: int) -> tuple[int, ...]:
    """A view's shape: FSDP1 shows a sharded unit's parameters as 1-D pieces of its flat shard, a
    ``NO_SHARD`` unit's (the engine's ``replicate``, whose mesh has no shard dimension) in their own shapes."""
    replicated = not hasattr(fsdp_param.mesh_info, "shard_mesh_size")
    return tuple(fsdp_param.sharded_size) if replicated else (numel,)


def _slice(flat: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """``piece``'s part of a flat buffer (parameters or gradients), in the view's shape."""
    return flat[piece.offset:piece.offset + piece.numel].view(piece.shape)


def _is_slice(tensor: torch.Tensor | None, flat: torch.Tensor, piece: _Piece) -> bool:
    """Whether ``tensor`` already is :func:`_slice` of ``flat`` (address, dtype, shape, contiguous), without
    making the slice. Never for an empty piece (every empty tensor looks alike: it is re-made, as before)."""
    return (tensor is not None and piece.numel > 0 and tensor.dtype == flat.dtype and tensor.device == flat.device
            and tensor.data_ptr() == flat.data_ptr() + piece.offset * flat.element_size()
            and tensor.shape == piece.shape and tensor.is_contiguous())


def _shard_rank(fsdp_param: FSDPParam) -> int:
    mesh_info: Any = fsdp_param.mesh_info
    return int(getattr(mesh_info, "shard_mesh_rank", 0))


def _flat_name(index: int) -> str:
    return "_flat_param" if index == 0 else f"_flat_param_{index}"  # FSDP1's name; one per extra dtype


def _slots(fsdp_param: FSDPParam) -> list[tuple[nn.Module, str]]:
    info = fsdp_param._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


def _drop_plain_attributes(slots: list[tuple[nn.Module, str]]) -> None:
    """Flat mode's plain tensor attributes removed from ``slots``: they would hide what the engine registers next."""
    for module, name in slots:
        if name not in module._parameters:
            module.__dict__.pop(name, None)


def _unreduced_grad(fsdp_param: FSDPParam) -> torch.Tensor | None:
    """The engine's unreduced, unsharded gradient of ``fsdp_param`` (``no_sync`` accumulation), or ``None``:
    ``unsharded_accumulated_grad`` when it accumulates in another dtype (torch < 2.15), else the unsharded
    parameter's ``.grad`` (kept when the engine reshards without reducing)."""
    accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
    if accumulated is not None:
        return cast(torch.Tensor, accumulated)
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return unsharded.grad if unsharded is not None else None


def _separate_accumulation() -> bool:
    """torch < 2.15 may keep ``no_sync`` accumulation apart from ``.grad`` (2.15: a read-only view of it)."""
    return not isinstance(getattr(FSDPParam, "unsharded_accumulated_grad", None), property)


def _drop_unreduced_grad(fsdp_param: FSDPParam) -> None:
    if hasattr(fsdp_param, "_unsharded_param"):
        fsdp_param._unsharded_param.grad = None
    if _separate_accumulation():
        fsdp_param.unsharded_accumulated_grad = None


def _repoint_unreduced_grad(fsdp_param: FSDPParam, tensor: torch.Tensor) -> None:
    """The engine's unreduced gradient becomes ``tensor`` (same shape, values and dtype): writes to it reach
    the reduction. Where the engine will not take it, it keeps its own (the shown one is then a copy)."""
    if _separate_accumulation() and getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
        fsdp_param.unsharded_accumulated_grad = tensor
        return
    with contextlib.suppress(RuntimeError):
        fsdp_param._unsharded_param.grad = tensor


def _set_grad_unchecked(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad`` aliasing ``grad`` even where shape or dtype differ (FSDP1 shows unsharded gradients on
    sharded parameters so, through ``.data``, which skips the check ``.grad =`` makes)."""
    if param.grad is None or param.grad.data_ptr() != grad.data_ptr():
        param.grad = torch.empty_like(param)
        param.grad.data = grad


def _slot_value(fsdp_param: FSDPParam) -> Any:
    info = fsdp_param._module_info
    return info.module._parameters.get(info.param_name)


def _sync_grads_after_backward(state: _engine.FSDPState) -> None:
    """Wrap ``state``'s final backward callback (the root's runs, ending the whole root's backward): then
    every unit's views show the sharded parameters and gradients. Idempotent."""
    callback = state._root_post_backward_final_callback
    if getattr(callback, _ATTR, False):
        return

    @torch.compiler.disable  # as the engine's own callback: dynamo (compiled autograd) must not trace it
    def callback_then_sync() -> None:
        callback()  # every group's post-backward has run in this backward (the callback runs the rest)
        for each in state._state_ctx.all_states or [state]:
            shards = getattr(each, _ATTR, None)
            if shards is not None:
                shards.follow()
                # A group that reduced there holds no unreduced gradient (outside ``no_sync``).
                shards.sync_grads(reduced=all(group.reduce_grads for group in shards.groups))
                shards.show()

    setattr(callback_then_sync, _ATTR, True)
    state._root_post_backward_final_callback = callback_then_sync  # type: ignore[method-assign]


def _writeback_before_backward(state: _engine.FSDPState, shards: LocalShards) -> None:
    """Wrap ``state``'s pre-backward hook (run before its gradients are reduced): the users' changes reach
    the engine first. A ``zero_grad()`` between forward and backward (Lightning's closure does that) must
    keep the engine from accumulating into the gradients it cleared."""
    pre_backward = state._pre_backward

    @torch.compiler.disable  # as the engine's own hook: dynamo (compiled autograd) must not trace it
    def writeback_then_pre_backward(*args: Any, **kwargs: Any) -> Any:
        shards.follow()
        shards.writeback()
        result = pre_backward(*args, **kwargs)
        shards.flat_grads_given = None  # the backward now writes the engine's gradients
        shards.show_unsharded()  # those the engine kept unsharded since the forward showed their views
        return result

    state._pre_backward = writeback_then_pre_backward  # type: ignore[method-assign]


def _views_between_iterations(state: _engine.FSDPState, module: nn.Module) -> None:
    """Hooks on the engine unit ``module`` (idempotent) keeping FSDP1's parameters around each forward.

    After a root forward every unit shows its views again, also where the engine keeps a unit unsharded
    for the backward (the root, ``SHARD_GRAD_OP``, ``NO_SHARD``), with or without autograd: a forward
    without autograd may be a reentrant activation checkpoint's first pass, whose backward recomputes it
    from those unsharded parameters (FSDP1 and the engine keep them too; resharding them would cost an
    all-gather FSDP1 does not make). Before a root forward, a unit the engine still holds unsharded from a
    forward whose backward never ran is resharded, so that the forward all-gathers what the user wrote to
    the views meanwhile (an EMA swapped in, a schedule-free ``eval()``): FSDP1 computes with its stale
    unsharded buffer there (pytorch#144289). A forward inside backward (recompute) puts the unsharded
    parameters back into the slots first (:meth:`LocalShards.show_unsharded`)."""
    if getattr(state, _ATTR + "_hooks", False):
        return
    setattr(state, _ATTR + "_hooks", True)

    def all_states() -> list[_engine.FSDPState]:
        return list(state._state_ctx.all_states or [state])

    def between_iterations() -> bool:
        """A root forward outside backward (not activation-checkpoint recompute), and outside our entry
        points (a forward inside ``summon_full_params`` runs on the full parameters registered there)."""
        return state._state_ctx.iter_forward_root is None and not _engine.in_backward() and not any(
            shards.engine_depth for each in all_states() if (shards := getattr(each, _ATTR, None)) is not None)

    @torch.compiler.disable
    def before_forward(module: nn.Module, args: Any) -> None:
        if _engine.in_backward():
            # Activation-checkpoint recompute, possibly before this unit's pre-backward (a checkpointed
            # region holding several units, or roots, recomputes them all at once): the engine finds a
            # unit it kept unsharded as it is (no all-gather), so its unsharded parameters go back into
            # the slots the views took after the forward, as FSDP1's are there.
            if (shards := getattr(state, _ATTR, None)) is not None:
                shards.show_unsharded()
        elif between_iterations() and not _engine.iteration_in_progress(module):
            _reshard_unsharded(all_states())

    @torch.compiler.disable
    def show_views(module: nn.Module, args: Any, output: Any) -> None:
        if not between_iterations():
            return
        for each in all_states():
            if (shards := getattr(each, _ATTR, None)) is not None:
                shards.show()

    module.register_forward_pre_hook(before_forward, prepend=True)
    module.register_forward_hook(show_views)


def _reshard_unsharded(states: list[_engine.FSDPState]) -> None:
    """The engine's idle unsharded groups of ``states`` resharded: its unsharded parameters freed."""
    for each in states:
        for group in each._fsdp_param_groups:
            if group.is_unsharded:
                group.reshard()


def local_shards(module: nn.Module) -> LocalShards | None:
    """The :class:`LocalShards` of the engine unit ``module``, or ``None`` (DTensor parameters)."""
    return getattr(_engine.engine_state(module), _ATTR, None)


def install(module: nn.Module, flat_mode: bool = False) -> LocalShards | None:
    """Give the engine unit ``module`` plain local-shard views (none without managed parameters); with
    ``flat_mode`` (FSDP1's ``use_orig_params=False``) its parameters are its flat local shards."""
    if (state := _engine.engine_state(module)) is not None:
        # Also a unit without parameters of its own: it may be the root, whose final callback the engine runs.
        _sync_grads_after_backward(state)
        _views_between_iterations(state, module)
    if not _engine.managed_params(module):
        return None
    return local_shards(module) or LocalShards(module, flat_mode)


@contextlib.contextmanager
def constructing(module: nn.Module) -> Iterator[None]:
    """Building a wrapper around ``module``: once the outermost is built, every unit in it shows its views."""
    global _constructing
    _constructing += 1
    try:
        yield
    finally:
        _constructing -= 1
    if not _constructing:
        for sub in module.modules():
            if (shards := local_shards(sub)) is not None and shards.engine_depth == 0:
                shards.show()


def writeback(modules: Iterable[nn.Module]) -> None:
    """Write the users' changes on the views of the units ``modules`` to the engine."""
    for module in modules:
        if (shards := local_shards(module)) is not None:
            shards.follow()
            shards.writeback()


def forget_given(modules: Iterable[nn.Module]) -> None:
    """:meth:`LocalShards.forget_given` for the units ``modules`` (an interrupted iteration was reset)."""
    for module in modules:
        if (shards := local_shards(module)) is not None:
            shards.forget_given()


def engine_grads(modules: Iterable[tuple[nn.Module, bool]]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], set[int]]:
    """The gradients of the units ``modules`` (each with whether it is flat) that show plain views (users'
    changes written back first), each as ``(local tensor to read and scale, the engine's DTensor gradient
    giving its mesh and placements)``, and the ids of the parameters those units show (views, flat
    parameters). In a flat unit, where every parameter of a buffer has its gradient in the flat gradient,
    that one tensor stands for them all (its padding holds zeros): one norm and one scaling per unit and
    dtype, as FSDP1's flat gradient; otherwise one per parameter, as FSDP1's ``use_orig_params=True``."""
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    shown: set[int] = set()
    for module, flat_unit in modules:
        if (shards := local_shards(module)) is None:
            continue
        shards.follow()
        shards.writeback()
        shown.update(id(param) for param in (*shards.views(), *shards.flat_params))
        for index, flat in enumerate(shards.grad_flats):
            members = [(piece, piece.fsdp_param.sharded_param.grad) for piece in shards.pieces if piece.buffer == index]
            if flat_unit and flat is not None and all(grad is not None and _in_flat(_local(grad), flat, piece)
                                                      for piece, grad in members):
                grads.append((flat, cast(torch.Tensor, members[0][1])))
            else:
                grads += [(_local(grad), grad) for _, grad in members if grad is not None]
    return grads, shown


def _in_flat(grad: torch.Tensor, flat: torch.Tensor, piece: _Piece) -> bool:
    """Whether ``grad`` is ``piece``'s slice of the flat (gradient) buffer ``flat``, in its dtype (an empty
    piece always is)."""
    return piece.numel == 0 or (grad.dtype == flat.dtype and
                                grad.data_ptr() == flat.data_ptr() + piece.offset * flat.element_size())


@contextlib.contextmanager
def engine_params(modules: Iterable[nn.Module], keep_parameter_views: bool = False) -> Iterator[None]:
    """The engine's DTensor parameters registered in the units ``modules`` for the duration (the
    users' changes written back first), for entry points that read module slots; the views after.

    ``keep_parameter_views``: for a caller that only reads the module tree's keys and finds each engine
    parameter by its slot (``state_dict``), units whose views are registered as the parameters under their
    own names (``use_orig_params=True``) keep them: the keys are the same, and switching every view
    there and back cost a third of a small model's state dict. Their users' changes are written back."""
    all_shards = [shards for module in modules if (shards := local_shards(module)) is not None]
    switched = [shards for shards in all_shards if shards.flat_mode or not keep_parameter_views]
    for shards in all_shards:
        shards.follow()
        shards.writeback()
    for shards in switched:
        shards.engine_depth += 1
        shards.hide()
    try:
        yield
    finally:
        for shards in all_shards:  # the entry point had the engine's parameters themselves
            shards.forget_given()
        for shards in switched:
            shards.engine_depth -= 1
            shards.follow()
            if shards.engine_depth == 0:
                shards.sync_grads()
                shards.show()


_engine.set_dcp_model_layout(lambda model: engine_params(model.modules()))  # torch's set_model_state_dict


class EngineParamsOnApply(nn.Module):
    """A module whose ``_apply`` (``.to()``, ``.double()``, ``to_empty()``...) runs on the engine's DTensor
    parameters of every unit inside it (the engine re-pads them; the views then follow)."""

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with engine_params(self.modules()):
            result = super()._apply(fn, *args, **kwargs)
            for module in self.modules():
                _engine.rederive_dtypes(module)
            return result


# ---- optimizer state: plain 1-D local tensors outside, the engine's DTensor layout inside ----


class EngineParamWalk:
    """``named_parameters()`` of the units in ``modules``, as it reads with the engine's DTensors registered
    (:func:`engine_params`: the names and the order of FSDP1's original parameters), without registering
    anything: a view as the DTensor it shows; a flat parameter's pieces appended to their modules' own
    parameters, as :meth:`LocalShards.hide` appends them. The optimizer state-dict family reads names this
    way and keeps the model as the user sees it (it reads no parameter values)."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.named_modules = list(root.named_modules())  # walked once: the family reads it several times
        self.shards = [shards for _, module in self.named_modules if (shards := local_shards(module)) is not None]
        self._sharded: dict[int, DTensor] = {}  # id(view) -> its DTensor
        self._flat: set[int] = set()  # ids of flat parameters: unregistered in the engine's layout
        self._appended: dict[int, list[tuple[str, DTensor]]] = {}  # id(module) -> flat mode's pieces there
        for shards in self.shards:
            shards.follow()  # the engine's current DTensors, as engine_params reads them
            shards.writeback()  # a replaced view adopted first
            for piece in shards.pieces:
                sharded = cast(DTensor, piece.fsdp_param.sharded_param)
                if not shards.flat_mode:
                    self._sharded[id(piece.view)] = sharded
                elif shards._shows_view(piece):
                    for slot_module, name in _slots(piece.fsdp_param):
                        self._appended.setdefault(id(slot_module), []).append((name, sharded))
            self._flat.update(id(param) for param in shards.flat_params)

    def sharded_of(self, param: Any) -> DTensor | None:
        """The engine's DTensor the view ``param`` shows (``use_orig_params=True``), else ``None``."""
        return self._sharded.get(id(param))

    def own(self, module: nn.Module) -> list[tuple[str, Any]]:
        """``module.named_parameters(recurse=False)`` in the engine's layout."""
        own = [(name, self._sharded.get(id(param), param)) for name, param in module._parameters.items()
               if param is not None and id(param) not in self._flat]
        return own + self._appended.get(id(module), [])

    def named_parameters(self, root: nn.Module) -> list[tuple[str, Any]]:
        """``root.named_parameters()`` in the engine's layout (a tied parameter under its first name)."""
        seen: set[int] = set()
        named = []
        for prefix, module in (self.named_modules if root is self.root else root.named_modules()):
            for name, param in self.own(module):
                if id(param) not in seen:
                    seen.add(id(param))
                    named.append((f"{prefix}.{name}" if prefix else name, param))
        return named


def flat_pieces(param: Any) -> list[tuple[nn.Parameter, DTensor, int, int]] | None:
    """For a flat parameter (``use_orig_params=False``): ``(view, sharded DTensor, offset, numel)`` of each
    parameter it holds, in its layout; ``None`` for any other tensor."""
    found = _flat_owner.get(param) if isinstance(param, torch.Tensor) else None
    if found is None:
        return None
    reference, index = found
    shards = reference()
    if shards is None:
        return None
    return [(piece.view, cast(DTensor, piece.fsdp_param.sharded_param), piece.offset, piece.numel)
            for piece in shards.pieces if piece.buffer == index]


def view_of_sharded(param: Any) -> nn.Parameter | None:
    """The plain view (``use_orig_params=True``) showing the engine's sharded parameter ``param``, or ``None``."""
    reference = _view_of_sharded.get(id(param))
    view = reference() if reference is not None else None
    return view if view is not None and _sharded_of_view.get(view) is param else None


def hidden_in_flat_parameter(param: Any) -> bool:
    """Whether ``param`` is the engine's DTensor of a unit with flat parameters (``use_orig_params=False``)."""
    reference = _hidden_in_flat.get(id(param)) if isinstance(param, DTensor) else None
    shards = reference() if reference is not None else None
    return shards is not None and any(piece.fsdp_param.sharded_param is param for piece in shards.pieces)


def sharded_of_view(param: nn.Parameter) -> DTensor | None:
    """The engine's sharded DTensor a plain local-shard view shows, or ``None`` for other parameters."""
    return cast(DTensor | None, _sharded_of_view.get(param))


def as_engine_value(value: Any, view: nn.Parameter, sharded: DTensor) -> Any:
    """A view's per-element optimizer state (the view's shape, or 1-D) as a DTensor in ``sharded``'s layout
    (no copy); anything else (``step``, non-tensors) as it is."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0 \
            or value.shape not in (view.shape, (view.numel(),)):  # a flat parameter's slice is 1-D
        return value
    return _engine.dtensor_like(value.reshape(_local(sharded).shape), sharded)


def as_plain_value(value: Any) -> Any:
    """A per-element DTensor optimizer state as the plain local tensor a view's state is (no copy): 1-D
    for a sharded parameter, its own shape for a replicated one."""
    if isinstance(value, DTensor) and value.dim() > 0:
        sharded = any(placement.is_shard() for placement in value.placements)
        return _local(value).reshape(-1) if sharded else _local(value)
    return value
