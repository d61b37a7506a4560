"""Golden torch-FSDP1 LOCAL_STATE_DICT checkpoints (flat parameters), and the model they are of.

Regenerate with torch FSDP1 (torch <= 2.13 ships it)::

    PYTHONPATH=. python -m tests.fsdp1_local_golden

It writes, for ``use_orig_params`` False and True, at world size 2, into ``tests/golden/fsdp1_local``:

* ``uop{0,1}_rank{0,1}.pt``: each rank's ``torch.save`` of FSDP1's LOCAL state dict after two
  training steps (one ``ShardedTensor`` per unit, keyed ``..._flat_param``);
* ``uop{0,1}_expected.pt``: what FSDP1 itself shows after loading those files into a fresh model
  (``summon_full_params``, plus buffers): the values a loader must reproduce bit for bit.

:class:`OddNet` is made to exercise every rule of FSDP1's flat layout: odd parameter sizes
(``use_orig_params=True`` pads each parameter to 16 bytes), parameters registered on the root
before its children (order within a unit), a weight tied within a unit (flattened once), an
ignored module (left out), a unit nested inside a nested unit, and a unit of one element (fewer
than the ranks: rank 1's shard is all padding).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

GOLDEN_LOCAL_DIR = Path(__file__).parent / "golden" / "fsdp1_local"
WORLD_SIZE = 2
VOCAB, WIDTH, HIDDEN = 7, 3, 5


class Inner(nn.Module):
    """A unit nested inside the :class:`Outer` unit."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, WIDTH)  # 15 + 3 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, HIDDEN)  # 15 + 5
        self.norm = nn.LayerNorm(HIDDEN)  # 5 + 5
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(self.lin(x)))


class Gate(nn.Module):
    """A unit of one element: fewer than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class OddNet(nn.Module):
    """Tiny model with FSDP1-layout pitfalls (see module docstring). Units: root, ``outer``,
    ``outer.inner``, ``gate``; ``side`` is ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(WIDTH))  # the root's own: first in its flat parameter
        self.emb = nn.Embedding(VOCAB, WIDTH)  # 21 elements, tied to head.weight
        self.outer = Outer()
        self.gate = Gate()
        self.side = nn.Linear(WIDTH, WIDTH)  # ignored
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.mix
        x = self.gate(self.outer(x)) + self.side(x)
        return self.head(x) + self.offset


UNIT_CLASSES = (Outer, Inner, Gate)


def make_model(seed: int = 0) -> OddNet:
    """The seeded model (the converter's ``--model tests.fsdp1_local_golden:make_model``)."""
    torch.manual_seed(seed)
    return OddNet()


def train(model: nn.Module, steps: int = 2) -> None:
    """A few SGD steps on fixed data (every rank the same batch): values away from the seed's."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 5), generator=generator)
        model(tokens).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def golden_paths(use_orig_params: bool) -> tuple[list[Path], Path]:
    """Each rank's LOCAL checkpoint file, and FSDP1's full values after loading them."""
    stem = f"uop{int(use_orig_params)}"
    ranks = [GOLDEN_LOCAL_DIR / f"{stem}_rank{rank}.pt" for rank in range(WORLD_SIZE)]
    return ranks, GOLDEN_LOCAL_DIR / f"{stem}_expected.pt"


def load_local_file(path: Path | str) -> dict[str, Any]:
    """One rank's FSDP1 LOCAL file (``ShardedTensor`` values: needs the process group, and
    ``weights_only=False`` since torch's safe list has no ``ShardedTensor``)."""
    return torch.load(path, weights_only=False)


# ---- with torch FSDP1 ----


def fsdp1_wrap(model: OddNet, use_orig_params: bool, sharding_strategy: str = "FULL_SHARD",
               **kwargs: Any) -> nn.Module:
    """``model`` wrapped by torch FSDP1 into the units above (CPU or this rank's GPU)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from tests.differential import device

    warnings.filterwarnings("ignore")
    return FullyShardedDataParallel(
        model.to(device()), auto_wrap_policy=ModuleWrapPolicy(set(UNIT_CLASSES)),
        ignored_modules=[model.side], use_orig_params=use_orig_params, device_id=device(),
        sharding_strategy=getattr(ShardingStrategy, sharding_strategy), **kwargs)


def fsdp1_local_state_dict(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        return model.state_dict()


def fsdp1_full_values(model: nn.Module, state_dict: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """FSDP1's own reading of a LOCAL state dict: loaded into ``model``, shown by
    ``summon_full_params`` (clean names), buffers included. Without a state dict: ``model``'s own.

    With ``use_orig_params=True`` FSDP1 cannot load its own LOCAL state dicts strictly (the flat
    parameter is no module parameter then: "Unexpected key(s) ... _flat_param"); with
    ``strict=False`` it loads the per-parameter views of the flat shard saved next to it.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType

    from fsdp_compat._common import clean_name

    if state_dict is not None:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
            model.load_state_dict(state_dict, strict=not model._use_orig_params)
    with FullyShardedDataParallel.summon_full_params(model):
        values = {clean_name(n): p.detach().cpu().clone() for n, p in model.named_parameters()}
    values.update({clean_name(n): b.detach().cpu().clone() for n, b in model.named_buffers()})
    return values


def _write(use_orig_params: bool) -> None:
    ranks, expected_path = golden_paths(use_orig_params)
    writer = fsdp1_wrap(make_model(0), use_orig_params)
    train(writer)
    torch.save(fsdp1_local_state_dict(writer), ranks[dist.get_rank()])
    dist.barrier()
    reader = fsdp1_wrap(make_model(1), use_orig_params)
    expected = fsdp1_full_values(reader, load_local_file(ranks[dist.get_rank()]))
    written = fsdp1_full_values(writer)
    assert all(torch.equal(expected[k], written[k]) for k in written), "FSDP1 misread its checkpoint"
    if dist.get_rank() == 0:
        torch.save(expected, expected_path)
    dist.barrier()


def write_golden() -> None:
    """On each of 2 ranks: write both checkpoints (needs torch FSDP1)."""
    GOLDEN_LOCAL_DIR.mkdir(parents=True, exist_ok=True)
    for use_orig_params in (False, True):
        _write(use_orig_params)


if __name__ == "__main__":
    from fsdp_compat.testing import run_on_ranks

    run_on_ranks(write_golden, WORLD_SIZE)
    print(f"wrote {sorted(p.name for p in GOLDEN_LOCAL_DIR.iterdir())}")
