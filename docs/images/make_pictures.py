"""Draws the pictures of docs/pictures.md and docs/rules.md into docs/images/.

    python docs/images/make_pictures.py

They are drawn as the reader's own machine would draw them: with Graphviz's
`dot` where it is installed, else with networkx and matplotlib.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.example_libraries import stax

import jaxfuse

HERE = os.path.dirname(os.path.abspath(__file__))


def add_relu(x, y):
    return jax.nn.relu(x + y)


def add_read_twice(x, y):
    s = x + y                     # a second reader of `s`: the add must stay
    return jax.nn.relu(s), s * 2.0


def bottleneck(filters=(64, 64, 256)):
    """ResNet-50's first bottleneck block, as in jax's stax example."""
    f1, f2, f3 = filters
    main = stax.serial(stax.Conv(f1, (1, 1)), stax.BatchNorm(), stax.Relu,
                       stax.Conv(f2, (3, 3), padding="SAME"), stax.BatchNorm(), stax.Relu,
                       stax.Conv(f3, (1, 1)), stax.BatchNorm())
    shortcut = stax.serial(stax.Conv(f3, (1, 1)), stax.BatchNorm())
    return stax.serial(stax.FanOut(2), stax.parallel(main, shortcut), stax.FanInSum, stax.Relu)


def next_token_loss(x, w, ids):
    """A language model's head and loss: hidden states [batch, tokens, width],
    a head [width, vocabulary], the shifted next-token cross-entropy."""
    import optax

    logits = x @ w
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def main():
    x = y = jnp.ones((8, 128), jnp.float32)
    jaxfuse.explain(add_relu, x, y, policy="always").save(
        os.path.join(HERE, "add_relu.svg"))
    jaxfuse.explain(add_read_twice, x, y, policy="always").save(
        os.path.join(HERE, "add_read_twice.svg"))

    init, apply = bottleneck()
    _, params = init(jax.random.PRNGKey(0), (2, 16, 16, 64))
    block = jaxfuse.explain(apply, params, jnp.ones((2, 16, 16, 64)), policy="always")
    print(block)
    block.save(os.path.join(HERE, "resnet50_block.svg"), kind="before", hops=1)

    # docs/rules.md: the cross-entropy rule at the shapes, the gradient in the program
    import jaxfuse.rules.cross_entropy as xent

    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((4, 256, 256), f32), jax.ShapeDtypeStruct((256, 32000), f32),
            jax.ShapeDtypeStruct((4, 256), jnp.int32))
    step = jax.value_and_grad(next_token_loss, argnums=(0, 1))
    site = jaxfuse.explain(jaxfuse.optimize(step, patterns=xent.rules()), *args)
    print(site)
    site.save(os.path.join(HERE, "cross_entropy.svg"))


if __name__ == "__main__":
    main()
