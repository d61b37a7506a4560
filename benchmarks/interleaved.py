"""torch FSDP1 and fsdp_compat in one process at world size 1, interleaved: the training step's CPU time
by phase, and the FULL ``rank0_only`` state dict.

``bench.py`` gives every engine its own process, so that each peak is its own; on a shared 2-core machine its
step ratios move by up to ±10% between runs of the same code. Here both engines wrap the same seeded model
(one of ``bench.py``'s ``--configs``, at its GPU or CPU scale) in one rank, and rounds of steps (or of state-dict
calls) alternate between them, the order reversed every round, so that load drifting on the machine hits
both alike. Reported: the median and the minimum over rounds of each engine's CPU time per step
(``time.process_time``; AdamW, ``clip_grad_norm_(1.0)``, ``zero_grad(set_to_none=True)``), the same per phase
(``zero_grad`` + forward + loss, backward, ``clip_grad_norm_``, optimizer step), and the wall time per FULL
``rank0_only`` state-dict call; ratios fsdp_compat / FSDP1. On a GPU the step figures are still the host's
CPU time (kernels run asynchronously: this is the host work a model too small to hide it pays), and the
state-dict calls are timed to a synchronised device; ``bench.py`` gives the step's wall time there.

    python benchmarks/interleaved.py --config bf16 --rounds 7 --steps 20
    python benchmarks/interleaved.py --config bf16_orig --state-dict-calls 150 --rounds 0
    python benchmarks/interleaved.py --quick                # tiny model, one round (the smoke test runs it)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the helpers beside this file, the package from a checkout

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from _engines import CONFIGS, _checkpoint_blocks, config_model  # noqa: E402
from fsdp_compat.examples import Block, TinyGPT  # noqa: E402
from fsdp_compat.testing import run_on_ranks  # noqa: E402

ENGINES = ("fsdp_compat", "fsdp1")
PHASES = ("forward", "backward", "clip", "optimizer")


def _build(engine: str, config: str, scale: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The config's model wrapped by ``engine`` as ``bench.py`` wraps it, its AdamW, and the API module."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    import fsdp_compat
    from fsdp_compat import testing
    from fsdp_compat.wrap import ModuleWrapPolicy

    api: Any = fsdp_compat if engine == "fsdp_compat" else torch_fsdp
    policy = (ModuleWrapPolicy if engine == "fsdp_compat" else TorchModuleWrapPolicy)({Block})
    train = CONFIGS[config]
    torch.manual_seed(0)
    device = testing.device()
    model = TinyGPT(config_model(config, scale).config).to(device)
    kwargs: dict[str, Any] = dict(auto_wrap_policy=policy, device_id=device,
                                  use_orig_params=train.use_orig_params)
    if train.bf16:
        kwargs["mixed_precision"] = api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                       buffer_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # both warn that FULL_SHARD is NO_SHARD at world size 1
        wrapped = api.FullyShardedDataParallel(model, **kwargs)
    if train.activation_checkpointing:
        _checkpoint_blocks(wrapped)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=train.fused_adamw and device.type == "cuda")
    return wrapped, optimizer, api


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
          phases: dict[str, float]) -> None:
    """One training step, each phase's CPU time added to ``phases``."""
    tokens, targets = batch
    start = time.process_time()
    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    forward = time.process_time()
    loss.backward()
    backward = time.process_time()
    model.clip_grad_norm_(1.0)
    clip = time.process_time()
    optimizer.step()
    end = time.process_time()
    for phase, seconds in zip(PHASES, (forward - start, backward - forward, clip - backward, end - clip)):
        phases[phase] += seconds


def _state_dict(model: nn.Module, api: Any) -> None:
    config = api.FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with api.FullyShardedDataParallel.state_dict_type(model, api.StateDictType.FULL_STATE_DICT, config):
        model.state_dict()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(config: str, scale: str, rounds: int, steps: int, warmup: int, calls: int) -> dict[str, Any]:
    from fsdp_compat import testing

    torch.set_flush_denormal(True)  # as bench.py: subnormals' cost depends on the init path, not the engine
    built = {engine: _build(engine, config, scale) for engine in ENGINES}
    spec = config_model(config, scale)
    generator = torch.Generator().manual_seed(1)
    shape = (spec.batch_per_rank, spec.config.block_size)
    device = testing.device()
    batch = tuple(torch.randint(0, spec.config.vocab_size, shape, generator=generator).to(device) for _ in range(2))
    for model, optimizer, _ in built.values():
        for _ in range(warmup):
            _step(model, optimizer, batch, dict.fromkeys(PHASES, 0.0))  # type: ignore[arg-type]
    per_round: dict[str, list[dict[str, float]]] = {engine: [] for engine in ENGINES}
    for round_ in range(rounds):
        for engine in ENGINES if round_ % 2 == 0 else reversed(ENGINES):
            model, optimizer, _ = built[engine]
            phases = dict.fromkeys(PHASES, 0.0)
            for _ in range(steps):
                _step(model, optimizer, batch, phases)  # type: ignore[arg-type]
            per_round[engine].append({phase: seconds / steps for phase, seconds in phases.items()})
    state_dict_s: dict[str, list[float]] = {engine: [] for engine in ENGINES}
    for model, _, api in built.values():  # an untimed call each first
        _state_dict(model, api)
    for call in range(calls):
        for engine in ENGINES if call % 2 == 0 else reversed(ENGINES):
            model, _, api = built[engine]
            _synchronize(device)
            start = time.perf_counter()
            _state_dict(model, api)
            _synchronize(device)
            state_dict_s[engine].append(time.perf_counter() - start)
    return {"per_round": per_round, "state_dict_s": state_dict_s}


def _summary(results: dict[str, Any]) -> list[str]:
    lines = []
    per_round = results["per_round"]
    if per_round["fsdp1"]:
        totals = {engine: [sum(round_.values()) for round_ in rounds] for engine, rounds in per_round.items()}
        for label, pick in (("median", statistics.median), ("min", min)):
            ours, theirs = pick(totals["fsdp_compat"]), pick(totals["fsdp1"])
            lines.append(f"step CPU ms, {label:6s}  fsdp_compat {ours * 1e3:8.2f}  FSDP1 {theirs * 1e3:8.2f}  "
                         f"ratio {ours / theirs:.3f}")
        for phase in PHASES:
            ours = statistics.median(round_[phase] for round_ in per_round["fsdp_compat"])
            theirs = statistics.median(round_[phase] for round_ in per_round["fsdp1"])
            lines.append(f"  {phase:10s} median   fsdp_compat {ours * 1e3:8.2f}  FSDP1 {theirs * 1e3:8.2f}  "
                         f"difference {(ours - theirs) * 1e3:+.2f}")
    calls = results["state_dict_s"]
    if calls["fsdp1"]:
        ours, theirs = statistics.median(calls["fsdp_compat"]), statistics.median(calls["fsdp1"])
        lines.append(f"FULL rank0_only state dict ms, median  fsdp_compat {ours * 1e3:.3f}  FSDP1 {theirs * 1e3:.3f}  "
                     f"ratio {ours / theirs:.3f}")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bf16", choices=sorted(set(CONFIGS) - {"offload_150m"}),
                        help="one of bench.py's --configs FSDP1 runs on a CPU (default bf16)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of steps per engine (default 7)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first (default 3)")
    parser.add_argument("--state-dict-calls", type=int, default=0,
                        help="timed FULL rank0_only state-dict calls per engine (default 0)")
    parser.add_argument("--scale", choices=("gpu", "cpu"), default=None,
                        help="the config's model: the issue's sizes (gpu) or bench.py's CPU fallback (cpu); "
                             "default gpu with CUDA, else cpu")
    parser.add_argument("--quick", action="store_true", help="tiny model, one round of 2 steps, 2 calls")
    args = parser.parse_args(argv)
    scale = "quick" if args.quick else args.scale or ("gpu" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.rounds, args.steps, args.warmup, args.state_dict_calls = 1, 2, 1, 2
    [results] = run_on_ranks(_rank_main, 1, args.config, scale, args.rounds, args.steps, args.warmup,
                             args.state_dict_calls)
    lines = [f"{args.config} ({scale} scale), world size 1, torch {torch.__version__}, {args.rounds} rounds of "
             f"{args.steps} steps, {args.state_dict_calls} state-dict calls", *_summary(results)]
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
