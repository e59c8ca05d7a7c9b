"""Hand-written attention to `jax.nn.dot_product_attention`, which runs cuDNN's
fused flash attention on a GPU where it can (and XLA's own path elsewhere).

    fast = jaxfuse.optimize(model.apply, patterns=jaxfuse.rules.attention.rules())

Three forms, each written once in plain jax.numpy, cover the layers of four
libraries; the matcher's canonical forms absorb how each library lays out
the same computation (transposes and operand order around the contractions,
heads under `vmap`, a scale folded from constants or written as a literal,
`/ c` against `* (1 / c)`):

  attention                  q / sqrt(d) before the einsum, masked with
                             `jnp.where(mask, w, finfo.min)`: flax.linen,
                             flax.nnx with dropout set but deterministic (with
                             dropout 0 it already calls jax.nn's), equinox in
                             float32 (its heads vmapped)
  attention_float32_softmax  the same with the softmax in float32: equinox's
                             16-bit layers
  attention_logits_scaled    the logits divided by sqrt(d), masked with -1e30:
                             dm-haiku; declined for float16 masks, where -1e30
                             is -inf and a fully masked row is NaN while
                             jax.nn's stays finite

The forms differ in arithmetic (where the scale rounds, the softmax's
precision, the mask's fill), so none stands for another. The scale is the
layer's own 1/sqrt(d), d the head size: a static shape, so a Python float.
The implementation is chosen per match (`implementation`): cuDNN's fused
kernel on an NVIDIA GPU where its preconditions hold, XLA's path elsewhere.
Masks are bool (a float mask means `mask != 0`, as `jnp.where` reads it).
Values agree with the hand-written form within float32 rounding
(tests/rules/test_attention.py); the gradient is jax.nn's.
"""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp

from .. import _compat as C
from ..fusion.match.rule_engine import rule
from ..fusion.ir.target import target_platform

_B, _T, _N, _H = 2, 8, 4, 16  # example shapes the spellings are first traced at


def _example():
    return jax.ShapeDtypeStruct((_B, _T, _N, _H), jnp.float32)


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
    if bias is not None and bias.dtype != q.dtype:
        return "xla", f"a {bias.dtype} bias with {q.dtype} queries"
    if bias is not None and (q.shape[-3] % 2 or k.shape[-3] % 2):
        return "xla", f"sequence lengths {q.shape[-3]}, {k.shape[-3]}: with a bias cuDNN needs them even"
    return "cudnn", ""


def _fused(q, k, v, mask=None, bias=None):
    """jax.nn.dot_product_attention on (..., T, N, H), any number of leading
    batch dimensions (flattened into one), the layer's scale; mask and bias
    broadcast to (..., N, T, S) as the layers broadcast them; the
    implementation chosen for the platform being compiled for."""
    lead = q.shape[:-3]
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = (*lead, q.shape[-2], q.shape[-3], k.shape[-3])

    def four(x):
        return x.reshape((math.prod(lead), *x.shape[-3:]))

    if mask is not None:
        mask = four(jnp.broadcast_to(mask if mask.dtype == jnp.bool_ else mask != 0, logits))
    if bias is not None:
        bias = four(jnp.broadcast_to(bias, logits))
    q4, k4, v4 = four(q), four(k), four(v)
    platform = target_platform()
    gpu = platform in ("cuda", "gpu")
    impl, _ = implementation(q4, k4, v4, bias=bias, platform=platform,
                             compute_capability=C.gpu_compute_capability() if gpu else None,
                             cudnn_version=C.cudnn_version() if gpu else None)
    out = jax.nn.dot_product_attention(q4, k4, v4, bias=bias, mask=mask, scale=scale,
                                       implementation=impl)
    return out.reshape(q.shape[:-1] + v.shape[-1:])


def _same_dtypes(q, k, v, *rest):
    return q.dtype == k.dtype == v.dtype and len(q.shape) >= 3


def _not_float16(q, k, v, *rest):
    # -1e30 is -inf in float16: a fully masked row would be NaN, jax.nn's is finite
    return _same_dtypes(q, k, v) and q.dtype != jnp.float16


# ------------------------------------------------------------------ spellings
# Written once each, as the layers compute them; the matcher's canonical forms
# (jaxfuse.fusion.ir.canonical) absorb the rest: transposes and operand order
# around the two contractions, vmapped heads, `/ c` against `* (1 / c)`, a
# scale computed from constants or written as a literal.
def _logits(q, k, scale_queries: bool):
    if scale_queries:  # flax.linen, flax.nnx, equinox
        q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k)
    if not scale_queries:  # dm-haiku
        logits = logits / np.sqrt(k.shape[-1]).astype(k.dtype)
    return logits


def _weights(logits, float32_softmax: bool):
    dtype = logits.dtype
    if float32_softmax:  # equinox: the softmax in float32 for 16-bit inputs
        return jax.nn.softmax(logits.astype(jnp.promote_types(dtype, jnp.float32))).astype(dtype)
    return jax.nn.softmax(logits).astype(dtype)


def _attend(weights, v):
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def _form(scale_queries: bool, float32_softmax: bool, fill):
    """(plain, masked, bias+mask) spellings of one form."""

    def masked_logits(logits, mask):
        big_neg = jnp.finfo(logits.dtype).min if fill is None else fill
        return jnp.where(mask, logits, big_neg)

    def plain(q, k, v):
        return _attend(_weights(_logits(q, k, scale_queries), float32_softmax), v)

    def masked(q, k, v, mask):
        logits = masked_logits(_logits(q, k, scale_queries), mask)
        return _attend(_weights(logits, float32_softmax), v)

    def biased(q, k, v, mask, bias):
        logits = masked_logits(_logits(q, k, scale_queries) + bias, mask)
        return _attend(_weights(logits, float32_softmax), v)

    return plain, masked, biased


# name -> (queries scaled (else logits), softmax in float32, mask fill (None: finfo.min),
#          with a bias form, where masked)
_FORMS = {
    # flax.linen and flax.nnx (with dropout set but deterministic), equinox in float32
    "attention": (True, False, None, True, _same_dtypes),
    # equinox at 16 bits: its softmax runs in float32
    "attention_float32_softmax": (True, True, None, False, _same_dtypes),
    # dm-haiku: the logits divided by sqrt(d), masked with -1e30
    "attention_logits_scaled": (False, False, -1e30, False, _not_float16),
}


def rules(forms=None) -> list:
    """The attention rules, one per form and masking (default: every form).

    Forms: "attention" (queries scaled by 1/sqrt(d), masked with the dtype's
    lowest value: flax.linen, flax.nnx, equinox in float32),
    "attention_float32_softmax" (equinox's 16-bit layers) and
    "attention_logits_scaled" (dm-haiku: the logits scaled, masked with
    -1e30; declined for float16 masks). Each comes unmasked, masked
    (`_masked`) and, for "attention", with a bias before the mask
    (`_bias_masked`)."""
    out = []
    for name in forms or _FORMS:
        scale_queries, float32_softmax, fill, with_bias, masked_where = _FORMS[name]
        plain, masked, biased = _form(scale_queries, float32_softmax, fill)
        mask = jax.ShapeDtypeStruct((_B, _N, _T, _T), jnp.bool_)
        logits = jax.ShapeDtypeStruct((_B, _N, _T, _T), jnp.float32)
        out.append(rule(plain, lambda q, k, v: _fused(q, k, v), name=name,
                        example_args=(_example(),) * 3, where=_same_dtypes))
        out.append(rule(masked, lambda q, k, v, m: _fused(q, k, v, m), name=f"{name}_masked",
                        example_args=(*(_example(),) * 3, mask), where=masked_where))
        if with_bias:
            out.append(rule(biased, lambda q, k, v, m, b: _fused(q, k, v, m, b),
                            name=f"{name}_bias_masked",
                            example_args=(*(_example(),) * 3, mask, logits), where=masked_where))
    return out
