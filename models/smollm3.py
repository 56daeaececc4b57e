"""SmolLM3 (transformers' SmolLM3ForCausalLM): Llama with NoPE layers. `no_rope_layers[i]` is 1 where layer i rotates
q and k and 0 where it attends without positions (every fourth layer in the released 3B); windows only where
`use_sliding_window` is set and `layer_types` says so; biases on all four projections per `attention_bias`."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Embedding, RMSNorm, module_list
from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jaxpaged.pallas_kernels import AttentionBackend


class NoPEDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose attention gets no rotary table where the layer is a NoPE one."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        super().__init__(cfg, layer, dtype=dtype, attention=attention)
        self.use_rope = layer not in cfg.option("nope_layers", ())

    def __call__(self, x, rope, kv_cache, attn_metadata):
        return super().__call__(x, rope if self.use_rope else None, kv_cache, attn_metadata)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([NoPEDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        layers = int(hf.num_hidden_layers)
        flags = list(getattr(hf, "no_rope_layers", None) or [1] * layers)
        if len(flags) != layers:
            raise ValueError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
        nope = tuple(i for i, use_rope in enumerate(flags) if not use_rope)
        cfg = model_config_from_hf(hf_config, architecture, options={"nope_layers": nope})
        if not getattr(hf, "use_sliding_window", False):  # sliding_window alone turns no window on
            cfg = dataclasses.replace(cfg, sliding_windows=())
        return cfg
