"""The one-line switch: make torch's FSDP1 names resolve to ``fsdp_compat.FullyShardedDataParallel``.

Lightning, accelerate and the transformers ``Trainer`` look torch's class up and build it themselves.
:func:`patch_torch` rebinds every reference to torch's class in an imported module's namespace or a
class defined there (torch's own aliases, a user's earlier ``import ... as FSDP``); references outside
torch, and those it cannot rebind (inside containers), are named in a warning. ``fsdp.wrap`` needs no
patch: it builds the ``wrapper_cls`` it is given. While on, building torch's class around our units
raises ``ValueError``; no FSDP1 code runs. A subclass of torch's class defined before the switch
(mmengine's ``MMFullyShardedDataParallel``) builds, while on, an instance of its twin on our class: a
subclass of it whose resolution order has our class where torch's was. Lightning's
``_has_dtensor_modules`` is patched too.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Generator
from typing import Any

import torch.distributed.fsdp
import torch.nn as nn

from . import _lightning_dtensor_check
from ._torch_fsdp1 import TORCH_FSDP1_CLASS, refuse_mixing
from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["is_torch_patched", "patch_torch", "torch_patched", "unpatch_torch"]

# Modules whose references are never rebound: ours (they must keep naming torch's class).
_OWN_PACKAGE = __name__.rpartition(".")[0]

# (owner, attribute) pairs rebound to our class; None while the switch is off.
_rebound: list[tuple[Any, str]] | None = None


def is_torch_patched() -> bool:
    """True between :func:`patch_torch` and :func:`unpatch_torch`."""
    return _rebound is not None


def patch_torch() -> None:
    """Make torch's FSDP1 class names resolve to ``fsdp_compat.FullyShardedDataParallel``.

    Call it first thing, before the framework builds a model; a second call rebinds only references
    imported since. Undo with :func:`unpatch_torch`.
    """
    global _rebound
    _lightning_dtensor_check.patch()
    if TORCH_FSDP1_CLASS is None:  # torch dropped FSDP1: frameworks still look the name up here
        if _rebound is None:
            _rebound = [(torch.distributed.fsdp, "FullyShardedDataParallel")]
            torch.distributed.fsdp.FullyShardedDataParallel = FullyShardedDataParallel  # type: ignore[misc, assignment]
        return
    if _rebound is None:
        _rebound = []
        # Installed once and left in place, inactive while the switch is off: CPython cannot
        # delete a class's __new__ cleanly (object.__new__ then rejects the constructor's arguments).
        TORCH_FSDP1_CLASS.__new__ = staticmethod(_refuse_our_units_inside)  # type: ignore[method-assign, assignment]
    _rebind_references(_rebound)


def unpatch_torch() -> None:
    """Give torch's names back their own class (those still pointing at ours). Idempotent."""
    global _rebound
    if _rebound is None:
        return
    _lightning_dtensor_check.unpatch()
    for owner, name in _rebound:
        if vars(owner).get(name) is not FullyShardedDataParallel:
            continue  # rebound again by someone else since: theirs now
        if TORCH_FSDP1_CLASS is None:
            delattr(owner, name)
        else:
            setattr(owner, name, TORCH_FSDP1_CLASS)
    _rebound = None


@contextlib.contextmanager
def torch_patched() -> Generator[None, None, None]:
    """``with torch_patched():`` — :func:`patch_torch` inside the block; undone after it unless the
    switch was already on."""
    was_on = is_torch_patched()
    patch_torch()
    try:
        yield
    finally:
        if not was_on:
            unpatch_torch()


def _refuse_our_units_inside(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``__new__`` of torch's FSDP1 class (and its subclasses) while patched: a subclass defined before
    the switch builds fsdp_compat's unit; torch's own class refuses our units before its ``__init__`` runs."""
    if is_torch_patched() and cls is not TORCH_FSDP1_CLASS:
        # ``type.__call__`` runs the returned object's ``__init__`` (the subclass's, then ours through super()).
        return object.__new__(_on_our_class(cls))
    module = args[0] if args else kwargs.get("module")
    if is_torch_patched() and isinstance(module, nn.Module):
        refuse_mixing(module, FullyShardedDataParallel, "contains fsdp_compat.FullyShardedDataParallel units",
                      "torch's FSDP1 FullyShardedDataParallel", "fsdp_compat.patch_torch() is on, so wrap it "
                      "with torch.distributed.fsdp.FullyShardedDataParallel (now fsdp_compat's class) instead")
    return object.__new__(cls)


def _rebind_references(record: list[tuple[Any, str]]) -> None:
    """Rebind torch's class in imported modules and their classes, adding each to ``record``; warn
    about references bound before the switch and about containers holding the class (never rebound)."""
    rebound: list[tuple[Any, str]] = []
    unreachable: list[str] = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or module_name.partition(".")[0] == _OWN_PACKAGE:
            continue
        classes = [value for value in namespace.values()
                   if issubclass(type(value), type) and vars(value).get("__module__") == module_name]
        for owner in [module, *classes]:
            for name, value in list(vars(owner).items()):
                if value is TORCH_FSDP1_CLASS:
                    setattr(owner, name, FullyShardedDataParallel)
                    rebound.append((owner, name))
                elif owner is module and _holds_torch_class(value):
                    unreachable.append(f"{module_name}.{name}")
    record.extend(rebound)  # before warning: undone by unpatch_torch even if a warning raises
    # torch's own module-level aliases are expected and handled; anything else bound torch's class
    # before the switch, so objects it already built with it remain torch's.
    late = [f"{_owner_name(owner)}.{name}" for owner, name in rebound
            if not _owner_name(owner).startswith("torch.")]
    if late:
        warnings.warn(
            f"fsdp_compat.patch_torch() was called after {late} bound torch's FSDP1 class; they now "
            "point to fsdp_compat's class, but anything built with torch's class before this call "
            "is still torch's. Call patch_torch() before importing and building the model",
            UserWarning, stacklevel=3)
    subclasses = _late_subclasses()
    if subclasses:
        warnings.warn(
            f"fsdp_compat.patch_torch() was called after {subclasses} subclassed torch's FSDP1 class; from now on "
            "they build fsdp_compat's class (still instances of the subclass), but anything built with them before "
            f"this call is still torch's, and static methods called on the subclass itself ({subclasses[0]}."
            "optim_state_dict(...)) are still torch's: call those on FullyShardedDataParallel or an instance. Call "
            "patch_torch() before importing and building the model", UserWarning, stacklevel=3)
    if unreachable:
        warnings.warn(
            f"fsdp_compat.patch_torch() cannot rebind torch's FSDP1 class held inside {unreachable}: "
            "code using those still sees torch's class. Call patch_torch() before importing them",
            UserWarning, stacklevel=3)


def _late_subclasses() -> list[str]:
    """Subclasses of torch's class defined outside torch not named before (each is named once)."""
    found: list[str] = []
    pending: list[type] = list(type.__subclasses__(TORCH_FSDP1_CLASS)) if TORCH_FSDP1_CLASS is not None else []
    while pending:
        subclass = pending.pop(0)
        pending.extend(type.__subclasses__(subclass))
        if isinstance(subclass, _OnOurClass) or subclass in _named or subclass.__module__.partition(".")[0] == "torch":
            continue
        _named.add(subclass)
        found.append(f"{subclass.__module__}.{subclass.__qualname__}")
    return found


def _holds_torch_class(value: Any) -> bool:
    # Exact built-in containers only, read without calling their methods: anything else (lazy
    # mappings, module proxies) may import or warn when touched, and is not ours to inspect.
    return type(value) in (dict, tuple, list, set, frozenset) and any(
        item is TORCH_FSDP1_CLASS for item in (dict.values(value) if type(value) is dict else value))


def _owner_name(owner: Any) -> str:
    return f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__


# Subclasses of torch's class defined before the switch (mmengine's ``MMFullyShardedDataParallel``), each
# with its twin on our class: built while switched, such a subclass builds its twin.
_twins: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()
_SUBCLASS = "_fsdp_compat_rebased_from"
_named: weakref.WeakSet[type] = weakref.WeakSet()  # late subclasses already named in a warning


class _OnOurClass(type):
    """Metaclass of a twin: its method resolution order is the subclass's own classes, then ours,
    without torch's class (and what only torch's class brings): none of FSDP1's code is reachable."""

    def mro(cls) -> list[type]:
        subclass = vars(cls).get(_SUBCLASS)  # a plain lookup would need the order being computed
        if subclass is None or TORCH_FSDP1_CLASS is None:
            return super().mro()
        torch_classes = set(TORCH_FSDP1_CLASS.__mro__)
        own = [c for c in subclass.__mro__ if c not in torch_classes]
        return [cls, *own, *(c for c in FullyShardedDataParallel.__mro__ if c not in own)]


def _on_our_class(subclass: type) -> type:
    """``subclass`` of torch's class rebased on ours: a subclass of ``subclass`` (``isinstance`` and its
    zero-argument ``super()`` calls hold) whose resolution order puts our class where torch's was."""
    twin = _twins.get(subclass)
    if twin is None:
        meta = type(subclass)
        metaclass = _OnOurClass if meta is type else type(f"_OnOurClass[{meta.__name__}]", (_OnOurClass, meta), {})
        namespace = {_SUBCLASS: subclass, "__module__": subclass.__module__, "__qualname__": subclass.__qualname__,
                     "__doc__": subclass.__doc__}
        twin = _twins[subclass] = metaclass(subclass.__name__, (subclass,), namespace)
    return twin
