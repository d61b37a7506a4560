"""``FSDP_COMPAT_WITHOUT_FSDP1=1`` really makes torch's FSDP1 absent (``tests/without_fsdp1.py``):
nothing can import or use FSDP1's class, ``wrap`` module or private modules, while the enums,
``fully_shard`` and ``torch.distributed.checkpoint`` stay usable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent("""
    import tests  # installs the mode, as in every test process
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType, fully_shard

    def refused(statement):
        try:
            exec(statement, globals())
        except ImportError as error:
            return "FSDP_COMPAT_WITHOUT_FSDP1=1" in str(error)
        return False

    assert refused("from torch.distributed.fsdp import FullyShardedDataParallel")
    assert refused("import torch.distributed.fsdp.wrap")
    assert refused("from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel")
    assert refused("import torch.distributed.fsdp._flat_param")
    assert refused("import torch.distributed.fsdp._optim_utils")
    fsdp1 = get_state_dict.__globals__["FSDP"]  # the reference DCP bound before the block
    for use in ("fsdp1(None)", "fsdp1.state_dict_type(None, None)", "fsdp1.optim_state_dict(None, None)"):
        assert refused(use), use
    assert fsdp1.fsdp_modules(None) == []  # what DCP asks: there are none
    print("absent")
""")


def test_fsdp1_cannot_be_imported_or_used_but_fsdp2_and_dcp_remain():
    env = {**os.environ, "FSDP_COMPAT_WITHOUT_FSDP1": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            check=False, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "absent", result.stderr
