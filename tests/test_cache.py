"""jaxfuse._cache.BoundedCache: the module-level caches of traced templates
and replacements (the rule engine's, the attention rule's) are bounded and
stay whole when threads fill them at once (issue 56)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse._cache import BoundedCache


def test_it_keeps_the_most_recent_entries_and_no_more():
    c = BoundedCache(3)
    for k in range(5):
        assert c.get(k, lambda k=k: k * 10) == k * 10
    assert len(c) == 3
    assert c.get(4, lambda: "made again") == 40  # kept
    assert c.get(0, lambda: "made again") == "made again"  # evicted first
    with pytest.raises(ValueError):
        BoundedCache(0)


def test_threads_filling_it_at_once_get_one_value_per_key():
    c = BoundedCache(16)
    made = []
    lock = threading.Lock()

    def make(k):
        with lock:
            made.append(k)
        return object()

    def work(i):
        k = i % 24
        return k, c.get(k, lambda: make(k))

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(work, range(2000)))
    assert len(got) == 2000 and len(c) <= 16
    assert set(made) == set(range(24))  # every key made at least once
    # a key still cached answers with its one stored value, to every caller
    for k in range(24):
        first = c.get(k, lambda: None)
        if first is not None:
            assert c.get(k, lambda: pytest.fail("made again")) is first


def test_threads_tracing_one_rule_at_once(rng):
    """Several threads explaining programs that hit the same rule at new
    shapes: every site is found and the rule's cache stays bounded."""
    r = jaxfuse.rule(lambda x, b: jax.nn.gelu(x + b), lambda x, b: jax.nn.gelu(b + x), name="bg")

    def explain(n):
        x = jnp.ones((4, 8 + n % 6), jnp.float32)
        b = jnp.ones((8 + n % 6,), jnp.float32)
        return [s.fused for s in jaxfuse.explain(lambda x, b: jax.nn.gelu(x + b) * 2.0, x, b,
                                                 patterns=[r]).sites]

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(explain, range(36)))
    assert all(res == [True] for res in results), results
    np.testing.assert_equal(len(results), 36)
