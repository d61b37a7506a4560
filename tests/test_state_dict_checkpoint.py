"""Checkpoints on disk: torch.save of FULL state dicts, torch.distributed.checkpoint (DCP) of
SHARDED ones, across engines (torch FSDP1 <-> fsdp_compat), across world sizes (4 -> 2), golden
checkpoints written by torch FSDP1 (so the tests keep working once torch drops it), damaged
checkpoint directories, and torch's ``get_state_dict`` / ``set_state_dict``.

"Loads" is checked by training on: a model restored from a checkpoint must reach the same
losses as the run that wrote it, continued without interruption. Plain SGD (no momentum) keeps
the optimizer stateless, so the model state is the whole training state.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import GPTConfig
from fsdp_compat.testing import run_on_ranks
from fsdp_compat.wrap import ModuleWrapPolicy
from tests import differential as diff

FULL = fsdp_compat.StateDictType.FULL_STATE_DICT
SHARDED = fsdp_compat.StateDictType.SHARDED_STATE_DICT
TINY = GPTConfig(vocab_size=37, block_size=8, n_layer=1, n_head=2, n_embd=16)  # ~4k parameters
STEPS_BEFORE, STEPS_AFTER = 3, 3
GOLDEN_FULL = diff.GOLDEN_DIR / "state_dict_fsdp1_full.pt"
GOLDEN_DCP = diff.GOLDEN_DIR / "state_dict_fsdp1_sharded_dcp"
GOLDEN_NAME = "state_dict_fsdp1"

needs_fsdp1 = pytest.mark.skipif(not diff.HAVE_FSDP1, reason="needs torch FSDP1")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make(wrapper_class, seed: int = 0, use_orig_params: bool = False, **kwargs):
    """The tiny seeded GPT, block-wrapped by ``wrapper_class`` (FSDP1 or ours)."""
    diff.quiet()
    model = diff.make_model(seed, TINY)
    if wrapper_class is diff.TorchFSDP:
        kwargs.update(diff.fsdp1_kwargs())
        policy = diff.block_policy_torch()
    else:
        from fsdp_compat.examples import Block
        policy = ModuleWrapPolicy({Block})
    return wrapper_class(model, auto_wrap_policy=policy, use_orig_params=use_orig_params, **kwargs)


def sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


def train(model, optimizer, steps: int, first_step: int) -> list[float]:
    """Global mean loss per step on the tiny config's data."""
    losses = []
    for step in range(first_step, first_step + steps):
        tokens, targets = diff.local_batch(step, TINY)
        loss = diff.loss_fn(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    return losses


def state_dict_type(model, kind, config=None):
    """``wrapper_class.state_dict_type`` with the right enum and config classes for the class."""
    if type(model) is diff.TorchFSDP:
        kind = getattr(diff.torch_fsdp.StateDictType, kind.name)
        if config is not None:
            config = getattr(diff.torch_fsdp, type(config).__name__)(**vars(config))
    return type(model).state_dict_type(model, kind, config)


def save_full(model, path: str) -> None:
    """FSDP1's FULL recipe: rank 0 gathers the full state dict (on CPU) and saves it."""
    with state_dict_type(model, FULL, fsdp_compat.FullStateDictConfig(offload_to_cpu=type(model) is FSDP,
                                                                       rank0_only=True)):
        state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()


def load_full(model, path: str) -> None:
    state = torch.load(path, weights_only=True)
    with state_dict_type(model, FULL):
        model.load_state_dict(state)


def save_sharded(model, path: str) -> None:
    """The SHARDED recipe: every rank writes its shards with torch.distributed.checkpoint."""
    with state_dict_type(model, SHARDED):
        dcp.save(model.state_dict(), checkpoint_id=path)


def load_sharded(model, path: str) -> None:
    with state_dict_type(model, SHARDED):
        state = model.state_dict()  # the template: this model's keys and layout
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state)


def full_state(model) -> dict[str, torch.Tensor]:
    with state_dict_type(model, FULL):
        return {k: v.cpu() for k, v in model.state_dict().items()}


def assert_losses(actual: list[float], expected: list[float], what: str) -> None:
    diff.assert_close_lists(actual, expected, rtol=1e-5, what=what)


# ---------------------------------------------------------------------------------------------
# crossing engines, same world size
# ---------------------------------------------------------------------------------------------

SAVE_LOAD = {"full": (save_full, load_full), "sharded_dcp": (save_sharded, load_sharded)}


def cross_engines(path: str, writer_name: str, format_name: str) -> None:
    """The writer trains, saves, and continues (the uninterrupted run); the reader, built from a
    different seed, loads and continues. Same losses."""
    classes = {"fsdp1": diff.TorchFSDP, "ours": FSDP}
    writer_class = classes[writer_name]
    reader_class = classes["ours" if writer_name == "fsdp1" else "fsdp1"]
    save, load = SAVE_LOAD[format_name]
    writer = make(writer_class)
    optimizer = sgd(writer)
    train(writer, optimizer, STEPS_BEFORE, 0)
    save(writer, path)
    uninterrupted = train(writer, optimizer, STEPS_AFTER, STEPS_BEFORE)

    reader = make(reader_class, seed=1, use_orig_params=True)
    load(reader, path)
    resumed = train(reader, sgd(reader), STEPS_AFTER, STEPS_BEFORE)
    assert_losses(resumed, uninterrupted, f"{writer_name} {format_name} checkpoint resumed by the other engine")


@needs_fsdp1
@pytest.mark.parametrize("format_name", sorted(SAVE_LOAD))
@pytest.mark.parametrize("writer_name", ["fsdp1", "ours"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpoint_crosses_engines(tmp_path, world_size, writer_name, format_name):
    path = str(tmp_path / ("checkpoint.pt" if format_name == "full" else "checkpoint"))
    run_on_ranks(cross_engines, world_size, path, writer_name, format_name)


# ---------------------------------------------------------------------------------------------
# DCP across world sizes
# ---------------------------------------------------------------------------------------------


def save_after_training(path: str, writer_name: str) -> tuple[dict, list[float]]:
    wrapper_class = diff.TorchFSDP if writer_name == "fsdp1" else FSDP
    model = make(wrapper_class)
    optimizer = sgd(model)
    train(model, optimizer, STEPS_BEFORE, 0)
    save_sharded(model, path)
    expected = full_state(model)
    return expected, train(model, optimizer, STEPS_AFTER, STEPS_BEFORE)


def load_and_resume(path: str, expected: dict, expected_losses: list[float]) -> None:
    model = make(FSDP, seed=1)
    load_sharded(model, path)
    after = full_state(model)
    assert list(after) == list(expected)
    for key in expected:
        assert torch.equal(after[key], expected[key]), key
    assert_losses(train(model, sgd(model), STEPS_AFTER, STEPS_BEFORE), expected_losses, "resumed at 2 ranks")


@pytest.mark.parametrize("writer_name", [
    "ours", pytest.param("fsdp1", marks=needs_fsdp1)])
def test_dcp_checkpoint_saved_at_4_ranks_loads_at_2(tmp_path, writer_name):
    expected, losses = run_on_ranks(save_after_training, 4, str(tmp_path / "ckpt"), writer_name)[0]
    run_on_ranks(load_and_resume, 2, str(tmp_path / "ckpt"), expected, losses)


def test_dcp_checkpoint_saved_at_2_ranks_loads_at_4(tmp_path):
    expected, losses = run_on_ranks(save_after_training, 2, str(tmp_path / "ckpt"), "ours")[0]
    run_on_ranks(load_and_resume, 4, str(tmp_path / "ckpt"), expected, losses)


# ---------------------------------------------------------------------------------------------
# golden checkpoints written by torch FSDP1 (torch 2.13, 4 ranks, FULL_SHARD, flat parameters)
# ---------------------------------------------------------------------------------------------


def write_golden_checkpoints() -> None:
    """Regenerate the golden files with torch FSDP1 (``FSDP_COMPAT_WRITE_GOLDEN=1``, 4 ranks)."""
    model = make(diff.TorchFSDP)
    optimizer = sgd(model)
    before = train(model, optimizer, STEPS_BEFORE, 0)
    if dist.get_rank() == 0:
        shutil.rmtree(GOLDEN_DCP, ignore_errors=True)
    dist.barrier()
    save_full(model, str(GOLDEN_FULL))
    save_sharded(model, str(GOLDEN_DCP))
    after = train(model, optimizer, STEPS_AFTER, STEPS_BEFORE)
    diff.save_golden(GOLDEN_NAME, {
        "torch": torch.__version__, "world_size": dist.get_world_size(), "config": vars(TINY),
        "losses_before": before, "losses_after": after,
    })


def resume_from_golden(format_name: str) -> None:
    golden = diff.load_golden(GOLDEN_NAME)
    model = make(FSDP, seed=1)
    if format_name == "full":
        load_full(model, str(GOLDEN_FULL))
    else:
        load_sharded(model, str(GOLDEN_DCP))
    assert_losses(train(model, sgd(model), STEPS_AFTER, STEPS_BEFORE), golden["losses_after"],
                  f"resumed from FSDP1's golden {format_name} checkpoint")


@pytest.mark.parametrize("format_name", ["full", "sharded_dcp"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_golden_fsdp1_checkpoint_resumes(world_size, format_name):
    if os.environ.get("FSDP_COMPAT_WRITE_GOLDEN") == "1" and diff.HAVE_FSDP1 and world_size == 2 \
            and format_name == "full":
        run_on_ranks(write_golden_checkpoints, 4)
    assert GOLDEN_FULL.exists() and GOLDEN_DCP.is_dir(), "golden checkpoints missing"
    run_on_ranks(resume_from_golden, world_size, format_name)


def test_golden_checkpoints_are_small():
    sizes = [GOLDEN_FULL.stat().st_size] + [p.stat().st_size for p in GOLDEN_DCP.iterdir()]
    assert sum(sizes) < 200_000, sizes


# ---------------------------------------------------------------------------------------------
# damaged checkpoint directories
# ---------------------------------------------------------------------------------------------


def _damage(path: Path, fault: str) -> None:
    shards = sorted(path.glob("*.distcp"))
    if fault == "missing_metadata":
        (path / ".metadata").unlink()
    elif fault == "garbage_metadata":
        (path / ".metadata").write_bytes(b"not a checkpoint")
    elif fault == "missing_shard_file":
        shards[-1].unlink()
    elif fault == "truncated_shard_file":
        data = shards[0].read_bytes()
        shards[0].write_bytes(data[: len(data) // 3])
    elif fault == "empty_directory":
        for item in path.iterdir():
            item.unlink()


def load_damaged(path: str, fault: str) -> None:
    writer = make(FSDP)
    train(writer, sgd(writer), 1, 0)
    if fault == "other_model":
        # A checkpoint of a different architecture: keys and shapes do not match.
        other = FSDP(diff.make_model(0, GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=8)))
        save_sharded(other, path)
    else:
        save_sharded(writer, path)
    dist.barrier()
    if dist.get_rank() == 0:
        _damage(Path(path), fault)
    dist.barrier()
    reader = make(FSDP, seed=1)
    before = diff.model_state(reader)
    # DCP reports read failures of any rank on every rank as CheckpointException (a BaseException).
    with pytest.raises((Exception, CheckpointException)) as raised:
        load_sharded(reader, path)
    assert str(raised.value), "the error must say what went wrong"
    after = diff.model_state(reader)
    for key in before:
        assert torch.equal(before[key], after[key]), f"{key} changed by a failed checkpoint load"
    train(reader, sgd(reader), 1, 0)  # the model is still usable


@pytest.mark.parametrize("fault", ["missing_metadata", "garbage_metadata", "missing_shard_file",
                                   "truncated_shard_file", "empty_directory", "other_model"])
def test_damaged_checkpoint_directory_fails_cleanly(tmp_path, fault):
    run_on_ranks(load_damaged, 2, str(tmp_path / "ckpt"), fault)


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint.state_dict: get_state_dict / set_state_dict
# ---------------------------------------------------------------------------------------------


def distributed_state_dict_round_trip(path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = make(FSDP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, STEPS_BEFORE, 0)
    model_state, optim_state = get_state_dict(model, optimizer)
    assert list(model_state) == list(diff.make_model(0, TINY).state_dict())
    assert type(model_state["tok_emb.weight"]).__name__ == "ShardedTensor"  # SHARDED, as torch gives FSDP1's
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    uninterrupted = train(model, optimizer, STEPS_AFTER, STEPS_BEFORE)

    reader = make(FSDP, seed=1)
    reader_optimizer = torch.optim.AdamW(reader.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(reader, reader_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(reader, reader_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train(reader, reader_optimizer, STEPS_AFTER, STEPS_BEFORE)
    assert_losses(resumed, uninterrupted, "model and AdamW state through get/set_state_dict")


def distributed_state_dict_full_options() -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model = make(FSDP)
    train(model, sgd(model), STEPS_BEFORE, 0)
    expected = full_state(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert list(full) == list(expected) and all(type(v) is torch.Tensor for v in full.values())
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert bool(offloaded) == (dist.get_rank() == 0)  # rank 0 only, as torch does for FSDP1
    for options, source in ((StateDictOptions(full_state_dict=True), full),
                            (StateDictOptions(full_state_dict=True, broadcast_from_rank0=True), offloaded)):
        reader = make(FSDP, seed=1)
        set_model_state_dict(reader, source, options=options)
        after = full_state(reader)
        for key in expected:
            assert torch.equal(after[key], expected[key]), (options, key)


def fsdp1_distributed_state_dict_to_ours(path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    writer = make(diff.TorchFSDP)
    train(writer, sgd(writer), STEPS_BEFORE, 0)
    dcp.save({"model": get_model_state_dict(writer)}, checkpoint_id=path)
    expected = full_state(writer)
    reader = make(FSDP, seed=1)
    state = {"model": get_model_state_dict(reader)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(reader, state["model"])
    after = full_state(reader)
    for key in expected:
        assert diff.relative_error(after[key], expected[key]) <= 1e-6, key


def test_get_and_set_state_dict_with_optimizer(tmp_path):
    run_on_ranks(distributed_state_dict_round_trip, 2, str(tmp_path / "ckpt"))


def test_get_and_set_state_dict_full_state_dict_options():
    run_on_ranks(distributed_state_dict_full_options, 2)


@needs_fsdp1
def test_fsdp1_get_state_dict_checkpoint_loads_into_ours(tmp_path):
    run_on_ranks(fsdp1_distributed_state_dict_to_ours, 2, str(tmp_path / "ckpt"))


# ---------------------------------------------------------------------------------------------
# LOCAL state dicts through DCP: every rank's piece is saved (ShardedTensor values, as FSDP1's)
# ---------------------------------------------------------------------------------------------

LOCAL = fsdp_compat.StateDictType.LOCAL_STATE_DICT


def local_dcp_round_trip(path: str, wrapper_name: str, use_orig_params: bool) -> int:
    """Save a trained model's LOCAL state dict with DCP, load it into a differently seeded model of
    the same shape: the number of elements that differ from the saved model afterwards."""
    wrapper_class = diff.TorchFSDP if wrapper_name == "fsdp1" else FSDP
    writer = make(wrapper_class, use_orig_params=use_orig_params)
    train(writer, sgd(writer), STEPS_BEFORE, 0)
    expected = full_state(writer)
    with state_dict_type(writer, LOCAL):
        dcp.save(writer.state_dict(), checkpoint_id=path)
    reader = make(wrapper_class, seed=1, use_orig_params=use_orig_params)
    with state_dict_type(reader, LOCAL):
        state = reader.state_dict()
        dcp.load(state, checkpoint_id=path)
        reader.load_state_dict(state)
    after = full_state(reader)
    assert list(after) == list(expected)
    return sum(int((after[key] != expected[key]).sum()) for key in expected)


@pytest.mark.parametrize("wrapper_name,use_orig_params", [
    # Not use_orig_params=True: there FSDP1's LOCAL dict (and so ours, which is FSDP1's) also holds each
    # parameter's plain per-rank view, and dcp.load fails on their differing sizes (README).
    ("ours", False), pytest.param("fsdp1", False, marks=needs_fsdp1)])
def test_local_state_dict_saved_with_dcp_loses_nothing(tmp_path, wrapper_name, use_orig_params):
    differing = run_on_ranks(local_dcp_round_trip, 2, str(tmp_path / "ckpt"), wrapper_name, use_orig_params)
    assert differing == [0, 0]
