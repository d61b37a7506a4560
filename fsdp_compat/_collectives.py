"""Object collectives: torch's where they match ours, ours where torch's cost more collectives."""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist


def communication_device(group: Any = None) -> torch.device:
    """Where tensors must live to be sent over ``group`` (its backend's device)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(value: Any, group: Any = None) -> Any:
    """Group rank 0's ``value`` on all ranks of ``group`` (rank 0 gets ``value`` itself back): two broadcasts."""
    objects = [value if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(objects, group=group, group_src=0, device=communication_device(group))
    return objects[0]


def same_on_all_ranks(value: Any, group: Any = None) -> bool:
    """Whether every rank of ``group`` holds a pickled-identical ``value``: one all-gather of
    digests, where ``dist.all_gather_object`` needs two (sizes, then payloads) of whole objects."""
    digest = torch.tensor(list(hashlib.sha256(pickle.dumps(value)).digest()), dtype=torch.uint8,
                          device=communication_device(group))
    everyone = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, digest, group=group)
    return all(torch.equal(other, digest) for other in everyone)


# Exception types an agreement re-raises on the ranks whose own checks passed (the failing rank's
# type, so that ``except KeyError`` works everywhere); any other becomes RuntimeError. A subclass
# comes before its base (NotImplementedError is a RuntimeError).
_AGREED_TYPES: tuple[type[Exception], ...] = (NotImplementedError, RuntimeError, ValueError, KeyError, TypeError,
                                              AssertionError, IndexError)
_MESSAGE_BYTES = 2048  # how much of the failing rank's message the other ranks repeat


@contextlib.contextmanager
def all_ranks_agree(groups: Sequence[Any], subject: str, consequence: str) -> Iterator[None]:
    """If the enclosed checks raise on any rank of ``groups`` (which together span every rank
    concerned), raise on all: a check failing on one rank only would leave the others waiting in
    the next collective. The failing rank re-raises its own exception; the others one of its type,
    ``"{subject} is invalid on rank(s) [...]"`` with the first failing rank's message and
    ``consequence``. Costs one small all-reduce per group when all passed."""
    error: Exception | None = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001 - every failure is agreed on, then re-raised
        error = caught
    if dist.is_initialized() and groups:
        raise_agreed(agreement_codes(error, groups), error, groups, subject, consequence)
    if error is not None:
        raise error


def failure_code(error: Exception | None) -> int:
    """This rank's outcome of its checks, as the agreement exchanges it: 0 passed, else its type's code."""
    if error is None:
        return 0
    return 1 + next((index for index, agreed in enumerate(_AGREED_TYPES) if isinstance(error, agreed)), 1)


def agreement_codes(error: Exception | None, groups: Sequence[Any]) -> torch.Tensor:
    """Every global rank's :func:`failure_code` (a CPU tensor indexed by rank): one all-reduce per group.
    A caller with an all-reduce of its own over the same ranks can carry the codes in it instead."""
    return _per_rank(failure_code(error), groups)


def raise_agreed(codes: torch.Tensor, error: Exception | None, groups: Sequence[Any], subject: str,
                 consequence: str) -> None:
    """Given every rank's code, raise on every rank if any rank's checks failed (as :func:`all_ranks_agree`)."""
    failed = codes.nonzero().flatten().tolist()
    if not failed:
        return
    message = _first_failure_message(error if dist.get_rank() == failed[0] else None, groups)
    if error is not None:
        raise error
    raise _AGREED_TYPES[int(codes[failed[0]]) - 1](
        f"{subject} is invalid on rank(s) {failed} (there: {message}); {consequence}.")


def _per_rank(value: int, groups: Sequence[Any]) -> torch.Tensor:
    """Every global rank's ``value`` (a CPU tensor indexed by rank), by an all-reduce along each group in turn."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=communication_device(groups[0]))
    values[dist.get_rank()] = value
    for group in groups:
        dist.all_reduce(values, group=group)
    return values.cpu()


def ranks_where(flag: bool, groups: Sequence[Any]) -> list[int]:
    """Global ranks, across ``groups``, on which ``flag`` is set."""
    return _per_rank(int(flag), groups).nonzero().flatten().tolist()


def _first_failure_message(error: Exception | None, groups: Sequence[Any]) -> str:
    """``error``'s message (given on one rank only) on every rank; the failure path only."""
    device = communication_device(groups[0])
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if error is not None:
        # A KeyError's str() is the repr of its message: relay the message itself.
        detail = error.args[0] if len(error.args) == 1 and isinstance(error.args[0], str) else str(error)
        encoded = f"{type(error).__name__}: {detail}".encode()[:_MESSAGE_BYTES]
        text[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    for group in groups:
        dist.all_reduce(text, group=group)
    return bytes(text.cpu().tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
