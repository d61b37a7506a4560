"""``FSDP_COMPAT_WITHOUT_FSDP1=1``: the tests as on a torch that no longer ships FSDP1.

Not a flag the tests consult, an enforced absence, installed in every test process (the pytest
process and each spawned rank) by ``tests/differential.py``:

* FSDP1's class (``torch.distributed.fsdp.FullyShardedDataParallel``), its ``wrap`` module and
  its private modules (flat parameter, runtime, state-dict and optimizer-state utilities...)
  cannot be imported: they are dropped from ``sys.modules`` and an import hook refuses them.
* Whatever already holds a reference cannot use them: constructing FSDP1 or calling any of its
  static methods raises, and so do the functions and policy classes of its ``wrap`` module.

What stays, because torch's FSDP2-era code shares or imports it: the public enums and config
classes (``torch.distributed.fsdp.api``: ``ShardingStrategy``, ``StateDictType``,
``MixedPrecision``...), ``torch.distributed.fsdp._common_utils`` (imported by the FSDP2 engine
itself) and ``torch.distributed.checkpoint.state_dict``, which torch imports ahead of the block:
it binds FSDP1's class at import, and only calls ``FSDP.fsdp_modules(model)``, which here answers
"no FSDP1 modules" without running FSDP1 code (there can be none: FSDP1 cannot be built).
Measured on torch 2.13 and 2.15: ``fully_shard``, ``replicate`` and ``torch.distributed.checkpoint``
(save/load, ``get_state_dict``/``set_state_dict``) work so. torch's
``apply_activation_checkpointing`` does not (it runs FSDP1's ``wrap`` module): tests of it skip.
"""

from __future__ import annotations

import importlib.abc
import inspect
import sys
from typing import Any, NoReturn

ENV = "FSDP_COMPAT_WITHOUT_FSDP1"
FSDP1_PACKAGE = "torch.distributed.fsdp"
# FSDP1's modules; what is not listed (``api``, ``_common_utils``, ``_fully_shard``) FSDP2 uses.
BLOCKED_MODULES = frozenset(f"{FSDP1_PACKAGE}.{name}" for name in (
    "fully_sharded_data_parallel", "wrap", "sharded_grad_scaler", "_flat_param", "_runtime_utils",
    "_init_utils", "_state_dict_utils", "_optim_utils", "_wrap_utils", "_unshard_param_utils",
    "_exec_order_utils", "_limiter_utils", "_debug_utils", "_dynamo_utils", "_trace_utils",
    "_traversal_utils", "_shard_utils", "_fsdp_extensions",
))
# Package attributes that are FSDP1 itself (the enums and configs stay).
BLOCKED_NAMES = frozenset({"FullyShardedDataParallel", "FlatParameter"})
# torch modules that import FSDP1 at import time and must work without it: imported first.
IMPORTED_AHEAD = ("torch.distributed.fsdp", "torch.distributed.checkpoint",
                  "torch.distributed.checkpoint.state_dict")


class FSDP1Absent(ImportError):
    """Raised on any import or use of FSDP1 in this mode."""


def _absent(what: str) -> NoReturn:
    raise FSDP1Absent(f"{what} is torch FSDP1, absent under {ENV}=1 (the tests run as on a torch "
                      "without FSDP1; fsdp_compat must not need it)")


class _RefuseFSDP1(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        """Refuse FSDP1's modules; anything else: no answer (``None``), the other finders decide."""
        if fullname in BLOCKED_MODULES or any(fullname.startswith(m + ".") for m in BLOCKED_MODULES):
            _absent(f"import {fullname}")


def _poisoned(what: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _absent(what)
    return refuse


def _no_fsdp1_modules(module: Any, root_only: bool = False) -> list:
    """``FSDP.fsdp_modules`` where no FSDP1 module can exist (what DCP's state_dict asks)."""
    return []


def _poison_class(cls: type, keep: dict[str, Any]) -> None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    for attribute, value in list(vars(cls).items()):
        if attribute in keep:
            setattr(cls, attribute, keep[attribute])
        elif attribute == "__init__" or (not attribute.startswith("__") and callable(
                value.__func__ if isinstance(value, (staticmethod, classmethod)) else value)):
            setattr(cls, attribute, _poisoned(f"{name}.{attribute}"))
        elif isinstance(value, property):
            setattr(cls, attribute, property(_poisoned(f"{name}.{attribute}")))
    cls.__new__ = staticmethod(_poisoned(f"{name}()"))  # type: ignore[method-assign]


def _poison_wrap_module(module: Any) -> None:
    for attribute, value in list(vars(module).items()):
        if getattr(value, "__module__", None) != module.__name__:
            continue  # imported names (typing, nn...) are not FSDP1's
        if inspect.isclass(value):
            _poison_class(value, keep={})
        elif callable(value):
            setattr(module, attribute, _poisoned(f"{module.__name__}.{attribute}"))


def install() -> None:
    """Make FSDP1 absent in this process (idempotent)."""
    if any(isinstance(finder, _RefuseFSDP1) for finder in sys.meta_path):
        return
    for name in IMPORTED_AHEAD:
        importlib.import_module(name)
    package = sys.modules[FSDP1_PACKAGE]
    fsdp1 = package.FullyShardedDataParallel
    _poison_class(fsdp1, keep={"fsdp_modules": staticmethod(_no_fsdp1_modules)})
    _poison_wrap_module(importlib.import_module(f"{FSDP1_PACKAGE}.wrap"))
    for name in [n for n in sys.modules if n in BLOCKED_MODULES]:
        del sys.modules[name]
        short = name.rsplit(".", 1)[1]
        if hasattr(package, short):
            delattr(package, short)
    for name in BLOCKED_NAMES:
        if hasattr(package, name):
            delattr(package, name)
    package.__getattr__ = _package_getattr  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _RefuseFSDP1())


def _package_getattr(name: str) -> Any:
    if name in BLOCKED_NAMES or f"{FSDP1_PACKAGE}.{name}" in BLOCKED_MODULES:
        _absent(f"{FSDP1_PACKAGE}.{name}")
    raise AttributeError(f"module {FSDP1_PACKAGE!r} has no attribute {name!r}")
