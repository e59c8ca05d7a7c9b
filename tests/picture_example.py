"""Functions for the command line tests of tests/fusion/report/test_pictures.py
(`jaxfuse-explain picture_example:...`)."""

import jax


def block(x, w, b):
    return jax.nn.relu(x @ w + b)


def add_read_twice(x, y):
    s = x + y  # a second reader: the add cannot be fused away
    return jax.nn.relu(s), s * 2.0
