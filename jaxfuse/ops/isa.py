"""Which instruction set XLA:CPU generates code for in this process.

XLA:CPU compiles for the host's CPU, capped by `--xla_cpu_max_isa` in
XLA_FLAGS. That level decides what jaxfuse must follow:
  * whether XLA contracts `x * y + z` into a fused multiply-add (from AVX2,
    which brings FMA), so the kernels round the same way (jaxfuse/ops/numerics.py);
  * which vector path the CPU kernels take: a kernel faster than the code XLA
    is held to would make timings on an emulated ISA flatter it;
  * which measured thresholds the cost model may use (jaxfuse/fusion/policy/cost.py): XLA's
    float16 loops, for one, are far faster at 512 bits.

A fourth follows the host's features at the AVX-512 level: whether XLA
computes float16 natively (AVX512-FP16), which changes its rounding
(`native_float16`).

Levels, lowest first: "sse4_2", "avx", "avx2" (with FMA), "avx512". A machine
that is not x86-64 has its own name as its level ("aarch64", ...).
"""

from __future__ import annotations

import functools
import os
import platform as _platform
import re

X86_LEVELS = ("baseline", "sse4_2", "avx", "avx2", "avx512")
_X86_MACHINES = ("x86_64", "amd64", "x86", "i686")


def max_isa_flag(xla_flags: str) -> str | None:
    """The last `--xla_cpu_max_isa=NAME` in XLA_FLAGS, upper-cased (None: absent)."""
    found = re.findall(r"--xla_cpu_max_isa=([A-Za-z0-9_]+)", xla_flags or "")
    return found[-1].upper() if found else None


def _cap_level(name: str | None) -> str | None:
    """The level an `--xla_cpu_max_isa` name caps XLA at (None: no cap we know).
    XLA's names: SSE4_2, AVX, AVX2, AVX512, AVX512_VNNI, AVX512_BF16, AMX, ..."""
    if name is None:
        return None
    if name in ("SSE4_2", "AVX", "AVX2"):
        return name.lower()
    if name.startswith(("AVX512", "AMX", "AVX10")):
        return "avx512"
    return None


def host_level(flags: frozenset[str]) -> str:
    """The highest level a CPU with these /proc/cpuinfo flags runs."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    if "avx" in flags:
        return "avx"
    if "sse4_2" in flags:
        return "sse4_2"
    return "baseline"


def target_level(xla_flags: str, machine: str, flags: frozenset[str]) -> str:
    """The level XLA:CPU targets: the host's, capped by `--xla_cpu_max_isa`."""
    if machine.lower() not in _X86_MACHINES:
        return machine.lower()
    level = host_level(flags)
    cap = _cap_level(max_isa_flag(xla_flags))
    if cap is not None and X86_LEVELS.index(cap) < X86_LEVELS.index(level):
        return cap
    return level


def is_x86(level: str) -> bool:
    return level in X86_LEVELS


@functools.lru_cache(maxsize=None)
def host_flags() -> frozenset[str]:
    """The CPU's feature flags, as /proc/cpuinfo spells them (read once)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:  # elsewhere: numpy's own run-time CPU feature detection
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy < 2
        from numpy.core import _multiarray_umath as umath  # type: ignore[no-redef]
    features = getattr(umath, "__cpu_features__", {})
    names = {"SSE42": "sse4_2", "AVX": "avx", "AVX2": "avx2", "FMA3": "fma", "F16C": "f16c",
             "AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512VL": "avx512vl",
             "AVX512DQ": "avx512dq"}
    return frozenset(flag for key, flag in names.items() if features.get(key))


@functools.lru_cache(maxsize=None)
def host_model() -> str:
    """The CPU's model: its name in /proc/cpuinfo (on Arm, which names none,
    the implementer, part and variant of the first core), else what `platform`
    says."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break  # the first processor's block is enough
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    for key in ("model name", "cpu model", "Model"):
        if fields.get(key):
            return fields[key]
    if "CPU implementer" in fields:
        return " ".join(f"{k[4:]} {fields.get(k, '?')}" for k in
                        ("CPU implementer", "CPU part", "CPU variant", "CPU revision"))
    return _platform.processor() or _platform.machine()


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, as XLA's thread
    pool counts them), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def target_level_here() -> str:
    """`target_level` for this process. XLA parses XLA_FLAGS once per process,
    when its first client is made; reading them once (at the first use, after
    that) follows it."""
    return target_level(os.environ.get("XLA_FLAGS", ""), _platform.machine(), host_flags())


def native_float16(level: str, flags: frozenset[str]) -> bool:
    """Whether XLA:CPU computes float16 in float16 itself: where it targets
    AVX-512 on a CPU with AVX512-FP16 (Sapphire Rapids and later). Every
    `--xla_cpu_max_isa` cap from AVX512 up leaves that feature on (XLA's
    cpu_features.cc filters it only with the AVX-512 family, below AVX512);
    elsewhere LLVM widens each float16 operation to float32."""
    return level == "avx512" and "avx512_fp16" in flags


@functools.lru_cache(maxsize=None)
def native_float16_here() -> bool:
    """`native_float16` for this process."""
    return native_float16(target_level_here(), host_flags())


def has_avx2(level: str) -> bool:
    """Whether an x86 level includes AVX2 and FMA."""
    return level in ("avx2", "avx512")


def kernel_vector_path(level: str) -> str:
    """The CPU kernels' vector path for XLA's level: "avx2" (AVX2, FMA, F16C
    loops) where XLA itself may use AVX2, else "baseline" (plain x86-64 loops).
    The kernels' CPUID check still applies on top."""
    return "avx2" if has_avx2(level) else "baseline"
