"""Instructions a training step executes, per engine, counted by valgrind's callgrind: a host-work figure that
does not move with the load on a shared machine.

``interleaved.py`` times both engines in one process, but on a shared 2-core machine its medians still move by
several percent from run to run, more than the host-work changes this project makes to a step. Instructions
executed are deterministic: each engine runs in its own process under ``valgrind --tool=callgrind``, with
counting switched on (``callgrind_control -i on``) only around the timed steps, after the wrapping and warm-up
steps, on one torch thread, at world size 1 (gloo), the model and trainer ``bench.py`` and ``interleaved.py``
use. Both engines run the same kernels on the same tensors, so the difference of their counts is the host
work (Python and dispatch) of one against the other. The totals themselves are not a native step's: under
valgrind torch's CPU kernels take their generic paths (no AVX-512), so the matrix products dominate the
count; read the difference, not the ratio of the totals. Needs ``valgrind`` (Debian: ``apt-get install
valgrind``); about 5 minutes per engine, the engines run side by side.

    python benchmarks/host_instructions.py --config bf16 --steps 4 --json benchmarks/results/host_ir_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the helpers beside this file, the package from a checkout

ENGINES = ("fsdp_compat", "fsdp1")


def _count_steps(engine_name: str, config: str, steps: int, port: int) -> None:
    """In the process valgrind runs: wrap, warm up, then ``steps`` steps with counting on."""
    import torch
    import torch.distributed as dist

    from interleaved import PHASES, _build, _step

    warnings.filterwarnings("ignore")  # as bench.py's ranks: FSDP1's deprecation, NO_SHARD at world size 1
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        _, trainer = _build(engine_name, config, "cpu", torch.device("cpu"))
        for _ in range(3):
            trainer.step()
        phases = dict.fromkeys(PHASES, 0.0)
        _callgrind_counting(True)
        for _ in range(steps):
            _step(trainer, phases)
        _callgrind_counting(False)
    finally:
        dist.destroy_process_group()


def _callgrind_counting(on: bool) -> None:
    subprocess.run(["callgrind_control", "--instr=" + ("on" if on else "off"), str(os.getpid())], check=True,
                   stdout=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(config: str, steps: int, engines: tuple[str, ...]) -> dict[str, int]:
    """Instructions per step of each engine, the engines' valgrind runs side by side."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("host_instructions.py needs valgrind (with callgrind_control) on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name in engines:
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={tmp}/{name}.out", sys.executable, __file__,
                       "--child", name, "--config", config, "--steps", str(steps), "--port", str(_free_port())]
            runs[name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        counts = {}
        for name, run in runs.items():
            output, _ = run.communicate()
            found = re.search(r"Collected : (\d+)", output)
            if run.returncode != 0 or found is None:
                raise SystemExit(f"{name} under valgrind failed (exit {run.returncode}):\n{output[-3000:]}")
            counts[name] = int(found.group(1)) // steps
    return counts


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bf16",
                        help="one of bench.py's --configs FSDP1 runs on a CPU (default bf16)")
    parser.add_argument("--steps", type=int, default=4, help="counted steps per engine (default 4)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default fsdp_compat,fsdp1)")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _count_steps(args.child, args.config, args.steps, args.port)
        return []
    engines = tuple(args.engines.split(","))
    counts = measure(args.config, args.steps, engines)
    import torch

    lines = [f"{args.config} (cpu scale), world size 1, torch {torch.__version__}, {args.steps} counted steps, "
             "instructions per step (callgrind)"]
    lines += [f"  {name:12s} {count:>15,}" for name, count in counts.items()]
    if set(ENGINES) <= set(counts):
        lines.append(f"  fsdp_compat - FSDP1: {counts['fsdp_compat'] - counts['fsdp1']:+,} (host work)")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"config": args.config, "steps": args.steps, "torch": torch.__version__,
                                         "instructions_per_step": counts}, indent=2) + "\n")
    return lines


if __name__ == "__main__":
    main()
