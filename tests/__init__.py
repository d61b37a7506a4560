"""fsdp_compat's tests. With ``FSDP_COMPAT_WITHOUT_FSDP1=1``, torch's FSDP1 is made absent in every
process that imports them (the pytest process and each spawned rank): see ``without_fsdp1.py``."""

import os

if os.environ.get("FSDP_COMPAT_WITHOUT_FSDP1") == "1":
    from tests import without_fsdp1

    without_fsdp1.install()
