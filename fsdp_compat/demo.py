"""The main job: train a small GPT with ``fsdp_compat``, checkpoint it, resume, and check the resume.

``python -m fsdp_compat.demo`` launches 2 local ranks itself (gloo on CPU; NCCL with one GPU per
rank when enough GPUs are present); under ``torchrun`` it uses the launcher's ranks. It trains on
synthetic tokens, saves a FULL and a SHARDED checkpoint (model + optimizer) half-way into a fresh
directory, points the ``latest`` marker at it once every rank has saved, finishes the run, then
builds a fresh model, resumes from the checkpoint ``latest`` names, trains the remaining steps and
reports whether the resumed run matches the uninterrupted one. ``--compare-fsdp1`` also runs
torch's own FSDP1 on the same seeds and prints the per-step loss difference.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F

from . import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from ._collectives import broadcast_object
from ._common import exit_without_finalizing
from .examples import Block, GPTConfig, TinyGPT, synthetic_batch
from .wrap import ModuleWrapPolicy

MODEL_CONFIG = GPTConfig(vocab_size=251, block_size=32, n_layer=4, n_head=4, n_embd=64)
GLOBAL_BATCH = 8
LATEST = "latest"  # the marker file naming the newest complete checkpoint directory
LEARNING_RATE = 3e-3


@dataclass
class DemoOptions:
    nproc: int
    steps: int
    strategy: str
    mixed_precision: str
    cpu_offload: bool
    checkpoint_dir: str | None
    compare_fsdp1: bool


def parse_args(argv: list[str] | None = None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_compat.demo",
        description="Train a small GPT with fsdp_compat (torch FSDP1's API on the FSDP2 engine), "
                    "checkpoint it, resume from the sharded checkpoint and check the resume.")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=8, help="training steps (even, >= 2)")
    parser.add_argument("--strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy],
                        help="ShardingStrategy (hybrid ones need an even number of ranks)")
    parser.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "fp16", "none"],
                        help="parameter dtype for compute; auto = bf16 where the device supports it")
    parser.add_argument("--cpu-offload", action="store_true", help="CPUOffload(offload_params=True)")
    parser.add_argument("--checkpoint-dir", default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--compare-fsdp1", action="store_true",
                        help="also run torch's FSDP1 side by side and print the per-step loss difference")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.steps % 2:
        parser.error("--steps must be an even number >= 2 (the checkpoint is taken half-way)")
    return DemoOptions(args.nproc, args.steps, args.strategy, args.mixed_precision, args.cpu_offload,
                       args.checkpoint_dir, args.compare_fsdp1)


# ---------------------------------------------------------------------------------------------
# Process set-up
# ---------------------------------------------------------------------------------------------

def _use_gpus(world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


# A collective that waits longer than this fails (rather than hanging the demo) when a rank died.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=2)


def _init_process_group(rank: int, world_size: int) -> torch.device:
    if _use_gpus(world_size):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawned_rank(rank: int, world_size: int, port: int, options: DemoOptions) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    run_rank(rank, world_size, options)
    exit_without_finalizing()


def run_rank(rank: int, world_size: int, options: DemoOptions) -> None:
    """One rank of the demo; raises on failure (the launcher turns that into a non-zero exit)."""
    warnings.filterwarnings("ignore")
    device = _init_process_group(rank, world_size)
    Demo(options, device).run()
    # Only after success: on failure the other ranks may be inside a collective, and tearing the
    # group down would wait for them; the launcher ends them instead.
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The job
# ---------------------------------------------------------------------------------------------

def _parameter_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    if choice == "none":
        return None
    if choice == "fp16":
        return torch.float16
    if choice == "bf16" or device.type == "cpu" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16 if choice == "auto" else None


def _peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Demo:
    """Train, checkpoint, resume and compare, on every rank."""

    def __init__(self, options: DemoOptions, device: torch.device):
        self.options = options
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.param_dtype = _parameter_dtype(options.mixed_precision, device)

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    # -- model, data, steps ------------------------------------------------------------------

    def build(self, wrapper_class: Any = FSDP, **extra: Any) -> tuple[FSDP, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyGPT(MODEL_CONFIG).to(self.device)
        mixed = (MixedPrecision(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
                 if self.param_dtype is not None else None)
        kwargs: dict[str, Any] = dict(
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_strategy=ShardingStrategy[self.options.strategy],
            mixed_precision=mixed,
            cpu_offload=CPUOffload(offload_params=self.options.cpu_offload),
            device_id=self.device,
            use_orig_params=True,
        )
        kwargs.update(extra)
        wrapped = wrapper_class(model, **kwargs)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
        return wrapped, optimizer

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = synthetic_batch(step, GLOBAL_BATCH, MODEL_CONFIG, self.device)
        per_rank = GLOBAL_BATCH // self.world_size
        start = self.rank * per_rank
        return tokens[start:start + per_rank], targets[start:start + per_rank]

    def step(self, model: FSDP, optimizer: torch.optim.Optimizer, step: int) -> float:
        tokens, targets = self.batch(step)
        logits = model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        return value.item() / self.world_size

    def train(self, model: FSDP, optimizer: torch.optim.Optimizer, steps: range, label: str,
              checkpoint_at: int | None = None) -> list[float]:
        losses = []
        for step in steps:
            started = time.perf_counter()
            losses.append(self.step(model, optimizer, step))
            elapsed = time.perf_counter() - started
            done = step + 1
            bar = "#" * done + "-" * (self.options.steps - done)
            self.log(f"[{bar}] {label} step {done}/{self.options.steps}  loss {losses[-1]:.5f}  "
                     f"step time {elapsed * 1000:.0f} ms  peak memory {_peak_memory_mib(self.device):.0f} MiB")
            if checkpoint_at is not None and done == checkpoint_at:
                self.save(model, optimizer, done)
        return losses

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Save into a fresh directory; switch the ``latest`` marker only after every rank returned.

        A save killed midway into an existing checkpoint's directory would leave new data under
        old metadata, which ``dcp.load`` reads without error: a fresh directory per checkpoint and
        a marker written last (atomically) mean a crash leaves the previous checkpoint in use.
        """
        directory = Path(broadcast_object(
            tempfile.mkdtemp(prefix=f"step-{step:06d}-", dir=self.checkpoint_dir) if self.rank == 0 else None))
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                                  FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            full = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        if self.rank == 0:
            torch.save(full, directory / "full.pt")
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sharded = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
        dcp.save(sharded, checkpoint_id=str(directory / "sharded"))
        dist.barrier()  # every rank has returned from both saves
        if self.rank == 0:
            _switch_latest(self.checkpoint_dir, directory)
        dist.barrier()  # nobody resumes before the marker names the new checkpoint
        self.log(f"saved FULL checkpoint {directory / 'full.pt'} and SHARDED checkpoint "
                 f"{directory / 'sharded'}; {self.checkpoint_dir / LATEST} now names {directory.name}")

    def resume(self) -> tuple[FSDP, torch.optim.Optimizer]:
        model, optimizer = self.build()
        directory = self.checkpoint_dir / (self.checkpoint_dir / LATEST).read_text().strip()
        # A fresh optimizer has no state yet, so its state dict could not serve as the template
        # that dcp.load fills in: give it zero state first (the loaded state replaces all of it).
        _give_optimizer_zero_state(optimizer)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=str(directory / "sharded"))
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state["optim"]))
        self.log(f"resumed a fresh model and optimizer from the SHARDED checkpoint {LATEST} names ({directory.name})")
        return model, optimizer

    # -- the whole run -----------------------------------------------------------------------

    def run(self) -> None:
        steps, half = self.options.steps, self.options.steps // 2
        precision = str(self.param_dtype).replace("torch.", "") if self.param_dtype else "fp32"
        self.log(f"fsdp_compat demo: {self.world_size} ranks on {self.device.type}, strategy "
                 f"{self.options.strategy}, mixed precision {precision}, cpu offload {self.options.cpu_offload}")
        with self._checkpoint_directory() as directory:
            self.checkpoint_dir = directory
            model, optimizer = self.build()
            self.log(f"model: {sum(p.numel() for p in model.parameters()) * self.world_size:,} "
                     f"parameters (sharded), {len(FSDP.fsdp_modules(model))} FSDP units")
            uninterrupted = self.train(model, optimizer, range(steps), "train", checkpoint_at=half)
            del model, optimizer
            model, optimizer = self.resume()
            resumed = self.train(model, optimizer, range(half, steps), "resume")
        matches = resumed == uninterrupted[half:]
        self.log(f"summary: final loss {uninterrupted[-1]:.5f}; resumed run "
                 f"{'matches' if matches else 'DOES NOT match'} the uninterrupted one "
                 f"(steps {half + 1}-{steps}, max |difference| "
                 f"{max(abs(a - b) for a, b in zip(resumed, uninterrupted[half:])):.3g})")
        if self.options.compare_fsdp1:
            self.compare_with_fsdp1(uninterrupted)
        if not matches:
            raise RuntimeError("the run resumed from the sharded checkpoint diverged from the uninterrupted run")

    def compare_with_fsdp1(self, ours: list[float]) -> None:
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        except ImportError:
            self.log("torch FSDP1 is not available in this torch; skipping --compare-fsdp1")
            return
        if self.options.cpu_offload and self.device.type == "cpu":
            self.log("torch FSDP1 cannot offload parameters on a CPU-only machine; comparing without offload")
        model, optimizer = self.build(TorchFSDP, cpu_offload=None)
        theirs = [self.step(model, optimizer, step) for step in range(self.options.steps)]
        self.log("step  fsdp_compat     torch FSDP1     difference")
        for step, (a, b) in enumerate(zip(ours, theirs), start=1):
            self.log(f"{step:4d}  {a:.7f}  {b:.7f}  {a - b:+.2e}")
        if self.param_dtype is not None:
            self.log(f"(compute in {self.param_dtype}: low-precision rounding lets the two engines "
                     "drift apart by about 1e-3 after a few steps; with --mixed-precision none they "
                     "agree exactly)")

    @contextlib.contextmanager
    def _checkpoint_directory(self):
        if self.options.checkpoint_dir:
            path = Path(self.options.checkpoint_dir)
            path.mkdir(parents=True, exist_ok=True)
            yield path
            return
        # Rank 0 makes the temporary directory; every rank must use the same one.
        name = broadcast_object(tempfile.mkdtemp(prefix="fsdp_compat_demo_") if self.rank == 0 else None)
        try:
            yield Path(name)
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(name, ignore_errors=True)


def _switch_latest(checkpoint_dir: Path, directory: Path) -> None:
    """Point the ``latest`` marker at ``directory``: written aside, then renamed over the old
    marker (atomic), so a reader sees the old name or the new one, never half of either."""
    pending = checkpoint_dir / (LATEST + ".pending")
    pending.write_text(directory.name + "\n")
    os.replace(pending, checkpoint_dir / LATEST)


@torch.no_grad()
def _give_optimizer_zero_state(optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients and a zero learning rate: creates every state entry, moves nothing."""
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, learning_rate in zip(optimizer.param_groups, learning_rates):
        group["lr"] = learning_rate


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
            run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), options)
        else:
            mp.spawn(_spawned_rank, args=(options.nproc, _free_port(), options), nprocs=options.nproc)
    except Exception as error:  # a rank failed: say so clearly and exit non-zero
        message = str(error).strip().splitlines()
        print(f"fsdp_compat demo FAILED: {message[-1] if message else type(error).__name__}", file=sys.stderr)
        if os.environ.get("FSDP_COMPAT_DEMO_TRACEBACK"):
            traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    exit_without_finalizing(main())  # under torchrun this process is a rank
