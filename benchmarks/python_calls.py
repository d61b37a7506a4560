"""Python-level calls a training step makes, per engine, by the code they run in: whose host work a step is.

``host_instructions.py`` counts a step's instructions, not whose they are. This counts the Python functions a
step enters (``sys.setprofile`` "call" events, generator resumptions included), after the wrapping and warm-up
steps, at world size 1 (gloo), on the model and trainer of ``bench.py`` and ``interleaved.py``, and sorts them
by the file each function lives in: the model's and the harness's, fsdp_compat's, the FSDP2 engine's
(``torch.distributed.fsdp._fully_shard``, ``replicate``), DTensor's, the rest of ``torch.distributed.fsdp``
(FSDP1's modules, and a helper the engine calls there), ``torch.nn``'s, the rest of torch, the standard
library. The counts repeat whatever the machine's load
(fsdp_compat's and FSDP1's exactly, raw ``fully_shard``'s to 0.1%) and take seconds. Each engine is built
and stepped in the same process, one after the other.

    python benchmarks/python_calls.py --config bf16 --engines fsdp_compat,fsdp1,fully_shard
    python benchmarks/python_calls.py --quick                     # tiny model, one step (the smoke test runs it)
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the helpers beside this file, the package from a checkout

import torch  # noqa: E402

from _engines import CONFIGS  # noqa: E402
from fsdp_compat.testing import run_on_ranks  # noqa: E402

ENGINES = ("fsdp_compat", "fsdp1", "fully_shard")
# (category, what a path contains), first match wins: the engine's files before the rest of torch.distributed.
CATEGORIES = (
    ("model", "/fsdp_compat/examples.py"),  # the benchmarked GPT's own forward, the same for every engine
    ("harness", "/fsdp_compat/testing.py"),
    ("fsdp_compat", "/fsdp_compat/"),
    ("FSDP2 engine", "/fsdp/_fully_shard/"),
    ("FSDP2 engine", "/_composable/replicate"),
    # FSDP1's modules; the engine, too, calls one of them (``_common_utils.collect_grad_tensors``, per unit).
    ("fsdp/ outside _fully_shard", "/distributed/fsdp/"),
    ("DTensor", "/distributed/tensor/"),
    ("torch.nn", "/torch/nn/"),
    ("autograd", "/torch/autograd/"),
    ("dynamo wrappers", "/torch/_dynamo/"),
    ("other torch", "/torch/"),
    ("harness", "/benchmarks/"),
)


def category(filename: str) -> str:
    """The category of the code in ``filename`` (``standard library`` where none matches)."""
    path = filename.replace("\\", "/")
    return next((name for name, part in CATEGORIES if part in path), "standard library")


def _calls_by_file(step: Callable[[], None], steps: int) -> collections.Counter[str]:
    """The Python calls ``steps`` calls of ``step`` make, per file of the function called."""
    by_file: collections.Counter[str] = collections.Counter()

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            by_file[frame.f_code.co_filename] += 1

    sys.setprofile(count)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.setprofile(None)
    return by_file


def _engine_calls(name: str, config: str, scale: str, steps: int, warmup: int) -> dict[str, float]:
    """Engine ``name``'s Python calls per step, per category (its model and trainer freed on return)."""
    from interleaved import PHASES, _build, _step

    _, trainer = _build(name, config, scale, torch.device("cpu"))
    for _ in range(warmup):
        trainer.step()
    gc.collect()  # the engine built before this one is collected now, not while this one is counted
    by_file = _calls_by_file(functools.partial(_step, trainer, dict.fromkeys(PHASES, 0.0)), steps)
    per_category: collections.Counter[str] = collections.Counter()
    for filename, calls in by_file.items():
        per_category[category(filename)] += calls
    return {part: calls / steps for part, calls in per_category.most_common()}


def _rank_main(names: tuple[str, ...], config: str, scale: str, steps: int, warmup: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")  # as bench.py's ranks: FSDP1's deprecation, NO_SHARD at world size 1
    torch.set_flush_denormal(True)
    return {name: _engine_calls(name, config, scale, steps, warmup) for name in names}


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bf16", choices=sorted(set(CONFIGS) - {"offload_150m"}),
                        help="one of bench.py's --configs FSDP1 runs on a CPU (default bf16)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated (default {','.join(ENGINES)})")
    parser.add_argument("--steps", type=int, default=5, help="counted steps per engine (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per engine first (default 3)")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--quick", action="store_true", help="tiny model, one warm-up and one counted step")
    args = parser.parse_args(argv)
    scale = "quick" if args.quick else "cpu"
    if args.quick:
        args.steps, args.warmup = 1, 1
    names = tuple(args.engines.split(","))
    unknown = set(names) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    [results] = run_on_ranks(_rank_main, 1, names, args.config, scale, args.steps, args.warmup)
    lines = [f"{args.config} ({scale} scale), world size 1, torch {torch.__version__}: Python calls per step"]
    for name, per_category in results.items():
        lines.append(f"  {name:12s} {sum(per_category.values()):>9,.0f}   "
                     + ", ".join(f"{part} {calls:,.0f}" for part, calls in per_category.items()))
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"config": args.config, "scale": scale, "steps": args.steps,
                                         "torch": torch.__version__, "calls_per_step": results}, indent=2) + "\n")
    return lines


if __name__ == "__main__":
    main()
