"""Run a script with torch's FSDP1 names switched to fsdp_compat, without changing the script.

    python -m fsdp_compat.run train.py --epochs 1          # instead of: python train.py --epochs 1
    python -m fsdp_compat.run -m my_package.train --epochs 1
    torchrun --nproc-per-node 2 -m fsdp_compat.run train.py --epochs 1
    accelerate launch -m fsdp_compat.run train.py --epochs 1

It calls :func:`fsdp_compat.patch_torch`, sets ``FSDP_COMPAT_PATCH_TORCH=1`` (so a process can tell
it is switched) and runs the script or module as ``__main__``. Processes a framework starts itself
without this launcher (Lightning with ``devices=N`` outside ``torchrun``) are not switched: launch
the ranks with ``torchrun -m fsdp_compat.run``, or call ``patch_torch()`` in the script.
"""

from __future__ import annotations

import os
import runpy
import sys

from .patch import patch_torch

PATCH_ENV = "FSDP_COMPAT_PATCH_TORCH"


def main(argv: list[str]) -> None:
    """Switch torch's FSDP1 names, then run ``argv`` (``script.py args`` or ``-m module args``)."""
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m fsdp_compat.run (script.py | -m module) [args ...]")
    os.environ[PATCH_ENV] = "1"
    patch_torch()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        # The script's directory comes first on sys.path, as with ``python script.py``.
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
