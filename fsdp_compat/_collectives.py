"""Object collectives: torch's where they match ours, ours where torch's cost more collectives."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import torch
import torch.distributed as dist


def communication_device(group: Any = None) -> torch.device:
    """Where tensors must live to be sent over ``group`` (its backend's device)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(value: Any, group: Any = None, source_group_rank: int = 0) -> Any:
    """``value`` from the rank ``source_group_rank`` of ``group`` on every rank of ``group``
    (two broadcasts: size, then payload). The source gets ``value`` itself back."""
    objects = [value if dist.get_rank(group) == source_group_rank else None]
    dist.broadcast_object_list(objects, group=group, group_src=source_group_rank,
                               device=communication_device(group))
    return objects[0]


def same_on_all_ranks(value: Any, group: Any = None) -> bool:
    """Whether every rank of ``group`` holds an equal (pickled-identical) ``value``: compares digests.

    One all-gather of fixed-size digests; ``dist.all_gather_object`` would need two (sizes, then
    payloads) and send whole objects.
    """
    device = communication_device(group)
    digest = torch.tensor(list(hashlib.sha256(pickle.dumps(value)).digest()), dtype=torch.uint8,
                          device=device)
    everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, digest, group=group)
    return all(torch.equal(other, digest) for other in everyone)
