"""Rules that ship with jaxfuse, opt-in: pass them to `optimize(patterns=...)`
or `register_pattern` them (`jaxfuse.rule` builds them; jaxfuse/fusion/match/rule_engine.py).

  attention  -- softmax(scale * q.k + bias [masked]) . v, read by its dataflow
                (flax.linen, flax.nnx, dm-haiku, equinox, HuggingFace Flax
                models), to `jax.nn.dot_product_attention`; a cost decision
                per site under policy="auto"
  cross_entropy -- a linear head's cross-entropy at integer labels (optax's and
                   hand-written spellings, with or without its gradient in the
                   program), evaluated over chunks of tokens so the
                   [tokens, vocabulary] logits never exist whole
"""

from . import attention, cross_entropy

__all__ = ["attention", "cross_entropy"]
