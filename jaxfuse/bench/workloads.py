"""What is timed: the three modes, the workloads, their inputs and byte counts.

Modes
-----
* ``unfused`` -- two separately compiled executables, ``jax.jit(jnp.add)`` then
  ``jax.jit(lambda y: jnp.maximum(y, 0))``, called one after the other: the sum
  is materialized in device memory between them (written by the first, read
  back by the second), as in a naive engine.  For equal shapes ``jnp.add`` is
  exactly ``lax.add``; for the bias form it also broadcasts the bias.
* ``xla`` -- ``jax.jit(f)`` with ``f = relu(a + b)``: XLA fuses it itself.
* ``jaxfuse`` -- ``jaxfuse.optimize(f)`` of the very same ``f``: the pass turns
  add->relu into our custom call.

A "copy" case (``jax.jit(lax.neg)``: one read and one write per element, which
XLA can neither elide nor alias to the non-donated input -- unlike ``x + 0``,
``x * 1`` or an identity, which it simplifies or forwards) runs alongside every
op group, interleaved with the modes, to give the device's copy bandwidth at
the same size, dtype and moment.

Workloads
---------
* ``add_relu``       ``relu(a + b)``, ``a`` and ``b`` of one shape.
* ``bias_add_relu``  ``relu(x + bias)``, ``x: (N, C)``, ``bias: (C,)``.  An
  integer size ``n`` becomes ``(n // 1024, 1024)``.
* ``resnet_block``   a ResNet basic block in NHWC, BatchNorm in its *inference*
  form (running statistics folded into a per-channel scale and shift)::

      h = relu(bn1(conv3x3(x)))        # bn = h * scale + shift: an add -> relu
      y = relu(bn2(conv3x3(h)) + x)    # the residual add -> relu

  timed ``jax.jit`` vs ``jaxfuse.optimize``; ``unfused`` has no meaning for a
  whole graph and is not run for it.

Bytes moved (analytic)
----------------------
For ``a`` of ``n`` elements and ``b`` of ``m`` (``m = n`` plain, ``m = C`` bias),
itemsize ``s``:  fused = ``(2n + m) s`` (read a, read b, write out: 3 passes
for the plain op); unfused = ``(4n + m) s`` (add reads a and b and writes the
sum, relu reads it back and writes the result: 5 passes for the plain op);
copy = ``2 n s``.  For the ResNet block the estimate is the traffic of a fully
fused block: x read twice (conv1, residual), h written and read once, out
written once, plus both weight tensors = ``5 n s + 2 * 9 C^2 s``.  XLA's own
``cost_analysis()["bytes accessed"]`` is recorded beside it as ``xla_bytes``.
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

MODES = ("unfused", "xla", "jaxfuse")
OP_WORKLOADS = ("add_relu", "bias_add_relu")
MODEL_WORKLOADS = ("resnet_block",)
WORKLOADS = OP_WORKLOADS + MODEL_WORKLOADS
MODEL_MODES = ("xla", "jaxfuse")
BIAS_WIDTH = 1024
COPY = "copy"

# Name of our FFI target (see jaxfuse/_kernels.py); used to check that the
# jaxfuse mode really lowered to our custom call.
_TARGET = getattr(getattr(jaxfuse, "_kernels", None), "TARGET", "jaxfuse_add_relu")
_CUSTOM_CALL_RE = re.compile(
    r"custom_call\s*@" + re.escape(_TARGET) + r"\b|call_target_name\s*=\s*\"" + re.escape(_TARGET) + '"'
)


# ----------------------------------------------------------------- the programs
relu = jax.nn.relu


def add_relu_f(a, b):
    """The one function both the ``xla`` and the ``jaxfuse`` modes compile."""
    return relu(a + b)


def fuse(f: Callable) -> Callable:
    """The ``jaxfuse`` mode: the optimization pass applied to ``f``."""
    return jaxfuse.optimize(f, policy="always")


# The two halves of the ``unfused`` mode: two executables, the sum materialized.
unfused_add = jax.jit(jnp.add)
unfused_relu = jax.jit(lambda y: jnp.maximum(y, 0))
xla_add_relu = jax.jit(add_relu_f)
copy_kernel = jax.jit(lax.neg)


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


xla_resnet_block = jax.jit(resnet_block)


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
    if mode in ("xla", "jaxfuse"):
        return (2 * n + m) * itemsize
    if mode == COPY:
        return 2 * n * itemsize
    raise ValueError(f"unknown mode {mode!r}")


def resnet_bytes(x_shape, itemsize: int) -> int:
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


@dataclass
class Inspection:
    xla_bytes: float | None
    custom_calls: int  # jaxfuse custom calls in the lowered module
    sites: int  # add_relu_p equations in the jaxpr (the pass fired there)


def inspect(fn: Callable, *args) -> Inspection:
    """XLA's byte count for ``fn``, how many fused sites its jaxpr has and how
    many of our custom calls its lowering has (sites without custom calls mean
    the kernel was not available and the primitive lowered to the fallback)."""
    try:
        sites = len(re.findall(re.escape(jaxfuse.add_relu_p.name) + r"\[", str(jax.make_jaxpr(fn)(*args))))
    except Exception:  # noqa: BLE001 - inspection must never sink a benchmark
        sites = 0
    lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        lowered = lowerable.lower(*args)
    except Exception:  # noqa: BLE001
        return Inspection(None, 0, sites)
    try:
        calls = len(_CUSTOM_CALL_RE.findall(lowered.as_text()))
    except Exception:  # noqa: BLE001
        calls = 0
    try:
        xb = bytes_accessed(lowered.compile().cost_analysis())
    except Exception:  # noqa: BLE001
        xb = None
    return Inspection(xb, calls, sites)


# ------------------------------------------------------------------- groups
@functools.lru_cache(maxsize=None)
def _generator(shapes: tuple, dtype_name: str):
    dtype = jnp.dtype(dtype_name)

    def gen(key):
        keys = jax.random.split(key, len(shapes))
        # Random normal data: half the sums are negative, so the ReLU does work,
        # and nothing is timed on zeros.
        return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes))

    return jax.jit(gen)


def make_input_sets(shapes, dtype, n_sets: int, seed: int = 0) -> list[tuple]:
    gen = _generator(tuple(tuple(s) for s in shapes), jnp.dtype(dtype).name)
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
    xla_bytes: dict[str, float | None] = field(default_factory=dict)
    custom_calls: dict[str, int] = field(default_factory=dict)
    sites: dict[str, int] = field(default_factory=dict)
    buffer_sets: int = 1


def _cycle(sets):
    n = len(sets)
    return lambda i: sets[i % n]


def op_group(workload, size, dtype, modes, cache_bytes, *, seed=0, rotate=True) -> Group:
    from .timing import rotation_count

    a_shape, b_shape = op_shapes(workload, size)
    itemsize = jnp.dtype(dtype).itemsize
    working_set = analytic_bytes("xla", a_shape, b_shape, itemsize)
    n_sets = rotation_count(working_set, cache_bytes) if rotate else 1
    sets = make_input_sets([a_shape, b_shape], dtype, n_sets, seed)
    pick = _cycle(sets)
    fused = fuse(add_relu_f) if "jaxfuse" in modes else None

    builders = {
        "unfused": lambda i: unfused_relu(unfused_add(*pick(i))),
        "xla": lambda i: xla_add_relu(*pick(i)),
        "jaxfuse": lambda i: fused(*pick(i)),
    }
    cases = {m: builders[m] for m in MODES if m in modes}
    cases[COPY] = lambda i: copy_kernel(pick(i)[0])
    group = Group(
        workload=workload,
        dtype=jnp.dtype(dtype).name,
        shape=a_shape,
        elements=math.prod(a_shape),
        cases=cases,
        bytes={m: analytic_bytes(m, a_shape, b_shape, itemsize) for m in cases},
        buffer_sets=n_sets,
    )
    args = sets[0]
    for m in cases:
        if m == "unfused":
            i1, i2 = inspect(unfused_add, *args), inspect(unfused_relu, args[0])
            xb = None if i1.xla_bytes is None or i2.xla_bytes is None else i1.xla_bytes + i2.xla_bytes
            group.xla_bytes[m], group.custom_calls[m], group.sites[m] = xb, 0, 0
        else:
            fn = {"xla": xla_add_relu, "jaxfuse": fused, COPY: copy_kernel}[m]
            ins = inspect(fn, *(args if m != COPY else args[:1]))
            group.xla_bytes[m], group.custom_calls[m], group.sites[m] = ins.xla_bytes, ins.custom_calls, ins.sites
    return group


def model_group(x_shape, dtype, modes, cache_bytes, *, seed=0, rotate=True) -> Group:
    from .timing import rotation_count

    x_shape = tuple(int(d) for d in x_shape)
    itemsize = jnp.dtype(dtype).itemsize
    params = init_resnet_params(jax.random.key(seed + 1), x_shape[-1], dtype)
    est = resnet_bytes(x_shape, itemsize)
    n_sets = rotation_count(est, cache_bytes) if rotate else 1
    xs = [s[0] for s in make_input_sets([x_shape], dtype, n_sets, seed)]
    n = len(xs)
    fused = fuse(resnet_block) if "jaxfuse" in modes else None
    builders = {
        "xla": lambda i: xla_resnet_block(xs[i % n], params),
        "jaxfuse": lambda i: fused(xs[i % n], params),
    }
    cases = {m: builders[m] for m in MODEL_MODES if m in modes}
    cases[COPY] = lambda i: copy_kernel(xs[i % n])
    group = Group(
        workload="resnet_block",
        dtype=jnp.dtype(dtype).name,
        shape=x_shape,
        elements=math.prod(x_shape),
        cases=cases,
        bytes={m: (2 * math.prod(x_shape) * itemsize if m == COPY else est) for m in cases},
        buffer_sets=n_sets,
    )
    for m in cases:
        if m == COPY:
            ins = inspect(copy_kernel, xs[0])
        else:
            ins = inspect(xla_resnet_block if m == "xla" else fused, xs[0], params)
        group.xla_bytes[m], group.custom_calls[m], group.sites[m] = ins.xla_bytes, ins.custom_calls, ins.sites
    return group

