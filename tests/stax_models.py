"""jax's stax ResNet-50 (jax.example_libraries.stax, as in jax's examples), for
the tests that run it (models/test_stax_model.py, fusion/safety/test_exact_false.py)."""

from __future__ import annotations

from jax.example_libraries import stax
from jax.example_libraries.stax import (AvgPool, BatchNorm, Conv, Dense, FanInSum, FanOut,
                                        Flatten, Identity, Relu)


def _conv_block(ks, filters, strides=(2, 2)):
    f1, f2, f3 = filters
    main = stax.serial(Conv(f1, (1, 1), strides), BatchNorm(), Relu,
                       Conv(f2, (ks, ks), padding="SAME"), BatchNorm(), Relu,
                       Conv(f3, (1, 1)), BatchNorm())
    shortcut = stax.serial(Conv(f3, (1, 1), strides), BatchNorm())
    return stax.serial(FanOut(2), stax.parallel(main, shortcut), FanInSum, Relu)


def _identity_block(ks, filters):
    f1, f2 = filters

    def make_main(input_shape):
        return stax.serial(Conv(f1, (1, 1)), BatchNorm(), Relu,
                           Conv(f2, (ks, ks), padding="SAME"), BatchNorm(), Relu,
                           Conv(input_shape[3], (1, 1)), BatchNorm())

    return stax.serial(FanOut(2), stax.parallel(stax.shape_dependent(make_main), Identity),
                       FanInSum, Relu)


def resnet50(classes=10):
    """The standard stax ResNet-50 (as in jax's examples), NHWC."""
    stages = [([64, 64, 256], (1, 1), 2), ([128, 128, 512], (2, 2), 3),
              ([256, 256, 1024], (2, 2), 5), ([512, 512, 2048], (2, 2), 2)]
    layers = [Conv(64, (7, 7), (2, 2), "SAME"), BatchNorm(), Relu,
              stax.MaxPool((3, 3), strides=(2, 2))]
    for filters, strides, identities in stages:
        layers.append(_conv_block(3, filters, strides))
        layers += [_identity_block(3, filters[:2]) for _ in range(identities)]
    layers += [stax.GlobalAvgPool if hasattr(stax, "GlobalAvgPool") else AvgPool((1, 1)), Flatten,
               Dense(classes)]
    return stax.serial(*layers)
