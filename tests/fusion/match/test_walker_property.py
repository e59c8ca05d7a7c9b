"""Property-based: random programs of add, mul and every ReLU spelling, with
reused intermediates, intermediates returned as outputs, broadcast bias adds and
inputs holding NaN/+-Inf/-0.0. Values equal `jax.jit(f)`, gradients match, and
the number of fused sites equals an independent count of eligible sites."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax
import jax.numpy as jnp
from jax import lax

from jaxfuse.ops import numerics as _numerics
from conftest import random_operand, xla_compiles_float16
from rewrite_support import assert_trees, fused_count, kernel_active, explain_all, fuse

pytestmark = [pytest.mark.exactness, pytest.mark.filterwarnings("ignore:jaxfuse. no kernel:RuntimeWarning")]

# Every spelling, and whether it is an eligible ReLU (the -0.0 one is not).
RELUS = {
    "nn.relu": (jax.nn.relu, True),
    "maximum": (lambda y: jnp.maximum(y, 0), True),
    "maximum-rev": (lambda y: jnp.maximum(0, y), True),
    "lax.max-zeros": (lambda y: lax.max(y, jnp.zeros_like(y)), True),
    "clip": (lambda y: jnp.clip(y, 0), True),
    # -0.0 cast to an integer dtype is plain 0: a candidate, declined there for the dtype.
    "max-negzero": (lambda y: jnp.maximum(y, jnp.array(-0.0, y.dtype)), False),
}
INPUT_SHAPES = [(4, 8), (4, 8), (8,), (1, 8)]  # x0, x1, bias, row bias
# float16 only where XLA:CPU compiles it (not when held to SSE4.2: conftest.py).
DTYPES = [np.float32, *([np.float16] if xla_compiles_float16() else []), jnp.bfloat16, np.int32]


@st.composite
def programs(draw):
    n_in = len(INPUT_SHAPES)
    steps = []
    for k in range(draw(st.integers(1, 8))):
        n = n_in + k  # values defined so far
        op = draw(st.sampled_from(["add", "add", "add-const", "mul", "relu", "relu"]))
        if op == "relu":
            steps.append(("relu", draw(st.sampled_from(sorted(RELUS))), draw(st.integers(0, n - 1))))
        else:
            steps.append((op, draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))))
    n = n_in + len(steps)
    outputs = draw(st.lists(st.integers(n_in, n - 1), min_size=1, max_size=3))
    return steps, outputs


def build(steps, outputs):
    def f(*inputs):
        vals = list(inputs)
        for op, x, y in steps:
            if op == "add":
                vals.append(vals[x] + vals[y])
            elif op == "add-const":
                vals.append(vals[x] + 2)  # a scalar literal operand
            elif op == "mul":
                vals.append(vals[x] * vals[y])
            else:
                vals.append(RELUS[x][0](vals[y]))
        return tuple(vals[i] for i in outputs)
    return f


def eligible_sites(steps, outputs, dtype):
    """Counted on the program itself, independently of any jaxpr. Only what the
    outputs depend on counts: the pass drops dead code before it looks for sites
    (XLA drops it anyway), so a dead ReLU is no site and a dead reader is no use."""
    n_in = len(INPUT_SHAPES)
    live = set(outputs)  # values the outputs depend on
    for k in reversed(range(len(steps))):
        op, x, y = steps[k]
        if n_in + k in live:
            live.update([y] if op == "relu" else [x] if op == "add-const" else [x, y])
    uses = [0] * (n_in + len(steps))
    for k, (op, x, y) in enumerate(steps):
        if n_in + k in live:
            for v in ([y] if op == "relu" else [x] if op == "add-const" else [x, y]):
                uses[v] += 1
    for v in outputs:
        uses[v] += 1
    candidates = eligible = 0
    for k, (op, kind, y) in enumerate(steps):
        if op != "relu" or n_in + k not in live or y < n_in \
                or steps[y - n_in][0] not in ("add", "add-const"):
            continue
        candidates += 1
        # XLA folds (v + 2) + 2 into v + 4: an add of a constant onto one.
        inner = steps[y - n_in][1] if steps[y - n_in][0] == "add-const" else None
        folded = inner is not None and inner >= n_in and steps[inner - n_in][0] == "add-const"
        ok = (uses[y] == 1 and RELUS[kind][1] and jnp.issubdtype(dtype, jnp.floating)
              and not folded)
        eligible += ok
    return candidates, eligible, eligible


def product_meets_add(steps) -> bool:
    """Whether an add reads a mul: the contraction rules decide such sites
    (jaxfuse/fusion/safety/rounding.py; pinned against XLA by tests/fusion/safety/test_rounding.py),
    so the independent count above does not apply to them."""
    n_in = len(INPUT_SHAPES)
    made_by_mul = {n_in + k for k, (op, _, _) in enumerate(steps) if op == "mul"}
    return any(op in ("add", "add-const") and ({x, y} if op == "add" else {x}) & made_by_mul
               for op, x, y in steps)


def contraction_decides(dtype) -> bool:
    """Whether the contraction rules apply to `dtype` here: float32, and float16
    where XLA:CPU computes it natively and so contracts it (AVX512-FP16)."""
    return np.dtype(dtype) == np.float32 or _numerics.cpu_contracts_dtype(dtype)


def exact_expected(dtype) -> bool:
    """Whether the optimized program must match `jax.jit(f)` bit for bit with the
    kernel in use: always for float32 and int32 (a site XLA would round otherwise
    is declined); not for float16/bfloat16, where XLA:CPU may keep float32
    excess precision across ops that our kernel rounds between."""
    return np.dtype(dtype) not in (np.dtype(np.float16), np.dtype(jnp.bfloat16))


def make_inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.int32:
        return [jnp.asarray(rng.integers(-3, 4, s, dtype=np.int32)) for s in INPUT_SHAPES]
    return [jnp.asarray(random_operand(rng, s, dtype)) for s in INPUT_SHAPES]


@settings(max_examples=int(os.environ.get("JAXFUSE_HYPOTHESIS_EXAMPLES", 50)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from(DTYPES), st.integers(0, 2**32 - 1))
def test_random_programs(program, dtype, seed):
    steps, outputs = program
    f = build(steps, outputs)
    inputs = make_inputs(seed, dtype)

    candidates, eligible, eligible_live = eligible_sites(steps, outputs, dtype)
    report = explain_all(f, *inputs)
    counted = not (product_meets_add(steps) and contraction_decides(dtype))
    if counted:
        assert len(report.fused) == eligible, (steps, outputs, str(report))
    else:  # fewer, where a product meets an add
        assert len(report.fused) <= eligible, (steps, outputs, str(report))
    assert len(report) == candidates, (steps, outputs, str(report))
    opt = fuse(f)
    assert fused_count(jax.make_jaxpr(opt)(*inputs)) == len(report.fused)
    if kernel_active() and counted:  # one custom call per live fused site in the lowered program
        text = jax.jit(opt).lower(*inputs).as_text()
        calls = text.count("custom_call @jaxfuse_add_relu") + text.count("custom_call @jaxfuse_epilogue")
        assert calls == eligible_live

    exact = not kernel_active() or exact_expected(dtype)
    assert_trees(opt(*inputs), jax.jit(f)(*inputs), exact=exact)

    if np.dtype(dtype) == np.float32:
        def loss(g):
            return lambda *xs: sum(jnp.sum(o * (i + 1.0)) for i, o in enumerate(g(*xs)))
        argnums = tuple(range(len(inputs)))
        assert_trees(jax.grad(loss(opt), argnums)(*inputs),
                     jax.jit(jax.grad(loss(f), argnums))(*inputs), exact=False)
