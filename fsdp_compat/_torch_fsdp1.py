"""Recognising torch's own FSDP1 class — never calling it.

:func:`fsdp_compat.patch_torch` rebinds torch's public names to our class, so "torch's class" is
remembered here, once, when fsdp_compat is imported (before any patch can run).
"""

from __future__ import annotations

import torch.distributed.fsdp as _torch_fsdp
import torch.nn as nn

# The class as torch exports it (None once torch no longer ships FSDP1), read through torch's
# public name: recognising it needs the class object only, never FSDP1's modules.
TORCH_FSDP1_CLASS: type | None
try:
    TORCH_FSDP1_CLASS = _torch_fsdp.FullyShardedDataParallel
except (AttributeError, ImportError):  # a torch without FSDP1: nothing of torch's to recognise
    TORCH_FSDP1_CLASS = None


def refuse_mixing(module: nn.Module, cls: type | None, contains: str, wrapper: str, advice: str) -> None:
    """Refuse ``module`` if it (or a submodule) is a ``cls``: one model, one FSDP implementation."""
    inside = [name or "<the module itself>" for name, m in module.named_modules() if cls and isinstance(m, cls)][:3]
    if inside:
        raise ValueError(f"Cannot wrap a module that {contains} (at {inside}) with {wrapper}: the two "
                         f"implementations cannot be mixed in one model. {advice}")


def check_no_torch_fsdp1_inside(module: nn.Module) -> None:
    """Refuse torch's FSDP1 units inside ours: their units cannot gather, reduce or checkpoint together."""
    refuse_mixing(module, TORCH_FSDP1_CLASS, "already contains torch's FSDP1 FullyShardedDataParallel",
                  "fsdp_compat.FullyShardedDataParallel", "Build the model with one class only — call "
                  "fsdp_compat.patch_torch() before any wrapping so every framework builds fsdp_compat's class")
