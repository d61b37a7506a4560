"""Smoke test of ``benchmarks/bench.py``: a ``--quick`` run end to end, plus its accounting helpers.

The benchmark's numbers are reported, never asserted; what is checked here is that the script
runs, that every engine produces measurements, and that the collective counts it reports are the
ones the engines must issue (so the comparison with the theoretical minimum means something).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _comm import collective_type, theoretical_min_traffic  # noqa: E402

from fsdp_compat import FullyShardedDataParallel as FSDP  # noqa: E402
from fsdp_compat.examples import Block, GPTConfig, TinyGPT  # noqa: E402
from fsdp_compat.testing import distributed_test  # noqa: E402
from fsdp_compat.wrap import ModuleWrapPolicy  # noqa: E402

try:
    from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
    HAVE_FSDP1 = True
except ImportError:  # pragma: no cover - depends on the torch version
    HAVE_FSDP1 = False


def test_collective_types_of_engine_ops() -> None:
    assert collective_type("allgather_") == "all_gather"
    assert collective_type("_allgather_base_") == "all_gather"
    assert collective_type("all_gather_into_tensor") == "all_gather"
    assert collective_type("_reduce_scatter_base_") == "reduce_scatter"
    assert collective_type("reduce_scatter_tensor") == "reduce_scatter"
    assert collective_type("allreduce_") == "all_reduce"
    assert collective_type("broadcast_") == "broadcast"
    assert collective_type("wait_tensor") is None


def test_theoretical_minimum() -> None:
    # 3x / 2x / 2x the parameter bytes times (n-1)/n; hybrid adds the replica all-reduce of a shard.
    assert theoretical_min_traffic("FULL_SHARD", 1000, 2) == 1500
    assert theoretical_min_traffic("SHARD_GRAD_OP", 1000, 4) == 1500
    assert theoretical_min_traffic("NO_SHARD", 1000, 2) == 1000
    assert theoretical_min_traffic("HYBRID_SHARD", 1000, 4, (2, 2)) == 1500 + 2 * 500 * 0.5
    assert theoretical_min_traffic("HYBRID_SHARD", 1000, 2, (1, 2)) == 1500


def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, str(BENCHMARKS / "bench.py"), "--quick", "--nproc", "2", "--models", "small",
               "--strategies", "FULL_SHARD,NO_SHARD", "--json", str(out), "--plot", str(tmp_path / "p.png")]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compat/raw" in done.stdout and "targets" in done.stdout
    assert "plot written" in done.stdout or "matplotlib is not installed" in done.stdout

    result = json.loads(out.read_text())
    summary = result["summary"]["small"]
    engines = ["fsdp_compat", "fully_shard"] + (["fsdp1"] if HAVE_FSDP1 else [])
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for engine in engines:
            cell = summary[strategy][engine]
            for metric in ("step_time_s", "step_cpu_s", "peak_mb", "state_mb", "wrap_time_s"):
                assert isinstance(cell[metric], float), (strategy, engine, metric, cell[metric])
    assert isinstance(summary["NO_SHARD"]["fully_shard_ws1"]["step_time_s"], float)

    # The quick model has 2 blocks + a root unit: FULL_SHARD gathers the root once and each block
    # twice (forward, backward) and reduce-scatters every unit; NO_SHARD all-reduces every unit.
    runs = {(r["spec"]["strategy"], r["spec"]["engine"]): r for r in result["runs"]}
    for engine in engines:
        full = runs[("FULL_SHARD", engine)]["comm"]["train_step"]["by_type"]
        assert (full["all_gather"]["count"], full["reduce_scatter"]["count"]) == (5, 3), (engine, full)
        no_shard = runs[("NO_SHARD", engine)]["comm"]["train_step"]["by_type"]
        assert set(no_shard) == {"all_reduce"} and no_shard["all_reduce"]["count"] == 3, (engine, no_shard)
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            assert 0.9 < summary[strategy][engine]["comm_vs_min"] < 1.1, (strategy, engine)


@pytest.mark.skipif(not HAVE_FSDP1, reason="compares with torch FSDP1 in one process")
@pytest.mark.parametrize("config", ["bf16_orig", "bf16_ac"])
def test_interleaved_quick_run(tmp_path: Path, config: str) -> None:
    """``interleaved.py`` (both FSDP1-style engines in one process at world size 1) trains the configuration
    with each engine, times every phase and the FULL ``rank0_only`` state dict, and reports the ratios."""
    command = [sys.executable, str(BENCHMARKS / "interleaved.py"), "--quick", "--config", config]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("step CPU ms, median") and "ratio" in line for line in lines), done.stdout
    assert sum(line.strip().split()[0] in ("forward", "backward", "clip", "optimizer") for line in lines) == 4
    assert any(line.startswith("FULL rank0_only state dict ms") for line in lines), done.stdout


def test_python_calls_quick_run_sorts_each_engines_calls_by_whose_code_they_are(tmp_path: Path) -> None:
    """``python_calls.py`` counts the Python calls of a world-size-1 step per engine, by the code they run in:
    fsdp_compat's step enters its own code and the engine's, raw ``fully_shard``'s the engine's only."""
    out = tmp_path / "calls.json"
    engines = ["fsdp_compat", "fully_shard", *(["fsdp1"] if HAVE_FSDP1 else [])]
    command = [sys.executable, str(BENCHMARKS / "python_calls.py"), "--quick", "--engines", ",".join(engines),
               "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    calls = json.loads(out.read_text())["calls_per_step"]
    assert calls["fsdp_compat"]["fsdp_compat"] > 0 and calls["fsdp_compat"]["FSDP2 engine"] > 0
    assert calls["fully_shard"]["FSDP2 engine"] > 0 and calls["fully_shard"].get("fsdp_compat", 0) < 5
    assert all(calls[engine]["model"] == calls["fsdp_compat"]["model"] for engine in engines)  # same model code


def test_quick_configs_run(tmp_path: Path) -> None:
    """``--configs`` (issue 35's training configurations) at world size 1: every engine trains the
    configuration (here bf16 mixed precision with activation checkpointing, clip_grad_norm_ each step) and
    reports its step time, peak, copies per step and the FULL ``rank0_only`` state dict."""
    out = tmp_path / "configs.json"
    engines = ["fsdp_compat", "fsdp1" if HAVE_FSDP1 else "fully_shard"]
    command = [sys.executable, str(BENCHMARKS / "bench.py"), "--quick", "--nproc", "1", "--configs", "bf16_ac",
               "--engines", ",".join(engines), "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["models"]["bf16_ac"]["train"]["activation_checkpointing"] is True
    for engine in engines:
        cell = result["summary"]["bf16_ac"]["FULL_SHARD"][engine]
        for metric in ("step_time_s", "step_cpu_s", "peak_mb", "step_tensor_peak_mb", "copies_per_step",
                       "full_sd_rank0_s"):
            assert isinstance(cell[metric], (int, float)), (engine, metric, cell[metric])


def test_bad_arguments_fail_fast(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (the script's command line runs in the tests around): a fresh interpreter costs seconds.
    import bench

    with pytest.raises(SystemExit) as exited:  # a message, so a non-zero exit status
        bench.main(["--quick", "--strategies=FOO"])
    assert exited.value.code != 0 and "choose from" in str(exited.value.code)
    assert "runs:" not in capsys.readouterr().out  # refused before launching anything


@distributed_test(world_size=2)
def test_meta_init_frees_each_units_full_tensors():
    """The benchmark's "wrap peak memory" row: building from the meta device must not keep the
    full (unsharded) tensors of units already sharded alive (it did: 1.9x FSDP1's peak at 50M)."""
    warnings.filterwarnings("ignore")
    with torch.device("meta"):
        meta_model = TinyGPT(GPTConfig(n_layer=3))
    full_weights: list[weakref.ref] = []
    alive_when_initialised = []
    for index, block in enumerate(meta_model.blocks):
        def record(module, index=index, original=block.ln1.reset_parameters):
            alive_when_initialised.append([ref() is not None for ref in full_weights[:index]])
            original()
            full_weights.append(weakref.ref(module.weight))
        block.ln1.reset_parameters = functools.partial(record, block.ln1)
    FSDP(meta_model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert alive_when_initialised == [[], [False], [False, False]]


def test_quick_checkpoint_run(tmp_path: Path) -> None:
    """``--checkpoints``: every checkpoint path, save and load, is measured for every engine
    (FSDP1's offload_to_cpu paths excepted: they crash FSDP1 on a CPU-only machine, and are then
    compared with raw fully_shard), with its collectives and peak memory."""
    out = tmp_path / "ckpt.json"
    command = [sys.executable, str(BENCHMARKS / "bench.py"), "--checkpoints", "--quick", "--models", "small",
               "--checkpoint-calls", "1", "--json", str(out)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    cell = result["summary"]["small"]["FULL_SHARD"]
    ratios = result["ratios"]["small"]["FULL_SHARD"]
    sides = [f"{name}:save" for name in ("model_full", "model_full_rank0", "model_full_offload",
                                           "model_full_offload_rank0", "model_sharded", "optim_full",
                                           "optim_full_rank0", "optim_sharded", "legacy_full_scatter",
                                           "legacy_full_shard", "dcp")]
    sides += [f"{name}:load" for name in ("model_full", "model_sharded", "optim_full", "optim_full_rank0",
                                           "optim_sharded", "legacy_full_scatter", "legacy_full_shard", "dcp")]
    for side in sides:
        for engine in ["fsdp_compat", "fully_shard"] + (["fsdp1"] if HAVE_FSDP1 and "offload" not in side else []):
            for suffix in ("_s", "_cpu_s", "_peak_mb", "_collectives"):
                value = cell[engine].get(f"ckpt:{side}{suffix}")
                assert isinstance(value, (int, float)), (engine, side, suffix, value)
        assert isinstance(ratios[side]["cpu_ratio"], float), side
    if HAVE_FSDP1:
        assert ratios["model_full_offload:save"]["against"] == "fully_shard"
        assert ratios["model_full:save"]["against"] == "fsdp1"
    # FULL model state dict: per unit with parameters (2 blocks + the root), one in-place broadcast
    # per rank (gloo's all-gather stages through a fresh copy); state_dict_type communicates nothing,
    # as FSDP1's.
    assert cell["fsdp_compat"]["ckpt:model_full:save_collectives"] == 3 * 2


@distributed_test(world_size=2)
def test_param_views_counts_the_tensors_each_rank_steps():
    """``param_views.py --counts`` (tensors stepped per rank, counted from the shapes) agrees with what the
    optimizer steps after a backward: the plain views and, where importable, torch FSDP1."""
    import param_views
    import torch.distributed as dist

    from tests import differential as diff

    warnings.filterwarnings("ignore")
    expected = param_views._stepped_per_rank("small", 2)
    for engine in ["plain"] + (["fsdp1"] if diff.HAVE_FSDP1 else []):
        _, optim = param_views._setup(engine, "small", True, {})
        assert len(param_views._stepped(optim)) == expected[engine][dist.get_rank()], engine
