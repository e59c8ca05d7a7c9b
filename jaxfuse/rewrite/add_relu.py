"""The built-in pattern: `add` followed by ReLU becomes one `add_relu_p`.

ReLU spellings recognised, each with the gradient it defines at exactly 0
(the fused op reproduces it through `grad_at_zero`):

  * `max(y, 0)` / `max(0, y)` -- `jnp.maximum`, `lax.max` -- with a zero that is
    provably +0.0: a literal, a known constant, or a broadcast/convert of one.
    lax.max's JVP splits ties, so the gradient at 0 is 0.5.
  * `jax.nn.relu` -- `custom_jvp_call` around `jit[relu]{max}`; its custom JVP
    gives 0 at 0.
  * a plain `jit` whose body is only a ReLU (plus the equations building its
    zero): `jnp.clip(y, 0)` is `jit[clip]{convert_element_type(0); max}`, so
    gradient 0.5 like the max inside.

A `custom_jvp` function other than jax.nn.relu that computes a ReLU is a
candidate but declined: its own derivative rule could be anything.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax

from jaxfuse._primitive import (MAXIMUM_GRAD_AT_ZERO, RELU_GRAD_AT_ZERO, add_relu_p,
                                check_operands)

from .. import _compat as C
from .graph import Graph
from .patterns import Match, Pattern

NAME = "add_relu"

# Equations a wrapper body may hold besides the ReLU: they only build the zero.
_ZERO_BUILDERS = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "pvary"})
_MAX_WRAPPER_EQNS = 4
_JAX_RELU = C.function_origin(C.unwrap_function(jax.nn.relu))


@dataclasses.dataclass(frozen=True)
class _Relu:
    operand: object          # the atom the ReLU is applied to
    grad_at_zero: float
    spelling: str
    decline: str | None = None
    extra: tuple = ()        # zero-building equations that die with the ReLU


def _relu(eqn, graph: Graph) -> _Relu | None:
    """How `eqn` spells a ReLU, or None when it is not one."""
    name = eqn.primitive.name
    if name == "max" and len(eqn.invars) == 2:
        return _max_relu(eqn, graph)
    if name == "custom_jvp_call":
        return _custom_jvp_relu(eqn, graph)
    if name in C.JIT_NAMES:
        return _jit_relu(eqn, graph)
    return None


def _max_relu(eqn, graph):
    x0, x1 = eqn.invars
    for y, z, text in ((x0, x1, "max(y, 0)"), (x1, x0, "max(0, y)")):
        zero = graph.const_value(z)
        if zero is None or graph.const_value(y) is not None:
            continue
        if zero.size == 0 or not np.all(zero == 0):
            return None  # a max with another constant is not a ReLU
        decline = None
        if np.any(np.signbit(zero)):
            # max(y, -0.0) may return -0.0 where the kernel returns +0.0.
            decline = "the zero operand of max is -0.0, not +0.0"
        prod = graph.producer(z)
        extra = (prod,) if prod is not None and graph.uses(z) == 1 and not graph.is_output(z) else ()
        return _Relu(y, MAXIMUM_GRAD_AT_ZERO, text, decline, extra)
    return None


def _body_relu(eqn, body_closed, graph: Graph) -> _Relu | None:
    """A ReLU when a call's body is exactly one, applied to one of its invars.

    Returns the spelling with `operand` mapped back to the caller's atom."""
    body = body_closed.jaxpr
    # Cheap early out: a ReLU wrapper is tiny, and every jit is offered here.
    if len(body.outvars) != 1 or body.effects or len(body.eqns) > _MAX_WRAPPER_EQNS:
        return None
    sub = graph.sub(body, body_closed.consts, eqn.invars)
    root = sub.producer(body.outvars[0])
    if root is None:
        return None
    inner = _relu(root, sub)
    if inner is None:
        return None
    if any(e is not root and (e.primitive.name not in _ZERO_BUILDERS or e.effects)
           for e in body.eqns):
        return None
    index = next((i for i, v in enumerate(body.invars) if v is inner.operand), None)
    if index is None:
        return None
    return dataclasses.replace(inner, operand=eqn.invars[index], extra=())


def _custom_jvp_relu(eqn, graph):
    inner = _body_relu(eqn, eqn.params["call_jaxpr"], graph)
    if inner is None:
        return None
    origin = C.debug_origin(eqn.params["call_jaxpr"].jaxpr)
    if origin is not None and _JAX_RELU is not None and origin == _JAX_RELU:
        return dataclasses.replace(inner, grad_at_zero=RELU_GRAD_AT_ZERO, spelling="jax.nn.relu")
    fname = origin[0] if origin else "?"
    return dataclasses.replace(
        inner, spelling=f"custom_jvp {fname}",
        decline=inner.decline or f"`{fname}` is a custom_jvp function with its own "
                                 f"derivative rule, which fusing would replace")


def _jit_relu(eqn, graph):
    inner = _body_relu(eqn, eqn.params["jaxpr"], graph)
    if inner is None:
        return None
    name = eqn.params.get("name", "?")
    spelling = "jnp.clip(y, 0)" if name == "clip" else (
        inner.spelling if inner.spelling == "jax.nn.relu" else f"jit[{name}]({inner.spelling})")
    pinned = C.jit_constraints(eqn.params)
    decline = inner.decline or (f"the jit[{name}] around the ReLU {pinned}, "
                                f"which fusing across it would drop" if pinned else None)
    return dataclasses.replace(inner, spelling=spelling, decline=decline)


# ------------------------------------------------------------------ the pattern
def match(eqn, graph: Graph) -> Match | None:
    relu = _relu(eqn, graph)
    if relu is None:
        return None
    add = graph.producer(relu.operand)
    if add is None or add.primitive.name != "add":
        return None
    return Match(root=eqn, eqns=(add, eqn, *relu.extra), operands=tuple(add.invars),
                 spelling=relu.spelling, info={"relu": relu, "add": add})


def check(m: Match, graph: Graph) -> str | None:
    relu, add = m.info["relu"], m.info["add"]
    if relu.decline:
        return relu.decline
    a, b = (x.aval for x in add.invars)
    y, out = add.outvars[0].aval, m.root.outvars[0].aval
    try:  # the fused primitive's own operand contract, its message as the reason
        check_operands(a.shape, a.dtype, b.shape, b.dtype)
    except (TypeError, ValueError) as e:
        return str(e).removeprefix("jaxfuse.add_relu_p: ").removeprefix("jaxfuse.add_relu: ")
    if (tuple(out.shape), out.dtype) != (tuple(y.shape), y.dtype):
        return f"the ReLU changes its operand's type from {y.str_short()} to {out.str_short()}"
    if getattr(out, "weak_type", False) != getattr(y, "weak_type", False):
        return "the ReLU changes its operand's weak type"
    return None


def build(m: Match, graph: Graph):
    relu, add = m.info["relu"], m.info["add"]
    # The add's operands go in as they are: the fused op serves the same
    # size-1 broadcasting and scalars that `add` itself accepts.
    return [C.new_eqn(list(add.invars), m.root.outvars, add_relu_p,
                      {"grad_at_zero": relu.grad_at_zero}, like=m.root,
                      effects=m.root.effects | add.effects)]


PATTERN = Pattern(
    NAME, match, check, build,
    roots=frozenset({"max", "custom_jvp_call", *C.JIT_NAMES}),
    doc="add followed by ReLU -> jaxfuse_add_relu (one custom call)",
)
