"""Rewrite rules written as plain JAX functions: `jaxfuse.rule(pattern, replacement)`.

    def pattern(x, w, b):
        return jax.nn.gelu(x @ w + b)

    def replacement(x, w, b):
        return my_fused_dense_gelu(x, w, b)     # a Pallas kernel, an FFI call, ...

    jaxfuse.optimize(model_apply, patterns=[jaxfuse.rule(pattern, replacement)])

As torch.fx's `replace_pattern` and inductor's `register_replacement` do,
the pattern is traced to a jaxpr (the template) and every place the user's
program computes the same thing is replaced by the replacement, traced at the
operands found there. Each positional parameter matches any value.

Matching runs twice, so a rule written once matches at every shape:

  1. Structurally, against the template traced at the example shapes: the
     same primitives in the same dataflow, params ignored, and shape-only
     steps (a broadcast, a reshape, a weak-type conversion) skipped on either
     side, since they come and go with shapes (flax reshapes a Dense bias to
     (1, C), haiku broadcasts it, jnp inserts broadcasts by rank). This binds
     each parameter to a value of the program.
  2. Exactly, against the pattern traced again at the bound values' shapes and
     dtypes (cached per signature): the same equations with the same params
     and types. Only then is the site replaced; otherwise it is declined with
     the reason, which `explain` shows.

The walker's checks make a rule safe as they make the built-in patterns safe:
a value computed inside the match and read outside it, an effect, or an
overlap with another rewrite declines the site. The replacement is bound as
one `jit` call named after the rule, so the rewritten program's gradient is
the replacement's own (JAX differentiates it, or uses its custom_vjp). A rule
applies at every safe site whatever the policy (the user asked for it),
unless it has a `cost`: asked under `policy="auto"` only, it may decline a
site for cost.

Both sides are read in canonical spellings first (`canonical.CanonicalView`:
powers of two as products, `/ sqrt` as `* rsqrt`, casts that keep the values
dropped, repeated equations merged, transposes moved to the results), so a
rule written in one spelling matches the equivalent ones; a match still binds
and defines only values the program itself holds.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Sequence

import numpy as np

import jax

from ... import _compat as C
from ..._cache import BoundedCache
from ..._reasons import Reason
from ..ir import xla
from ..ir.canonical import RESPELLED, SPELLED_AS, CanonicalView, close_to_reciprocal, contraction
from ..ir.graph import Graph, output_index
from ..ir.inline import inline_small_calls
from ..ir.target import target_platform
from .patterns import Match, Pattern

# custom_jvp/custom_vjp params that are per-trace callables: two calls are the
# same when their bodies and the function they came from are.
_RULE_PARAMS = frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "jvp", "fwd_jaxpr_thunk", "bwd",
                          "out_trees", "fwd", "num_consts"})
_DEFAULT_EXAMPLE = jax.ShapeDtypeStruct((4, 4), np.float32)
TEMPLATES_KEPT = 128  # per rule: traced templates and replacements


class RuleError(TypeError):
    """A rule whose pattern and replacement do not fit together."""


# ------------------------------------------------------------------ templates
@dataclasses.dataclass(frozen=True, eq=False)
class _Template:
    """A pattern traced at one signature: equations to match, consts by var."""

    jaxpr: C.Jaxpr
    consts: dict

    @property
    def out_avals(self):
        return tuple(v.aval for v in self.jaxpr.outvars)

    @functools.cached_property
    def graph(self) -> Graph:
        """Its uses and constants (arithmetic on constants folded)."""
        return Graph(self.jaxpr, [self.consts[v] for v in self.jaxpr.constvars])

    @functools.cached_property
    def contractions(self) -> dict:
        """id(var) -> the contraction computing it, for the vars one computes."""
        found = {}
        for e in self.jaxpr.eqns:
            for v in e.outvars:
                c = contraction(v, self.graph.producer, lambda a: self.graph.uses(a) == 1)
                if c is not None:
                    found[id(v)] = c
        return found


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    aval = getattr(x, "aval", None)
    if aval is not None:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                                    weak_type=getattr(aval, "weak_type", False))
    x = np.asarray(x) if not hasattr(x, "shape") else x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def _signature(avals) -> tuple:
    return tuple((tuple(a.shape), np.dtype(a.dtype).name, bool(getattr(a, "weak_type", False)))
                 for a in avals)


def _describe(avals) -> str:
    return "(" + ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in avals) + ")"


def _trace(fun, avals) -> _Template:
    # dead code dropped, as the walker drops the program's (jax's logsumexp
    # computes a `sign` it does not use where it is no custom_jvp)
    closed = C.without_dead_code(jax.make_jaxpr(fun)(*avals))
    jaxpr = closed.jaxpr
    inlined = C.replace_eqns(jaxpr, inline_small_calls(list(jaxpr.eqns), jaxpr.outvars).eqns)
    canonical = CanonicalView(inlined, Graph(inlined, closed.consts).const_value)
    return _Template(canonical.jaxpr, dict(zip(jaxpr.constvars, closed.consts)))


def _canonical_view(graph: Graph) -> tuple[CanonicalView, Graph]:
    """The program's canonical view and its graph, once per jaxpr."""
    def build():
        view = CanonicalView(graph.jaxpr, graph.const_value)
        return view, graph.respelled(view.jaxpr)
    return graph.cached(("rule_engine.canonical",), build)


# ------------------------------------------------------------------- matching
@dataclasses.dataclass(frozen=True)
class _State:
    bound: dict        # id(pattern invar) -> program atom
    mapped: dict       # id(pattern eqn) -> program eqn
    used: frozenset = frozenset()  # ids of the program equations mapped
    absorbed: tuple = ()  # program equations a canonical form took in (a contraction's transposes)

    def bind(self, var, atom):
        old = self.bound.get(id(var))
        if old is not None:
            return self if old is atom else None
        return dataclasses.replace(self, bound={**self.bound, id(var): atom})

    def map(self, p_eqn, g_eqn, *, absorbing=()):
        return _State(self.bound, {**self.mapped, id(p_eqn): g_eqn},
                      self.used | {id(g_eqn)} | {id(e) for e in absorbing},
                      self.absorbed + tuple(absorbing))

    def program_eqns(self) -> tuple:
        """Every program equation the match takes, each once."""
        seen, out = set(), []
        for e in (*self.mapped.values(), *self.absorbed):
            if id(e) not in seen:
                seen.add(id(e))
                out.append(e)
        return tuple(out)


class _Matcher:
    """One template against one program graph; `exact` compares params and types."""

    def __init__(self, template: _Template, graph: Graph, exact: bool):
        self.t, self.graph, self.exact = template, graph, exact
        self.invars = {id(v) for v in template.jaxpr.invars}
        self.producer = {id(v): e for e in template.jaxpr.eqns for v in e.outvars}
        self.tgraph = template.graph

    def atom(self, p, g, state: _State, depth=0):
        if depth > 256:
            return
        p_value = self._pattern_const(p)
        if p_value is not None:
            # Structurally, a constant meets a constant: its value may come from
            # the example shapes (a head dimension's square root); the exact
            # pass compares values.
            g_value = self.graph.const_value(g)
            if g_value is not None and (not self.exact or _same_constant(p_value, g_value, p, g)):
                yield state
            return
        if id(p) in self.invars:
            ge = self.graph.producer(g)
            if not self.exact and ge is not None and _widening(ge):
                # the narrower value a cast widens first (a 16-bit program's
                # float32 arithmetic: the value it stores), then the widened
                # one; the exact pass tells which computes the pattern
                yield from self.atom(p, ge.invars[0], state, depth + 1)
            s = state.bind(p, g)
            if s is not None:
                yield s
            return
        pe = self.producer[id(p)]
        if not self.exact and pe.primitive.name in xla.SHAPE_ONLY and len(pe.invars) == 1:
            yield from self.atom(pe.invars[0], g, state, depth + 1)
        ge = self.graph.producer(g)
        if ge is None:
            return
        if not self.exact and ge.primitive.name in xla.SHAPE_ONLY and len(ge.invars) == 1:
            yield from self.atom(p, ge.invars[0], state, depth + 1)
        yield from self.value(p, g, state, depth)

    def value(self, p, g, state, depth):
        """`p` (computed by the pattern) against `g` (by the program)."""
        pc = self.t.contractions.get(id(p))
        if pc is not None:
            gc = self._contraction(g, self.graph)
            if gc is not None:
                yield from self.contraction(pc, gc, p, g, state, depth)
            return
        pe, ge = self.producer[id(p)], self.graph.producer(g)
        if ge is not None:
            yield from self.eqn(pe, ge, output_index(pe, p), output_index(ge, g), state, depth)

    @staticmethod
    def _contraction(atom, graph: Graph):
        return contraction(atom, graph.producer, lambda a: graph.uses(a) == 1)

    def contraction(self, pc, gc, p, g, state, depth):
        """Two contractions, whatever their transposes and operand order: in
        the exact pass they compute the same einsum at the same types."""
        done = state.mapped.get(id(pc.dot))
        if done is not None:
            if done is gc.dot:
                yield state
            return
        if any(id(e) in state.used or e.effects for e in gc.eqns):
            return
        orders = []
        for swapped in (False, True):
            if self.exact and not (
                    pc.signature() == gc.signature(swapped) and _same_types([p], [g])
                    and pc.dot.outvars[0].aval.dtype == gc.dot.outvars[0].aval.dtype
                    and _same_params(_contraction_params(pc.dot), _contraction_params(gc.dot))):
                continue
            operands = gc.operands[::-1] if swapped else gc.operands
            if operands not in orders:
                orders.append(operands)
        if not orders:
            return
        for e in pc.eqns:  # every pattern equation of the chain stands for the program's
            state = state.map(e, gc.dot, absorbing=gc.eqns if e is pc.dot else ())
        for operands in orders:
            yield from self._all(list(pc.operands), list(operands), state, depth + 1)

    def reciprocal(self, pe, ge, state, depth):
        """`x / c` against `x * c'` (either way round), c' within an ulp of 1 / c."""
        p_side, g_side = self._scaled(pe, self._pattern_const), self._scaled(ge, self.graph.const_value)
        if p_side is None or g_side is None:
            return
        (p_x, p_c), (g_x, g_c) = p_side, g_side
        if self.exact:
            times, over = (p_c, g_c) if pe.primitive.name == "mul" else (g_c, p_c)
            if not (_same_types(pe.outvars, ge.outvars)
                    and close_to_reciprocal(times, over, pe.outvars[0].aval.dtype)):
                return
        yield from self.atom(p_x, g_x, state.map(pe, ge), depth + 1)

    @staticmethod
    def _scaled(eqn, const_value):
        """(x, c) for `x / c` or `x * c` (either order) with c constant, else None."""
        a, b = eqn.invars
        if eqn.primitive.name == "div":
            c = const_value(b)
            return None if c is None else (a, c)
        for x, y in ((a, b), (b, a)):
            c = const_value(y)
            if c is not None and const_value(x) is None:
                return x, c
        return None

    def eqn(self, pe, ge, p_out, g_out, state, depth):
        if p_out != g_out or len(pe.invars) != len(ge.invars) or len(pe.outvars) != len(ge.outvars):
            return
        done = state.mapped.get(id(pe))
        if done is not None:
            if done is ge:
                yield state
            return
        if id(ge) in state.used:
            return  # one program equation per pattern equation
        if ge.effects:
            return
        if {pe.primitive.name, ge.primitive.name} == {"div", "mul"}:
            yield from self.reciprocal(pe, ge, state, depth)
            return
        if pe.primitive.name != ge.primitive.name:
            return
        if self.exact and not (_same_types(pe.outvars, ge.outvars)
                               and _same_params(_canonical(pe), _canonical(ge))):
            return
        state = state.map(pe, ge)
        orders = [list(ge.invars)]
        if pe.primitive.name in xla.COMMUTATIVE and len(ge.invars) == 2:
            orders.append(orders[0][::-1])
        for g_invars in orders:
            yield from self._all(list(pe.invars), g_invars, state, depth + 1)

    def _all(self, ps, gs, state, depth):
        if not ps:
            yield state
            return
        for s in self.atom(ps[0], gs[0], state, depth):
            yield from self._all(ps[1:], gs[1:], s, depth)

    def _pattern_const(self, p):
        if C.is_var(p) and id(p) in self.invars:
            return None
        return self.tgraph.const_value(p)

    def outputs(self, root, state):
        """Every way the template's outputs map onto the program from `root`,
        which produces the first one: (state, program output atoms)."""
        outs = list(self.t.jaxpr.outvars)
        i = output_index(self.producer[id(outs[0])], outs[0])
        if i >= len(root.outvars):
            return
        for s in self.value(outs[0], root.outvars[i], state, 0):
            if id(root) in s.used:
                yield from self._rest(outs, 1, s, [root.outvars[i]])

    def _rest(self, outs, k, state, found):
        if k == len(outs):
            yield state, tuple(found)
            return
        p = outs[k]
        pe = self.producer[id(p)]
        done = state.mapped.get(id(pe))
        if done is not None:
            yield from self._rest(outs, k + 1, state, found + [done.outvars[output_index(pe, p)]])
            return
        for ge in self.graph.eqns:
            if ge.primitive.name == pe.primitive.name:
                i = output_index(pe, p)
                for s in self.eqn(pe, ge, i, i, state, 0):
                    yield from self._rest(outs, k + 1, s, found + [ge.outvars[i]])


def _needs(template: _Template) -> frozenset:
    """Primitives every program match of `template` holds (`Pattern.needs`):
    not the steps matching may skip (shape-only ones), meet in another form
    (`div` as `mul`, a contraction's transposes) or meet as a constant."""
    contracted = {id(e) for c in template.contractions.values() for e in c.eqns}
    names = set()
    for e in template.jaxpr.eqns:
        name = e.primitive.name
        if (name in xla.SHAPE_ONLY or name in RESPELLED or id(e) in contracted
                or all(template.graph.const_value(v) is not None for v in e.outvars)):
            continue
        names.add(name)
    return frozenset(names)


def _widening(eqn) -> bool:
    """A cast to a wider float: it keeps every value."""
    if eqn.primitive.name != "convert_element_type" or len(eqn.invars) != 1:
        return False
    src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
    return (src != dst and jax.numpy.issubdtype(src, jax.numpy.floating)
            and jax.numpy.issubdtype(dst, jax.numpy.floating) and jax.numpy.promote_types(src, dst) == dst)


def _transposed_later(eqn, graph: Graph) -> bool:
    """A contraction whose result only a transpose reads: matched from there."""
    if eqn.primitive.name != "dot_general":
        return False
    users = graph.users(eqn.outvars[0])
    return graph.uses(eqn.outvars[0]) == 1 and len(users) == 1 \
        and users[0].primitive.name == "transpose"


def _same_constant(p_value, g_value, p, g) -> bool:
    """The same type, and the same value element for element (a constant's
    value may be held before its broadcast)."""
    if (np.dtype(p.aval.dtype) != np.dtype(g.aval.dtype)
            or tuple(p.aval.shape) != tuple(g.aval.shape)):
        return False
    # a weakly typed literal may be held as a Python float: compare the values
    # the program computes with, in its dtype
    with np.errstate(all="ignore"):
        p_value = np.asarray(p_value).astype(np.dtype(p.aval.dtype))
        g_value = np.asarray(g_value).astype(np.dtype(g.aval.dtype))
    try:
        shape = np.broadcast_shapes(p_value.shape, g_value.shape)
        p_value, g_value = np.broadcast_to(p_value, shape), np.broadcast_to(g_value, shape)
        same = bool(np.array_equal(p_value, g_value, equal_nan=True))
        if same and np.issubdtype(p_value.dtype, np.floating):  # 0.0 is not -0.0 here
            same = bool(np.array_equal(np.signbit(p_value), np.signbit(g_value)))
        return same
    except (ValueError, TypeError):
        return False


def _same_types(ps, gs) -> bool:
    for p, g in zip(ps, gs):
        a, b = p.aval, g.aval
        if (tuple(getattr(a, "shape", ())) != tuple(getattr(b, "shape", ()))
                or getattr(a, "dtype", None) != getattr(b, "dtype", None)
                or getattr(a, "weak_type", False) != getattr(b, "weak_type", False)):
            return False
    return True


def _contraction_params(eqn) -> dict:
    """A dot_general's params but its dimension numbers (compared as an einsum)."""
    return {k: v for k, v in _canonical(eqn).items() if k != "dimension_numbers"}


def _canonical(eqn) -> dict:
    """`eqn`'s params with spellings of the same computation made one: a
    matmul's `preferred_element_type=None` is its result type (jnp's `@`
    names it, flax's Dense leaves it out), default precision is None."""
    params = eqn.params
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        params = dict(params)
        if params.get("preferred_element_type") is None and "preferred_element_type" in params:
            params["preferred_element_type"] = np.dtype(eqn.outvars[0].aval.dtype)
        elif params.get("preferred_element_type") is not None:
            params["preferred_element_type"] = np.dtype(params["preferred_element_type"])
        precision = params.get("precision")
        if precision is not None and all(str(p).endswith("DEFAULT") for p in (
                precision if isinstance(precision, (tuple, list)) else (precision,))):
            params["precision"] = None
    return params


def _same_params(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    body = a.get("call_jaxpr")
    for k in a:
        if k in _RULE_PARAMS and body is not None:
            continue  # per-trace callables: the body and its origin decide (below)
        if not _same_value(a[k], b[k]):
            return False
    if body is not None:
        return C.debug_origin(getattr(body, "jaxpr", body)) == C.debug_origin(
            getattr(b["call_jaxpr"], "jaxpr", b["call_jaxpr"]))
    return True


def _same_value(x, y) -> bool:
    if isinstance(x, C.ClosedJaxpr) or isinstance(y, C.ClosedJaxpr):
        return (isinstance(x, C.ClosedJaxpr) and isinstance(y, C.ClosedJaxpr)
                and len(x.consts) == len(y.consts)
                and all(_same_value(np.asarray(c), np.asarray(d)) for c, d in zip(x.consts, y.consts))
                and _same_jaxpr(x.jaxpr, y.jaxpr))
    if isinstance(x, C.Jaxpr) or isinstance(y, C.Jaxpr):
        return isinstance(x, C.Jaxpr) and isinstance(y, C.Jaxpr) and _same_jaxpr(x, y)
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return np.shape(x) == np.shape(y) and bool(np.array_equal(x, y, equal_nan=True))
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_value(a, b) for a, b in zip(x, y))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - values without a boolean equality
        return x is y


def _same_jaxpr(a: C.Jaxpr, b: C.Jaxpr) -> bool:
    """Alpha-equivalence: the same equations over renamed variables."""
    if (len(a.invars), len(a.constvars), len(a.outvars), len(a.eqns)) != (
            len(b.invars), len(b.constvars), len(b.outvars), len(b.eqns)):
        return False
    names = {id(x): y for x, y in zip([*a.constvars, *a.invars], [*b.constvars, *b.invars])}
    if not _same_types([*a.constvars, *a.invars], [*b.constvars, *b.invars]):
        return False

    def same_atom(x, y):
        if C.is_literal(x) or C.is_literal(y):
            return (C.is_literal(x) and C.is_literal(y) and _same_types([x], [y])
                    and _same_value(np.asarray(C.literal_value(x)), np.asarray(C.literal_value(y))))
        return names.get(id(x)) is y

    for e, f in zip(a.eqns, b.eqns):
        if e.primitive is not f.primitive or len(e.invars) != len(f.invars) \
                or len(e.outvars) != len(f.outvars):
            return False
        if not all(same_atom(x, y) for x, y in zip(e.invars, f.invars)):
            return False
        if not (_same_types(e.outvars, f.outvars) and _same_params(_canonical(e), _canonical(f))):
            return False
        names.update({id(x): y for x, y in zip(e.outvars, f.outvars)})
    return all(same_atom(x, y) for x, y in zip(a.outvars, b.outvars))


# ----------------------------------------------------------------------- rule
class _Rule:
    def __init__(self, patterns: Sequence[Callable], replacement: Callable, name: str,
                 where: Callable | None, example_args, cost: Callable | None = None):
        self.patterns, self.replacement, self.name, self.where = patterns, replacement, name, where
        self.cost_fn = cost
        # traced templates and replacements, per signature and platform: bounded
        # (a long-lived rule meets many shapes) and safe to fill from two threads
        self._templates = BoundedCache(TEMPLATES_KEPT)
        arity = {_arity(p) for p in patterns} | {_arity(replacement)}
        arity.discard(None)
        if len(arity) > 1:
            raise RuleError(f"jaxfuse.rule {name!r}: the pattern(s) and the replacement take "
                            f"different numbers of positional arguments ({sorted(arity)})")
        n = arity.pop() if arity else len(example_args or ())
        if example_args is None:
            if not n:
                raise RuleError(f"jaxfuse.rule {name!r}: give `example_args` (the pattern's "
                                f"signature could not be read)")
            example_args = (_DEFAULT_EXAMPLE,) * n
        self.examples = tuple(_abstract(a) for a in example_args)
        self.roots = set()
        self._heads = []  # (pattern index, template at the examples, its first output's primitive)
        for k, pattern in enumerate(patterns):
            template = self.template(k, self.examples)
            for v in template.jaxpr.outvars:
                if not C.is_var(v) or v in template.jaxpr.invars or v in template.consts:
                    raise RuleError(f"jaxfuse.rule {name!r}: every output of a pattern must be "
                                    f"computed from its arguments (pattern {k} returns an "
                                    f"argument or a constant as is)")
            unused = {id(v) for v in template.jaxpr.invars} - {
                id(a) for e in template.jaxpr.eqns for a in e.invars}
            if unused:
                raise RuleError(f"jaxfuse.rule {name!r}: pattern {k} does not use all of its "
                                f"arguments, so a match could not bind them")
            first = next(e for e in template.jaxpr.eqns if template.jaxpr.outvars[0] in e.outvars)
            heads = {first.primitive.name}
            if id(template.jaxpr.outvars[0]) in template.contractions:
                heads = {"dot_general", "transpose"}  # a program may end it either way
            # the program's root may spell the head otherwise (`x / sqrt(v)` for `x * rsqrt(v)`)
            self.roots |= {n for h in heads for n in SPELLED_AS.get(h, (h,))}
            needs = _needs(template)
            self.needs = needs if k == 0 else self.needs & needs
            self._heads.append((k, template, heads))
            self.check_replacement(self.examples, template.out_avals)

    def template(self, k, avals) -> _Template:
        return self._templates.get((k, _signature(avals)), lambda: _trace(self.patterns[k], avals))

    def replacement_call(self, avals):
        # Per platform too: a replacement may choose its implementation by
        # `jaxfuse.target_platform()` (the attention rules pick cuDNN on a GPU).
        key = ("replacement", target_platform(), _signature(avals))

        def trace():
            # A fresh function per miss: jax caches a jit's trace by function,
            # and would hand back another platform's trace of the same one.
            def call(*args):
                return self.replacement(*args)

            return jax.make_jaxpr(jax.jit(functools.update_wrapper(call, self.replacement)))(*avals)

        return self._templates.get(key, trace)

    def check_replacement(self, avals, pattern_out):
        closed = self.replacement_call(avals)
        got = tuple(v.aval for v in closed.jaxpr.outvars)
        if [(tuple(a.shape), a.dtype) for a in got] != [(tuple(a.shape), a.dtype) for a in pattern_out]:
            raise RuleError(
                f"jaxfuse.rule {self.name!r}: at arguments {_describe(avals)} the pattern returns "
                f"{_describe(pattern_out)} but the replacement returns {_describe(got)}; they "
                f"must return the same shapes and dtypes")
        return closed

    # ---- Pattern protocol
    def match(self, eqn, graph: Graph):
        # Both sides are read in their canonical spellings (`canonical.CanonicalView`):
        # the program's root is the view's equation defining the root's result.
        view, cgraph = _canonical_view(graph)
        croot = view.producer(eqn.outvars[0]) if eqn.outvars else None
        if croot is None:
            return  # the root is a cast the view reads through
        for k, template, heads in self._heads:
            if croot.primitive.name not in heads:
                continue
            loose = _Matcher(template, cgraph, exact=False)
            near, offered = None, False
            # Every binding that re-traces exactly, in order: the walker takes
            # the first `check` passes (`where` may decline one operand order
            # and accept the other).
            for state, _ in loose.outputs(croot, _State({}, {})):
                found = self._in_program(self._verify(k, template, state, croot, cgraph), eqn, view)
                if found is not None and "reason" not in found.info:
                    offered = True
                    yield found
                else:
                    near = near or found
            if not offered and near is not None and not _transposed_later(eqn, graph):
                yield near  # declined, with the reason `explain` shows
            if offered or near is not None:
                return

    def _in_program(self, m: Match | None, root, view: CanonicalView) -> Match | None:
        """A match found in the canonical view as the program's: rooted at
        `root`, absorbing the program equations its equations stand for; a
        near miss where it would read or define a value only the view holds."""
        if m is None:
            return None
        eqns = tuple({id(p): p for e in m.eqns for p in view.origin(e)}.values())
        eqns += view.read_through(eqns)
        if "reason" not in m.info and any(view.is_fresh(a) for a in (*m.operands, *m.outputs)):
            return self._near_miss(root, _State({}, {}), m.operands,
                                   "the match reads or defines a value the program computes only "
                                   "in another layout")
        return dataclasses.replace(m, root=root, eqns=eqns)

    def _verify(self, k, template, state, root, graph) -> Match | None:
        operands = tuple(state.bound.get(id(v)) for v in template.jaxpr.invars)
        if any(a is None for a in operands):
            return None
        avals = tuple(_abstract(a) for a in operands)
        try:
            exact_template = self.template(k, avals)
        except Exception as e:  # noqa: BLE001 - the pattern does not trace at these shapes
            reason = (f"the pattern does not trace at {_describe(avals)}: "
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return self._near_miss(root, state, operands, reason)
        exact = _Matcher(exact_template, graph, exact=True)
        start = _State({id(p): g for p, g in zip(exact_template.jaxpr.invars, operands)}, {})
        for s, outs in exact.outputs(root, start):
            if all(s.bound.get(id(p)) is g for p, g in zip(exact_template.jaxpr.invars, operands)):
                return Match(root=root, eqns=s.program_eqns(), operands=operands,
                             spelling=self.name, outputs=outs,
                             info={"rule": self, "avals": avals,
                                   "out_avals": exact_template.out_avals})
        return self._near_miss(root, state, operands,
                               f"shape {_describe(avals)} does not re-trace to the matched equations")

    def _near_miss(self, root, state, operands, reason) -> Match:
        return Match(root=root, eqns=state.program_eqns(), operands=operands,
                     spelling=self.name, info={"rule": self, "reason": reason})

    @staticmethod
    def _shown(m: Match, graph: Graph) -> list:
        """The operands as `where` and `cost` see them: constants' values, else avals."""
        values = [graph.const_value(a) for a in m.operands]
        return [v if v is not None else a for v, a in zip(values, m.info["avals"])]

    def check(self, m: Match, graph: Graph) -> str | None:
        if "reason" in m.info:
            return m.info["reason"]
        if self.where is not None:
            if not self.where(*self._shown(m, graph)):
                return f"`where` declined the operands {_describe(m.info['avals'])}"
        self.check_replacement(m.info["avals"], m.info["out_avals"])
        return None

    def cost(self, m: Match, graph: Graph):
        """Under `policy="auto"`: the user's `cost(*operands)` (a reason
        declines the site for cost; None applies it)."""
        why = self.cost_fn(*self._shown(m, graph))
        if why is not None and not isinstance(why, (str, Reason)):
            raise RuleError(f"jaxfuse.rule {self.name!r}: `cost` must return None, a string or a "
                            f"jaxfuse Reason, got {type(why).__name__}")
        return why

    def build(self, m: Match, graph: Graph):
        closed = self.replacement_call(m.info["avals"])
        (call,) = closed.jaxpr.eqns if len(closed.jaxpr.eqns) == 1 else (None,)
        if call is None or closed.jaxpr.constvars:
            raise RuleError(f"jaxfuse.rule {self.name!r}: the replacement did not trace to one "
                            f"jit call")
        env = {id(v): a for v, a in zip(closed.jaxpr.invars, m.operands)}
        invars = [env.get(id(a), a) if C.is_var(a) else a for a in call.invars]
        params = {**call.params, "name": self.name} if "name" in call.params else call.params
        return [C.new_eqn(invars, list(m.outputs), call.primitive, params, like=m.root)]


def _arity(fun) -> int | None:
    try:
        params = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in kinds and p.default is inspect.Parameter.empty for p in params)


def rule(pattern, replacement: Callable, *, name: str | None = None,
         where: Callable | None = None, example_args=None, cost: Callable | None = None) -> Pattern:
    """A `jaxfuse.Pattern` that replaces what `pattern` computes by `replacement`.

    `pattern`: a JAX function, or a list of them (several spellings, one
    replacement); `replacement`: a JAX function with the same positional
    parameters, returning the same shapes and dtypes. Each parameter matches
    any value of the user's program; the replacement is called with the
    values matched. `where(*operands)`: a predicate over the matched operands
    (`jax.ShapeDtypeStruct`s, or numpy arrays where they are constants)
    restricting the rule to some sites. `example_args`: arrays or
    `jax.ShapeDtypeStruct`s to trace the pattern at first (default: float32
    (4, 4) arrays); a rule matches at every shape and dtype all the same.
    `cost(*operands)`: under `policy="auto"` only, whether a safe site pays:
    None applies it, a reason (a string) declines it for cost, which
    `explain` shows; under "always" every safe site applies. Without `cost`
    a rule applies at every safe site under every policy.
    Use the result wherever patterns go: `optimize(f, patterns=[...])`,
    `explain`, `register_pattern`.
    """
    patterns = list(pattern) if isinstance(pattern, (list, tuple)) else [pattern]
    if not patterns or not all(callable(p) for p in patterns) or not callable(replacement):
        raise TypeError("jaxfuse.rule: pattern(s) and replacement must be callables")
    name = name or getattr(patterns[0], "__name__", "rule")
    if cost is not None and not callable(cost):
        raise TypeError("jaxfuse.rule: cost must be a callable (or None)")
    r = _Rule(patterns, replacement, name, where, example_args, cost)
    return Pattern(name, r.match, r.check, r.build, roots=frozenset(r.roots),
                   doc=f"user rule {name!r}", needs=r.needs,
                   cost=r.cost if cost is not None else None,
                   replacement=lambda m: r.replacement)


__all__ = ["rule", "RuleError"]
