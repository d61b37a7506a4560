"""Differential-test helpers: one seeded model, three ways (single process, torch FSDP1, ours).

Every rank builds the same seeded model, takes its slice of one deterministic global batch, and
trains; the single-process reference trains on the whole batch. With gradient averaging over
ranks, all three must agree step by step.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_compat._common import clean_name
from fsdp_compat.examples import Block, GPTConfig, TinyGPT, synthetic_batch

# The benchmarks' tensor-peak counter: the step-memory tests and bench.py's "tensors made in the step" row
# must measure the same thing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _memory import AllocatorPeak  # noqa: E402,F401

GLOBAL_BATCH = 4
GOLDEN_DIR = Path(__file__).parent / "golden"

import fsdp_compat
import fsdp_compat.wrap

try:  # FSDP1 is the oracle; tests fall back to golden files when torch no longer ships it.
    import torch.distributed.fsdp.wrap as torch_wrap
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
except ImportError:  # no FSDP1 in this torch, or FSDP_COMPAT_WITHOUT_FSDP1=1 (tests/without_fsdp1.py)
    TorchFSDP = None
    torch_wrap = None

import torch.distributed.fsdp

# FSDP1's public enums and config classes as a drop-in user passes them: torch's own, or
# fsdp_compat's (equal to torch's) once torch no longer ships them.
torch_fsdp = torch.distributed.fsdp if hasattr(torch.distributed.fsdp, "ShardingStrategy") else fsdp_compat

HAVE_FSDP1 = TorchFSDP is not None


def device() -> torch.device:
    """This rank's compute device: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_model(seed: int = 0, config: GPTConfig | None = None, on_device: bool = True) -> TinyGPT:
    """The seeded test model (uneven vocabulary, tied head, buffers)."""
    torch.manual_seed(seed)
    model = TinyGPT(config or GPTConfig())
    return model.to(device()) if on_device else model


def block_policy_torch() -> Any:
    """torch's ModuleWrapPolicy over transformer blocks (what a drop-in user passes); ours, which
    wraps the same units, once torch no longer ships FSDP1's ``wrap`` module."""
    return (torch_wrap or fsdp_compat.wrap).ModuleWrapPolicy({Block})


def local_batch(step: int, config: GPTConfig | None = None, global_batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (the whole batch without a group)."""
    tokens, targets = synthetic_batch(step, global_batch, config or GPTConfig(), device())
    if not dist.is_initialized():
        return tokens, targets
    per_rank = global_batch // dist.get_world_size()
    start = dist.get_rank() * per_rank
    return tokens[start:start + per_rank], targets[start:start + per_rank]


def loss_fn(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """``sgd`` (momentum) or ``adamw``, with fixed hyperparameters."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def mean_over_ranks(loss: torch.Tensor) -> float:
    """``loss`` averaged over the ranks (one all-reduce), as a Python float."""
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, first_step: int = 0,
          sharded: bool = True) -> list[float]:
    """Train ``steps`` steps; returns the global mean loss per step (same on every rank)."""
    losses = []
    for step in range(first_step, first_step + steps):
        if sharded:
            tokens, targets = local_batch(step)
        else:
            tokens, targets = synthetic_batch(step, GLOBAL_BATCH, GPTConfig(), device())
        loss = loss_fn(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if sharded and dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def computed_once_per_process(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a deterministic single-process run: a reference for several tests, e.g. every strategy of
    test_training_parity) computed once per rank process and argument tuple: each call gets a deep copy
    of the result and the CPU RNG state the run left, as if it ran again. Runs on a GPU are not cached."""
    results: dict[tuple[Any, ...], tuple[Any, torch.Tensor]] = {}

    @functools.wraps(fn)
    def cached(*args: Any, **kwargs: Any) -> Any:
        if device().type != "cpu":
            return fn(*args, **kwargs)
        key = (*args, *sorted(kwargs.items()))
        if key not in results:
            result = fn(*args, **kwargs)
            results[key] = (copy.deepcopy(result), torch.get_rng_state())
        result, rng_state = results[key]
        torch.set_rng_state(rng_state)
        return copy.deepcopy(result)

    return cached


@computed_once_per_process
def reference_run(optimizer_name: str, steps: int, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process, unsharded run on the whole global batch."""
    model = make_model(seed)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    losses = train(model, optimizer, steps, sharded=False)
    return losses, {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


def _shows_local_shards(model: nn.Module) -> bool:
    """An fsdp_compat model with FSDP1's plain local-shard parameters (``dtensor_params=False``)."""
    return (any(isinstance(unit, fsdp_compat.FullyShardedDataParallel) for unit in model.modules())
            and not any(isinstance(param, DTensor) for param in model.parameters()))


def _summoner(model: nn.Module) -> Any:
    """The ``summon_full_params`` that shows ``model``'s full parameters, or ``None`` (DTensors: gathered)."""
    if HAVE_FSDP1 and isinstance(model, TorchFSDP):
        return TorchFSDP.summon_full_params
    return fsdp_compat.FullyShardedDataParallel.summon_full_params if _shows_local_shards(model) else None


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clean FQN -> full parameter value (gathered), for any of the three kinds of model."""
    if (summon := _summoner(model)) is not None:
        with summon(model):
            return {clean_name(n): p.detach().cpu().clone() for n, p in model.named_parameters()}
    result = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        result[clean_name(name)] = value.detach().cpu().clone()
    return result


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clean FQN -> full gradient (gathered; FSDP1 needs ``use_orig_params=True``); no-grad params left out."""
    if (summon := _summoner(model)) is not None:
        with summon(model, with_grads=True, writeback=False):
            return {clean_name(n): p.grad.detach().cpu().clone()
                    for n, p in model.named_parameters() if p.grad is not None}
    result = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            result[clean_name(name)] = grad.detach().cpu().clone()
    return result



def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Clean FQN -> full value of every parameter and buffer, for "nothing changed" checks."""
    state = full_parameters(model)
    for name, buffer in model.named_buffers():
        state[clean_name(name)] = buffer.detach().cpu().clone()
    return state

def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ||a - e|| / ||e|| (0 when both are zero).

    Element-wise relative checks blow up on the odd near-zero element after a few Adam steps,
    where reduction order alone changes the last bits; the tensor-level error is what "equal
    within 1e-5 relative" means for a parameter.
    """
    actual, expected = actual.double(), expected.double()
    scale = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / scale if scale > 0 else difference


def assert_close_dicts(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                       rtol: float = 1e-5, what: str = "") -> None:
    """Same keys, same shapes, and every tensor within ``rtol`` norm-wise relative error."""
    assert set(actual) == set(expected), f"{what} keys differ: {set(actual) ^ set(expected)}"
    for name in expected:
        assert actual[name].shape == expected[name].shape, f"{what} {name}: shape differs"
        error = relative_error(actual[name], expected[name])
        assert error <= rtol, f"{what} {name}: relative error {error:.3g} > {rtol}"


def assert_close_lists(actual: list[float], expected: list[float], rtol: float = 1e-5, what: str = "") -> None:
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=1e-7,
                               msg=lambda m: f"{what}: {m}")


def fsdp1_kwargs() -> dict[str, Any]:
    """What torch FSDP1 needs on top of the test's arguments (it refuses CPU without device_id)."""
    return {"device_id": device()}


def quiet() -> None:
    """Silence deprecation chatter from FSDP1 in rank output."""
    warnings.filterwarnings("ignore")


# ---- golden values: FSDP1 results saved so the tests keep meaning something without FSDP1 ----

def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def load_golden(name: str) -> Any:
    path = golden_path(name)
    return json.loads(path.read_text()) if path.exists() else None


def save_golden(name: str, value: Any) -> None:
    """Write a golden file (only when ``FSDP_COMPAT_WRITE_GOLDEN=1``; rank 0 only)."""
    if os.environ.get("FSDP_COMPAT_WRITE_GOLDEN") != "1":
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    GOLDEN_DIR.mkdir(exist_ok=True)
    golden_path(name).write_text(json.dumps(value, indent=1, sort_keys=True))


def golden_key(*parts: object) -> str:
    """A golden-file key for this world size and test configuration."""
    return "-".join(str(p) for p in (f"ws{dist.get_world_size()}", *parts))


def check_against_fsdp1(golden_name: str, key: str, ours: list[float],
                        run_fsdp1: Callable[[], list[float]], rtol: float = 1e-5) -> None:
    """``ours`` equals torch FSDP1's values: run FSDP1 now, or use its golden values without it.

    With FSDP1 present the fresh values are also written to the golden file (when
    ``FSDP_COMPAT_WRITE_GOLDEN=1``), so the test keeps meaning something once torch drops FSDP1.
    """
    expected = fsdp1_value(golden_name, key, run_fsdp1)
    assert_close_lists(ours, expected, rtol=rtol, what=f"{key} vs torch FSDP1")


def fsdp1_value(golden_name: str, key: str, run_fsdp1: Callable[[], Any]) -> Any:
    """torch FSDP1's (JSON-able) value for ``key``: computed now, or its golden copy without FSDP1."""
    golden = load_golden(golden_name) or {}
    if HAVE_FSDP1:
        golden[key] = run_fsdp1()
        save_golden(golden_name, golden)
    assert key in golden, f"no FSDP1 result or golden value for {key} in {golden_name}"
    return golden[key]


class AllGatherLog(TorchDispatchMode):
    """Appends "all-gather" to ``events`` for every all-gather collective dispatched."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in str(func):
            self.events.append("all-gather")
        return func(*args, **(kwargs or {}))


