"""jaxfuse.rules.attention: hand-written attention in flax.linen, flax.nnx,
dm-haiku and equinox layers becomes `jax.nn.dot_product_attention`, with
values and gradients within float32 rounding of the layer's own."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.fusion.ir.subjaxprs import all_eqns
from conftest import skip_without_float16

pytest.importorskip("flax", reason="needs the `models` extra (flax)")

RULES = None


def rules():
    global RULES
    if RULES is None:
        import jaxfuse.rules
        RULES = jaxfuse.rules.attention.rules()
    return RULES


def replaced(fun, *args) -> list[str]:
    """The forms (the replacement's names) of the attention sites replaced in
    fun's program, every safe site applied (`policy="always"`: under "auto"
    each site is a cost decision, tests/test_attention_hf.py)."""
    closed = jax.make_jaxpr(jaxfuse.optimize(fun, patterns=rules(), policy="always"))(*args)
    return sorted(e.params["name"] for e in all_eqns(closed)
                  if str(e.params.get("name", "")).startswith("attention"))


def close(got, want, tol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=tol, atol=tol)


def check(fun, *args, grad_argnums=0):
    opt = jaxfuse.optimize(fun, patterns=rules(), policy="always")
    close(opt(*args), jax.jit(fun)(*args))
    loss = lambda *a: jnp.sum(jnp.sin(fun(*a)))  # noqa: E731
    close(jax.grad(jaxfuse.optimize(loss, patterns=rules(), policy="always"), argnums=grad_argnums)(*args),
          jax.jit(jax.grad(loss, argnums=grad_argnums))(*args), tol=1e-4)


def the_site(fun, *args):
    """The one attention site `explain` reports for fun's program under "always"."""
    (site,) = [s for s in jaxfuse.explain(fun, *args, patterns=rules(), policy="always").sites
               if s.pattern == "attention"]
    return site


def assert_jits_program(fun, *args):
    """A declined site leaves jit's program: the same values bit for bit."""
    got = jaxfuse.optimize(fun, patterns=rules(), policy="always")(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fun)(*args)))


def _x(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _causal(t):
    return jnp.tril(jnp.ones((t, t), bool))


# ------------------------------------------------------------------ flax.linen
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_flax_linen_multi_head_attention(rng, head_dim):
    nn = pytest.importorskip("flax.linen")
    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=2 * head_dim,
                                        dropout_rate=0.0, deterministic=True)
    x = _x(rng, 2, 6, 16)
    params = m.init(jax.random.key(0), x, x)
    f = lambda p, x: m.apply(p, x, x)  # noqa: E731
    assert replaced(f, params, x) == ["attention"]
    check(f, params, x)


def test_flax_linen_with_a_mask_and_fully_masked_rows(rng):
    nn = pytest.importorskip("flax.linen")
    m = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, dropout_rate=0.0,
                                        deterministic=True)
    x = _x(rng, 2, 6, 16)
    params = m.init(jax.random.key(0), x, x)
    mask = jnp.broadcast_to(_causal(6), (2, 1, 6, 6)).at[1, :, 2, :].set(False)  # a row all masked
    f = lambda p, x, mask: m.apply(p, x, x, mask=mask)  # noqa: E731
    assert replaced(f, params, x, mask) == ["attention_masked"]
    check(f, params, x, mask)


def test_flax_linen_under_scan_and_remat_one_match_per_layer(rng):
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, dropout_rate=0.0,
                                                deterministic=True)(x, x)
            return x + y, None

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                             split_rngs={"params": True}, length=3)
            return layers()(x, None)[0]

    m = Encoder()
    x = _x(rng, 2, 5, 16)
    params = m.init(jax.random.key(1), x)
    assert replaced(m.apply, params, x) == ["attention"]  # one body, three layers
    check(m.apply, params, x)


def test_vmap_jit_and_idempotence(rng):
    nn = pytest.importorskip("flax.linen")
    m = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, dropout_rate=0.0,
                                        deterministic=True)
    x = _x(rng, 3, 4, 5, 16)
    params = m.init(jax.random.key(2), x[0], x[0])
    f = lambda p, x: m.apply(p, x, x)  # noqa: E731
    batched = jax.vmap(f, in_axes=(None, 0))
    assert replaced(batched, params, x) == ["attention"]
    close(jax.jit(jaxfuse.optimize(batched, patterns=rules()))(params, x), jax.jit(batched)(params, x))
    close(jax.vmap(jaxfuse.optimize(f, patterns=rules()), in_axes=(None, 0))(params, x),
          batched(params, x))
    # The replacement's own body (jax.nn's XLA path) holds naive attention of
    # its own spelling: rewriting the rewritten program changes nothing more.
    once = jaxfuse.explain(jaxfuse.optimize(f, patterns=rules()), params, x[0]).jaxpr
    from jaxfuse.fusion import rewrite
    twice, report = rewrite(once, rules())
    assert not report.fused
    assert str(twice) == str(once)


# -------------------------------------------------------------------- flax.nnx
def test_flax_nnx_naive_path_and_the_negative_cases(rng):
    nnx = pytest.importorskip("flax.nnx")

    def layer(**kw):
        m = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                                   rngs=nnx.Rngs(0), **kw)
        graphdef, state = nnx.split(m)
        return (lambda s, x: nnx.merge(graphdef, s)(x, deterministic=True)), state

    x = _x(rng, 2, 5, 16)
    f, state = layer(dropout_rate=0.1)  # deterministic: no dropout, the naive path
    assert replaced(f, state, x) in (["attention"], ["attention_flax_nnx"])
    check(f, state, x, grad_argnums=1)
    f, state = layer(dropout_rate=0.0)  # nnx already calls jax.nn.dot_product_attention
    assert replaced(f, state, x) == []

    # Sown attention weights are read outside the attention: declined, unchanged.
    m = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                               dropout_rate=0.1, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(m)

    def sown(s, x):
        layer = nnx.merge(graphdef, s)
        y = layer(x, deterministic=True, sow_weights=True)
        return y, nnx.state(layer, nnx.Intermediate)

    assert replaced(sown, state, x) == []
    report = jaxfuse.explain(jaxfuse.optimize(sown, patterns=rules()), state, x)
    assert report.sites and not report.fused
    assert any("outside the fused region" in s.reason or "output of the jaxpr" in s.reason
               for s in report), str(report)


# ------------------------------------------------------------------- dm-haiku
@pytest.mark.parametrize("masked", [False, True])
def test_haiku_multi_head_attention(rng, masked):
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")

    def net(x, mask):
        return hk.MultiHeadAttention(num_heads=2, key_size=8, w_init=hk.initializers.VarianceScaling(1.0))(
            x, x, x, mask=mask)

    t = hk.without_apply_rng(hk.transform(net))
    x = _x(rng, 2, 6, 16)
    mask = jnp.broadcast_to(_causal(6), (2, 1, 6, 6)) if masked else None
    params = t.init(jax.random.key(3), x, mask)
    f = (lambda p, x, m: t.apply(p, x, m)) if masked else (lambda p, x: t.apply(p, x, None))
    args = (params, x, mask) if masked else (params, x)
    assert replaced(f, *args) == ["attention_logits_scaled" + ("_masked" if masked else "")]
    check(f, *args)


def test_haiku_float16_masked_is_declined(rng):
    skip_without_float16()
    hk = pytest.importorskip("haiku", reason="needs dm-haiku")

    def net(x, mask):
        return hk.MultiHeadAttention(num_heads=2, key_size=8,
                                     w_init=hk.initializers.VarianceScaling(1.0))(x, x, x, mask=mask)

    t = hk.without_apply_rng(hk.transform(net))
    x = _x(rng, 2, 6, 16, dtype=jnp.float16)
    mask = jnp.broadcast_to(_causal(6), (2, 1, 6, 6))
    params = jax.tree.map(lambda p: p.astype(jnp.float16), t.init(jax.random.key(3), x, mask))
    f = lambda p, x, m: t.apply(p, x, m)  # noqa: E731
    report = jaxfuse.explain(jaxfuse.optimize(f, patterns=rules()), params, x, mask, policy="always")
    (site,) = [s for s in report if s.pattern == "attention"]
    # the fill -1e30 is -inf in float16: the step that differs is named
    assert not site.fused and not site.declined_for_cost
    assert site.why.code == "attention-fill" and "masked with -inf" in str(site.reason), str(report)


# -------------------------------------------------------------------- equinox
@pytest.mark.parametrize("masked", [False, True])
def test_equinox_multihead_attention_batched_and_not(rng, masked):
    eqx = pytest.importorskip("equinox", reason="needs equinox")
    m = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=jax.random.key(4))
    params, static = eqx.partition(m, eqx.is_array)
    mask = _causal(5) if masked else None

    def one(p, x):
        return eqx.combine(p, static)(x, x, x, mask=mask)

    batched = jax.vmap(one, in_axes=(None, 0))
    x = _x(rng, 3, 5, 16)
    suffix = "_masked" if masked else ""
    assert replaced(one, params, x[0]) == [f"attention{suffix}"]
    assert replaced(batched, params, x) == [f"attention{suffix}"]
    check(one, params, x[0])
    check(batched, params, x)


@pytest.mark.parametrize("masked", [False, True])
def test_equinox_at_16_bits_gets_its_float32_softmax_form(rng, masked):
    eqx = pytest.importorskip("equinox", reason="needs equinox")
    m = eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=jax.random.key(4))
    m = jax.tree.map(lambda p: p.astype(jnp.bfloat16) if eqx.is_array(p) else p, m)
    params, static = eqx.partition(m, eqx.is_array)
    mask = _causal(5) if masked else None
    batched = jax.vmap(lambda p, x: eqx.combine(p, static)(x, x, x, mask=mask), in_axes=(None, 0))
    x = _x(rng, 3, 5, 16, dtype=jnp.bfloat16)
    assert replaced(batched, params, x) == ["attention_float32_softmax" + ("_masked" if masked else "")]
    close(jaxfuse.optimize(batched, patterns=rules())(params, x), jax.jit(batched)(params, x), tol=2e-2)


# ------------------------------------------------- spellings nobody shipped
def _matmul_spelling(q, k, v):
    # (B, T, N, H) through explicit transposes, the scale as a product
    qt = (q * (1.0 / np.sqrt(q.shape[-1]))).transpose(0, 2, 1, 3)
    w = jax.nn.softmax(qt @ k.transpose(0, 2, 3, 1))
    return (w @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _logits_times_scale(q, k, v):
    # as PyTorch code is ported: scores * scale, keys first, heads vmapped
    def head(q, k, v):  # (T, H) each
        s = jax.lax.dot_general(k, q, (((1,), (1,)), ((), ()))).T * (1.0 / np.sqrt(q.shape[-1]))
        return jax.nn.softmax(s) @ v
    return jax.vmap(jax.vmap(head, in_axes=1, out_axes=1))(q, k, v)


@pytest.mark.parametrize("spelling, form", [(_matmul_spelling, "attention"),
                                            (_logits_times_scale, "attention_logits_scaled")])
def test_a_spelling_of_ones_own_is_matched_by_its_form(rng, spelling, form):
    q, k, v = (_x(rng, 2, 7, 3, 16) for _ in range(3))
    assert replaced(spelling, q, k, v) == [form]
    check(spelling, q, k, v, grad_argnums=(0, 1, 2))


def test_flax_dot_product_attention_with_a_bias_and_a_mask(rng):
    nn = pytest.importorskip("flax.linen")
    q, k, v = (_x(rng, 2, 6, 3, 16) for _ in range(3))
    bias = _x(rng, 2, 3, 6, 6)
    mask = jnp.broadcast_to(_causal(6), (2, 1, 6, 6))
    f = lambda q, k, v, bias, mask: nn.dot_product_attention(q, k, v, bias=bias, mask=mask)  # noqa: E731
    assert replaced(f, q, k, v, bias, mask) == ["attention_bias_masked"]
    check(f, q, k, v, bias, mask, grad_argnums=(0, 3))


# ------------------------------------------------------- the implementation
def _avals(b=2, t=8, n=4, h=64, dtype=jnp.bfloat16, kv_heads=None, s=None):
    q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
    kv = jax.ShapeDtypeStruct((b, s or t, kv_heads or n, h), dtype)
    return q, kv, kv


@pytest.mark.parametrize("case,platform,cc,cudnn,want,why", [
    (dict(), "cuda", (9, 0), 91000, "cudnn", ""),
    (dict(h=128), "cuda", (8, 0), 90000, "cudnn", ""),
    (dict(h=256), "cuda", (9, 0), 91000, "cudnn", ""),  # Hopper takes up to 256
    (dict(h=256), "cuda", (8, 6), 91000, "xla", "at most 128"),
    (dict(h=60), "cuda", (9, 0), 91000, "xla", "multiple of 8"),
    (dict(dtype=jnp.float32), "cuda", (9, 0), 91000, "xla", "float16 or bfloat16"),
    (dict(kv_heads=3), "cuda", (9, 0), 91000, "xla", "4 query heads over 3 key heads"),
    (dict(kv_heads=2), "cuda", (9, 0), 91000, "cudnn", ""),  # grouped queries
    (dict(), "cuda", (9, 0), None, "xla", "cuDNN is not detected"),
    (dict(), "cpu", None, None, "xla", "only on NVIDIA GPUs"),
    (dict(), "rocm", None, None, "xla", "only on NVIDIA GPUs"),
])
def test_the_implementation_is_chosen_per_match(case, platform, cc, cudnn, want, why):
    from jaxfuse.rules.attention import implementation

    q, k, v = _avals(**case)
    got, reason = implementation(q, k, v, platform=platform, compute_capability=cc,
                                 cudnn_version=cudnn)
    assert got == want and why in reason


def test_a_bias_needs_even_lengths_and_the_queries_dtype_for_cudnn():
    from jaxfuse.rules.attention import implementation

    kw = dict(platform="cuda", compute_capability=(9, 0), cudnn_version=91000)
    q, k, v = _avals(t=7)
    bias = jax.ShapeDtypeStruct((2, 4, 7, 7), jnp.bfloat16)
    assert implementation(q, k, v, bias=bias, **kw)[0] == "xla"
    assert implementation(q, k, v, **kw)[0] == "cudnn"  # odd lengths are fine without a bias
    q, k, v = _avals(t=8)
    assert implementation(q, k, v, bias=jax.ShapeDtypeStruct((2, 4, 8, 8), jnp.float32), **kw)[0] == "xla"
    assert implementation(q, k, v, bias=jax.ShapeDtypeStruct((2, 4, 8, 8), jnp.bfloat16), **kw)[0] == "cudnn"


def test_each_platform_gets_its_own_replacement(rng, monkeypatch):
    # The replacement is traced for the platform being compiled for, and once
    # per platform: explain for a GPU on this machine asks for a GPU choice.
    import flax.linen as nn
    from jaxfuse.rules import attention

    patterns = rules()  # built (and their examples traced) before the spy is in place
    seen = []
    real = attention.implementation

    def spy(*args, platform, **kw):
        seen.append(platform)
        return real(*args, platform=platform, **kw)

    monkeypatch.setattr(attention, "implementation", spy)
    q, k, v = (_x(rng, 3, 10, 2, 24) for _ in range(3))  # shapes no other test traces
    f = lambda q, k, v: nn.dot_product_attention(q, k, v)  # noqa: E731
    for platform in ("cpu", "cuda", "cpu"):
        report = jaxfuse.explain(jaxfuse.optimize(f, patterns=patterns), q, k, v, platform=platform,
                                 policy="always")  # auto declines XLA's path on a GPU for cost
        assert [s.pattern for s in report.fused] == ["attention"], str(report)
    assert seen == ["cpu", "cuda"], seen  # traced once per platform, then cached
    # Here cuDNN is absent, so even the GPU's program takes the XLA path.
    assert real(q, k, v, platform="cuda", compute_capability=None,
                cudnn_version=jaxfuse._compat.cudnn_version())[0] == "xla"


# -------------------------------------------------------------- train steps
def _causal_layer(p, x):
    b, t, d = x.shape

    def heads(w):
        return (x @ w).reshape(b, t, 4, d // 4)

    q, k, v = heads(p["wq"]), heads(p["wk"]), heads(p["wv"])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // 4).astype(np.float32)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return x + o.reshape(b, t, d) @ p["wo"]


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_a_train_step_rewrites_forward_and_backward(rng, remat):
    """Hand-written causal attention (2 x 128 tokens, 4 heads of 32), two
    layers, `value_and_grad`: each layer's forward and backward replaced by
    jax.nn's forward and its VJP. Under `jax.checkpoint` the forward pass
    holds each layer's primal alone (its forward rewritten) and the backward
    recomputes it beside its gradient in the checkpoint's body (both
    rewritten there)."""
    d = 128
    ps = [{n: jnp.asarray(rng.standard_normal((d, d)) * 0.05, jnp.float32)
           for n in ("wq", "wk", "wv", "wo")} for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((2, 128, d)), jnp.float32)
    layer = jax.checkpoint(_causal_layer) if remat else _causal_layer

    def loss(ps, x):
        for p in ps:
            x = layer(p, x)
        return jnp.mean(jnp.sin(x))

    step = jax.value_and_grad(loss)
    found = [s for s in jaxfuse.explain(step, ps, x, patterns=rules(),
                                        policy="always").sites if s.pattern == "attention"]
    assert all(s.fused for s in found), found
    joint = [s for s in found if s.spelling.endswith("+ gradient")]
    assert len(joint) == 2 and all(s.path == ("checkpoint" if remat else "") for s in joint), found
    assert len(found) == (4 if remat else 2), found
    opt = jaxfuse.optimize(step, patterns=rules(), policy="always")
    (gl, gg), (wl, wg) = opt(ps, x), jax.jit(step)(ps, x)
    np.testing.assert_allclose(np.asarray(gl), np.asarray(wl), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(gg), jax.tree.leaves(wg), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                                   atol=1e-4 * float(np.max(np.abs(np.asarray(w)))))


def _keras_style(q, k, v, mask):
    # keras-hub's Gemma: the logits masked, then Keras's Softmax layer masks its
    # output again with the same mask (a no-op but on rows masked whole)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.float32(np.sqrt(q.shape[-1]))
    s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("causal", [False, True])
def test_a_remask_after_the_softmax_is_read_through(rng, causal):
    """`where(mask, softmax(where(mask, s, min)), 0)`: the same mask twice.
    Rewritten; a query whose keys are all masked gets 0 there, as the program
    gives (jax.nn alone would average the values); forward and gradient."""
    b, t, n, h = 2, 16, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))
    pad = np.ones((b, t), bool)
    pad[1, 10:] = False  # batch 1 pads its last 6 tokens
    keep = pad[:, None, None, :] & pad[:, None, :, None]  # padded queries see nothing
    if causal:
        keep = keep & np.tril(np.ones((t, t), bool))
    mask = jnp.asarray(keep)

    def f(q, k, v):
        return _keras_style(q, k, v, mask)

    site = the_site(f, q, k, v)
    assert site.fused and "re-masked after the softmax" in site.spelling, site
    opt = jaxfuse.optimize(f, patterns=rules(), policy="always")
    want = jax.jit(f)(q, k, v)
    assert float(jnp.max(jnp.abs(want[1, 10:]))) == 0.0  # the rows masked whole
    np.testing.assert_allclose(np.asarray(opt(q, k, v)), np.asarray(want), rtol=1e-5, atol=1e-5)
    loss = lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    got = jax.grad(jaxfuse.optimize(loss, patterns=rules(), policy="always"), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# ------------------------------------------- normalized after the contraction
def _deferred(q, k, v, *, move=True, mask=True, sum_axis=-1, rows="sum", values_axis=3):
    # MaxText's `dot_product` attention: exp(s - max) contracted with the values,
    # divided afterwards by the sum of the exponentials (moved to the output's layout)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.float32(np.sqrt(q.shape[-1]))
    if mask:
        s = jnp.where(_causal(q.shape[1])[None, None], s, -0.7 * float(jnp.finfo(jnp.float32).max))
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    total = jnp.sum(jnp.exp(s) if rows == "unshifted" else e, axis=sum_axis, keepdims=True)
    if not move:
        return jnp.einsum("bnts,bsnh->bnth", e, v) / total
    total = jnp.moveaxis(total, -2, 1)                # [b, t, n, 1]
    if rows == "swapped":
        total = jnp.swapaxes(total, 1, 2)             # t and n crossed (equal sizes)
    out = jnp.einsum("bnts,bsnh->btnh", e, v)
    return out / total


@pytest.mark.parametrize("move", [True, False], ids=["moved", "logits_layout"])
@pytest.mark.parametrize("mask", [True, False], ids=["causal", "plain"])
def test_normalized_after_the_values_contraction(rng, move, mask):
    """`(exp(s - max) . v) / sum(exp(s - max))`, the sum laid out as the
    output (MaxText's moveaxis) or the output as the logits: rewritten, values
    and gradients as jit's."""
    q, k, v = (_x(rng, 2, 16, 4, 8) for _ in range(3))

    def f(q, k, v):
        return _deferred(q, k, v, move=move, mask=mask)

    site = the_site(f, q, k, v)
    assert site.fused and "normalized after the values' contraction" in site.spelling, site
    assert ("causal" in site.spelling) == mask, site
    check(f, q, k, v, grad_argnums=(0, 1, 2))


def test_normalized_after_the_contraction_in_a_train_step(rng):
    """Two such layers under `value_and_grad`: each forward and backward pair
    replaced by jax.nn's attention and its VJP."""
    d = 32
    ps = [{n: _x(rng, d, d) * 0.1 for n in ("wq", "wk", "wv")} for _ in range(2)]
    x = _x(rng, 2, 16, d)

    def loss(ps, x):
        for p in ps:
            q, k, v = ((x @ p[n]).reshape(2, 16, 4, d // 4) for n in ("wq", "wk", "wv"))
            x = x + _deferred(q, k, v).reshape(2, 16, d)
        return jnp.mean(jnp.sin(x))

    step = jax.value_and_grad(loss)
    found = [s for s in jaxfuse.explain(step, ps, x, patterns=rules(), policy="always").sites
             if s.pattern == "attention"]
    assert len(found) == 2 and all(s.fused and s.spelling.endswith("+ gradient")
                                   for s in found), found
    (gl, gg), (wl, wg) = jaxfuse.optimize(step, patterns=rules(), policy="always")(ps, x), \
        jax.jit(step)(ps, x)
    close(gl, wl, tol=1e-5)
    for g, w in zip(jax.tree.leaves(gg), jax.tree.leaves(wg), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4,
                                   atol=1e-4 * float(np.max(np.abs(np.asarray(w)))))


@pytest.mark.parametrize("kwargs, why", [
    ({"rows": "swapped"}, "pairs other rows than the softmax's sums"),
    ({"rows": "unshifted"}, "sum of other values"),
    ({"sum_axis": -2, "move": False}, "over another axis"),
])
def test_a_division_after_the_contraction_that_differs_is_declined(rng, kwargs, why):
    q, k, v = (_x(rng, 2, 16, 16, 16) for _ in range(3))  # heads, tokens, head size alike

    def f(q, k, v):
        return _deferred(q, k, v, **kwargs)

    site = the_site(f, q, k, v)
    assert not site.fused and why in site.reason, site
    assert_jits_program(f, q, k, v)


# ------------------------------------------------ a group axis of the queries
def _grouped(q, k, v, mask):
    # logits [B, T, K, G, S]: G query heads per key/value head as an axis of the
    # queries alone (the einsums MaxText and gemma write around their reshapes)
    b, t, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->btkgs", q, k) * np.float32(h ** -0.5)
    s = jnp.where(mask, s, -1e30)
    o = jnp.einsum("btkgs,bskh->btkgh", jax.nn.softmax(s, axis=-1), v)
    return o.reshape(b, t, n, h)


def _multi_query(q, k, v, mask):
    # one key/value head, written without a heads axis: [B, S, H]
    s = jnp.einsum("btnh,bsh->btns", q, k[:, :, 0]) * np.float32(q.shape[-1] ** -0.5)
    s = jnp.where(mask, s, -1e30)
    return jnp.einsum("btns,bsh->btnh", jax.nn.softmax(s, axis=-1), v[:, :, 0])


def _maxtext_grouped(q, k, v, mask):
    b, t, n, h = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)
    w = jnp.einsum("btkgh,bskh->bkgts", q, k)
    w = jnp.where(jnp.moveaxis(mask, 1, -2), w, -0.7 * float(jnp.finfo(jnp.float32).max))
    e = jnp.exp(w - jnp.max(w, axis=-1, keepdims=True))
    total = jnp.moveaxis(jnp.sum(e, axis=-1, keepdims=True), -2, 1)   # [b, t, kv, g, 1]
    total = total.reshape(b, t, n, 1)
    return jnp.einsum("bkgts,bskh->btkgh", e, v).reshape(b, t, n, h) / total


@pytest.mark.parametrize("spelling, kv, groups", [
    (_grouped, 2, 3), (_multi_query, 1, 4), (_maxtext_grouped, 2, 2), (_maxtext_grouped, 4, 1)])
@pytest.mark.parametrize("mask_kind", ["causal_padding", "per_group"])
def test_a_group_axis_of_the_queries_is_read_as_key_value_heads(rng, spelling, kv, groups,
                                                                mask_kind):
    """Logits [.., K, G, T, S] (or [B, T, N, S] against keys with no heads
    axis): G query heads per key/value head, as jax.nn's grouped heads; a mask
    over (T, S) broadcast over the heads, or one that differs per query head
    of a group."""
    b, t, h = 2, 12, 8
    q = _x(rng, b, t, kv * groups, h)
    k, v = _x(rng, b, t, kv, h), _x(rng, b, t, kv, h)
    pad = np.ones((b, t), bool)
    pad[1, 9:] = False
    if mask_kind == "causal_padding":
        keep = np.tril(np.ones((t, t), bool))[None] & pad[:, None, :]   # [B, T, S]
    else:
        keep = rng.random((b, t, groups, t)) > 0.3                     # [B, T, G, S]
        keep[..., 0] = True
    shaped = {_grouped: lambda m: m[:, :, None, None] if m.ndim == 3 else m[:, :, None],
              _multi_query: lambda m: m[:, :, None] if m.ndim == 3 else m,
              _maxtext_grouped: lambda m: m[:, :, None, None] if m.ndim == 3 else m[:, :, None]}
    mask = jnp.asarray(shaped[spelling](keep))

    def f(q, k, v):
        return spelling(q, k, v, mask)

    site = the_site(f, q, k, v)
    assert site.fused, site
    assert (f"{groups} query heads per key/value head" in site.spelling) == (groups > 1), site
    check(f, q, k, v, grad_argnums=(0, 1, 2))


def _gemma_grouped(q, k, v, mask):
    # gemma's layer: the grouped logits merged to [B, T, N, S] for the mask and the
    # softmax, split back to [B, T, K, G, S] for the values
    b, t, n, h = q.shape
    kv = k.shape[2]
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, kv, n // kv, h), k)
    logits = logits.reshape(b, t, n, -1)
    logits = jnp.where(jnp.expand_dims(mask, -2), logits, -2.3819763e38)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    out = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, kv, n // kv, -1), v)
    return out.reshape(b, t, n, h)


@pytest.mark.parametrize("kv, groups", [(2, 3), (1, 4)])
def test_gemmas_heads_merged_around_the_softmax(rng, kv, groups):
    """gemma's grouped-query layer: logits merged over (K, G) before the
    softmax and split after it; a causal and padding mask over (T, S)."""
    b, t, h = 2, 12, 8
    q, k, v = _x(rng, b, t, kv * groups, h), _x(rng, b, t, kv, h), _x(rng, b, t, kv, h)
    pad = np.ones((b, t), bool)
    pad[1, 8:] = False
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & pad[:, None, :])

    def f(q, k, v):
        return _gemma_grouped(q, k, v, mask)

    site = the_site(f, q, k, v)
    assert site.fused and f"{groups} query heads per key/value head" in site.spelling, site
    check(f, q, k, v, grad_argnums=(0, 1, 2))


def test_heads_split_otherwise_than_merged_are_declined(rng):
    """The weights split back as (G, K) where the logits merged (K, G): another
    attention (each query head reads another key/value head), declined."""
    b, t, h = 2, 8, 4
    q, k, v = _x(rng, b, t, 4, h), _x(rng, b, t, 2, h), _x(rng, b, t, 2, h)

    def f(q, k, v):
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, 2, 2, h), k).reshape(b, t, 4, t)
        probs = jax.nn.softmax(logits, axis=-1).reshape(b, t, 2, 2, t)
        return jnp.einsum("BTGKS,BSKH->BTKGH", probs, v).reshape(b, t, 4, h)

    site = the_site(f, q, k, v)
    assert not site.fused and "query axes" in site.reason, site
    assert_jits_program(f, q, k, v)


def test_a_soft_capped_attention_names_what_jax_nn_lacks(rng):
    """Gemma 2's logit soft cap has no counterpart in jax.nn's attention: the
    site is declined saying so, and the program is jit's."""
    q, k, v = (_x(rng, 2, 8, 2, 4) for _ in range(3))

    def f(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.5
        s = 50.0 * jnp.tanh(s / 50.0)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)

    site = the_site(f, q, k, v)
    assert not site.fused and "has no soft cap" in site.reason and "tanh" in site.reason, site
    assert_jits_program(f, q, k, v)


def _named_softmax(x):
    # x [T, S, B, N]: the softmax over S vmapped over T, B and N, as penzai's
    # named-axis `nmap` runs jax.nn.softmax (inside, S is moved last)
    f = jax.vmap(jax.nn.softmax, in_axes=1, out_axes=0)   # [S, N] -> [N, S]
    f = jax.vmap(f, in_axes=1, out_axes=0)                 # [S, B, N] -> [B, N, S]
    return jax.vmap(f, in_axes=0, out_axes=0)(x)           # [T, S, B, N] -> [T, B, N, S]


def _named_axes(q, k, v, mask):
    # penzai's spelling: the logits transposed to [T, S, B, N], masked there, and
    # the softmax under nmap
    s = jnp.einsum("btnh,bsnh->bnst", q, k) * np.float32(q.shape[-1] ** -0.5)
    s = jnp.transpose(s, (3, 2, 0, 1))
    s = jnp.where(mask, s, -1e30)
    return jnp.einsum("tbns,bsnh->btnh", _named_softmax(s), v)


@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
def test_a_softmax_under_named_axes_is_read_through_its_transposes(rng, mask_kind):
    """penzai's nmap runs the softmax with its axis moved last and the logits
    transposed to its named layout: rewritten, the masks read at the
    contraction's axes (a causal one as is_causal); forward and gradient."""
    b, t, n, h = 2, 8, 2, 4
    q, k, v = (_x(rng, b, t, n, h) for _ in range(3))
    if mask_kind == "causal":
        mask = jnp.asarray(np.tril(np.ones((t, t), bool)))[:, :, None, None]   # [T, S, 1, 1]
    else:
        pad = np.ones((b, t), bool)
        pad[1, 5:] = False
        mask = jnp.asarray(np.broadcast_to(pad.T[None, :, :, None], (t, t, b, 1)))  # [T, S, B, 1]

    def f(q, k, v):
        return _named_axes(q, k, v, mask)

    site = the_site(f, q, k, v)
    assert site.fused and ("causal" in site.spelling) == (mask_kind == "causal"), site
    check(f, q, k, v, grad_argnums=(0, 1, 2))
