"""fsdp_compat: torch's legacy FSDP1 API (``FullyShardedDataParallel``) on the FSDP2 engine.

Change one import and keep the rest of an FSDP1 program::

    from fsdp_compat import FullyShardedDataParallel as FSDP

or, for frameworks that build torch's FSDP1 class themselves (Lightning, accelerate, transformers),
switch torch's names to this class before they run::

    import fsdp_compat; fsdp_compat.patch_torch()     # or: python -m fsdp_compat.run script.py
"""

from . import wrap
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .patch import is_torch_patched, patch_torch, torch_patched, unpatch_torch

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "__version__",
    "is_torch_patched",
    "patch_torch",
    "torch_patched",
    "unpatch_torch",
    "wrap",
]
