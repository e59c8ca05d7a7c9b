"""HuggingFace transformers' Flax models at small random configs, for the
attention and rule-engine tests: no download, 2 layers, width 32-64, 2-4 heads.

`build(family, dtype)` returns `(forward, params, inputs)`: `forward(params,
*inputs)` runs the model's `__call__` as a user does (its own padding mask,
head mask and position ids built inside), returning the last hidden state (or
the decoder's, for encoder-decoders). Inputs hold a padding mask with padded
positions, so the mask paths are exercised.
"""

from __future__ import annotations

import warnings

import numpy as np

import jax
import jax.numpy as jnp

BATCH, TOKENS, VOCAB = 2, 8, 100

# family -> (config class, model class, config kwargs, input kind)
_TEXT = "text"
_SEQ2SEQ = "seq2seq"
_IMAGE = "image"

FAMILIES = {
    "bert": ("BertConfig", "FlaxBertModel", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64), _TEXT),
    "roberta": ("RobertaConfig", "FlaxRobertaModel", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64), _TEXT),
    "electra": ("ElectraConfig", "FlaxElectraModel", dict(
        hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64), _TEXT),
    "distilbert": ("DistilBertConfig", "FlaxDistilBertModel", dict(
        dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64), _TEXT),
    "gpt2": ("GPT2Config", "FlaxGPT2Model", dict(
        n_embd=32, n_layer=2, n_head=2, n_positions=64), _TEXT),
    "gpt_neo": ("GPTNeoConfig", "FlaxGPTNeoModel", dict(
        hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=64, intermediate_size=64), _TEXT),
    "opt": ("OPTConfig", "FlaxOPTModel", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        word_embed_proj_dim=32, max_position_embeddings=64), _TEXT),
    "llama": ("LlamaConfig", "FlaxLlamaModel", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64), _TEXT),
    "mistral": ("MistralConfig", "FlaxMistralModel", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, sliding_window=4), _TEXT),
    "gemma": ("GemmaConfig", "FlaxGemmaModel", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, max_position_embeddings=64), _TEXT),
    "clip_text": ("CLIPTextConfig", "FlaxCLIPTextModel", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64), _TEXT),
    "bart": ("BartConfig", "FlaxBartModel", dict(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64), _SEQ2SEQ),
    "bloom": ("BloomConfig", "FlaxBloomModel", dict(hidden_size=32, n_layer=2, n_head=2), _TEXT),
    "t5": ("T5Config", "FlaxT5Model", dict(
        d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2), _SEQ2SEQ),
    "vit": ("ViTConfig", "FlaxViTModel", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=16, patch_size=4, num_channels=3), _IMAGE),
}


def available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _model(family, dtype):
    import transformers

    config_name, model_name, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, **kwargs) \
        if "vocab" not in config_name.lower() and family != "vit" else \
        getattr(transformers, config_name)(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, model_name)(config, seed=0, dtype=dtype)


def padding_mask(batch=BATCH, tokens=TOKENS) -> np.ndarray:
    """1 for real tokens, 0 for padding: the second sequence has 3 padded positions."""
    mask = np.ones((batch, tokens), np.int32)
    mask[1:, tokens - 3:] = 0
    return mask


def build(family: str, dtype=jnp.float32, *, batch=BATCH, tokens=TOKENS, seed=0):
    """(forward, params, inputs) for `family` at `dtype` (params cast to it)."""
    model = _model(family, dtype)
    kind = FAMILIES[family][3]
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                          model.params)
    if kind == _IMAGE:
        cfg = model.config
        pixels = jnp.asarray(rng.standard_normal((batch, cfg.num_channels, cfg.image_size,
                                                  cfg.image_size)), dtype)

        def forward(params, pixels):
            return model(pixels, params=params).last_hidden_state

        return forward, params, (pixels,)
    ids = jnp.asarray(rng.integers(1, VOCAB, (batch, tokens)), jnp.int32)
    mask = jnp.asarray(padding_mask(batch, tokens))
    if kind == _SEQ2SEQ:
        dec = jnp.asarray(rng.integers(1, VOCAB, (batch, tokens)), jnp.int32)

        def forward(params, ids, mask, dec):
            return model(ids, attention_mask=mask, decoder_input_ids=dec,
                         params=params).last_hidden_state

        return forward, params, (ids, mask, dec)

    def forward(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).last_hidden_state

    return forward, params, (ids, mask)


def attention_layers(family: str) -> int:
    """How many attention layers the 2-layer model of `family` runs."""
    return 6 if FAMILIES[family][3] == _SEQ2SEQ else 2
