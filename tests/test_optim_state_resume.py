"""Resuming training from a checkpoint, through every FSDP1 optimizer-state path.

Each test trains 3 steps, saves model + optimizer state, builds a fresh model and optimizer,
loads, and trains 3 more steps. At the same world size, losses and final parameters must equal an
uninterrupted 6-step run bit for bit; across world sizes (SHARDED via
``torch.distributed.checkpoint``) within 1e-6. Checkpoints also cross engines: torch FSDP1 writes
and fsdp_compat reads, and the reverse (with golden FSDP1 checkpoints kept for when torch no
longer ships FSDP1).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat import StateDictType
from fsdp_compat.examples import GPTConfig, synthetic_batch
from fsdp_compat._tensor_layout import to_full
from fsdp_compat.testing import distributed_test
from tests import differential as diff
from tests.test_optim_state import Setup, api_of, assert_states_equal, build, full_state

FIRST, SECOND = 3, 3
PATHS = ["full_rank0_scatter", "full_shard", "osd_full", "osd_full_rank0", "osd_sharded_dcp", "sharded_flatten"]


# ---------------------------------------------------------------------------------------------
# Checkpoint directories shared by the ranks
# ---------------------------------------------------------------------------------------------

@contextmanager
def shared_directory(group: Any = None):
    """A temporary directory every rank of ``group`` sees (one machine), removed afterwards."""
    name = [tempfile.mkdtemp(prefix="fsdp_compat_optim_") if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(name, group_src=0, group=group)
    try:
        yield name[0]
    finally:
        dist.barrier(group=group)
        if dist.get_rank(group) == 0:
            shutil.rmtree(name[0], ignore_errors=True)


def _load_file(path: str) -> Any:
    return torch.load(path, weights_only=True)


# ---------------------------------------------------------------------------------------------
# Save and load, as FSDP1 programs do, one function pair per path
# ---------------------------------------------------------------------------------------------

def save_checkpoint(wrapper_class: type, path: str, model: nn.Module, optim: torch.optim.Optimizer,
                    directory: str, group: Any = None) -> Any:
    """Write model + optimizer state to ``directory`` by ``path``; returns in-memory parts if any."""
    api = api_of(wrapper_class)
    rank0 = dist.get_rank(group) == 0
    if path == "osd_sharded_dcp":
        with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": wrapper_class.optim_state_dict(model, optim)}
        dcp.save(state, checkpoint_id=directory, process_group=group)
        return None
    if path == "sharded_flatten":  # in memory: the deprecated sharded pair has no file format
        with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
            return {"model": model.state_dict(), "optim": wrapper_class.sharded_optim_state_dict(model, optim)}
    rank0_only = path in ("full_rank0_scatter", "osd_full_rank0")
    # (FSDP1 cannot offload a FULL model state dict on a CPU-only machine; it crashes.)
    offload = wrapper_class is FSDP
    with wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT,
                                       api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
                                       api.FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)):
        model_state = model.state_dict()
        if path.startswith("full_"):
            optim_state = wrapper_class.full_optim_state_dict(model, optim, rank0_only=rank0_only)
        else:
            optim_state = wrapper_class.optim_state_dict(model, optim)
    if rank0:
        torch.save({"model": model_state, "optim": optim_state}, os.path.join(directory, "checkpoint.pt"))
    dist.barrier(group=group)
    return None


def load_checkpoint(wrapper_class: type, path: str, model: nn.Module, optim: torch.optim.Optimizer,
                    directory: str, in_memory: Any = None, group: Any = None) -> None:
    api = api_of(wrapper_class)
    if path == "osd_sharded_dcp":
        with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=directory, process_group=group)
            model.load_state_dict(state["model"])
            # FSDP1's documented recipe (ShardedTensor templates read from the checkpoint).
            from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
            optim_state = load_sharded_optimizer_state_dict(state["model"], "optim",
                                                            dcp.FileSystemReader(directory))
            optim.load_state_dict(wrapper_class.optim_state_dict_to_load(model, optim, optim_state["optim"]))
        return
    if path == "sharded_flatten":
        with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(in_memory["model"])
        optim.load_state_dict(wrapper_class.flatten_sharded_optim_state_dict(in_memory["optim"], model, optim))
        return
    checkpoint = _load_file(os.path.join(directory, "checkpoint.pt"))
    rank0 = dist.get_rank(group) == 0
    with wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        model.load_state_dict(checkpoint["model"])
    if path == "full_rank0_scatter":
        sharded = wrapper_class.scatter_full_optim_state_dict(checkpoint["optim"] if rank0 else None, model,
                                                              optim=optim, group=group)
    elif path == "full_shard":
        sharded = wrapper_class.shard_full_optim_state_dict(checkpoint["optim"], model, optim=optim)
    else:
        rank0_only = path == "osd_full_rank0"
        with wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT,
                                           optim_state_dict_config=api.FullOptimStateDictConfig(rank0_only=rank0_only)):
            given = checkpoint["optim"] if rank0 or not rank0_only else {}
            sharded = wrapper_class.optim_state_dict_to_load(model, optim, given, group=group)
    optim.load_state_dict(sharded)


# ---------------------------------------------------------------------------------------------
# Same world size: bit for bit
# ---------------------------------------------------------------------------------------------

def check_resume(path: str, setup: Setup) -> None:
    diff.quiet()
    model, optim = build(FSDP, setup)
    losses = diff.train(model, optim, FIRST + SECOND)
    uninterrupted = diff.full_parameters(model)

    model, optim = build(FSDP, setup)
    first = diff.train(model, optim, FIRST)
    with shared_directory() as directory:
        in_memory = save_checkpoint(FSDP, path, model, optim, directory)
        saved_state = full_state(model, optim)
        del model, optim
        fresh, fresh_optim = build(FSDP, setup)
        load_checkpoint(FSDP, path, fresh, fresh_optim, directory, in_memory)
    assert_states_equal(full_state(fresh, fresh_optim), saved_state, what="optimizer state after load",
                        inner_order=path != "osd_sharded_dcp")
    second = diff.train(fresh, fresh_optim, SECOND, first_step=FIRST)
    assert first + second == losses, f"losses {first + second} != uninterrupted {losses}"
    resumed = diff.full_parameters(fresh)
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), f"{name} differs from the uninterrupted run"


RESUME_SETUPS = [Setup(optimizer="adam_groups", use_orig_params=True), Setup(optimizer="sgd", use_orig_params=False)]


@pytest.mark.parametrize("setup", RESUME_SETUPS, ids=lambda s: f"orig{int(s.use_orig_params)}-{s.optimizer}")
@pytest.mark.parametrize("path", PATHS)
@distributed_test(world_size=2)
def test_resume_is_bit_exact(path, setup):
    check_resume(path, setup)


@pytest.mark.parametrize("path,setup", [
    ("osd_full", Setup(optimizer="adamw", strategy="NO_SHARD")),
    ("osd_sharded_dcp", Setup(optimizer="adamw", strategy="NO_SHARD")),
    ("full_rank0_scatter", Setup(optimizer="adam_groups", model="frozen")),
    ("osd_sharded_dcp", Setup(optimizer="adamw", cpu_offload=True)),
    ("full_shard", Setup(optimizer="adamw", cpu_offload=True)),
    ("osd_full_rank0", Setup(optimizer="adam_groups", mixed_precision=True)),
], ids=["no_shard-osd_full", "no_shard-osd_sharded_dcp", "frozen-full_rank0_scatter",
        "cpu_offload-osd_sharded_dcp", "cpu_offload-full_shard", "mixed_precision-osd_full_rank0"])
@distributed_test(world_size=2)
def test_resume_is_bit_exact_more_layouts(path, setup):
    check_resume(path, setup)


@distributed_test(world_size=4)
def test_resume_is_bit_exact_hybrid():
    for path in ("osd_sharded_dcp", "full_rank0_scatter"):
        check_resume(path, Setup(optimizer="adam_groups", strategy="HYBRID_SHARD", hybrid=True))


# ---------------------------------------------------------------------------------------------
# Another world size: a checkpoint saved at 4 ranks resumes at 2 (within 1e-6)
# ---------------------------------------------------------------------------------------------

def train_on_group(model: nn.Module, optim: torch.optim.Optimizer, steps: int, first_step: int,
                   group: Any) -> list[float]:
    """``diff.train`` for a model living on ``group`` (its ranks split the same global batch)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = diff.GLOBAL_BATCH // size
    losses = []
    for step in range(first_step, first_step + steps):
        tokens, targets = synthetic_batch(step, diff.GLOBAL_BATCH, GPTConfig(), diff.device())
        loss = diff.loss_fn(model, tokens[rank * per_rank:(rank + 1) * per_rank],
                            targets[rank * per_rank:(rank + 1) * per_rank])
        loss.backward()
        optim.step()
        optim.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=group)
        losses.append(value.item() / size)
    return losses


@torch.no_grad()
def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state (zeros) without changing any parameter: one step with
    zero gradients at ``lr=0``. Its SHARDED ``optim_state_dict`` is then a template that
    ``dcp.load`` fills in, at any world size. (What torch's ``get_optimizer_state_dict`` does.)"""
    learning_rates = [group["lr"] for group in optim.param_groups]
    for group in optim.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    optim.step()
    optim.zero_grad(set_to_none=True)
    for group, lr in zip(optim.param_groups, learning_rates):
        group["lr"] = lr


def load_sharded_via_template(model: nn.Module, optim: torch.optim.Optimizer, directory: str, group: Any) -> None:
    """The DCP load recipe that needs nothing of FSDP1: templates from the fresh model."""
    init_optimizer_state(optim)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, checkpoint_id=directory, process_group=group)
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))


def _assert_close_run(losses: list[float], params: dict[str, torch.Tensor], expected_losses: list[float],
                      expected_params: dict[str, torch.Tensor], what: str) -> None:
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(expected_losses, dtype=torch.float64), rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{what} losses: {m}")
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{what} {n}: {m}")


@distributed_test(world_size=4)
def test_resume_at_another_world_size():
    """Saved at 4 ranks (SHARDED through DCP, and FULL), resumed on 2 of them; and saved on 2
    ranks, resumed at 4 (FSDP1's documented DCP recipe)."""
    diff.quiet()
    setup = Setup(optimizer="adam_groups")
    model, optim = build(FSDP, setup)
    losses = diff.train(model, optim, FIRST + SECOND)
    uninterrupted = diff.full_parameters(model)

    model, optim = build(FSDP, setup)
    diff.train(model, optim, FIRST)
    pair = dist.new_group([0, 1])
    with shared_directory() as directory:
        sharded_dir = os.path.join(directory, "sharded")
        save_checkpoint(FSDP, "osd_sharded_dcp", model, optim, sharded_dir)
        save_checkpoint(FSDP, "full_rank0_scatter", model, optim, directory)
        del model, optim
        if dist.get_rank() < 2:
            for load in ("template", "scatter"):
                fresh, fresh_optim = build(FSDP, setup, group=pair)
                if load == "template":
                    load_sharded_via_template(fresh, fresh_optim, sharded_dir, pair)
                else:
                    load_checkpoint(FSDP, "full_rank0_scatter", fresh, fresh_optim, directory, group=pair)
                second = train_on_group(fresh, fresh_optim, SECOND, FIRST, pair)
                _assert_close_run(second, diff.full_parameters(fresh), losses[FIRST:], uninterrupted,
                                  f"resumed at 2 ranks ({load})")
        dist.barrier()

        growing_dir = os.path.join(directory, "from_two")
        if dist.get_rank() < 2:
            small, small_optim = build(FSDP, setup, group=pair)
            train_on_group(small, small_optim, FIRST, 0, pair)
            save_checkpoint(FSDP, "osd_sharded_dcp", small, small_optim, growing_dir, group=pair)
        dist.barrier()
        fresh, fresh_optim = build(FSDP, setup)
        load_checkpoint(FSDP, "osd_sharded_dcp", fresh, fresh_optim, growing_dir)
        second = diff.train(fresh, fresh_optim, SECOND, first_step=FIRST)
        _assert_close_run(second, diff.full_parameters(fresh), losses[FIRST:], uninterrupted,
                          "saved at 2 ranks, resumed at 4")


# ---------------------------------------------------------------------------------------------
# Crossing engines: torch FSDP1 writes, fsdp_compat reads, and the reverse
# ---------------------------------------------------------------------------------------------

CROSS_SETUP = Setup(optimizer="adamw", use_orig_params=False, tiny=True)
GOLDEN_FULL = diff.GOLDEN_DIR / "optim_state_fsdp1_full.pt"
GOLDEN_DCP = diff.GOLDEN_DIR / "optim_state_fsdp1_dcp"


def gathered_state(wrapper_class: type, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state on every rank, for either engine. Through SHARDED: FSDP1's FULL
    output is corrupt on CPU with ``use_orig_params=True`` (every state of a parameter aliases
    one gather buffer)."""
    api = api_of(wrapper_class)
    with wrapper_class.state_dict_type(model, api.StateDictType.SHARDED_STATE_DICT):
        sharded = wrapper_class.optim_state_dict(model, optim)
    return {"state": {name: {key: to_full(value).cpu() if torch.is_tensor(value) else value
                             for key, value in state.items()} for name, state in sharded["state"].items()},
            "param_groups": sharded["param_groups"]}


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Equal values bit for bit, under the same names and groups; order aside (the two sides may
    use different ``use_orig_params``, whose FSDP1 orders differ)."""
    sort = lambda osd: {"state": dict(sorted(osd["state"].items())),  # noqa: E731
                        "param_groups": [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]}
    assert_states_equal(sort(actual), sort(expected), what=what, inner_order=False)


def _writing_golden() -> bool:
    return os.environ.get("FSDP_COMPAT_WRITE_GOLDEN") == "1"


def fsdp1_run(path: str, directory: str) -> dict[str, Any]:
    """FSDP1 trains 3 steps, checkpoints by ``path`` into ``directory``, trains 3 more."""
    model, optim = build(diff.TorchFSDP, CROSS_SETUP)
    first = diff.train(model, optim, FIRST)
    save_checkpoint(diff.TorchFSDP, path, model, optim, directory)
    saved = gathered_state(diff.TorchFSDP, model, optim)
    second = diff.train(model, optim, SECOND, first_step=FIRST)
    return {"losses": first + second, "saved": saved}


def fsdp1_checkpoint(path: str, directory: str) -> dict[str, Any]:
    """An FSDP1 checkpoint in ``directory`` and FSDP1's own run, live or from the golden copy."""
    if diff.HAVE_FSDP1:
        run = fsdp1_run(path, directory)
        if _writing_golden() and dist.get_rank() == 0:
            if path == "osd_sharded_dcp":
                shutil.rmtree(GOLDEN_DCP, ignore_errors=True)
                shutil.copytree(directory, GOLDEN_DCP)
                torch.save(run, GOLDEN_DCP / "run.pt")
            else:
                checkpoint = _load_file(os.path.join(directory, "checkpoint.pt"))
                torch.save({**checkpoint, "run": run}, GOLDEN_FULL)
        return run
    if path == "osd_sharded_dcp":
        shutil.copytree(GOLDEN_DCP, directory, dirs_exist_ok=True)
        return torch.load(GOLDEN_DCP / "run.pt", weights_only=True)
    golden_checkpoint = _load_file(GOLDEN_FULL)
    if dist.get_rank() == 0:
        torch.save({"model": golden_checkpoint["model"], "optim": golden_checkpoint["optim"]},
                   os.path.join(directory, "checkpoint.pt"))
    dist.barrier()
    return golden_checkpoint["run"]


@pytest.mark.parametrize("path", ["full_rank0_scatter", "osd_full", "osd_sharded_dcp"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=2)
def test_fsdp1_checkpoint_resumes_in_fsdp_compat(path, use_orig_params):
    """The optimizer state arrives bit for bit; training continues as FSDP1's own run does."""
    diff.quiet()
    with shared_directory() as directory:
        expected = fsdp1_checkpoint(path, directory)
        setup = Setup(optimizer=CROSS_SETUP.optimizer, use_orig_params=use_orig_params, tiny=True)
        model, optim = build(FSDP, setup)
        load_checkpoint(FSDP, path, model, optim, directory)
    assert_same_state(gathered_state(FSDP, model, optim), expected["saved"], "optimizer state loaded from FSDP1")
    second = diff.train(model, optim, SECOND, first_step=FIRST)
    diff.assert_close_lists(second, expected["losses"][FIRST:], what="continued after FSDP1's checkpoint")


@pytest.mark.skipif(not diff.HAVE_FSDP1, reason="needs torch FSDP1 to read the checkpoint")
@pytest.mark.parametrize("path", ["full_rank0_scatter", "osd_full", "osd_sharded_dcp"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=2)
def test_fsdp_compat_checkpoint_resumes_in_fsdp1(path, use_orig_params):
    diff.quiet()
    setup = Setup(optimizer=CROSS_SETUP.optimizer, use_orig_params=use_orig_params, tiny=True)
    model, optim = build(FSDP, setup)
    losses = diff.train(model, optim, FIRST + SECOND)
    model, optim = build(FSDP, setup)
    diff.train(model, optim, FIRST)
    with shared_directory() as directory:
        save_checkpoint(FSDP, path, model, optim, directory)
        saved = gathered_state(FSDP, model, optim)
        theirs, their_optim = build(diff.TorchFSDP, setup)
        load_checkpoint(diff.TorchFSDP, path, theirs, their_optim, directory)
    assert_same_state(gathered_state(diff.TorchFSDP, theirs, their_optim), saved, "optimizer state FSDP1 loaded")
    second = diff.train(theirs, their_optim, SECOND, first_step=FIRST)
    diff.assert_close_lists(second, losses[FIRST:], what="FSDP1 continued after our checkpoint")
