"""Part of the switch: Lightning's "is this FSDP2?" check answers no for modules holding our units.

Lightning's ``_has_dtensor_modules`` recognises FSDP2 by ``DTensor`` parameters before it checks for
FSDP1's class; our units have those but FSDP1's names, so its FSDP2 branch of ``_load_raw_module_state``
(``fabric.load`` of a FULL checkpoint) fails on them. Patched at once if Lightning is imported, else
by an import hook; nothing here imports Lightning.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch.nn as nn

from ._unit_state import state_of

# The module defining the check, under both of Lightning's package names.
MODULE_NAMES = ("lightning.fabric.strategies.model_parallel", "lightning_fabric.strategies.model_parallel")
CHECK_NAME = "_has_dtensor_modules"


def patch() -> None:
    """Patch the check where Lightning is imported; hook the import where it is not yet. Idempotent."""
    for name in MODULE_NAMES:
        if name in sys.modules:
            _patch_module(sys.modules[name])
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def unpatch() -> None:
    """Give Lightning its own check back and remove the import hook. Idempotent."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _PatchOnImport)]
    for name in MODULE_NAMES:
        original = getattr(getattr(sys.modules.get(name), CHECK_NAME, None), "_fsdp_compat_original", None)
        if original is not None:
            setattr(sys.modules[name], CHECK_NAME, original)


def _patch_module(module: ModuleType) -> None:
    original = getattr(module, CHECK_NAME, None)
    if original is None or hasattr(original, "_fsdp_compat_original"):
        return  # a Lightning version without the check, or patched already

    def has_dtensor_modules(candidate: object) -> bool:
        if isinstance(candidate, nn.Module) and any(state_of(m) is not None for m in candidate.modules()):
            return False  # FSDP1's API and names: Lightning's FSDP1 branch is the right one
        return original(candidate)

    has_dtensor_modules._fsdp_compat_original = original  # type: ignore[attr-defined]
    setattr(module, CHECK_NAME, has_dtensor_modules)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: lets the other finders find the check's module, and patches the check
    right after the module runs."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULE_NAMES:
            return None
        others = (finder for finder in sys.meta_path if finder is not self and hasattr(finder, "find_spec"))
        spec = next((spec for finder in others if (spec := finder.find_spec(fullname, path, target))), None)
        loader: Any = spec and spec.loader
        if not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _patch_module(module)

        loader.exec_module = exec_module
        return spec
