"""Convert LOCAL_STATE_DICT checkpoints in FSDP1's format (flat parameters) into ones any world size loads.

FSDP1's LOCAL checkpoints (one file per rank), and fsdp_compat's, which are in FSDP1's format, load only
at the world size and wrapping they were written with. This reads them with the model definition,
without FSDP1, and writes a FULL state dict file (``torch.save``, clean parameter names) or a
``torch.distributed.checkpoint`` directory.
Launch one process per rank file, as many as the checkpoint was written with::

    torchrun --nproc-per-node 2 -m fsdp_compat.convert --model mypkg.models:build_model \\
        --checkpoint 'checkpoints/local_rank{rank}.pt' --output model_full.pt

``--model`` names a function returning the unwrapped model; the units are read off the checkpoint,
modules ignored when it was written must be named (``--ignored-modules side.proj``). Files are read
with ``torch.load(weights_only=False)`` (``ShardedTensor`` needs it): convert only checkpoints you trust.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._collectives import communication_device
from ._common import exit_without_finalizing
from ._flat_checkpoint import FLAT_PARAM, flat_unit_paths
from .api import FullStateDictConfig, StateDictType
from .fully_sharded_data_parallel import FullyShardedDataParallel
from .wrap import CustomPolicy

__all__ = ["convert_local_checkpoint", "main"]

FORMATS = ("full", "dcp")


def convert_local_checkpoint(model: nn.Module, checkpoint: str | os.PathLike[str], output: str | os.PathLike[str],
                             *, output_format: str = "full", ignored_modules: Iterable[str] = (),
                             device: torch.device | str | None = None) -> None:
    """Read this rank's FSDP1 LOCAL checkpoint file into ``model`` and write a FULL or DCP one.

    Call on every rank of the default process group, of the checkpoint's world size.
    ``checkpoint``: this rank's file (``{rank}`` is replaced by the rank). ``output``: the FULL
    file (``output_format="full"``, written by rank 0) or the DCP directory (``"dcp"``).
    ``ignored_modules``: paths of the modules ignored when the checkpoint was written. ``model``
    is wrapped (and sharded) on the way; build a fresh one to train.
    """
    if output_format not in FORMATS:
        raise ValueError(f"output_format must be one of {FORMATS}, got {output_format!r}")
    if not dist.is_initialized():
        raise RuntimeError("convert_local_checkpoint needs the default process group, of the "
                           "checkpoint's world size (or run `python -m fsdp_compat.convert`)")
    device = torch.device(device) if device is not None else communication_device()
    state_dict = _load_rank_file(str(checkpoint), device)
    wrapped = _wrap_like_checkpoint(model, state_dict, ignored_modules, device)
    with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.LOCAL_STATE_DICT):
        wrapped.load_state_dict(state_dict)
    _save(wrapped, str(output), output_format)


def _load_rank_file(checkpoint: str, device: torch.device) -> dict[str, Any]:
    if dist.get_world_size() > 1 and "{rank}" not in checkpoint:
        raise ValueError(f"checkpoint {checkpoint!r} must name each rank's file with {{rank}} "
                         "(e.g. 'local_rank{rank}.pt'): an FSDP1 LOCAL checkpoint is one file per rank")
    path = checkpoint.replace("{rank}", str(dist.get_rank()))
    state_dict = torch.load(path, map_location=device, weights_only=False)
    if not flat_unit_paths(state_dict):
        raise ValueError(f"{path} holds no flat parameters (keys ending in {FLAT_PARAM!r}), so it is "
                         "not an FSDP1 LOCAL_STATE_DICT of a sharded model. (FSDP1 saves NO_SHARD "
                         "models' LOCAL state dicts as FULL ones: load it under FULL_STATE_DICT.)")
    return state_dict


def _wrap_like_checkpoint(model: nn.Module, state_dict: dict[str, Any], ignored_modules: Iterable[str],
                          device: torch.device) -> FullyShardedDataParallel:
    """``model`` wrapped into the units that the checkpoint has flat parameters for."""
    units = {id(_submodule(model, path, "the checkpoint has a unit"))
             for path in flat_unit_paths(state_dict).values() if path}
    ignored = [_submodule(model, path, "--ignored-modules names") for path in ignored_modules]
    return FullyShardedDataParallel(model, auto_wrap_policy=CustomPolicy(lambda module: id(module) in units),
                                    ignored_modules=ignored or None, device_id=device)


def _submodule(model: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{what} {path!r}, which the model has no module for: build the model the "
                         "checkpoint was written from") from None


def _save(wrapped: FullyShardedDataParallel, output: str, output_format: str) -> None:
    if output_format == "full":
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, config):
            state_dict = wrapped.state_dict()
        if dist.get_rank() == 0:
            torch.save(state_dict, output)
    else:
        import torch.distributed.checkpoint as dcp

        with FullyShardedDataParallel.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            dcp.save(wrapped.state_dict(), checkpoint_id=output)
    dist.barrier()


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (see the module docstring); starts a process group if there is none."""
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_compat.convert",
        description="Convert a torch FSDP1 LOCAL_STATE_DICT checkpoint (one file per rank, flat "
                    "parameters) into a FULL state dict file or a DCP directory that loads at any "
                    "world size. Launch with the checkpoint's world size (torchrun --nproc-per-node N).")
    parser.add_argument("--model", required=True, help="module:function returning the unwrapped model")
    parser.add_argument("--checkpoint", required=True, help="each rank's file, with {rank} in the name")
    parser.add_argument("--output", required=True, help="the FULL file or the DCP directory to write")
    parser.add_argument("--format", choices=FORMATS, default="full", help="full (torch.save) or dcp")
    parser.add_argument("--ignored-modules", nargs="*", default=[], metavar="PATH",
                        help="modules that were ignored (ignored_modules) when the checkpoint was written")
    parser.add_argument("--backend", default="gloo", help="process-group backend (default gloo: CPU)")
    args = parser.parse_args(argv)
    model = pkgutil.resolve_name(args.model)()
    started = not dist.is_initialized()
    if started and "MASTER_ADDR" not in os.environ:  # no torchrun: a one-rank checkpoint
        dist.init_process_group(args.backend, store=dist.HashStore(), rank=0, world_size=1)
    elif started:
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(args.backend)
    try:
        convert_local_checkpoint(model, args.checkpoint, args.output, output_format=args.format,
                                 ignored_modules=args.ignored_modules)
        if dist.get_rank() == 0:
            print(f"wrote {args.output} ({args.format})")
    finally:
        if started:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()
