"""Hand-written attention to `jax.nn.dot_product_attention`, which runs cuDNN's
fused flash attention on a GPU where it can (and XLA's own path elsewhere).

    fast = jaxfuse.optimize(model.apply, patterns=jaxfuse.rules.attention.rules())

One matcher reads the computation, not its spelling: a softmax between two
contractions,

    softmax(scale * (q . k) + bias [masked]) . v

found by its dataflow from the second contraction back, whatever the library
(flax.linen and nnx, equinox, dm-haiku, HuggingFace transformers' Flax models
built on flax's `dot_product_attention_weights`). On the way it puts each part
in one canonical form:

  * the contractions as the einsums they compute, whatever the transposes
    around them, the operand order, einsum against `dot_general`, heads under
    `vmap` and the order of the batch dimensions (`canonical.contraction`);
  * the scale as one number: constant factors on the queries, on the keys or
    on the logits, `/ c` or `* (1 / c)`, folded into jax.nn's `scale` (net
    scale 1, as T5 and GPT-Neo cancel flax's, included);
  * additive terms as a bias, except a mask: `select(p, 0, c)` added to the
    logits, or `where(p, logits, c)`, with `c` the dtype's lowest value or at
    most -1e9, becomes jax.nn's boolean mask; its constant part (flax's
    `make_causal_mask` sliced, `jnp.tril`) is evaluated, and an exactly
    lower-triangular one becomes `is_causal=True`, a band `local_window_size`;
  * keys and values repeated over heads (`jnp.repeat`, grouped and
    multi-query attention) as jax.nn's native key/value heads;
  * widening casts (the softmax in float32 at 16 bits) looked through;
  * the softmax's output masked again by the logits' own mask (Keras's
    `Softmax` layer: `where(mask, p, 0)`), read through: a query whose keys
    are all masked gets 0 there, as in the program;
  * the normalization after the values' contraction, `(exp(s - max) . v) /
    sum(exp(s - max))` in any layout of the sum (MaxText's `dot_product`
    attention): the division is the site.

Where a softmax sits between two contractions and a step differs, the site is
declined with that step named (`explain` shows it). Under `policy="auto"` each
match is a cost decision (`cost`): measured on CPU, cuDNN's preconditions on a
GPU. Values agree with the hand-written form within rounding (jax.nn computes
the logits and the softmax in at least float32); the gradient is jax.nn's.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

import jax
import jax.numpy as jnp

from .. import _compat as C
from .._cache import BoundedCache
from .._reasons import Reason, ReasonKind
from ..fusion.ir import xla
from ..fusion.ir.canonical import contraction, evaluate
from ..fusion.ir.graph import Graph
from ..fusion.match.patterns import Match, Pattern
from ..fusion.ir.target import target_platform

NAME = "attention"

# ------------------------------------------------------------------- reasons
STEP = ReasonKind("attention-step", "`{culprit}` {where}: {why}")
SCALE_ARRAY = ReasonKind("attention-scale-array",
                         "scale is an array of shape {shape}, not one number (`{culprit}`)")
SCALE_TRACED = ReasonKind("attention-scale-traced",
                          "scale is computed at run time (`{culprit}` of a traced value)")
SOFTMAX = ReasonKind("attention-softmax", "the softmax {why}")
LAYOUT = ReasonKind("attention-layout", "{why}")
FILL = ReasonKind("attention-fill", "masked with {fill}: {why}")
DTYPE = ReasonKind("attention-dtype", "{why}")
COST = ReasonKind("attention-cost", "{why}")

_WEIGHTS = "between the softmax and the values' contraction"
_LOGITS = "between the logits' contraction and the softmax"

# A fill at most this (or the dtype's lowest value) masks: exp of it less any
# logit a model produces is 0 in every float type, and a row masked whole gets
# equal logits everywhere, so uniform weights, as jax.nn's mask gives.
_MASK_FILL = -1e9


class _Miss(Exception):
    """A step of the attention that differs: the reason, and the equations seen."""

    def __init__(self, reason: Reason, eqns=()):
        super().__init__(str(reason))
        self.reason, self.eqns = reason, tuple(eqns)


# --------------------------------------------------------- the implementation
def implementation(q, k, v, *, bias=None, platform: str, compute_capability=None,
                   cudnn_version=None) -> tuple[str, str]:
    """Which `jax.nn.dot_product_attention` implementation a match gets, and why.

    `implementation=None` is the XLA path on every platform (jax 0.10, 0.11),
    so the choice is made here, per match: "cudnn" (cuDNN's fused flash
    attention) only where its preconditions hold, as jax's own check states
    them: an NVIDIA GPU with cuDNN, float16/bfloat16, equal dtypes, a head
    size that is a multiple of 8 and at most 128 (256 from compute capability
    9.0, Hopper), the same head size for values, head counts that divide
    (grouped queries), and even sequence lengths where a bias is added (its
    gradient's requirement). Anything else gets "xla", with the reason.
    `q`, `k`, `v`: arrays or avals of shape (B, T, N, H)."""
    if platform not in ("cuda", "gpu"):
        return "xla", f"{platform}: cuDNN's fused attention runs only on NVIDIA GPUs"
    if cudnn_version is None:
        return "xla", "cuDNN is not detected"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (jnp.float16, jnp.bfloat16):
        return "xla", f"{q.dtype}: cuDNN's fused attention takes float16 or bfloat16"
    head, limit = q.shape[-1], 256 if (compute_capability or (0, 0)) >= (9, 0) else 128
    if head % 8 or head > limit:
        return "xla", f"head size {head}: cuDNN needs a multiple of 8, at most {limit}"
    if v.shape[-1] != head or k.shape[-1] != head:
        return "xla", "query, key and value head sizes differ"
    if q.shape[-2] % k.shape[-2]:
        return "xla", f"{q.shape[-2]} query heads over {k.shape[-2]} key heads"
    if bias is not None and bias.dtype not in (q.dtype, np.dtype(bool)):
        return "xla", f"a {bias.dtype} bias with {q.dtype} queries"
    if bias is not None and (q.shape[-3] % 2 or k.shape[-3] % 2):
        return "xla", f"sequence lengths {q.shape[-3]}, {k.shape[-3]}: with a bias cuDNN needs them even"
    return "cudnn", ""


def _platform_facts(platform):
    gpu = platform in ("cuda", "gpu")
    return (C.gpu_compute_capability() if gpu else None), (C.cudnn_version() if gpu else None)


# ------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class _Side:
    """q, k or v as the replacement reads it: a program atom, the layout
    equations replayed on it (innermost first) and the role of each axis of
    the result ("T", "S", "H", "D" or a batch role)."""

    src: object
    replay: tuple
    roles: tuple
    walked: tuple = ()   # equations passed on the way (absorbed where nothing else reads them)
    groups: int = 1      # > 1: read with native key/value heads (the repeat dropped)
    group_axis: int | None = None  # the axis (of the replayed value) holding those heads

    @property
    def group_role(self):
        return None if self.group_axis is None else self.roles[self.group_axis]


@dataclasses.dataclass(frozen=True)
class _Term:
    """A bias term or a mask factor: an atom read at the logits' rank through
    `view` (size-1 dimensions where it broadcasts)."""

    atom: object
    view: tuple
    coefficient: float = 1.0   # bias: the factor the logits' arithmetic applies to it
    negate: bool = False       # mask: keep where the atom is False
    value: object = dataclasses.field(default=None, compare=False)  # a constant mask's value
    order: tuple | None = None  # read through transposes: the atom, reshaped, transposed so

    def laid_out(self, value, xp=np):
        """`value` (the atom's, or its constant value) at the logits' axes."""
        if self.order is None:
            return xp.reshape(value, self.view)
        before = [0] * len(self.view)
        for j, o in enumerate(self.order):
            before[o] = self.view[j]
        return xp.transpose(xp.reshape(value, tuple(before)), self.order)


@dataclasses.dataclass(frozen=True)
class _Plan:
    q: _Side
    k: _Side
    v: _Side
    logit_roles: tuple          # role of each axis of the logits
    logit_shape: tuple
    out_roles: tuple            # role of each axis of the root's result
    out_dtype: object
    dtype: object               # the dtype jax.nn computes in (the values' contraction's)
    scale: float
    bias: tuple                 # _Terms
    masks: tuple                # _Terms
    causal: bool
    window: tuple | None
    heads: tuple                # the roles jax.nn's heads axis stands for, major first
    core: tuple                 # equations the replacement must absorb
    optional: tuple             # equations it absorbs where nothing else reads them
    form: str
    details: str
    zero_masked_rows: bool = False  # re-masked after the softmax: a row masked whole is 0
    post: tuple = ()            # normalized after the values' contraction: the layout steps
    result_dtype: object = None  # from it to the division, and the division's dtype

    @property
    def operands(self) -> tuple:
        return (self.q.src, self.k.src, self.v.src, *(t.atom for t in self.bias),
                *(t.atom for t in self.masks))


# ---------------------------------------------------------------- utilities
def _scalar(value):
    """A constant's value as one Python float when all its elements are equal."""
    arr = np.asarray(value)
    if arr.size == 0:
        return None
    first = arr.reshape(-1)[0]
    if arr.size > 1 and not np.all(arr == first):
        return None
    return float(first)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _widening(eqn) -> bool:
    """A cast that keeps every value: float to a wider float."""
    if eqn.primitive.name != "convert_element_type":
        return False
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    return _is_float(src) and _is_float(dst) and (src == dst or jnp.promote_types(src, dst) == dst)


def _in_jax_attention(eqn) -> bool:
    """`eqn` was traced inside jax.nn.dot_product_attention's own XLA path:
    already the form the rule produces."""
    tb = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = getattr(tb, "frames", None) or ()
    return any(f.function_name.endswith("_dot_product_attention_core")
               and f.file_name.replace("\\", "/").endswith("jax/_src/nn/functions.py") for f in frames)


def _view_through(view, eqn):
    """A value read as `view` (at `eqn`'s operand rank) seen through the
    broadcast `eqn`: its view at the broadcast's result rank, or None."""
    if xla.broadcast_view(eqn) is None:
        return None
    out = [1] * len(eqn.params["shape"])
    for d, n in zip(eqn.params["broadcast_dimensions"], view):
        out[d] = n
    return tuple(out)


# ----------------------------------------------------------------- softmax
@dataclasses.dataclass(frozen=True)
class _Softmax:
    logits: object   # the atom the softmax reads
    axis: int        # its axis, among the logits'
    eqns: tuple
    dtype: object
    perm: tuple | None = None  # the result's axis j is the logits' axis perm[j] (penzai's)


def _through(atom, graph, names):
    """Follow `atom` down through single-operand equations named in `names`:
    (the atom reached, equations passed)."""
    passed = []
    while True:
        e = graph.producer(atom)
        if e is None or e.primitive.name not in names:
            return atom, passed
        if e.primitive.name == "max":  # jax.nn.softmax's `initial=-inf`
            consts = [graph.const_value(a) for a in e.invars]
            if consts[0] is not None and _scalar(consts[0]) == -np.inf:
                atom = e.invars[1]
            elif consts[1] is not None and _scalar(consts[1]) == -np.inf:
                atom = e.invars[0]
            else:
                return atom, passed
        else:
            if len(e.invars) != 1:
                return atom, passed
            atom = e.invars[0]
        passed.append(e)


# what stands between a reduction and the operand it is subtracted from or
# divides: keepdims (views, broadcasts), casts, jax.nn.softmax's stop_gradient
# and `max(-inf, .)` (its `initial`)
_KEEPDIMS = xla.VIEWS | {"broadcast_in_dim", "copy", "convert_element_type", "stop_gradient", "max"}


def softmax_of(atom, graph: Graph) -> _Softmax | None:
    """The softmax computing `atom`: `e / sum(e)` with `e = exp(x - max(x))`
    over one axis, whatever the keepdims spelling and `stop_gradient`; None
    if `atom` is no softmax. Raises `_Miss` for a softmax that differs in a
    step (`exp(x) / sum(exp(x))`: no maximum subtracted)."""
    div = graph.producer(atom)
    if div is None or div.primitive.name != "div":
        return None
    e_atom, denom = div.invars
    exp = graph.producer(e_atom)
    if exp is None or exp.primitive.name != "exp":
        return None
    # jnp.sum at 16 bits accumulates in float32: casts around the sum
    total, passed = _through(denom, graph, _KEEPDIMS - {"stop_gradient", "max"})
    red = graph.producer(total)
    if red is None or red.primitive.name != "reduce_sum":
        return None
    summed, widened = _through(red.invars[0], graph, ("convert_element_type",))
    if summed is not e_atom:
        return None
    axes = tuple(red.params["axes"])
    eqns = [div, exp, red, *passed, *widened]
    if len(axes) != 1:
        raise _Miss(SOFTMAX(why=f"runs over {len(axes)} axes at once"), eqns)
    x, more, perm = _max_subtracted(exp, axes, graph, eqns)
    axis = int(axes[0]) if perm is None else int(perm[axes[0]])
    return _Softmax(x, axis, tuple(eqns + more), x.aval.dtype, perm)


def _max_subtracted(exp, axes, graph: Graph, eqns) -> tuple:
    """(x, the equations, perm) of `exp(x - max(x))`, the maximum over `axes`
    with keepdims in any spelling; or of `exp(transpose(x) - max(x))`, the
    softmax's axis moved last as a softmax under penzai's named-axis `nmap`
    computes it (perm: the transpose's, the other axes in their order).
    Raises `_Miss` where `exp` reads anything else."""
    sub = graph.producer(exp.invars[0])
    if sub is None or sub.primitive.name != "sub":
        raise _Miss(SOFTMAX(why="subtracts no maximum before `exp` (it may overflow where "
                            "jax.nn's does not)"), eqns)
    x, m = sub.invars
    top, passed = _through(m, graph, _KEEPDIMS)
    mx = graph.producer(top)
    moved = graph.producer(x) if C.is_var(x) else None
    perm = None
    if mx is not None and mx.primitive.name == "reduce_max" and mx.invars[0] is not x \
            and moved is not None and moved.primitive.name == "transpose" \
            and moved.invars[0] is mx.invars[0] and axes is not None and len(axes) == 1:
        p = tuple(moved.params["permutation"])
        rest = [a for j, a in enumerate(p) if j != axes[0]]
        if (p[axes[0]],) == tuple(mx.params["axes"]) and rest == sorted(rest):
            perm, x = p, moved.invars[0]
            passed = [*passed, moved]
    if mx is None or mx.primitive.name != "reduce_max" or mx.invars[0] is not x \
            or (axes is not None and perm is None and tuple(mx.params["axes"]) != tuple(axes)):
        raise _Miss(SOFTMAX(why="subtracts something other than the maximum of its input"),
                    [*eqns, sub])
    return x, [sub, mx, *passed], perm


def unnormalized_of(atom, graph: Graph) -> _Softmax | None:
    """The softmax's numerator computing `atom`, `exp(x - max(x))` over one
    axis, where the division by its sum comes after the values' contraction
    (MaxText's `dot_product` path, flash-style attention): None if `atom` is
    no `exp`, `_Miss` where the maximum differs."""
    exp = graph.producer(atom) if C.is_var(atom) else None
    if exp is None or exp.primitive.name != "exp":
        return None
    sub = graph.producer(exp.invars[0])
    if sub is None or sub.primitive.name != "sub":
        return None  # an exp of anything else is no softmax's numerator
    x, more, _ = _max_subtracted(exp, None, graph, [exp])
    axes = tuple(more[1].params["axes"])
    if len(axes) != 1:
        raise _Miss(SOFTMAX(why=f"runs over {len(axes)} axes at once"), [exp, *more])
    return _Softmax(x, int(axes[0]), (exp, *more), x.aval.dtype)


def _softmax_nearby(atom, graph: Graph, depth: int = 8, find=None):
    """The atom of a softmax's result found within `depth` elementwise or
    layout steps above `atom`: whether this contraction reads attention
    weights (a softmax between two contractions; `find`: `unnormalized_of`
    where the normalization comes after the contraction)."""
    find = find or softmax_of
    frontier, seen = [atom], set()
    for _ in range(depth):
        nxt = []
        for a in frontier:
            if not C.is_var(a) or id(a) in seen:
                continue
            seen.add(id(a))
            try:
                if find(a, graph) is not None:
                    return a
            except _Miss:
                return a
            e = graph.producer(a)
            if e is None:
                continue
            if e.primitive.name in xla.FUSIBLE or any(
                    e.primitive.name == "dot_general" and graph.const_value(b) is not None
                    for b in e.invars):
                # elementwise and layout steps, or a contraction with a constant
                # (a head mask): never a projection, nor a reduction
                nxt.extend(e.invars)
        frontier = nxt
    return None


def _producers(atom, graph: Graph, limit: int = 64) -> list:
    """The equations computing `atom` (a constant's, a mask's), up to `limit`."""
    out, stack, seen = [], [atom], set()
    while stack and len(out) < limit:
        a = stack.pop()
        if not C.is_var(a) or id(a) in seen:
            continue
        seen.add(id(a))
        e = graph.producer(a)
        if e is not None:
            out.append(e)
            stack.extend(e.invars)
    return out


def _dot_labels(eqn):
    """(lhs, rhs, out) einsum labels of a bare dot_general (`canonical.contraction`'s)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = [None] * len(eqn.invars[0].aval.shape), [None] * len(eqn.invars[1].aval.shape)
    for i, (a, b) in enumerate(zip(lb, rb)):
        lhs[a] = rhs[b] = ("b", i)
    for i, (a, b) in enumerate(zip(lc, rc)):
        lhs[a] = rhs[b] = ("c", i)
    lhs = [x or ("l", k) for k, x in enumerate(lhs)]
    rhs = [x or ("r", k) for k, x in enumerate(rhs)]
    out = [("b", i) for i in range(len(lb))] + [x for x in lhs if x[0] == "l"] + \
        [x for x in rhs if x[0] == "r"]
    return lhs, rhs, out


def _window_of(plane: np.ndarray):
    """(is_causal, local_window_size) when the (T, S) boolean `plane` is
    exactly jax.nn's causal mask and/or window, (False, None) when it is all
    True; None when it is neither (jax.nn's definitions: causal keeps key j
    <= query i; a window (l, r) keeps i - l <= j <= i + r)."""
    t, s = plane.shape
    if plane.all():
        return False, None
    lefts, rights = set(), set()
    for i in range(t):
        row = np.flatnonzero(plane[i])
        if row.size == 0 or row[-1] - row[0] + 1 != row.size:
            return None
        if row[0] > 0:
            lefts.add(i - int(row[0]))
        if row[-1] < s - 1:
            rights.add(int(row[-1]) - i)
    if len(lefts) > 1 or len(rights) > 1:
        return None
    left = lefts.pop() if lefts else max(t, s)
    right = rights.pop() if rights else max(t, s)
    if left < 0 or right < 0:
        return None
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    if not np.array_equal(plane, (j >= i - left) & (j <= i + right)):
        return None
    if right == 0:
        return True, (None if left >= t else (left, 0))
    return False, (min(left, s), min(right, s))


class _Analysis:
    """Reads one attention from its values' contraction back; `run()` gives
    the `_Plan` or raises `_Miss` naming the step that differs."""

    def __init__(self, root, graph: Graph, deferred: bool = False):
        self.root, self.graph, self.deferred = root, graph, deferred
        self.softmax: _Softmax | None = None
        # gemma's grouped layer: the softmax runs on [.., K*G, ..], split into (K, G) after
        # it and merged from them before it: (the merged axis, K, G), coordinates unmerged
        self.split: tuple | None = None
        self.moved: list = []   # (logits()) the softmax input's axis i is axis moved[i] of c1's
        self.core: list = []
        self.optional: list = []
        self.fills: list = []   # (effective fill, dtype, equation) of every mask found
        self.remasks: list = []  # (predicate, negate) of `where(mask, weights, 0)` after the softmax

    def single_use(self, atom) -> bool:
        return self.graph.uses(atom) == 1

    def miss(self, reason, *eqns):
        raise _Miss(reason, (*self.core, *eqns))

    def constant_eqns(self, atom):
        self.optional.extend(_producers(atom, self.graph))

    # ---------------------------------------------------------------- run
    def run(self) -> _Plan:
        g = self.graph
        c2 = contraction(self.root.outvars[0], g.producer, self.single_use)
        self.core += c2.eqns
        find = unnormalized_of if self.deferred else softmax_of
        which = next(i for i in (0, 1) if _softmax_nearby(c2.operands[i], g, find=find) is not None)
        w_atom, v_atom = c2.operands[which], c2.operands[1 - which]
        w_labels, v_labels = c2.labels[which], c2.labels[1 - which]
        sm, w_axes = self.weights(w_atom)
        self.softmax = sm
        self.core += sm.eqns
        x = sm.logits
        # the softmax's axis among the logits' contraction's (split where gemma merges heads)
        sm_axis = sm.axis + (1 if self.split is not None and sm.axis > self.split[0] else 0)
        contracted = [i for i, lab in enumerate(w_labels) if lab[0] == "c"]
        w_free = [i for i, lab in enumerate(w_labels) if lab[0] in ("l", "r")]
        if len(contracted) != 1 or w_axes[contracted[0]] != sm_axis:
            self.miss(LAYOUT(why="the values' contraction does not sum over the softmax's axis"))
        if len(w_free) not in (1, 2):
            self.miss(LAYOUT(why=f"the weights keep {len(w_free)} axes besides the batch ones "
                                 f"(the queries' one, and at most a group of query heads, "
                                 f"expected)"))
        v_free = [lab for lab in v_labels if lab[0] in ("l", "r")]
        if len(v_free) != 1:
            self.miss(LAYOUT(why=f"the values keep {len(v_free)} axes besides the batch ones "
                                 f"(one head axis expected)"))
        # ---- the logits, down to the queries' contraction
        terms, masks, mult, c1_atom = self.logits(x)
        if self.moved != sorted(self.moved):  # transposed on the way: the contraction's axes
            if self.split is not None:
                self.miss(LAYOUT(why="the logits are transposed and merged over two head axes"))
            sm_axis = self.moved[sm_axis]
            w_axes = tuple(self.moved[a] for a in w_axes)
        c1 = contraction(c1_atom, g.producer, self.single_use)
        self.core += c1.eqns
        out1 = c1.labels[2]
        lshape = tuple(c1_atom.aval.shape)  # the logits, as their contraction lays them out
        key_label = out1[sm_axis]
        if key_label[0] not in ("l", "r"):
            self.miss(LAYOUT(why="the softmax runs over a batch axis of the logits"))
        if len([lab for lab in c1.labels[0] if lab[0] == "c"]) != 1:
            self.miss(LAYOUT(why="the logits' contraction sums over other than one head axis"))
        k_index = 0 if key_label in c1.labels[0] else 1
        q_index = 1 - k_index
        q_labels, k_labels = c1.labels[q_index], c1.labels[k_index]
        q_free = [lab for lab in q_labels if lab[0] in ("l", "r")]
        k_free = [lab for lab in k_labels if lab[0] in ("l", "r")]
        if len(q_free) != len(w_free) or len(k_free) != 1:
            self.miss(LAYOUT(why="the queries or the keys have other than one sequence axis"))
        # a second axis of the queries alone (MaxText's and gemma's [.., K, G, T, S]
        # logits): a group of query heads per key/value head
        query_label, group_label = (q_free[0], None) if len(q_free) == 1 else \
            self.query_axis(q_free, out1, terms, masks, sm_axis, lshape)
        logit_roles = tuple("T" if lab == query_label else "S" if lab == key_label
                            else "G" if lab == group_label else lab for lab in out1)
        if sorted(w_axes[i] for i in w_free) != sorted(out1.index(lab) for lab in q_free):
            self.miss(LAYOUT(why="the weights' free axes are not the logits' query axes"))
        c2_role = {lab: logit_roles[w_axes[i]] for i, lab in enumerate(w_labels) if lab[0] == "b"}
        batch_roles = [r for r in logit_roles if r not in ("T", "S", "G")]
        if sorted(map(repr, c2_role.values())) != sorted(map(repr, batch_roles)):
            self.miss(LAYOUT(why="the values' contraction pairs other batch axes than the logits'"))
        q_roles = tuple(lab if lab[0] == "b" else "H" if lab[0] == "c"
                        else "T" if lab == query_label else "G" for lab in q_labels)
        k_roles = tuple(lab if lab[0] == "b" else "H" if lab[0] == "c" else "S" for lab in k_labels)
        v_roles = tuple(c2_role[lab] if lab[0] == "b" else "S" if lab[0] == "c" else "D"
                        for lab in v_labels)
        w_role = {w_labels[i]: logit_roles[w_axes[i]] for i in w_free}
        out_roles = tuple(c2_role[lab] if lab[0] == "b" else w_role.get(lab, "D")
                          for lab in c2.labels[2])
        # ---- the operands, their scales peeled
        q_side, q_scale = self.side(c1.operands[q_index], q_roles)
        k_side, k_scale = self.side(c1.operands[k_index], k_roles, gqa=True)
        v_side, _ = self.side(v_atom, v_roles, gqa=True, scales=False)
        if (k_side.groups, k_side.group_role) != (v_side.groups, v_side.group_role):
            k_side, k_scale = self.side(c1.operands[k_index], k_roles)
            v_side, _ = self.side(v_atom, v_roles, scales=False)
        scale = mult * q_scale * k_scale
        if not (scale > 0 and math.isfinite(scale)):
            self.miss(LAYOUT(why=f"the net scale {scale:g} is not a positive number"))
        # ---- dtypes
        dtype = np.dtype(w_atom.aval.dtype)
        if dtype == np.float64:
            self.miss(DTYPE(why="float64: jax.nn's attention computes its softmax in float32"))
        if not _is_float(dtype) or np.dtype(v_atom.aval.dtype) != dtype:
            self.miss(DTYPE(why=f"the weights are {dtype.name} and the values "
                                f"{np.dtype(v_atom.aval.dtype).name} at their contraction"))
        for name, s in (("queries", q_side), ("keys", k_side), ("values", v_side)):
            have = np.dtype(s.src.aval.dtype)
            if have != dtype and jnp.promote_types(have, dtype) != dtype:
                self.miss(DTYPE(why=f"the {name} are {have.name}, wider than the weights' "
                                    f"{dtype.name}: jax.nn would compute them in {dtype.name}"))
        # ---- masks: the constant part as is_causal / a window where it is exactly that
        self._roles, self._shape = logit_roles, lshape
        all_masks = list(masks)
        causal, window, masks = self.constant_masks(masks, logit_roles, lshape)
        self.check_fills(masks, causal, window, logit_roles, lshape)
        if self.split is not None and self.remasks:
            self.miss(LAYOUT(why="the weights are masked again and split over two head axes"))
        zero_rows = self.remask_is_the_mask([t for t in all_masks if t.value is None], causal,
                                            window, len(self._shape))
        # ---- jax.nn's heads axis: the grouped one, else one the bias and masks broadcast over
        heads_role = k_side.group_role
        if heads_role is None and batch_roles:
            flat = [r for r in batch_roles
                    if all(t.view[logit_roles.index(r)] == 1 for t in (*terms, *masks))]
            heads_role = flat[-1] if flat else batch_roles[-1]
        heads = (heads_role,) if heads_role is not None else ()
        groups = k_side.groups
        if group_label is not None:
            if k_side.groups > 1:
                self.miss(LAYOUT(why="the keys are repeated over heads and the queries hold a "
                                     "group axis besides"))
            # jax.nn's query heads: the key/value heads (the batch axis before the group
            # in the queries' layout, else the last one) major, the group minor
            at = q_labels.index(group_label)
            kv = q_labels[at - 1] if at > 0 and q_labels[at - 1][0] == "b" else \
                (batch_roles[-1] if batch_roles else None)
            heads = (kv, "G") if kv is not None else ("G",)
            groups = int(lshape[logit_roles.index("G")])
        form, details = self.form(sm, dtype, mult, q_scale * k_scale, terms, masks, causal,
                                  window, groups)
        for s in (q_side, k_side, v_side):
            self.optional.extend(s.walked)
        if zero_rows:
            details = ", ".join(filter(None, (details, "re-masked after the softmax")))
        return _Plan(q_side, k_side, v_side, logit_roles, lshape, out_roles,
                     np.dtype(self.root.outvars[0].aval.dtype), dtype, float(scale), tuple(terms),
                     tuple(masks), causal, window, heads, tuple(self.core),
                     tuple(self.optional), form, details, zero_rows)

    def query_axis(self, q_free, out1, terms, masks, key_axis, shape):
        """(the query axis, the group axis) of two free axes of the queries:
        rows are independent, so either reading computes the same; the query
        axis is the one the masks and bias vary along (with the keys), else
        the one as long as the keys (self-attention), else the one beside the
        keys' axis in the logits, else the longer."""
        at = {lab: out1.index(lab) for lab in q_free}
        varied = [lab for lab in q_free if any(t.view[at[lab]] != 1 for t in (*terms, *masks))]
        as_long = [lab for lab in q_free if shape[at[lab]] == shape[key_axis]]
        if len(varied) == 1:
            query = varied[0]
        elif len(as_long) == 1:
            query = as_long[0]
        elif any(at[lab] == key_axis - 1 for lab in q_free):
            query = next(lab for lab in q_free if at[lab] == key_axis - 1)
        else:
            query = max(q_free, key=lambda lab: (shape[at[lab]], at[lab]))
        return query, next(lab for lab in q_free if lab != query)

    # ------------------------------------------------------------ weights
    def weights(self, atom):
        """From the weights the values' contraction reads back to the softmax:
        (the softmax, for each axis of `atom` the softmax's axis it is)."""
        g = self.graph
        axes = list(range(len(atom.aval.shape)))  # atom axis i is axis axes[i] of `cur`
        cur = atom
        find = unnormalized_of if self.deferred else softmax_of
        while True:
            sm = find(cur, g) if C.is_var(cur) else None
            if sm is not None:
                if self.split is not None and sm.axis == self.split[0]:
                    self.miss(LAYOUT(why="the softmax runs over the axis the weights split"))
                if sm.perm is not None:
                    if self.split is not None:
                        self.miss(LAYOUT(why="the softmax moves its axis and the weights are "
                                             "split over two head axes"))
                    axes = [sm.perm[a] for a in axes]  # among the logits' axes
                return sm, tuple(axes)
            e = g.producer(cur) if C.is_var(cur) else None
            if e is None:
                self.miss(LAYOUT(why="the values' contraction reads no softmax"))
            name = e.primitive.name
            if self.split is not None and name not in ("convert_element_type", "copy"):
                self.miss(STEP(culprit=name, where=_WEIGHTS, why="not a step attention takes "
                                                                 "after the heads' split"), e)
            if name == "reshape" and self.split is None and not self.deferred and (
                    a := _merged_axis(e.outvars[0].aval.shape, e.invars[0].aval.shape)) is not None:
                # [.., K*G, ..] -> [.., K, G, ..] (gemma): the atom's axes stay in the
                # split coordinates, which the logits' contraction has too
                shape = e.outvars[0].aval.shape
                self.split = (a, int(shape[a]), int(shape[a + 1]))
                self.core.append(e)
                cur = e.invars[0]
                continue
            if name == "convert_element_type" and _is_float(e.outvars[0].aval.dtype) \
                    and _is_float(e.invars[0].aval.dtype):
                self.core.append(e)
                cur = e.invars[0]
            elif name == "copy":
                self.core.append(e)
                cur = e.invars[0]
            elif name == "transpose":
                perm = e.params["permutation"]
                axes = [perm[a] for a in axes]
                self.core.append(e)
                cur = e.invars[0]
            elif name == "mul" and self._ones(e) is not None:
                i = self._ones(e)
                self.core.append(e)
                self.constant_eqns(e.invars[i])
                cur = e.invars[1 - i]
            elif name == "dot_general" and self._ones_dot(e) is not None:
                inner, mapping = self._ones_dot(e)
                axes = [mapping[a] for a in axes]
                self.core.append(e)
                self.constant_eqns(e.invars[1 - e.invars.index(inner)])
                cur = inner
            elif name == "select_n" and len(e.invars) == 3 and self._zero_branch(e) is not None \
                    and axes == list(range(len(axes))):
                # where(mask, softmax, 0), Keras's Softmax layer: the weights the mask
                # dropped are 0 already, unless it drops a whole row (checked in run())
                keep, negate = self._zero_branch(e)
                self.core.append(e)
                self.constant_eqns(e.invars[1 + (1 - keep)])
                self.remasks.append((e.invars[0], negate, e))
                cur = e.invars[1 + keep]
            elif name in ("mul", "dot_general"):
                self.miss(STEP(culprit=name, where=_WEIGHTS,
                               why="the weights are scaled by something other than ones "
                                   "(a head mask or dropout)"), e)
            else:
                self.miss(STEP(culprit=name, where=_WEIGHTS, why="not a step attention takes"), e)

    def _zero_branch(self, eqn):
        """(index of the kept branch among select_n's cases, negate) where one
        case is a constant 0: select_n(p, 0, w) keeps w where p, select_n(p, w, 0)
        where not p."""
        p, if_false, if_true = eqn.invars
        for keep, zero, negate in ((1, if_false, False), (0, if_true, True)):
            value = self.graph.const_value(zero)
            if value is not None and _scalar(value) == 0.0 and p.aval.dtype == np.bool_:
                return keep, negate
        return None

    def remask_is_the_mask(self, masks, causal, window, rank):
        """Whether every re-mask after the softmax is the logits' own mask: the
        same factors (the constant ones as is_causal or a window included)."""
        if not self.remasks:
            return False
        own = {(id(t.atom), t.negate) for t in masks}
        for p, negate, e in self.remasks:
            found: list = []
            self.split_factors(p, negate, found, lambda view: view, rank)
            consts = [t for t in found if t.value is not None]
            if {(id(t.atom), t.negate) for t in found if t.value is None} != own:
                self.miss(STEP(culprit="select_n", where=_WEIGHTS,
                               why="the weights are masked again by another mask than the "
                                   "logits'"), e)
            if consts:
                c, w, _ = self.constant_masks(consts, self._roles, self._shape)
                if (c, w) != (causal, window):
                    self.miss(STEP(culprit="select_n", where=_WEIGHTS,
                                   why="the weights are masked again by another constant mask "
                                       "than the logits'"), e)
        return True

    def _ones(self, eqn):
        """The operand index of a constant all-ones factor of a same-shape `mul`."""
        for i, a in enumerate(eqn.invars):
            value = self.graph.const_value(a)
            if value is not None and _scalar(value) == 1.0 \
                    and tuple(eqn.invars[1 - i].aval.shape) == tuple(eqn.outvars[0].aval.shape):
                return i
        return None

    def _ones_dot(self, eqn):
        """For `einsum('...hqk,h->...hqk', w, ones)` (a head mask of ones, as
        HF's BERT family always applies one): (w, for each result axis the
        axis of w it is); None for any other dot_general."""
        lhs, rhs, out = _dot_labels(eqn)
        for i, labels in ((0, lhs), (1, rhs)):
            other = (rhs, lhs)[i]
            value = self.graph.const_value(eqn.invars[1 - i])
            if value is None or _scalar(value) != 1.0:
                continue
            if any(lab[0] != "b" for lab in other):
                continue  # the ones may only run along batch (head) axes
            if tuple(eqn.outvars[0].aval.shape) != tuple(
                    eqn.invars[i].aval.shape[labels.index(lab)] for lab in out):
                continue
            return eqn.invars[i], [labels.index(lab) for lab in out]
        return None

    # ------------------------------------------------------------- logits
    def _reaches_dot(self, atom, depth=0) -> bool:
        """Whether `atom` is computed from a contraction by steps the logits take."""
        if depth > 32 or not C.is_var(atom):
            return False
        e = self.graph.producer(atom)
        if e is None:
            return False
        name = e.primitive.name
        if name in ("dot_general", "transpose"):
            return contraction(atom, self.graph.producer, self.single_use) is not None or (
                name == "transpose" and self._reaches_dot(e.invars[0], depth + 1))
        if name in ("convert_element_type", "copy", "neg") or (name == "reshape" and self.split):
            return self._reaches_dot(e.invars[0], depth + 1)
        if name in ("add", "add_any", "sub", "mul", "div", "select_n"):
            return any(self._reaches_dot(a, depth + 1) for a in e.invars)
        return False

    def logits(self, x):
        """(bias terms, mask factors, multiplier, the contraction's atom) of
        the softmax's input `x`."""
        g = self.graph
        terms, masks = [], []
        mult, cur = 1.0, x
        rank = len(x.aval.shape)
        identity = lambda view: view  # noqa: E731
        self.moved = list(range(rank))  # x's axis i is axis moved[i] of `cur`, so far
        while True:
            if contraction(cur, g.producer, self.single_use) is not None:
                if self.split is not None:
                    self.miss(LAYOUT(why="the weights are split over two head axes and the "
                                         "logits are not merged from them"))
                return terms, masks, mult, cur
            e = g.producer(cur) if C.is_var(cur) else None
            if e is None:
                self.miss(LAYOUT(why="the softmax reads no contraction of queries and keys"))
            name = e.primitive.name
            if name == "reshape" and self.split is not None:
                a, k, grp = self.split
                split_shape = tuple(e.invars[0].aval.shape)
                if _merged_axis(split_shape, e.outvars[0].aval.shape) != a \
                        or split_shape[a:a + 2] != (k, grp) \
                        or contraction(e.invars[0], g.producer, self.single_use) is None:
                    self.miss(STEP(culprit=name, where=_LOGITS,
                                   why="merges other axes than the weights split"), e)
                self.core.append(e)

                def unmerged(view):
                    n = view[a]
                    return (*view[:a], *((k, grp) if n == k * grp else (1, 1)), *view[a + 1:])
                bad = [t for t in (*terms, *masks) if t.view[a] not in (1, k * grp)]
                if bad:
                    self.miss(LAYOUT(why="a mask or bias broadcasts over part of the merged heads"))
                terms = [dataclasses.replace(t, view=unmerged(t.view)) for t in terms]
                masks = [dataclasses.replace(t, view=unmerged(t.view)) for t in masks]
                return terms, masks, mult, e.invars[0]
            if name in ("convert_element_type", "copy") and _is_float(e.outvars[0].aval.dtype) \
                    and _is_float(e.invars[0].aval.dtype):
                self.core.append(e)
                cur = e.invars[0]
                continue
            if name == "transpose" and self.split is None:
                # (penzai's named axes) the masks and bias read at the operand's
                # axes: a reshape still lays them out where their axes keep their order
                perm = tuple(e.params["permutation"])
                self.moved = [perm[a] for a in self.moved]
                terms = [self._permuted(t, perm) for t in terms]
                masks = [self._permuted(t, perm) for t in masks]
                self.core.append(e)
                cur = e.invars[0]
                continue
            if name in ("add", "add_any", "sub"):
                a, b = e.invars
                if self._reaches_dot(a):
                    main, other, sign = a, b, (-1.0 if name == "sub" else 1.0)
                elif self._reaches_dot(b) and name != "sub":
                    main, other, sign = b, a, 1.0
                elif self._reaches_dot(b):
                    self.miss(LAYOUT(why="the logits are subtracted from something (negated)"), e)
                else:
                    self.miss(LAYOUT(why="the softmax reads no contraction of queries and keys"), e)
                self.core.append(e)
                self.split_terms(other, mult * sign, terms, masks, identity, rank)
                cur = main
                continue
            if name in ("mul", "div"):
                a, b = e.invars
                if name == "div" or self._reaches_dot(a):
                    main, c = a, b
                else:
                    main, c = b, a
                value = g.const_value(c)
                if value is None:
                    self.miss(SCALE_TRACED(culprit=name), e)
                s = _scalar(value)
                if s is None:
                    self.miss(SCALE_ARRAY(culprit=name, shape=tuple(np.shape(value))), e)
                mult = mult / s if name == "div" else mult * s
                self.core.append(e)
                self.constant_eqns(c)
                cur = main
                continue
            if name == "neg":
                self.miss(LAYOUT(why="the logits are negated"), e)
            if name == "select_n" and len(e.invars) == 3:
                p, if_false, if_true = e.invars
                if self._reaches_dot(if_true):
                    main, fill_atom, keep = if_true, if_false, True
                else:
                    main, fill_atom, keep = if_false, if_true, False
                value = g.const_value(fill_atom)
                fill = None if value is None else _scalar(value)
                if fill is None:
                    self.miss(STEP(culprit=name, where=_LOGITS,
                                   why="selects between the logits and a value that is not "
                                       "one constant (a mask needs a constant fill)"), e)
                self.core.append(e)
                self.constant_eqns(fill_atom)
                self.fills.append((fill * mult, np.dtype(e.outvars[0].aval.dtype), e))
                self.split_factors(p, not keep, masks, identity, rank)
                cur = main
                continue
            if name == "tanh":
                self.miss(STEP(culprit=name, where=_LOGITS,
                               why="a soft cap of the logits (`cap * tanh(s / cap)`, Gemma 2's): "
                                   "jax.nn.dot_product_attention has no soft cap to express it"), e)
            self.miss(STEP(culprit=name, where=_LOGITS, why="not a step attention takes"), e)

    @staticmethod
    def _permuted(term, perm):
        """`term` read at the axes of a transpose's operand (the transpose's
        axis j is its operand's axis perm[j])."""
        inverse = [0] * len(perm)
        for j, p in enumerate(perm):
            inverse[p] = j
        order = term.order or tuple(range(len(perm)))
        return dataclasses.replace(term, view=tuple(term.view[i] for i in inverse),
                                   order=tuple(order[i] for i in inverse))

    def split_terms(self, atom, coefficient, terms, masks, to_logits, rank):
        """An additive term of the logits as bias terms and mask factors."""
        g = self.graph
        e = g.producer(atom) if C.is_var(atom) else None
        value = g.const_value(atom)
        if value is not None and np.all(np.asarray(value) == 0):
            self.constant_eqns(atom)
            return
        name = e.primitive.name if e is not None else None
        if name in ("add", "add_any", "sub"):
            self.optional.append(e)
            self.split_terms(e.invars[0], coefficient, terms, masks, to_logits, rank)
            self.split_terms(e.invars[1], -coefficient if name == "sub" else coefficient, terms,
                             masks, to_logits, rank)
            return
        if name == "convert_element_type" and _is_float(e.outvars[0].aval.dtype) \
                and _is_float(e.invars[0].aval.dtype):
            self.optional.append(e)
            self.split_terms(e.invars[0], coefficient, terms, masks, to_logits, rank)
            return
        if name == "broadcast_in_dim" and xla.broadcast_view(e) is not None:
            self.optional.append(e)
            inner = functools.partial(lambda outer, eqn, v: outer(_view_through(v, eqn)), to_logits, e)
            self.split_terms(e.invars[0], coefficient, terms, masks, inner, rank)
            return
        if name == "select_n" and len(e.invars) == 3:
            p, a, b = e.invars
            va, vb = g.const_value(a), g.const_value(b)
            fa = None if va is None else _scalar(va)
            fb = None if vb is None else _scalar(vb)
            dtype = np.dtype(e.outvars[0].aval.dtype)
            for fill, zero, keep_if in ((fa, fb, True), (fb, fa, False)):
                if zero == 0.0 and fill is not None and _masks(fill * coefficient, dtype):
                    self.optional.append(e)
                    self.constant_eqns(a)
                    self.constant_eqns(b)
                    self.fills.append((fill * coefficient, dtype, e))
                    self.split_factors(p, not keep_if, masks, to_logits, rank)
                    return
        view = to_logits(tuple(atom.aval.shape))
        if view is None or len(view) != rank:
            self.miss(LAYOUT(why=f"a bias of shape {tuple(atom.aval.shape)} does not broadcast "
                                 f"to the logits by size-1 dimensions"))
        terms.append(_Term(atom, tuple(view), coefficient=float(coefficient)))

    def split_factors(self, p, negate, masks, to_logits, rank):
        """A mask predicate (True: keep) as factors jax.nn's mask ANDs."""
        g = self.graph
        e = g.producer(p) if C.is_var(p) else None
        name = e.primitive.name if e is not None else None
        value = evaluate(p, g)
        if value is not None:
            view = to_logits(tuple(np.shape(value)))
            if view is not None and len(view) == rank:
                self.constant_eqns(p)
                masks.append(_Term(p, tuple(view), negate=negate, value=np.asarray(value)))
                return
        if name in ("and", "or") and p.aval.dtype == np.bool_ and (name == "and") != negate:
            self.optional.append(e)
            for a in e.invars:
                self.split_factors(a, negate, masks, to_logits, rank)
            return
        if name == "not" and p.aval.dtype == np.bool_:
            self.optional.append(e)
            self.split_factors(e.invars[0], not negate, masks, to_logits, rank)
            return
        if name in ("gt", "ne", "eq"):
            # bool -> number -> compared with 0: the bool itself (combine_masks' round trip)
            for i in (0, 1):
                zero = g.const_value(e.invars[1 - i])
                inner = g.producer(e.invars[i]) if C.is_var(e.invars[i]) else None
                if zero is None or _scalar(zero) != 0.0 or inner is None \
                        or inner.primitive.name != "convert_element_type" \
                        or inner.invars[0].aval.dtype != np.bool_ or (name == "gt" and i != 0):
                    continue
                self.optional.extend([e, inner])
                self.constant_eqns(e.invars[1 - i])
                self.split_factors(inner.invars[0], negate != (name == "eq"), masks, to_logits, rank)
                return
        if name == "broadcast_in_dim" and xla.broadcast_view(e) is not None:
            self.optional.append(e)
            inner = functools.partial(lambda outer, eqn, v: outer(_view_through(v, eqn)), to_logits, e)
            self.split_factors(e.invars[0], negate, masks, inner, rank)
            return
        view = to_logits(tuple(p.aval.shape))
        if view is None or len(view) != rank:
            self.miss(LAYOUT(why=f"a mask of shape {tuple(p.aval.shape)} does not broadcast to the "
                                 f"logits by size-1 dimensions (a {len(p.aval.shape)}-D mask)"))
        if p.aval.dtype != np.bool_:
            self.miss(LAYOUT(why=f"a {np.dtype(p.aval.dtype).name} mask predicate"))
        masks.append(_Term(p, tuple(view), negate=negate))

    # -------------------------------------------------------------- masks
    def constant_masks(self, masks, roles, shape):
        """(is_causal, local_window_size, the mask factors left): the constant
        factors' AND, where it is exactly a causal mask or a band, is given
        to jax.nn as such and not read."""
        consts = [m for m in masks if m.value is not None]
        rest = [m for m in masks if m.value is None]
        if not consts:
            return False, None, rest
        combined = np.ones((1,) * len(shape), bool)
        for m in consts:
            v = m.laid_out(np.asarray(m.value) != 0)
            combined = combined & (~v if m.negate else v)
        t, s = roles.index("T"), roles.index("S")
        for ax, n in enumerate(combined.shape):
            if ax not in (t, s) and n > 1 and not np.all(combined == np.take(combined, [0], ax)):
                return False, None, masks  # differs along a batch axis: read as a mask
        index = tuple(slice(None) if ax in (t, s) else 0 for ax in range(combined.ndim))
        plane = combined[index]
        if t > s:
            plane = plane.T
        plane = np.broadcast_to(plane, (shape[t], shape[s]))
        found = _window_of(plane)
        if found is None:
            return False, None, masks
        return found[0], found[1], rest

    def check_fills(self, masks, causal, window, roles, shape):
        """A mask's fill must take exp to 0 as jax.nn's does; -inf only where
        no row can be masked whole (there it is NaN, jax.nn's uniform)."""
        for fill, dtype, e in self.fills:
            if math.isinf(fill) and fill < 0:
                t, s = shape[roles.index("T")], shape[roles.index("S")]
                rows_kept = not masks and (causal or window is not None) and t <= s
                if not rows_kept:
                    self.miss(FILL(fill="-inf", why="a row masked whole is NaN here, and finite "
                                                    "(uniform weights) in jax.nn's attention"), e)
            elif not _masks(fill, dtype):
                self.miss(FILL(fill=f"{fill:g}", why=f"exp of it less the largest logit need not be 0, "
                                                    f"as jax.nn's mask makes it (a fill of at most "
                                                    f"{_MASK_FILL:g} or the dtype's lowest value masks)"), e)

    # ------------------------------------------------------------ operands
    def side(self, atom, roles, *, gqa=False, scales=True):
        """`atom` (an operand of a contraction) as the replacement reads it:
        (its `_Side`, the product of the constant scales peeled off it)."""
        g = self.graph
        walk = []   # (equation, kind) from `atom` down: "layout", "skip", "scale", "repeat"
        scale, cur, repeat = 1.0, atom, None
        reshaped = False
        while C.is_var(cur):
            e = g.producer(cur)
            if e is None:
                break
            name = e.primitive.name
            if _widening(e):
                walk.append((e, "skip"))
                cur = e.invars[0]
                continue
            if scales and name in ("mul", "div"):
                a, b = e.invars
                found = None
                for c, other in ((b, a),) if name == "div" else ((b, a), (a, b)):
                    value = g.const_value(c)
                    s = None if value is None else _scalar(value)
                    if s is not None and s != 0 and g.const_value(other) is None:
                        found = (1.0 / s if name == "div" else s), other, c
                        break
                if found is None:
                    break
                scale *= found[0]
                walk.append((e, "scale"))
                self.constant_eqns(found[2])
                cur = found[1]
                continue
            if gqa and repeat is None and not reshaped and name == "reshape":
                grouped = _repeat(e, g)
                if grouped is not None:
                    axis, groups, bcast = grouped
                    walk += [(e, "repeat"), (bcast, "repeat")]
                    repeat = (len(walk), axis, groups)
                    cur = bcast.invars[0]
                    continue
            if name in ("reshape", "transpose", "copy") and len(e.invars) == 1:
                reshaped |= name == "reshape"
                walk.append((e, "layout"))
                cur = e.invars[0]
                continue
            break
        kinds = [k for _, k in walk]
        deepest = max((i for i, k in enumerate(kinds) if k != "layout"), default=-1)
        walk = walk[:deepest + 1]
        src = walk[-1][0].invars[0] if walk else atom
        replay = tuple(e for e, k in reversed(walk) if k == "layout")
        groups, group_axis = 1, None
        if repeat is not None:
            _, axis, groups = repeat
            # the repeated axis in the operand's own coordinates: up through the
            # transposes replayed above the repeat
            above = [e for e, k in walk[:repeat[0] - 2] if e.primitive.name == "transpose"]
            for e in reversed(above):
                axis = list(e.params["permutation"]).index(axis)
            group_axis = axis
        return _Side(src, replay, tuple(roles), tuple(e for e, _ in walk), groups, group_axis), scale

    # --------------------------------------------------------------- form
    def form(self, sm, dtype, logit_scale, side_scale, terms, masks, causal, window, groups):
        """The site's name (as the shipped forms were named) and a description."""
        name = NAME
        if logit_scale != 1.0 and side_scale == 1.0:
            name += "_logits_scaled"
        if np.dtype(sm.dtype).itemsize > np.dtype(dtype).itemsize:
            name += "_float32_softmax"
        if terms:
            name += "_bias"
        if masks or causal or window is not None:
            name += "_masked"
        parts = []
        if causal:
            parts.append("causal")
        if window is not None:
            parts.append(f"window {window}")
        if masks:
            parts.append(f"{len(masks)} mask factor{'s' if len(masks) > 1 else ''}")
        if terms:
            parts.append(f"{len(terms)} bias term{'s' if len(terms) > 1 else ''}")
        if groups > 1:
            parts.append(f"{groups} query heads per key/value head")
        return name, ", ".join(parts)


def _masks(fill: float, dtype) -> bool:
    """A finite fill that masks (see `_MASK_FILL`)."""
    if not math.isfinite(fill):
        return False
    return fill <= _MASK_FILL or (_is_float(dtype) and fill <= float(jnp.finfo(dtype).min))


def _merges(split_shape, merged_shape) -> list:
    """Every axis `a` where `merged_shape` is `split_shape` with its axes a
    and a + 1 merged (a reshape that merges two neighbours), in order."""
    i, o = tuple(split_shape), tuple(merged_shape)
    if len(i) != len(o) + 1:
        return []
    return [a for a in range(len(o))
            if i[:a] == o[:a] and i[a + 2:] == o[a + 1:] and i[a] * i[a + 1] == o[a]]


def _merged_axis(split_shape, merged_shape) -> int | None:
    """The axis `a` where `merged_shape` is `split_shape` with its axes a and
    a + 1 merged, the second longer than 1 (a first of size 1: one key/value
    head), else None."""
    found = [a for a in _merges(split_shape, merged_shape) if split_shape[a + 1] > 1]
    whole = [a for a in found if split_shape[a] > 1]
    return (whole or found or [None])[0]


def _repeat(reshape, graph: Graph):
    """`jnp.repeat(x, g, axis)` as jax traces it (a broadcast inserting a
    size-g axis after `axis`, merged into it by a reshape): (axis, g, the
    broadcast equation), or None."""
    bcast = graph.producer(reshape.invars[0]) if C.is_var(reshape.invars[0]) else None
    if bcast is None or bcast.primitive.name != "broadcast_in_dim" or len(bcast.invars) != 1:
        return None
    i = tuple(reshape.invars[0].aval.shape)
    dims = tuple(bcast.params["broadcast_dimensions"])
    src = tuple(bcast.invars[0].aval.shape)
    for a in _merges(i, reshape.outvars[0].aval.shape):
        if dims == tuple(d for d in range(len(i)) if d != a + 1) and src == i[:a + 1] + i[a + 2:]:
            return a, i[a + 1], bcast
    return None


# --------------------------------------------------------------- replacement
def _replay(side: _Side, value):
    for e in side.replay:
        value = e.primitive.bind(value, **e.params)
    return value


def _replacement(plan: _Plan):
    """The function of the plan's operands that computes the attention with
    jax.nn.dot_product_attention, in the root's layout and dtype."""
    sizes = dict(zip(plan.logit_roles, plan.logit_shape))
    batch = [r for r in plan.logit_roles if r not in ("T", "S")]
    heads = plan.heads   # jax.nn's heads axis: these roles merged, the first major
    others = [r for r in batch if r not in heads]
    flat = math.prod(sizes[r] for r in others)
    nb = len(plan.bias)

    def four(value, roles, seq, last):
        here = [r for r in heads if r in roles]  # the keys and values lack the query group
        perm = [roles.index(r) for r in (*others, seq, *here, last)]
        value = jnp.transpose(value, perm)
        n = math.prod(value.shape[len(others) + 1:-1])
        return value.reshape((flat, value.shape[len(others)], n, value.shape[-1]))

    def logits4(value):
        roles = plan.logit_roles
        value = jnp.transpose(value, [roles.index(r) for r in (*others, *heads, "T", "S")])
        lead = value.shape[:len(others)]
        if any(n != 1 for n in lead):
            value = jnp.broadcast_to(value, tuple(sizes[r] for r in others) + value.shape[len(others):])
            b = flat
        else:
            b = 1
        mid = value.shape[len(others):len(others) + len(heads)]
        if any(n != 1 for n in mid) and tuple(mid) != tuple(sizes[r] for r in heads):
            # merged, the head axes are whole, or all 1 (broadcast over every head)
            value = jnp.broadcast_to(value, value.shape[:len(others)] + tuple(sizes[r] for r in heads)
                                     + value.shape[-2:])
        return value.reshape((b, math.prod(value.shape[len(others):-2]), *value.shape[-2:]))

    def attention(*args):
        q, k, v = (_replay(s, a).astype(plan.dtype) for s, a in zip((plan.q, plan.k, plan.v), args))
        q4, k4, v4 = four(q, plan.q.roles, "T", "H"), four(k, plan.k.roles, "S", "H"), \
            four(v, plan.v.roles, "S", "D")
        bias = mask = None
        for t, a in zip(plan.bias, args[3:3 + nb]):
            b = logits4(t.laid_out(a, jnp))
            if t.coefficient != 1.0:
                b = b * jnp.asarray(t.coefficient, b.dtype)
            bias = b if bias is None else bias + b
        for t, a in zip(plan.masks, args[3 + nb:]):
            m = t.laid_out(a, jnp)
            m = logits4(jnp.logical_not(m) if t.negate else m)
            mask = m if mask is None else jnp.logical_and(mask, m)
        platform = target_platform()
        cc, cudnn = _platform_facts(platform)
        with_bias = bias if bias is not None else (
            jax.ShapeDtypeStruct(mask.shape, q4.dtype) if mask is not None else None)
        impl, _ = implementation(q4, k4, v4, bias=with_bias, platform=platform,
                                 compute_capability=cc, cudnn_version=cudnn)
        window = plan.window
        if impl == "cudnn" and window is not None and not (plan.causal and window[1] == 0):
            impl = "xla"  # cuDNN takes only a left window with a causal mask
        out = jax.nn.dot_product_attention(q4, k4, v4, bias=bias, mask=mask, scale=plan.scale,
                                           is_causal=plan.causal, local_window_size=window,
                                           implementation=impl)
        if plan.zero_masked_rows:
            # the program masked the weights again: a query whose keys are all masked
            # gets 0 there, where jax.nn averages the values
            out = out * _rows_kept(mask, plan.causal, window, q4.shape[1], k4.shape[1],
                                   out.dtype)
        shape = tuple(sizes[r] for r in (*others, "T", *heads))
        roles = [*others, "T", *heads]
        out = out.reshape(shape + (out.shape[-1],))
        roles.append("D")
        out = jnp.transpose(out, [roles.index(r) for r in plan.out_roles]).astype(plan.out_dtype)
        for e in plan.post:  # normalized after the contraction: its layout steps to the division
            out = e.primitive.bind(out, **e.params)
        return out if plan.result_dtype is None else out.astype(plan.result_dtype)

    attention.__name__ = attention.__qualname__ = plan.form
    return attention


def _rows_kept(mask, causal: bool, window, t: int, s: int, dtype):
    """[B or 1, T, N or 1, 1]: 1 where a query keeps some key under the mask
    (B, N or 1, T, S), `is_causal` and the window as jax.nn reads them, else 0."""
    keep = jnp.ones((1, 1, t, s), bool) if mask is None else mask
    rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    if causal:
        keep = keep & (cols <= rows)
    if window is not None:
        left, right = window
        keep = keep & (cols >= rows - left) & (cols <= rows + right)
    kept = jnp.any(keep, axis=-1)  # (B, N, T)
    return jnp.transpose(kept, (0, 2, 1))[..., None].astype(dtype)


def _plan_key(plan: _Plan, avals) -> tuple:
    """What the replacement's trace depends on (not the program's atoms)."""
    def side(s):
        return (tuple((e.primitive.name, repr(sorted(e.params.items()))) for e in s.replay),
                repr(s.roles))
    return (repr(plan.logit_roles), plan.logit_shape, repr(plan.out_roles), plan.out_dtype.name,
            plan.dtype.name, plan.scale, tuple((t.view, t.order, t.coefficient) for t in plan.bias),
            tuple((t.view, t.order, t.negate) for t in plan.masks), plan.causal, plan.window,
            repr(plan.heads), plan.form, plan.zero_masked_rows, side(plan.q), side(plan.k),
            side(plan.v), side(_Side(None, plan.post, ())), repr(plan.result_dtype),
            tuple((tuple(a.shape), np.dtype(a.dtype).name) for a in avals), target_platform())


_TRACES = BoundedCache(256)  # traced replacements, per plan and platform


def _traced(plan: _Plan):
    avals = tuple(jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype) for a in plan.operands)
    return _TRACES.get(_plan_key(plan, avals),
                       lambda: jax.make_jaxpr(jax.jit(_replacement(plan)))(*avals))


# ------------------------------------------------------------------ pattern
def _leads_to_transpose(eqn, graph: Graph) -> bool:
    """A result only a transpose reads: the site is matched from there."""
    users = graph.users(eqn.outvars[0])
    return graph.uses(eqn.outvars[0]) == 1 and len(users) == 1 and users[0].primitive.name == "transpose"


def _absorbed(plan: _Plan, graph: Graph) -> tuple:
    """The core equations, and every optional one whose results only they read."""
    taken = {id(e) for e in plan.core}
    operands = {id(a) for a in plan.operands if C.is_var(a)}
    optional, seen = [], set()
    for e in plan.optional:
        if id(e) not in seen and id(e) not in taken:
            seen.add(id(e))
            optional.append(e)
    changed = True
    while changed:
        changed = False
        for e in optional:
            if id(e) in taken or e.effects or any(id(v) in operands for v in e.outvars):
                continue
            if all(C.is_var(v) and not graph.is_output(v)
                   and all(id(u) in taken for u in graph.users(v)) for v in e.outvars):
                taken.add(id(e))
                changed = True
    return (*plan.core, *(e for e in optional if id(e) in taken))


def match(eqn, graph: Graph):
    """The attention whose values' contraction `eqn` ends (or, normalized
    after it, whose division `eqn` is): a `Match` (with the reason in `info`
    where a step differs), or None where `eqn` ends none."""
    if eqn.primitive.name == "div":
        return _match_deferred(eqn, graph)
    if eqn.primitive.name not in ("dot_general", "transpose") or _leads_to_transpose(eqn, graph):
        return None
    c2 = contraction(eqn.outvars[0], graph.producer, lambda a: graph.uses(a) == 1)
    if c2 is None or not any(lab[0] == "c" for lab in c2.labels[0]):
        return None
    if not any(_softmax_nearby(a, graph) is not None for a in c2.operands):
        return None
    if _in_jax_attention(c2.dot):
        return None  # jax.nn.dot_product_attention's own XLA path: the rule's own form
    analysis = _Analysis(eqn, graph)
    try:
        plan = analysis.run()
    except _Miss as miss:
        eqns = tuple({id(e): e for e in (*miss.eqns, *c2.eqns)}.values())
        return Match(root=eqn, eqns=eqns, operands=tuple(c2.operands), spelling=NAME,
                     info={"reason": miss.reason})
    eqns = _absorbed(plan, graph)
    return Match(root=eqn, eqns=eqns, operands=plan.operands,
                 spelling=plan.form + (f" ({plan.details})" if plan.details else ""),
                 info={"plan": plan})


# layout steps between the values' contraction and a division after it, and
# from the sum of the numerators to that division
_POST_VIEWS = frozenset({"transpose", "reshape", "copy", "convert_element_type", "squeeze"})


def _match_deferred(div, graph: Graph):
    """`(exp(x - max) . v) / sum(exp(x - max))` in any layout (MaxText's
    `dot_product` attention, which normalizes after the contraction): the
    division is the site, the softmax's normalization moved before the
    contraction (equal up to rounding)."""
    num, den = div.invars
    post, cur = [], num
    while C.is_var(cur):
        e = graph.producer(cur)
        if e is None or e.primitive.name not in _POST_VIEWS:
            break
        post.insert(0, e)
        cur = e.invars[0]
    # (values the region computes may have other readers: a train step's
    # backward reads them, and the walker matches it with the forward)
    dot = graph.producer(cur) if C.is_var(cur) else None
    if dot is None or dot.primitive.name != "dot_general":
        return None
    if not any(_softmax_nearby(a, graph, find=unnormalized_of) is not None for a in dot.invars):
        return None
    if _in_jax_attention(dot):
        return None
    analysis = _Analysis(dot, graph, deferred=True)
    try:
        plan = analysis.run()
        summed = _normalizer(analysis.softmax, plan, den, post, dot, graph)
    except _Miss as miss:
        eqns = tuple({id(e): e for e in (*miss.eqns, *post, div)}.values())
        return Match(root=div, eqns=eqns, operands=tuple(dot.invars), spelling=NAME,
                     info={"reason": miss.reason})
    plan = dataclasses.replace(
        plan, core=(*plan.core, *post, *summed, div), post=tuple(post),
        result_dtype=np.dtype(div.outvars[0].aval.dtype),
        details=", ".join(filter(None, (plan.details, "normalized after the values' contraction"))))
    return Match(root=div, eqns=_absorbed(plan, graph), operands=plan.operands,
                 spelling=plan.form + f" ({plan.details})", info={"plan": plan})


def _labels(shape, roles) -> list:
    """Each axis as the tuple of (role, size) it holds; () where its size is 1."""
    return [((r, n),) if n != 1 else () for r, n in zip(roles, shape)]


def _carry(labels: list, e):
    """`labels` carried through the layout step `e` (None: an axis broadcast
    over); raises ValueError where the step mixes axes other than by merging
    or splitting whole ones."""
    name, out_shape = e.primitive.name, tuple(e.outvars[0].aval.shape)
    if name in ("convert_element_type", "copy"):
        return labels
    if name == "transpose":
        return [labels[p] for p in e.params["permutation"]]
    if name == "squeeze":
        return [lab for i, lab in enumerate(labels) if i not in e.params["dimensions"]]
    if name == "broadcast_in_dim":
        in_shape, dims = tuple(e.invars[0].aval.shape), tuple(e.params["broadcast_dimensions"])
        out = [() if n == 1 else None for n in out_shape]
        for i, j in enumerate(dims):
            if in_shape[i] == out_shape[j]:
                out[j] = labels[i]
        return out
    if name == "reshape" and e.params.get("dimensions") is None:
        if any(lab is None for lab in labels):
            raise ValueError("reshapes an axis broadcast over")
        atoms = [a for lab in labels for a in lab]
        out = []
        for n in out_shape:
            taken, size = [], 1
            while size < n and atoms:
                taken.append(atoms.pop(0))
                size *= taken[-1][1]
            if size != n:
                raise ValueError("splits an axis")
            out.append(tuple(taken))
        if atoms:
            raise ValueError("drops an axis")
        return out
    raise ValueError(f"`{name}` is not a layout step")


def _normalizer(sm: _Softmax, plan: _Plan, den, post, dot, graph: Graph) -> list:
    """The equations computing `den` as the sum of the softmax's numerators
    over its axis, laid out as the division by it needs: every axis of the
    contraction's result but the values' own (`D`) holding the same rows.
    Raises `_Miss` naming the step that differs."""
    exp = sm.eqns[0]
    chain, cur = [], den
    while True:
        e = graph.producer(cur) if C.is_var(cur) else None
        if e is None:
            raise _Miss(SOFTMAX(why="is divided after the values' contraction by something other "
                                    "than the sum of its exponentials"), [exp])
        if e.primitive.name == "reduce_sum":
            break
        if e.primitive.name not in _POST_VIEWS | {"broadcast_in_dim"} or len(e.invars) != 1:
            raise _Miss(STEP(culprit=e.primitive.name, where="in the division after the values' "
                             "contraction", why="not a step of the softmax's sum"), [exp, e])
        chain.insert(0, e)
        cur = e.invars[0]
    summed, widened = _through(e.invars[0], graph, ("convert_element_type",))
    if summed is not exp.outvars[0] or tuple(e.params["axes"]) != (sm.axis,):
        raise _Miss(SOFTMAX(why="is divided after the values' contraction by a sum of other "
                                "values or over another axis than its maximum's"), [exp, e])
    rows = [r for i, r in enumerate(plan.logit_roles) if i != sm.axis]
    shape = [n for i, n in enumerate(plan.logit_shape) if i != sm.axis]
    numerator = _labels(tuple(dot.outvars[0].aval.shape), plan.out_roles)
    try:
        labels = _labels(tuple(shape), rows)
        for step in chain:
            labels = _carry(labels, step)
        for step in post:
            numerator = _carry(numerator, step)
    except ValueError as err:
        raise _Miss(LAYOUT(why=f"the division after the values' contraction {err}"),
                    [exp, e]) from None
    values = [lab for lab in numerator if any(a[0] == "D" for a in lab)]
    # (the sum broadcast over the values' axis: by broadcast_in_dim, or by
    # the division itself where jax's lax ops broadcast size-1 axes)
    paired = all(d == n or (d is None or d == ()) and n in values and len(n) == 1
                 for d, n in zip(labels, numerator))
    if len(labels) != len(numerator) or not paired:
        raise _Miss(LAYOUT(why="the division after the values' contraction pairs other rows "
                               "than the softmax's sums"), [exp, e])
    return [e, *widened, *chain]


def check(m: Match, graph: Graph):
    return m.info.get("reason")


def build(m: Match, graph: Graph):
    closed = _traced(m.info["plan"])
    (call,) = closed.jaxpr.eqns
    env = {id(v): a for v, a in zip(closed.jaxpr.invars, m.operands)}
    invars = [env.get(id(a), a) if C.is_var(a) else a for a in call.invars]
    return [C.new_eqn(invars, list(m.outputs), call.primitive, call.params, like=m.root)]


# ---------------------------------------------------------------------- cost
def _shapes(plan: _Plan):
    """(q, k, v) avals as jax.nn reads them: (B, T, N, H), (B, S, K, H), (B, S, K, D)."""
    sizes = dict(zip(plan.logit_roles, plan.logit_shape))
    batch = [r for r in plan.logit_roles if r not in ("T", "S")]
    heads = plan.heads
    b = math.prod(sizes[r] for r in batch if r not in heads)
    n = math.prod(sizes[r] for r in heads)
    kv = math.prod(_axis_size(plan.k, r) for r in heads if r in plan.k.roles)
    h = _axis_size(plan.q, "H")
    d = _axis_size(plan.v, "D")
    t, s = sizes["T"], sizes["S"]
    return (jax.ShapeDtypeStruct((b, t, n, h), plan.dtype), jax.ShapeDtypeStruct((b, s, kv, h), plan.dtype),
            jax.ShapeDtypeStruct((b, s, kv, d), plan.dtype))


def _axis_size(side: _Side, role) -> int:
    shape = jax.eval_shape(lambda x: _replay(side, x),
                           jax.ShapeDtypeStruct(side.src.aval.shape, side.src.aval.dtype)).shape
    return int(shape[side.roles.index(role)])


# Measured on a 2-core x86 CPU (jax 0.10.2; benchmarks/probes/attention_cost.py,
# benchmarks/results/cpu-attention-cost-2026-12-04.json, and the HF BERT-base
# workloads' compiled memory): jax.nn's XLA path against the hand-written form
# HF runs, 12 heads of 64, a padding mask. In float32 it takes about half the
# time at up to 128 keys, and the whole encoder holds less temp (25 MB against
# 31 MB at 8 x 128); jax.nn holds about twice the float32 logits as temp, so
# from 256 keys the attention alone holds 2.7x (4 x 256), the encoder 8% more,
# and at 512 keys it loses time too (1.6x, 5x the temp). At 16 bits it loses
# everywhere: its softmax runs in float32.
CPU_MAX_KEYS = 128
"""The longest key sequence for which jax.nn's attention is measured to win on
CPU (float32), in time and memory; longer ones are declined for cost."""


def cost(m: Match, graph) -> Reason | None:
    """`policy="auto"`'s decision for one attention site: on an NVIDIA GPU,
    apply where cuDNN's fused kernel runs it (16-bit, a head size that is a
    multiple of 8, ...: `implementation`); on CPU, where jax.nn's XLA path is
    measured to win (float32, at most `CPU_MAX_KEYS` keys); elsewhere decline."""
    plan = m.info.get("plan")
    if plan is None:
        return None
    platform = target_platform()
    q, k, v = _shapes(plan)
    if platform in ("cuda", "gpu"):
        cc, cudnn = _platform_facts(platform)
        bias = jax.ShapeDtypeStruct((1,), plan.dtype) if (plan.bias or plan.masks) else None
        impl, why = implementation(q, k, v, bias=bias, platform=platform, compute_capability=cc,
                                   cudnn_version=cudnn)
        if impl == "cudnn" and plan.window is not None and not (plan.causal and plan.window[1] == 0):
            impl, why = "xla", f"window {plan.window}: cuDNN takes only a left window with a causal mask"
        if impl != "cudnn":
            return COST(why=f"on a GPU jax.nn's attention pays only as cuDNN's fused kernel, "
                            f"which this one cannot take ({why})")
        return None
    if platform == "cpu":
        if plan.dtype != np.float32:
            return COST(why=f"{plan.dtype.name} on CPU: jax.nn's attention runs its softmax in "
                            f"float32, measured 1.1-1.8x slower with 1.4-7x the temp bytes")
        if k.shape[1] > CPU_MAX_KEYS:
            return COST(why=f"{k.shape[1]} keys on CPU: jax.nn's attention holds about twice the "
                            f"float32 logits as temp, measured to raise the program's memory from "
                            f"256 keys and its time from 512 (it wins up to {CPU_MAX_KEYS})")
        return None
    return COST(why=f"{platform}: jax.nn's attention is not measured against the hand-written "
                    f"form here")


ATTENTION = Pattern(
    NAME, match, check, build, roots=frozenset({"dot_general", "transpose", "div"}),
    doc="softmax(scale * q.k + bias [masked]) . v -> jax.nn.dot_product_attention",
    needs=frozenset({"dot_general", "exp", "reduce_sum", "div"}), cost=cost,
    replacement=lambda m: _replacement(m.info["plan"]))


def rules() -> list:
    """The attention rule, as a list to pass to `optimize(patterns=...)`.

    One pattern, named "attention": every softmax between two contractions
    it can prove to be `softmax(scale * q.k + bias [masked]) . v` is replaced
    by `jax.nn.dot_product_attention` (the module docstring lists the
    canonical forms it reads through). Each site's spelling names its form as
    the shipped forms were named (`attention`, `attention_masked`,
    `attention_bias_masked`, `attention_logits_scaled`,
    `attention_float32_softmax`, ...), and the replacement's `jit` carries that
    name. A softmax between two contractions that differs in a step is
    declined with that step named. Under `policy="auto"` each site is a cost
    decision (`cost`); under "always" every safe site is replaced."""
    return [ATTENTION]
