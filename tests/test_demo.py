"""The main job runs end to end: train, checkpoint, resume from the sharded checkpoint, verify."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_compat import demo


def _run_demo(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdp_compat.demo", *arguments],
                          capture_output=True, text=True, timeout=300)


def test_demo_trains_checkpoints_and_resumes(tmp_path):
    result = _run_demo("--steps", "4", "--checkpoint-dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed run matches the uninterrupted one" in result.stdout
    assert "[####] resume step 4/4" in result.stdout
    # Each checkpoint goes to a fresh directory; the "latest" marker names it once every rank saved.
    latest = tmp_path / (tmp_path / "latest").read_text().strip()
    assert latest.name.startswith("step-000002")
    assert (latest / "full.pt").exists() and (latest / "sharded").is_dir()


def test_demo_help_lists_the_options(capsys):
    # In this process: the command line itself runs in the test above (a fresh interpreter costs seconds).
    with pytest.raises(SystemExit) as exited:
        demo.main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for option in ("--nproc", "--steps", "--strategy", "--mixed-precision", "--cpu-offload",
                   "--checkpoint-dir", "--compare-fsdp1"):
        assert option in out


def test_demo_fails_clearly_on_bad_input(capsys):
    with pytest.raises(SystemExit) as exited:
        demo.main(["--steps", "3"])
    assert exited.value.code != 0
    assert "--steps must be an even number" in capsys.readouterr().err
