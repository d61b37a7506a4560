"""``summon_full_params``, ``apply`` and the rest of the instance API (``fsdp_modules``,
``check_is_root``), side by side with the single-process reference and torch FSDP1.

FSDP1 is built with ``use_orig_params=True`` so its original parameters (and gradients) are
readable inside ``summon_full_params``; golden values in ``tests/golden/runtime_summon.json``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compat
import fsdp_compat.fully_sharded_data_parallel as fsdp_module
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.examples import Block, GPTConfig
from fsdp_compat.testing import distributed_test
from tests import differential as diff

GOLDEN = "runtime_summon"
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
FLAT = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _hybrid_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(diff.device().type, (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))


def _fsdp1_classes() -> list[type]:
    return [diff.TorchFSDP] if diff.HAVE_FSDP1 else []


def _build(wrapper_class, strategy: str = "FULL_SHARD", model: nn.Module | None = None, **kwargs) -> nn.Module:
    """``model`` (default: the seeded TinyGPT) wrapped per block, ``use_orig_params=True``."""
    is_fsdp1 = wrapper_class is diff.TorchFSDP
    if strategy in HYBRID:
        kwargs.setdefault("device_mesh", _hybrid_mesh())
    policy = diff.block_policy_torch() if is_fsdp1 else fsdp_compat.wrap.ModuleWrapPolicy({Block})
    if "mixed_precision" in kwargs and is_fsdp1:
        kwargs["mixed_precision"] = diff.torch_fsdp.MixedPrecision(**vars(kwargs["mixed_precision"]))
    return wrapper_class(model if model is not None else diff.make_model(),
                         sharding_strategy=fsdp_compat.ShardingStrategy[strategy], auto_wrap_policy=policy,
                         use_orig_params=True, **(diff.fsdp1_kwargs() if is_fsdp1 else {}), **kwargs)


def _shows_shards(params, strategy: str = "FULL_SHARD") -> bool:
    """What a model shows outside ``summon_full_params``: sharded DTensors (``dtensor_params=True``), or
    FSDP1's plain local shards, 1-D but under ``NO_SHARD`` (whose parameters keep their shapes)."""
    params = list(params)
    if fsdp_module.DTENSOR_PARAMS:
        return all(isinstance(p, DTensor) for p in params)
    return all(not isinstance(p, DTensor) and (p.dim() == 1 or strategy == "NO_SHARD") for p in params)


def _inside(model: nn.Module, wrapper_class=FSDP, **summon_kwargs) -> dict[str, torch.Tensor]:
    """Clean name -> a copy of what ``named_parameters()`` shows inside ``summon_full_params``."""
    with wrapper_class.summon_full_params(model, **summon_kwargs):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def _reference_params(model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    model = model if model is not None else diff.make_model()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _is_full(values: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Which matrix parameters are visible at their full shape. FSDP1 shows shards as 1-D views
    (a 1-D parameter lying wholly in one rank's shard then looks full), fsdp_compat as DTensors."""
    full_shapes = {name: p.shape for name, p in diff.make_model().named_parameters() if p.ndim > 1}
    return {name: not isinstance(t, DTensor) and t.shape == full_shapes[name]
            for name, t in values.items() if name in full_shapes}


@torch.no_grad()
def _halve_all(model: nn.Module) -> None:
    for param in model.parameters():
        param.mul_(0.5)


def _train_losses(model: nn.Module, steps: int = 2) -> list[float]:
    return diff.train(model, diff.make_optimizer("sgd", model.parameters()), steps)


# ---------------------------------------------------------------------------------------------
# Values, writeback, discard
# ---------------------------------------------------------------------------------------------


def _edit_then_train(wrapper_class, strategy: str, **kwargs) -> tuple[nn.Module, list[float]]:
    """Halve every parameter inside a writeback summon, scribble inside a discarded one, train.

    FSDP1 keeps edits made under ``writeback=False`` when it does not shard (``NO_SHARD``, one
    rank), as its docstring says; fsdp_compat discards them for every strategy.
    """
    model = _build(wrapper_class, strategy, **kwargs)
    with wrapper_class.summon_full_params(model):
        _halve_all(model)
    if wrapper_class is not FSDP and strategy == "NO_SHARD":
        return model, _train_losses(model)
    with wrapper_class.summon_full_params(model, writeback=False):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(7.0)
    return model, _train_losses(model)


def check_values_and_writeback(strategy: str, mixed_precision: bool) -> None:
    diff.quiet()
    extra = {"mixed_precision": fsdp_compat.MixedPrecision(param_dtype=torch.bfloat16)} if mixed_precision else {}
    model = _build(FSDP, strategy, **extra)
    inside = _inside(model)
    # Full precision values, clean names, the tied head still tied, exactly the reference's.
    diff.assert_close_dicts(inside, _reference_params(), rtol=0, what="inside vs reference")
    assert all(t.dtype == torch.float32 for t in inside.values())
    with FSDP.summon_full_params(model):
        assert model.head.weight is model.tok_emb.weight
    for fsdp1 in _fsdp1_classes():
        diff.assert_close_dicts(inside, _inside(_build(fsdp1, strategy, **extra), fsdp1), rtol=0,
                                what="inside vs FSDP1")

    model, losses = _edit_then_train(FSDP, strategy, **extra)
    if mixed_precision:
        return  # bf16 compute: training is compared with the reference in the mixed-precision tests
    reference = diff.make_model()
    _halve_all(reference)
    reference_losses = diff.train(reference, diff.make_optimizer("sgd", reference.parameters()), 2,
                                  sharded=False)
    diff.assert_close_lists(losses, reference_losses, what="losses after edits vs reference")
    diff.assert_close_dicts(diff.full_parameters(model), _reference_params(reference), what="params vs reference")
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("writeback", strategy), losses, lambda: _edit_then_train(diff.TorchFSDP, strategy)[1])


@pytest.mark.parametrize("strategy", FLAT)
@pytest.mark.parametrize("mixed_precision", [False, True])
@distributed_test(world_size=2)
def test_full_values_inside_writeback_keeps_edits_and_discard_drops_them(strategy, mixed_precision):
    check_values_and_writeback(strategy, mixed_precision)


@pytest.mark.parametrize("strategy", HYBRID)
@distributed_test(world_size=4)
def test_summon_with_hybrid_sharding(strategy):
    check_values_and_writeback(strategy, mixed_precision=False)
    # rank0_only means rank 0 of each shard group (global ranks 0 and 2), as FSDP1's ``rank``.
    model = _build(FSDP, strategy)
    visible = _is_full(_inside(model, rank0_only=True, writeback=False))
    assert all(visible.values()) == (dist.get_rank() % 2 == 0), visible
    for fsdp1 in _fsdp1_classes():
        assert _is_full(_inside(_build(fsdp1, strategy), fsdp1, rank0_only=True, writeback=False)) == visible


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@distributed_test(world_size=2)
def test_summon_between_forward_and_backward(strategy):
    """Allowed by FSDP1; the pending backward still gives the reference gradients."""
    diff.quiet()
    for wrapper_class in [FSDP, *_fsdp1_classes()]:
        model = _build(wrapper_class, strategy)
        loss = diff.loss_fn(model, *diff.local_batch(0))
        diff.assert_close_dicts(_inside(model, wrapper_class), _reference_params(), rtol=0)
        loss.backward()
        reference = diff.make_model()
        diff.loss_fn(reference, *diff.synthetic_batch(0, diff.GLOBAL_BATCH, GPTConfig(), diff.device())).backward()
        expected = {name: p.grad for name, p in reference.named_parameters()}
        diff.assert_close_dicts(diff.full_gradients(model), expected, what=f"grads ({wrapper_class.__module__})")


# ---------------------------------------------------------------------------------------------
# rank0_only, offload_to_cpu, with_grads
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload_to_cpu", [False, True])
@distributed_test(world_size=2)
def test_rank0_only_shows_full_parameters_on_rank_0_only(offload_to_cpu):
    diff.quiet()
    model = _build(FSDP)
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False, offload_to_cpu=offload_to_cpu):
        inside = dict(model.named_parameters())
        if dist.get_rank() == 0:
            diff.assert_close_dicts({n: p.detach() for n, p in inside.items()}, _reference_params(), rtol=0)
            assert all(p.device.type == "cpu" for p in inside.values()) or not offload_to_cpu
        else:
            assert _shows_shards(inside.values())  # still its shards
            assert not any(_is_full(inside).values())
    assert _shows_shards(model.parameters())
    if not offload_to_cpu:  # FSDP1's offload_to_cpu crashes on a CPU-only machine
        for fsdp1 in _fsdp1_classes():
            their_visible = _is_full(_inside(_build(fsdp1), fsdp1, rank0_only=True, writeback=False))
            assert their_visible == _is_full(inside)


@distributed_test(world_size=2)
def test_offload_to_cpu_gives_full_cpu_copies_on_every_rank():
    diff.quiet()
    model = _build(FSDP)
    with pytest.warns(UserWarning, match="rank0_only"):
        with FSDP.summon_full_params(model, offload_to_cpu=True):
            assert all(p.device.type == "cpu" and not isinstance(p, DTensor) for p in model.parameters())
            _halve_all(model)
    reference = diff.make_model()
    _halve_all(reference)
    diff.assert_close_dicts(diff.full_parameters(model), _reference_params(reference), rtol=0)


def _grads_inside_and_edited(wrapper_class, strategy: str) -> tuple[dict, dict]:
    """Gradients seen inside ``with_grads=True`` after one backward, and after doubling them inside."""
    model = _build(wrapper_class, strategy)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    with wrapper_class.summon_full_params(model, with_grads=True):
        seen = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        with torch.no_grad():
            for param in model.parameters():
                param.grad.mul_(2.0)
    return seen, diff.full_gradients(model)


@pytest.mark.parametrize("strategy", FLAT)
@distributed_test(world_size=2)
def test_with_grads_shows_and_writes_back_full_gradients(strategy):
    diff.quiet()
    seen, after = _grads_inside_and_edited(FSDP, strategy)
    reference = diff.make_model()
    diff.loss_fn(reference, *diff.synthetic_batch(0, diff.GLOBAL_BATCH, GPTConfig(), diff.device())).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    diff.assert_close_dicts(seen, expected, rtol=1e-6, what="grads inside vs reference")
    diff.assert_close_dicts(after, {n: 2 * g for n, g in expected.items()}, rtol=1e-6, what="edited grads")
    for fsdp1 in _fsdp1_classes():
        their_seen, their_after = _grads_inside_and_edited(fsdp1, strategy)
        diff.assert_close_dicts(seen, their_seen, rtol=1e-6, what="grads inside vs FSDP1")
        diff.assert_close_dicts(after, their_after, rtol=1e-6, what="edited grads vs FSDP1")


# How the gradients are summoned: writeback=True, writeback=False, or rank0_only (writeback=False).
GRAD_SUMMONS = {"writeback": {}, "discard": {"writeback": False}, "rank0_only": {"writeback": False, "rank0_only": True}}


def _double_grads_inside(wrapper_class, strategy: str, summon: str) -> dict[str, object]:
    """After one backward: the gradients seen inside ``with_grads=True``, doubled there in place;
    then the full gradients after, ``clip_grad_norm_``'s total norm and the parameters after an SGD step."""
    model = _build(wrapper_class, strategy)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    with wrapper_class.summon_full_params(model, with_grads=True, **GRAD_SUMMONS[summon]):
        # Under rank0_only (NO_SHARD only here) the other ranks see their whole replicated gradients.
        seen = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for name, p in model.named_parameters()}
        with torch.no_grad():
            for param in model.parameters():
                param.grad.mul_(2.0)
    after = diff.full_gradients(model)
    total = model.clip_grad_norm_(1e9).item()  # a bound no norm reaches: only the norm
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"seen": seen, "after": after, "total": total, "params": diff.full_parameters(model)}


def _persisted(run: dict[str, object]) -> bool:
    seen, after = run["seen"], run["after"]
    return all(torch.allclose(after[name], 2 * seen[name], rtol=1e-6) for name in seen)  # type: ignore[index]


@pytest.mark.parametrize("strategy,summon", [(strategy, summon) for strategy in FLAT for summon in
                                             ("writeback", "discard")] + [("NO_SHARD", "rank0_only")])
@distributed_test(world_size=2)
def test_gradient_edits_inside_with_grads_persist_where_fsdp1_keeps_them(strategy, summon):
    """FSDP1 keeps in-place gradient edits made inside ``summon_full_params(with_grads=True)`` with
    ``writeback=True``, and under ``NO_SHARD`` whatever ``writeback`` says (its gradients inside are
    the unit's own, on every rank also under ``rank0_only``); so do we, value by value: the
    gradients, ``clip_grad_norm_``, an optimizer step."""
    diff.quiet()
    ours = _double_grads_inside(FSDP, strategy, summon)
    assert _persisted(ours) == (summon == "writeback" or strategy == "NO_SHARD")
    theirs: dict[str, object] = {}

    def fsdp1() -> dict[str, object]:
        theirs.update(_double_grads_inside(diff.TorchFSDP, strategy, summon))
        return {"persisted": _persisted(theirs), "total": theirs["total"]}

    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("grad-edits", strategy, summon), fsdp1)
    assert _persisted(ours) == expected["persisted"]
    diff.assert_close_lists([ours["total"]], [expected["total"]], rtol=1e-6, what="clip_grad_norm_ vs FSDP1")
    if theirs:
        for what in ("after", "params"):
            diff.assert_close_dicts(ours[what], theirs[what], rtol=1e-6, what=f"{what} vs FSDP1")


def _assign_grads_inside(wrapper_class) -> bool:
    """Whether gradients assigned (not edited in place) inside ``with_grads=True`` are kept."""
    model = _build(wrapper_class)
    diff.loss_fn(model, *diff.local_batch(0)).backward()
    with wrapper_class.summon_full_params(model, with_grads=True):
        for param in model.parameters():
            param.grad = torch.full_like(param, 0.25)
    return all(torch.all(grad == 0.25) for grad in diff.full_gradients(model).values())


@distributed_test(world_size=2)
def test_gradients_assigned_inside_with_grads_are_kept_where_fsdp1_drops_them():
    """A deliberate difference: ``writeback=True`` keeps a gradient the user assigned inside (as it
    keeps an assigned parameter); FSDP1 silently restores its own gradient."""
    diff.quiet()
    assert _assign_grads_inside(FSDP)
    if diff.HAVE_FSDP1:
        assert not _assign_grads_inside(diff.TorchFSDP)


# ---------------------------------------------------------------------------------------------
# recurse=False, nesting, re-entry, misuse
# ---------------------------------------------------------------------------------------------


def _nesting_views(wrapper_class) -> dict[str, object]:
    model = _build(wrapper_class)
    views: dict[str, object] = {}
    with wrapper_class.summon_full_params(model, recurse=False):
        views["root only"] = _is_full(dict(model.named_parameters()))
        with wrapper_class.summon_full_params(model.blocks[0]):
            views["root and block 0"] = _is_full(dict(model.named_parameters()))
        for name, inner in [("same module again", model), ("inner recursively", model.blocks[1])]:
            try:
                with wrapper_class.summon_full_params(inner, recurse=name == "same module again"):
                    views[name] = "entered"
            except AssertionError:
                views[name] = "AssertionError"
    with wrapper_class.summon_full_params(model.blocks[1], recurse=False):
        try:
            with wrapper_class.summon_full_params(model):  # the outer call reaches block 1 again
                views["re-entry from outside"] = "entered"
        except AssertionError:
            views["re-entry from outside"] = "AssertionError"
    views["losses after"] = _train_losses(model)
    return views


@distributed_test(world_size=2)
def test_recurse_false_nesting_and_reentry_like_fsdp1():
    diff.quiet()
    views = _nesting_views(FSDP)
    root_own = {"tok_emb.weight", "pos_emb.weight"}  # the root unit's own matrices
    assert {n for n, full in views["root only"].items() if full} == root_own
    assert {n for n, full in views["root and block 0"].items() if full} == \
        root_own | {n for n in views["root only"] if n.startswith("blocks.0.")}
    assert views["same module again"] == "AssertionError"
    assert views["inner recursively"] == "entered"
    assert views["re-entry from outside"] == "AssertionError"
    reference = diff.make_model()
    diff.assert_close_lists(views["losses after"],
                            diff.train(reference, diff.make_optimizer("sgd", reference.parameters()), 2,
                                       sharded=False))
    for fsdp1 in _fsdp1_classes():
        theirs = _nesting_views(fsdp1)
        diff.assert_close_lists(views.pop("losses after"), theirs.pop("losses after"))
        assert theirs == views


MISUSE = {
    "rank0_only with writeback": ({"rank0_only": True, "writeback": True}, "FULL_SHARD"),
    "with_grads with offload_to_cpu": ({"with_grads": True, "offload_to_cpu": True}, "FULL_SHARD"),
    "offload_to_cpu with NO_SHARD": ({"offload_to_cpu": True}, "NO_SHARD"),
}


@pytest.mark.parametrize("case", list(MISUSE))
@distributed_test(world_size=2)
def test_combinations_fsdp1_rejects_raise_its_exception(case):
    diff.quiet()
    summon_kwargs, strategy = MISUSE[case]
    for wrapper_class in [FSDP, *_fsdp1_classes()]:
        model = _build(wrapper_class, strategy)
        with pytest.raises(NotImplementedError):
            with wrapper_class.summon_full_params(model, **summon_kwargs):
                pass
        assert not any(m.training_state.name == "SUMMON_FULL_PARAMS" for m in wrapper_class.fsdp_modules(model))


# Misuse inside an open summon_full_params: (what is summoned, the call made inside it).
MISUSE_INSIDE = {
    "apply on the root, root summoned": ("root", lambda cls, model: model.apply(_shape_dependent_init)),
    "apply on the root, block 0 summoned": ("block 0", lambda cls, model: model.apply(_shape_dependent_init)),
    "apply on block 0, root summoned": ("root", lambda cls, model: model.blocks[0].apply(_shape_dependent_init)),
    "summon the root again": ("root", lambda cls, model: cls.summon_full_params(model).__enter__()),
    "summon the root, block 1 summoned": ("block 1", lambda cls, model: cls.summon_full_params(model).__enter__()),
}


def _misuse_inside_summon(wrapper_class, case: str) -> dict:
    """The exception (type and message) of ``case``, and the losses of training afterwards."""
    model = _build(wrapper_class)
    diff.loss_fn(model, *diff.local_batch(0)).backward()  # FSDP1 cannot summon an inner unit before its lazy init
    model.zero_grad(set_to_none=True)
    summoned, call = MISUSE_INSIDE[case]
    target = {"root": model, "block 0": model.blocks[0], "block 1": model.blocks[1]}[summoned]
    error = None
    with wrapper_class.summon_full_params(target):
        try:
            call(wrapper_class, model)
        except Exception as raised:  # noqa: BLE001 - the type and text are what is compared
            error = raised
    return {"type": type(error).__name__, "message": str(error), "losses after": _train_losses(model)}


@pytest.mark.parametrize("case", list(MISUSE_INSIDE))
@distributed_test(world_size=2)
def test_misuse_inside_summon_raises_fsdp1_exception_and_text(case):
    """``apply`` inside ``summon_full_params`` raises FSDP1's ``ValueError`` ("expected to be in states
    [<TrainingState.IDLE: 1>] ..."), summoning an already summoned unit its ``AssertionError``; the
    model is left as it was (it then trains like the reference). Ours may explain after FSDP1's text."""
    diff.quiet()
    ours = _misuse_inside_summon(FSDP, case)
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("misuse-inside", case), lambda: {
        key: value for key, value in _misuse_inside_summon(diff.TorchFSDP, case).items() if key != "losses after"})
    assert ours["type"] == expected["type"]
    assert ours["message"].startswith(expected["message"]), (ours["message"], expected["message"])
    reference = diff.make_model()
    diff.assert_close_lists(ours["losses after"], diff.train(reference, diff.make_optimizer("sgd", reference.parameters()),
                                                             2, sharded=False))


def _summon_from_hook(wrapper_class, where: str) -> str:
    """What summoning from inside the forward or the backward raises."""
    model = _build(wrapper_class)

    def summon(*_):
        with wrapper_class.summon_full_params(model):
            pass

    block = model.blocks[0]
    handle = (block.register_forward_pre_hook(summon) if where == "forward"
              else block.register_full_backward_hook(summon))
    try:
        diff.loss_fn(model, *diff.local_batch(0)).backward()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return type(error).__name__
    finally:
        handle.remove()
    return "no error"


@pytest.mark.parametrize("where", ["forward", "backward"])
@distributed_test(world_size=2)
def test_summon_inside_forward_or_backward_raises_like_fsdp1(where):
    diff.quiet()
    assert _summon_from_hook(FSDP, where) == "AssertionError"
    for fsdp1 in _fsdp1_classes():
        assert _summon_from_hook(fsdp1, where) == "AssertionError"


@distributed_test(world_size=2)
def test_forward_inside_summon_raises_and_training_continues():
    """FSDP1 runs this forward but leaves its parameters resharded inside the open context and
    trains wrongly afterwards; fsdp_compat refuses it and stays correct."""
    diff.quiet()
    model = _build(FSDP)
    with FSDP.summon_full_params(model, writeback=False):
        with pytest.raises(AssertionError, match="summon_full_params"):
            model(diff.local_batch(0)[0])
    reference = diff.make_model()
    diff.assert_close_lists(_train_losses(model),
                            diff.train(reference, diff.make_optimizer("sgd", reference.parameters()), 2,
                                       sharded=False))


def _bf16_model(frozen: bool, strategy: str) -> nn.Module:
    """bf16 ``MixedPrecision``; ``frozen``: only the attention trains (LoRA's frozen base)."""
    inner = diff.make_model()
    for name, param in inner.named_parameters():
        param.requires_grad_(not frozen or ".attn." in name)
    mixed = fsdp_compat.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return _build(FSDP, strategy, model=inner, mixed_precision=mixed)


def _train_trainable(model: nn.Module, steps: int) -> list[float]:
    return diff.train(model, diff.make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad]), steps)


@pytest.mark.parametrize("strategy", FLAT)
@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "frozen-base"])
@distributed_test(world_size=2)
def test_inner_forward_inside_summon_runs_on_the_full_precision_parameters(frozen, strategy):
    """``model.module(...)`` inside the context (what ``generate`` on an HF model's ``.module``
    does) runs on the summoned full-precision parameters: no cast to ``param_dtype``, no
    all-gather over them, which stay registered; training afterwards is unaffected.

    Deliberately not FSDP1's behaviour: its inner units cast their inputs to ``param_dtype`` and
    re-gather low-precision parameters under the open context, which on CPU fails with "mixed
    dtype (CPU)" (checked side by side, torch 2.13).
    """
    diff.quiet()
    tokens = diff.local_batch(0)[0]
    model = _bf16_model(frozen, strategy)
    with FSDP.summon_full_params(model, writeback=False):
        summoned = [p for _, p in model.named_parameters()]
        logits = model.module(tokens)
        assert all(p is q for (_, p), q in zip(model.named_parameters(), summoned, strict=True))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, diff.make_model()(tokens), rtol=1e-6, atol=1e-6)
    assert _train_trainable(model, 2) == _train_trainable(_bf16_model(frozen, strategy), 2)


@distributed_test(world_size=2)
def test_names_inside_are_clean_like_fsdp1():
    diff.quiet()

    def names(wrapper_class) -> dict[str, list[str]]:
        model = _build(wrapper_class)
        result = {"params outside": [n for n, _ in model.named_parameters()]}
        with wrapper_class.summon_full_params(model):
            result["params inside"] = [n for n, _ in model.named_parameters()]
            result["buffers inside"] = [n for n, _ in model.named_buffers()]
        return result

    ours = names(FSDP)
    assert ours["params inside"] == [n for n, _ in diff.make_model().named_parameters()]
    assert all(n.startswith("_fsdp_wrapped_module.") for n in ours["params outside"])
    for fsdp1 in _fsdp1_classes():
        assert names(fsdp1) == ours


# ---------------------------------------------------------------------------------------------
# CPU offload and ignored modules
# ---------------------------------------------------------------------------------------------


def _ignored_ln_f(wrapper_class, cpu_offload: bool) -> tuple[nn.Module, nn.Module]:
    inner = diff.make_model()
    extra = {"cpu_offload": fsdp_compat.CPUOffload(offload_params=True)} if cpu_offload else {}
    return _build(wrapper_class, model=inner, ignored_modules=[inner.ln_f], **extra), inner


def _halve_inside_then_train(model: nn.Module, wrapper_class) -> list[float]:
    with wrapper_class.summon_full_params(model):
        _halve_all(model)
    return _train_losses(model)


@pytest.mark.parametrize("cpu_offload", [False, True])
@distributed_test(world_size=2)
def test_summon_with_cpu_offload_and_ignored_modules(cpu_offload):
    """Ignored parameters are not averaged over ranks, so training is compared with FSDP1 (or,
    with CPU offload, which FSDP1 cannot do on a CPU-only machine, with our run without it)."""
    diff.quiet()
    model, inner = _ignored_ln_f(FSDP, cpu_offload)
    ignored = inner.ln_f.weight
    with FSDP.summon_full_params(model):
        assert inner.ln_f.weight is ignored  # ignored parameters stay as they are
        diff.assert_close_dicts({n: p.detach() for n, p in model.named_parameters()}, _reference_params(), rtol=0)
    losses = _halve_inside_then_train(model, FSDP)
    assert inner.ln_f.weight is ignored
    if cpu_offload:
        assert all(p.device.type == "cpu" for p in model.parameters())
        diff.assert_close_lists(losses, _halve_inside_then_train(_ignored_ln_f(FSDP, False)[0], FSDP))
        return
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("ignored_ln_f"), losses,
                 lambda: _halve_inside_then_train(_ignored_ln_f(diff.TorchFSDP, False)[0], diff.TorchFSDP))


# ---------------------------------------------------------------------------------------------
# apply, fsdp_modules, check_is_root
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def _shape_dependent_init(module: nn.Module) -> None:
    """Needs full parameters: each Linear weight becomes a ramp over its full shape."""
    if isinstance(module, nn.Linear):
        ramp = torch.arange(module.weight.numel(), dtype=module.weight.dtype, device=module.weight.device)
        module.weight.copy_((ramp / ramp.numel() - 0.5).view_as(module.weight) * 0.1)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@distributed_test(world_size=2)
def test_apply_runs_on_full_parameters_and_keeps_the_result(strategy):
    diff.quiet()
    model = _build(FSDP, strategy)
    assert model.apply(_shape_dependent_init) is model
    assert _shows_shards(model.parameters(), strategy)
    reference = diff.make_model().apply(_shape_dependent_init)
    diff.assert_close_dicts(diff.full_parameters(model), _reference_params(reference), rtol=0)
    losses = _train_losses(model)
    diff.assert_close_lists(losses, diff.train(reference, diff.make_optimizer("sgd", reference.parameters()), 2,
                                               sharded=False))

    def fsdp1() -> list[float]:
        theirs = _build(diff.TorchFSDP, strategy)
        theirs.apply(_shape_dependent_init)
        return _train_losses(theirs)
    diff.check_against_fsdp1(GOLDEN, diff.golden_key("apply", strategy), losses, fsdp1)


@distributed_test(world_size=2)
def test_fsdp_modules_and_check_is_root_like_fsdp1():
    diff.quiet()

    def surface(wrapper_class) -> dict[str, list]:
        model = _build(wrapper_class)
        diff.loss_fn(model, *diff.local_batch(0)).backward()  # FSDP1 settles roots lazily
        units = wrapper_class.fsdp_modules(model)
        return {"units": [type(u.module).__name__.replace("FSDP", "") for u in units],
                "roots": [type(u.module).__name__.replace("FSDP", "") for u in wrapper_class.fsdp_modules(model, root_only=True)],
                "is root": [u.check_is_root() for u in units],
                "module is the wrapped module": [u.module is u._fsdp_wrapped_module for u in units]}

    ours = surface(FSDP)
    assert ours["units"] == ["TinyGPT", "Block", "Block"] and ours["is root"] == [True, False, False]
    for fsdp1 in _fsdp1_classes():
        assert surface(fsdp1) == ours
