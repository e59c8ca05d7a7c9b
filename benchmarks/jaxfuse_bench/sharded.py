"""A sharded language-model train step on CPU host devices (jaxfuse issue 57).

    python -m jaxfuse_bench.sharded [--quick] [--rounds N] [--json PATH]
    jaxfuse-bench --sharded ...   (runs this in its own process)

Its own process: the host devices (``--xla_force_host_platform_device_count``)
must be set before jax starts. On a 2 x 2 mesh ``data`` x ``model``, the step
``jax.value_and_grad`` of ``optax.softmax_cross_entropy_with_integer_labels(x @
W, labels).mean()`` with x and the labels on ``data``, and W
replicated (data parallel), its vocabulary on ``model`` (tensor parallel) or
its rows on ``data`` (FSDP). Modes: ``xla`` (``jax.jit``), ``jaxfuse`` (the
default ``policy="auto"`` with the cross-entropy rule) and ``jaxfuse-always``.
Per case: whether the rule applied, the time against jit's (the median of
per-round ratios of interleaved rounds, with a bootstrap 95% interval), the
temp bytes per device XLA reports and the bytes the collectives move per call
(`jaxfuse.fusion.tuning.hlo_collectives`: result bytes times loop trips).
On CPU host devices a collective is a copy in memory; across hosts it crosses
the network.
"""

from __future__ import annotations

import os
import sys

DEVICES = 4
if __name__ == "__main__":  # before jax starts: its own process
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

# (batch, tokens, width, vocabulary): the x [8, 256, 256], W [256, 32000]
SIZES = {"quick": (8, 64, 128, 8000), "cpu": (8, 256, 256, 32000)}
LAYOUTS = ("data_parallel", "tensor_parallel", "fsdp")
MODES = ("xla", "jaxfuse", "jaxfuse-always")


def _specs(layout):
    from jax.sharding import PartitionSpec as P

    return {"data_parallel": (P("data"), P()), "tensor_parallel": (P("data"), P(None, "model")),
            "fsdp": (P("data"), P("data", None))}[layout]


def run(size, rounds: int, reps: int, seed: int = 0) -> list[dict]:
    import numpy as np

    import jax
    import optax
    from jax.sharding import NamedSharding

    import jaxfuse
    from jaxfuse.fusion.ir.subjaxprs import all_eqns
    from jaxfuse.fusion.tuning.hlo_collectives import collective_bytes
    from jaxfuse.rules import cross_entropy as X

    from .timing import ratio_ci

    if jax.device_count() < DEVICES:
        raise SystemExit(f"jaxfuse_bench.sharded: needs {DEVICES} devices, jax sees "
                         f"{jax.device_count()} (run it as its own process)")
    batch, tokens, width, vocab = size
    kind = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind),
                         devices=jax.devices()[:DEVICES])

    def loss(x, w, labels):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()

    step = jax.value_and_grad(loss, argnums=(0, 1))
    rng = np.random.default_rng(seed)
    host = (rng.standard_normal((batch, tokens, width)).astype(np.float32),
            (rng.standard_normal((width, vocab)) / np.sqrt(width)).astype(np.float32),
            rng.integers(0, vocab, (batch, tokens)).astype(np.int32))
    records = []
    for layout in LAYOUTS:
        xs, ws = _specs(layout)
        args = tuple(jax.device_put(a, NamedSharding(mesh, s))
                     for a, s in zip(host, (xs, ws, xs)))
        fns = {"xla": jax.jit(step),
               "jaxfuse": jaxfuse.optimize(step, patterns=X.rules()),
               "jaxfuse-always": jaxfuse.optimize(step, patterns=X.rules(), policy="always")}
        compiled, facts = {}, {}
        for m, f in fns.items():
            c = f.lower(*args).compile()
            compiled[m] = c
            comm = collective_bytes(c.as_text())
            sites = (0 if m == "xla" else
                     sum(e.params.get("name") == X.NAME for e in all_eqns(f.trace(*args).jaxpr)))
            facts[m] = {"temp": c.memory_analysis().temp_size_in_bytes, "moved": comm.bytes,
                        "collectives": comm.count, "sites": sites}
            jax.block_until_ready(c(*args))  # warm
        samples = {m: [] for m in MODES}
        for r in range(rounds):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for m in order:
                t0 = time.perf_counter()
                for _ in range(reps):
                    out = compiled[m](*args)
                jax.block_until_ready(out)
                samples[m].append((time.perf_counter() - t0) / reps)
        for m in MODES:
            ratio = (1.0, 1.0, 1.0) if m == "xla" else ratio_ci(samples[m], samples["xla"])
            records.append({"workload": "sharded_xent_train", "layout": layout, "mode": m,
                            "shape": list(size), "mesh": "2x2 data x model",
                            "median_s": sorted(samples[m])[len(samples[m]) // 2],
                            "t_over_xla": ratio[0], "ci": [ratio[1], ratio[2]],
                            "temp_over_xla": facts[m]["temp"] / max(1, facts["xla"]["temp"]),
                            "moved_over_xla": (facts[m]["moved"] / facts["xla"]["moved"]
                                               if facts["xla"]["moved"] else None),
                            **facts[m]})
    return records


def table(records) -> str:
    def mib(n):
        return f"{n / 2**20:.1f} MiB"

    lines = ["layout           mode            rule  t/xla [95% CI]         temp/device       "
             "moved/call (collectives)"]
    for r in records:
        lines.append(
            f"{r['layout']:<16} {r['mode']:<15} {r['sites']:>4}  "
            f"{r['t_over_xla']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]  "
            f"{mib(r['temp']):>9} ({r['temp_over_xla']:.2f}x)  "
            f"{mib(r['moved']):>9} ({r['collectives']})")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m jaxfuse_bench.sharded", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smaller step (seconds, not minutes)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15; quick 7)")
    p.add_argument("--reps", type=int, default=None, help="calls per round (default 3; quick 5)")
    p.add_argument("--size", type=lambda t: tuple(int(v) for v in t.lower().split("x")),
                   default=None, metavar="BxSxHxV",
                   help="batch x tokens x width x vocabulary (default: the issue's 8x256x256x32000; "
                        "quick 8x64x128x8000)")
    p.add_argument("--json", metavar="PATH", help="write the records as JSON")
    a = p.parse_args(argv)
    size = a.size or SIZES["quick" if a.quick else "cpu"]
    records = run(size, a.rounds or (7 if a.quick else 15), a.reps or (5 if a.quick else 3))
    print(f"sharded_xent_train {'x'.join(map(str, size))} (batch x tokens x width x vocabulary) "
          f"on {DEVICES} host devices:")
    print(table(records))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
