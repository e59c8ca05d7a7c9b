"""The cross-entropy rule's chunk budget and its two ways to the gradient, on
the train step of jaxfuse's issue 45: HF transformers' Flax Llama (random
weights), width 256, 2 layers, batch 4 x 256 tokens, `jax.value_and_grad` of
`optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()`.

    python benchmarks/probes/xent_budget.py --vocab 32000 --rounds 9 \\
        --budgets 8,16,32,64,128 --recompute 32 [--json out.json]

Each variant is compiled once; temp bytes are XLA's `memory_analysis()`;
times are paired rounds interleaved in one process (order reversed every
other round), the ratio to jit's round by round, its median with a bootstrap
95% interval. Variants:

  jit                 `jax.jit` of the step
  in-program B MiB    `jaxfuse.optimize` of the step with `cross_entropy.rules(B MiB)`:
                      the gradient's equations are in the program, one pass over
                      the chunks computes loss and gradients (Liger's way)
  custom_vjp B MiB    `jax.value_and_grad` of `jaxfuse.optimize(loss)`: the rule's own
                      backward recomputes each chunk's logits (Cut Cross-Entropy's way)
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import numpy as np

import jax
import jax.numpy as jnp

MIB = 1 << 20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--budgets", default="8,16,32,64,128", help="MiB, comma-separated")
    p.add_argument("--recompute", default="32", help="budgets (MiB) to time the custom_vjp at")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import optax
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    import jaxfuse
    from jaxfuse.rules import cross_entropy

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FlaxLlamaForCausalLM(cfg, seed=0)
    params = model.params
    ids = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (4, 256)), jnp.int32)

    def loss(params, ids):
        logits = model(ids, params=params).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    step = jax.value_and_grad(loss)
    variants = {"jit": jax.jit(step).lower(params, ids).compile()}
    recompute = {int(b) for b in args.recompute.split(",") if b}
    for b in (int(x) for x in args.budgets.split(",")):
        rules = cross_entropy.rules(b * MIB)
        variants[f"in-program {b} MiB"] = jaxfuse.optimize(
            step, patterns=rules, policy="always").lower(params, ids).compile()
        if b in recompute:
            variants[f"custom_vjp {b} MiB"] = jax.jit(jax.value_and_grad(jaxfuse.optimize(
                loss, patterns=rules, policy="always"))).lower(params, ids).compile()
    temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in variants.items()}
    for c in variants.values():
        jax.block_until_ready(c(params, ids))
    times = {k: [] for k in variants}
    names = list(variants)
    load = os.getloadavg()
    for r in range(args.rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(variants[k](params, ids))
            times[k].append(time.perf_counter() - t)
    rng = np.random.default_rng(0)
    out = {"vocab": args.vocab, "load": [load, os.getloadavg()], "rows": []}
    print(f"V={args.vocab} load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    for k in names:
        ratio = np.array(times[k]) / np.array(times["jit"])
        boot = [np.median(rng.choice(ratio, len(ratio))) for _ in range(2000)]
        row = dict(variant=k, temp=temp[k], temp_ratio=temp[k] / temp["jit"],
                   ms=1e3 * float(np.median(times[k])), ratio=float(np.median(ratio)),
                   ci=[float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))])
        out["rows"].append(row)
        print(f"{k:22s} temp {temp[k] / MIB:8.1f} MiB ({row['temp_ratio']:.3f}x)  "
              f"{row['ms']:8.0f} ms  t/jit {row['ratio']:.3f} [{row['ci'][0]:.3f}, {row['ci'][1]:.3f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
