"""One process of tests/fusion/test_distributed.py: joins a `jax.distributed` job on
localhost (CPU, gloo collectives, 4 devices per process), runs `optimize` on
programs sharded across the processes, and writes what it saw as JSON.

    python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.json CACHE_DIR
"""

from __future__ import annotations

import json
import sys
import traceback


def main(process_id: int, processes: int, port: int, out_path: str, cache_dir: str) -> None:
    result: dict = {"process": process_id}
    try:
        import jax

        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.config.update("jax_num_cpu_devices", 4)
            jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                                       num_processes=processes, process_id=process_id,
                                       initialization_timeout=30)
        except Exception as e:  # noqa: BLE001 - reported as a skip by the test
            result["skip"] = f"jax {jax.__version__} cannot run several CPU processes: {e}"
            return
        result.update(checks(cache_dir))
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - the test shows it
        result["error"] = traceback.format_exc()
    finally:
        with open(out_path, "w") as f:
            json.dump(result, f)


def _same_shards(a, b) -> bool:
    import numpy as np

    bits = lambda a: np.atleast_1d(np.asarray(a.data)).view(np.uint8)  # noqa: E731
    return all(np.array_equal(bits(x), bits(y))
               for x, y in zip(a.addressable_shards, b.addressable_shards, strict=False))


def _global(mesh, spec, host):
    import jax

    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])


def checks(cache_dir: str) -> dict:
    import numpy as np

    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import jaxfuse
    from jaxfuse.fusion.tuning import autotuner as tuning

    out: dict = {"devices": jax.device_count(), "local_devices": jax.local_device_count(),
                 "processes": jax.process_count()}
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # "data" spans the processes
    rng = np.random.default_rng(0)  # the same global values on every process
    x = _global(mesh, P("data", "model"), rng.standard_normal((64, 32)).astype(np.float32))
    b = _global(mesh, P("model"), rng.standard_normal(32).astype(np.float32))
    s = _global(mesh, P("model"), rng.standard_normal(32).astype(np.float32))

    sites = {"bias_relu": (lambda x, b: jax.nn.relu(x + b), (x, b)),
             "scale_shift_relu": (lambda x, s, b: jax.nn.relu(x * s + b), (x, s, b))}
    tuner = tuning.Autotuner(rounds=3, cache=tuning.TuningCache(cache_dir))
    for name, (f, args) in sites.items():
        want = jax.jit(f)(*args)
        fused = jaxfuse.optimize(f, policy="always")
        hlo = fused.lower(*args).compile().as_text()
        measured = jaxfuse.optimize(f, policy="measure", autotuner=tuner)(*args)
        out[name] = {
            "always_equal": _same_shards(fused(*args), want),
            "custom_call": "jaxfuse" in hlo,
            "collectives": [op for op in ("all-gather", "all-to-all", "all-reduce",
                                          "collective-permute") if op in hlo],
            "measure_equal": _same_shards(measured, want),
        }
    out["cross_entropy"] = cross_entropy(mesh)
    # Below: each decision was timed (not a fallback), and every process made the same one.
    out["train_step"] = train_step(mesh, tuner)
    choices = [entry[1] for entry in tuner.log]  # the step's decision too
    codes = np.asarray([{"xla": 0, "auto": 1, "always": 2}[c] for c in choices], np.int32)
    every = multihost_utils.process_allgather(codes)
    out["measure"] = {"timed": len(choices), "skipped": list(tuner.skipped),
                      "agree": bool(np.all(every == every[0]))}
    return out


def cross_entropy(mesh) -> dict:
    """The cross-entropy rule on a data-parallel train step, the tokens split
    over the processes, under the default policy: the region runs on each
    device's shards; its values, and the bytes its collectives move against
    jit's, as each process sees them."""
    import numpy as np

    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxfuse
    from jaxfuse.fusion.ir.subjaxprs import all_eqns
    from jaxfuse.fusion.tuning.hlo_collectives import collective_bytes
    from jaxfuse.rules import cross_entropy as X

    rng = np.random.default_rng(2)
    x = _global(mesh, P("data"), rng.standard_normal((16, 8, 32)).astype(np.float32))
    w = _global(mesh, P(), (rng.standard_normal((32, 1024)) * 0.1).astype(np.float32))
    labels = _global(mesh, P("data"), rng.integers(0, 1024, (16, 8)).astype(np.int32))

    def loss(x, w, labels):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()

    step = jax.value_and_grad(loss, argnums=(0, 1))
    fused = jaxfuse.optimize(step, patterns=X.rules(budget=128 << 10))  # 4 chunks a device
    try:
        jax.jit(step)(x, w, labels)
    except Exception as e:  # jax 0.11, 0.12.0: no take_along_axis gradient under Explicit axes
        if type(e).__name__ != "ShardingTypeError":
            raise
        try:
            fused(x, w, labels)
            same = False
        except type(e):
            same = True  # optimize fails with jit's own error
        auto = jax.make_mesh(mesh.axis_sizes, mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
        return {**cross_entropy(auto), "jit_error": str(e)[:300], "same_error": same}
    sites = sum(e.params.get("name") == X.NAME for e in all_eqns(fused.trace(x, w, labels).jaxpr))
    want, got = jax.jit(step)(x, w, labels), fused(x, w, labels)
    err = 0.0
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False):
        for a, b in zip(g.addressable_shards, r.addressable_shards, strict=False):
            a, b = np.asarray(a.data, np.float64), np.asarray(b.data, np.float64)
            err = max(err, float(np.max(np.abs(a - b), initial=0) / max(np.max(np.abs(b)), 1e-30)))
    moved = collective_bytes(fused.lower(x, w, labels).compile().as_text()).bytes
    jit_moved = collective_bytes(jax.jit(step).lower(x, w, labels).compile().as_text()).bytes
    return {"sites": sites, "error": err, "moved": moved, "jit_moved": jit_moved,
            "specs_equal": [str(g.sharding.spec) for g in jax.tree.leaves(got)]
            == [str(r.sharding.spec) for r in jax.tree.leaves(want)]}


def train_step(mesh, tuner) -> dict:
    """A data-parallel flax step (batch over the processes, parameters
    replicated; jit's own collectives all-reduce the gradients), fused
    against jit's: the same parameters on every process. Under "measure" the
    candidates' timing runs those collectives on every process."""
    import numpy as np

    import jax
    import jax.numpy as jnp
    import optax
    from flax import linen as nn
    from jax.sharding import PartitionSpec as P

    import jaxfuse

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (32, 32):
                x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(4)(x)

    model, opt = MLP(), optax.sgd(0.1)
    rng = np.random.default_rng(1)
    xs = _global(mesh, P("data"), rng.standard_normal((16, 8)).astype(np.float32))
    ys = _global(mesh, P("data"), rng.standard_normal((16, 4)).astype(np.float32))
    params = jax.jit(model.init, out_shardings=jax.sharding.NamedSharding(mesh, P()))(
        jax.random.key(0), jnp.zeros((1, 8)))
    state = jax.jit(opt.init)(params)

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(params, updates), state, loss

    want = jax.jit(step)(params, state, xs, ys)
    fused = jaxfuse.optimize(step, policy="always")
    got = fused(params, state, xs, ys)
    measured = jaxfuse.optimize(step, policy="measure", autotuner=tuner)(params, state, xs, ys)
    sites = jaxfuse.explain(fused, params, state, xs, ys)
    same = lambda a, b: all(_same_shards(g, w)  # noqa: E731
                            for g, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False))
    return {"fused_sites": len(sites.fused), "equal": same(got, want),
            "measure_equal": same(measured, want)}


if __name__ == "__main__":
    pid, n, port = (int(a) for a in sys.argv[1:4])
    main(pid, n, port, sys.argv[4], sys.argv[5])
