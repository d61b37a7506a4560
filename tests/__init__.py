"""fsdp_compat's tests. With ``FSDP_COMPAT_WITHOUT_FSDP1=1``, torch's FSDP1 is made absent in every
process that imports them (the pytest process and each spawned rank): see ``without_fsdp1.py``."""

import os
import platform

# The golden files hold torch FSDP1's numbers from one machine. x86 CPU kernels (ATen, oneDNN, MKL)
# round differently on AVX-512 than on AVX2, which moves bf16/fp16-rounded gradients by an ulp here
# and there: enough to fail the tight golden comparisons (no_sync checksums) on an AVX-512 machine.
# Every process of the tests (this one and each spawned rank) runs the AVX2 kernels the golden
# files were recorded with; live comparisons with FSDP1 run both sides on the same kernels anyway.
if platform.machine() in ("x86_64", "AMD64"):
    for _variable, _value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_CBWR", "AVX2")):
        os.environ.setdefault(_variable, _value)

if os.environ.get("FSDP_COMPAT_WITHOUT_FSDP1") == "1":
    from tests import without_fsdp1

    without_fsdp1.install()
