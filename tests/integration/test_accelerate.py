"""accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=1)`` flow with torch's FSDP1 class
switched to fsdp_compat's (the public ``fsdp_compat.torch_patched()``; see ``test_lightning_fabric.py``
for what it rebinds). accelerate looks the class up at ``prepare`` time
(``torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel``).

CPU shim: accelerate only selects FSDP for GPU-like distributed types, so after building the
``Accelerator`` the tests set ``state.distributed_type = DistributedType.FSDP`` (on
``PartialState()`` too, or the next ``AcceleratorState()`` reverts it) and ``state.fsdp_plugin``.
torch's FSDP1 cannot run this flow on CPU (accelerate passes ``device_id=torch.device("cpu")``,
which FSDP1 refuses as "Inconsistent compute device and `device_id`: cpu vs cpu:0"), so training is compared with the unsharded model on both ranks' batches
and resumed runs with the uninterrupted run.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("accelerate", reason="needs the integration extra: pip install -e '.[integration]'")

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_compat.testing import distributed_test

from ._common import (
    assert_close,
    rank_batches,
    run_flow,
    shared_tmpdir,
    small_model,
    unsharded_reference,
)

STEPS, ACCUMULATE = 4, 2


def _accelerator(state_dict_type: str = "FULL_STATE_DICT") -> Accelerator:
    # accelerate keeps its state in process-wide singletons: start each flow afresh.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), state_dict_type=state_dict_type,
        use_orig_params=True)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True, gradient_accumulation_steps=ACCUMULATE)
    # CPU shim: accelerate selects FSDP only for GPU-like distributed types. Set on PartialState too,
    # as accelerate does itself on GPU: every later AcceleratorState() (prepare builds several) copies
    # PartialState's attributes over its own, and save_state/load_state would then take the
    # non-FSDP path (rank 0's optimizer.state_dict() of local shards loaded on every rank).
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def _prepare(accelerator: Accelerator, joint: bool):
    model = small_model()
    if joint:  # the optimizer is built on the unwrapped model
        return accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    model = accelerator.prepare(model)
    return model, accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _train(accelerator: Accelerator, model, optimizer, batches) -> list[float]:
    losses = []
    for x, y in batches:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train_flow(joint: bool):
    accelerator = _accelerator()
    model, optimizer = _prepare(accelerator, joint)
    losses = _train(accelerator, model, optimizer, rank_batches(STEPS * ACCUMULATE))
    state = accelerator.get_state_dict(model)  # FULL, on rank 0 (accelerate's rank0_only)
    return losses, {k: v.clone() for k, v in state.items()}


# prepare(model, optimizer) gets an optimizer built on the unwrapped model.
@pytest.mark.parametrize("joint", [True, False],
                         ids=["prepare(model,optimizer)", "prepare(model)+prepare(optimizer)"])
@distributed_test(world_size=2)
def test_accelerate_trains_like_the_unsharded_model(joint):
    losses, state = run_flow(_train_flow, joint, ours=True)
    expected_losses, expected_state = unsharded_reference(STEPS * ACCUMULATE, ACCUMULATE)
    assert_close(losses, expected_losses, atol=1e-5)
    if torch.distributed.get_rank() == 0:  # get_state_dict gathers to rank 0
        assert_close(state, expected_state, atol=1e-5)


def _resume_flow(state_dict_type: str, directory: str):
    batches = rank_batches(2 * STEPS * ACCUMULATE)
    half = STEPS * ACCUMULATE
    accelerator = _accelerator(state_dict_type)
    model, optimizer = _prepare(accelerator, joint=False)
    uninterrupted = _train(accelerator, model, optimizer, batches)
    expected = accelerator.get_state_dict(model)

    accelerator = _accelerator(state_dict_type)
    model, optimizer = _prepare(accelerator, joint=False)
    first = _train(accelerator, model, optimizer, batches[:half])
    accelerator.save_state(os.path.join(directory, state_dict_type))

    accelerator = _accelerator(state_dict_type)
    model, optimizer = _prepare(accelerator, joint=False)
    accelerator.load_state(os.path.join(directory, state_dict_type))
    second = _train(accelerator, model, optimizer, batches[half:])
    return uninterrupted, first + second, expected, accelerator.get_state_dict(model)


# Not an fsdp_compat bug, and the same with torch FSDP1: for SHARDED, accelerate's
# load_fsdp_optimizer (use_dcp) reads the checkpoint into FSDP.optim_state_dict() of the fresh
# optimizer, which has no state before its first step; FSDP1 then gives an empty "state" too
# (checked side by side on gloo, torch 2.13), so DCP reads no optimizer state and the resumed run
# drifts from the second step on. Strict, so a change on either side shows up here.
SHARDED_OPTIMIZER_TEMPLATE = pytest.mark.xfail(
    strict=True, reason="accelerate + FSDP1 limitation: SHARDED load_state restores no state into a fresh optimizer")


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT",
                                             pytest.param("SHARDED_STATE_DICT", marks=SHARDED_OPTIMIZER_TEMPLATE)])
@distributed_test(world_size=2)
def test_accelerate_save_load_state_resumes_like_uninterrupted(state_dict_type):
    with shared_tmpdir() as directory:
        uninterrupted, resumed, expected, state = run_flow(_resume_flow, state_dict_type, directory, ours=True)
    assert_close(resumed, uninterrupted, atol=1e-6)
    assert_close(state, expected, atol=1e-6)
