"""More FSDP1 frameworks through the switch (``fsdp_compat.patch_torch()``), as in-repo reproductions of
their call patterns (none of them is a dependency):

* mmengine: ``MMFullyShardedDataParallel`` subclasses torch's FSDP1 class at import; its ``FSDPStrategy``
  builds it from a registry, sets the state-dict type through the instance, accumulates with ``no_sync``
  and checkpoints with ``FSDP.optim_state_dict``.
* Composer: binds torch's class at import, wraps with it, tunes FSDP1's ``_exec_order_data`` prefetch
  limits (warning when they are missing) and checkpoints through torch's
  ``torch.distributed.checkpoint.state_dict`` API.
* OLMo's local sharded checkpointer: walks the root's ``_all_handles`` and saves / restores each
  handle's ``flat_param`` with its metadata.

Each runs with the switch applied before the framework's import (its module source is executed after
``patch_torch()``) and after it (executed before). FSDP1's own refusals that these frameworks meet are
pinned at the end.
"""

from __future__ import annotations

import contextlib
import copy
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel as FSDP
from fsdp_compat.testing import device, distributed_test, run_on_ranks
from tests import differential as diff

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = "switch_frameworks"
needs_fsdp1 = pytest.mark.skipif(not diff.HAVE_FSDP1, reason="subclasses torch's FSDP1 class")
ORDERS = ["switch_before_import", "switch_after_import"]


@contextlib.contextmanager
def framework(name: str, source: str, order: str) -> Iterator[types.ModuleType]:
    """The switch on for the block, and the framework module ``name`` (``source``) imported before or
    after it; both undone afterwards (these processes are shared by other tests)."""
    if not diff.HAVE_FSDP1:  # as tests/test_patch.py
        pytest.skip("the switch rebinds torch's FSDP1 names; torch has none here (FSDP_COMPAT_WITHOUT_FSDP1)")
    module = types.ModuleType(name)
    sys.modules[name] = module
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the late switch names the framework's references: pinned elsewhere
            if order == "switch_after_import":
                exec(source, module.__dict__)
            with fsdp_compat.torch_patched():
                if order == "switch_before_import":
                    exec(source, module.__dict__)
                yield module
    finally:
        del sys.modules[name]


def linear_policy():
    """A unit per ``nn.Linear``, with torch's policy class as frameworks pass it (ours without FSDP1)."""
    return (diff.torch_wrap or fsdp_compat.wrap).ModuleWrapPolicy({nn.Linear})


def linear_stack(seed: int = 0, layers: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))).to(device())


def batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 8, generator=generator).to(device())


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    with FSDP.summon_full_params(model):
        return {diff.clean_name(name): param.detach().clone() for name, param in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# mmengine: a subclass of FSDP1's class
# ---------------------------------------------------------------------------------------------

MMENGINE_SOURCE = '''
import torch
import torch.nn as nn
from torch.distributed.fsdp.api import ShardingStrategy, StateDictType
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel

MODEL_WRAPPERS = {}


class MMFullyShardedDataParallel(FullyShardedDataParallel):
    """mmengine's pattern: string arguments parsed, an attribute set before FSDP's ``__init__``,
    ``use_orig_params=True`` by default, and a ``train_step`` of its own."""

    def __init__(self, module, sharding_strategy=None, use_orig_params=True, **kwargs):
        if isinstance(sharding_strategy, str):
            sharding_strategy = ShardingStrategy[sharding_strategy]
        self._auto_ignored_modules = []
        super().__init__(module=module, sharding_strategy=sharding_strategy, use_orig_params=use_orig_params,
                         **kwargs)

    def train_step(self, data, optimizer, accumulate):
        loss = self(data).square().mean()
        if accumulate:
            with self.no_sync():
                loss.backward()
            return loss.detach()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()


MODEL_WRAPPERS["MMFullyShardedDataParallel"] = MMFullyShardedDataParallel
FSDP = FullyShardedDataParallel


def wrap_model(model, **config):
    """``FSDPStrategy._wrap_model``: built from the registry, state-dict type set through the instance."""
    wrapped = MODEL_WRAPPERS[config.pop("type", "MMFullyShardedDataParallel")](module=model, **config)
    wrapped.set_state_dict_type(wrapped, StateDictType.FULL_STATE_DICT)
    return wrapped


def optim_state_dict(model, optimizer):
    return FSDP.optim_state_dict(model, optimizer)
'''


def train_like_mmengine(model: nn.Module, optimizer: torch.optim.Optimizer, train_step) -> list[float]:
    """Two optimizer steps, each accumulating two micro-batches (the first inside ``no_sync``)."""
    return [train_step(model, batch(step), optimizer, step % 2 == 0).item() for step in range(4)]


def mmengine_flow(order: str) -> None:
    policy = linear_policy()
    with framework("fake_mmengine", MMENGINE_SOURCE, order) as mmengine:
        subclass = mmengine.MMFullyShardedDataParallel
        model = mmengine.wrap_model(linear_stack(), sharding_strategy="FULL_SHARD", auto_wrap_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = train_like_mmengine(model, optimizer, subclass.train_step)
        optim_state = mmengine.optim_state_dict(model, optimizer)
    # It is the subclass, and fsdp_compat's class all through: no FSDP1 class, code or unit in it.
    assert isinstance(model, subclass) and type(model).__name__ == "MMFullyShardedDataParallel"
    assert isinstance(model, FSDP) and diff.TorchFSDP not in type(model).__mro__
    assert all(not isinstance(module, diff.TorchFSDP) for module in model.modules())
    assert [type(unit) for unit in FSDP.fsdp_modules(model)][1:] == [FSDP] * 4  # children: FSDP1 builds its own class
    assert set(optim_state["state"]) == {f"{i}.{kind}" for i in range(4) for kind in ("weight", "bias")}
    # The same training with fsdp_compat's class directly: the same numbers.
    reference = FSDP(linear_stack(), auto_wrap_policy=policy, use_orig_params=True)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = train_like_mmengine(reference, reference_optimizer, subclass.train_step)
    assert losses == expected
    for name, value in full_params(reference).items():
        assert torch.equal(full_params(model)[name], value), name


@needs_fsdp1
@pytest.mark.parametrize("order", ORDERS)
def test_mmengine_subclass_builds_fsdp_compats_class(order):
    run_on_ranks(mmengine_flow, 2, order)


def late_subclass_is_torchs_again_once_switched_off() -> None:
    with framework("fake_mmengine_off", MMENGINE_SOURCE, "switch_after_import") as mmengine:
        ours = mmengine.MMFullyShardedDataParallel(linear_stack(layers=1))
    torchs = mmengine.MMFullyShardedDataParallel(linear_stack(layers=1), device_id=device())
    assert diff.TorchFSDP not in type(ours).__mro__ and isinstance(ours, FSDP)
    assert type(torchs) is mmengine.MMFullyShardedDataParallel and isinstance(torchs, diff.TorchFSDP)


@needs_fsdp1
def test_late_subclass_builds_torchs_class_once_switched_off():
    run_on_ranks(late_subclass_is_torchs_again_once_switched_off, 2)


@needs_fsdp1
def test_late_switch_names_the_subclasses_defined_before_it():
    module = types.ModuleType("fake_mmengine_warned")
    sys.modules[module.__name__] = module
    try:
        exec(MMENGINE_SOURCE, module.__dict__)
        with pytest.warns(UserWarning, match=r"after \['fake_mmengine_warned.MMFullyShardedDataParallel'\] "
                                             r"subclassed torch's FSDP1 class"):
            with fsdp_compat.torch_patched():
                pass
    finally:
        del sys.modules[module.__name__]


MAIN_SCRIPT = '''
import os, sys, warnings
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel


class Trainer(FullyShardedDataParallel):  # defined in __main__, before the switch
    def step(self, x):
        with self.no_sync():
            self(x).sum().backward()
        self(x).sum().backward()


dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
import fsdp_compat
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fsdp_compat.patch_torch()
model = Trainer(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), auto_wrap_policy=lambda module, recurse,
                nonwrapped_numel: isinstance(module, nn.Linear), use_orig_params=True)
model.step(torch.ones(3, 4))
torch_class = fsdp_compat.patch.TORCH_FSDP1_CLASS
print(type(model).__name__, isinstance(model, Trainer), torch_class in type(model).__mro__,
      any("__main__.Trainer" in str(w.message) for w in caught), all(p.grad is not None for p in model.parameters()))
'''


@needs_fsdp1
def test_subclass_defined_in_main_before_the_switch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["Trainer", "True", "False", "True", "True"]


# ---------------------------------------------------------------------------------------------
# Composer: prefetch limits and torch's state-dict API
# ---------------------------------------------------------------------------------------------

COMPOSER_SOURCE = '''
import warnings
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FullyShardedDataParallel


def prepare_fsdp_module(model, policy, forward_prefetch_limit=1, backward_prefetch_limit=1):
    """Composer's ``prepare_fsdp_module``: wrap, then tune FSDP1's prefetch limits on the root."""
    fsdp_obj = FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                        forward_prefetch=True)
    if hasattr(fsdp_obj, "_exec_order_data"):
        if hasattr(fsdp_obj._exec_order_data, "_forward_prefetch_limit"):
            fsdp_obj._exec_order_data._forward_prefetch_limit = forward_prefetch_limit
        else:
            warnings.warn("FSDP._exec_order_data does not have attribute _forward_prefetch_limit which is "
                          "unexpected. Please open an issue to Composer to report this.")
        if hasattr(fsdp_obj._exec_order_data, "_backward_prefetch_limit"):
            fsdp_obj._exec_order_data._backward_prefetch_limit = backward_prefetch_limit
        else:
            warnings.warn("FSDP._exec_order_data does not have attribute _backward_prefetch_limit which is "
                          "unexpected. Please open an issue to Composer to report this.")
    return fsdp_obj


def save(model, optimizer):
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {"model": get_model_state_dict(model, options=options),
            "optimizers": get_optimizer_state_dict(model, optimizer, options=options)}


def load(model, optimizer, state):
    options = StateDictOptions(full_state_dict=True, cpu_offload=False, strict=True)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, optimizer, state["optimizers"], options=options)
'''




def gathers_ahead(order: str, forward_limit: int, backward_limit: int) -> tuple[int, int, list[float]]:
    """All-gathers before the first layer's forward and between the last two layers' backward, in a
    step after the first (which records the order), and the losses."""
    with framework("fake_composer_prefetch", COMPOSER_SOURCE, order) as composer:
        layers = linear_stack(layers=5)
        inner = list(layers)  # hooks on the layers themselves run after their unit's all-gather
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Composer's "unexpected" warnings among them
            model = composer.prepare_fsdp_module(layers, linear_policy(), forward_limit,
                                                 backward_limit)
        losses = []
        events: list[str] = []
        for step in range(3):
            if step == 2:
                for i, layer in enumerate(inner):
                    layer.register_forward_pre_hook(lambda *_, i=i: events.append(f"forward {i}"))
                    layer.register_full_backward_pre_hook(lambda *_, i=i: events.append(f"backward {i}"))
            with diff.AllGatherLog(events) if step == 2 else contextlib.nullcontext():
                loss = model(batch(step)).square().mean()
                loss.backward()
            losses.append(loss.item())
    backward = events[events.index("backward 4"):events.index("backward 3")]
    return events.index("forward 0"), backward.count("all-gather"), losses


@pytest.mark.parametrize("order", ORDERS)
@distributed_test(world_size=2)
def test_composer_prefetch_limits_reach_the_engine(order):
    forward_1, backward_1, losses = gathers_ahead(order, 1, 1)
    # Each limit is how many units are all-gathered ahead: one more unit each, the same numbers.
    assert gathers_ahead(order, 2, 1)[:2] == (forward_1 + 1, backward_1)
    assert gathers_ahead(order, 1, 2)[:2] == (forward_1, backward_1 + 1)
    forward_3, backward_3, losses_3 = gathers_ahead(order, 3, 3)
    assert (forward_3, backward_3) == (forward_1 + 2, backward_1 + 2)
    assert losses_3 == losses


def composer_checkpoint_round_trip(order: str) -> None:
    with framework("fake_composer_checkpoint", COMPOSER_SOURCE, order) as composer:
        model = composer.prepare_fsdp_module(linear_stack(), linear_policy())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            model(batch(step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        saved, params = copy.deepcopy(composer.save(model, optimizer)), full_params(model)
        model(batch(2)).square().mean().backward()  # moves the model and the optimizer on
        optimizer.step()
        composer.load(model, optimizer, saved)
        assert all(torch.equal(value, params[name]) for name, value in full_params(model).items())
        reloaded = composer.save(model, optimizer)
    assert list(saved["model"]) == [f"{i}.{kind}" for i in range(4) for kind in ("weight", "bias")]
    for name, state in saved["optimizers"]["state"].items():
        for key, value in state.items():
            assert torch.equal(reloaded["optimizers"]["state"][name][key], value), (name, key)


@pytest.mark.parametrize("order", ORDERS)
def test_composer_checkpoints_through_torchs_state_dict_api(order):
    run_on_ranks(composer_checkpoint_round_trip, 2, order)


# ---------------------------------------------------------------------------------------------
# OLMo: the root's _all_handles
# ---------------------------------------------------------------------------------------------

OLMO_SOURCE = '''
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

# FlatParameter metadata OLMo's LocalShardedCheckpointer saves (those a handle has).
METADATA = ("_fqns", "_shard_param_offsets", "_shard_indices", "_numels", "_numels_with_padding", "_shapes",
            "_shard_numel_padded", "_shard_param_infos")


@torch.no_grad()
def flat_param_state(fsdp_model):
    handles = []
    for handle in fsdp_model._all_handles:
        flat_param = handle.flat_param
        data = {"flat_param.data": flat_param.detach().clone()}
        data.update({f"flat_param.{key}": getattr(flat_param, key) for key in METADATA if hasattr(flat_param, key)})
        handles.append(data)
    return handles


@torch.no_grad()
def load_flat_param_state(fsdp_model, handles):
    assert len(fsdp_model._all_handles) == len(handles)
    for handle, data in zip(fsdp_model._all_handles, handles):
        flat_param = handle.flat_param
        for key in METADATA:
            if hasattr(flat_param, key):
                assert getattr(flat_param, key) == data[f"flat_param.{key}"], key
        flat_param.copy_(data["flat_param.data"])
'''


def olmo_round_trip(order: str, use_orig_params: bool) -> list[list[str]]:
    with framework("fake_olmo", OLMO_SOURCE, order) as olmo:
        model = olmo.FSDP(linear_stack(), auto_wrap_policy=linear_policy(),
                          use_orig_params=use_orig_params)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(batch(0)).square().mean().backward()
        optimizer.step()
        saved, params = olmo.flat_param_state(model), full_params(model)
        model(batch(1)).square().mean().backward()
        optimizer.step()
        olmo.load_flat_param_state(model, saved)
        assert all(torch.equal(value, params[name]) for name, value in full_params(model).items())
        assert all(handle._fully_sharded_module is unit.module and handle.uses_sharded_strategy
                   and handle._use_orig_params == use_orig_params and not handle._offload_params
                   for handle, unit in zip(model._all_handles, FSDP.fsdp_modules(model)[1:]))
        assert not hasattr(FSDP.fsdp_modules(model)[1], "_all_handles")  # the root's only, as FSDP1
    return [data["flat_param._fqns"] for data in saved]


def fsdp1_handle_fqns(use_orig_params: bool) -> list[list[str]]:
    model = diff.TorchFSDP(linear_stack(), auto_wrap_policy=linear_policy(),
                           use_orig_params=use_orig_params, **diff.fsdp1_kwargs())
    model(batch(0)).sum().backward()  # FSDP1 sets _all_handles at lazy initialisation
    return [list(handle.flat_param._fqns) for handle in model._all_handles]


def olmo_flow(order: str, use_orig_params: bool) -> None:
    fqns = olmo_round_trip(order, use_orig_params)
    assert fqns == diff.fsdp1_value(GOLDEN, diff.golden_key("all_handles_fqns", use_orig_params),
                                    lambda: fsdp1_handle_fqns(use_orig_params))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_olmo_checkpointer_walks_all_handles(order, use_orig_params):
    run_on_ranks(olmo_flow, 2, order, use_orig_params)


# ---------------------------------------------------------------------------------------------
# FSDP1's refusals
# ---------------------------------------------------------------------------------------------


def _error(call) -> list[str]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the type and text are what is compared
        return [type(error).__name__, str(error)]
    return ["no error", ""]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
@distributed_test(world_size=2)
def test_manual_hybrid_without_process_group_raises_as_fsdp1(strategy):
    """torch's ``test_raises_manual_wrap_hybrid_shard_when_none_policy``: nothing says how to split the ranks."""
    ours = _error(lambda: FSDP(nn.Linear(4, 4), sharding_strategy=fsdp_compat.ShardingStrategy[strategy]))
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("manual_hybrid", strategy), lambda: _error(
        lambda: diff.TorchFSDP(nn.Linear(4, 4), sharding_strategy=diff.torch_fsdp.ShardingStrategy[strategy],
                               **diff.fsdp1_kwargs())))
    assert ours[0] == expected[0] == "ValueError"
    assert ours[1].startswith(expected[1])
    # With an auto-wrap policy the default layout (sharding within each node) is built, as FSDP1 does.
    FSDP(nn.Sequential(nn.Linear(4, 4)), sharding_strategy=fsdp_compat.ShardingStrategy[strategy],
         auto_wrap_policy=linear_policy())


def _load_without_one_parameter(wrapper_class, api) -> list[str]:
    model = wrapper_class(linear_stack(layers=2), auto_wrap_policy=linear_policy(),
                          **({} if wrapper_class is FSDP else diff.fsdp1_kwargs()))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(batch(0)).sum().backward()
    optimizer.step()
    with wrapper_class.state_dict_type(model, api.StateDictType.FULL_STATE_DICT):
        saved = wrapper_class.optim_state_dict(model, optimizer)
        del saved["state"]["0.bias"]
        before = copy.deepcopy(optimizer.state_dict())
        error = _error(lambda: wrapper_class.optim_state_dict_to_load(model, optimizer, saved))
    after = optimizer.state_dict()
    assert all(torch.equal(after["state"][i]["exp_avg"], state["exp_avg"]) for i, state in before["state"].items())
    return error


@distributed_test(world_size=2)
def test_parameter_missing_from_a_loaded_optimizer_state_raises_as_fsdp1():
    """``use_orig_params=False``: a unit's parameters are one flat parameter with one ``step``; FSDP1 takes
    the missing parameter's as ``None`` and refuses (it would otherwise load zeros for its moments)."""
    diff.quiet()
    ours = _load_without_one_parameter(FSDP, fsdp_compat)
    expected = diff.fsdp1_value(GOLDEN, diff.golden_key("optim_state_missing_parameter"),
                                lambda: _load_without_one_parameter(diff.TorchFSDP, diff.torch_fsdp))
    assert ours[0] == expected[0] == "ValueError"
    assert _sets_sorted(ours[1]).startswith(_sets_sorted(expected[1]))  # FSDP1 prints sets (hash order varies)


def _sets_sorted(text: str) -> str:
    return re.sub(r"\{([^{}]*)\}", lambda match: "{" + ", ".join(sorted(match.group(1).split(", "))) + "}", text)
