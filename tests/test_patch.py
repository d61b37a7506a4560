"""The public switch ``fsdp_compat.patch_torch()``: torch's FSDP1 names resolve to our class.

Needs no library beyond torch: the frameworks themselves are covered in ``tests/integration/``.
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.state_dict as dcp_state_dict
import torch.distributed.fsdp

from .differential import HAVE_FSDP1

if not HAVE_FSDP1:  # what the switch rebinds is torch's FSDP1, absent in this mode
    pytest.skip("the switch rebinds torch's FSDP1 names; torch has none here (FSDP_COMPAT_WITHOUT_FSDP1)",
                allow_module_level=True)

import torch.distributed.fsdp.fully_sharded_data_parallel as torch_fsdp1_module  # noqa: E402
import torch.nn as nn

import fsdp_compat
from fsdp_compat import FullyShardedDataParallel
from fsdp_compat.testing import device, distributed_test


# torch's class, read before any test switches the names. Held by an instance attribute, which the
# switch leaves alone (it rebinds module globals and class attributes: this module's too).
_torch = types.SimpleNamespace(FSDP1=torch_fsdp1_module.FullyShardedDataParallel)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def switch_off_after_each_test():
    yield
    fsdp_compat.unpatch_torch()


def _torch_names() -> list[type]:
    return [torch.distributed.fsdp.FullyShardedDataParallel, torch_fsdp1_module.FullyShardedDataParallel]


def _fake_framework_module(name: str, **namespace: object) -> types.ModuleType:
    """A module that bound torch's class at import, as a framework module could."""
    module = types.ModuleType(name)
    module.__dict__.update(namespace)
    sys.modules[name] = module
    return module


def test_patch_makes_torch_names_resolve_to_ours():
    fsdp_compat.patch_torch()
    assert _torch_names() == [FullyShardedDataParallel, FullyShardedDataParallel]
    assert fsdp_compat.is_torch_patched()


def test_unpatch_gives_torch_its_class_back():
    fsdp_compat.patch_torch()
    fsdp_compat.unpatch_torch()
    assert _torch_names() == [_torch.FSDP1, _torch.FSDP1]
    assert not fsdp_compat.is_torch_patched()


def test_patch_is_idempotent():
    fsdp_compat.patch_torch()
    fsdp_compat.patch_torch()
    assert _torch_names() == [FullyShardedDataParallel, FullyShardedDataParallel]
    fsdp_compat.unpatch_torch()
    fsdp_compat.unpatch_torch()
    assert _torch_names() == [_torch.FSDP1, _torch.FSDP1]


def test_context_manager_switches_only_inside_the_block():
    with fsdp_compat.torch_patched():
        assert _torch_names() == [FullyShardedDataParallel, FullyShardedDataParallel]
    assert _torch_names() == [_torch.FSDP1, _torch.FSDP1]


def test_context_manager_keeps_a_switch_that_was_already_on():
    fsdp_compat.patch_torch()
    with fsdp_compat.torch_patched():
        pass
    assert _torch_names() == [FullyShardedDataParallel, FullyShardedDataParallel]


def test_torch_checkpoint_api_sees_our_class_without_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fsdp_compat.patch_torch()
    assert not [w for w in caught if "torch.distributed" in str(w.message)]
    assert dcp_state_dict.FSDP is FullyShardedDataParallel
    fsdp_compat.unpatch_torch()
    assert dcp_state_dict.FSDP is _torch.FSDP1


def test_late_module_reference_is_rebound_and_named_in_a_warning():
    module = _fake_framework_module("fake_framework_late", FSDP=_torch.FSDP1)
    try:
        with pytest.warns(UserWarning, match=r"after \[.*'fake_framework_late.FSDP'.*\] bound torch's FSDP1"):
            fsdp_compat.patch_torch()
        assert module.FSDP is FullyShardedDataParallel
        fsdp_compat.unpatch_torch()
        assert module.FSDP is _torch.FSDP1
    finally:
        del sys.modules["fake_framework_late"]


def test_late_class_attribute_is_rebound():
    strategy = type("Strategy", (), {"wrapper_cls": _torch.FSDP1, "__module__": "fake_framework_cls"})
    _fake_framework_module("fake_framework_cls", Strategy=strategy)
    try:
        with pytest.warns(UserWarning, match=r"fake_framework_cls.Strategy.wrapper_cls"):
            fsdp_compat.patch_torch()
        assert strategy.wrapper_cls is FullyShardedDataParallel
        fsdp_compat.unpatch_torch()
        assert strategy.wrapper_cls is _torch.FSDP1
    finally:
        del sys.modules["fake_framework_cls"]


def test_reference_inside_a_container_is_named_in_a_warning():
    module = _fake_framework_module("fake_framework_tuple", WRAPPERS=(nn.Module, _torch.FSDP1))
    try:
        with pytest.warns(UserWarning, match=r"cannot rebind .* \['fake_framework_tuple.WRAPPERS'\]"):
            fsdp_compat.patch_torch()
        assert module.WRAPPERS == (nn.Module, _torch.FSDP1)
    finally:
        del sys.modules["fake_framework_tuple"]


def test_our_class_refuses_a_module_holding_torch_units():
    model = nn.Sequential(nn.Linear(2, 2))
    # A torch FSDP1 instance as far as isinstance can tell, built without running FSDP1.
    torch_unit = _torch.FSDP1.__new__(_torch.FSDP1)
    nn.Module.__init__(torch_unit)
    model.append(torch_unit)
    with pytest.raises(ValueError, match=r"contains torch's FSDP1 .* \(at \['1'\]\)"):
        FullyShardedDataParallel(model)


@distributed_test(world_size=2)
def test_torch_class_refuses_our_units_while_switched():
    if not HAVE_FSDP1:
        pytest.skip("torch's FSDP1 is not available")
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0] = FullyShardedDataParallel(model[0], device_id=device())
    fsdp_compat.patch_torch()
    try:
        with pytest.raises(ValueError, match=r"contains fsdp_compat.FullyShardedDataParallel units .* \['0'\]"):
            _torch.FSDP1(model, device_id=device())
    finally:
        fsdp_compat.unpatch_torch()
    # Switched off, torch's class constructs as before.
    assert isinstance(_torch.FSDP1(nn.Linear(4, 4), device_id=device()), _torch.FSDP1)


@distributed_test(world_size=2)
def test_frameworks_lookup_builds_our_class_while_switched():
    with fsdp_compat.torch_patched():
        from torch.distributed.fsdp import FullyShardedDataParallel as FrameworkFSDP  # looked up late

        wrapped = FrameworkFSDP(nn.Linear(4, 4), device_id=device(), use_orig_params=True)
        assert isinstance(wrapped, torch.distributed.fsdp.FullyShardedDataParallel)
    assert type(wrapped) is FullyShardedDataParallel


def _run_launcher(*args: str, tmp_path: Path) -> str:
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, torch.distributed.fsdp as F\n"
        "print(F.FullyShardedDataParallel.__module__, sys.argv[1:], __name__)\n"
    )
    argv = [a.replace("SCRIPT", str(script)) for a in args]
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "fsdp_compat.run", *argv], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    return result.stdout.strip().splitlines()[-1]


def test_launcher_runs_a_script_switched(tmp_path):
    out = _run_launcher("SCRIPT", "--epochs", "1", tmp_path=tmp_path)
    assert out == "fsdp_compat.fully_sharded_data_parallel ['--epochs', '1'] __main__"


def test_launcher_runs_a_module_switched(tmp_path):
    out = _run_launcher("-m", "probe", "x", tmp_path=tmp_path)
    assert out == "fsdp_compat.fully_sharded_data_parallel ['x'] __main__"


# Lightning recognises FSDP2 by DTensor parameters (its ``_has_dtensor_modules``) before it checks
# for FSDP1's class; stand-ins for its module, so these tests need no Lightning.
LIGHTNING_CHECK_MODULE = "lightning_fabric.strategies.model_parallel"
LIGHTNING_CHECK_SOURCE = "def _has_dtensor_modules(module):\n    return True  # Lightning's own answer\n"


def _model_holding_our_unit() -> nn.Module:
    # One of our units, built on a one-process group that is only needed while it is built.
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        return nn.Sequential(nn.Linear(2, 2), FullyShardedDataParallel(nn.Linear(2, 2)))
    finally:
        torch.distributed.destroy_process_group()


def test_lightning_fsdp2_check_says_no_for_our_units_while_switched(monkeypatch):
    lightning = types.ModuleType(LIGHTNING_CHECK_MODULE)
    exec(LIGHTNING_CHECK_SOURCE, lightning.__dict__)
    monkeypatch.setitem(sys.modules, LIGHTNING_CHECK_MODULE, lightning)
    own_check = lightning._has_dtensor_modules
    fsdp_compat.patch_torch()
    assert lightning._has_dtensor_modules(_model_holding_our_unit()) is False
    assert lightning._has_dtensor_modules(nn.Linear(2, 2)) is True  # anything else: Lightning's answer
    fsdp_compat.unpatch_torch()
    assert lightning._has_dtensor_modules is own_check


def test_lightning_imported_after_the_switch_gets_the_check_patched(monkeypatch, tmp_path):
    package = tmp_path / "lightning_fabric" / "strategies"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "model_parallel.py").write_text(LIGHTNING_CHECK_SOURCE)
    for name in [n for n in sys.modules if n.partition(".")[0] == "lightning_fabric"]:
        monkeypatch.delitem(sys.modules, name)  # an installed Lightning, if any, is restored after
    monkeypatch.syspath_prepend(str(tmp_path))
    fsdp_compat.patch_torch()
    import lightning_fabric.strategies.model_parallel as lightning

    assert lightning.__file__.startswith(str(tmp_path))
    assert lightning._has_dtensor_modules(_model_holding_our_unit()) is False
    fsdp_compat.unpatch_torch()
    assert lightning._has_dtensor_modules(_model_holding_our_unit()) is True
