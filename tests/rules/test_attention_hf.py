"""jaxfuse.rules.attention on HuggingFace transformers' Flax models (small
random configs, no download): every attention layer of each family is
rewritten to `jax.nn.dot_product_attention` with no spelling written for
any family, values and gradients agree with `jax.jit` of the unrewritten
model, a softmax between two contractions the rule does not rewrite is
explained by the step that differs, and under `policy="auto"` each site is a
cost decision."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns

import hf_models as H

pytestmark = pytest.mark.skipif(not H.available(), reason="needs the `hf` extra (transformers)")


def _rules():
    from jaxfuse.rules import attention
    return attention.rules()


def sites(fun, *args, policy="always", platform=None):
    """The attention sites `explain` reports for `fun(*args)`."""
    report = jaxfuse.explain(jaxfuse.optimize(fun, patterns=_rules()), *args, policy=policy,
                             platform=platform)
    return [s for s in report.sites if s.pattern == "attention"]


def close(got, want, tol):
    """Each leaf within `tol` of the reference, relative to the largest value
    of all of them: a gradient that is 0 in exact arithmetic (a key
    projection's bias, softmax being shift-invariant) is rounding noise of the
    size of the others' rounding in both programs."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    scale = max([float(np.max(np.abs(np.asarray(w, np.float64)))) for w in want if np.size(w)] + [1e-30])
    for g, w in zip(got, want, strict=False):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale)


def loss_of(forward):
    return lambda p, *x: jnp.sum(jnp.sin(forward(p, *x).astype(jnp.float32)))


def replaced_calls(fun, *args) -> int:
    closed = jax.make_jaxpr(jaxfuse.optimize(fun, patterns=_rules(), policy="always"))(*args)
    return sum(1 for e in all_eqns(closed) if str(e.params.get("name", "")).startswith("attention"))


# ------------------------------------------------ the four families asked for
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "vit"])
def test_every_attention_layer_is_rewritten_with_values_and_gradients(family):
    forward, params, inputs = H.build(family)
    found = sites(forward, params, *inputs)
    assert len(found) == H.attention_layers(family) and all(s.fused for s in found), found
    assert replaced_calls(forward, params, *inputs) == H.attention_layers(family)
    opt = jaxfuse.optimize(forward, patterns=_rules(), policy="always")
    close(opt(params, *inputs), jax.jit(forward)(params, *inputs), 1e-5)
    loss = loss_of(forward)
    got = jax.grad(jaxfuse.optimize(loss, patterns=_rules(), policy="always"))(params, *inputs)
    want = jax.jit(jax.grad(loss))(params, *inputs)
    close(got, want, 1e-4)


# Each family's attention as the rule reads it: the forms and the canonical
# parts found (no family has a spelling of its own).
FORMS = {
    "bert": ("attention_masked", "1 mask factor"),
    "roberta": ("attention_masked", "1 mask factor"),
    "electra": ("attention_masked", "1 mask factor"),
    # DistilBERT adds -1e30 * (1 - mask) for an int mask: not provably a mask, a bias
    "distilbert": ("attention_bias", "1 bias term"),
    "gpt2": ("attention_masked", "causal, 1 mask factor"),
    "gpt_neo": ("attention_masked", "causal"),
    "opt": ("attention_masked", "causal, 1 mask factor"),
    "llama": ("attention_masked", "causal, 1 mask factor, 2 query heads per key/value head"),
    "mistral": ("attention_masked", "causal, window (4, 0), 1 mask factor, 2 query heads"),
    "gemma": ("attention_masked", "causal, 1 mask factor, 4 query heads per key/value head"),
    "clip_text": ("attention_masked", "causal, 1 mask factor"),
    "bart": ("attention_masked", ""),
    "bloom": ("attention_bias_masked", "causal, 1 mask factor, 1 bias term"),  # ALiBi: a bias
    "vit": ("attention", ""),
    # T5: the net scale 1 (flax's 1/sqrt(d) cancelled), its relative position bias a bias
    "t5": ("attention", "1 bias term"),
}


def _clip_with_old_names(clip):
    # transformers' Flax T5 calls jnp.clip(a_max=...), names jax 0.10 no longer takes
    def shim(x, min=None, max=None, *, a_min=None, a_max=None, **kw):
        return clip(x, a_min if min is None else min, a_max if max is None else max, **kw)
    return shim


@pytest.mark.parametrize("family", [f for f in H.FAMILIES if f not in ("bert", "gpt2", "llama", "vit")])
def test_other_families_need_no_spelling_of_their_own(family, monkeypatch):
    if family == "t5":
        monkeypatch.setattr(jnp, "clip", _clip_with_old_names(jnp.clip))
    forward, params, inputs = H.build(family)
    want = jax.jit(forward)(params, *inputs)
    found = sites(forward, params, *inputs)
    assert len(found) == H.attention_layers(family) and all(s.fused for s in found), found
    form, parts = FORMS[family]
    assert all(s.spelling.startswith(form) for s in found), [s.spelling for s in found]
    assert any(parts in s.spelling for s in found), [s.spelling for s in found]
    opt = jaxfuse.optimize(forward, patterns=_rules(), policy="always")
    close(opt(params, *inputs), want, 1e-5)


def test_gpt_neo_local_layers_and_mistral_get_their_window():
    # GPT-Neo's local layer masks `causal XOR tril(causal, -window)`; the values
    # prove a band of 3 keys before each query, as jax.nn's local_window_size
    forward, params, inputs = H.build("gpt_neo")
    spellings = sorted(s.spelling for s in sites(forward, params, *inputs))
    assert spellings == ["attention_masked (causal, 1 mask factor)",
                         "attention_masked (causal, window (3, 0), 1 mask factor)"], spellings


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_16_bit_models_are_rewritten_and_as_close_to_float32(family):
    # The replacement computes the logits and the softmax in float32, so it is
    # at least as close to the float32 model as the bfloat16 model itself.
    forward, params, inputs = H.build(family, jnp.bfloat16)
    f32, p32, _ = H.build(family, jnp.float32)
    found = sites(forward, params, *inputs)
    assert len(found) == H.attention_layers(family) and all(s.fused for s in found)
    want = np.asarray(jax.jit(f32)(p32, *inputs), np.float64)
    own = np.asarray(jax.jit(forward)(params, *inputs), np.float64)
    got = np.asarray(jaxfuse.optimize(forward, patterns=_rules(), policy="always")(params, *inputs),
                     np.float64)
    err = lambda x: float(np.linalg.norm(x - want) / np.linalg.norm(want))  # noqa: E731
    assert err(got) <= max(1.5 * err(own), 2e-2), (err(got), err(own))


# ------------------------------------------------------------ idempotence
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_optimizing_twice_changes_nothing_more(family):
    from jaxfuse.fusion import rewrite

    forward, params, inputs = H.build(family)
    once = jaxfuse.explain(jaxfuse.optimize(forward, patterns=_rules(), policy="always"),
                           params, *inputs).jaxpr
    twice, report = rewrite(once, _rules())
    # the replacements' own bodies (jax.nn's XLA path) are left alone, not even a near miss
    assert not [s for s in report.sites if s.pattern == "attention"], report
    assert str(twice) == str(once)
    opt = jaxfuse.optimize(forward, patterns=_rules(), policy="always")
    assert jaxfuse.optimize(opt, patterns=_rules(), policy="always") is opt


# ---------------------------------------------------------- cost decisions
def test_auto_applies_where_jax_nn_is_measured_to_win_and_says_why_elsewhere():
    from jaxfuse.rules import attention

    forward, params, inputs = H.build("bert")
    # float32, 8 keys on CPU: measured to win
    assert all(s.fused for s in sites(forward, params, *inputs, policy="auto", platform="cpu"))
    # 16 bits on CPU: jax.nn's float32 softmax loses; declined for cost, with the reason
    bf, bparams, _ = H.build("bert", jnp.bfloat16)
    found = sites(bf, bparams, *inputs, policy="auto", platform="cpu")
    assert found and all(not s.fused and s.declined_for_cost for s in found)
    assert all(s.why.code == "attention-cost" and "bfloat16 on CPU" in str(s.reason) for s in found)
    # "always" applies every safe site whatever it costs
    assert all(s.fused for s in sites(bf, bparams, *inputs, policy="always", platform="cpu"))
    # a GPU without cuDNN (or float32 there): XLA's path, nothing to gain
    found = sites(forward, params, *inputs, policy="auto", platform="cuda")
    assert all(s.declined_for_cost and "cuDNN" in str(s.reason) for s in found)
    # more keys than measured to win on CPU
    q = jax.ShapeDtypeStruct((1, attention.CPU_MAX_KEYS + 8, 2, 16), jnp.float32)
    found = sites(_plain_attention, q, q, q, policy="auto", platform="cpu")
    assert len(found) == 1 and found[0].declined_for_cost and "keys on CPU" in str(found[0].reason)
    # at the measured limit the time test passes; the memory promise still holds: a site is
    # applied exactly where the rewritten program peaks within jit's peak plus the slack,
    # else declined by the memory check, not by the cost hook. (jax 0.10-0.12.0: one head
    # fits, two hold more, jax.nn keeping about twice the float32 logits; from 0.12.1 jit's
    # own program of the custom_jvp softmax peaks as high, and both fit.)
    from jaxfuse.fusion.tuning import hlo_memory

    for heads in (1, 2):
        q = jnp.ones((1, attention.CPU_MAX_KEYS, heads, 16), jnp.float32)
        peaks = jaxfuse.explain(_plain_attention, q, q, q, patterns=_rules(), policy="always",
                                platform="cpu", memory=True).memory
        fits = hlo_memory.within(peaks["optimized"]["peak"], peaks["jit"]["peak"])
        (site,) = sites(_plain_attention, q, q, q, policy="auto", platform="cpu")
        assert site.fused == fits, (heads, peaks, site)
        assert fits or site.why.code == "holds-more", site
        if heads == 1:
            assert fits


def _plain_attention(q, k, v, mask=None, bias=None):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]).astype(q.dtype), k)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)


# -------------------------------------------- gradients through bias and mask
def test_gradients_through_a_learned_bias_and_an_additive_padding_mask(rng):
    b, t, n, h = 2, 7, 3, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, n, t, t)), jnp.float32)   # a learned position bias
    pad = jnp.asarray(H.padding_mask(b, t))

    def f(q, k, v, bias, pad):
        additive = jax.lax.select(jnp.broadcast_to(pad[:, None, None, :] > 0, (b, 1, 1, t)),
                                  jnp.zeros((b, 1, 1, t)), jnp.full((b, 1, 1, t), jnp.finfo(jnp.float32).min))
        return _plain_attention(q, k, v, bias=bias + additive)

    found = sites(f, q, k, v, bias, pad)
    assert len(found) == 1 and found[0].fused and "1 mask factor, 1 bias term" in found[0].spelling
    opt = jaxfuse.optimize(f, patterns=_rules(), policy="always")
    close(opt(q, k, v, bias, pad), jax.jit(f)(q, k, v, bias, pad), 1e-5)
    loss = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.grad(jaxfuse.optimize(loss, patterns=_rules(), policy="always"), argnums=(0, 1, 2, 3))(
        q, k, v, bias, pad)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias, pad)
    close(got, want, 1e-4)


def test_a_row_masked_whole_keeps_the_hand_written_values(rng):
    # finfo.min added to every logit of a row: uniform weights, as jax.nn's mask gives
    b, t, n, h = 2, 5, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))
    mask = np.tril(np.ones((t, t), bool))[None, None].repeat(b, 0)
    mask[1, :, 2, :] = False  # query 2 of batch 1 sees nothing
    mask = jnp.asarray(mask)
    found = sites(_plain_attention, q, k, v, mask)
    assert found[0].fused and "1 mask factor" in found[0].spelling
    opt = jaxfuse.optimize(_plain_attention, patterns=_rules(), policy="always")
    close(opt(q, k, v, mask), jax.jit(_plain_attention)(q, k, v, mask), 1e-5)


# ------------------------------------------------------------- near misses
def _near_miss(fun, *args):
    (site,) = sites(fun, *args)
    assert not site.fused and not site.declined_for_cost, site
    return site.why


def _qkv(rng, b=2, t=6, n=2, h=8):
    return tuple(jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))


def test_a_scale_that_is_an_array_is_named(rng):
    per_head = jnp.asarray(np.array([0.5, 0.25], np.float32)[None, :, None, None])

    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * per_head
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)

    reason = _near_miss(f, *_qkv(rng))
    assert reason.code == "attention-scale-array" and "(1, 2, 1, 1)" in str(reason)


def test_a_scale_computed_at_run_time_is_named(rng):
    def f(q, k, v, s):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * s
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)

    reason = _near_miss(f, *_qkv(rng), jnp.float32(0.3))
    assert reason.code == "attention-scale-traced"


def test_dropout_between_the_softmax_and_the_values_is_named(rng):
    def f(q, k, v, key):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0)
        keep = jax.random.bernoulli(key, 0.9, w.shape)
        return jnp.einsum("bhqk,bkhd->bqhd", w * keep / 0.9, v)

    reason = _near_miss(f, *_qkv(rng), jax.random.key(0))
    assert reason.code == "attention-step" and "between the softmax and the values" in str(reason)


def test_a_fill_that_need_not_mask_is_named(rng):
    mask = jnp.asarray(np.tril(np.ones((6, 6), bool)))

    def f(q, k, v):
        logits = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -1e4)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)

    reason = _near_miss(f, *_qkv(rng))
    assert reason.code == "attention-fill" and "masked with -10000" in str(reason)


def test_a_softmax_without_its_maximum_is_named(rng):
    def f(q, k, v):
        e = jnp.exp(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0)
        return jnp.einsum("bhqk,bkhd->bqhd", e / jnp.sum(e, -1, keepdims=True), v)

    reason = _near_miss(f, *_qkv(rng))
    assert reason.code == "attention-softmax" and "no maximum" in str(reason)


def test_a_reshape_between_the_contraction_and_the_softmax_is_named(rng):
    def f(q, k, v):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        b, n, t, s = logits.shape
        w = jax.nn.softmax(logits.reshape(b * n, t, s)).reshape(b, n, t, s)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    reason = _near_miss(f, *_qkv(rng))
    assert reason.code == "attention-step" and str(reason).startswith("`reshape`")


def test_float64_is_named(rng):
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in _qkv(rng))
        reason = _near_miss(_plain_attention, q, k, v)
    assert reason.code == "attention-dtype" and "float64" in str(reason)


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_16_bit_hf_models_get_cudnn_under_auto_gpu(family):
    # On an NVIDIA GPU with cuDNN, auto applies the rule where cuDNN's fused
    # kernel takes the site (bfloat16, head size a multiple of 8), and the
    # lowered program holds cuDNN's fused attention.
    from jaxfuse import _compat

    if _compat.cudnn_version() is None:
        pytest.skip("jax finds no cuDNN")
    forward, params, inputs = H.build(family, jnp.bfloat16)
    found = sites(forward, params, *inputs, policy="auto")
    assert found and all(s.fused for s in found), found
    opt = jaxfuse.optimize(forward, patterns=_rules())
    assert "__cudnn$fmha" in jax.jit(opt).lower(params, *inputs).as_text()
    f32, p32, _ = H.build(family, jnp.float32)
    want = np.asarray(jax.jit(f32)(p32, *inputs), np.float64)
    err = lambda x: float(np.linalg.norm(np.asarray(x, np.float64) - want) / np.linalg.norm(want))  # noqa: E731
    assert err(opt(params, *inputs)) <= max(2 * err(jax.jit(forward)(params, *inputs)), 2e-2)


# -------------------------------------------------------------- train steps
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_train_steps_rewrite_every_attention_forward_and_backward(family):
    """`optimize(jax.value_and_grad(loss))`: each attention layer's values
    are read by the backward pass, so each site is matched with its backward
    (fusion/match/training.py) and replaced by jax.nn's forward and its own
    VJP: every layer, loss within 1e-5 and gradients within 1e-4 of jit's."""
    forward, params, inputs = H.build(family)
    step = jax.value_and_grad(loss_of(forward))
    found = sites(step, params, *inputs)
    assert len(found) == H.attention_layers(family), found
    assert all(s.fused and s.spelling.endswith("+ gradient") for s in found), found
    opt = jaxfuse.optimize(step, patterns=_rules(), policy="always")
    called = [str(e.params.get("name", "")) for e in all_eqns(jax.make_jaxpr(opt)(params, *inputs))]
    assert sum(n.startswith("attention") and n.endswith("_vjp") for n in called) \
        == H.attention_layers(family)
    (got_loss, got), (want_loss, want) = opt(params, *inputs), jax.jit(step)(params, *inputs)
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-5)
    close(got, want, 1e-4)
