"""The built-in patterns: an `add` into a ReLU, and the BatchNorm / residual
epilogues around it, become one fused op (`add_relu_p` or `epilogue_p`).

Each pattern is a tree (dsl.py) plus the flags of the fused op it becomes.
They are tried most specific first, so `relu((x - m) * s + t + r)` becomes
one call rather than a `mul` and a `sub` left to XLA:

  name                        tree                              fused op
  norm_residual_relu          relu((((x - m) * q) * s + t) + r) epilogue(mean, prescale, scale, residual)
  norm_relu                   relu(((x - m) * q) * s + t)       epilogue(mean, prescale, scale)
  bn_residual_relu            relu(((x - m) * s + t) + r)       epilogue(mean, scale, residual)
  bn_relu                     relu((x - m) * s + t)             epilogue(mean, scale)
  scale_shift_residual_relu   relu((x * s + t) + r)             epilogue(scale, residual)
  scale_shift_relu            relu(x * s + t)                   epilogue(scale)
  bias_residual_relu          relu((x + t) + r)                 epilogue(residual)
  add_relu                    relu(x + t)                       add_relu

(norm_*: stax's and equinox's BatchNorm, `gamma * ((x - mean) * rsqrt(var)) + beta`,
two products the kernel rounds as XLA does.) A residual sum written `(0 + a) + b` (stax's FanInSum: Python's `sum`) matches
as `a + b`, exactly so under the ReLU (dsl.ZeroPlus). `add` and `mul` match in
either operand order (`t + s * x`); an operand that
is a broadcast adding size-1 dims is read in place from its source. Under
`grad`, the pre-activation's derivative masks (masks.py) are rewritten from
the fused op's output and, where needed, its tie mask.
"""

from __future__ import annotations

import dataclasses

import numpy as np


from ...ops.primitive import add_relu_p, check_broadcast, epilogue_labels, epilogue_p

from ... import _compat as C
from ..._reasons import ReasonKind, message
from ..ir.xla import REPEATS
from ..safety import rounding
from . import masks as M
from ..match.dsl import add, matches, mul, operand, required_primitives, sub, zero_plus
from ..ir.graph import Graph
from ..match.patterns import Match, Pattern
from .relu import ROOTS, relu

x, m, q, s, t, r = (operand(n) for n in ("x", "mean", "prescale", "scale", "shift", "residual"))


@dataclasses.dataclass(frozen=True)
class Spec:
    """One epilogue pattern: its tree and the fused op's operand flags."""

    name: str
    tree: object
    mean: bool
    scale: bool
    residual: bool
    doc: str
    prescale: bool = False

    @property
    def form(self) -> str:
        """What the kernel reads besides `x`, as the cost model's thresholds are
        measured: "residual", "batchnorm" (a mean), "scale_shift" or "plain"."""
        return ("residual" if self.residual else "batchnorm" if self.mean
                else "scale_shift" if self.scale else "plain")

    @property
    def labels(self):
        return epilogue_labels(mean=self.mean, prescale=self.prescale, scale=self.scale,
                               residual=self.residual)

    @property
    def factors(self) -> tuple:
        """The operands of the site's own product `((x - mean) * prescale) * scale`."""
        return tuple(k for k in self.labels if k in ("x", "mean", "prescale", "scale")) \
            if self.scale else ()

    @property
    def addends(self) -> tuple:
        """The operands the site adds or subtracts (a product there could be contracted)."""
        summed = ("shift", "residual", *(("x", "mean") if self.mean or not self.scale else ()))
        return tuple(k for k in self.labels if k in summed)


SPECS = (
    Spec("norm_residual_relu",
           relu(add(zero_plus(add(mul(mul(sub(x, m, tag="sub"), q), s), t)), r)),
           True, True, True, "relu((((x - m) * q) * s + t) + r) -> one jaxfuse_epilogue call",
           prescale=True),
    Spec("norm_relu", relu(add(mul(mul(sub(x, m, tag="sub"), q), s), t)), True, True, False,
           "relu(((x - m) * q) * s + t) -> one jaxfuse_epilogue call", prescale=True),
    Spec("bn_residual_relu", relu(add(zero_plus(add(mul(sub(x, m, tag="sub"), s), t)), r)),
           True, True, True,
           "relu(((x - m) * s + t) + r) -> one jaxfuse_epilogue call"),
    Spec("bn_relu", relu(add(mul(sub(x, m, tag="sub"), s), t)), True, True, False,
           "relu((x - m) * s + t) -> one jaxfuse_epilogue call"),
    Spec("scale_shift_residual_relu", relu(add(zero_plus(add(mul(x, s), t)), r)), False, True, True,
           "relu((x * s + t) + r) -> one jaxfuse_epilogue call"),
    Spec("scale_shift_relu", relu(add(mul(x, s), t)), False, True, False,
           "relu(x * s + t) -> one jaxfuse_epilogue call"),
    Spec("bias_residual_relu", relu(add(add(x, t), r)), False, False, True,
           "relu((x + t) + r) -> one jaxfuse_epilogue call"),
    Spec("add_relu", relu(add(x, t)), False, False, False,
           "add followed by ReLU -> jaxfuse_add_relu (one custom call)"),
)


def _candidates(spec: Spec):
    def match(eqn, graph: Graph):
        out = eqn.outvars[0] if len(eqn.outvars) == 1 else None
        if out is None:
            return
        for st in matches(spec.tree, out, graph):
            yield _to_match(spec, st, eqn, graph)

    return match


def _to_match(spec, st, root, graph) -> Match:
    sp = st.notes["relu"]
    v, out = sp.operand, root.outvars[0]
    inside = {id(e) for e in st.eqns}
    found = M.find(v, out, graph, inside) if graph.uses(v) > 1 else []
    found = found or []
    operands = tuple(st.bindings[n] for n in spec.labels)
    # `x - m` read elsewhere too (a training step's backward pass reads it for
    # the scale's gradient): the kernel computes it from x and m, and the
    # program keeps it for those readers, as XLA would recompute it in each of
    # their loops. (A shared multiply is not taken: XLA might then not
    # contract it into the add, and the kernel's bits would differ.)
    centred = st.notes.get("sub")
    shared = (centred,) if centred is not None and _read_outside(centred, graph, inside) else ()
    return Match(
        root=root, eqns=(*st.eqns, *(mk.eqn for mk in found)),
        operands=tuple(o.atom for o in operands), spelling=sp.text,
        outputs=(out, *(mk.eqn.outvars[0] for mk in found)), shared=shared,
        info={"spec": spec, "relu": sp, "operands": operands, "masks": tuple(found)})


def _read_outside(eqn, graph, inside) -> bool:
    v = eqn.outvars[0]
    return graph.is_output(v) or any(id(u) not in inside for u in graph.users(v))


# XLA's algebraic simplifier rewrites `(a + c1) + c2` as `a + (c1 + c2)` and
# `(a * c1) * c2` as `a * (c1 * c2)` when c1 and c2 are splat constants, in
# floating point too (seen on XLA:CPU with jax 0.10 and 0.11; a subtraction
# counts as an add, and constants that differ element to element are left
# alone). A site holding the outer op would round `a + c1` first.
_REASSOCIATED = ({"add", "sub", "add_any"}, {"mul"})

REASSOCIATED = ReasonKind(
    "reassociated-constants",
    "XLA folds the constants of `(a {op} c1) {op} c2` into `a {op} (c1 {op} c2)`, rounding once "
    "where the fused op would round `a {op} c1` first", exact_only=True)
OPERAND_CONTRACT = message("operand-contract")  # the fused op's own check's words
RELU_CHANGES_TYPE = ReasonKind(
    "relu-changes-type", "the ReLU changes its operand's type from {before} to {after}")
RELU_CHANGES_WEAK_TYPE = ReasonKind(
    "relu-changes-weak-type", "the ReLU changes its operand's weak type")


def _splat_constant(atom, graph: Graph) -> bool:
    v = graph.const_value(atom)
    return v is not None and (v.size <= 1 or bool(np.all(v == v.flat[0])))


def _producer_seen_through(atom, graph: Graph):
    eqn = graph.producer(atom)
    while eqn is not None and eqn.primitive.name in REPEATS:
        eqn = graph.producer(eqn.invars[0])
    return eqn


def reassociated_constants(mt: Match, graph: Graph):
    """Why XLA would compute one of the site's ops differently: it folds the
    op's constant into the constant of the same kind of op producing its other
    operand (None: no such pair)."""
    for eqn in mt.eqns:
        group = next((g for g in _REASSOCIATED if eqn.primitive.name in g), None)
        if group is None or not any(_splat_constant(a, graph) for a in eqn.invars):
            continue
        for a in eqn.invars:
            if _splat_constant(a, graph):
                continue
            inner = _producer_seen_through(a, graph)
            if (inner is not None and inner.primitive.name in group
                    and any(_splat_constant(b, graph) for b in inner.invars)):
                return REASSOCIATED(eqn.primitive.name, op="+" if "add" in group else "*")
    return None


def check(mt: Match, graph: Graph):
    spec, sp, operands = mt.info["spec"], mt.info["relu"], mt.info["operands"]
    if sp.decline:
        return sp.decline
    folded = reassociated_constants(mt, graph)
    if folded:
        return folded
    try:  # the fused op's own operand contract, its message as the reason
        check_broadcast("", [(n, o.shape, o.aval.dtype) for n, o in zip(spec.labels, operands)])
    except (TypeError, ValueError) as e:
        return OPERAND_CONTRACT(text=str(e).removeprefix(": "))
    y, out = sp.operand.aval, mt.root.outvars[0].aval
    if (tuple(out.shape), out.dtype) != (tuple(y.shape), y.dtype):
        return RELU_CHANGES_TYPE(before=y.str_short(), after=out.str_short())
    if getattr(out, "weak_type", False) != getattr(y, "weak_type", False):
        return RELU_CHANGES_WEAK_TYPE()
    return rounding.site_reason(spec.labels, operands, spec.addends, spec.factors, y, graph)


def build(mt: Match, graph: Graph):
    spec, sp = mt.info["spec"], mt.info["relu"]
    found = mt.info["masks"]
    like = mt.root
    eqns, atoms = [], []
    for o in mt.info["operands"]:
        if o.via is None:
            atoms.append(o.atom)
            continue
        # Read the broadcast's source in place: the same broadcast_in_dim, to
        # the size-1 view instead of the full shape.
        view = C.new_var(o.via.outvars[0].aval.update(shape=o.shape))
        eqns.append(C.new_eqn([o.atom], [view], o.via.primitive,
                              {**o.via.params, "shape": o.shape}, like=o.via))
        atoms.append(view)
    out = mt.root.outvars[0]
    needs_tie = any(M.NEEDS_TIE[mk.kind] for mk in found)
    tie_var = None
    if needs_tie:
        given = [mk.eqn.outvars[0] for mk in found if mk.kind == "eq"]
        tie_var = given[0] if given else C.new_var(
            out.aval.update(dtype=np.dtype(np.bool_), weak_type=False))
    effects = C.no_effects()
    for e in mt.eqns:
        effects = effects | e.effects
    # Write the result over a full-size operand nothing reads afterwards.
    inplace = next((k for k in mt.dead_operands
                    if mt.info["operands"][k].via is None
                    and tuple(mt.info["operands"][k].shape) == tuple(out.aval.shape)), None)
    # Optional params are left out when unset, so a plain site's params stay minimal.
    optional = {k: v for k, v in (("site_facts", mt.cost), ("inplace", inplace)) if v is not None}
    if not mt.exact and spec.name != "add_relu":
        optional["exact"] = False  # the lowering keeps the kernel where XLA rounds by position
    if spec.name == "add_relu" and not needs_tie:
        params = {"grad_at_zero": sp.grad_at_zero, **optional}
        eqns.append(C.new_eqn(atoms, [out], add_relu_p, params, like=like, effects=effects))
    else:
        params = {"mean": spec.mean, "prescale": spec.prescale, "scale": spec.scale,
                  "residual": spec.residual, "tie": needs_tie, "grad_at_zero": sp.grad_at_zero,
                  **optional}
        eqns.append(C.new_eqn(atoms, [out, tie_var] if needs_tie else [out], epilogue_p,
                              params, like=like, effects=effects))
    eqns.extend(M.build(found, out, tie_var, like=like))
    return eqns


PATTERNS = tuple(
    Pattern(f.name, _candidates(f), check, build, roots=ROOTS, doc=f.doc, barrier=True,
            needs=required_primitives(f.tree), form=f.form)
    for f in SPECS)

__all__ = ["SPECS", "PATTERNS"]
