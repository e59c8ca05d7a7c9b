"""A rule's train-step form: a matched region and its backward, as one site.

In a program traced with its gradient (`jax.value_and_grad` inside
`optimize`), a region a rule matches in the forward pass keeps values for the
backward pass (the softmax of an attention, a norm's reciprocal), and the
backward's equations read them: matched alone, the region's values have
readers outside it and the site is declined. What those readers are is not a
spelling to write down per rule: it is JAX's derivative of the region itself.

So the region's training form is derived, as inductor derives a pattern's
from AOTAutograd's joint graph: the program's own equations of the region
(calls the walker saw through put back, so a custom_jvp's own rule is the
one differentiated) form a function of the region's operands; its `jax.vjp`
with respect to some of them, traced with this jax and read in the rules'
canonical spellings, is the joint template: the region, what autodiff keeps
for the backward, and the backward itself. Matching that template against
the program (the region's operands bound, the cotangents free) finds the
backward's equations and the program values they produce: the gradients of
the region's differentiated operands. The operands whose cotangents the
program computes decide which template: every subset of the floating
operands is tried, largest first.

The rewrite then replaces forward and backward together: a call of the
replacement's forward (`jax.vjp` of the rule's replacement, its residuals
as outputs) where the region was, and a call of the replacement's own VJP
(a custom_vjp's bwd where it has one) where the backward produced the
gradients. What is kept between them is what the replacement keeps (for
`jax.nn.dot_product_attention`'s cuDNN kernel, no [T, S] probabilities).
"""

from __future__ import annotations

import itertools

import numpy as np

import jax

from ... import _compat as C
from ..._reasons import ReasonKind
from .patterns import Match

BACKWARD_DIFFERS = ReasonKind(
    "backward-differs",
    "forward matched; the backward that reads its `{culprit}` result (a value kept for the "
    "gradient) is not the region's own gradient{detail}", blame="readers")

MAX_OPERANDS = 6  # subsets of the differentiated operands tried: at most 2^6 - 1


def _float(aval) -> bool:
    dtype = np.dtype(getattr(aval, "dtype", np.float32)) if str(getattr(aval, "dtype", "")) != \
        "bfloat16" else None
    return dtype is None or np.issubdtype(dtype, np.floating)


def internal_readers(m: Match, graph) -> list:
    """The equations outside `m` that read a value `m` computes but does not
    define for the program (what its training form must take in)."""
    inside = {id(e) for e in m.eqns} - {id(e) for e in m.shared}
    outputs = {id(v) for v in m.outputs}
    found, seen = [], set()
    for e in m.eqns:
        if id(e) not in inside:
            continue
        for v in e.outvars:
            if id(v) in outputs or not C.is_var(v):
                continue
            for r in graph.users(v):
                if id(r) not in inside and id(r) not in seen:
                    seen.add(id(r))
                    found.append((e, r))
    return found


def region(m: Match, graph) -> tuple:
    """(closed jaxpr, operands, extras) of the region `m` absorbs, as the
    program computes it: its equations in program order, with the equations
    that compute a value it reads from its operands alone (a layout step the
    rule read through: `_operand_chains`), every call the walker saw through
    and the region takes whole put back (its derivative rule with it). Its
    inputs are `m`'s operands, then `extras`: values it reads that are
    neither (a mask the program builds), which the gradient does not flow to."""
    operands = [a for a in m.operands if C.is_var(a)]
    inside = {id(e) for e in m.eqns} - {id(e) for e in m.shared}
    inside |= _operand_chains([e for e in graph.eqns if id(e) in inside], operands, graph)
    eqns, placed = [], set()
    for e in graph.eqns:
        if id(e) not in inside:
            continue
        whole = None
        for g in graph.calls_around(e):
            # (constants of its body the match leaves to the program do not count)
            if all(id(x) in inside or id(x) in g.constants for x in g.eqns):
                whole = g
                break
        if whole is not None:
            if id(whole) not in placed:
                placed.add(id(whole))
                eqns.append(whole.call)
            continue
        eqns.append(e)
    known = {id(a) for a in operands}
    defined = {id(v) for e in eqns for v in e.outvars}
    consts, constvars, extras = [], [], []
    for e in eqns:
        for a in e.invars:
            if not C.is_var(a) or id(a) in defined or id(a) in known:
                continue
            known.add(id(a))
            value = graph.const_value(a)
            if value is not None:  # (a constant may be held before its broadcast)
                constvars.append(a)
                consts.append(np.broadcast_to(np.asarray(value, np.dtype(a.aval.dtype)),
                                              tuple(a.aval.shape)))
            else:
                extras.append(a)
    jaxpr = C.make_jaxpr_of(constvars, [*operands, *extras], eqns, list(m.outputs))
    return C.ClosedJaxpr(jaxpr, consts), operands, extras


def _operand_chains(eqns, operands, graph, limit: int = 16) -> set:
    """ids of the equations outside `eqns` that compute a value they read from
    the operands alone (an attention's repeat of grouped keys: in a train step
    its result is also read by the backward, so the match leaves it out, yet
    the region's gradient flows through it)."""
    ops = {id(a) for a in operands}
    inside = {id(e) for e in eqns}
    added: set = set()

    def chain(v, depth):
        if not C.is_var(v) or id(v) in ops or graph.const_value(v) is not None:
            return []
        p = graph.producer(v)
        if p is None or p.effects or depth > limit:
            return None
        if id(p) in inside or id(p) in added:
            return []
        found = [p]
        for a in p.invars:
            sub = chain(a, depth + 1)
            if sub is None:
                return None
            found += sub
        return found

    defined = {id(v) for e in eqns for v in e.outvars}
    for e in eqns:
        for a in e.invars:
            if C.is_var(a) and id(a) not in defined and id(a) not in ops:
                found = chain(a, 0)
                if found:
                    added.update(id(p) for p in found)
    return added


def joint_function(closed, n: int, diff: tuple):
    """f(*inputs, *cotangents) -> (*outputs, *gradients of the inputs in
    `diff`), `n` inputs."""
    def joint(*args):
        xs, cts = args[:n], args[n:]

        def partial(*d):
            full = list(xs)
            for i, x in zip(diff, d):
                full[i] = x
            return C.eval_closed(closed, *full)

        outs, vjp = jax.vjp(partial, *[xs[i] for i in diff])
        return (*outs, *vjp(list(cts)))
    return joint


def joint_match(m: Match, graph):
    """The training form of `m` (a Match taking its backward too: operands
    the region's and the cotangents, outputs the region's and the gradients),
    a Reason where the backward differs, or None where nothing outside reads
    the region's values (no training form to find)."""
    from .rule_engine import _Matcher, _State, _canonical_view, _trace

    readers = internal_readers(m, graph)
    if not readers:
        return None
    closed, operands, extras = region(m, graph)
    first, reader = readers[0]
    if len(operands) != len(m.operands):
        return BACKWARD_DIFFERS(first.primitive.name, detail=" (an operand is a literal)")
    n = len(operands) + len(extras)
    floats = [i for i, a in enumerate(operands) if _float(a.aval)]
    if not floats or len(floats) > MAX_OPERANDS:
        return BACKWARD_DIFFERS(first.primitive.name, detail="")
    view, cgraph = _canonical_view(graph)
    croot = view.producer(view.atom(m.outputs[0]))
    if croot is None:
        return BACKWARD_DIFFERS(first.primitive.name, detail="")
    inputs = [*operands, *extras]
    avals = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype) for a in inputs]
    cts = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in m.outputs]
    backward_reads = set()  # what a backward of the region reads its values with
    for size in range(len(floats), 0, -1):
        for diff in itertools.combinations(floats, size):
            try:
                template = _trace(joint_function(closed, n, diff), [*avals, *cts])
            except Exception:  # noqa: BLE001 - not differentiable so (an integer path): next subset
                continue
            backward_reads |= _backward_readers(template.jaxpr, n)
            outs = template.jaxpr.outvars
            if any(not C.is_var(v) or v in template.jaxpr.invars for v in outs):
                continue  # a gradient that is a constant (zero): not this subset
            exact = _Matcher(template, cgraph, exact=True)
            start = _State({id(p): view.atom(g)
                            for p, g in zip(template.jaxpr.invars[:n], inputs)}, {})
            for state, found in exact.outputs(croot, start):
                bound = [state.bound.get(id(p)) for p in template.jaxpr.invars[n:]]
                if any(b is None for b in bound):
                    continue
                eqns = tuple({id(p): p for e in _taken(template.jaxpr, n, diff, state)
                              for p in view.origin(e)}.values())
                eqns += view.read_through(eqns)
                if any(view.is_fresh(a) for a in (*bound, *found)):
                    continue
                return Match(root=m.root, eqns=eqns, operands=(*operands, *bound),
                             spelling=m.spelling + " + gradient",
                             outputs=tuple(found),
                             info={**m.info, "training": {"diff": diff, "n": len(operands),
                                                          "outputs": len(m.outputs),
                                                          "forward": m}})
    if not any(r.primitive.name in backward_reads for _, r in readers):
        return None  # readers no backward of the region has: a second use, not a backward
    where = C.user_frame(reader.source_info)
    detail = f" (`{reader.primitive.name}`" + (f" at {where[0]}:{where[1]})" if where else ")")
    return BACKWARD_DIFFERS(first.primitive.name, detail=detail)


def _taken(jaxpr, n: int, diff: tuple, state) -> list:
    """The program equations a joint template's match takes: those standing
    for template equations the differentiated inputs or the cotangents reach.
    What the rest compute (a mask's bias from the mask alone) stays in the
    program, shared with any other reader (the next layer's copy of it)."""
    reached = {id(jaxpr.invars[i]) for i in diff} | {id(v) for v in jaxpr.invars[n:]}
    out, seen = [], set()
    for e in jaxpr.eqns:
        if not any(C.is_var(a) and id(a) in reached for a in e.invars):
            continue
        reached.update(id(v) for v in e.outvars)
        g = state.mapped.get(id(e))
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    for g in state.absorbed:
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def _backward_readers(jaxpr, n: int) -> set:
    """Primitives of a joint template's backward equations (those the
    cotangents reach) that read a value of its forward."""
    tangent = {id(v) for v in jaxpr.invars[n:]}
    forward = {id(v) for v in jaxpr.invars[:n]}
    names = set()
    for e in jaxpr.eqns:
        reads = [a for a in e.invars if C.is_var(a)]
        if any(id(a) in tangent for a in reads):
            if any(id(a) in forward for a in reads):
                names.add(e.primitive.name)
            tangent.update(id(v) for v in e.outvars)
        else:
            forward.update(id(v) for v in e.outvars)
    return names


def calls(replacement, avals, diff: tuple, out_avals, name: str):
    """(forward, backward) ClosedJaxprs, each one jit call named after the
    rule: forward(*operands) -> (*outputs, *residuals), the replacement's
    value and what its `jax.vjp` keeps; backward(*residuals, *cotangents) ->
    the gradients of the operands in `diff`, the replacement's own VJP."""
    held = {}

    def vjp_of(*xs):
        def partial(*d):
            full = list(xs)
            for i, x in zip(diff, d):
                full[i] = x
            out = replacement(*full)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return jax.vjp(partial, *[xs[i] for i in diff])

    def forward(*xs):
        outs, vjp = vjp_of(*xs)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        held["tree"] = tree
        return (*outs, *leaves)

    def backward(*args):
        leaves, cts = args[:len(args) - len(out_avals)], args[len(args) - len(out_avals):]
        vjp = jax.tree_util.tree_unflatten(held["tree"], list(leaves))
        return tuple(vjp(tuple(cts)))

    forward.__name__ = forward.__qualname__ = name
    backward.__name__ = backward.__qualname__ = name + "_vjp"
    fwd = jax.make_jaxpr(jax.jit(forward))(*avals)
    res = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
           for v in fwd.jaxpr.outvars[len(out_avals):]]
    bwd = jax.make_jaxpr(jax.jit(backward))(*res, *out_avals)
    return fwd, bwd


def build(replacement, m: Match, name: str) -> list:
    """The forward call and the VJP call replacing `m` (a `joint_match`)."""
    t = m.info["training"]
    n, n_out, diff = t["n"], t["outputs"], t["diff"]
    operands, cts = m.operands[:n], m.operands[n:]
    avals = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype) for a in operands]
    out_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in m.outputs[:n_out]]
    fwd, bwd = calls(replacement, avals, diff, out_avals, name)
    if len(fwd.jaxpr.eqns) != 1 or len(bwd.jaxpr.eqns) != 1 or fwd.jaxpr.constvars \
            or bwd.jaxpr.constvars:
        raise ValueError(f"{name}: the replacement's forward and VJP did not trace to one jit "
                         f"call each")
    (fcall,), (bcall,) = fwd.jaxpr.eqns, bwd.jaxpr.eqns
    residuals = [C.new_var(v.aval) for v in fwd.jaxpr.outvars[n_out:]]
    env = {id(v): a for v, a in zip(fwd.jaxpr.invars, operands)}
    f_in = [env.get(id(a), a) if C.is_var(a) else a for a in fcall.invars]
    f_out = [*m.outputs[:n_out], *residuals]
    out_map = {id(v): w for v, w in zip(fwd.jaxpr.outvars, f_out)}
    f_out = [out_map.get(id(v), C.new_var(v.aval)) for v in fcall.outvars]
    benv = {id(v): a for v, a in zip(bwd.jaxpr.invars, [*residuals, *cts])}
    b_in = [benv.get(id(a), a) if C.is_var(a) else a for a in bcall.invars]
    b_map = {id(v): w for v, w in zip(bwd.jaxpr.outvars, m.outputs[n_out:])}
    b_out = [b_map.get(id(v), C.new_var(v.aval)) for v in bcall.outvars]
    forward = m.info["training"]["forward"]
    return [C.new_eqn(f_in, f_out, fcall.primitive, {**fcall.params, "name": name},
                      like=forward.root),
            C.new_eqn(b_in, b_out, bcall.primitive, {**bcall.params, "name": name + "_vjp"},
                      like=forward.root)]
