"""The cross-entropy of a linear head, chunked over tokens so that the
[tokens, vocabulary] logits never exist whole.

    fast_step = jaxfuse.optimize(train_step, patterns=jaxfuse.rules.cross_entropy.rules())

A language model's train step spends most of its memory on the logits: `x @ W`
is [tokens, V] in float32, and so are the log-softmax and its gradient. This
rule finds the head's contraction and everything the loss computes from it
row by row, and evaluates that region over chunks of tokens: each chunk runs
the program's own equations at the chunk's shape, so values agree with jit's
within float32 rounding (the sums over tokens are added chunk by chunk).

What it matches is the computation, not a spelling (jaxfuse/rules/_chunking.py
has the analysis): a head `x @ W [+ b]` or a tied embedding `x @ E.T` (flax's
`Embed.attend`, GPT-2's shared kernel) with any batch and sequence axes and a
shifted slice (`logits[:, :-1]`); a log-sum-exp over the vocabulary
(`jax.nn.log_softmax`, `jax.nn.logsumexp`, optax's
`softmax_cross_entropy_with_integer_labels`, `softmax_cross_entropy` of a
`one_hot`, whose one-hot is built per chunk and never materialised) with a
label taken at integer indices (`take_along_axis`, a one-hot's `==`), in any
dtype (a bfloat16 head upcast to float32); reduced however the program likes
(mean, sum, a padding mask's weighted sum over its count, ignore-index labels
such as -100): the per-token values leave the loop and the program reduces
them itself.

Two ways to get the gradient, chosen by what the program holds:

  * A train step traced with its gradient (`jax.value_and_grad` inside the
    optimized function) already holds the backward rows `dZ` and the two
    contractions `dZ @ W.T`, `x.T @ dZ`: they are part of the region, so one
    pass over the chunks computes the loss's rows and the gradients of `x`
    and `W` together (Liger Kernel's way: no logits recomputed).
  * A loss differentiated outside the optimized function gets the pass's own
    `custom_vjp`: the backward runs each chunk's `jax.vjp` again, recomputing
    its logits (Cut Cross-Entropy's way: nothing [tokens, V] kept between the
    passes, one more head contraction). The same recompute serves a loss whose
    gradient needs a value computed across tokens of the logits (two passes).

benchmarks/results/notes/2026-12-04-cross-entropy.md has the measurements the
choice of chunk size and the trade-off rest on.

The rule declines, with the reason `explain` shows, where the logits (or any
[tokens, V] value of the loss) have another reader: returned, read by an
operation that mixes tokens or by code outside the loss; where the labels are
floats (a dense [tokens, V] target from outside); and where no integer label
is taken.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

import jax

from .. import _compat as C
from .._reasons import Bytes, ReasonKind
from ..fusion.match.patterns import Match, Pattern
from . import _chunking as K
from . import _sharded as S

NAME = "cross_entropy"

NO_LABEL = ReasonKind(
    "xent-no-label",
    "a log-sum-exp over the vocabulary, but no label is taken at integer indices "
    "(the rule matches cross-entropy at integer labels)")
FITS_ONE_CHUNK = ReasonKind(
    "xent-fits-one-chunk",
    "the logits' rows ({bytes} for {tokens} tokens x {vocab}) fit one chunk of the "
    "{budget} budget: chunking cannot save memory")
SHARDED_FORWARD = ReasonKind(
    "xent-sharded-forward",
    "over a mesh of {devices} devices, a loss without its gradient in the program: its "
    "gradient, taken outside the optimized function, would sum the head weight's gradient "
    "across devices once per chunk (a train step traced with its gradient runs per device)")
TOO_NARROW = ReasonKind(
    "xent-too-narrow",
    "a vocabulary of {vocab} is too narrow for chunking to pay (at least {least})")

# The most vocabulary-wide rows one chunk's pass holds at once, as XLA fuses
# it: the head's output, its float32 copy (a bfloat16 head), the exponentials
# and the gradient's rows (benchmarks/results/notes/2026-12-04-cross-entropy.md).
ROWS_LIVE = 4
# Smallest vocabulary worth chunking (below it the logits are a few bytes per token).
LEAST_VOCAB = 256
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Budget:
    """How large a chunk may be: its vocabulary-wide rows hold at most
    `bytes` (None: `weights` times the head weight's bytes, within [`least`,
    `most`]).

    Each chunk reads the whole head weight and adds to the whole of its
    gradient, so the number of chunks sets the traffic and the chunk's rows
    set the memory. A train step already holds the weight and its gradient:
    rows worth twice the weight keep what the loss adds to that order, while
    each chunk's contraction sees H / 2 token rows (H the hidden width). On
    the issue's Llama (2-core CPU) a budget of the weight's size or twice it
    held 0.26x jit's temp at 32000 words and 0.13-0.15x at 128256, and took
    0.80-0.85x and 0.73-0.77x jit's time; a quarter of it, 1.15-1.4x (the
    weight re-read by many small chunks); see
    benchmarks/results/notes/2026-12-04-cross-entropy.md."""

    bytes: int | None = None
    weights: float = 2.0
    least: int = 8 * MIB
    most: int = 256 * MIB

    def for_head(self, weight_bytes: int) -> int:
        if self.bytes is not None:
            return int(self.bytes)
        return int(min(max(self.weights * weight_bytes, self.least), self.most))


DEFAULT_BUDGET = Budget()


def rules(budget: Budget | int | None = None) -> list:
    """The cross-entropy rules (one): pass them to `optimize(patterns=...)`.
    `budget`: a `Budget`, or the bytes a chunk's vocabulary-wide rows may hold.

    Under `policy="auto"` a site is declined for cost where chunking cannot
    save memory (`cannot_pay`) or, over a mesh, where the program does not hold
    the loss's gradient (its gradient would communicate per chunk), and then,
    like every rewrite, where the compiled program would peak above jit's plus
    the slack; "always" applies every safe site. Over a mesh, a train step's
    region runs on each device's shards (`_sharded.py`), keeping the
    collectives of jit's program."""
    if budget is None:
        budget = DEFAULT_BUDGET
    elif isinstance(budget, (int, np.integer)):
        if budget <= 0:
            raise ValueError(f"cross_entropy.rules: budget must be a positive number of bytes, "
                             f"got {budget}")
        budget = Budget(bytes=int(budget))
    elif not isinstance(budget, Budget):
        raise TypeError(f"cross_entropy.rules: budget must be a Budget or bytes, got {budget!r}")
    site = _Site(budget)
    return [Pattern(NAME, site.match, site.check, site.build, roots={"dot_general"},
                    doc="a linear head's cross-entropy, chunked over tokens",
                    needs=frozenset({"dot_general", "exp"}),
                    cost=lambda m, graph: cannot_pay(m, budget))]


# ----------------------------------------------------------------- the site
def _head_candidate(eqn, graph) -> bool:
    """A contraction of hidden states [tokens..., H] with a weight [H, V] or
    [V, H] (no batch dimensions), whose result reaches an `exp` and a
    reduction over its last axis within a few steps: a head under a softmax."""
    if eqn.primitive.name != "dot_general" or len(eqn.invars) != 2:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    ls, rs = K._shape(lhs), K._shape(rhs)
    if lb or rb or len(rs) != 2 or len(ls) < 2 or len(lc) != 1 or len(rc) != 1:
        return False
    if lc[0] != len(ls) - 1:
        return False
    out = eqn.outvars[0]
    v = K._shape(out)[-1]
    if v != rs[1 - rc[0]]:
        return False
    return graph.cached(("xent-softmax-below", id(eqn)), lambda: _softmax_below(out, graph, v))


def _softmax_below(z, graph, vocab, depth=10) -> bool:
    seen_exp = seen_reduce = False
    frontier, seen = [z], set()
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for u in graph.users(v):
                if id(u) in seen:
                    continue
                seen.add(id(u))
                name = u.primitive.name
                shape = K._shape(u.invars[0]) if u.invars else ()
                if name == "exp" and shape and shape[-1] == vocab:
                    seen_exp = True
                if name in ("reduce_max", "reduce_sum") and shape and shape[-1] == vocab \
                        and len(shape) - 1 in tuple(u.params["axes"]):
                    seen_reduce = True
                if seen_exp and seen_reduce:
                    return True
                nxt.extend(o for o in u.outvars if K._shape(o)[-1:] == (vocab,))
        frontier = nxt
        if not frontier:
            break
    return False


class _Site:
    def __init__(self, budget: Budget):
        self.budget = budget

    def match(self, eqn, graph):
        if not _head_candidate(eqn, graph):
            return None
        try:
            plan = K.analyse(graph, eqn)
            reason = _not_cross_entropy(plan)
        except K.Decline as err:
            return Match(root=eqn, eqns=(eqn,), operands=tuple(eqn.invars),
                         spelling="linear head + softmax", info={"reason": err.reason})
        if reason is not None:
            return Match(root=eqn, eqns=(eqn,), operands=tuple(eqn.invars),
                         spelling="linear head + softmax", info={"reason": reason})
        return Match(root=eqn, eqns=tuple(plan.absorbed), operands=tuple(plan.operands),
                     spelling=_spelling(plan, graph), outputs=tuple(plan.outputs),
                     info={"plan": plan, "piece": piece_size(plan, self.budget), "built": {}})

    def check(self, m: Match, graph):
        reason = m.info.get("reason")
        if reason is not None:
            return reason
        try:
            self._traced(m)
        except K.Decline as err:
            return err.reason
        return None

    def _traced(self, m: Match):
        built = m.info["built"]
        if "closed" not in built:
            plan = m.info["plan"]
            fn = K.build_function(plan, m.info["piece"])
            if S.wanted(plan):  # a train step over a mesh: each device runs its shards
                fn = S.partitioned(plan, fn, lambda local: piece_size(local, self.budget))

            def cross_entropy(*operands):
                return fn(*operands)

            avals = [jax.ShapeDtypeStruct(K._shape(a), K._dtype(a)) for a in plan.operands]
            built["closed"] = jax.make_jaxpr(jax.jit(cross_entropy))(*avals)
        return built["closed"]

    def build(self, m: Match, graph):
        closed = self._traced(m)
        (call,) = closed.jaxpr.eqns
        env = {id(v): a for v, a in zip(closed.jaxpr.invars, m.operands)}
        invars = [env.get(id(a), a) if C.is_var(a) else a for a in call.invars]
        if any(C.is_var(a) and a in closed.jaxpr.invars for a in invars):  # pragma: no cover
            raise ValueError("cross_entropy: the replacement reads a value it was not given")
        params = {**call.params, "name": NAME} if "name" in call.params else call.params
        return [C.new_eqn(invars, list(m.outputs), call.primitive, params, like=m.root)]


def _not_cross_entropy(plan: K.Plan):
    """Why the region is not a cross-entropy at integer labels, or None."""
    lse = label = False
    for e in plan.in_loop:
        name = e.primitive.name
        if name == "exp" and plan.vocab_wide(e.invars[0]):
            lse = True
        if name in ("gather", *K.SCATTERS):
            idx = e.invars[1]
            operand = e.invars[0]
            if plan.vocab_wide(operand) and np.issubdtype(K._dtype(idx), np.integer):
                label = True
        if name in ("eq", "ne") and plan.vocab_wide(e.outvars[0]) and all(
                np.issubdtype(K._dtype(a), np.integer) for a in e.invars):
            label = True
    if not lse:
        return K.NOT_CROSS_ENTROPY(text="no log-sum-exp over the vocabulary reads the head")
    if not label:
        return NO_LABEL()
    return None


def _spelling(plan: K.Plan, graph) -> str:
    names = []
    for e in plan.in_loop:
        n = graph.inlined_from(e)
        if n and n not in names and not n.startswith("_where"):
            names.append(n.lstrip("_"))
    grad = any(e.primitive.name == "dot_general" for e in plan.partial)
    what = "cross-entropy" + (f" ({', '.join(names)})" if names else "")
    return what + (" + gradient" if grad else "")


# ------------------------------------------------------------ chunk sizing
def _facts(plan: K.Plan) -> dict:
    head = plan.head
    x, w = head.invars
    hidden = K._shape(x)[-1]
    tokens = plan.size * plan.token_elems
    itemsize = max([np.dtype(K._dtype(v)).itemsize for e in plan.in_loop for v in e.outvars
                    if plan.vocab_wide(v)] or [4])
    # one device's share under a mesh (plan.layout): its tokens, vocabulary and weight
    return {"tokens": tokens, "vocab": plan.vocab, "hidden": hidden,
            "row_bytes": plan.vocab * itemsize,
            "weight_bytes": int(np.prod(plan.local_shape(w))) * np.dtype(K._dtype(w)).itemsize}


def piece_size(plan: K.Plan, budget: Budget = DEFAULT_BUDGET) -> int:
    """Positions of the chunk axis per chunk: as many token rows as fit the
    budget with `ROWS_LIVE` vocabulary-wide rows each (at least one position;
    the chunks are balanced so the last is not a sliver)."""
    f = _facts(plan)
    limit = budget.for_head(f["weight_bytes"])
    rows = max(1, limit // (ROWS_LIVE * f["row_bytes"]))
    per = max(1, rows // plan.token_elems)
    per = min(per, plan.size)
    # A divisor of the axis within a factor of two spares the loop a last,
    # smaller chunk (compiled apart, with buffers of its own).
    for d in range(per, max(1, per // 2) - 1, -1):
        if plan.size % d == 0:
            return d
    chunks = math.ceil(plan.size / per)
    return math.ceil(plan.size / chunks)


def cannot_pay(m: Match, budget: Budget = DEFAULT_BUDGET):
    """A static reason the site cannot pay, for the cost hook of `policy="auto"`
    (None: chunking saves memory). Cheap: reads the match's shapes only."""
    plan = m.info.get("plan")
    if plan is None:
        return None
    devices = S.mesh_size(plan)
    if devices > 1 and not S.holds_its_gradient(plan):
        return SHARDED_FORWARD(devices=devices)
    f = _facts(plan)
    if f["vocab"] < LEAST_VOCAB:
        return TOO_NARROW(vocab=f["vocab"], least=LEAST_VOCAB)
    limit = budget.for_head(f["weight_bytes"])
    held = ROWS_LIVE * f["row_bytes"] * f["tokens"]
    if held <= limit:
        return FITS_ONE_CHUNK(bytes=Bytes(held), tokens=f["tokens"], vocab=f["vocab"],
                              budget=Bytes(limit))
    return None


__all__ = ["rules", "Budget", "DEFAULT_BUDGET", "piece_size", "cannot_pay", "NAME"]
