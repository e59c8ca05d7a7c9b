"""Model-level workloads: whole programs, timed as a user runs them.

Each is timed in three modes, interleaved, in both timing modes:

* ``xla``            ``jax.jit(f)``;
* ``jaxfuse``        ``jaxfuse.optimize(f)``, the default ``policy="auto"``: the
                     cost model fuses a site only where the custom call should
                     not lose to XLA's own fusion on this platform;
* ``jaxfuse-always`` ``jaxfuse.optimize(f, policy="always")``: every safe site.
* ``jaxfuse-inexact`` ``jaxfuse.optimize(f, exact=False)``: auto, with the sites
  declined only to keep jit's bits (BatchNorm on batch statistics, products XLA
  contracts) decided on cost and memory too.

The question they answer is the issue's "never slower than XLA": the
``jaxfuse`` mode's time ratio against ``xla`` must not have a 95% interval
above 1.  Each record also says how many sites the pass fused (``explain``),
how many custom calls the lowered program holds and the compiled program's
memory as XLA reports it; its temp bytes against xla's answer the other
question, whether ``optimize`` raises a program's memory.

Workloads (sizes per platform in ``SIZES``: ``quick`` / ``cpu`` / ``gpu``)
------------------------------------------------------------------------
* ``relu_add``        ``relu(a + b)``, both operands arguments (materialized).
* ``scale_shift``     ``relu(x * s + t)``, BatchNorm's inference form;
                      ``x: (N, 1024)``, ``s, t: (1024,)``.
* ``dense_relu``      ``relu(x @ w + b)``; ``(M, K, N)``.
* ``mlp``             a 4-layer MLP forward, batch 32, width 64: tiny, the
                      per-call overhead case.
* ``mlp_train_step``  a 3-layer MLP (width 256, batch 128) training step:
                      softmax cross-entropy, ``jax.grad``, ``optax.sgd`` update,
                      returning the new parameters and optimizer state.  The
                      state is carried from call to call (a training loop), so
                      in throughput mode each call depends on the previous one.
                      Needs optax.
* ``flax_cnn``        ``flax.linen``: Conv(3x3) -> BatchNorm(use_running_average=True)
                      -> relu, three times, NHWC.  Needs flax.
* ``eqx_nchw_conv``   ``equinox.nn.Conv2d`` (NCHW, with its bias) -> relu, three
                      times, vmapped over the batch.  Needs equinox.
* ``resnet_block``    a ResNet basic block, NHWC, BatchNorm in inference form
                      (``workloads.resnet_block``).
* ``stax_resnet50``   ResNet-50 built from ``jax.example_libraries.stax`` layers
                      as in jax's stax example (bottleneck blocks, stax's
                      BatchNorm, ``FanOut``/``FanInSum`` residuals); input HWCN.
                      The final average pool covers the last feature map, so a
                      small image size works on a CPU.
* ``linen_attention`` a flax.linen encoder block (LayerNorm, multi-head
                      attention with heads of 64, MLP), forward; the jaxfuse
                      modes add the attention rule (``jaxfuse.rules.attention``),
                      which replaces flax's hand-written attention with
                      ``jax.nn.dot_product_attention``.  Needs flax.
* ``hf_bert_encoder`` HuggingFace transformers' ``FlaxBertModel`` at BERT-base
                      width (hidden 768, 12 heads of 64, MLP 3072), 2 layers,
                      forward, with a padding mask (a quarter of the rows end
                      in padding); the jaxfuse modes add the attention rule,
                      so ``jaxfuse`` shows its per-site cost decisions and
                      ``jaxfuse-always`` every site rewritten.  Needs
                      transformers (a release with Flax models, <4.58).
* ``hf_gpt2_decoder`` ``FlaxGPT2Model`` at the same width, 2 layers: causal
                      attention with the padding mask.  Needs transformers.
* ``hf_bert_train``, ``hf_gpt2_train``
                      the same two models' train steps: ``jax.value_and_grad``
                      of a loss of their hidden states; the attention rule
                      matches each layer with its backward and replaces both
                      (jax.nn's forward and its own VJP).
* ``llama_train``, ``llama_train_128k``
                      HF transformers' ``FlaxLlamaForCausalLM`` (random
                      weights, never a download): ``jax.value_and_grad`` of
                      ``optax.softmax_cross_entropy_with_integer_labels(
                      logits[:, :-1], ids[:, 1:]).mean()``, the language-model
                      train step of jaxfuse's issue 45, at a 32000 and a 128256
                      vocabulary (Llama 2's and Llama 3's); the jaxfuse modes add
                      the cross-entropy rule (``jaxfuse.rules.cross_entropy``),
                      which evaluates the head's loss and gradient over chunks of
                      tokens.  Needs transformers, optax.
* ``gpt2_train``, ``gpt2_train_128k``
                      HF transformers' ``FlaxGPT2LMHeadModel`` (its head is the
                      token embedding, tied), the same step with the one-hot
                      spelling of transformers' ``run_clm_flax`` example
                      (``optax.softmax_cross_entropy`` of flax's ``onehot``).

A workload whose library is missing is skipped with a printed reason.

Inputs: the data arguments (``x``, or ``a`` and ``b``) rotate through enough
sets to exceed the cache (``timing.rotation_count``), as a new batch would;
parameters stay fixed.  Bytes are the *compulsory* traffic: every argument
read once and every result written once (a lower bound on what any
implementation moves; for the elementwise workloads it is exact, and XLA's
own estimate is kept as ``xla_bytes``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import workloads as W

MODEL_WORKLOADS = ("relu_add", "scale_shift", "dense_relu", "mlp", "mlp_train_step", "flax_cnn",
                   "eqx_nchw_conv", "resnet_block", "stax_resnet50", "haiku_resnet_train",
                   "haiku_resnet_eval", "haiku_resnet50_eval", "linen_ffn_train", "eqx_mlp_train", "linen_attention",
                   "hf_bert_encoder", "hf_gpt2_decoder", "hf_bert_train", "hf_gpt2_train",
                   "llama_train", "llama_train_128k", "gpt2_train", "gpt2_train_128k")

SIZES: dict[str, dict[str, tuple]] = {
    "relu_add": {"quick": (1 << 20,), "cpu": (1 << 22,), "gpu": (1 << 26,)},
    "scale_shift": {"quick": (1024, 1024), "cpu": (4096, 1024), "gpu": (65536, 1024)},
    "dense_relu": {"quick": (256, 256, 256), "cpu": (1024, 1024, 1024), "gpu": (8192, 4096, 4096)},
    # (batch, width, layers)
    "mlp": {"quick": (32, 64, 4), "cpu": (32, 64, 4), "gpu": (32, 64, 4)},
    "mlp_train_step": {"quick": (128, 256, 3), "cpu": (128, 256, 3), "gpu": (128, 256, 3)},
    # NHWC
    "flax_cnn": {"quick": (4, 16, 16, 32), "cpu": (8, 32, 32, 32), "gpu": (32, 56, 56, 64)},
    # NCHW
    "eqx_nchw_conv": {"quick": (4, 32, 16, 16), "cpu": (8, 32, 32, 32), "gpu": (32, 64, 56, 56)},
    # NHWC
    "resnet_block": {"quick": (4, 16, 16, 64), "cpu": (8, 32, 32, 64), "gpu": (32, 56, 56, 64)},
    # (batch, image size)
    "stax_resnet50": {"quick": (2, 64), "cpu": (4, 64), "gpu": (32, 224)},
    # training steps of models built from the libraries' own layers: (batch, size, width)
    "haiku_resnet_train": {"quick": (8, 16, 16), "cpu": (16, 32, 32), "gpu": (64, 56, 64)},
    "haiku_resnet_eval": {"quick": (8, 16, 16), "cpu": (16, 32, 32), "gpu": (64, 56, 64)},
    # haiku's own ResNet-50 (hk.nets), inference: (batch, image size)
    "haiku_resnet50_eval": {"quick": (2, 64), "cpu": (4, 96), "gpu": (32, 224)},
    "linen_ffn_train": {"quick": (16, 32, 64), "cpu": (32, 64, 128), "gpu": (64, 256, 512)},
    "eqx_mlp_train": {"quick": (64, 64, 128), "cpu": (128, 128, 256), "gpu": (512, 512, 1024)},
    # (batch, tokens, model width); heads of 64
    "linen_attention": {"quick": (4, 64, 128), "cpu": (8, 256, 256), "gpu": (32, 1024, 1024)},
    # (batch, tokens): BERT-base width, 2 layers
    "hf_bert_encoder": {"quick": (2, 64), "cpu": (8, 128), "gpu": (32, 512)},
    "hf_gpt2_decoder": {"quick": (2, 64), "cpu": (8, 128), "gpu": (32, 512)},
    # their train steps: value_and_grad of a loss of the hidden states
    "hf_bert_train": {"quick": (2, 64), "cpu": (8, 128), "gpu": (32, 512)},
    "hf_gpt2_train": {"quick": (2, 64), "cpu": (8, 128), "gpu": (32, 512)},
    # language-model train steps: (batch, tokens, width, layers, vocabulary)
    "llama_train": {"quick": (2, 64, 64, 2, 4096), "cpu": (4, 256, 256, 2, 32000),
                    "gpu": (8, 1024, 1024, 2, 32000)},
    "llama_train_128k": {"quick": (2, 64, 64, 2, 16384), "cpu": (4, 256, 256, 2, 128256),
                         "gpu": (8, 1024, 1024, 2, 128256)},
    "gpt2_train": {"quick": (2, 64, 64, 2, 4096), "cpu": (4, 256, 256, 2, 32000),
                   "gpu": (8, 1024, 1024, 2, 32000)},
    "gpt2_train_128k": {"quick": (2, 64, 64, 2, 16384), "cpu": (4, 256, 256, 2, 128256),
                        "gpu": (8, 1024, 1024, 2, 128256)},
}

REQUIRES: dict[str, tuple[str, ...]] = {
    "mlp_train_step": ("optax",),
    "flax_cnn": ("flax",),
    "eqx_nchw_conv": ("equinox",),
    "haiku_resnet_train": ("haiku", "optax"),
    "haiku_resnet_eval": ("haiku",),
    "haiku_resnet50_eval": ("haiku",),
    "linen_ffn_train": ("flax", "optax"),
    "eqx_mlp_train": ("equinox", "optax"),
    "linen_attention": ("flax",),
    "hf_bert_encoder": ("flax", "transformers"),
    "hf_gpt2_decoder": ("flax", "transformers"),
    "hf_bert_train": ("flax", "transformers"),
    "hf_gpt2_train": ("flax", "transformers"),
    "llama_train": ("transformers", "optax"),
    "llama_train_128k": ("transformers", "optax"),
    "gpt2_train": ("transformers", "optax"),
    "gpt2_train_128k": ("transformers", "optax"),
}

NUM_CLASSES = 10
HF_VOCAB = 1000  # the token embeddings are not what these workloads measure


class Skip(Exception):
    """A workload that cannot run here (a missing library); the message says why."""


def missing(workload: str) -> str | None:
    """Why ``workload`` cannot run (a library it needs does not import), or None."""
    for lib in REQUIRES.get(workload, ()):
        try:
            importlib.import_module(lib)
        except ImportError as e:
            return f"needs {lib}, which is not installed ({e})"
    return None


@dataclass
class Spec:
    """A model program ``fn(params, *data)`` and how to make its inputs."""

    fn: Callable
    params: Any
    data_shapes: tuple  # per data argument: (shape, kind), kind "normal", "labels" or ("tokens", V)
    shape: tuple  # what the table shows
    carry: bool = False  # fn returns the next params (a training step)
    note: str = ""
    rules: tuple = ()  # user rules (jaxfuse.rule) the jaxfuse modes add to the built-ins


def _cast(tree, dtype):
    def c(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree_util.tree_map(c, tree)


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _dense_params(key, sizes, dtype):
    params = []
    for k, (i, o) in zip(jax.random.split(key, len(sizes)), sizes):
        kw, kb = jax.random.split(k)
        params.append({"w": _normal(kw, (i, o), dtype, math.sqrt(2.0 / i)),
                       "b": _normal(kb, (o,), dtype, 0.1)})
    return params


def _mlp_apply(params, x):
    h = x
    for p in params[:-1]:
        h = jax.nn.relu(h @ p["w"] + p["b"])
    return h @ params[-1]["w"] + params[-1]["b"]


# ----------------------------------------------------------------- builders
def _relu_add(size, dtype, key):
    (n,) = size
    return Spec(lambda p, a, b: jax.nn.relu(a + b), (), (((n,), "normal"), ((n,), "normal")), (n,))


def _scale_shift(size, dtype, key):
    n, c = size
    ks, kt = jax.random.split(key)
    params = {"s": _normal(ks, (c,), dtype, 1.0) + jnp.asarray(1, dtype),
              "t": _normal(kt, (c,), dtype, 0.5)}
    return Spec(lambda p, x: jax.nn.relu(x * p["s"] + p["t"]), params, (((n, c), "normal"),), (n, c))


def _dense_relu(size, dtype, key):
    m, k, n = size
    kw, kb = jax.random.split(key)
    params = {"w": _normal(kw, (k, n), dtype, 1.0 / math.sqrt(k)), "b": _normal(kb, (n,), dtype, 0.5)}
    return Spec(lambda p, x: jax.nn.relu(x @ p["w"] + p["b"]), params, (((m, k), "normal"),),
                (m, k, n), note="x (M,K) @ w (K,N) + b (N,)")


def _mlp(size, dtype, key):
    batch, width, layers = size
    params = _dense_params(key, [(width, width)] * layers, dtype)
    return Spec(_mlp_apply, params, (((batch, width), "normal"),), (batch, width),
                note=f"{layers} dense layers of {width}")


def _mlp_train_step(size, dtype, key):
    import optax

    batch, width, layers = size
    params = _dense_params(key, [(width, width)] * (layers - 1) + [(width, NUM_CLASSES)], dtype)
    opt = optax.sgd(1e-3)

    def loss(p, x, y):
        logits = _mlp_apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(state, x, y):
        p, opt_state = state
        grads = jax.grad(loss)(p, x, y)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    state = (params, opt.init(params))
    return Spec(step, state, (((batch, width), "normal"), ((batch,), "labels")), (batch, width),
                carry=True, note=f"{layers} layers, sgd; state carried call to call")


def _flax_cnn(size, dtype, key):
    import flax.linen as nn

    n, h, w, c = size

    class CNN(nn.Module):
        features: int
        layers: int = 3

        @nn.compact
        def __call__(self, x):
            for _ in range(self.layers):
                x = nn.Conv(self.features, (3, 3), padding="SAME")(x)
                x = nn.BatchNorm(use_running_average=True)(x)
                x = nn.relu(x)
            return x

    model = CNN(c)
    k1, k2 = jax.random.split(key)
    variables = model.init(k1, jnp.zeros((1, h, w, c), jnp.float32))
    # Non-trivial running statistics and affine parameters, so every ReLU sees
    # inputs on both sides of zero.
    leaves, tree = jax.tree_util.tree_flatten(variables)
    keys = jax.random.split(k2, len(leaves))
    leaves = [x + 0.1 * jnp.abs(jax.random.normal(k, x.shape, x.dtype)) for k, x in zip(keys, leaves)]
    variables = _cast(jax.tree_util.tree_unflatten(tree, leaves), dtype)
    return Spec(lambda v, x: model.apply(v, x), variables, (((n, h, w, c), "normal"),), (n, h, w, c),
                note="3 x (Conv 3x3 -> BatchNorm -> relu), NHWC")


def _eqx_nchw_conv(size, dtype, key):
    import equinox as eqx

    n, c, h, w = size
    keys = jax.random.split(key, 3)
    convs = [eqx.nn.Conv2d(c, c, 3, padding=1, use_bias=True, key=k) for k in keys]
    convs = _cast(convs, dtype)
    params, static = eqx.partition(convs, eqx.is_array)

    def forward(params, x):
        layers = eqx.combine(params, static)

        def one(xi):
            for conv in layers:
                xi = jax.nn.relu(conv(xi))
            return xi

        return jax.vmap(one)(x)

    return Spec(forward, params, (((n, c, h, w), "normal"),), (n, c, h, w),
                note="3 x (Conv2d 3x3 + bias -> relu), NCHW")


def _resnet_block(size, dtype, key):
    x_shape = tuple(int(d) for d in size)
    params = W.init_resnet_params(key, x_shape[-1], dtype)
    return Spec(lambda p, x: W.resnet_block(x, p), params, ((x_shape, "normal"),), x_shape)


# ResNet-50 as in jax's stax example: bottleneck blocks, BatchNorm, residual sums.
def _stax():
    from jax.example_libraries import stax

    return stax


def _conv_block(kernel_size, filters, strides=(2, 2)):
    stax = _stax()
    ks = kernel_size
    f1, f2, f3 = filters
    main = stax.serial(stax.Conv(f1, (1, 1), strides), stax.BatchNorm(), stax.Relu,
                       stax.Conv(f2, (ks, ks), padding="SAME"), stax.BatchNorm(), stax.Relu,
                       stax.Conv(f3, (1, 1)), stax.BatchNorm())
    shortcut = stax.serial(stax.Conv(f3, (1, 1), strides), stax.BatchNorm())
    return stax.serial(stax.FanOut(2), stax.parallel(main, shortcut), stax.FanInSum, stax.Relu)


def _identity_block(kernel_size, filters):
    stax = _stax()
    ks = kernel_size
    f1, f2 = filters

    def make_main(input_shape):
        # the last conv restores the input's channel count
        return stax.serial(stax.Conv(f1, (1, 1)), stax.BatchNorm(), stax.Relu,
                           stax.Conv(f2, (ks, ks), padding="SAME"), stax.BatchNorm(), stax.Relu,
                           stax.Conv(input_shape[3], (1, 1)), stax.BatchNorm())

    main = stax.shape_dependent(make_main)
    return stax.serial(stax.FanOut(2), stax.parallel(main, stax.Identity), stax.FanInSum, stax.Relu)


def resnet50_final_size(image: int) -> int:
    """Spatial size of ResNet-50's last feature map for a square input."""
    s = -(-image // 2)  # 7x7 stride-2 SAME conv
    s = (s - 3) // 2 + 1  # 3x3 stride-2 VALID max pool
    for _ in range(3):  # three stride-2 stages
        s = -(-s // 2)
    return s


def resnet50(num_classes=1000, pool=7):
    stax = _stax()
    return stax.serial(
        stax.GeneralConv(("HWCN", "OIHW", "NHWC"), 64, (7, 7), (2, 2), "SAME"),
        stax.BatchNorm(), stax.Relu, stax.MaxPool((3, 3), strides=(2, 2)),
        _conv_block(3, [64, 64, 256], strides=(1, 1)),
        _identity_block(3, [64, 64]), _identity_block(3, [64, 64]),
        _conv_block(3, [128, 128, 512]),
        *[_identity_block(3, [128, 128]) for _ in range(3)],
        _conv_block(3, [256, 256, 1024]),
        *[_identity_block(3, [256, 256]) for _ in range(5)],
        _conv_block(3, [512, 512, 2048]),
        _identity_block(3, [512, 512]), _identity_block(3, [512, 512]),
        stax.AvgPool((pool, pool)), stax.Flatten, stax.Dense(num_classes),
    )


def _stax_resnet50(size, dtype, key):
    batch, image = size
    pool = resnet50_final_size(image)
    if pool < 1:
        raise ValueError(f"stax_resnet50: image size {image} is too small")
    init, apply = resnet50(1000, pool)
    in_shape = (image, image, 3, batch)  # HWCN, as the first GeneralConv expects
    _, params = init(key, in_shape)
    return Spec(lambda p, x: apply(p, x), _cast(params, dtype), ((in_shape, "normal"),), in_shape,
                note=f"batch {batch}, {image}x{image}, HWCN input")


def _train_step(loss, opt):
    """A step over state (params, opt_state[, model_state]) -> the next state."""
    import optax

    def step(state, x, y):
        params, opt_state, *model_state = state
        grads, *new_model_state = jax.grad(loss, has_aux=bool(model_state))(params, *model_state, x, y) \
            if model_state else (jax.grad(loss)(params, x, y),)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, *new_model_state)

    return step


def _xent(logits, y):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _haiku_small_resnet(width):
    import haiku as hk

    def net(x, is_training):
        bn = lambda: hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)  # noqa: E731
        h = jax.nn.relu(bn()(hk.Conv2D(width, 3, with_bias=False)(x), is_training))
        for _ in range(2):  # two residual blocks
            r = jax.nn.relu(bn()(hk.Conv2D(width, 3, with_bias=False)(h), is_training))
            r = bn()(hk.Conv2D(width, 3, with_bias=False)(r), is_training)
            h = jax.nn.relu(h + r)
        return hk.Linear(NUM_CLASSES)(h.mean(axis=(1, 2)))

    return hk.transform_with_state(net)


def _running_stats(state, key):
    """BatchNorm running statistics as after training (haiku starts them at 0)."""
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [
        jnp.abs(0.1 * jax.random.normal(k, v.shape, jnp.float32) + 1.0).astype(v.dtype)
        if getattr(v, "ndim", 0) else v for k, v in zip(keys, leaves)])


def _haiku_resnet_train(size, dtype, key):
    import optax

    batch, image, width = size
    t = _haiku_small_resnet(width)
    x0 = jnp.zeros((batch, image, image, 3), jnp.float32)
    params, bn_state = t.init(key, x0, True)
    params, bn_state = _cast(params, dtype), _cast(bn_state, dtype)

    def loss(p, st, x, y):
        logits, st = t.apply(p, st, None, x, True)
        return _xent(logits, y), st

    opt = optax.sgd(1e-3)
    state = (params, opt.init(params), bn_state)
    return Spec(_train_step(loss, opt), state,
                (((batch, image, image, 3), "normal"), ((batch,), "labels")),
                (batch, image, image, 3), carry=True,
                note=f"dm-haiku: 2 residual blocks of Conv2D+BatchNorm (training mode), width {width}")


def _haiku_inference(t, x_shape, dtype, key, note):
    """A haiku network `t(x, is_training)` applied in inference mode, its
    BatchNorms on running statistics."""
    params, bn_state = t.init(key, jnp.zeros(x_shape, jnp.float32), True)
    state = _cast((params, _running_stats(bn_state, key)), dtype)
    return Spec(lambda p, x: t.apply(p[0], p[1], None, x, False)[0], state,
                ((x_shape, "normal"),), x_shape, note=note)


def _haiku_resnet_eval(size, dtype, key):
    batch, image, width = size
    return _haiku_inference(_haiku_small_resnet(width), (batch, image, image, 3), dtype, key,
                            f"dm-haiku: haiku_resnet_train's network in inference mode "
                            f"(BatchNorm on running statistics), width {width}")


def _haiku_resnet50_eval(size, dtype, key):
    import haiku as hk

    batch, image = size
    t = hk.transform_with_state(lambda x, is_training: hk.nets.ResNet50(1000)(x, is_training))
    return _haiku_inference(t, (batch, image, image, 3), dtype, key,
                            f"dm-haiku's hk.nets.ResNet50 in inference mode, batch {batch}, "
                            f"{image}x{image}, NHWC")


def _linen_ffn_train(size, dtype, key):
    import flax.linen as nn
    import optax

    batch, tokens, dim = size

    class FFN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                h = nn.Dense(4 * dim)(nn.LayerNorm()(x))
                x = x + nn.Dense(dim)(jax.nn.relu(h))
            return nn.Dense(NUM_CLASSES)(x.mean(axis=1))

    model = FFN()
    params = _cast(model.init(key, jnp.zeros((1, tokens, dim), jnp.float32)), dtype)
    opt = optax.sgd(1e-3)
    loss = lambda p, x, y: _xent(model.apply(p, x), y)  # noqa: E731
    return Spec(_train_step(loss, opt), (params, opt.init(params)),
                (((batch, tokens, dim), "normal"), ((batch,), "labels")), (batch, tokens, dim),
                carry=True, note="flax.linen: 2 x (LayerNorm, Dense 4d, relu, Dense, residual)")


def _linen_attention(size, dtype, key):
    import flax.linen as nn

    import jaxfuse.rules

    batch, tokens, dim = size

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.MultiHeadDotProductAttention(num_heads=dim // 64, dropout_rate=0.0,
                                                deterministic=True)(nn.LayerNorm()(x))
            x = x + h
            return x + nn.Dense(dim)(jax.nn.relu(nn.Dense(4 * dim)(nn.LayerNorm()(x))))

    model = Encoder()
    params = _cast(model.init(key, jnp.zeros((1, tokens, dim), jnp.float32)), dtype)
    return Spec(model.apply, params, (((batch, tokens, dim), "normal"),), (batch, tokens, dim),
                note="flax.linen encoder block: LayerNorm, attention (head size 64), MLP; "
                     "jaxfuse modes add the attention rule",
                rules=tuple(jaxfuse.rules.attention.rules()))


def _hf_model(config, dtype, key):
    import warnings

    import transformers

    seed = int(jax.random.randint(key, (), 0, 2 ** 31 - 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notice that its Flax models are deprecated
        model = getattr(transformers, config[0])(getattr(transformers, config[1])(**config[2]),
                                                 seed=seed, dtype=dtype)
    return model, _cast(model.params, dtype)


def _hf_forward(model):
    def forward(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).last_hidden_state
    return forward


def _hf_bert_encoder(size, dtype, key):
    import jaxfuse.rules

    batch, tokens = size
    model, params = _hf_model(("FlaxBertModel", "BertConfig", dict(
        vocab_size=HF_VOCAB, hidden_size=768, num_hidden_layers=2, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=max(512, tokens))), dtype, key)
    return Spec(_hf_forward(model), params, (((batch, tokens), "tokens"), ((batch, tokens), "padding")),
                (batch, tokens), note="HF FlaxBertModel, BERT-base width (768, 12 heads of 64), 2 layers, "
                                      "padding mask; jaxfuse modes add the attention rule",
                rules=tuple(jaxfuse.rules.attention.rules()))


def _hf_gpt2_decoder(size, dtype, key):
    import jaxfuse.rules

    batch, tokens = size
    model, params = _hf_model(("FlaxGPT2Model", "GPT2Config", dict(
        vocab_size=HF_VOCAB, n_embd=768, n_layer=2, n_head=12, n_positions=max(1024, tokens))),
        dtype, key)
    return Spec(_hf_forward(model), params, (((batch, tokens), "tokens"), ((batch, tokens), "padding")),
                (batch, tokens), note="HF FlaxGPT2Model, width 768, 12 heads of 64, 2 layers, causal with "
                                      "a padding mask; jaxfuse modes add the attention rule",
                rules=tuple(jaxfuse.rules.attention.rules()))


def _hf_train(forward_spec: Spec) -> Spec:
    """`jax.value_and_grad` of a loss of an HF model's hidden states: its
    attention's values are read by the backward pass, so the rule matches each
    layer with its backward (jaxfuse/fusion/match/training.py)."""
    forward = forward_spec.fn

    def loss(params, ids, mask):
        return jnp.mean(jnp.sin(forward(params, ids, mask).astype(jnp.float32)))

    return Spec(jax.value_and_grad(loss), forward_spec.params, forward_spec.data_shapes,
                forward_spec.shape, note=forward_spec.note.replace(", padding mask", ", padding mask, "
                                                                   "value_and_grad of a loss"),
                rules=forward_spec.rules)


def _hf_bert_train(size, dtype, key):
    return _hf_train(_hf_bert_encoder(size, dtype, key))


def _hf_gpt2_train(size, dtype, key):
    return _hf_train(_hf_gpt2_decoder(size, dtype, key))


def _eqx_mlp_train(size, dtype, key):
    import equinox as eqx
    import optax

    batch, features, width = size
    model = eqx.nn.MLP(features, NUM_CLASSES, width_size=width, depth=3, activation=jax.nn.relu,
                       key=key)
    params, static = eqx.partition(_cast(model, dtype), eqx.is_array)
    opt = optax.sgd(1e-3)
    loss = lambda p, x, y: _xent(jax.vmap(eqx.combine(p, static))(x), y)  # noqa: E731
    return Spec(_train_step(loss, opt), (params, opt.init(params)),
                (((batch, features), "normal"), ((batch,), "labels")), (batch, features),
                carry=True, note=f"equinox.nn.MLP, depth 3, width {width}")


def _causal_lm(size, dtype, key, which: str):
    """An HF transformers Flax causal LM at random weights (no download) and
    the issue's step: value_and_grad of its shifted next-token loss."""
    import warnings

    import optax
    import transformers

    import jaxfuse.rules

    batch, tokens, width, layers, vocab = size
    seed = int(jax.random.randint(key, (), 0, 1 << 30))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notice that its Flax classes are deprecated
        if which == "llama":
            cfg = transformers.LlamaConfig(
                vocab_size=vocab, hidden_size=width, intermediate_size=int(width * 8 / 3) // 8 * 8,
                num_hidden_layers=layers, num_attention_heads=max(1, width // 64),
                num_key_value_heads=max(1, width // 64), max_position_embeddings=max(tokens, 128))
            model = transformers.FlaxLlamaForCausalLM(cfg, seed=seed, dtype=dtype)
        else:
            cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers,
                                          n_head=max(1, width // 64), n_positions=max(tokens, 128))
            model = transformers.FlaxGPT2LMHeadModel(cfg, seed=seed, dtype=dtype)
    params = _cast(model.params, dtype)

    if which == "llama":
        def loss(params, ids):
            logits = model(ids, params=params).logits.astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()
        spelling = "optax.softmax_cross_entropy_with_integer_labels"
    else:
        from flax.training.common_utils import onehot

        def loss(params, ids):
            logits = model(ids, params=params).logits.astype(jnp.float32)
            shifted = logits[..., :-1, :]
            return optax.softmax_cross_entropy(shifted, onehot(ids[..., 1:], shifted.shape[-1])).mean()
        spelling = "optax.softmax_cross_entropy of a one-hot (run_clm_flax)"

    return Spec(jax.value_and_grad(loss), params, (((batch, tokens), ("tokens", vocab)),),
                (batch, tokens, width, layers, vocab),
                note=f"HF Flax {'Llama' if which == 'llama' else 'GPT-2 (tied head)'}, width "
                     f"{width}, {layers} layers, vocabulary {vocab}: value_and_grad of {spelling}; "
                     f"jaxfuse modes add the cross-entropy rule",
                rules=tuple(jaxfuse.rules.cross_entropy.rules()))


def _llama_train(size, dtype, key):
    return _causal_lm(size, dtype, key, "llama")


def _gpt2_train(size, dtype, key):
    return _causal_lm(size, dtype, key, "gpt2")


BUILDERS: dict[str, Callable] = {
    "haiku_resnet_train": _haiku_resnet_train, "haiku_resnet_eval": _haiku_resnet_eval,
    "haiku_resnet50_eval": _haiku_resnet50_eval, "linen_ffn_train": _linen_ffn_train,
    "eqx_mlp_train": _eqx_mlp_train, "linen_attention": _linen_attention,
    "relu_add": _relu_add, "scale_shift": _scale_shift, "dense_relu": _dense_relu, "mlp": _mlp,
    "mlp_train_step": _mlp_train_step, "flax_cnn": _flax_cnn, "eqx_nchw_conv": _eqx_nchw_conv,
    "resnet_block": _resnet_block, "stax_resnet50": _stax_resnet50,
    "hf_bert_encoder": _hf_bert_encoder, "hf_gpt2_decoder": _hf_gpt2_decoder,
    "hf_bert_train": _hf_bert_train, "hf_gpt2_train": _hf_gpt2_train,
    "llama_train": _llama_train, "llama_train_128k": _llama_train,
    "gpt2_train": _gpt2_train, "gpt2_train_128k": _gpt2_train,
}


# What each number of a model workload's size means (`jaxfuse-bench --model-shape`).
SIZE_FORMS: dict[str, str] = {
    "relu_add": "elements", "scale_shift": "rows x channels", "dense_relu": "M x K x N",
    "mlp": "batch x width x layers", "mlp_train_step": "batch x width x layers",
    "flax_cnn": "N x H x W x C", "eqx_nchw_conv": "N x C x H x W", "resnet_block": "N x H x W x C",
    "stax_resnet50": "batch x image size", "haiku_resnet_train": "batch x size x width",
    "haiku_resnet_eval": "batch x size x width", "haiku_resnet50_eval": "batch x image size",
    "linen_ffn_train": "batch x tokens x width", "eqx_mlp_train": "batch x features x width",
    "linen_attention": "batch x tokens x width",
    "hf_bert_encoder": "batch x tokens", "hf_gpt2_decoder": "batch x tokens",
    "hf_bert_train": "batch x tokens", "hf_gpt2_train": "batch x tokens",
    "llama_train": "batch x tokens x width x layers x vocabulary",
    "llama_train_128k": "batch x tokens x width x layers x vocabulary",
    "gpt2_train": "batch x tokens x width x layers x vocabulary",
    "gpt2_train_128k": "batch x tokens x width x layers x vocabulary",
}


def size_for(workload: str, platform_key: str, override=None) -> tuple:
    """The size of a model workload on ``platform_key`` ("quick", "cpu", "gpu")."""
    if override is not None:
        return tuple(override)
    return tuple(SIZES[workload][platform_key])


# ------------------------------------------------------------------- inputs
def _data_sets(data_shapes, dtype, n_sets: int, seed: int) -> list[tuple]:
    def gen(key):
        keys = jax.random.split(key, len(data_shapes))
        out = []
        for k, (shape, kind) in zip(keys, data_shapes):
            if kind == "labels":
                out.append(jax.random.randint(k, shape, 0, NUM_CLASSES, jnp.int32))
            elif kind == "tokens":
                out.append(jax.random.randint(k, shape, 0, HF_VOCAB, jnp.int32))
            elif kind == "padding":  # (batch, tokens): row b ends in (b % 4) eighths of padding
                batch, tokens = shape
                length = tokens - (jnp.arange(batch) % 4) * (tokens // 8)
                out.append((jnp.arange(tokens)[None, :] < length[:, None]).astype(jnp.int32))
            elif isinstance(kind, tuple) and kind[0] == "tokens":
                out.append(jax.random.randint(k, shape, 0, kind[1], jnp.int32))
            else:
                out.append(jax.random.normal(k, shape, jnp.float32).astype(dtype))
        return tuple(out)

    gen = jax.jit(gen)
    base = jax.random.key(seed)
    sets = [gen(jax.random.fold_in(base, i)) for i in range(n_sets)]
    jax.block_until_ready(sets)
    return sets


def _nbytes(tree) -> int:
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))


def model_group(workload, size, dtype, modes, cache_bytes, *, seed=0, rotate=True) -> W.Group:
    """The cases and inspections of one model workload; raises ``Skip`` when a
    library it needs is missing."""
    from .timing import rotation_count

    why = missing(workload)
    if why is not None:
        raise Skip(why)
    modes = [m for m in W.MODEL_MODES if m in modes]
    dtype = jnp.dtype(dtype)
    spec = BUILDERS[workload](tuple(size), dtype, jax.random.key(seed + 1))
    params = spec.params
    one = _data_sets(spec.data_shapes, dtype, 1, seed)[0]
    out_shape = jax.eval_shape(spec.fn, params, *one)
    data_bytes, param_bytes, out_bytes = _nbytes(one), _nbytes(params), _nbytes(out_shape)
    n_sets = rotation_count(data_bytes + out_bytes, cache_bytes) if rotate else 1
    sets = [one] + (_data_sets(spec.data_shapes, dtype, n_sets, seed)[1:] if n_sets > 1 else [])
    n = len(sets)

    fns = {}
    for m in modes:
        policy = W.policy_of(m, "model")
        fns[m] = (jax.jit(spec.fn) if policy is None else
                  W.fuse(spec.fn, policy, spec.rules, exact=W.exact_of(m)))

    def case(m):
        f = fns[m]
        if spec.carry:
            state = [params]

            def call(i):
                state[0] = f(state[0], *sets[i % n])
                return state[0]
        else:
            def call(i):
                return f(params, *sets[i % n])
        return call

    nbytes = data_bytes + param_bytes + out_bytes
    group = W.Group(
        workload=workload,
        dtype=dtype.name,
        shape=tuple(spec.shape),
        elements=math.prod(spec.shape),
        cases={m: case(m) for m in modes},
        bytes={m: nbytes for m in modes},
        kind="model",
        bytes_source="compulsory: arguments read once + results written once",
        policies={m: W.policy_of(m, "model") for m in modes},
        buffer_sets=n,
        note=spec.note,
    )
    for m in modes:
        policy = W.policy_of(m, "model")
        # explain the optimized function itself: its patterns include the workload's rules
        group.inspections[m] = W.inspect(fns[m], params, *one, mode=m, policy=policy,
                                         plain=fns[m] if policy else None)
    return group
