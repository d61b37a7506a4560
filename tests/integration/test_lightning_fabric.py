"""Lightning Fabric's ``FSDPStrategy`` flow with torch's FSDP1 class switched to fsdp_compat's.

The switch is the public ``fsdp_compat.torch_patched()`` (``patch_torch()``): it rebinds
``torch.distributed.fsdp.FullyShardedDataParallel`` and
``torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel`` (which Lightning
imports inside its methods) and references already bound elsewhere. Nothing private is patched.

CPU shim: Fabric's connector refuses ``type(strategy) is FSDPStrategy`` without a GPU, so the tests
pass a subclass with no changes. torch's own FSDP1 cannot run this flow on CPU (Fabric passes
``device_id=root_device.index``, ``None`` on CPU, and FSDP1 then demands an accelerator), so results
are compared with the unsharded model trained on both ranks' batches.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning", reason="needs the integration extra: pip install -e '.[integration]'")

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy

from fsdp_compat.testing import distributed_test

from ._common import (
    assert_close,
    full_state,
    rank_batches,
    run_flow,
    shared_tmpdir,
    small_model,
    unsharded_reference,
)

STEPS, ACCUMULATE = 4, 2


class CPUFSDPStrategy(FSDPStrategy):
    """Fabric's FSDPStrategy unchanged: only ``type(...) is FSDPStrategy`` (the GPU check) differs."""


def _fabric(state_dict_type: str = "full") -> Fabric:
    strategy = CPUFSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=state_dict_type,
                               use_orig_params=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()  # ranks already exist (the rank pool's): this only sets Fabric up
    return fabric


def _setup(fabric: Fabric, joint: bool):
    model = small_model()
    if joint:  # the optimizer is built on the unwrapped model, then both are set up together
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return fabric.setup(model, optimizer)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, optimizer


def _train(fabric: Fabric, model, optimizer, batches) -> list[float]:
    """Gradient accumulation with ``no_backward_sync`` and ``clip_gradients``, as Fabric's docs do."""
    losses = []
    for i, (x, y) in enumerate(batches):
        last = (i + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE
            fabric.backward(loss)
        losses.append(loss.item())
        if last:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _train_flow(joint: bool):
    fabric = _fabric()
    model, optimizer = _setup(fabric, joint)
    losses = _train(fabric, model, optimizer, rank_batches(STEPS * ACCUMULATE))
    return losses, full_state(model._forward_module)


# setup(model, optimizer) gets an optimizer built on the unwrapped model.
@pytest.mark.parametrize("joint", [True, False],
                         ids=["setup", "setup_module+setup_optimizers"])
@distributed_test(world_size=2)
def test_fabric_trains_like_the_unsharded_model(joint):
    losses, state = run_flow(_train_flow, joint, ours=True)
    expected_losses, expected_state = unsharded_reference(STEPS * ACCUMULATE, ACCUMULATE,
                                                          loss_divisor=ACCUMULATE)
    assert_close(losses, expected_losses, atol=1e-5)
    assert_close(state, expected_state, atol=1e-5)


def _resume_flow(state_dict_type: str, directory: str):
    batches = rank_batches(2 * STEPS * ACCUMULATE)
    half = STEPS * ACCUMULATE
    fabric = _fabric(state_dict_type)
    model, optimizer = _setup(fabric, joint=False)
    uninterrupted = _train(fabric, model, optimizer, batches)
    expected = full_state(model._forward_module)

    fabric = _fabric(state_dict_type)
    model, optimizer = _setup(fabric, joint=False)
    first = _train(fabric, model, optimizer, batches[:half])
    path = os.path.join(directory, f"ckpt-{state_dict_type}")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": half})

    fabric = _fabric(state_dict_type)
    model, optimizer = _setup(fabric, joint=False)
    state = {"model": model, "optimizer": optimizer}
    remainder = fabric.load(path, state)
    second = _train(fabric, model, optimizer, batches[remainder["step"]:])
    return uninterrupted, first + second, expected, full_state(model._forward_module)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@distributed_test(world_size=2)
def test_fabric_save_load_resume_equals_uninterrupted(state_dict_type):
    with shared_tmpdir() as directory:
        uninterrupted, resumed, expected, state = run_flow(_resume_flow, state_dict_type, directory, ours=True)
    assert_close(resumed, uninterrupted, atol=1e-6)
    assert_close(state, expected, atol=1e-6)
