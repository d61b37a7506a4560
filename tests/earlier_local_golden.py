"""Golden LOCAL_STATE_DICT checkpoints in the format fsdp_compat wrote before it wrote FSDP1's.

Until then, fsdp_compat's LOCAL state dict held each parameter under its clean name as a
``ShardedTensor`` of the parameter holding this rank's dim-0 ``torch.chunk`` piece (buffers and
ignored modules' parameters plain). Those checkpoints must keep loading. These files were written
by that code (commit fa2a290) at world size 2, by running this module with it on the path::

    PYTHONPATH=<checkout of fa2a290> python tests/earlier_local_golden.py

into ``tests/golden/earlier_local``: ``rank{0,1}.pt`` (each rank's ``torch.save``) and ``dcp/`` (the
same dicts through ``torch.distributed.checkpoint``), of :class:`tests.fsdp1_local_golden.OddNet`
holding FSDP1's values ``uop0_expected.pt`` (wrapped as the FSDP1 golden files, ``FULL_SHARD``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests import fsdp1_local_golden as fsdp1_golden

EARLIER_LOCAL_DIR = Path(__file__).parent / "golden" / "earlier_local"


def rank_path(rank: int) -> Path:
    return EARLIER_LOCAL_DIR / f"rank{rank}.pt"


def expected_values() -> dict[str, torch.Tensor]:
    """The values the files hold (FSDP1's golden ``use_orig_params=False`` values)."""
    return torch.load(fsdp1_golden.golden_paths(False)[1], weights_only=True)


def _write() -> None:
    import torch.distributed.checkpoint as dcp

    import fsdp_compat
    from fsdp_compat import FullyShardedDataParallel as FSDP
    from fsdp_compat.wrap import ModuleWrapPolicy

    model = fsdp1_golden.make_model(seed=1)
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(set(fsdp1_golden.UNIT_CLASSES)),
                   ignored_modules=[model.side])
    expected = expected_values()
    with FSDP.state_dict_type(wrapped, fsdp_compat.StateDictType.FULL_STATE_DICT):
        wrapped.load_state_dict(expected | {"head.weight": expected["emb.weight"]})
    with FSDP.state_dict_type(wrapped, fsdp_compat.StateDictType.LOCAL_STATE_DICT):
        state_dict = wrapped.state_dict()
    assert not any(key.endswith("_flat_param") for key in state_dict), "not the earlier format"
    torch.save(state_dict, rank_path(dist.get_rank()))
    dcp.save(state_dict, checkpoint_id=str(EARLIER_LOCAL_DIR / "dcp"))


if __name__ == "__main__":
    import sys

    sys.path.append(str(Path(__file__).parent.parent))  # for ``tests``; the fsdp_compat on PYTHONPATH wins
    from fsdp_compat.testing import run_on_ranks

    EARLIER_LOCAL_DIR.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_write, fsdp1_golden.WORLD_SIZE)
    print(f"wrote {sorted(p.name for p in EARLIER_LOCAL_DIR.iterdir())}")
