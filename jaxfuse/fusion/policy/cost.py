"""The cost model behind `policy="auto"`: fuse a site only where the custom call
cannot lose to the fusion XLA would do itself.

What the model knows (measured; benchmarks/results/README.md has the runs):

  * A custom call is a fusion barrier. XLA fuses elementwise producers and
    consumers of the add/ReLU into the same loop; behind a custom call each of
    them writes its full-size result to memory and reads it back.
  * On GPU, XLA folds bias + ReLU into the matmul's cuBLASLt epilogue
    (BIAS_RELU) and into cuDNN's fused convolution; replacing that costs a
    whole extra pass. XLA:CPU does neither (dot and conv run in YNNPACK with
    the bias/ReLU in a loop fusion after them), so there it is only a loop.
  * XLA:CPU runs an NCHW convolution in NHWC and folds the transpose back into
    the epilogue loop; a custom call needs row-major NCHW operands, so that
    transpose becomes a copy of its own.
  * A custom call costs a few microseconds on CPU; below a size measured per
    platform and dtype the kernel cannot win that back.
  * A size with symbolic dimensions (shape-polymorphic `jax.export`) is not
    known when the program is rewritten or lowered, so nothing says the call
    pays: such a site is declined. Only comparisons that hold for every value
    of the dimensions are used (`_at_least`), never an `int` of a symbolic size.

Decisions are made twice. When the jaxpr is rewritten: what holds on every
platform (producers and consumers XLA would fuse), and what depends on the
platform (epilogue folding, layouts, call overhead) for the platform the
program is expected to be compiled for (`optimize`: the default device, as jit
uses it for uncommitted arguments; `explain`: the arguments' devices). A site
declined then is left alone, so a program with no fused site is exactly the
one `jax.jit` compiles. The platform facts are also recorded on the fused op
(`SiteFacts`, its `cost` parameter) and checked again when jit lowers it for
the platform really compiled for (arguments committed elsewhere, export for
several platforms): a site declined only there lowers to XLA's own ops, with
the same values, in the rewrite's arrangement of the program.

The model is a function of a `Plan` (plan.py): the policy, the platform, and
the decisions made by measurement, all values; it holds no state of its own.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jax import errors as _errors

from ... import _compat as C
from ..._reasons import Bytes, ReasonKind
from ...ops.facts import SiteFacts, in_conv_band, platform_reason, symbolic as _symbolic
from ..ir.graph import Graph
from ..ir.xla import FUSIBLE, FUSING_CONSUMERS, TRANSPARENT, body_of, moves_no_data
from ..match.walker import Walked, walk
from .plan import Plan, rule_key

POLICIES = ("auto", "always", "measure")

_JAXFUSE = frozenset({"jaxfuse_add_relu", "jaxfuse_epilogue"})
# An operand this much smaller than the output costs nothing to materialize.
_SMALL = 16

FUSIBLE_OPERAND = ReasonKind(
    "fusible-operand",
    "operand {position} comes from a `{culprit}` that XLA fuses into the same loop; as a "
    "custom-call operand it is written out and read back (+{extra})", blame="producer")
FUSIBLE_READERS = ReasonKind(
    "fusible-readers",
    "the result is only read by ops XLA fuses into the same loop ({used_by}); a custom call "
    "writes it out and reads it back (+{extra})")


def _size(atom):
    """Elements of `atom`: an int, or a symbolic expression (shape-polymorphic export)."""
    size = math.prod(getattr(atom.aval, "shape", ()))
    return size if _symbolic(size) else int(size)


def _at_least(a, b) -> bool:
    """Whether `a >= b` for every value of their symbolic dimensions (False
    where jax cannot decide it: unproven is not true)."""
    try:
        return bool(a >= b)
    except _errors.InconclusiveDimensionOperation:
        return False


def _bytes(n):
    """A byte count for a reason's text (symbolic: its expression)."""
    return f"{n} bytes" if _symbolic(n) else Bytes(n)


# --------------------------------------------------------------- boundaries
@dataclasses.dataclass(frozen=True)
class Context:
    """How a (nested) jaxpr's inputs and outputs meet the program around it."""

    inputs: tuple
    """Per invar: (producer class, primitive) the caller gives it."""
    outputs: tuple
    """Per outvar: the set of materializing reader kinds in the caller."""

    @property
    def key(self):
        return (self.inputs, self.outputs)


TOP = None  # the traced function itself: inputs are arguments, outputs are results


class CostModel:
    """Decides barrier patterns for one rewrite under `plan` (a `plan.Plan`)."""

    def __init__(self, plan):
        self.plan = plan

    @property
    def policy(self) -> str:
        return self.plan.policy

    @property
    def platform(self) -> str | None:
        return self.plan.platform

    # ---- contexts for nested jaxprs (walker.descend)
    def context_for(self, eqn, body, graph, outer=TOP) -> Context | None:
        name = eqn.primitive.name
        body_jaxpr = getattr(body, "jaxpr", body)
        if name not in TRANSPARENT or len(body_jaxpr.invars) != len(eqn.invars):
            return Context((("input", None),) * len(body_jaxpr.invars),
                           (("loop",),) * len(body_jaxpr.outvars))
        inputs = tuple(producer_class(a, graph, outer) for a in eqn.invars)
        outputs = tuple(tuple(sorted(materializing_readers(v, graph, outer)))
                        for v in eqn.outvars[:len(body_jaxpr.outvars)])
        return Context(inputs, outputs)

    # ---- the decision (walker.match_all)
    def evaluate(self, m, graph, context, pattern, next_probe):
        """(why the site is declined or None, its `SiteFacts` or None) for a
        match `m` of the barrier `pattern`; `next_probe()` numbers a site the
        probe must ask XLA about (the walk's own counter)."""
        out = m.root.outvars[0]
        n_out = _size(out)
        if not _symbolic(n_out):
            n_out = max(n_out, 1)
        itemsize = np.dtype(out.aval.dtype).itemsize
        producers, written = [], 0
        inside = {id(e) for e in m.eqns}
        for k, a in enumerate(m.operands):
            cls, prim = producer_class(a, graph, context)
            if cls == "fusible" and C.is_var(a) and materializing_readers(a, graph, context, inside):
                cls = "materialized"  # another reader keeps it in memory in XLA's program too
            if cls == "fusible":
                # "small" only where provably so: a symbolic operand may be as large as the output
                if not _at_least(n_out, _size(a) * _SMALL):
                    return FUSIBLE_OPERAND(prim, position=k + 1,
                                           extra=_bytes(2 * _size(a) * itemsize)), None
                cls = "small"
                written += _size(a) * itemsize if not _symbolic(_size(a)) else 0
            producers.append(cls)
        readers = materializing_readers(out, graph, context, skip=inside)
        if not readers:
            users = sorted({e.primitive.name for e in graph.users(out) if id(e) not in inside})
            used_by = ", ".join(f"`{u}`" for u in users) or "nothing outside the site"
            return FUSIBLE_READERS(used_by=used_by, extra=_bytes(2 * n_out * itemsize)), None
        form, channels = _form_and_channels(getattr(pattern, "form", ""),
                                            [_size(a) for a in m.operands], n_out)
        facts = SiteFacts(pattern.name, str(n_out) if _symbolic(n_out) else n_out,
                          np.dtype(out.aval.dtype).name, tuple(producers),
                          tuple(sorted(readers)), form, channels, written_bytes=written)
        platform = self.plan.platform
        # Known platform: decline here, so the site keeps XLA's own program
        # exactly (a site declined only at lowering gets XLA's ops, but in the
        # rewrite's arrangement: inlined calls, moved derivative masks).
        reason = platform_reason(facts, platform) if platform else None
        if reason is None and platform and in_conv_band(facts, platform):
            # Whether XLA would put this epilogue into one library fusion with
            # the convolutions around it is only known from its compiled
            # program: the probe asks, after the rewrite.
            facts = dataclasses.replace(facts, probe=next_probe())
        return self.plan.decide(facts, reason)


    def evaluate_rule(self, m, graph, pattern):
        """Why a rule's match `m` is declined for cost (None: it is applied):
        the rule's own cost function, where it has one, then what measurement
        decided for matches of its kind."""
        own = getattr(pattern, "cost", None)
        if own is not None:
            why = own(m, graph)
            if why is not None:
                return why
        avals = [getattr(a, "aval", None) for a in m.operands]
        return self.plan.decide_rule(rule_key(
            pattern.name, [tuple(getattr(a, "shape", ())) for a in avals],
            [str(getattr(a, "dtype", "?")) for a in avals]))


def form_of(pattern, operand_sizes, n_out) -> str:
    """The site's form, as the thresholds are measured per form: what the
    kernel reads besides `x` (`pattern.form`, or a form name). A plain site with a
    per-channel operand (at most 1/16 of the output) is "bias"; an epilogue
    whose scale, shift or mean is full size reads like "plain" (no per-channel
    operand to broadcast)."""
    form = pattern if isinstance(pattern, str) else getattr(pattern, "form", "")
    return _form_and_channels(form, operand_sizes, n_out)[0]


def _form_and_channels(form, operand_sizes, n_out) -> tuple[str, int]:
    if not form or _symbolic(n_out):
        return form, 0
    small = [n for n in operand_sizes[1:] if not _symbolic(n) and n * _SMALL <= n_out]
    channels = max(small, default=0)
    if form == "plain":
        return ("bias" if small else "plain"), channels
    per_channel = operand_sizes[1:-1] if form == "residual" else operand_sizes[1:]
    return (form if len(small) >= len(per_channel) else "plain"), channels


def producer_class(atom, graph, context) -> tuple[str, str | None]:
    """(class, primitive) of what produces `atom`, looking through views and
    into transparent calls."""
    if not C.is_var(atom):
        return "input", None
    eqn = graph.producer(atom)
    if eqn is None:
        if context is not None and atom in graph.jaxpr.invars:
            return context.inputs[list(graph.jaxpr.invars).index(atom)]
        return "input", None  # an argument, a constant
    name = eqn.primitive.name
    if moves_no_data(eqn):
        return producer_class(eqn.invars[0], graph, context)
    if name == "dot_general":
        return "dot", name
    if name == "conv_general_dilated":
        return ("conv" if _feature_minor(eqn) else "conv-nchw"), name
    if name in _JAXFUSE:
        return "fused", name
    if name in FUSIBLE:
        return "fusible", name
    if name in TRANSPARENT:
        body, consts = body_of(eqn)
        if body is not None:
            i = next(k for k, v in enumerate(eqn.outvars) if v is atom)
            inner = Context(tuple(producer_class(a, graph, context) for a in eqn.invars), ())
            return producer_class(body.outvars[i], Graph(body, consts), inner)
    return "other", name


def materializing_readers(var, graph, context, skip=frozenset()) -> set:
    """Kinds of readers of `var` that keep it in memory in XLA's own program."""
    kinds = set()
    if graph.is_output(var):
        if context is None:
            kinds.add("output")
        else:
            for i, v in enumerate(graph.jaxpr.outvars):
                if v is var:
                    kinds.update(context.outputs[i])
    for eqn in graph.users(var):
        if id(eqn) in skip:
            continue
        name = eqn.primitive.name
        if moves_no_data(eqn):
            kinds.update(materializing_readers(eqn.outvars[0], graph, context))
            continue  # moves no data: what matters is who reads the view
        if name in FUSING_CONSUMERS:
            continue
        if name in TRANSPARENT:
            body, consts = body_of(eqn)
            if body is not None:
                inner = Context((("input", None),) * len(body.invars), tuple(
                    tuple(sorted(materializing_readers(o, graph, context))) for o in eqn.outvars))
                sub = Graph(body, consts)
                for i, a in enumerate(eqn.invars):
                    if a is var:
                        kinds.update(materializing_readers(body.invars[i], sub, inner))
                continue
        kinds.add({"dot_general": "dot", "conv_general_dilated": "conv"}.get(
            name, "fused" if name in _JAXFUSE else "other"))
    return kinds


def _feature_minor(eqn) -> bool:
    """Whether a convolution's output has its feature dimension last (NHWC):
    the layout XLA's CPU convolution writes, which a row-major operand reads
    without a transpose."""
    dn = eqn.params.get("dimension_numbers")
    out_spec = getattr(dn, "out_spec", None)
    if out_spec is None:
        return True
    return out_spec[1] == len(out_spec) - 1


def apply(closed, patterns, plan: Plan, origin=None) -> Walked:
    """The walk of `closed` under `plan`: every site the plan fuses, fused
    (`origin`: the (file, line) sites without a user frame are reported at)."""
    model = CostModel(plan) if plan.costed else None
    return walk(C.without_dead_code(closed), patterns, origin, cost=model, exact=plan.exact)
