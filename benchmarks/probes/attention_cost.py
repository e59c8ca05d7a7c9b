"""Attention alone: the hand-written form HF transformers' Flax models run
against `jax.nn.dot_product_attention` as the attention rule calls it, per
shape and dtype: time (paired, interleaved rounds) and XLA's temp bytes.

    python benchmarks/probes/attention_cost.py [--reps 15] [--out FILE.json]
    python benchmarks/probes/attention_cost.py --models hf_bert_encoder,hf_gpt2_decoder \
        --shapes 8x64,8x128,4x256 [--dtypes float32]

Forms (q, k, v of shape (B, T, 12, 64), a padding mask (B, T) with padded keys):
  hand           flax's `dot_product_attention_weights` as HF calls it: q / sqrt(d),
                 einsum, + `lax.select(mask > 0, 0, finfo.min)`, softmax in the
                 dtype, einsum (BERT, RoBERTa, ... ; bfloat16 softmax in bfloat16)
  hand_f32       the same with q, k and the softmax in float32 (Llama, Mistral,
                 Gemma, BLOOM at 16 bits); only for 16-bit dtypes
  nn_mask        jax.nn.dot_product_attention(q, k, v, mask=(B, 1, 1, T) bool):
                 what the rule gives the padding bias
  nn_bias        the same with the additive bias passed as `bias` (the issue's table)
and, causal (GPT-2 and the decoders): hand_causal (make_causal_mask sliced and
combined with padding, as a bias) against nn_causal (is_causal=True plus the
padding mask). The attention rule's cost function (jaxfuse/rules/attention.py)
reads its CPU decisions from these numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfuse_bench.timing import measure_interleaved, ratio_ci
from jaxfuse_bench.workloads import memory_stats

HEADS, HEAD = 12, 64


def _bias(mask, dtype):
    m = mask[:, None, None, :]
    return lax.select(m > 0, jnp.full(m.shape, 0.0, dtype), jnp.full(m.shape, jnp.finfo(dtype).min, dtype))


def _causal_bias(mask, t, dtype):
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
    both = jnp.logical_and(mask[:, None, None, :] > 0, causal)
    return lax.select(both, jnp.full(both.shape, 0.0, dtype), jnp.full(both.shape, jnp.finfo(dtype).min, dtype))


def _hand(q, k, v, bias, f32=False):
    dtype = q.dtype
    if f32:
        q, k = q.astype(jnp.float32), k.astype(jnp.float32)
        bias = bias.astype(jnp.float32)
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    w = jnp.einsum("...qhd,...khd->...hqk", q, k) + bias
    w = jax.nn.softmax(w).astype(q.dtype)
    if f32:
        w = w.astype(dtype)
    return jnp.einsum("...hqk,...khd->...qhd", w, v)


FORMS = {
    "hand": lambda q, k, v, m: _hand(q, k, v, _bias(m, q.dtype)),
    "hand_f32": lambda q, k, v, m: _hand(q, k, v, _bias(m, jnp.float32), f32=True),
    "nn_mask": lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=(m > 0)[:, None, None, :]),
    "nn_bias": lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, bias=_bias(m, q.dtype)),
    "hand_causal": lambda q, k, v, m: _hand(q, k, v, _causal_bias(m, q.shape[1], q.dtype)),
    "nn_causal": lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=(m > 0)[:, None, None, :], is_causal=True),
}


def run(shapes, dtypes, reps):
    rows = []
    for dtype in dtypes:
        for b, t in shapes:
            rng = np.random.default_rng(0)
            q, k, v = (jnp.asarray(rng.standard_normal((b, t, HEADS, HEAD)), dtype) for _ in range(3))
            mask = np.ones((b, t), np.int32)
            mask[:, t - t // 4:] = 0  # a quarter of the keys padded
            mask = jnp.asarray(mask)
            names = [n for n in FORMS if n != "hand_f32" or dtype != "float32"]
            fns = {n: jax.jit(FORMS[n]) for n in names}
            mem = {}
            for n in names:
                compiled = fns[n].lower(q, k, v, mask).compile()
                mem[n] = memory_stats(compiled.memory_analysis())
            ref = np.asarray(fns["hand"](q, k, v, mask), np.float64)
            diffs = {n: float(np.max(np.abs(np.asarray(fns[n](q, k, v, mask), np.float64) - ref)))
                     for n in ("nn_mask", "nn_bias")}
            cases = {n: (lambda f: lambda i: f(q, k, v, mask))(fns[n]) for n in names}
            res = measure_interleaved(cases, reps=reps)
            for n in names:
                base = "hand_causal" if n == "nn_causal" else "hand"
                r = ratio_ci(res[n][0].samples, res[base][0].samples)
                row = dict(dtype=dtype, batch=b, tokens=t, form=n, median_s=res[n][0].median,
                           ratio_vs_hand=r[0], ci=[r[1], r[2]], temp=mem[n]["temp"],
                           temp_vs_hand=(mem[n]["temp"] / mem[base]["temp"]) if mem[base]["temp"] else None,
                           max_abs_diff=diffs.get(n))
                rows.append(row)
                print(f"{dtype:9s} {b:3d}x{t:<5d} {n:12s} {row['median_s'] * 1e3:8.2f} ms  "
                      f"x{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]  temp {mem[n]['temp'] / 2**20:7.2f} MiB "
                      f"(x{row['temp_vs_hand'] or float('nan'):.2f})"
                      + (f"  max|diff| {diffs[n]:.3g}" if n in diffs else ""), flush=True)
    return rows


def run_models(workloads, shapes, dtypes, reps):
    """The benchmark's HF workloads (jaxfuse_bench.models) at `shapes`: jax.jit
    against every attention site rewritten (policy="always"), paired."""
    import jaxfuse
    from jaxfuse_bench import models

    rows = []
    for wl in workloads:
        for dtype in dtypes:
            for b, t in shapes:
                spec = models.BUILDERS[wl]((b, t), jnp.dtype(dtype), jax.random.key(1))
                data = models._data_sets(spec.data_shapes, jnp.dtype(dtype), 1, 0)[0]
                fns = {"xla": jax.jit(spec.fn),
                       "rule": jaxfuse.optimize(spec.fn, patterns=list(spec.rules), policy="always")}
                temp = {n: memory_stats(f.lower(spec.params, *data).compile().memory_analysis())["temp"]
                        for n, f in fns.items()}
                cases = {n: (lambda f: lambda i: f(spec.params, *data))(f) for n, f in fns.items()}
                res = measure_interleaved(cases, reps=reps)
                r = ratio_ci(res["rule"][0].samples, res["xla"][0].samples)
                row = dict(workload=wl, dtype=dtype, batch=b, tokens=t, xla_s=res["xla"][0].median,
                           rule_s=res["rule"][0].median, ratio=r[0], ci=[r[1], r[2]],
                           temp_xla=temp["xla"], temp_rule=temp["rule"])
                rows.append(row)
                print(f"{wl:16s} {dtype:9s} {b:3d}x{t:<5d} xla {row['xla_s'] * 1e3:8.2f} ms  rule "
                      f"x{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]  temp {temp['xla'] / 2**20:6.1f} -> "
                      f"{temp['rule'] / 2**20:6.1f} MiB", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", default="8x128,2x512,4x256,16x64,1x1024")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--models", default=None,
                    help="instead: time these benchmark workloads (hf_bert_encoder, hf_gpt2_decoder) "
                         "under jit and with every attention site rewritten, at --shapes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    load = os.getloadavg()
    print(f"jax {jax.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {load[0]:.2f}", flush=True)
    if args.models:
        rows = run_models(args.models.split(","), shapes, args.dtypes.split(","), args.reps)
    else:
        rows = run(shapes, args.dtypes.split(","), args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "cpus": os.cpu_count(), "load_before": load,
                       "load_after": os.getloadavg(), "heads": HEADS, "head": HEAD,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
