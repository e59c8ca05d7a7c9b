"""Rules that ship with jaxfuse, opt-in: pass them to `optimize(patterns=...)`
or `register_pattern` them (`jaxfuse.rule` builds them; jaxfuse/fusion/match/rule_engine.py).

  attention  -- hand-written softmax(q k^T / sqrt(d) [masked]) v, as flax.linen,
                flax.nnx, dm-haiku and equinox layers spell it, to
                `jax.nn.dot_product_attention`
"""

from . import attention

__all__ = ["attention"]
