"""The benchmarked models and the engines that shard them.

Every engine gets the same meta-device GPT and wraps it per transformer block plus a root unit.
``fsdp_compat`` and torch FSDP1 are driven through the same FSDP1 calls (constructor, state-dict
types, ``optim_state_dict``); raw FSDP2 through its own API (``fully_shard`` / ``replicate`` and
``torch.distributed.checkpoint.state_dict``), written the way its documentation recommends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compat.examples import Block, GPTConfig, TinyGPT

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class ModelSpec:
    """A benchmarked model: its sizes and each rank's batch (sequences of ``block_size`` tokens)."""

    config: GPTConfig
    batch_per_rank: int


# An odd vocabulary keeps the uneven-shard case of the test model. ~5M and ~50M parameters.
MODELS = {
    "small": ModelSpec(GPTConfig(vocab_size=2053, block_size=64, n_layer=6, n_head=8, n_embd=256), 4),
    "large": ModelSpec(GPTConfig(vocab_size=2053, block_size=64, n_layer=10, n_head=10, n_embd=640), 1),
    # ~26M: the checkpoint suite's large model (a full --checkpoints run stays at a few minutes).
    "medium": ModelSpec(GPTConfig(vocab_size=2053, block_size=64, n_layer=8, n_head=8, n_embd=512), 1),
}
# ``--quick``: same structure, tiny sizes (for the smoke test).
QUICK_MODELS = {
    "small": ModelSpec(GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=2, n_embd=32), 2),
    "large": ModelSpec(GPTConfig(vocab_size=37, block_size=16, n_layer=3, n_head=4, n_embd=64), 2),
    "medium": ModelSpec(GPTConfig(vocab_size=37, block_size=16, n_layer=3, n_head=4, n_embd=64), 2),
}



@dataclass(frozen=True)
class TrainConfig:
    """One of issue 35's training configurations: how the model is wrapped and stepped, and its model at
    three scales (``gpu``: the issue's sizes; ``cpu``: what a 2-core CPU machine runs in minutes;
    ``quick``: the smoke test's)."""

    gpu: ModelSpec
    cpu: ModelSpec
    bf16: bool = False  # MixedPrecision(param_dtype, reduce_dtype, buffer_dtype = bfloat16)
    use_orig_params: bool = False
    activation_checkpointing: bool = False  # torch's apply_activation_checkpointing on every block
    cpu_offload: bool = False  # CPUOffload(offload_params=True); raw FSDP2: CPUOffloadPolicy()
    fused_adamw: bool = False  # AdamW(fused=True) (where the parameters are not offloaded)


_VOCAB = 50304  # GPT-2's vocabulary, padded
_GPT_1P3B = ModelSpec(GPTConfig(vocab_size=_VOCAB, block_size=1024, n_layer=24, n_head=16, n_embd=2048), 4)
_CPU_SMALL = MODELS["small"]
# bfloat16 matrix products are emulated on CPUs without bf16 instructions (10x fp32's time here): a
# narrower model keeps the CPU fallback's bf16 steps near the fp32 ones.
_CPU_BF16 = ModelSpec(GPTConfig(vocab_size=2053, block_size=64, n_layer=6, n_head=4, n_embd=128), 2)
# The five configurations (``--configs``). Every one trains with AdamW and clip_grad_norm_ each step.
CONFIGS = {
    "bf16": TrainConfig(_GPT_1P3B, _CPU_BF16, bf16=True, fused_adamw=True),
    "bf16_orig": TrainConfig(_GPT_1P3B, _CPU_BF16, bf16=True, fused_adamw=True, use_orig_params=True),
    "bf16_ac": TrainConfig(_GPT_1P3B, _CPU_BF16, bf16=True, fused_adamw=True, activation_checkpointing=True),
    "fp32_40m": TrainConfig(ModelSpec(GPTConfig(vocab_size=_VOCAB, block_size=512, n_layer=6, n_head=8,
                                                n_embd=512), 8), _CPU_SMALL),
    "offload_150m": TrainConfig(ModelSpec(GPTConfig(vocab_size=_VOCAB, block_size=512, n_layer=16, n_head=12,
                                                    n_embd=768), 4), _CPU_BF16, bf16=True, cpu_offload=True),
}


def config_model(config: str, scale: str) -> ModelSpec:
    """The model of ``config`` at ``scale`` (gpu, cpu or quick)."""
    if scale == "quick":
        return QUICK_MODELS["small"]
    return getattr(CONFIGS[config], scale)


def build_meta_model(spec: ModelSpec) -> TinyGPT:
    """The GPT with every parameter and buffer on the meta device (no memory yet)."""
    with torch.device("meta"):
        return TinyGPT(spec.config)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (the tied head/embedding counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass
class RunContext:
    """What a run is: strategy, device, and the meshes it may use (built once, lazily)."""

    strategy: str
    device: torch.device
    world_size: int
    hybrid_mesh: tuple[int, int]
    use_orig_params: bool = False  # FSDP1-style engines only
    train: TrainConfig | None = None  # ``--configs``: mixed precision, offload, activation checkpointing
    _meshes: dict[tuple[int, ...], DeviceMesh] | None = None

    @abstractmethod
    def mesh(self, shape: tuple[int, ...]) -> DeviceMesh:
        self._meshes = self._meshes or {}
        if shape not in self._meshes:
            names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
            self._meshes[shape] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._meshes[shape]


class Engine(ABC):
    """One way of sharding the model and of taking its state dicts."""

    name = ""
    label = ""

    @abstractmethod
    def wrap(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        """Shard the meta-device ``model`` per block plus a root unit, with real storage."""

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The FULL (unsharded) model state dict, on every rank."""

    @abstractmethod
    def full_state_dict_offloaded(self, model: nn.Module, offload: bool) -> dict[str, Any]:
        """The FULL model state dict on rank 0 (``offload_to_cpu=offload``), as issue 35 times it."""

    @abstractmethod
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> Any:
        """The engine's gradient clipping (FSDP1: the wrapper's method; FSDP2: torch's function)."""

    @abstractmethod
    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The sharded model state dict that goes to ``torch.distributed.checkpoint``."""

    @abstractmethod
    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load what :meth:`model_state` returned (filled in by ``dcp.load``)."""

    @abstractmethod
    def optim_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """The sharded optimizer state dict that goes to ``torch.distributed.checkpoint``."""

    @abstractmethod
    def load_optim_state(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load what :meth:`optim_state` returned (filled in by ``dcp.load``)."""


class FSDP1StyleEngine(Engine):
    """``fsdp_compat`` or torch FSDP1: the same FSDP1 program, only the import differs."""

    def __init__(self, name: str, label: str, fsdp_class: Any, api: Any, policy_class: Any,
                 keep_ties_at_init: bool = False) -> None:
        self.name, self.label = name, label
        self.fsdp, self.api, self.policy_class = fsdp_class, api, policy_class
        self.keep_ties_at_init = keep_ties_at_init

    def wrap(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        kwargs: dict[str, Any] = dict(
            auto_wrap_policy=self.policy_class({Block}),
            sharding_strategy=getattr(self.api.ShardingStrategy, ctx.strategy),
            device_id=ctx.device,  # FSDP1 refuses a CPU module without it
            use_orig_params=ctx.use_orig_params,
        )
        if ctx.strategy == "HYBRID_SHARD":
            kwargs["device_mesh"] = ctx.mesh(ctx.hybrid_mesh)
        if self.keep_ties_at_init:
            kwargs["param_init_fn"] = tie_preserving_init(model, ctx.device)
        train = ctx.train
        if train is not None and train.bf16:
            kwargs["mixed_precision"] = self.api.MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
        if train is not None and train.cpu_offload:
            kwargs["cpu_offload"] = self.api.CPUOffload(offload_params=True)
        wrapped = self.fsdp(model, **kwargs)
        if train is not None and train.activation_checkpointing:
            _checkpoint_blocks(wrapped)
        return wrapped

    def full_state_dict_offloaded(self, model: nn.Module, offload: bool) -> dict[str, Any]:
        """FULL with ``rank0_only=True`` and ``offload_to_cpu=offload`` (issue 35's checkpoint figure)."""
        config = self.api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=True)
        with self.fsdp.state_dict_type(model, self.api.StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> Any:
        return model.clip_grad_norm_(max_norm)

    def _sharded(self, model: nn.Module) -> Any:
        return self.fsdp.state_dict_type(model, self.api.StateDictType.SHARDED_STATE_DICT)

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        # offload_to_cpu=False: FSDP1's offload path is broken on CPU (shared/FSDP1-CONTRACT.md);
        # rank0_only=False so that every engine does the same work on every rank.
        config = self.api.FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with self.fsdp.state_dict_type(model, self.api.StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        with self._sharded(model):
            return model.state_dict()

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        with self._sharded(model):
            model.load_state_dict(state)

    def optim_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        with self._sharded(model):
            return self.fsdp.optim_state_dict(model, optim)

    def load_optim_state(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        with self._sharded(model):
            optim.load_state_dict(self.fsdp.optim_state_dict_to_load(model, optim, state))


# reshard_after_forward of the block units per strategy; ``None`` at the root lets the engine
# keep it unsharded after forward, as FSDP1 and fsdp_compat do.
_RAW_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "NO_SHARD": False}


class RawFSDP2Engine(Engine):
    """torch's FSDP2 API used directly: ``fully_shard`` per block and at the root.

    For ``NO_SHARD`` it uses the engine's ``replicate`` (what fsdp_compat maps NO_SHARD to), or,
    with ``replicate_as_hsdp``, ``fully_shard`` on a (world, 1) mesh (the alternative mapping).
    """

    def __init__(self, name: str, label: str, replicate_as_hsdp: bool = False) -> None:
        self.name, self.label = name, label
        self.replicate_as_hsdp = replicate_as_hsdp

    def wrap(self, model: nn.Module, ctx: RunContext) -> nn.Module:
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard

        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        train = ctx.train
        options: dict[str, Any] = {}
        if train is not None and train.bf16:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if train is not None:
            options["offload_policy"] = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if train.cpu_offload
                                         else OffloadPolicy())
        if train is not None and train.activation_checkpointing:
            _checkpoint_blocks(model)
        units = [*model.blocks, model]
        if ctx.strategy == "NO_SHARD" and not self.replicate_as_hsdp:
            for unit in units:
                replicate(unit, mesh=ctx.mesh((ctx.world_size,)), **options)
        else:
            shape = {"HYBRID_SHARD": ctx.hybrid_mesh,
                     "NO_SHARD": (ctx.world_size, 1)}.get(ctx.strategy, (ctx.world_size,))
            mesh = ctx.mesh(shape)
            reshard = _RAW_RESHARD[ctx.strategy]
            for block in model.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **options)
            fully_shard(model, mesh=mesh, reshard_after_forward=None if reshard else False, **options)
        _materialize(model, torch.device("cpu") if train is not None and train.cpu_offload else ctx.device)
        return model

    def full_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

    def full_state_dict_offloaded(self, model: nn.Module, offload: bool) -> dict[str, Any]:
        """torch's nearest call: FULL with ``cpu_offload`` (which also keeps it on rank 0 only)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> Any:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state)

    def optim_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optim)

    def load_optim_state(self, model: nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optim, state)


def _checkpoint_blocks(model: nn.Module) -> None:
    """torch's ``apply_activation_checkpointing`` on every transformer block (non-reentrant), the FSDP1
    recipe: after wrapping for FSDP1-style engines, before ``fully_shard`` for raw FSDP2."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, Block))


def tie_preserving_init(model: nn.Module, device: torch.device) -> Callable[[nn.Module], None]:
    """A ``param_init_fn`` for torch FSDP1 that keeps ``model``'s tied parameters tied.

    FSDP1's default meta-device initialisation calls ``to_empty(recurse=False)`` module by module,
    which gives the tied head and embedding two separate tensors: FSDP1 would then train a model
    with one more embedding matrix (5.80M instead of 5.28M parameters for ``small``) than the other
    engines. This does the same per-module work (storage, then ``reset_parameters()``) but gives
    every module holding a shared tensor the one materialised first, keeping its value. Only
    shared tensors are remembered, and only until their last holder is initialised, so nothing
    else outlives FSDP1's flattening.
    """
    holders: Counter[int] = Counter(
        id(tensor) for module in model.modules() for registry in (module._parameters, module._buffers)
        for tensor in registry.values() if tensor is not None and tensor.is_meta)
    shared = {key for key, count in holders.items() if count > 1}
    materialized: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def init(module: nn.Module) -> None:
        tied_values = []
        for registry in (module._parameters, module._buffers):
            for name, tensor in registry.items():
                if tensor is None or not tensor.is_meta:
                    continue
                key = id(tensor)
                if key in materialized:
                    registry[name] = materialized[key]
                    tied_values.append((registry[name], registry[name].detach().clone()))
                else:
                    replacement = torch.empty_like(tensor, device=device)
                    if isinstance(tensor, nn.Parameter):
                        replacement = nn.Parameter(replacement, requires_grad=tensor.requires_grad)
                    registry[name] = replacement
                    if key in shared:
                        materialized[key] = replacement
                holders[key] -= 1
                if holders[key] == 0:
                    materialized.pop(key, None)
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        for tensor, value in tied_values:  # initialised by its first holder
            tensor.copy_(value)

    return init


@torch.no_grad()
def _materialize(model: nn.Module, device: torch.device) -> None:
    """FSDP2's documented meta-device recipe: allocate the shards, then initialise them."""
    model.to_empty(device=device)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def make_engine(name: str) -> Engine:
    """The engine called ``name`` (imports FSDP1 only when asked for)."""
    if name == "fsdp_compat":
        import fsdp_compat
        from fsdp_compat.wrap import ModuleWrapPolicy

        return FSDP1StyleEngine(name, "fsdp_compat", fsdp_compat.FullyShardedDataParallel,
                                fsdp_compat, ModuleWrapPolicy)
    if name == "fsdp1":
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP1StyleEngine(name, "torch FSDP1", torch_fsdp.FullyShardedDataParallel,
                                torch_fsdp, ModuleWrapPolicy, keep_ties_at_init=True)
    if name == "fully_shard":
        return RawFSDP2Engine(name, "raw fully_shard")
    if name == "fully_shard_ws1":
        return RawFSDP2Engine(name, "raw fully_shard (ws,1)", replicate_as_hsdp=True)
    raise ValueError(f"unknown engine {name!r}; choose from fsdp_compat, fsdp1, fully_shard, "
                     "fully_shard_ws1")


def fsdp1_available() -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
    except ImportError:
        return False
    return True
