"""penzai's transformer (a library we did not write), small and random: its
attention, a softmax under the named-axis `nmap` over logits transposed into
the named layout, is rewritten by the attention rule in the forward pass.

Needs the `penzai` extra (CI's jax 0.12 leg installs it); skipped with the
reason without it."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxfuse
from jaxfuse.rules import attention

pz = pytest.importorskip("penzai.pz", reason="needs the `penzai` extra (penzai)")


def _llamalike(**kwargs):
    from penzai.models.transformer.variants import llamalike_common as common

    config = common.LlamalikeTransformerConfig(
        embedding_dim=32, projection_dim=8, mlp_hidden_dim=64, num_decoder_blocks=2,
        vocab_size=64, mlp_variant="swiglu", tie_embedder_and_logits=False, **kwargs)
    return common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))


@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["grouped", "multi_head"])
def test_every_attention_layer_of_a_llamalike_model_is_rewritten(rng, heads):
    kv_heads, per_kv = heads
    model = _llamalike(num_kv_heads=kv_heads, query_head_multiplier=per_kv)

    def logits(tokens):
        return model(pz.nx.wrap(tokens).tag("batch", "seq")).unwrap("batch", "seq", "vocabulary")

    tokens = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    sites = [s for s in jaxfuse.explain(logits, tokens, patterns=attention.rules(),
                                        policy="always").sites if s.pattern == "attention"]
    assert len(sites) == 2 and all(s.fused and "causal" in s.spelling for s in sites), sites
    got = jaxfuse.optimize(logits, patterns=attention.rules(), policy="always")(tokens)
    want = jax.jit(logits)(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
