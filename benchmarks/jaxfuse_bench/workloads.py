"""What is timed: the modes, the op-level workloads, their inputs and byte counts,
and how a program is inspected (fused sites, custom calls, XLA's byte count,
the compiled program's memory).

Op-level modes (``add_relu``, ``bias_add_relu``)
-------------------------------------------------
* ``unfused`` -- two separately compiled executables, ``jax.jit(jnp.add)`` then
  ``jax.jit(lambda y: jnp.maximum(y, 0))``, called one after the other: the sum
  is materialized in device memory between them (written by the first, read
  back by the second), as in a naive engine.  For equal shapes ``jnp.add`` is
  exactly ``lax.add``; for the bias form it also broadcasts the bias.
* ``xla`` -- ``jax.jit(f)`` with ``f = relu(a + b)``: XLA fuses it itself.
* ``jaxfuse`` -- ``jaxfuse.optimize(f, policy="always")`` of the very same
  ``f``: the pass turns add->relu into our custom call *unconditionally*, so
  this mode measures the kernel.  (Under the default ``policy="auto"`` the cost
  model would decline the small sizes and the program would be XLA's own; the
  model-level workloads, ``jaxfuse_bench.models``, time that policy.)

Model-level modes are ``xla``, ``jaxfuse`` (``policy="auto"``, the default a
user gets), ``jaxfuse-always`` (``policy="always"``) and ``jaxfuse-inexact``
(``policy="auto", exact=False``); see ``models``.

Op workloads
------------
* ``add_relu``       ``relu(a + b)``, ``a`` and ``b`` of one shape.
* ``bias_add_relu``  ``relu(x + bias)``, ``x: (N, C)``, ``bias: (C,)``.  An
  integer size ``n`` becomes ``(n // 1024, 1024)``.

Bytes moved (analytic)
----------------------
For ``a`` of ``n`` elements and ``b`` of ``m`` (``m = n`` plain, ``m = C`` bias),
itemsize ``s``:  fused = ``(2n + m) s`` (read a, read b, write out: 3 passes
for the plain op); unfused = ``(4n + m) s`` (add reads a and b and writes the
sum, relu reads it back and writes the result: 5 passes for the plain op).
XLA's own ``cost_analysis()["bytes accessed"]`` is recorded beside it as
``xla_bytes``.

Memory (as XLA reports it)
--------------------------
``Compiled.memory_analysis()`` of the very program that is timed: its temp
(scratch buffers, intermediates included), argument, output and alias bytes,
and the peak where the backend reports one (``memory_stats``).  They come from
the compiler's buffer assignment, not from a measurement: deterministic for a
program, so reported exactly.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxfuse
from jaxfuse.fusion.patterns import epilogues as _epilogues
from jaxfuse.fusion.tuning import hlo_memory

OP_MODES = ("unfused", "xla", "jaxfuse")
MODEL_MODES = ("xla", "jaxfuse", "jaxfuse-always", "jaxfuse-inexact")
MODES = ("unfused", "xla", "jaxfuse", "jaxfuse-always", "jaxfuse-inexact")
JAXFUSE_MODES = ("jaxfuse", "jaxfuse-always", "jaxfuse-inexact")
OP_WORKLOADS = ("add_relu", "bias_add_relu")
BIAS_WIDTH = 1024
COPY = "copy"


def policy_of(mode: str, kind: str) -> str | None:
    """The ``jaxfuse.optimize`` policy a mode runs with (None: plain XLA)."""
    if mode == "jaxfuse-always":
        return "always"
    if mode == "jaxfuse":
        return "always" if kind == "op" else "auto"
    if mode == "jaxfuse-inexact":
        return "auto"
    return None


def exact_of(mode: str) -> bool:
    """The ``exact`` a mode runs with: False only for ``jaxfuse-inexact``."""
    return mode != "jaxfuse-inexact"


# Names of our FFI targets (see jaxfuse/ops/kernels.py); used to check that a
# jaxfuse mode really lowered to our custom calls.
TARGETS = (jaxfuse.ops.kernels.TARGET, jaxfuse.ops.kernels.EPILOGUE_TARGET)
_CUSTOM_CALL_RE = re.compile(
    r"custom_call\s*@(?:" + "|".join(map(re.escape, TARGETS)) + r")\b"
    r"|call_target_name\s*=\s*\"(?:" + "|".join(map(re.escape, TARGETS)) + ')"'
)


def count_custom_calls(text: str) -> int:
    """jaxfuse custom calls (either target) in a lowered module's text."""
    return len(_CUSTOM_CALL_RE.findall(text))


# ----------------------------------------------------------------- the programs
relu = jax.nn.relu


def add_relu_f(a, b):
    """The one function both the ``xla`` and the ``jaxfuse`` modes compile."""
    return relu(a + b)


def fuse(f: Callable, policy: str = "always", rules=(), exact: bool = True) -> Callable:
    """A jaxfuse mode: the optimization pass applied to ``f``, with the
    registered patterns and ``rules`` (user rules a workload asks for)."""
    if not rules:
        return jaxfuse.optimize(f, policy=policy, exact=exact)
    from jaxfuse.fusion import registered_patterns

    return jaxfuse.optimize(f, policy=policy, exact=exact,
                            patterns=[*registered_patterns(), *rules])


# The two halves of the ``unfused`` mode: two executables, the sum materialized.
unfused_add = jax.jit(jnp.add)
unfused_relu = jax.jit(lambda y: jnp.maximum(y, 0))
xla_add_relu = jax.jit(add_relu_f)


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _batchnorm(x, p, eps=1e-5):
    # Inference form: running statistics folded into one scale and one shift.
    scale = p["gamma"] * lax.rsqrt(p["var"] + eps)
    shift = p["beta"] - p["mean"] * scale
    return x * scale + shift


def resnet_block(x, params):
    """conv -> BN -> ReLU -> conv -> BN -> (+ x) -> ReLU, NHWC."""
    h = relu(_batchnorm(_conv(x, params["w1"]), params["bn1"]))
    h = _batchnorm(_conv(h, params["w2"]), params["bn2"])
    return relu(h + x)


def init_resnet_params(key, channels: int, dtype) -> dict:
    ks = jax.random.split(key, 10)
    std = math.sqrt(2.0 / (9 * channels))

    def w(k):
        return (jax.random.normal(k, (3, 3, channels, channels), jnp.float32) * std).astype(dtype)

    def bn(k1, k2, k3, k4):
        n = lambda k: jax.random.normal(k, (channels,), jnp.float32)  # noqa: E731
        return {
            "gamma": (1.0 + 0.1 * n(k1)).astype(dtype),
            "beta": (0.1 * n(k2)).astype(dtype),
            "mean": (0.1 * n(k3)).astype(dtype),
            "var": (1.0 + 0.1 * jnp.abs(n(k4))).astype(dtype),
        }

    return {"w1": w(ks[0]), "w2": w(ks[1]), "bn1": bn(*ks[2:6]), "bn2": bn(*ks[6:10])}


# ------------------------------------------------------------------- shapes
def op_shapes(workload: str, size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape of a, shape of b) for an op workload and a size (int or shape tuple)."""
    shape = (int(size),) if isinstance(size, (int, np.integer)) else tuple(int(d) for d in size)
    if workload == "add_relu":
        return shape, shape
    if workload == "bias_add_relu":
        if len(shape) == 1:
            n = shape[0]
            c = BIAS_WIDTH if n >= BIAS_WIDTH and n % BIAS_WIDTH == 0 else n
            shape = (n // c, c)
        return shape, (shape[-1],)
    raise ValueError(f"not an op workload: {workload!r}")


# ------------------------------------------------------------------- bytes
def analytic_bytes(mode: str, a_shape, b_shape, itemsize: int) -> int:
    """Bytes an ideal implementation of ``mode`` moves (see the module docstring)."""
    n, m = math.prod(a_shape), math.prod(b_shape)
    if mode == "unfused":
        return (4 * n + m) * itemsize
    if mode in ("xla", "jaxfuse", "jaxfuse-always"):
        return (2 * n + m) * itemsize
    if mode == COPY:
        return 2 * n * itemsize
    raise ValueError(f"unknown mode {mode!r}")


def resnet_bytes(x_shape, itemsize: int) -> int:
    """Traffic of a fully fused ResNet block: x read twice, h written and read,
    the output written, both 3x3 weight tensors read."""
    n, c = math.prod(x_shape), x_shape[-1]
    return (5 * n + 2 * 9 * c * c) * itemsize


def bytes_accessed(cost) -> float | None:
    """``"bytes accessed"`` out of ``Compiled.cost_analysis()``, whatever its shape:
    a dict (current jax), a list of per-program dicts (older jax), or None.
    None when absent or negative (XLA's "unknown", as for a custom call)."""
    if cost is None:
        return None
    if isinstance(cost, (list, tuple)):
        vals = [bytes_accessed(c) for c in cost]
        vals = [v for v in vals if v is not None]
        return float(sum(vals)) if vals else None
    if isinstance(cost, dict):
        v = cost.get("bytes accessed")
        try:
            v = None if v is None else float(v)
        except (TypeError, ValueError):
            return None
        # XLA reports -1 when it cannot cost an op (e.g. our custom call).
        return v if v is not None and v >= 0 else None
    return None


# memory_stats keys -> CompiledMemoryStats attributes.  "peak" is absent from
# some backends and versions; it is then None.
MEMORY_FIELDS = {
    "temp": "temp_size_in_bytes",
    "argument": "argument_size_in_bytes",
    "output": "output_size_in_bytes",
    "alias": "alias_size_in_bytes",
    "peak": "peak_memory_in_bytes",
}


def memory_stats(analysis) -> dict[str, int | None] | None:
    """``{"temp", "argument", "output", "alias", "peak"}`` in bytes out of
    ``Compiled.memory_analysis()``, whatever its shape: what it returns differs
    by backend and version (an object with ``*_in_bytes`` attributes, a list of
    one per program, None).  A field not reported (or negative) is None; None
    when there is no temp figure at all, the one the comparisons need."""
    if isinstance(analysis, (list, tuple)):
        # One program per executable: more than one has no single figure.
        analysis = analysis[0] if len(analysis) == 1 else None
    if analysis is None:
        return None
    out: dict[str, int | None] = {}
    for key, attr in MEMORY_FIELDS.items():
        v = analysis.get(attr) if isinstance(analysis, dict) else getattr(analysis, attr, None)
        try:
            v = None if v is None else int(v)
        except (TypeError, ValueError):
            v = None
        out[key] = v if v is not None and v >= 0 else None
    return out if out["temp"] is not None else None


@dataclass
class Inspection:
    xla_bytes: float | None
    custom_calls: int  # jaxfuse custom calls in the lowered module
    sites: int  # sites the pass fused (explain's `fused`; 0 for plain XLA)
    declined: int = 0  # sites safe to fuse that the cost model declined
    rejected: int = 0  # other candidate sites the pass left alone
    impl: str = "xla"
    fingerprint: str | None = None  # of the compiled program, names and debug info aside
    memory: dict[str, int | None] | None = None  # memory_stats of the compiled program


_DEBUG_SECTIONS = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}


def program_fingerprint(hlo_text: str) -> str:
    """A hash of a compiled HLO module's text without what does not change the
    program: source locations, metadata, the module's and instructions' names
    (renumbered in order of appearance).  Equal fingerprints: the same program."""
    import hashlib

    out, skip = [], False
    for ln in hlo_text.splitlines():
        if ln.strip() in _DEBUG_SECTIONS:
            skip = True
            continue
        if skip:
            skip = bool(ln.strip())
            continue
        out.append(ln)
    t = "\n".join(out)
    t = re.sub(r",?\s*metadata=\{[^{}]*\}", "", t)
    t = re.sub(r"^HloModule [^,\s]+", "HloModule m", t)
    names: dict[str, str] = {}
    t = re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), t)
    return hashlib.sha256(t.encode()).hexdigest()


# The built-in patterns, whose sites become our custom calls.
_BUILT_IN = frozenset(p.name for p in _epilogues.PATTERNS)


def impl_of(mode: str, custom_calls: int, sites: int, declined: int, rule_sites: int = 0) -> str:
    """What a record's program really ran:

    * ``xla``        a plain XLA mode;
    * ``kernel``     at least one jaxfuse custom call in the lowered program;
    * ``fallback``   sites fused, but no custom call: the kernels are not
                     available (or disabled) and the fused op lowered to XLA's ops;
    * ``rule``       only user rules (``jaxfuse.rule``) replaced sites: no custom call;
    * ``declined``   the cost model (``policy="auto"``) kept XLA's code at every site;
    * ``no-rewrite`` the pass found nothing to fuse: the program is XLA's own.
    """
    if mode not in JAXFUSE_MODES:
        return "xla"
    if custom_calls > 0:
        return "kernel"
    if sites > rule_sites:
        return "fallback"
    if rule_sites:
        return "rule"
    return "declined" if declined > 0 else "no-rewrite"


def inspect(fn: Callable, *args, mode: str = "xla", policy: str | None = None,
            plain: Callable | None = None) -> Inspection:
    """XLA's byte count and memory (``memory_stats``) for the jitted ``fn``, how
    many jaxfuse custom calls its lowering holds and, for a jaxfuse mode, what ``jaxfuse.explain`` says of the
    plain function ``plain`` under ``policy`` (fused / declined / rejected
    sites).  Lowering shares jit's cache, so timing ``fn`` later compiles nothing.
    Never raises: inspection must not sink a benchmark."""
    sites = declined = rejected = rule_sites = 0
    lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        lowered = lowerable.lower(*args)
    except Exception:  # noqa: BLE001 - inspection never sinks a benchmark (docstring)
        lowered = None
    # After the lowering: `auto` times a conv band's programs on its first
    # trace, and explain reports the stored decision (it never times).
    if policy is not None and plain is not None:
        try:
            rep = jaxfuse.explain(plain, *args, policy=policy)
            sites, declined = len(rep.fused), len(rep.declined_for_cost)
            rejected = len(rep.rejected) - declined
            # a user rule's replacement is no custom call of ours
            rule_sites = sum(1 for s in rep.fused if s.pattern not in _BUILT_IN)
        except Exception:  # noqa: BLE001 - inspection never sinks a benchmark (docstring)
            pass
    if lowered is None:
        return Inspection(None, 0, sites, declined, rejected,
                          impl_of(mode, 0, sites, declined, rule_sites))
    try:
        calls = count_custom_calls(lowered.as_text())
    except Exception:  # noqa: BLE001 - inspection never sinks a benchmark (docstring)
        calls = 0
    xb = fp = mem = compiled = None
    try:
        compiled = lowered.compile()
        xb = bytes_accessed(compiled.cost_analysis())
        fp = program_fingerprint(compiled.as_text())
    except Exception:  # noqa: BLE001 - inspection never sinks a benchmark (docstring)
        pass
    if compiled is not None:
        try:
            mem = memory_stats(compiled.memory_analysis())
            if mem is not None:
                mem.update(hlo_memory.figures_of(compiled))
        except Exception:  # noqa: BLE001 - inspection never sinks a benchmark (docstring)
            pass
    return Inspection(xb, calls, sites, declined, rejected,
                      impl_of(mode, calls, sites, declined, rule_sites), fp,
                      mem)


# ------------------------------------------------------------------- groups
@functools.lru_cache(maxsize=None)
def _generator(shapes: tuple, dtype_name: str, x64: bool):
    dtype = jnp.dtype(dtype_name)

    def gen(key):
        keys = jax.random.split(key, len(shapes))
        # Random normal data: half the sums are negative, so the ReLU does work,
        # and nothing is timed on zeros.
        return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes))

    return jax.jit(gen)


def make_input_sets(shapes, dtype, n_sets: int, seed: int = 0) -> list[tuple]:
    gen = _generator(tuple(tuple(s) for s in shapes), jnp.dtype(dtype).name,
                     bool(jax.config.jax_enable_x64))
    base = jax.random.key(seed)
    sets = [gen(jax.random.fold_in(base, i)) for i in range(n_sets)]
    jax.block_until_ready(sets)
    return sets


@dataclass
class Group:
    """One (workload, dtype, shape): the cases to time and what to record about them."""

    workload: str
    dtype: str
    shape: tuple[int, ...]
    elements: int
    cases: dict[str, Callable[[int], Any]]
    bytes: dict[str, int]
    kind: str = "op"  # "op" or "model"
    bytes_source: str = "analytic"
    inspections: dict[str, Inspection] = field(default_factory=dict)
    policies: dict[str, str | None] = field(default_factory=dict)
    buffer_sets: int = 1
    note: str = ""


def _cycle(sets):
    n = len(sets)
    return lambda i: sets[i % n]


def op_group(workload, size, dtype, modes, cache_bytes, *, seed=0, rotate=True) -> Group:
    from .timing import rotation_count

    modes = [m for m in OP_MODES if m in modes]
    a_shape, b_shape = op_shapes(workload, size)
    itemsize = jnp.dtype(dtype).itemsize
    working_set = analytic_bytes("xla", a_shape, b_shape, itemsize)
    n_sets = rotation_count(working_set, cache_bytes) if rotate else 1
    sets = make_input_sets([a_shape, b_shape], dtype, n_sets, seed)
    pick = _cycle(sets)
    fused = fuse(add_relu_f, policy_of("jaxfuse", "op")) if "jaxfuse" in modes else None

    builders = {
        "unfused": lambda i: unfused_relu(unfused_add(*pick(i))),
        "xla": lambda i: xla_add_relu(*pick(i)),
        "jaxfuse": lambda i: fused(*pick(i)),
    }
    group = Group(
        workload=workload,
        dtype=jnp.dtype(dtype).name,
        shape=a_shape,
        elements=math.prod(a_shape),
        cases={m: builders[m] for m in modes},
        bytes={m: analytic_bytes(m, a_shape, b_shape, itemsize) for m in modes},
        kind="op",
        policies={m: policy_of(m, "op") for m in modes},
        buffer_sets=n_sets,
    )
    args = sets[0]
    for m in modes:
        if m == "unfused":
            i1, i2 = inspect(unfused_add, *args), inspect(unfused_relu, args[0])
            xb = None if i1.xla_bytes is None or i2.xla_bytes is None else i1.xla_bytes + i2.xla_bytes
            # memory None: two executables have no one program's figures (the sum
            # between them is one's output and the other's argument, not a temp),
            # and adding them up would compare with nothing.
            group.inspections[m] = Inspection(xb, 0, 0)
        elif m == "xla":
            group.inspections[m] = inspect(xla_add_relu, *args)
        else:
            group.inspections[m] = inspect(fused, *args, mode=m, policy=policy_of(m, "op"),
                                           plain=add_relu_f)
    return group
