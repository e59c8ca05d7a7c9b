"""How XLA rounds a multi-operation epilogue on each platform, so the kernel can
round the same way (csrc/epilogue_scalar.h has the arithmetic).

`contract`: `v * s + t` is one fused multiply-add. `narrow_each_op`: float16 /
bfloat16 round to the narrow type after every operation (otherwise: computed
in float32, rounded once). Each entry says where it comes from; the tests in
tests/test_epilogue_numerics.py (CPU) and tests/test_gpu.py (CUDA) compare the
kernel with XLA on that platform and fail when an entry is wrong.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform as _platform
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rounding:
    contract: bool
    narrow_each_op: bool
    source: str


_WIDE = (np.dtype(np.float32), np.dtype(np.float64))

# Measured: XLA:CPU (jaxlib 0.10.2 and 0.11.2, x86-64 with FMA) contracted all
# 4096 float32 and float64 results of x*s+t, (x-m)*s+t and x*s+t+r; for float16
# and bfloat16 it rounded every operation to the narrow type (0 of 4096 differ).
# Held to an ISA without FMA (--xla_cpu_max_isa=SSE4_2 or AVX) it contracted none.
_CPU_WIDE = Rounding(True, True, "measured on XLA:CPU (jax 0.10.2, 0.11.2)")
_CPU_WIDE_NO_FMA = Rounding(False, True, "measured on XLA:CPU held to an ISA without FMA")
_CPU_NARROW = Rounding(False, True, "measured on XLA:CPU (jax 0.10.2, 0.11.2)")
# XLA's --xla_cpu_max_isa levels below AVX2, which is where FMA comes in.
_ISAS_WITHOUT_FMA = frozenset({"SSE4_2", "AVX"})


def _max_isa(xla_flags: str) -> str | None:
    found = re.findall(r"--xla_cpu_max_isa=([A-Za-z0-9_]+)", xla_flags or "")
    return found[-1].upper() if found else None


def _host_has_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "fma" in line.split(":", 1)[1].split()
    except OSError:
        pass
    try:  # elsewhere: numpy's own run-time CPU feature detection
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy < 2
        from numpy.core import _multiarray_umath as umath  # type: ignore[no-redef]
    return bool(getattr(umath, "__cpu_features__", {}).get("FMA3", True))


def cpu_contracts(xla_flags: str, machine: str, host_fma: bool) -> bool:
    """Whether XLA:CPU contracts a multiply into an add, given XLA_FLAGS, the
    machine and whether its CPU has FMA: on x86-64 where the ISA XLA targets
    (the host's, capped by `--xla_cpu_max_isa`) has FMA. Elsewhere (AArch64
    always has fused multiply-add) it is assumed to, as on x86-64 with FMA."""
    if machine.lower() not in ("x86_64", "amd64", "x86", "i686"):
        return True
    return _max_isa(xla_flags) not in _ISAS_WITHOUT_FMA and host_fma


@functools.lru_cache(maxsize=None)
def cpu_contracts_here() -> bool:
    """`cpu_contracts` for this process. XLA parses XLA_FLAGS once per process,
    when its first client is made; reading them once (at the first lowering,
    after that) follows it."""
    return cpu_contracts(os.environ.get("XLA_FLAGS", ""), _platform.machine(), _host_has_fma())
# Measured: XLA:GPU on an H200 (jax 0.11.2) gave float32 relu(x*s+t) the same
# bits with and without a fusion barrier between mul and add: no contraction.
_CUDA_F32 = Rounding(False, True, "measured on XLA:GPU, H200, jax 0.11.2")
# Not yet measured on a GPU: float64 assumed like float32; float16/bfloat16
# assumed rounded per operation like XLA:CPU. tests/test_gpu.py checks both.
_CUDA_OTHER = Rounding(False, True, "assumed (like float32 / like XLA:CPU); checked by tests/test_gpu.py")


def rounding(platform: str, dtype) -> Rounding:
    dtype = np.dtype(dtype)
    if platform == "cpu":
        if dtype not in _WIDE:
            return _CPU_NARROW
        return _CPU_WIDE if cpu_contracts_here() else _CPU_WIDE_NO_FMA
    if platform == "cuda":
        return _CUDA_F32 if dtype == np.float32 else _CUDA_OTHER
    # Other platforms lower to XLA's own ops, which round as that platform does.
    return Rounding(False, True, f"{platform}: XLA's own ops, no kernel")
