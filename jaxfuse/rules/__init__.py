"""Rules that ship with jaxfuse, opt-in: pass them to `optimize(patterns=...)`
or `register_pattern` them (`jaxfuse.rule` builds them; jaxfuse/fusion/match/rule_engine.py).

  attention  -- softmax(scale * q.k + bias [masked]) . v, read by its dataflow
                (flax.linen, flax.nnx, dm-haiku, equinox, HuggingFace Flax
                models), to `jax.nn.dot_product_attention`; a cost decision
                per site under policy="auto"
"""

from . import attention

__all__ = ["attention"]
