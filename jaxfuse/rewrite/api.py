"""`optimize` and `explain`: trace, rewrite, and (for optimize) evaluate.

`optimize` returns a `jax.jit` of a function that traces the user's function
to a jaxpr, rewrites it and binds the result into jit's own trace. Tracing and
rewriting therefore happen exactly when jit traces, so jit's cache (and its
C++ dispatch path) is the cache: a hit re-traces and re-rewrites nothing.
Composition with grad/vmap/jit/checkpoint comes from the fused primitive's
own rules, since what jit sees is an ordinary jaxpr.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple

import numpy as np

import jax

from .. import _compat as C
from .patterns import resolve
from .report import Report
from .walker import rewrite

_INFO = "_jaxfuse_optimized"


class _Optimized(NamedTuple):
    wrapper: Callable   # the jitted function this record belongs to
    fun: Callable
    patterns: tuple
    static: tuple


def _info(fun) -> _Optimized | None:
    # functools.wraps copies attributes onto wrappers of an optimized function;
    # the record only counts on the very object it was made for.
    info = getattr(fun, _INFO, None)
    return info if info is not None and info.wrapper is fun else None


def optimize(fun: Callable | None = None, *, patterns=None, **jit_kwargs):
    """Rewrites every safe fusion site of `fun` and jit-compiles the result.

    Usable as `@optimize` or `@optimize(patterns=..., static_argnums=...)`.
    `patterns`: names or `Pattern`s; None means every pattern registered when
    `optimize` is called. Other keyword arguments go to `jax.jit`
    (`static_argnums`, `static_argnames`, `donate_argnums`, ...).
    """
    if fun is None:
        return functools.partial(optimize, patterns=patterns, **jit_kwargs)
    pats = resolve(patterns)
    info = _info(fun)
    if info is not None and info.patterns == pats and not jit_kwargs:
        return fun  # already optimized with these patterns: nothing more to do

    @functools.wraps(fun)
    def traced(*args, **kwargs):
        # Called by jit with tracers for the dynamic arguments and concrete
        # values for the static ones; only the tracers become jaxpr inputs.
        flat_fun, dynamic = _split_dynamic(fun, args, kwargs, C.is_tracer_leaf)
        closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*dynamic)
        new, _ = rewrite(closed, pats)
        out = C.eval_closed(new, *dynamic)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

    jitted = jax.jit(traced, **jit_kwargs)
    try:
        setattr(jitted, _INFO, _Optimized(jitted, fun, pats, _static_spec(jit_kwargs)))
    except AttributeError:  # pragma: no cover - a jit wrapper that refuses attributes
        pass
    return jitted


def explain(fun: Callable, *args, **kwargs) -> Report:
    """Which sites of `fun(*args, **kwargs)` `optimize` fuses, and why not the rest.

    Arguments may be arrays, Python scalars or `jax.ShapeDtypeStruct`s; other
    leaves (strings, ...) and the static arguments of an optimized function are
    treated as static. Given an optimized function, explains the function it
    wraps with the patterns it was optimized with.
    """
    info = _info(fun)
    if info is None:
        pats, static = resolve(None), None
    else:
        fun, pats, static = info.fun, info.patterns, info.static
    args, kwargs = _mark_static(fun, args, kwargs, static)
    flat_fun, dynamic = _split_dynamic(fun, args, kwargs, _is_dynamic_leaf)
    closed = jax.make_jaxpr(flat_fun)(*dynamic)
    _, report = rewrite(closed, pats, C.definition_site(fun))
    return report


# ----------------------------------------------------------------- arguments
class _Static:
    """Marks a leaf as static for `explain`."""

    def __init__(self, value):
        self.value = value


def _is_dynamic_leaf(x) -> bool:
    if isinstance(x, _Static):
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct,
                          int, float, complex, bool)) or C.is_tracer_leaf(x)


def _split_dynamic(fun, args, kwargs, is_dynamic):
    """A function of the dynamic leaves only, and those leaves."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if is_dynamic(x)]
    flat = [x.value if isinstance(x, _Static) else x for x in flat]

    def flat_fun(*dynamic):
        leaves = list(flat)
        for i, x in zip(where, dynamic):
            leaves[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, leaves)
        return fun(*a, **k)

    return flat_fun, [flat[i] for i in where]


def _static_spec(jit_kwargs):
    nums = jit_kwargs.get("static_argnums", ())
    names = jit_kwargs.get("static_argnames", ())
    nums = (nums,) if isinstance(nums, int) else tuple(nums or ())
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return nums, names


def _mark_static(fun, args, kwargs, static):
    if not static or not any(static):
        return args, kwargs
    nums, names = static
    try:  # static_argnames may also name positional parameters, as in jax.jit
        params = list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):
        params = []
    nums = {n % len(args) for n in nums if args} | {
        params.index(n) for n in names if n in params and params.index(n) < len(args)}
    args = tuple(_Static(a) if i in nums else a for i, a in enumerate(args))
    kwargs = {k: _Static(v) if k in names else v for k, v in kwargs.items()}
    return args, kwargs
