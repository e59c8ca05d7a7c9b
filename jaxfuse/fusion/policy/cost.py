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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from jax import errors as _errors
from jax import export as _export

from ... import _compat as C
from ...ops import isa as _isa
from ..ir.graph import Graph

# Set only while probe.py compiles a rewritten program: sites numbered for the
# probe lower to XLA's own ops, named so their ops can be found in XLA's fusions.
PROBING = C.jit_key_flag(
    "jaxfuse_probing", False,
    "Internal: lower probed sites to XLA's own ops under a name the probe finds.")

PROBE_SCOPE = "jaxfuse_probe"

POLICIES = ("auto", "always", "measure")

# Equations XLA fuses into the loop that reads their result (so their result
# is never in memory in XLA's own program).
FUSIBLE = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "abs", "sign", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "atan2",
    "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow",
    "square", "floor", "ceil", "round", "nextafter", "erf", "erfc", "erf_inv", "is_finite",
    "select_n", "clamp", "convert_element_type", "eq", "ne", "gt", "ge", "lt", "le", "and", "or",
    "not", "xor", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "slice",
    "dynamic_slice", "pad", "concatenate", "rev", "gather", "iota", "copy", "reduce_precision",
    "add_any", "pvary", "real", "imag", "conj", "population_count", "shift_left",
    "shift_right_logical", "shift_right_arithmetic",
})
# ... and loops that read them: XLA fuses an elementwise producer into a
# reduction's input loop, so a value read only by these is not materialized.
FUSING_CONSUMERS = FUSIBLE | frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "argmax", "argmin", "reduce_precision", "cumsum", "cumprod", "cummax", "cummin",
    "reduce_window_sum",
})
# Views that move no data: a value read through them is the value itself.
_VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})
_JAXFUSE = frozenset({"jaxfuse_add_relu", "jaxfuse_epilogue"})
# Calls whose bodies XLA inlines: their boundary is transparent (to the cost
# model and to the contraction checks alike).
TRANSPARENT = frozenset({*C.JIT_NAMES, "closed_call", "core_call", "custom_jvp_call",
                         "custom_vjp_call", "custom_vjp_call_jaxpr", *C.CHECKPOINT_NAMES})
# An operand this much smaller than the output costs nothing to materialize.
_SMALL = 16


@dataclasses.dataclass(frozen=True)
class SiteFacts:
    """What the platform decision needs to know about a fused site."""

    pattern: str
    elements: int | str
    """Output elements; for a symbolic size (shape-polymorphic export), its
    expression as text, since it has no value to compare (`symbolic`)."""
    dtype: str
    producers: tuple
    """Per operand: "input", "dot", "conv", "conv-nchw", "fused", "materialized" (a
    fusible op's result that another reader keeps in memory), "small" or "other"."""
    consumers: tuple
    """Kinds of readers that keep the result in memory anyway ("output", "dot", ...)."""
    form: str = ""
    """What the kernel reads (`form_of`): "plain", "bias", "scale_shift",
    "batchnorm" or "residual"; "" for a pattern that is none of them."""
    channels: int = 0
    """Elements of the widest per-channel operand (0: none)."""
    probe: int = -1
    """For a site fused by a conv band: its number in the rewrite, by which the
    probe (probe.py) names it in XLA's compiled program (-1: not probed)."""
    xla_fuses: bool = False
    """The probe saw XLA fuse this site into a library fusion with its neighbours."""
    written_bytes: int = 0
    """Bytes of the "small" operands: values XLA would compute inside its own
    loop that the call needs written to memory first (temp the site adds)."""

    def __str__(self):
        return f"{self.pattern}[{self.elements} x {self.dtype}]"

    @property
    def symbolic(self) -> bool:
        return not isinstance(self.elements, int)


@dataclasses.dataclass(frozen=True)
class PlatformFacts:
    min_elements: Mapping[str, int | None]
    """Below this many output elements a custom call loses to XLA's loop (None:
    at every size measured)."""
    folds_dot_epilogue: bool
    folds_conv_epilogue: bool
    transposes_nchw_conv: bool
    source: str
    narrow_matmuls_in_f32: bool = False
    """float16/bfloat16 matmuls and convolutions run in float32, with the
    conversions folded into the elementwise loops around them."""
    form_min_elements: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    """(form, dtype) -> the threshold for that form where it differs from
    `min_elements` (sites a convolution feeds excepted: `conv_bands`)."""
    conv_bands: tuple = ()
    """`ConvBand`s: where the kernel pays for a site a convolution feeds (a
    conv net's epilogue). Forms and dtypes without a band use `min_elements`."""
    conv_source: str = ""
    isa_levels: tuple[str, ...] | None = None
    """The ISA levels XLA targets (jaxfuse/ops/isa.py) where these facts were measured: on
    another, the kernel's speed against XLA's code is unknown and `auto` leaves
    every site to XLA (None: the facts do not depend on the ISA)."""
    isa_min_elements: Mapping[tuple[str, str], int | None] = dataclasses.field(default_factory=dict)
    """(ISA level, dtype) -> the threshold on that level where it differs from
    `min_elements` (None: the kernel lost at every size measured)."""
    isa_source: str = ""

    def min_elements_for(self, dtype: str, level: str | None):
        """`min_elements[dtype]`, or the ISA level's own figure where it has one."""
        if level is not None and (level, dtype) in self.isa_min_elements:
            return self.isa_min_elements[(level, dtype)]
        return self.min_elements.get(dtype)

    def conv_band(self, facts: "SiteFacts"):
        """The band for a conv-fed site: of those for its form and dtype, the one
        for the widest channel count it reaches (None: no band for the form)."""
        fits = [b for b in self.conv_bands if (b.form, b.dtype) == (facts.form, facts.dtype)
                and b.min_channels <= facts.channels]
        return max(fits, key=lambda b: b.min_channels, default=None)


@dataclasses.dataclass(frozen=True)
class ConvBand:
    """A site of `form` and `dtype` fed by a convolution, with per-channel
    operands of at least `min_channels` elements, pays for output sizes in
    [low, high) (`high` None: no upper end measured)."""

    form: str
    dtype: str
    min_channels: int
    low: int
    high: int | None = None

    def __contains__(self, elements) -> bool:
        return self.low <= elements and (self.high is None or elements < self.high)


# Conv-fed BatchNorm epilogues (ConvBand): inside a conv net these forms pay
# at far smaller sizes than the op thresholds below, so a band of sizes per
# form and channel width decides them; where XLA:CPU's YNNPACK fusion absorbs
# the convolutions and BatchNorms into one subgraph, a custom call would split
# it, and probe.py gives those sites back after seeing XLA's compiled program.
# Source: benchmarks/results/thresholds-forms-cpu-2026-12-02.txt.
#
# ISA levels (jaxfuse/ops/isa.py): the thresholds were measured where XLA targets AVX2,
# and hold where it targets AVX-512 for float32, float64 and bfloat16; there
# XLA's float16 loop (16 lanes converted at a time, or native with
# AVX512-FP16) beats the kernel, on an AMD EPYC host (issue report) and on
# an Intel one, so float16 is declined at that level. Levels below AVX2 and
# other machines were never measured, so `auto` declines there. Sources: the
# results README's AVX2 and AVX-512 sections.
#
# Thresholds: `python benchmarks/thresholds.py` measures the smallest size from
# which the kernel beats XLA's own fusion of the site inside a program, at
# every larger size, in both timing modes (paired 95% intervals); each value
# is the largest of three runs (benchmarks/results/thresholds-cpu-2026-12-01.txt).
PLATFORMS = {
    "cpu": PlatformFacts(
        min_elements={"float32": 1 << 23, "float64": 1 << 22, "bfloat16": 1 << 20,
                      "float16": 1 << 18},
        folds_dot_epilogue=False, folds_conv_epilogue=False, transposes_nchw_conv=True,
        source="benchmarks/results/thresholds-cpu-2026-12-01.txt",
        # XLA:CPU computes a bfloat16 convolution in float32 (convert -> f32
        # YNNPACK conv) and fuses the convert back into the BatchNorm+ReLU
        # loop, which writes float32 for the next conv; a custom call needs
        # the bfloat16 value written, then converted again, which loses
        # (benchmarks/results/cpu-models-probe-2026-12-02.json).
        narrow_matmuls_in_f32=True,
        # relu(a + b) of two full operands pays from 2^22 elements; the other
        # forms keep 2^23, where none lost (benchmarks/results/notes/2026-12-01-to-02.md).
        form_min_elements={("plain", "float32"): 1 << 22},
        conv_bands=(*(
            ConvBand(form, "float32", channels, low, 1 << 22)
            for form in ("scale_shift", "batchnorm", "residual")
            for channels, low in ((1, 1 << 17), (128, 1 << 14))),
            # After a convolution, relu(conv + y) and relu(conv + bias) keep
            # the float32 threshold, 2^23 (below it they lost), with no upper end.
            *(ConvBand(form, "float32", 0, 1 << 23) for form in ("plain", "bias"))),
        conv_source="benchmarks/results/thresholds-forms-cpu-2026-12-02.txt",
        isa_levels=("avx2", "avx512"),
        isa_min_elements={("avx512", "float16"): None},
        isa_source="AVX-512 hosts: XLA's float16 loop beat the kernel "
                   "(benchmarks/results/cpu-avx512-ops-2026-12-03.json)"),
    # On CUDA no size pays yet: in the H200 run recorded in bench/results the
    # add+ReLU kernel was ahead of XLA's fusion only in the bfloat16 bias form,
    # so auto leaves every site to XLA there until a measurement says otherwise
    # (policy="measure" times the kernel on the device itself). The entries to
    # put here come from a GPU run of benchmarks/gpu_check.sh: its bench.log ends with
    # them, read off the op sweep by `benchmarks/thresholds.py --from-bench`.
    "cuda": PlatformFacts(
        min_elements={"float32": None, "float64": None, "float16": None, "bfloat16": None},
        folds_dot_epilogue=True, folds_conv_epilogue=True, transposes_nchw_conv=False,
        source="the H200 run recorded in bench/results (no size where the kernel beat XLA)"),
}


def _mib(nbytes) -> str:
    if _symbolic(nbytes):
        return f"{nbytes} bytes"
    return f"{nbytes / 2**20:.3g} MiB"


def _size(atom):
    """Elements of `atom`: an int, or a symbolic expression (shape-polymorphic export)."""
    size = math.prod(getattr(atom.aval, "shape", ()))
    return size if _symbolic(size) else int(size)


def _symbolic(size) -> bool:
    return _export.is_symbolic_dim(size)


def _at_least(a, b) -> bool:
    """Whether `a >= b` for every value of their symbolic dimensions (False
    where jax cannot decide it: unproven is not true)."""
    try:
        return bool(a >= b)
    except _errors.InconclusiveDimensionOperation:
        return False


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
    """Decides barrier patterns for one rewrite (`policy="auto"`)."""

    policy = "auto"

    def __init__(self, platform: str | None = None, give_back=frozenset(), lean=None):
        self.platform = platform
        self.probed: list[int] = []  # sites fused by a conv band, for probe.py
        self.give_back = frozenset(give_back)  # of those, the ones XLA fuses with neighbours
        # (facts, reason): sites whose facts (`site_key`) are in `facts` are
        # declined for `reason`: they raised the program's memory (memory.py).
        self.lean = lean

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

    # ---- the platform-independent decision (walker.match_all)
    def evaluate(self, m, graph, context, pattern: str = "site"):
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
                    return (f"operand {k + 1} comes from a `{prim}` that XLA fuses into the "
                            f"same loop; as a custom-call operand it is written out and read "
                            f"back (+{_mib(2 * _size(a) * itemsize)})"), None
                cls = "small"
                written += _size(a) * itemsize if not _symbolic(_size(a)) else 0
            producers.append(cls)
        readers = materializing_readers(out, graph, context, skip=inside)
        if not readers:
            users = sorted({e.primitive.name for e in graph.users(out) if id(e) not in inside})
            used_by = ", ".join(f"`{u}`" for u in users) or "nothing outside the site"
            return (f"the result is only read by ops XLA fuses into the same loop ({used_by}); "
                    f"a custom call writes it out and reads it back "
                    f"(+{_mib(2 * n_out * itemsize)})"), None
        facts = SiteFacts(pattern, str(n_out) if _symbolic(n_out) else n_out,
                          np.dtype(out.aval.dtype).name, tuple(producers),
                          tuple(sorted(readers)),
                          *_form_and_channels(pattern, [_size(a) for a in m.operands], n_out),
                          written_bytes=written)
        # Known platform: decline here, so the site keeps XLA's own program
        # exactly (a site declined only at lowering gets XLA's ops, but in the
        # rewrite's arrangement: inlined calls, moved derivative masks).
        reason = platform_reason(facts, self.platform) if self.platform else None
        if reason is None and self.platform and in_conv_band(facts, self.platform):
            # Whether XLA would put this epilogue into one library fusion with
            # the convolutions around it is only known from its compiled
            # program: probe.py asks, after the rewrite.
            facts = dataclasses.replace(facts, probe=len(self.probed))
            self.probed.append(facts.probe)
            if facts.probe in self.give_back:
                facts = dataclasses.replace(facts, xla_fuses=True)
                reason = XLA_FUSES_REASON
        if reason is None and self.lean is not None and site_key(facts) in self.lean[0]:
            reason = self.lean[1]
        return reason, facts


def site_key(facts: SiteFacts) -> SiteFacts:
    """What identifies a site's kind across rewrites of one program: its facts
    without the probe's numbering and verdict."""
    return dataclasses.replace(facts, probe=-1, xla_fuses=False)


_FORMS = {"add_relu": "plain", "scale_shift_relu": "scale_shift", "bn_relu": "batchnorm",
          "norm_relu": "batchnorm", "bn_residual_relu": "residual",
          "norm_residual_relu": "residual", "scale_shift_residual_relu": "residual",
          "bias_residual_relu": "residual"}


def form_of(pattern: str, operand_sizes, n_out) -> str:
    """The site's form, as the thresholds are measured per form: what the
    kernel reads besides `x`. `add_relu` with a per-channel operand (at most
    1/16 of the output) is "bias"; an epilogue whose scale, shift or mean is
    full size reads like "plain" (no per-channel operand to broadcast)."""
    return _form_and_channels(pattern, operand_sizes, n_out)[0]


def _form_and_channels(pattern, operand_sizes, n_out) -> tuple[str, int]:
    form = _FORMS.get(pattern, "")
    if not form or _symbolic(n_out):
        return form, 0
    small = [n for n in operand_sizes[1:] if not _symbolic(n) and n * _SMALL <= n_out]
    channels = max(small, default=0)
    if pattern == "add_relu":
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
    if name in _VIEWS or (name == "broadcast_in_dim" and _adds_size1_dims(eqn)):
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
        if name in _VIEWS or (name == "broadcast_in_dim" and _adds_size1_dims(eqn)):
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


def body_of(eqn):
    """(body Jaxpr, consts) of a transparent call whose invars are the call's operands."""
    closed = (eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
              or eqn.params.get("fun_jaxpr"))
    body = getattr(closed, "jaxpr", closed)
    if not isinstance(body, C.Jaxpr) or len(body.invars) != len(eqn.invars):
        return None, None
    if len(body.outvars) != len(eqn.outvars):
        return None, None
    return body, getattr(closed, "consts", None)


def _adds_size1_dims(eqn) -> bool:
    src = tuple(eqn.invars[0].aval.shape)
    dims = tuple(eqn.params["broadcast_dimensions"])
    out = tuple(eqn.params["shape"])
    kept = [out[d] for d in dims]
    return list(dims) == sorted(dims) and tuple(kept) == src and all(
        out[i] == 1 for i in range(len(out)) if i not in dims)


def _feature_minor(eqn) -> bool:
    """Whether a convolution's output has its feature dimension last (NHWC):
    the layout XLA's CPU convolution writes, which a row-major operand reads
    without a transpose."""
    dn = eqn.params.get("dimension_numbers")
    out_spec = getattr(dn, "out_spec", None)
    if out_spec is None:
        return True
    return out_spec[1] == len(out_spec) - 1


# ------------------------------------------------------ the platform decision
XLA_FUSES_REASON = (
    "XLA:CPU fuses this epilogue into one YNNPACK fusion with the convolutions and reductions "
    "around it (seen in the program it compiles); a custom call would split that fusion")


def give_back_to_xla(eqn):
    """A fused call's equation marked to lower to XLA's own ops (`platform_reason`
    reads `xla_fuses`), as a site the probe gives back to XLA's fusion."""
    facts = eqn.params.get("site_facts") or SiteFacts(
        pattern=eqn.primitive.name, elements=0, dtype="", producers=(), consumers=())
    return C.replace_params(eqn, {**eqn.params,
                                  "site_facts": dataclasses.replace(facts, xla_fuses=True)})


def in_conv_band(facts: SiteFacts | None, platform: str) -> bool:
    """Whether a conv band (not the op thresholds) decides this site."""
    p = PLATFORMS.get(platform)
    return (facts is not None and p is not None and "conv" in facts.producers
            and p.conv_band(facts) is not None)


def platform_reason(facts: SiteFacts | None, platform: str, isa: str | None = None) -> str | None:
    """Why the kernel would lose on `platform` (None: it pays). `isa`: the ISA
    level XLA targets there (None: this process's, jaxfuse/ops/isa.py)."""
    if facts is None:
        return None
    if facts.xla_fuses:
        return XLA_FUSES_REASON
    p = PLATFORMS.get(platform)
    if p is None:
        return None  # no kernel there anyway: the lowering uses XLA's ops
    if p.folds_dot_epilogue and "dot" in facts.producers:
        return (f"on {platform} XLA folds the bias and ReLU into the matmul's epilogue "
                f"(cuBLASLt BIAS_RELU); a separate kernel adds a pass")
    if p.folds_conv_epilogue and ("conv" in facts.producers or "conv-nchw" in facts.producers):
        return (f"on {platform} XLA folds the bias and ReLU into cuDNN's fused convolution; "
                f"a separate kernel adds a pass")
    narrow = facts.dtype in ("float16", "bfloat16")
    if p.narrow_matmuls_in_f32 and narrow and (
            {"dot", "conv", "conv-nchw"} & set(facts.producers) or {"dot", "conv"} & set(facts.consumers)):
        return (f"on {platform} XLA runs {facts.dtype} matmuls and convolutions in float32 and folds "
                f"the conversions into the loop around them; a custom call needs the {facts.dtype} "
                f"value written out and converted again")
    if p.transposes_nchw_conv and "conv-nchw" in facts.producers:
        return (f"on {platform} the convolution writes NHWC and XLA folds the transpose back "
                f"to NCHW into its epilogue loop; the custom call's row-major operand would "
                f"cost a transpose of its own")
    level = None
    if p.isa_levels is not None:
        level = isa or _isa.target_level_here()
        if level not in p.isa_levels:
            return (f"on {platform} XLA targets {level}, where the kernel has not been measured "
                    f"against XLA's code (measured: {', '.join(p.isa_levels)}); "
                    f"policy='always' or 'measure' fuses it anyway")
    if (level, facts.dtype) in p.isa_min_elements and p.isa_min_elements[(level, facts.dtype)] is None:
        return (f"on {platform} targeting {level} the kernel has not beaten XLA's own "
                f"{facts.dtype} loop at any size measured ({p.isa_source})")
    # A form measured on its own (form_min_elements) keeps its threshold even
    # where the dtype's other forms never paid; a dtype never measured is declined.
    form_own = p.form_min_elements.get((facts.form, facts.dtype))
    smallest = form_own if form_own is not None else p.min_elements_for(facts.dtype, level)
    if smallest is None:
        return (f"on {platform} the kernel has not beaten XLA's own fusion at any size "
                f"measured ({p.source})" if facts.dtype in p.min_elements else
                f"on {platform} the kernel has not been measured for {facts.dtype}")
    if facts.symbolic:
        # Even a size provably above the threshold: above every measured
        # threshold a call is paced (rewrite.pacing.paced); one of symbolic size is not.
        return (f"{facts.elements} elements: symbolic, the cost model cannot tell whether "
                f"a custom call pays on {platform}")
    band = p.conv_band(facts) if "conv" in facts.producers else None
    if band is not None:
        if facts.elements not in band:
            where = (f"below {band.low}" if band.high is None
                     else f"outside {band.low}..{band.high}")
            return (f"{facts.elements} elements: {where}, where the kernel beat XLA's loop for "
                    f"a {facts.form} epilogue of {facts.channels} channels after a convolution "
                    f"on {platform} (measured: {p.conv_source})")
        return None
    if facts.elements < smallest:
        return (f"{facts.elements} elements: below {smallest}, the cost of a custom call on "
                f"{platform} exceeds what the kernel saves over XLA's loop "
                f"(measured: {p.source})")
    return None
