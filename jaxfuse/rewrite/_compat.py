"""Every jax-internal detail the pass relies on, in one place.

The rest of `jaxfuse.rewrite` imports jaxpr types and helpers only from here,
so a jax upgrade (0.10 -> 0.11) touches this file alone.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np

import jax
from jax.extend import core as _xcore

Jaxpr = _xcore.Jaxpr
ClosedJaxpr = _xcore.ClosedJaxpr
JaxprEqn = _xcore.JaxprEqn
Literal = _xcore.Literal
Var = _xcore.Var
Tracer = jax.core.Tracer

# Primitive names that differ between jax versions.
JIT_NAMES = frozenset({"jit", "pjit"})
CHECKPOINT_NAMES = frozenset({"remat2", "checkpoint", "remat"})

try:  # private: no public way to walk a traceback's user frames
    from jax._src import source_info_util as _siu
except ImportError:  # pragma: no cover - jax moved it
    _siu = None

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def new_eqn(invars, outvars, primitive, params, *, like: JaxprEqn, effects=None):
    """A fresh equation carrying `like`'s source info and context."""
    return _xcore.new_jaxpr_eqn(
        list(invars), list(outvars), primitive, dict(params),
        like.effects if effects is None else effects,
        source_info=like.source_info, ctx=like.ctx,
    )


def replace_params(eqn: JaxprEqn, params: dict) -> JaxprEqn:
    return eqn.replace(params=params)


def replace_eqns(jaxpr: Jaxpr, eqns: list[JaxprEqn]) -> Jaxpr:
    # Same vars, effects and debug info; only the equation list changes.
    return jaxpr.replace(eqns=eqns)


def replace_closed(closed: ClosedJaxpr, jaxpr: Jaxpr) -> ClosedJaxpr:
    return ClosedJaxpr(jaxpr, closed.consts)


def eval_closed(closed: ClosedJaxpr, *args) -> list[Any]:
    """Binds the jaxpr's equations into the current trace, source info included."""
    return _xcore.jaxpr_as_fun(closed)(*args)


def literal_value(atom) -> np.ndarray | None:
    if isinstance(atom, Literal):
        return np.asarray(atom.val)
    return None


def is_literal(atom) -> bool:
    return isinstance(atom, Literal)


def is_var(atom) -> bool:
    # DropVar is a Var subclass; it is never read, so it never counts as a use.
    return isinstance(atom, Var)


def debug_origin(jaxpr: Jaxpr) -> tuple[str, str] | None:
    """(function name, file) the jaxpr was traced from, when jax recorded it."""
    info = getattr(jaxpr, "debug_info", None)
    src = getattr(info, "func_src_info", None)
    if not src or " at " not in src:
        return None
    name, where = src.split(" at ", 1)
    return name, where.rsplit(":", 1)[0]


def function_origin(fun) -> tuple[str, str] | None:
    """(name, file) of a Python function, comparable with `debug_origin`."""
    code = getattr(fun, "__code__", None)
    if code is None:
        return None
    return fun.__name__, code.co_filename


def user_frame(source_info) -> tuple[str, int] | None:
    """(file, line) of the innermost frame in the user's own code, if any.

    Frames inside jax, the stdlib and jaxfuse itself are skipped, so a site in
    library code reports the line in user code that reached it.
    """
    tb = getattr(source_info, "traceback", None)
    if tb is None or _siu is None:
        return None
    for frame in _siu.user_frames(tb):
        if not frame.file_name.startswith(_PACKAGE_DIR):
            return frame.file_name, frame.start_line
    return None


def first_user_frame(source_infos: Iterable) -> tuple[str, int] | None:
    for info in source_infos:
        found = user_frame(info)
        if found is not None:
            return found
    return None


def _unspecified(s) -> bool:
    return s is None or type(s).__name__ == "UnspecifiedValue"


def jit_constraints(params: dict) -> str | None:
    """What a jit equation pins down beyond its body (shardings, layouts,
    donation, compiler options), or None when it is a plain function call."""
    if any(params.get("donated_invars", ())):
        return "donates its arguments"
    if not all(map(_unspecified, (*params.get("in_shardings", ()),
                                  *params.get("out_shardings", ())))):
        return "pins shardings"
    if any(l is not None for l in (*params.get("in_layouts", ()), *params.get("out_layouts", ()))):
        return "pins layouts"
    if params.get("compiler_options_kvs"):
        return "sets compiler options"
    return None


def unwrap_function(fun):
    """The Python function under jit/custom_jvp wrappers."""
    fun = getattr(fun, "fun", fun)  # custom_jvp / custom_vjp
    while hasattr(fun, "__wrapped__"):
        fun = fun.__wrapped__
    return fun


def is_tracer_leaf(x) -> bool:
    return isinstance(x, Tracer)


def definition_site(fun) -> tuple[str, int] | None:
    """(file, first line) where `fun` was defined, when that is user code: the
    location of last resort (tracebacks stop at the trace's entry, so a
    jax-wrapped function passed in directly records no user frame)."""
    code = getattr(unwrap_function(fun), "__code__", None)
    if code is None or code.co_filename.startswith(_PACKAGE_DIR):
        return None
    if _siu is not None and not _siu.is_user_filename(code.co_filename):
        return None
    return code.co_filename, code.co_firstlineno


def new_var(aval):
    return Var(aval)
