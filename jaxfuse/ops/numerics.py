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
import functools

import numpy as np

from .. import _reasons
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
# jaxlib 0.12.0.1 (AVX-512 without FP16, and held to AVX2 and SSE4.2): the same,
# except the loops `_POSITION_RULES` names (tests/test_epilogue.py and
# benchmarks/results/cpu-jax012-contraction-2026-12-04.txt).
_CPU_WIDE = Rounding(True, True, "measured on XLA:CPU (jax 0.10.2, 0.11.2, 0.12.0.1)")
_CPU_WIDE_NO_FMA = Rounding(False, True, "measured on XLA:CPU held to an ISA without FMA "
                                         "(jax 0.10.2, 0.11.2, 0.12.0.1)")
_CPU_NARROW = Rounding(False, True, "measured on XLA:CPU (jax 0.10.2, 0.11.2, 0.12.0.1)")
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


def xla_version() -> tuple[int, int]:
    """(major, minor) of the jaxlib, so the XLA, running in this process: (0, 12)."""
    return _jaxlib_version()


@functools.lru_cache(maxsize=None)
def _jaxlib_version() -> tuple[int, int]:
    import jaxlib

    parts = (jaxlib.__version__.split(".") + ["0", "0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)


@dataclasses.dataclass(frozen=True)
class PositionRule:
    """Where one XLA:CPU release's own loop rounds `v * s + t` by element
    position: the loops whose innermost dimension has one of `inner` elements,
    with more than one row, at the ISA `levels`, given an operand that
    `repeats` (see `_repeats`). `measured`: the jaxlib releases it was measured
    on; it holds for the releases from `since` (major, minor) up to the next
    rule's."""

    since: tuple[int, int]
    levels: frozenset
    inner: frozenset
    repeats: str
    measured: str


# Measured (jax 0.11.2, XLA:CPU targeting AVX-512; tests/ops/test_epilogue.py and
# benchmarks/results/cpu-avx512-position-rounding-2026-12-03.txt): where a
# per-channel operand repeats along the rows while varying along an innermost
# dimension of 3 or 7, LLVM vectorizes XLA's loop across groups of rows, with a
# multiply 8 lanes wide feeding an add 16 wide for the last channel, which it
# then does not contract; the remainder rows it does. So whether `v * s + t`
# rounds once depends on the element's position, and no kernel rounds as that
# loop does. (jax 0.10.2 contracted every element; the rule, measured on
# 0.11.2, is kept for 0.10 as well, where it only declines more.)
_POSITION_011 = PositionRule((0, 10), frozenset({"avx512"}), frozenset({3, 7}), "along rows",
                             "jax 0.10.2, 0.11.2")
# Measured (jax 0.12.0.1; benchmarks/results/cpu-jax012-contraction-2026-12-04.txt):
# XLA 0.12 no longer has LLVM contract every multiply-add of the module
# (0.10 / 0.11 compiled with fused multiply-add allowed everywhere: their
# optimized IR carries no `contract` flags, and x*s+t+r at 4x8 float32 is
# `vfmadd213ps` + `vaddps`); it marks each fmul / fadd `contract` instead, and
# where LLVM vectorizes the loop across rows (an innermost dimension of 3 to 8
# elements, the rows interleaved) the x86 back end drops the contraction for
# some vectors and keeps it for others: at 4x8 float32 x*s+t+r is `vmulps`,
# `vaddps`, `vaddps` (rounded twice), at 4x8 x*s+t still `vfmadd231ps`, and at
# 64x33x7 with a (33, 1) scale the last column is rounded and the others
# contracted. Seen with a per-channel operand (C,), a per-row one (R, 1) and
# (C, 1) in (N, C, W), for float32 and float64, targeting AVX-512 (at 4, 8, 16
# and 67 rows, not at 2, 3 or 5) and AVX2 (float32, 4 rows); at 8 elements only
# in loops of at most 8 rows or with an operand the same along the innermost
# dimension; never with only full-size and scalar operands, an innermost
# dimension of 2 or of 9 and more, or one row. Which loops LLVM vectorizes that
# way follows its cost model, so the rule takes every loop of that kind: an
# innermost dimension of 3 to 8, more than one row, an operand that repeats
# along some dimension and not all (it declines some loops XLA rounds alike,
# e.g. 512 rows of 8 with a (8,) scale: speed lost, never bits).
_POSITION_012 = PositionRule((0, 12), frozenset({"avx2", "avx512"}),
                             frozenset(range(3, 9)), "anywhere", "jax 0.12.0.1")
# Newest first: a jaxlib takes the first rule whose `since` it has reached.
_POSITION_RULES = (_POSITION_012, _POSITION_011)


def position_rule(version: tuple[int, int] | None = None) -> PositionRule:
    """The rule for jaxlib `version` (None: this process's). A release newer
    than every measured one takes the newest rule."""
    version = version or xla_version()
    for rule in _POSITION_RULES:
        if tuple(version) >= rule.since:
            return rule
    return _POSITION_RULES[-1]


POSITIONAL_ROUNDING = _reasons.ReasonKind(
    "xla-rounds-by-position",
    "XLA:CPU ({xla}, targeting {level}) vectorizes the loop over rows of {inner} elements "
    "across the rows, with an operand of shape {operand} repeated in it, and contracts "
    "`v * s + t` into a fused multiply-add in some elements and not others: its rounding "
    "depends on the element's position, which no kernel reproduces (measured on {measured})",
    exact_only=True)


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


def cpu_positional_channels(dtype, out_shape, level: str | None = None,
                            version: tuple[int, int] | None = None):
    """Where XLA:CPU's loop over `out_shape` may contract products in some
    elements and not others, given an operand that repeats along the rows:
    (innermost dim, the other dims of more than one element); None where it
    rounds every element alike. `level`: the ISA XLA targets, `version`: the
    jaxlib (None: this process's)."""
    level = level or _isa.target_level_here()
    rule = position_rule(version)
    if level not in rule.levels or not cpu_contracts_dtype(dtype, level):
        return None
    dims = [i for i, d in enumerate(out_shape) if not _is_one(d)]
    if len(dims) < 2 or not isinstance(out_shape[dims[-1]], (int, np.integer)) \
            or out_shape[dims[-1]] not in rule.inner:
        return None
    return dims[-1], dims[:-1]


def _repeats(rule: PositionRule, aligned, inner: int, rows) -> bool:
    """Whether an operand (its shape `aligned` to the output's rank) is one
    that makes `rule`'s loops round by position."""
    if rule.repeats == "along rows":  # varies along the innermost dim, repeats along a row
        return not _is_one(aligned[inner]) and any(_is_one(aligned[d]) for d in rows)
    varies = [not _is_one(aligned[d]) for d in (*rows, inner)]
    return any(varies) and not all(varies)  # neither full-size nor the same everywhere


def cpu_rounds_by_position(dtype, out_shape, operand_shapes, level: str | None = None,
                           version: tuple[int, int] | None = None):
    """Why XLA:CPU's own loop would round `v * s + t` differently from element
    to element at this site (a `jaxfuse._reasons.Reason`; None: uniformly).
    `operand_shapes`: the shapes the fused op reads, broadcast numpy-style to
    `out_shape`; `level`: the ISA XLA targets, `version`: the jaxlib's
    (major, minor) (None: this process's)."""
    level = level or _isa.target_level_here()
    found = cpu_positional_channels(dtype, out_shape, level, version)
    if found is None:
        return None
    inner, rows = found
    rule = position_rule(version)
    rank = len(out_shape)
    for shape in operand_shapes:
        aligned = (1,) * (rank - len(shape)) + tuple(shape)
        if _repeats(rule, aligned, inner, rows):
            v = version or xla_version()
            return POSITIONAL_ROUNDING(None, xla=f"jaxlib {v[0]}.{v[1]}", level=level,
                                       inner=out_shape[inner], operand=list(shape),
                                       measured=rule.measured)
    return None


def rounding(platform: str, dtype) -> Rounding:
    dtype = np.dtype(dtype)
    if platform == "cpu":
        return _cpu_rounding(dtype, _isa.target_level_here())
    if platform == "cuda":
        return _CUDA_F32 if dtype == np.float32 else _CUDA_OTHER
    # Other platforms lower to XLA's own ops, which round as that platform does.
    return Rounding(False, True, f"{platform}: XLA's own ops, no kernel")
