"""What a fused site records for its lowering, and where on each platform the
kernel beats XLA's own loop.

The pass decides which sites to fuse for the platform it expects the program to
be compiled for (jaxfuse/fusion/policy/cost.py). It records what that decision
rests on in the fused op's `site_facts` parameter (`SiteFacts`), and the
lowering checks it again for the platform really compiled for (arguments
committed elsewhere, export for several platforms): a site whose kernel would
lose there lowers to XLA's own ops, with the same values.

The thresholds and rules per platform (`PLATFORMS`) are measurements of our
kernels against XLA's code; each entry names the run it comes from
(benchmarks/results/). `platform_reason` is the one function that reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jax import export as _export

from .. import _compat as C
from .._reasons import Reason, ReasonKind
from . import isa as _isa


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
    """What the kernel reads: "plain", "bias", "scale_shift", "batchnorm" or
    "residual"; "" for a pattern that is none of them."""
    channels: int = 0
    """Elements of the widest per-channel operand (0: none)."""
    probe: int = -1
    """For a site fused by a conv band: its number in the rewrite, by which the
    probe (fusion/policy/probe.py) names it in XLA's compiled program (-1: not probed)."""
    xla_fuses: bool = False
    """The probe saw XLA fuse this site into a library fusion with its neighbours."""
    written_bytes: int = 0
    """Bytes of the "small" operands: values XLA would compute inside its own
    loop that the call needs written to memory first (memory the site adds)."""

    def __str__(self):
        return f"{self.pattern}[{self.elements} x {self.dtype}]"

    @property
    def symbolic(self) -> bool:
        return not isinstance(self.elements, int)


def site_key(facts: SiteFacts) -> SiteFacts:
    """What identifies a site's kind across rewrites of one program: its facts
    without the probe's numbering and verdict."""
    return dataclasses.replace(facts, probe=-1, xla_fuses=False)


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


@dataclasses.dataclass(frozen=True)
class PlatformFacts:
    min_elements: Mapping[str, int | None]
    """Below this many output elements a custom call loses to XLA's loop (None:
    at every size measured)."""
    folds_dot_epilogue: bool
    folds_conv_epilogue: bool
    transposes_nchw_conv: bool
    narrow_matmuls_in_f32: bool = False
    """float16/bfloat16 matmuls and convolutions run in float32, with the
    conversions folded into the elementwise loops around them."""
    form_min_elements: Mapping[tuple[str, str], int | None] = dataclasses.field(default_factory=dict)
    """(form, dtype) -> the threshold for that form where it differs from
    `min_elements` (sites a convolution feeds excepted: `conv_bands`)."""
    conv_bands: tuple = ()
    """`ConvBand`s: where the kernel pays for a site a convolution feeds (a
    conv net's epilogue). Forms and dtypes without a band use `min_elements`."""
    isa_levels: tuple[str, ...] | None = None
    """The ISA levels XLA targets (ops/isa.py) where these facts were measured: on
    another, the kernel's speed against XLA's code is unknown and `auto` leaves
    every site to XLA (None: the facts do not depend on the ISA)."""
    isa_min_elements: Mapping[tuple[str, str], int | None] = dataclasses.field(default_factory=dict)
    """(ISA level, dtype) -> the threshold on that level where it differs from
    `min_elements` (None: the kernel lost at every size measured)."""

    def min_elements_for(self, dtype: str, level: str | None):
        """`min_elements[dtype]`, or the ISA level's own figure where it has one."""
        if level is not None and (level, dtype) in self.isa_min_elements:
            return self.isa_min_elements[(level, dtype)]
        return self.min_elements.get(dtype)

    def conv_band(self, facts: SiteFacts):
        """The band for a conv-fed site: of those for its form and dtype, the one
        for the widest channel count it reaches (None: no band for the form)."""
        fits = [b for b in self.conv_bands if (b.form, b.dtype) == (facts.form, facts.dtype)
                and b.min_channels <= facts.channels]
        return max(fits, key=lambda b: b.min_channels, default=None)


# CPU. Thresholds: `python benchmarks/thresholds.py` measures the smallest size
# from which the kernel beats XLA's own fusion of the site inside a program, at
# every larger size, in both timing modes (paired 95% intervals); each value is
# the largest of three runs (benchmarks/results/thresholds-cpu-2026-12-01.txt).
#   * float32 relu(a + b) of two full operands pays from 2^22 elements; the
#     other forms keep 2^23, where none lost (benchmarks/results/notes/2026-12-01-to-02.md).
#     With large outputs prefaulted in 4 KiB pages, each threshold is the smallest
#     size from which the kernel read below jit in every one of >= 10 fresh
#     processes: float32 `a + b` 2^22, bias 2^23; bfloat16 `a + b` 2^20, bias 2^22
#     (benchmarks/results/fresh-processes-cpu-zen4-2026-12-04.txt).
#   * Conv-fed BatchNorm epilogues pay at far smaller sizes inside a conv net,
#     so a band of sizes per form and channel width decides them; where
#     XLA:CPU's YNNPACK fusion absorbs the convolutions and BatchNorms into one
#     subgraph, a custom call would split it, and fusion/policy/probe.py gives
#     those sites back after seeing XLA's compiled program
#     (benchmarks/results/thresholds-forms-cpu-2026-12-02.txt). After a
#     convolution, relu(conv + y) and relu(conv + bias) keep the float32
#     threshold, 2^23 (below it they lost), with no upper end.
#   * XLA:CPU computes a bfloat16 convolution in float32 (convert -> f32
#     YNNPACK conv) and fuses the convert back into the BatchNorm+ReLU loop,
#     which writes float32 for the next conv; a custom call needs the bfloat16
#     value written, then converted again, which loses
#     (benchmarks/results/cpu-models-probe-2026-12-02.json).
#   * ISA levels (ops/isa.py): measured where XLA targets AVX2 and AVX-512; on
#     AVX-512, XLA's float16 loop (16 lanes converted at a time, or native with
#     AVX512-FP16) beats the kernel, so float16 is declined there
#     (benchmarks/results/cpu-avx512-ops-2026-12-03.json). Other levels were
#     never measured, so `auto` declines there.
# CUDA. In the H200 run recorded in benchmarks/results the add+ReLU kernel was
# ahead of XLA's fusion only in the bfloat16 bias form; until a GPU run of
# benchmarks/gpu_check.sh gives the entries (its bench.log ends with them, read
# off the op sweep by `benchmarks/thresholds.py --from-bench`), auto leaves every
# CUDA site to XLA (policy="measure" times the kernel on the device itself).
PLATFORMS = {
    "cpu": PlatformFacts(
        min_elements={"float32": 1 << 23, "float64": 1 << 22, "bfloat16": 1 << 20,
                      "float16": 1 << 18},
        folds_dot_epilogue=False, folds_conv_epilogue=False, transposes_nchw_conv=True,
        narrow_matmuls_in_f32=True,
        form_min_elements={("plain", "float32"): 1 << 22, ("bias", "bfloat16"): 1 << 22},
        conv_bands=(*(
            ConvBand(form, "float32", channels, low, 1 << 22)
            for form in ("scale_shift", "batchnorm", "residual")
            for channels, low in ((1, 1 << 17), (128, 1 << 14))),
            *(ConvBand(form, "float32", 0, 1 << 23) for form in ("plain", "bias"))),
        isa_levels=("avx2", "avx512"),
        isa_min_elements={("avx512", "float16"): None}),
    "cuda": PlatformFacts(
        min_elements={"float32": None, "float64": None, "float16": None, "bfloat16": None},
        folds_dot_epilogue=True, folds_conv_epilogue=True, transposes_nchw_conv=False),
}

# Where users read the measurements these facts state (shipped with the docs).
_MEASURED = "docs/policies.md"


# ------------------------------------------------------------------- reasons
XLA_FUSES = ReasonKind(
    "xla-library-fusion",
    "XLA:CPU fuses this epilogue into one YNNPACK fusion with the convolutions and reductions "
    "around it (seen in the program it compiles); a custom call would split that fusion")
FOLDS_DOT_EPILOGUE = ReasonKind(
    "folds-dot-epilogue",
    "on {platform} XLA folds the bias and ReLU into the matmul's epilogue (cuBLASLt BIAS_RELU); "
    "a separate kernel adds a pass")
FOLDS_CONV_EPILOGUE = ReasonKind(
    "folds-conv-epilogue",
    "on {platform} XLA folds the bias and ReLU into cuDNN's fused convolution; a separate kernel "
    "adds a pass")
NARROW_MATMUL = ReasonKind(
    "narrow-matmul-in-f32",
    "on {platform} XLA runs {dtype} matmuls and convolutions in float32 and folds the "
    "conversions into the loop around them; a custom call needs the {dtype} value written out "
    "and converted again")
NCHW_TRANSPOSE = ReasonKind(
    "nchw-transpose",
    "on {platform} the convolution writes NHWC and XLA folds the transpose back to NCHW into its "
    "epilogue loop; the custom call's row-major operand would cost a transpose of its own")
ISA_UNMEASURED = ReasonKind(
    "isa-unmeasured",
    "on {platform} XLA targets {level}, where the kernel has not been measured against XLA's "
    "code (measured: {measured}); policy='always' or 'measure' fuses it anyway")
ISA_NEVER_WINS = ReasonKind(
    "isa-never-wins",
    "on {platform} targeting {level} the kernel has not beaten XLA's own {dtype} loop at any "
    "size measured (" + _MEASURED + ")")
NEVER_WINS = ReasonKind(
    "never-wins",
    "on {platform} the kernel has not beaten XLA's own fusion at any size measured "
    "(" + _MEASURED + ")")
DTYPE_UNMEASURED = ReasonKind(
    "dtype-unmeasured", "on {platform} the kernel has not been measured for {dtype}")
SYMBOLIC_SIZE = ReasonKind(
    "symbolic-size",
    "{elements} elements: symbolic, the cost model cannot tell whether a custom call pays on "
    "{platform}")
OUTSIDE_CONV_BAND = ReasonKind(
    "outside-conv-band",
    "{elements} elements: {where}, where the kernel beat XLA's loop for a {form} epilogue of "
    "{channels} channels after a convolution on {platform} (" + _MEASURED + ")")
BELOW_THRESHOLD = ReasonKind(
    "below-threshold",
    "{elements} elements: below {threshold}, the cost of a custom call on {platform} exceeds "
    "what the kernel saves over XLA's loop (" + _MEASURED + ")")


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


def platform_reason(facts: SiteFacts | None, platform: str, isa: str | None = None) -> Reason | None:
    """Why the kernel would lose on `platform` (None: it pays). `isa`: the ISA
    level XLA targets there (None: this process's, ops/isa.py)."""
    if facts is None:
        return None
    if facts.xla_fuses:
        return XLA_FUSES()
    p = PLATFORMS.get(platform)
    if p is None:
        return None  # no kernel there anyway: the lowering uses XLA's ops
    if p.folds_dot_epilogue and "dot" in facts.producers:
        return FOLDS_DOT_EPILOGUE(platform=platform)
    if p.folds_conv_epilogue and ("conv" in facts.producers or "conv-nchw" in facts.producers):
        return FOLDS_CONV_EPILOGUE(platform=platform)
    narrow = facts.dtype in ("float16", "bfloat16")
    if p.narrow_matmuls_in_f32 and narrow and (
            {"dot", "conv", "conv-nchw"} & set(facts.producers) or {"dot", "conv"} & set(facts.consumers)):
        return NARROW_MATMUL(platform=platform, dtype=facts.dtype)
    if p.transposes_nchw_conv and "conv-nchw" in facts.producers:
        return NCHW_TRANSPOSE(platform=platform)
    level = None
    if p.isa_levels is not None:
        level = isa or _isa.target_level_here()
        if level not in p.isa_levels:
            return ISA_UNMEASURED(platform=platform, level=level, measured=", ".join(p.isa_levels))
    if (level, facts.dtype) in p.isa_min_elements and p.isa_min_elements[(level, facts.dtype)] is None:
        return ISA_NEVER_WINS(platform=platform, level=level, dtype=facts.dtype)
    # A form measured on its own (form_min_elements) keeps its threshold even
    # where the dtype's other forms never paid; a dtype never measured is declined.
    form_key = (facts.form, facts.dtype)
    if form_key in p.form_min_elements:
        smallest = p.form_min_elements[form_key]
    else:
        smallest = p.min_elements_for(facts.dtype, level)
    if smallest is None:
        return (NEVER_WINS(platform=platform) if facts.dtype in p.min_elements
                else DTYPE_UNMEASURED(platform=platform, dtype=facts.dtype))
    if facts.symbolic:
        # Even a size provably above the threshold: above every measured
        # threshold a call is paced (ops/pacing.py); one of symbolic size is not.
        return SYMBOLIC_SIZE(platform=platform, elements=facts.elements)
    band = p.conv_band(facts) if "conv" in facts.producers else None
    if band is not None:
        if facts.elements not in band:
            where = (f"below {band.low}" if band.high is None
                     else f"outside {band.low}..{band.high}")
            return OUTSIDE_CONV_BAND(platform=platform, elements=facts.elements, where=where,
                                     form=facts.form, channels=facts.channels)
        return None
    if facts.elements < smallest:
        return BELOW_THRESHOLD(platform=platform, elements=facts.elements, threshold=smallest)
    return None


def symbolic(size) -> bool:
    """Whether a size has symbolic dimensions (shape-polymorphic export)."""
    return _export.is_symbolic_dim(size)
