"""Liger Kernel's RMSNorm, SwiGLU and GeGLU, written as JAX custom_vjps the
way Liger writes its Triton kernels, against XLA's own fusion of the plain
code (as HF transformers' Flax Llama spells it) in a train step: compiled temp
bytes and time, paired and interleaved in one process.

    python benchmarks/probes/norm_gated.py [--tokens 1024] [--width 256] [--inner 688]
                                           [--rounds 15] [--layers 2]

Liger's kernels save memory by what they keep for the backward pass: RMSNorm
keeps the input and one reciprocal root per row (not the normalized rows);
SwiGLU and GeGLU keep the two projections and recompute the activation in the
backward pass (not the activation's output). The question is whether XLA's
fusion of the plain code already does as well: its fusion duplicates cheap
elementwise producers into each consumer, so a residual that is an
elementwise function of a value kept anyway costs it no buffer.

What it found (2-core CPU, jax 0.10.2; benchmarks/results/notes/
2026-12-04-cross-entropy.md): Liger's RMSNorm and SwiGLU hold exactly the
temp bytes of the plain program and tie its time; Liger's GeGLU held 0.85x
and took 0.83x, but the same backward with the same residuals, its product
spelled `a * cdf`, holds exactly the plain program's bytes: the difference
is how XLA packs that backward's buffers, not what Liger keeps, so no rule
rests on it.

The program: `layers` blocks of `h = h + mlp(rmsnorm(h))`, mlp a gated unit
(`down(act(gate(x)) * up(x))`), loss `mean(h ** 2)`, `jax.value_and_grad`
with respect to every weight and the input.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import jax
import jax.numpy as jnp

EPS = 1e-6


# ------------------------------------------------------------------ plain
def rmsnorm_plain(x, w):
    """HF transformers' FlaxLlamaRMSNorm."""
    variance = jnp.power(jnp.asarray(x, jnp.float32), 2).mean(-1, keepdims=True)
    return w * jnp.asarray(x / jnp.sqrt(variance + EPS), x.dtype)


def swiglu_plain(a, b):
    return jax.nn.silu(a) * b


def geglu_plain(a, b):
    return jax.nn.gelu(a, approximate=True) * b


# ------------------------------------------------------------------ Liger
@jax.custom_vjp
def rmsnorm_liger(x, w):
    return rmsnorm_plain(x, w)


def _rms_fwd(x, w):
    rstd = jax.lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + EPS)
    y = w * (x * rstd).astype(x.dtype)
    return y, (x, w, rstd)  # one float per row, not the normalized rows


def _rms_bwd(res, dy):
    x, w, rstd = res
    xhat = x * rstd
    dxhat = dy * w
    dx = rstd * (dxhat - xhat * jnp.mean(dxhat * xhat, -1, keepdims=True))
    dw = jnp.sum((dy * xhat).reshape(-1, x.shape[-1]), 0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


rmsnorm_liger.defvjp(_rms_fwd, _rms_bwd)


@jax.custom_vjp
def swiglu_liger(a, b):
    return swiglu_plain(a, b)


def _swiglu_fwd(a, b):
    return swiglu_plain(a, b), (a, b)  # the activation is recomputed in the backward


def _swiglu_bwd(res, dy):
    a, b = res
    s = jax.nn.sigmoid(a)
    silu = a * s
    return dy * b * (s * (1 + a * (1 - s))), dy * silu


swiglu_liger.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def geglu_liger(a, b):
    return geglu_plain(a, b)


def _geglu_fwd(a, b):
    return geglu_plain(a, b), (a, b)


def _geglu_bwd(res, dy):
    a, b = res
    c = np.sqrt(2 / np.pi)
    inner = c * (a + 0.044715 * a ** 3)
    t = jnp.tanh(inner)
    gelu = 0.5 * a * (1 + t)
    dgelu = 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * 0.044715 * a * a)
    return dy * b * dgelu, dy * gelu


geglu_liger.defvjp(_geglu_fwd, _geglu_bwd)


@jax.custom_vjp
def geglu_liger_cdf(a, b):
    """Liger's GeGLU again, the same residuals (a, b), the backward's product
    spelled `a * cdf` rather than `0.5 * a * (1 + t)`: the same arithmetic."""
    return geglu_plain(a, b)


def _geglu_cdf_bwd(res, dy):
    a, b = res
    c = np.sqrt(2 / np.pi)
    t = jnp.tanh(c * (a + 0.044715 * a ** 3))
    cdf = 0.5 * (1 + t)
    dgelu = cdf + a * (0.5 * (1 - t * t)) * c * (1 + 3 * 0.044715 * a * a)
    return dy * b * dgelu, dy * (a * cdf)


geglu_liger_cdf.defvjp(_geglu_fwd, _geglu_cdf_bwd)


@jax.custom_vjp
def gelu_liger(a):
    """The tanh GELU alone (GPT-2's `gelu_new`), its input kept, the rest recomputed."""
    return jax.nn.gelu(a, approximate=True)


def _gelu_fwd(a):
    return gelu_liger(a), a


def _gelu_bwd(a, dy):
    return (_geglu_bwd((a, jnp.ones_like(a)), dy)[0],)


gelu_liger.defvjp(_gelu_fwd, _gelu_bwd)


def geglu_gelu_liger(a, b):
    return gelu_liger(a) * b


# ---------------------------------------------------------------- program
def make_step(norm, gated, layers):
    def loss(params, x):
        h = x
        for p in params:
            n = norm(h, p["norm"])
            h = h + gated(n @ p["gate"], n @ p["up"]) @ p["down"]
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1))


def init(key, layers, width, inner, dtype):
    params = []
    for k in jax.random.split(key, layers):
        k1, k2, k3 = jax.random.split(k, 3)
        params.append({"norm": jnp.ones(width, dtype),
                       "gate": (jax.random.normal(k1, (width, inner)) / np.sqrt(width)).astype(dtype),
                       "up": (jax.random.normal(k2, (width, inner)) / np.sqrt(width)).astype(dtype),
                       "down": (jax.random.normal(k3, (inner, width)) / np.sqrt(inner)).astype(dtype)})
    return params


def measure(args):
    dtype = jnp.dtype(args.dtype)
    params = init(jax.random.key(0), args.layers, args.width, args.inner, dtype)
    x = jax.random.normal(jax.random.key(1), (args.tokens, args.width)).astype(dtype)
    variants = {
        "plain rmsnorm + swiglu": (rmsnorm_plain, swiglu_plain),
        "liger rmsnorm + plain swiglu": (rmsnorm_liger, swiglu_plain),
        "plain rmsnorm + liger swiglu": (rmsnorm_plain, swiglu_liger),
        "plain rmsnorm + geglu": (rmsnorm_plain, geglu_plain),
        "plain rmsnorm + liger geglu": (rmsnorm_plain, geglu_liger),
        "plain rmsnorm + liger geglu (a*cdf)": (rmsnorm_plain, geglu_liger_cdf),
        "plain rmsnorm + liger gelu * b": (rmsnorm_plain, geglu_gelu_liger),
    }
    compiled, temp, values = {}, {}, {}
    for name, (norm, gated) in variants.items():
        c = jax.jit(make_step(norm, gated, args.layers)).lower(params, x).compile()
        compiled[name] = c
        temp[name] = c.memory_analysis().temp_size_in_bytes
        values[name] = jax.block_until_ready(c(params, x))
    # the Liger forms compute the same gradients (within float32 rounding)
    for name, ref in (("liger rmsnorm + plain swiglu", "plain rmsnorm + swiglu"),
                      ("plain rmsnorm + liger swiglu", "plain rmsnorm + swiglu"),
                      ("plain rmsnorm + liger geglu", "plain rmsnorm + geglu"),
                      ("plain rmsnorm + liger geglu (a*cdf)", "plain rmsnorm + geglu"),
                      ("plain rmsnorm + liger gelu * b", "plain rmsnorm + geglu")):
        for g, w in zip(jax.tree.leaves(values[name]), jax.tree.leaves(values[ref])):
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                       rtol=1e-4, atol=1e-6)
    times = {k: [] for k in compiled}
    names = list(compiled)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t = time.perf_counter()
            jax.block_until_ready(compiled[name](params, x))
            times[name].append(time.perf_counter() - t)
    return temp, times


def _ci(ratios, rng):
    boot = [np.median(rng.choice(ratios, len(ratios))) for _ in range(2000)]
    return float(np.median(ratios)), float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--inner", type=int, default=688)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import os
    load = os.getloadavg()
    temp, times = measure(args)
    rng = np.random.default_rng(0)
    out = {"args": vars(args), "load_before": load, "load_after": os.getloadavg(), "rows": []}
    print(f"tokens {args.tokens}, width {args.width}, inner {args.inner}, {args.layers} layers, "
          f"{args.dtype}; load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    pairs = {"liger rmsnorm + plain swiglu": "plain rmsnorm + swiglu",
             "plain rmsnorm + liger swiglu": "plain rmsnorm + swiglu",
             "plain rmsnorm + liger geglu": "plain rmsnorm + geglu",
             "plain rmsnorm + liger geglu (a*cdf)": "plain rmsnorm + geglu",
             "plain rmsnorm + liger gelu * b": "plain rmsnorm + geglu"}
    for name in times:
        base = pairs.get(name)
        row = {"variant": name, "temp_bytes": temp[name], "median_ms": 1e3 * float(np.median(times[name]))}
        if base:
            ratios = np.array(times[name]) / np.array(times[base])
            row["time_ratio"] = _ci(ratios, rng)
            row["temp_ratio"] = temp[name] / temp[base]
        out["rows"].append(row)
        extra = (f"  temp/plain {row['temp_ratio']:.3f}  time/plain {row['time_ratio'][0]:.3f} "
                 f"[{row['time_ratio'][1]:.3f}, {row['time_ratio'][2]:.3f}]") if base else ""
        print(f"{name:36s} temp {temp[name] / 2**20:8.2f} MiB  median {row['median_ms']:8.2f} ms{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
