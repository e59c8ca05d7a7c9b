"""jaxfuse.rules.cross_entropy: a linear head's cross-entropy, chunked over
tokens, in HF transformers' Flax Llama and GPT-2 train steps and in the
spellings optax and hand-written losses use; values and gradients against
jax.jit of the unrewritten program, temp bytes lower, near misses declined
with their reasons."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns

optax = pytest.importorskip("optax", reason="needs the `models` extra (optax)")
pytest.importorskip("flax", reason="needs the `models` extra (flax)")

from jaxfuse.rules import cross_entropy as X  # noqa: E402

V = 1000
# about four token rows a chunk at V = 1000 in float32: many chunks, a remainder
SMALL = X.rules(budget=X.ROWS_LIVE * 4 * V * 4)


def fused(fun, *args, rules=SMALL) -> int:
    closed = jax.make_jaxpr(jaxfuse.optimize(fun, patterns=rules, policy="always"))(*args)
    return sum(e.params.get("name") == X.NAME for e in all_eqns(closed))


def close(got, want, rtol=1e-4, floor=0.1):
    """Within float32 rounding: `rtol` of each value, or `floor` x `rtol` of the
    leaf's largest (an element near zero in a gradient)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=False):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = np.max(np.abs(w[np.isfinite(w)]), initial=0.0)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * floor * scale, equal_nan=True)


class Compared:
    """`fun` compiled by jit and by `optimize` (once each): results, temp
    bytes, and how many sites the rule replaced."""

    def __init__(self, fun, *args, rules=SMALL):
        traced = jaxfuse.optimize(fun, patterns=rules, policy="always").trace(*args)
        self.sites = sum(e.params.get("name") == X.NAME for e in all_eqns(traced.jaxpr))
        opt = traced.lower().compile()
        ref = jax.jit(fun).lower(*args).compile()
        self.got, self.want = opt(*args), ref(*args)
        self.temp = opt.memory_analysis().temp_size_in_bytes
        self.jit_temp = ref.memory_analysis().temp_size_in_bytes


def check(fun, *args, rules=SMALL, loss_rtol=1e-5, rtol=1e-4, floor=0.1) -> Compared:
    """The optimized program replaces one site and gives jit's values (a
    (loss, gradients) pair: the loss within `loss_rtol`)."""
    c = Compared(fun, *args, rules=rules)
    assert c.sites == 1
    if isinstance(c.want, tuple) and len(c.want) == 2 and np.ndim(c.want[0]) == 0:
        close(c.got[0], c.want[0], rtol=loss_rtol)
        close(c.got[1], c.want[1], rtol=rtol, floor=floor)
    else:
        close(c.got, c.want, rtol=rtol, floor=floor)
    return c


# ------------------------------------------------------------------ models
def _llama(dtype=jnp.float32):
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FlaxLlamaForCausalLM(cfg, seed=0, dtype=dtype)


def _gpt2(dtype=jnp.float32):
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FlaxGPT2LMHeadModel(cfg, seed=0, dtype=dtype)


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("transformers", reason="needs the `hf` extra (transformers)")
    return _llama()


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers", reason="needs the `hf` extra (transformers)")
    return _gpt2()


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, V, (2, 17)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 17)) > 0.3, jnp.int32)
    return ids, mask


def _onehot(labels, n):
    from flax.training.common_utils import onehot
    return onehot(labels, n)


# The losses as the libraries and examples spell them (run_clm_flax:
# a one-hot and optax.softmax_cross_entropy; run_mlm_flax: a label mask).
LOSSES = {
    "integer": lambda lg, ids, mask: optax.softmax_cross_entropy_with_integer_labels(
        lg[:, :-1], ids[:, 1:]).mean(),
    "one_hot": lambda lg, ids, mask: optax.softmax_cross_entropy(
        lg[..., :-1, :], _onehot(ids[..., 1:], lg.shape[-1])).mean(),
    "padding_mask": lambda lg, ids, mask: (optax.softmax_cross_entropy_with_integer_labels(
        lg[:, :-1], ids[:, 1:]) * mask[:, 1:]).sum() / mask[:, 1:].sum(),
    "ignore_index": lambda lg, ids, mask: _ignore_index(lg, jnp.where(mask > 0, ids, -100)),
}


def _ignore_index(lg, labels):
    labels = labels[:, 1:]
    keep = labels != -100
    nll = optax.softmax_cross_entropy_with_integer_labels(lg[:, :-1], jnp.where(keep, labels, 0))
    return jnp.sum(nll * keep) / jnp.sum(keep)


def _step(model, spelling, f32=False):
    def loss(params, ids, mask):
        logits = model(ids, params=params).logits
        if f32:
            logits = logits.astype(jnp.float32)
        return LOSSES[spelling](logits, ids, mask)
    return loss


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("spelling", list(LOSSES))
def test_llama_train_step(llama, batch, spelling):
    ids, mask = batch
    c = check(jax.value_and_grad(_step(llama, spelling)), llama.params, ids, mask)
    assert c.temp < c.jit_temp


@pytest.mark.parametrize("spelling", ["integer", "one_hot"])
def test_gpt2_tied_head(gpt2, batch, spelling):
    """GPT-2's head is its token embedding, transposed: the head's gradient
    (accumulated over chunks) joins the embedding's own."""
    ids, mask = batch
    c = check(jax.value_and_grad(_step(gpt2, spelling)), gpt2.params, ids, mask)
    assert c.temp < c.jit_temp


def test_grad_value_and_grad_and_a_gradient_taken_outside(llama, batch):
    ids, mask = batch
    loss = _step(llama, "padding_mask")
    check(jax.grad(loss), llama.params, ids, mask)
    # optimize(loss) differentiated outside: the rule's own custom_vjp (the
    # backward recomputes each chunk's logits)
    opt = jaxfuse.optimize(loss, patterns=SMALL, policy="always")
    assert fused(loss, llama.params, ids, mask) == 1
    close(jax.value_and_grad(opt)(llama.params, ids, mask),
          jax.jit(jax.value_and_grad(loss))(llama.params, ids, mask))


def test_vmap_of_the_loss(llama, batch):
    ids, mask = batch

    def per_example(params, ids):
        logits = llama(ids[None], params=params).logits[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:-1], ids[1:]).mean()

    def loss(params, ids):
        return jax.vmap(per_example, in_axes=(None, 0))(params, ids).mean()

    check(jax.value_and_grad(loss), llama.params, ids)
    # the optimized loss itself under vmap, and its gradient under vmap
    opt = jaxfuse.optimize(per_example, patterns=SMALL, policy="always")
    close(jax.vmap(opt, in_axes=(None, 0))(llama.params, ids),
          jax.vmap(jax.jit(per_example), in_axes=(None, 0))(llama.params, ids))
    close(jax.vmap(jax.grad(opt), in_axes=(None, 0))(llama.params, ids),
          jax.jit(jax.vmap(jax.grad(per_example), in_axes=(None, 0)))(llama.params, ids))


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_bfloat16_params_with_a_float32_loss(batch, model):
    """A bfloat16 head upcast to float32 for the loss: the chunks' shares of
    the weight's gradient add in float32 and round once, as XLA's single
    contraction does, so the gradients are jit's, inside the loop and in the
    rule's own backward alike."""
    pytest.importorskip("transformers", reason="needs the `hf` extra (transformers)")
    ids, mask = batch
    m = (_llama if model == "llama" else _gpt2)(jnp.bfloat16)
    params = m.to_bf16(m.params)
    loss = _step(m, "padding_mask", f32=True)
    bf16_ulp = 2.0 ** -7
    # jit's own bfloat16 contraction over the tokens is one sum rounded once on jax 0.10
    # (the rule's gradients were bit for bit jit's there); XLA 0.12 rounds partial sums of
    # it, so an element where the terms cancel differs by a bfloat16 ulp of the sum's largest
    # terms: one ulp of the leaf's largest value
    if model == "gpt2":  # the gradient in the program: the loop's own sums
        check(jax.value_and_grad(loss), params, ids, mask, rtol=bf16_ulp, loss_rtol=bf16_ulp,
              floor=1.0)
    else:  # the gradient taken outside: the rule's backward
        close(jax.grad(jaxfuse.optimize(loss, patterns=SMALL, policy="always"))(params, ids, mask),
              jax.jit(jax.grad(loss))(params, ids, mask), rtol=bf16_ulp, floor=1.0)


# --------------------------------------------------------- a plain head
def _head(rng, b=3, s=11, h=16, v=300, dtype=jnp.float32):
    x = jnp.asarray(rng.standard_normal((b, s, h)), dtype)
    w = jnp.asarray(rng.standard_normal((h, v)) / np.sqrt(h), dtype)
    ids = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    return x, w, ids


def _plain_rules(v=300):
    return X.rules(budget=X.ROWS_LIVE * 4 * v * 4)


SPELLINGS = {
    "log_softmax_take_along_axis": lambda lg, y: -jnp.mean(
        jnp.take_along_axis(jax.nn.log_softmax(lg), y[..., None], axis=-1)),
    "logsumexp_minus_take": lambda lg, y: jnp.sum(
        jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, y[..., None], -1)[..., 0]),
    "one_hot_times_log_softmax": lambda lg, y: -jnp.sum(
        jax.nn.one_hot(y, lg.shape[-1]) * jax.nn.log_softmax(lg)) / y.size,
    "smoothed_labels": lambda lg, y: optax.softmax_cross_entropy(
        lg, optax.smooth_labels(jax.nn.one_hot(y, lg.shape[-1]), 0.1)).mean(),
    # Gemma 2's final soft cap: its gradient's `one_minus_square` (jax 0.12.1's
    # tanh derivative) is elementwise like any other
    "soft_capped": lambda lg, y: optax.softmax_cross_entropy_with_integer_labels(
        30.0 * jnp.tanh(lg / 30.0), y).mean(),
    "z_loss_and_accuracy": lambda lg, y: (
        optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()
        + 1e-4 * jnp.mean(jax.nn.logsumexp(lg, -1) ** 2),
        jnp.mean(jnp.argmax(lg, -1) == y)),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_hand_written_spellings(rng, spelling):
    """Each spelling, with and without the gradient in the program, a shifted
    slice, a bias. An accuracy's argmax reads the logits row by row: it goes
    into the loop too."""
    x, w, ids = _head(rng)
    b = jnp.asarray(rng.standard_normal(w.shape[1]), jnp.float32)
    loss_fn = SPELLINGS[spelling]

    def loss(x, w, b, ids):
        out = loss_fn((x @ w + b)[:, :-1], ids[:, 1:])
        return out if isinstance(out, tuple) else (out, jnp.zeros(()))

    rules = _plain_rules()
    check(loss, x, w, b, ids, rules=rules)
    check(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), x, w, b, ids, rules=rules)


def test_tied_embeddings_as_flax_attends(rng):
    """flax's `Embed.attend` (`x @ E.T`) as the head, the embedding also the
    input lookup: its gradient has both parts."""
    import flax.linen as nn

    class LM(nn.Module):
        @nn.compact
        def __call__(self, ids):
            emb = nn.Embed(300, 16)
            h = nn.Dense(16)(emb(ids))
            return emb.attend(jnp.tanh(h))

    ids = jnp.asarray(rng.integers(0, 300, (3, 10)), jnp.int32)
    model = LM()
    params = model.init(jax.random.PRNGKey(0), ids)

    def loss(params, ids):
        logits = model.apply(params, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    check(jax.value_and_grad(loss), params, ids, rules=_plain_rules())


@pytest.mark.parametrize("shape,sl", [((23, 16), slice(None)), ((2, 3, 13, 16), slice(1, None)),
                                      ((1, 7, 16), slice(2, -3))])
def test_token_layouts_and_slices(rng, shape, sl):
    """No batch axis, two batch axes, a slice at either end; chunks that do
    not divide the axis."""
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 300)) / 4, jnp.float32)
    ids = jnp.asarray(rng.integers(0, 300, shape[:-1]), jnp.int32)

    def loss(x, w, ids):
        lg = x @ w
        return optax.softmax_cross_entropy_with_integer_labels(lg[..., sl, :], ids[..., sl]).sum()

    rules = X.rules(budget=X.ROWS_LIVE * 3 * 300 * 4)  # chunks of three rows
    check(loss, x, w, ids, rules=rules)
    check(jax.value_and_grad(loss, argnums=(0, 1)), x, w, ids, rules=rules)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.int32])
def test_label_dtypes(rng, dtype):
    x, w, _ = _head(rng, v=120)
    ids = jnp.asarray(rng.integers(0, 120, x.shape[:2]), dtype)

    def loss(x, w, ids):
        return optax.softmax_cross_entropy_with_integer_labels((x @ w)[:, :-1], ids[:, 1:]).mean()

    check(jax.value_and_grad(loss, argnums=(0, 1)), x, w, ids, rules=_plain_rules(120))


def test_non_finite_values_and_out_of_range_labels(rng):
    """NaN and inf in the hidden states (at a kept token and at the one the
    shift drops, whose zero gradient rows still meet them), a row of -inf
    logits, labels out of range (take_along_axis fills NaN, a one-hot is all
    zero): the rewritten program gives jit's values, NaN where jit's has NaN."""
    x, w, ids = _head(rng)
    x = x.at[0, 3, :].set(jnp.nan).at[1, -1, 2].set(jnp.inf).at[2, 4, :].set(-jnp.inf)
    ids = ids.at[0, 5].set(-100).at[1, 2].set(300).at[2, 7].set(-3)

    def gather_loss(x, w, ids):
        return optax.softmax_cross_entropy_with_integer_labels((x @ w)[:, :-1], ids[:, 1:])

    def onehot_loss(x, w, ids):
        lg = (x @ w)[:, :-1]
        return optax.softmax_cross_entropy(lg, jax.nn.one_hot(ids[:, 1:], lg.shape[-1]))

    rules = _plain_rules()
    for f in (gather_loss, onehot_loss):
        check(f, x, w, ids, rules=rules)

        def summed(x, w, ids, f=f):
            return jnp.nansum(f(x, w, ids))

        check(jax.grad(summed, argnums=(0, 1)), x, w, ids, rules=rules)


# ------------------------------------------------------------- near misses
def _reasons(fun, *args, rules=SMALL):
    rep = jaxfuse.explain(jaxfuse.optimize(fun, patterns=rules, policy="always"), *args)
    return [(s.fused, s.why.code, str(s.why)) for s in rep.sites
            if s.pattern == X.NAME]


def test_near_misses_are_declined_with_their_reasons(rng):
    x, w, ids = _head(rng)
    soft = jax.nn.softmax(jnp.asarray(rng.standard_normal((3, 10, 300)), jnp.float32))
    rules = _plain_rules()

    def returned(x, w, ids):
        lg = x @ w
        return optax.softmax_cross_entropy_with_integer_labels(lg[:, :-1], ids[:, 1:]).mean(), lg

    def float_labels(x, w, ids):
        return optax.softmax_cross_entropy((x @ w)[:, :-1], soft).mean()

    def no_label(x, w, ids):
        return jnp.mean(jax.nn.logsumexp(x @ w, -1) ** 2)

    def sorted_reader(x, w, ids):
        lg = x @ w
        loss = optax.softmax_cross_entropy_with_integer_labels(lg[:, :-1], ids[:, 1:]).mean()
        return loss + jnp.sort(lg, axis=1)[0, 0, 0]

    def probabilities_returned(x, w, ids):
        lg = (x @ w)[:, :-1]
        loss = optax.softmax_cross_entropy_with_integer_labels(lg, ids[:, 1:]).mean()
        return loss, jax.nn.softmax(lg)

    cases = [(returned, "xent-logits-returned", "the logits are returned"),
             (float_labels, "xent-dense-operand", "labels are floats"),
             (no_label, "xent-no-label", "no label is taken at integer indices"),
             (sorted_reader, "xent-logits-read", "`sort` reads"),
             (probabilities_returned, "xent-wide-returned",
              "as wide as the logits is an output")]
    for fun, code, words in cases:
        found = _reasons(fun, x, w, ids, rules=rules)
        assert [(f, c) for f, c, _ in found] == [(False, code)], (fun, found)
        assert words in found[0][2]
        # declined: the program is jit's
        close(jaxfuse.optimize(fun, patterns=rules, policy="always")(x, w, ids),
              jax.jit(fun)(x, w, ids))


def test_a_loss_under_its_own_jit_under_grad(rng):
    """`jax.grad` of a function calling a jitted loss: the forward call passes
    a [tokens, V] value to the gradient's call. Where both calls are small
    enough to inline (jax 0.12.1 on: the log-sum-exp is a custom_jvp call, so
    the forward call has few equations of its own), the walker sees through
    them and the region spans them: one site, jit's values. Where the forward
    call is larger (jax 0.10 spells the log-sum-exp out), the region ends at
    the call, and the value it returns declines the site."""
    from jaxfuse.fusion.ir.inline import INLINE_MAX_EQNS

    x, w, ids = _head(rng)

    def loss_under_its_own_jit(x, w, ids):
        return jax.jit(lambda x, w: optax.softmax_cross_entropy_with_integer_labels(
            (x @ w)[:, :-1], ids[:, 1:]).mean())(x, w)

    step = jax.grad(loss_under_its_own_jit, argnums=(0, 1))
    forward = jax.make_jaxpr(step)(x, w, ids).jaxpr.eqns[0].params["jaxpr"].jaxpr
    if len(forward.eqns) <= INLINE_MAX_EQNS:
        check(step, x, w, ids, rules=_plain_rules())
    else:
        found = _reasons(step, x, w, ids, rules=_plain_rules())
        assert [(f, c) for f, c, _ in found] == [(False, "xent-wide-returned")], found


def test_zero_tokens_and_other_heads_are_left_alone(rng):
    x, w, ids = _head(rng)

    def empty(x, w, ids):
        return optax.softmax_cross_entropy_with_integer_labels(x[:, :0] @ w, ids[:, :0]).sum()

    assert [c for _, c, _ in _reasons(empty, x, w, ids)] == ["xent-no-tokens"]

    def mlp(x, w, ids):  # a contraction under no softmax is no candidate
        return jnp.sum(jax.nn.relu(x @ w))

    assert _reasons(mlp, x, w, ids) == []


# ------------------------------------------------------- memory and sizing
def test_explain_shows_the_site_and_the_bytes_it_saves(llama, batch):
    ids, mask = batch
    step = jax.value_and_grad(_step(llama, "integer"))
    rep = jaxfuse.explain(jaxfuse.optimize(step, patterns=SMALL, policy="always"),
                          llama.params, ids, mask, memory=True)
    (site,) = [s for s in rep.sites if s.pattern == X.NAME]
    assert site.fused and "gradient" in site.spelling
    assert rep.memory["optimized"]["temp"] < rep.memory["jit"]["temp"]


def _plan(loss, *args):
    """The rule's analysis of `loss`'s head, on the walker's view of its jaxpr
    (small jit calls such as take_along_axis inlined)."""
    from jaxfuse import _compat as C
    from jaxfuse.fusion.ir.graph import Graph
    from jaxfuse.fusion.ir.inline import inline_small_calls
    from jaxfuse.rules import _chunking as K

    closed = jax.make_jaxpr(loss)(*args)
    inlined = inline_small_calls(list(closed.jaxpr.eqns))
    jaxpr = C.replace_eqns(closed.jaxpr, inlined.eqns)
    head = next(e for e in jaxpr.eqns if e.primitive.name == "dot_general")
    return head, K.analyse(Graph(jaxpr, closed.consts, inlined=inlined), head)


def test_the_chunk_size_comes_from_the_budget(rng):
    x, w, ids = _head(rng, b=4, s=65, h=16, v=1000)

    def loss(x, w, ids):
        return optax.softmax_cross_entropy_with_integer_labels((x @ w)[:, :-1], ids[:, 1:]).mean()

    _, plan = _plan(loss, x, w, ids)
    assert (plan.size, plan.token_elems, plan.vocab) == (64, 4, 1000)
    row = 1000 * 4
    # 16 rows fit: four positions of four tokens; 8 positions divide 64 evenly
    assert X.piece_size(plan, X.Budget(bytes=X.ROWS_LIVE * row * 16)) == 4
    assert X.piece_size(plan, X.Budget(bytes=X.ROWS_LIVE * row * 35)) == 8
    assert X.piece_size(plan, X.Budget(bytes=1)) == 1
    assert X.piece_size(plan, X.Budget(bytes=1 << 40)) == 64
    # by default the budget is twice the head weight's bytes, within [least, most]
    assert X.Budget().for_head(1 << 10) == X.Budget().least
    assert X.Budget().for_head(1 << 40) == X.Budget().most
    assert X.Budget().for_head(100 << 20) == 200 << 20


def test_cannot_pay_is_a_static_decline_for_the_cost_hook(rng):
    from jaxfuse.fusion.match.patterns import Match

    def site(b, s, v):
        x, w, ids = _head(rng, b=b, s=s, h=8, v=v)

        def loss(x, w, ids):
            return optax.softmax_cross_entropy_with_integer_labels(x @ w, ids).mean()

        head, plan = _plan(loss, x, w, ids)
        return Match(root=head, eqns=(head,), operands=(), info={"plan": plan})

    narrow = X.cannot_pay(site(4, 8, 10))
    assert narrow.code == "xent-too-narrow" and "10" in str(narrow)
    small = X.cannot_pay(site(4, 8, 1000))
    assert small.code == "xent-fits-one-chunk"
    assert X.cannot_pay(site(16, 512, 4096)) is None  # 32 MiB of rows against an 8 MiB budget


def test_rules_reject_a_bad_budget():
    with pytest.raises(ValueError, match="positive"):
        X.rules(budget=0)
    with pytest.raises(TypeError, match="Budget"):
        X.rules(budget="big")
    (p,) = X.rules()
    assert p.name == X.NAME and p.roots == frozenset({"dot_general"})


def test_auto_declines_for_cost_where_chunking_saves_nothing_and_always_applies(rng):
    # logits that fit one chunk: the cost hook declines under "auto", with its reason
    x, w, ids = _head(rng, b=2, s=8, h=8, v=1000)

    def loss(x, w, ids):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, ids).mean()

    (site,) = [s for s in jaxfuse.explain(jaxfuse.optimize(loss, patterns=X.rules()),
                                          x, w, ids).sites if s.pattern == X.NAME]
    assert not site.fused and site.declined_for_cost and site.why.code == "xent-fits-one-chunk"
    (site,) = [s for s in jaxfuse.explain(jaxfuse.optimize(loss, patterns=X.rules(),
                                                           policy="always"),
                                          x, w, ids).sites if s.pattern == X.NAME]
    assert site.fused


def test_a_gradient_accumulation_scan_over_micro_batches(rng):
    """The train step people write for large batches: `lax.scan` over 4
    micro-batches, each one's `value_and_grad` added to a carry. The region
    sits in the scan's body, with its gradient: fused there, jit's values,
    at most 0.3x jit's temp."""
    h, v = 64, 4096
    w = jnp.asarray(rng.standard_normal((h, v)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 8, 64, h)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, (4, 8, 64)), jnp.int32)

    def loss(w, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, y).mean()

    def accumulate(w, x, labels):
        def body(acc, mb):
            value, grad = jax.value_and_grad(loss)(w, *mb)
            return (acc[0] + value, acc[1] + grad), None
        (value, grad), _ = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros_like(w)), (x, labels))
        return value / 4, grad / 4

    c = check(accumulate, w, x, labels, rules=X.rules(budget=X.ROWS_LIVE * 4 * v * 32))
    assert c.temp <= 0.3 * c.jit_temp, (c.temp, c.jit_temp)
