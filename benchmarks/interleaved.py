"""torch FSDP1 and fsdp_compat in one process at world size 1, interleaved: the training step's CPU time
by phase, and the FULL ``rank0_only`` state dict.

``bench.py`` gives every engine its own process, so that each peak is its own; on a shared 2-core machine its
step ratios move by up to ±10% between runs of the same code. Here both engines wrap the same seeded model
(one of ``bench.py``'s ``--configs``, at its GPU or CPU scale, wrapped and trained by ``bench.py``'s own
engines and trainer) in one rank, and rounds of steps (or of state-dict
calls) alternate between them, the order reversed every round, so that load drifting on the machine hits
both alike. Reported: the median and the minimum over rounds of each engine's CPU time per step
(``time.process_time``; AdamW, ``clip_grad_norm_(1.0)``, ``zero_grad(set_to_none=True)``), the same per phase
(``zero_grad`` + forward + loss, backward, ``clip_grad_norm_``, optimizer step), and the wall time per FULL
``rank0_only`` state-dict call (``offload_to_cpu`` on a GPU, as ``bench.py``); ratios fsdp_compat / FSDP1.
On a GPU the step figures are still the host's CPU time (kernels run asynchronously: this is the host work a
model too small to hide it pays), and the state-dict calls are timed to a synchronised device; ``bench.py``
gives the step's wall time there.

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
import torch.nn.functional as F  # noqa: E402

from _engines import CONFIGS, Engine, RunContext, build_meta_model, config_model, make_engine  # noqa: E402
from _worker import Trainer, _sync  # noqa: E402
from fsdp_compat.testing import run_on_ranks  # noqa: E402

ENGINES = ("fsdp_compat", "fsdp1")
PHASES = ("forward", "backward", "clip", "optimizer")


def _build(name: str, config: str, scale: str, device: torch.device) -> tuple[Engine, Trainer]:
    """The config's model wrapped by the engine ``name`` and its trainer, exactly as ``bench.py`` runs it."""
    engine, train, spec = make_engine(name), CONFIGS[config], config_model(config, scale)
    ctx = RunContext("FULL_SHARD", device, 1, (1, 1), use_orig_params=train.use_orig_params, train=train)
    torch.manual_seed(0)
    model = engine.wrap(build_meta_model(spec), ctx)
    fused = True if train.fused_adamw and not train.cpu_offload and device.type == "cuda" else None
    return engine, Trainer(model, spec, device, 0, 1, fused=fused, clip=lambda: engine.clip_grad_norm_(model, 1.0))


def _step(trainer: Trainer, phases: dict[str, float]) -> None:
    """``Trainer.step`` with each phase's CPU time added to ``phases``."""
    tokens, targets = trainer.batches[trainer.step_index % len(trainer.batches)]
    trainer.step_index += 1
    start = time.process_time()
    trainer.optim.zero_grad(set_to_none=True)
    logits = trainer.model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    forward = time.process_time()
    loss.backward()
    backward = time.process_time()
    trainer.clip()  # type: ignore[misc]
    clip = time.process_time()
    trainer.optim.step()
    end = time.process_time()
    for phase, seconds in zip(PHASES, (forward - start, backward - forward, clip - backward, end - clip)):
        phases[phase] += seconds


def _rank_main(config: str, scale: str, rounds: int, steps: int, warmup: int, calls: int) -> dict[str, Any]:
    from fsdp_compat import testing

    warnings.filterwarnings("ignore")  # as bench.py's ranks: FSDP1's deprecation, NO_SHARD at world size 1
    torch.set_flush_denormal(True)  # as bench.py: subnormals' cost depends on the init path, not the engine
    device = testing.device()
    built = {name: _build(name, config, scale, device) for name in ENGINES}
    for _, trainer in built.values():
        for _ in range(warmup):
            trainer.step()
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in ENGINES}
    for round_ in range(rounds):
        for name in ENGINES if round_ % 2 == 0 else reversed(ENGINES):
            phases = dict.fromkeys(PHASES, 0.0)
            for _ in range(steps):
                _step(built[name][1], phases)
            per_round[name].append({phase: seconds / steps for phase, seconds in phases.items()})
    # The FULL state dict with rank0_only (offload_to_cpu on a GPU), as bench.py times it; an untimed call first.
    offload = device.type == "cuda"
    for engine, trainer in built.values():
        engine.full_state_dict_offloaded(trainer.model, offload)
    state_dict_s: dict[str, list[float]] = {name: [] for name in ENGINES}
    for call in range(calls):
        for name in ENGINES if call % 2 == 0 else reversed(ENGINES):
            engine, trainer = built[name]
            _sync(device)
            start = time.perf_counter()
            engine.full_state_dict_offloaded(trainer.model, offload)
            _sync(device)
            state_dict_s[name].append(time.perf_counter() - start)
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
