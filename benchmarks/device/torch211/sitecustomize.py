"""For one benchmark run on a lent GPU machine whose only torch is 2.11 (below fsdp_compat's range),
never for the package or its tests: ``PYTHONPATH=benchmarks/device/torch211`` makes Python import this at
start-up, and it adds the engine names the adapter needs from torch 2.13 where they are missing (a rehearsal
on 2.11, ``QUICK=1 bash benchmarks/device/run_issue35.sh``, found these three).

* ``FSDPState._fsdp_param_groups``: 2.13 keeps a list of parameter groups per unit; 2.11 one group or ``None``.
* ``FSDPParam._unsharded_dtensor_spec``: 2.13's spec of a parameter that was a ``DTensor`` (tensor
  parallelism) before sharding, else ``None``; 2.11 calls it ``_tp_spec`` and sets it only for such parameters.
* ``FSDPModule.reset_iter_state``: 2.13's recovery after a forward or backward that raised midway (the adapter
  calls it only then; a benchmark never does). The stand-in reshards what is unsharded and clears the
  iteration state, as 2.13's does, without 2.13's waits on in-flight collectives.
"""

from __future__ import annotations

import re

import torch

_release = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())  # type: ignore[union-attr]

if _release < (2, 13):
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

    if not hasattr(FSDPState, "_fsdp_param_groups"):
        FSDPState._fsdp_param_groups = property(  # type: ignore[attr-defined]
            lambda self: [self._fsdp_param_group] if self._fsdp_param_group is not None else [])

    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    if not hasattr(FSDPParam, "_unsharded_dtensor_spec"):
        FSDPParam._unsharded_dtensor_spec = property(  # type: ignore[attr-defined]
            lambda self: self._tp_spec if self.is_dtensor else None)

    if not hasattr(FSDPModule, "reset_iter_state"):
        def reset_iter_state(self: FSDPModule) -> None:
            state = self._get_fsdp_state()
            for each in state._state_ctx.all_states or [state]:
                group = each._fsdp_param_group
                if group is not None:
                    if group.is_unsharded:
                        group.reshard()
                    group._training_state = TrainingState.IDLE
                each._training_state = TrainingState.IDLE
            state._state_ctx.iter_forward_root = None

        FSDPModule.reset_iter_state = reset_iter_state  # type: ignore[attr-defined]
