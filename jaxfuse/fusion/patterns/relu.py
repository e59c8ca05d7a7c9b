"""The ReLU spellings a real program produces, as one pattern node (`relu(child)`).

Each spelling carries the gradient it defines at exactly 0 (the fused op
reproduces it through `grad_at_zero`):

  * `max(y, 0)` / `max(0, y)` -- `jnp.maximum`, `lax.max` -- with a zero that is
    provably +0.0: a literal, a known constant, or a broadcast/convert of one.
    lax.max's JVP splits ties, so the gradient at 0 is 0.5.
  * `jax.nn.relu` -- `custom_jvp_call` around `jit[relu]{max}`; its custom JVP
    gives 0 at 0.
  * `jnp.clip(y, 0)` and other small `jit` wrappers: the walker inlines them
    (graph.inlined_from names the jit), so they arrive as the max inside.
    A wrapper that pins shardings or donates is not inlined; it is recognised
    here only to say why it is declined.

A `custom_jvp` function other than jax.nn.relu that computes a ReLU is a
candidate but declined: its own derivative rule could be anything.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import jax

from ...ops.primitive import MAXIMUM_GRAD_AT_ZERO, RELU_GRAD_AT_ZERO

from ... import _compat as C
from ..._reasons import Reason, ReasonKind
from ..match.dsl import Custom, Node
from ..ir.graph import Graph

# Equations a wrapper body may hold besides the ReLU: they only build the zero.
_ZERO_BUILDERS = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "pvary"})
_MAX_WRAPPER_EQNS = 4
_JAX_RELU = C.function_origin(C.unwrap_function(jax.nn.relu))


@dataclasses.dataclass(frozen=True)
class Spelling:
    operand: object          # the atom the ReLU is applied to
    grad_at_zero: float
    text: str
    decline: Reason | None = None
    extra: tuple = ()        # zero-building equations that die with the ReLU


def spelling(eqn, graph: Graph) -> Spelling | None:
    """How `eqn` spells a ReLU, or None when it is not one."""
    name = eqn.primitive.name
    if name == "max" and len(eqn.invars) == 2:
        return _max_relu(eqn, graph)
    if name == "custom_jvp_call":
        return _custom_jvp_relu(eqn, graph)
    if name in C.JIT_NAMES:
        return _jit_relu(eqn, graph)
    return None


NEGATIVE_ZERO = ReasonKind("negative-zero", "the zero operand of max is -0.0, not +0.0")
OWN_DERIVATIVE = ReasonKind(
    "own-derivative",
    "`{culprit}` is a custom_jvp function with its own derivative rule, which fusing would replace")
PINNED_JIT = ReasonKind(
    "pinned-jit", "the jit[{culprit}] around the ReLU {pinned}, which fusing across it would drop")


def _is_positive_zero(value: np.ndarray) -> tuple[bool, Reason | None]:
    """(is it a zero, why a max with it is still no ReLU the kernel can serve)."""
    if value.size == 0 or not np.all(value == 0):
        return False, None
    if not np.issubdtype(value.dtype, np.floating) and value.dtype.kind != "V":
        return True, None  # an integer or complex zero: the dtype check declines it
    if np.any(np.signbit(value.astype(np.float32))):
        # max(y, -0.0) may return -0.0 where the kernel returns +0.0.
        return True, NEGATIVE_ZERO()
    return True, None


def _max_relu(eqn, graph):
    x0, x1 = eqn.invars
    for y, z, text in ((x0, x1, "max(y, 0)"), (x1, x0, "max(0, y)")):
        zero = graph.const_value(z)
        if zero is None or graph.const_value(y) is not None:
            continue
        is_zero, decline = _is_positive_zero(zero)
        if not is_zero:
            return None  # a max with another constant is not a ReLU
        prod = graph.producer(z)
        extra = (prod,) if prod is not None and graph.uses(z) == 1 and not graph.is_output(z) else ()
        wrapper = graph.inlined_from(eqn)
        if wrapper == "clip":
            text = "jnp.clip(y, 0)"
        elif wrapper is not None:
            text = f"jit[{wrapper}]({text})"
        custom = [g for g in graph.calls_around(eqn) if g.custom]
        if custom:
            # the body of a custom_jvp the walker sees through: its rule, not max's
            return _custom_spelling(Spelling(y, MAXIMUM_GRAD_AT_ZERO, text, decline, extra),
                                    custom[-1].call)
        return Spelling(y, MAXIMUM_GRAD_AT_ZERO, text, decline, extra)
    return None


def _body_relu(eqn, body_closed, graph: Graph) -> Spelling | None:
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
    inner = spelling(root, sub)
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
    return _custom_spelling(inner, eqn)


def _custom_spelling(inner: Spelling, eqn) -> Spelling:
    """A ReLU computed by the body of `eqn`, a custom_jvp call: jax.nn.relu's
    rule gives 0 at 0; any other function's rule is its own (declined)."""
    if eqn.primitive.name != "custom_jvp_call":
        fname = eqn.params.get("name") or "?"
        return dataclasses.replace(inner, text=f"custom_vjp {fname}",
                                   decline=inner.decline or OWN_DERIVATIVE(fname))
    origin = C.debug_origin(eqn.params["call_jaxpr"].jaxpr)
    if origin is not None and _JAX_RELU is not None and origin == _JAX_RELU:
        return dataclasses.replace(inner, grad_at_zero=RELU_GRAD_AT_ZERO, text="jax.nn.relu")
    fname = origin[0] if origin else "?"
    return dataclasses.replace(
        inner, text=f"custom_jvp {fname}",
        decline=inner.decline or OWN_DERIVATIVE(fname))


def _jit_relu(eqn, graph):
    inner = _body_relu(eqn, eqn.params["jaxpr"], graph)
    if inner is None:
        return None
    name = eqn.params.get("name", "?")
    text = "jnp.clip(y, 0)" if name == "clip" else (
        inner.text if inner.text == "jax.nn.relu" else f"jit[{name}]({inner.text})")
    pinned = C.jit_constraints(eqn.params)
    decline = inner.decline or (PINNED_JIT(name, pinned=pinned) if pinned else None)
    return dataclasses.replace(inner, text=text, decline=decline)


ROOTS = frozenset({"max", "custom_jvp_call", *C.JIT_NAMES})


def _match_relu(atom, graph, state):
    eqn = graph.producer(atom)
    if eqn is None:
        return
    sp = graph.cached(("relu spelling", id(eqn)), lambda: spelling(eqn, graph))
    if sp is None:
        return
    yield state.absorb(eqn, *sp.extra).note("relu", sp), sp.operand


def relu(child: Node) -> Node:
    """A value produced by any ReLU spelling of `child`; notes["relu"] is the Spelling."""
    return Custom(_match_relu, child)
