"""CPUOffload(offload_params=True): sharded parameters and gradients live on the CPU between steps.

The optimizer then steps on the CPU; compute runs on the compute device (the CPU here, where
torch FSDP1 cannot offload at all: it pins memory and fails with "Cannot access accelerator
device"). Training must equal the single-process reference within 1e-5 relative, and we assert
where the sharded parameters and their gradients are after every backward and every step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests.test_mixed_precision import wrapper_kwargs

STEPS = 4
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
CPU = torch.device("cpu")


def offloaded_model(strategy: str = "FULL_SHARD", use_orig_params: bool = True, **kwargs) -> FSDP:
    """TinyGPT auto-wrapped by block, offloaded; ``CPUOffload`` passed as torch's object when it exists."""
    cpu_offload = (diff.torch_fsdp if diff.HAVE_FSDP1 else fsdp_compat).CPUOffload(offload_params=True)
    return FSDP(diff.make_model(), cpu_offload=cpu_offload, use_orig_params=use_orig_params,
                auto_wrap_policy=diff.block_policy_torch(), **wrapper_kwargs(True, strategy), **kwargs)


def assert_on_cpu(model: FSDP, grads: bool) -> None:
    for name, param in model.named_parameters():
        assert param.device == CPU, f"{name} is on {param.device}"
        if grads:
            assert param.grad is not None and param.grad.device == CPU, f"{name}.grad not on the CPU"
    for unit in FSDP.fsdp_modules(model):
        if unit._has_params:
            assert unit._flat_param.device == CPU


def train_checking_devices(model: FSDP, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    """``diff.train`` with device assertions after each backward and each optimizer step."""
    losses = []
    for step in range(steps):
        tokens, targets = diff.local_batch(step)
        loss = diff.loss_fn(model, tokens, targets)
        loss.backward()
        assert_on_cpu(model, grads=True)
        optimizer.step()
        optimizer.zero_grad()
        assert_on_cpu(model, grads=False)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("use_orig_params", [True, False])
@distributed_test(world_size=2)
def test_offload_training_matches_reference(strategy, use_orig_params):
    diff.quiet()
    model = offloaded_model(strategy, use_orig_params)
    assert_on_cpu(model, grads=False)
    optimizer = diff.make_optimizer("adamw", model.parameters())
    losses = train_checking_devices(model, optimizer, STEPS)
    reference_losses, reference_params = diff.reference_run("adamw", STEPS)
    diff.assert_close_lists(losses, reference_losses, rtol=1e-5, what="losses vs reference")
    diff.assert_close_dicts(diff.full_parameters(model), reference_params, rtol=1e-5, what="params")


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_offload_with_mixed_precision_equals_no_offload(strategy):
    """Offloading moves tensors, never values: bf16 training is bit-identical with and without."""
    diff.quiet()
    policy = fsdp_compat.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                        buffer_dtype=torch.bfloat16)
    offloaded = offloaded_model(strategy, mixed_precision=policy)
    plain = FSDP(diff.make_model(), mixed_precision=policy, auto_wrap_policy=diff.block_policy_torch(),
                 **wrapper_kwargs(True, strategy))
    results = []
    for model in (offloaded, plain):
        optimizer = diff.make_optimizer("adamw", model.parameters())
        results.append((diff.train(model, optimizer, STEPS), diff.full_parameters(model)))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(value, results[1][1][name]), name
    assert_on_cpu(offloaded, grads=False)


def accumulate_then_clip(model: torch.nn.Module, sharded: bool) -> tuple[list[float], dict, float]:
    """Two micro-batches per step (the first inside ``no_sync``), clipped, SGD."""
    optimizer = diff.make_optimizer("sgd", model.parameters())
    losses, norm = [], 0.0
    for step in range(2):
        for micro in range(2):
            if sharded:
                tokens, targets = diff.local_batch(2 * step + micro)
            else:
                tokens, targets = diff.synthetic_batch(2 * step + micro, diff.GLOBAL_BATCH, diff.GPTConfig(), diff.device())
            context = model.no_sync() if sharded and micro == 0 else contextlib.nullcontext()
            with context:
                loss = diff.loss_fn(model, tokens, targets)
                loss.backward()
        if sharded:
            assert_on_cpu(model, grads=True)
            norm = model.clip_grad_norm_(1.0).item()
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        if sharded:
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses, diff.full_parameters(model), norm


@distributed_test(world_size=2)
def test_offload_with_no_sync_and_clip_grad_norm():
    diff.quiet()
    losses, params, norm = accumulate_then_clip(offloaded_model(), sharded=True)
    reference_losses, reference_params, reference_norm = accumulate_then_clip(diff.make_model(), sharded=False)
    diff.assert_close_lists(losses, reference_losses, rtol=1e-5, what="losses")
    diff.assert_close_lists([norm], [reference_norm], rtol=1e-5, what="clipped norm")
    diff.assert_close_dicts(params, reference_params, rtol=1e-5, what="params")
