"""The torch releases fsdp_compat supports: declared once, warned about outside, failing clearly
where torch's FSDP2 engine lacks a piece the adapter needs."""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fsdp_compat import _engine

ROOT = Path(__file__).resolve().parents[1]


def test_setup_cfg_declares_the_tested_range():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = config["options"]["install_requires"].split()
    (first_major, first_minor), (end_major, end_minor) = _engine.TESTED_TORCH
    assert f"torch>={first_major}.{first_minor},<{end_major}.{end_minor}" in requirements


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1", "2.15.0+cu132", "2.15.1"])
def test_tested_torch_does_not_warn(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _engine.warn_if_untested(version) is False


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "2.16.0a0+git1234", "3.0.0"])
def test_untested_torch_warns(version):
    with pytest.warns(UserWarning, match=r"tested with torch>=2\.13,<2\.16, not torch " + re.escape(version)):
        assert _engine.warn_if_untested(version) is True


def _import_fsdp_compat_after(statement: str) -> subprocess.CompletedProcess:
    code = f"{statement}\nimport fsdp_compat"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, env=env, timeout=300)


def test_import_names_a_missing_engine_method():
    result = _import_fsdp_compat_after(
        "from torch.distributed.fsdp import FSDPModule\ndel FSDPModule.reset_iter_state")
    assert result.returncode != 0
    assert "ImportError: fsdp_compat cannot run on torch" in result.stderr
    assert "FSDPModule.reset_iter_state" in result.stderr
    assert "fsdp_compat supports torch>=2.13,<2.16" in result.stderr


def test_import_names_a_missing_engine_name():
    result = _import_fsdp_compat_after(
        "import torch.distributed.fsdp._fully_shard._fsdp_param as p\ndel p.unsafe_setattr_param")
    assert result.returncode != 0
    assert "unsafe_setattr_param" in result.stderr
    assert "fsdp_compat supports torch>=2.13,<2.16" in result.stderr
