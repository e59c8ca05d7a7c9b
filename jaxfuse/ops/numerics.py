"""How XLA rounds a multi-operation epilogue on each platform, so the kernel can
round the same way (csrc/epilogue_scalar.h has the arithmetic).

`contract`: `v * s + t` is one fused multiply-add. `narrow_each_op`: float16 /
bfloat16 round to the narrow type after every operation (otherwise: computed
in float32, rounded once). Each entry says where it comes from; the tests in
tests/ops/test_epilogue_numerics.py (CPU) and tests/ops/test_gpu.py (CUDA) compare the
kernel with XLA on that platform and fail when an entry is wrong.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import isa as _isa


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
# Measured: XLA:CPU targeting AVX-512 on a CPU with AVX512-FP16 (jax 0.10.2)
# computes float16 natively: each operation rounded to float16, and `v * s + t`
# one float16 FMA (0 of 4096 differ from that model in every epilogue form;
# 567 of 4096 x*s+t differ from rounding the product). bfloat16 is unchanged.
# Held to AVX2 on the same host it rounds per operation without contracting.
_CPU_FLOAT16_NATIVE = Rounding(True, True, "measured on XLA:CPU with AVX512-FP16 (jax 0.10.2)")


def cpu_contracts(level: str) -> bool:
    """Whether XLA:CPU contracts a multiply into an add when it targets ISA
    `level` (jaxfuse/ops/isa.py): on x86-64 from AVX2, which brings FMA; other machines
    (AArch64) always have fused multiply-add and are assumed to contract too."""
    return _isa.has_avx2(level) or not _isa.is_x86(level)


def cpu_contracts_here() -> bool:
    """`cpu_contracts` for the level XLA targets in this process."""
    return cpu_contracts(_isa.target_level_here())


# Measured: XLA:GPU on an H200 (jax 0.11.2) gave float32 relu(x*s+t) the same
# bits with and without a fusion barrier between mul and add: no contraction.
_CUDA_F32 = Rounding(False, True, "measured on XLA:GPU, H200, jax 0.11.2")
# Not yet measured on a GPU: float64 assumed like float32; float16/bfloat16
# assumed rounded per operation like XLA:CPU. tests/ops/test_gpu.py checks both.
_CUDA_OTHER = Rounding(False, True, "assumed (like float32 / like XLA:CPU); checked by tests/ops/test_gpu.py")


# Measured (jax 0.11.2, XLA:CPU targeting AVX-512; tests/ops/test_epilogue.py and
# benchmarks/results/cpu-avx512-position-rounding-2026-12-03.txt): where a
# per-channel operand repeats along the rows while varying along an innermost
# dimension of 3 or 7, LLVM vectorizes XLA's loop across groups of rows, with a
# multiply 8 lanes wide feeding an add 16 wide for the last channel, which it
# then does not contract; the remainder rows it does. So whether `v * s + t`
# rounds once depends on the element's position, and no kernel rounds as that
# loop does. (jax 0.10.2 contracted every element; the rule does not rely on that.)
_CPU_POSITIONAL_CHANNELS = frozenset({3, 7})


def _cpu_rounding(dtype, level: str) -> Rounding:
    """How XLA:CPU rounds `dtype` when it targets ISA `level`."""
    if dtype == np.float16 and _isa.native_float16(level, _isa.host_flags()):
        return _CPU_FLOAT16_NATIVE
    if dtype not in _WIDE:
        return _CPU_NARROW
    return _CPU_WIDE if cpu_contracts(level) else _CPU_WIDE_NO_FMA


def cpu_contracts_dtype(dtype, level: str | None = None) -> bool:
    """Whether XLA:CPU targeting ISA `level` (None: this process's) contracts a
    product of `dtype` values into an add."""
    return _cpu_rounding(np.dtype(dtype), level or _isa.target_level_here()).contract


def _is_one(d) -> bool:
    return isinstance(d, (int, np.integer)) and d == 1


def cpu_positional_channels(dtype, out_shape, level: str | None = None):
    """Where XLA:CPU's loop over `out_shape` may contract products in some
    elements and not others, given an operand that repeats along the rows while
    varying along the innermost dimension: (innermost dim, the other dims of
    more than one element); None where it rounds every element alike."""
    level = level or _isa.target_level_here()
    if level != "avx512" or not cpu_contracts_dtype(dtype, level):
        return None
    dims = [i for i, d in enumerate(out_shape) if not _is_one(d)]
    if len(dims) < 2 or not isinstance(out_shape[dims[-1]], int) \
            or out_shape[dims[-1]] not in _CPU_POSITIONAL_CHANNELS:
        return None
    return dims[-1], dims[:-1]


def cpu_rounds_by_position(dtype, out_shape, operand_shapes, level: str | None = None) -> str | None:
    """Why XLA:CPU's own loop would round `v * s + t` differently from element
    to element at this site (None: uniformly). `operand_shapes`: the shapes
    the fused op reads, broadcast numpy-style to `out_shape`; `level`: the ISA
    XLA targets (None: this process's)."""
    found = cpu_positional_channels(dtype, out_shape, level)
    if found is None:
        return None
    inner, rows = found
    rank = len(out_shape)
    for shape in operand_shapes:
        aligned = (1,) * (rank - len(shape)) + tuple(shape)
        if not _is_one(aligned[inner]) and any(_is_one(aligned[d]) for d in rows):
            return (f"XLA:CPU targeting AVX-512 vectorizes a loop whose operand repeats every "
                    f"{out_shape[inner]} elements across groups of rows and contracts "
                    f"`v * s + t` in some channels but not others, so its rounding depends on "
                    f"the element's position, which no kernel reproduces")
    return None


def rounding(platform: str, dtype) -> Rounding:
    dtype = np.dtype(dtype)
    if platform == "cpu":
        return _cpu_rounding(dtype, _isa.target_level_here())
    if platform == "cuda":
        return _CUDA_F32 if dtype == np.float32 else _CUDA_OTHER
    # Other platforms lower to XLA's own ops, which round as that platform does.
    return Rounding(False, True, f"{platform}: XLA's own ops, no kernel")
