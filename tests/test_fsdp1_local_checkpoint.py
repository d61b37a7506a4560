"""torch FSDP1's LOCAL_STATE_DICT checkpoints (flat parameters): written by fsdp_compat as FSDP1
writes them (so FSDP1 resumes them), loaded under LOCAL_STATE_DICT, refused with a ValueError on
every rank when world size or wrapping differ, and converted by ``fsdp_compat.convert`` into FULL /
DCP checkpoints that load at another world size. fsdp_compat's earlier per-parameter LOCAL format
still loads.

The oracle is FSDP1's own reading of the same checkpoint (``summon_full_params`` after loading
it) and FSDP1's own LOCAL state dict of the same values: live when torch ships FSDP1, else the
golden files written by ``tests/fsdp1_local_golden.py`` (world size 2, both ``use_orig_params``
values). Values must match bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.convert import convert_local_checkpoint
from fsdp_compat.testing import distributed_test, run_on_ranks
from fsdp_compat.wrap import ModuleWrapPolicy
from tests import differential as diff
from tests import earlier_local_golden as earlier
from tests import fsdp1_local_golden as golden

LOCAL = fsdp_compat.StateDictType.LOCAL_STATE_DICT
FULL = fsdp_compat.StateDictType.FULL_STATE_DICT
SHARDED = fsdp_compat.StateDictType.SHARDED_STATE_DICT
ROOT = Path(__file__).parent.parent

needs_fsdp1 = pytest.mark.skipif(not diff.HAVE_FSDP1, reason="needs torch FSDP1")


def ours(use_orig_params: bool = False, unit_classes=golden.UNIT_CLASSES, **kwargs) -> FSDP:
    """A fresh (seed 1) OddNet wrapped by fsdp_compat into the golden checkpoints' units."""
    model = golden.make_model(seed=1).to(diff.device())
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy(set(unit_classes)), ignored_modules=[model.side],
                use_orig_params=use_orig_params, **kwargs)


def load_local(model: FSDP, state_dict: dict) -> None:
    with FSDP.state_dict_type(model, LOCAL):
        model.load_state_dict(state_dict)


def golden_rank_file(use_orig_params: bool) -> dict:
    ranks, _ = golden.golden_paths(use_orig_params)
    return golden.load_local_file(ranks[dist.get_rank()])


def golden_expected(use_orig_params: bool) -> dict[str, torch.Tensor]:
    return torch.load(golden.golden_paths(use_orig_params)[1], weights_only=True)


def assert_bit_for_bit(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert set(actual) == set(expected), f"{what}: keys differ: {set(actual) ^ set(expected)}"
    for key, value in expected.items():
        assert torch.equal(actual[key].cpu(), value), f"{what}: {key} differs"


def assert_computes_with(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    """The wrapped model's forward is the plain model's with ``expected`` loaded (it uses them)."""
    plain = golden.make_model(seed=2)
    plain.load_state_dict(expected | {"head.weight": expected["emb.weight"]})  # tied: listed once
    tokens = torch.arange(golden.VOCAB).reshape(1, -1) % golden.VOCAB
    with torch.no_grad():
        torch.testing.assert_close(model(tokens.to(diff.device())).cpu(), plain(tokens))


# ---------------------------------------------------------------------------------------------
# golden checkpoints (written by torch FSDP1; these tests run without it)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loader_uop", [False, True])
@pytest.mark.parametrize("writer_uop", [False, True])
@distributed_test(world_size=2)
def test_golden_fsdp1_local_checkpoint_loads_bit_for_bit(writer_uop, loader_uop):
    """Whatever use_orig_params either side has (it only changes FSDP1's padding)."""
    model = ours(use_orig_params=loader_uop)
    load_local(model, golden_rank_file(writer_uop))
    expected = golden_expected(writer_uop)
    assert_bit_for_bit(diff.model_state(model), expected, f"golden uop={writer_uop}")
    assert_computes_with(model, expected)


def assert_raises_everywhere_and_changes_nothing(model: FSDP, state_dict: dict, *fragments: str) -> str:
    before = diff.model_state(model)
    with pytest.raises(ValueError) as raised:
        load_local(model, state_dict)
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, message
    assert_bit_for_bit(diff.model_state(model), before, "after a refused load")
    return message


@distributed_test(world_size=2)
def test_other_wrapping_raises_on_every_rank_and_changes_nothing():
    model = ours(unit_classes=(golden.Outer, golden.Gate))  # inner's parameters now in outer's unit
    message = assert_raises_everywhere_and_changes_nothing(
        model, golden_rank_file(False), "'outer._flat_param'", "'outer'", "flat size is 30 in shards of 15",
        "lays out 48", "save it as FULL_STATE_DICT or SHARDED_STATE_DICT")
    assert "'outer.inner._flat_param'" in message, message  # a unit the model no longer has


@pytest.mark.parametrize("writer_uop", [False, True])
@distributed_test(world_size=2)
def test_one_rank_shard_groups_raise_on_every_rank_and_change_nothing(writer_uop):
    """Written sharded over 2 ranks, loaded into hybrid sharding over one-rank groups (2 replicas),
    which is ``NO_SHARD`` as in FSDP1: no unit has a flat parameter to load."""
    mesh = init_device_mesh(diff.device().type, (2, 1))
    model = ours(sharding_strategy=fsdp_compat.ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    assert_raises_everywhere_and_changes_nothing(model, golden_rank_file(writer_uop), "no sharded unit 'gate'",
                                                 "do not match", "save it as FULL_STATE_DICT")


@distributed_test(world_size=2)
def test_misfit_on_one_rank_raises_on_every_rank():
    model = ours()
    state_dict = golden_rank_file(False)
    if dist.get_rank() == 1:
        state_dict.pop("gate._flat_param")
    expected = "'gate'" if dist.get_rank() == 1 else "rank(s) [1]"
    assert_raises_everywhere_and_changes_nothing(model, state_dict, expected)


# ---------------------------------------------------------------------------------------------
# fsdp_compat's LOCAL state dicts are FSDP1's, so that FSDP1 resumes them
# ---------------------------------------------------------------------------------------------


def ours_holding(values: dict[str, torch.Tensor], use_orig_params: bool, strategy: str = "FULL_SHARD",
                 **kwargs) -> FSDP:
    """:func:`ours` with ``values`` loaded (FULL)."""
    model = ours(use_orig_params, sharding_strategy=getattr(fsdp_compat.ShardingStrategy, strategy), **kwargs)
    with FSDP.state_dict_type(model, FULL):
        model.load_state_dict(values | {"head.weight": values["emb.weight"]})
    return model


def our_local_state_dict(model: FSDP) -> dict:
    with FSDP.state_dict_type(model, LOCAL):
        return model.state_dict()


def assert_same_local_state_dict(actual: dict, expected: dict) -> None:
    """Same keys in the same order, same value kinds, FSDP1's ShardedTensor metadata, equal bytes."""
    assert list(actual) == list(expected)
    for key, value in expected.items():
        theirs, ours_value = value, actual[key]
        assert type(ours_value) is type(theirs), key
        if type(theirs).__name__ == "ShardedTensor":
            assert ours_value.metadata() == theirs.metadata(), key
            assert [s.metadata for s in ours_value.local_shards()] == [s.metadata for s in theirs.local_shards()], key
            pairs = [(a.tensor, b.tensor) for a, b in zip(ours_value.local_shards(), theirs.local_shards())]
        else:
            pairs = [(ours_value, theirs)]
        for a, b in pairs:
            assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad), key
            assert torch.equal(a.cpu(), b.cpu()), key


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=2)
def test_local_state_dict_is_fsdp1s_byte_for_byte(use_orig_params, strategy):
    """Holding the values of the golden FSDP1 checkpoint, our LOCAL state dict is that checkpoint: one
    ``<unit>._flat_param`` ShardedTensor per unit (FSDP1's padding and metadata), buffers and the ignored
    module's parameters plain, with ``use_orig_params=True`` FSDP1's per-parameter views, in FSDP1's key
    order. (FSDP1 writes the same for both strategies.)"""
    model = ours_holding(golden_expected(use_orig_params), use_orig_params, strategy)
    assert_same_local_state_dict(our_local_state_dict(model), golden_rank_file(use_orig_params))


@distributed_test(world_size=2)
def test_local_state_dict_with_a_device_mesh_is_fsdp1s_without_one():
    """FSDP1 refuses LOCAL with a device mesh; ours writes what FSDP1 writes for the same sharding given as a
    process group, which FSDP1 built that way resumes. (Likewise over HYBRID_SHARD's shard groups.)"""
    model = ours_holding(golden_expected(False), False, device_mesh=init_device_mesh(diff.device().type, (2,)))
    assert_same_local_state_dict(our_local_state_dict(model), golden_rank_file(False))


# fault name -> (how rank 1 corrupts its dict, the exception every rank raises)
LOCAL_FAULTS = {
    "empty": (lambda sd: sd.clear(), ValueError),  # in no format at all: it must still not go it alone
    "unexpected_key": (lambda sd: sd.__setitem__("extra.weight", torch.zeros(2)), RuntimeError),
    "wrong_buffer_shape": (lambda sd: sd.__setitem__("offset", torch.zeros(3)), RuntimeError),
}


@pytest.mark.parametrize("fault", sorted(LOCAL_FAULTS))
@distributed_test(world_size=2)
def test_bad_local_input_on_one_rank_raises_everywhere_and_loads_nowhere(fault):
    """Loading our LOCAL dicts (FSDP1's format) is collective: bad input on one rank raises on every rank,
    none left waiting, and nothing is loaded anywhere."""
    state_dict = our_local_state_dict(ours_holding(golden_expected(False), False))
    corrupt, error_type = LOCAL_FAULTS[fault]
    if dist.get_rank() == 1:
        corrupt(state_dict)
    model = ours()
    before = diff.model_state(model)
    with pytest.raises(error_type) as raised:
        load_local(model, state_dict)
    assert dist.get_rank() == 1 or "rank(s) [1]" in str(raised.value), raised.value
    assert_bit_for_bit(diff.model_state(model), before, "after a refused load")


def fsdp1_resumes_ours(path: str, strategy: str, use_orig_params: bool) -> None:
    """mmengine's flow (its FSDPStrategy's default ``state_dict_cfg='local'``): ``model.state_dict()``
    under LOCAL_STATE_DICT, ``torch.save`` per rank; FSDP1, wrapped as we were, resumes it (in memory and
    from the files) with the ``strict`` that it loads its own LOCAL files with."""
    expected = golden_expected(use_orig_params)
    state_dict = our_local_state_dict(ours_holding(expected, use_orig_params, strategy))
    rank_path = path.format(rank=dist.get_rank())
    torch.save(state_dict, rank_path)
    for incoming in (state_dict, golden.load_local_file(rank_path)):
        fsdp1 = golden.fsdp1_wrap(golden.make_model(1), use_orig_params, strategy)
        assert_bit_for_bit(golden.fsdp1_full_values(fsdp1, incoming), expected, f"FSDP1 {strategy}")
        assert_computes_with(fsdp1, expected)
    if use_orig_params:  # FSDP1 refuses its own such dicts under strict=True, and ours alike
        for incoming in (state_dict, golden_rank_file(True)):
            fsdp1 = golden.fsdp1_wrap(golden.make_model(1), use_orig_params, strategy)
            with diff.TorchFSDP.state_dict_type(fsdp1, diff.torch_fsdp.StateDictType.LOCAL_STATE_DICT):
                with pytest.raises(RuntimeError, match="Unexpected key.*_flat_param"):
                    fsdp1.load_state_dict(incoming)


@needs_fsdp1
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_resumes_our_local_checkpoint(tmp_path, strategy, use_orig_params):
    run_on_ranks(fsdp1_resumes_ours, 2, str(tmp_path / "local_rank{rank}.pt"), strategy, use_orig_params)


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed_test(world_size=2)
def test_earlier_per_parameter_local_checkpoint_still_loads(use_orig_params):
    """fsdp_compat's LOCAL files before it wrote FSDP1's format (each parameter's ``torch.chunk`` piece
    as a ShardedTensor) load as before, into either ``use_orig_params``."""
    model = ours(use_orig_params)
    load_local(model, golden.load_local_file(earlier.rank_path(dist.get_rank())))
    assert_bit_for_bit(diff.model_state(model), earlier.expected_values(), "earlier format")


@distributed_test(world_size=2)
def test_earlier_local_dcp_checkpoint_loads_as_sharded():
    """Through ``torch.distributed.checkpoint`` the earlier LOCAL format is a SHARDED checkpoint (same
    keys and pieces): the SHARDED recipe loads it."""
    model = ours()
    with FSDP.state_dict_type(model, SHARDED):
        state_dict = model.state_dict()
        dcp.load(state_dict, checkpoint_id=str(earlier.EARLIER_LOCAL_DIR / "dcp"))
        model.load_state_dict(state_dict)
    assert_bit_for_bit(diff.model_state(model), earlier.expected_values(), "earlier format through DCP")


# ---------------------------------------------------------------------------------------------
# the converter
# ---------------------------------------------------------------------------------------------


def convert_golden(output: str, output_format: str, use_orig_params: bool) -> None:
    ranks, _ = golden.golden_paths(use_orig_params)
    pattern = str(ranks[0]).replace("rank0", "rank{rank}")
    convert_local_checkpoint(golden.make_model(seed=1), pattern, output, output_format=output_format,
                             ignored_modules=["side"])


def load_converted(output: str, output_format: str, use_orig_params: bool) -> None:
    model = ours()
    if output_format == "full":
        with FSDP.state_dict_type(model, FULL):
            model.load_state_dict(torch.load(output, weights_only=True))
    else:
        with FSDP.state_dict_type(model, SHARDED):
            state_dict = model.state_dict()
            dcp.load(state_dict, checkpoint_id=output)
            model.load_state_dict(state_dict)
    assert_bit_for_bit(diff.model_state(model), golden_expected(use_orig_params), f"converted {output_format}")


@pytest.mark.parametrize("output_format", ["full", "dcp"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_converter_output_loads_at_another_world_size(tmp_path, output_format, use_orig_params):
    output = str(tmp_path / ("model.pt" if output_format == "full" else "model_dcp"))
    run_on_ranks(convert_golden, 2, output, output_format, use_orig_params)
    run_on_ranks(load_converted, 3, output, output_format, use_orig_params)
    if output_format == "full":  # and into the plain model
        plain = golden.make_model(seed=1)
        plain.load_state_dict(torch.load(output, weights_only=True))
        state = {k: v for k, v in plain.state_dict().items() if k != "head.weight"}  # tied: twice
        assert_bit_for_bit(state, golden_expected(use_orig_params), "plain model")


def test_convert_command_line(tmp_path):
    """``python -m fsdp_compat.convert`` under torchrun, with the checkpoint's world size."""
    ranks, expected_path = golden.golden_paths(True)
    output = tmp_path / "model.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "fsdp_compat.convert", "--model", "tests.fsdp1_local_golden:make_model",
               "--checkpoint", str(ranks[0]).replace("rank0", "rank{rank}"), "--output", str(output),
               "--ignored-modules", "side"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote {output} (full)" in done.stdout
    converted = torch.load(output, weights_only=True)
    converted.pop("head.weight")  # the tied weight, under both names in a state dict
    assert_bit_for_bit(converted, torch.load(expected_path, weights_only=True), "command line")


# ---------------------------------------------------------------------------------------------
# live against torch FSDP1: sharding strategies, mixed-precision alignment
# ---------------------------------------------------------------------------------------------


def fsdp1_writes_and_reads(path: str, strategy: str, use_orig_params: bool, steps: int = 2, **kwargs) -> dict:
    """FSDP1 trains, saves each rank's LOCAL file, and reads it back into a fresh model."""
    writer = golden.fsdp1_wrap(golden.make_model(0), use_orig_params, strategy, **kwargs)
    golden.train(writer, steps)
    rank_path = path.format(rank=dist.get_rank())
    torch.save(golden.fsdp1_local_state_dict(writer), rank_path)
    dist.barrier()
    reader = golden.fsdp1_wrap(golden.make_model(1), use_orig_params, strategy, **kwargs)
    return golden.fsdp1_full_values(reader, golden.load_local_file(rank_path))


def load_what_fsdp1_wrote(path: str, strategy: str, use_orig_params: bool) -> None:
    expected = fsdp1_writes_and_reads(path, strategy, use_orig_params)
    model = ours(use_orig_params, sharding_strategy=getattr(fsdp_compat.ShardingStrategy, strategy))
    load_local(model, golden.load_local_file(path.format(rank=dist.get_rank())))
    assert_bit_for_bit(diff.model_state(model), expected, f"{strategy} uop={use_orig_params}")
    assert_computes_with(model, expected)


@needs_fsdp1
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_loads_what_fsdp1_wrote_bit_for_bit(tmp_path, strategy, use_orig_params):
    run_on_ranks(load_what_fsdp1_wrote, 2, str(tmp_path / "local_rank{rank}.pt"), strategy, use_orig_params)


def load_mixed_precision_checkpoint(path: str) -> None:
    """FSDP1 aligns to 16 bytes of MixedPrecision.param_dtype (8 bf16 elements, not 4 fp32)."""
    policy = diff.torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16)
    # No training: the ignored module would get bf16 inputs. Seed 0's values are not the reader's.
    expected = fsdp1_writes_and_reads(path, "FULL_SHARD", True, steps=0, mixed_precision=policy)
    state_dict = golden.load_local_file(path.format(rank=dist.get_rank()))
    for mixed_precision in (fsdp_compat.MixedPrecision(param_dtype=torch.bfloat16), None):
        model = ours(True, mixed_precision=mixed_precision)
        load_local(model, state_dict)
        assert_bit_for_bit(diff.model_state(model), expected, f"mixed_precision={mixed_precision}")


@needs_fsdp1
def test_loads_fsdp1_mixed_precision_alignment(tmp_path):
    run_on_ranks(load_mixed_precision_checkpoint, 2, str(tmp_path / "local_rank{rank}.pt"))


def test_golden_local_checkpoints_are_small():
    files = list(golden.GOLDEN_LOCAL_DIR.iterdir())
    assert len(files) == 6 and sum(p.stat().st_size for p in files) < 64_000
    files = [path for path in earlier.EARLIER_LOCAL_DIR.rglob("*") if path.is_file()]
    assert len(files) == 5 and sum(p.stat().st_size for p in files) < 64_000
