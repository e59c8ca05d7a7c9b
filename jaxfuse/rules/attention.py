"""Hand-written attention to `jax.nn.dot_product_attention`, which runs cuDNN's
fused flash attention on a GPU where it can (and XLA's own path elsewhere).

    rules = jaxfuse.rules.attention.rules()          # every spelling whose library is installed
    fast = jaxfuse.optimize(model.apply, patterns=rules)

Each spelling is the library's own code for the attention core (called as the
layer calls it, dropout off; flax's also with a bias and a mask together), so
a match reproduces its equations exactly at
the matched shapes (jaxfuse.rule re-traces and compares them):

  flax_linen  flax.linen.dot_product_attention: q / sqrt(d) before the einsum,
              masked with `jnp.where(mask, w, finfo.min)`
  flax_nnx    flax.nnx.dot_product_attention with dropout set but deterministic
              (with dropout 0 it already calls jax.nn.dot_product_attention)
  haiku       hk.MultiHeadAttention's: the logits divided by sqrt(d), masked
              with -1e30; declined for float16, where -1e30 is -inf and a fully
              masked row is NaN while jax.nn's stays finite
  equinox     eqx.nn.MultiheadAttention's: vmapped over heads (and over a batch,
              as models call it), q / sqrt(d), softmax in float32

The scale is the layer's own 1/sqrt(d), d the head size: a static shape, so a
Python float. The implementation is chosen per match (`implementation`):
cuDNN's fused kernel on an NVIDIA GPU where its preconditions hold, XLA's
path elsewhere. Masks are bool (a float mask means `mask != 0`, as `jnp.where`
reads it). Values agree with the hand-written form within float32 rounding
(tests/test_attention_rule.py); the gradient is jax.nn's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from .. import _compat as C
from ..rewrite.rules import rule
from ..rewrite.target import target_platform

_B, _T, _N, _H = 2, 8, 4, 16  # example shapes the spellings are first traced at


def _example(batch: bool = True):
    shape = (_B, _T, _N, _H) if batch else (_T, _N, _H)
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _mask_example(batch: bool = True):
    shape = (_B, _N, _T, _T) if batch else (_N, _T, _T)
    return jax.ShapeDtypeStruct(shape, jnp.bool_)


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


# ------------------------------------------------------------------ spellings
def _flax_linen():
    from flax.linen import dot_product_attention

    plain = lambda q, k, v: dot_product_attention(q, k, v)  # noqa: E731
    masked = lambda q, k, v, mask: dot_product_attention(q, k, v, mask=mask)  # noqa: E731
    biased = lambda q, k, v, mask, bias: dot_product_attention(  # noqa: E731
        q, k, v, bias=bias, mask=mask)
    return plain, masked, biased


def _flax_nnx():
    from flax.nnx import dot_product_attention

    kw = dict(dropout_rate=0.5, deterministic=True)  # the naive path, no dropout applied
    plain = lambda q, k, v: dot_product_attention(q, k, v, **kw)  # noqa: E731
    masked = lambda q, k, v, mask: dot_product_attention(q, k, v, mask=mask, **kw)  # noqa: E731
    biased = lambda q, k, v, mask, bias: dot_product_attention(  # noqa: E731
        q, k, v, bias=bias, mask=mask, **kw)
    return plain, masked, biased


def _haiku_core(q, k, v, mask=None):
    # hk.MultiHeadAttention.__call__, between the projections.
    import numpy as np

    logits = jnp.einsum("...thd,...Thd->...htT", q, k)
    logits = logits / np.sqrt(k.shape[-1]).astype(k.dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, -1e30)
    weights = jax.nn.softmax(logits)
    return jnp.einsum("...htT,...Thd->...thd", weights, v)


def _haiku():
    import haiku  # noqa: F401  (only so that the spelling ships with the library)

    return (lambda q, k, v: _haiku_core(q, k, v),
            lambda q, k, v, mask: _haiku_core(q, k, v, mask))


def _equinox():
    from equinox.nn._attention import dot_product_attention

    one = functools.partial(dot_product_attention, dropout=None)
    heads = jax.vmap(one, in_axes=1, out_axes=1)
    # a (S, S) mask, the same for every head: eqx closes over it
    heads_masked = lambda q, k, v, m: jax.vmap(  # noqa: E731
        functools.partial(one, mask=m), in_axes=1, out_axes=1)(q, k, v)
    return heads, heads_masked


# library -> its (unmasked, masked) spellings
_LIBRARIES = {"flax_linen": _flax_linen, "flax_nnx": _flax_nnx, "haiku": _haiku,
              "equinox": _equinox}


def _not_float16_masked(q, k, v, mask):
    return _same_dtypes(q, k, v) and q.dtype != jnp.float16


def rules(libraries=None) -> list:
    """The attention rules for `libraries` (default: every one installed),
    masked and unmasked; a library that is not installed is left out."""
    out = []
    for lib in libraries or _LIBRARIES:
        try:
            plain, masked, *biased = _LIBRARIES[lib]()
        except ImportError:
            continue
        if lib == "equinox":
            # as a layer is called on one example (S, H, D), and vmapped over a batch
            batched, batched_masked = jax.vmap(plain), jax.vmap(masked, in_axes=(0, 0, 0, None))
            square = jax.ShapeDtypeStruct((_T, _T), jnp.bool_)
            spellings = [(plain, (_example(False),) * 3, None),
                         (batched, (_example(),) * 3, None),
                         (masked, (*(_example(False),) * 3, square), None),
                         (batched_masked, (*(_example(),) * 3, square), None)]
        else:
            unmasked_where = _same_dtypes
            masked_where = _not_float16_masked if lib == "haiku" else _same_dtypes
            spellings = [(plain, (_example(),) * 3, unmasked_where),
                         (masked, (*(_example(),) * 3, _mask_example()), masked_where)]
            logits = jax.ShapeDtypeStruct((_B, _N, _T, _T), jnp.float32)
            spellings += [(p, (*(_example(),) * 3, _mask_example(), logits), _same_dtypes)
                          for p in biased]
        for k, (pattern, examples, where) in enumerate(spellings):
            form = {3: "", 4: "_masked", 5: "_bias_masked"}[len(examples)]
            name = f"attention_{lib}{form}"
            if lib == "equinox" and k in (1, 3):
                name += "_batched"
            fused = _equinox_fused if lib == "equinox" else _fused
            replacement = {
                3: lambda q, k, v, f=fused: f(q, k, v),
                4: lambda q, k, v, mask, f=fused: f(q, k, v, mask),
                5: lambda q, k, v, mask, bias: _fused(q, k, v, mask, bias),
            }[len(examples)]
            out.append(rule(pattern, replacement, name=name, example_args=examples,
                            where=where or _same_dtypes))
    return out


def _equinox_fused(q, k, v, mask=None):
    """`_fused` for equinox's layouts: (..., S, H, D), an (S, S) mask for every head."""
    return _fused(q, k, v, None if mask is None else mask[None])
