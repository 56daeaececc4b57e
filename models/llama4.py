"""Llama 4 (transformers' Llama4ForCausalLM, and Llama4ForConditionalGeneration's language model: models/vision/llama4.py
adds its vision model).

- RoPE layers (`no_rope_layers[i]` 1): complex RoPE (interleaved pairs, llama3 scaling), then q and k L2-normed
  without a weight (`use_qk_norm`), and chunked local attention: a token sees only its own chunk of
  `attention_chunk_size` positions (`layer_types` "chunked_attention");
- NoPE layers: no rotation, full causal attention, q times log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1
  (`attn_temperature_tuning`);
- MoE layers (`moe_layers`, from `interleave_moe_layer_step`): a sigmoid router over the top-k logits whose score
  scales each expert's input (not its output), plus an always-on shared expert; the other layers a dense MLP
  `intermediate_size_mlp` wide.
Every built-in attention backend honours the chunk (`supports_chunks`: the reference, the native CPU kernel, the Triton
and Mosaic kernels); a backend without it would serve the other layers and leave the chunked ones to the reference.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Attention, CausalLM, Embedding, GatedMLP, RMSNorm, module_list, rope_table
from jaxpaged.models.llama import attention_specs
from jaxpaged.models.mixtral import MoeDecoderLayer
from jaxpaged.models.moe import MoeOptions, SparseMoeBlock
from jaxpaged.models.weights import WeightSpec, decoder_specs, layer_prefixes, projection_specs, scale_specs
from jaxpaged.pallas_kernels import AttentionBackend, stack_new_kv

VISION = (r"^(model\.)?(vision_model|multi_modal_projector)\.",
          "the vision model and the projector: not ported, prompts are text")  # fmt: skip


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
    """transformers' Llama4TextL2Norm: RMS normalisation in float32, no weight."""
    h = x.astype(jnp.float32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Llama4Attention(Attention):
    """`rope` is (cos, sin, positions [T]): RoPE layers rotate, L2-norm q/k and attend within their chunk; NoPE layers
    scale q by the temperature of their position."""

    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        chunk = cfg.option("chunk_size") if layer in cfg.option("chunked_layers", ()) else None
        if chunk is not None and not attention.supports_chunks:  # a backend without chunks: this layer on the reference
            attention = REFERENCE_ATTENTION
        super().__init__(cfg, layer, dtype=dtype, attention=attention)
        if chunk is not None:
            self.spec = dataclasses.replace(self.spec, chunk_size=int(chunk))
        self.use_rope = layer not in cfg.option("nope_layers", ())
        self.l2_eps = cfg.rms_norm_eps if self.use_rope and cfg.option("l2_qk_norm") else None
        self.temperature = None if self.use_rope else cfg.option("temperature")

    def rotate(self, q, k, rope):
        cos, sin, positions = rope
        if self.use_rope:
            q, k = super().rotate(q, k, (cos, sin))
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scale[:, None, None]).astype(q.dtype)
        return q, k


class Llama4MoeBlock(SparseMoeBlock):
    """Router `gate` (top-k of the logits, sigmoid of those), experts fed x times their score, a shared expert."""

    def __init__(self, cfg: ModelConfig, moe: MoeOptions, *, dtype):
        super().__init__(cfg, moe, dtype=dtype)
        shared = dataclasses.replace(cfg, intermediate_size=moe.intermediate_size, mlp_bias=False)
        self.shared_expert = nnx.data(GatedMLP(shared, dtype=dtype))  # (SparseMoeBlock left it None: static)

    def __call__(self, x: jax.Array, num_valid=None) -> jax.Array:
        t, d, k = x.shape[0], x.shape[1], self.top_k
        top, ids = jax.lax.top_k(self.gate(x), k)
        scores = jax.nn.sigmoid(top.astype(jnp.float32)).astype(x.dtype)
        rows = (x[:, None, :] * scores[..., None]).reshape(t * k, d)  # each (token, expert) its own scaled input
        ones = jnp.ones((t * k, 1), x.dtype)
        valid = None if num_valid is None else num_valid * k
        routed = self.experts_output(rows, ids.reshape(t * k, 1), ones, valid).reshape(t, k, d).sum(axis=1)
        return self.shared_expert(x) + routed


class Llama4ForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([MoeDecoderLayer(cfg, i, dtype=dtype, attention=attention, attention_cls=Llama4Attention,
                                                   moe_cls=Llama4MoeBlock) for i in range(cfg.num_layers)])  # fmt: skip
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    def run_layers(self, x, positions, kv_cache, attn_metadata, layers):
        """CausalLM's, the rotary table (interleaved pairs: transformers' complex RoPE) carrying the positions."""
        cfg = self.config
        table = lambda: (*rope_table(cfg.rope, positions, cfg.head_dim, attn_metadata, interleaved=True), positions)  # noqa: E731
        rope = self.shared(table, positions)
        new_kv = []
        for layer in layers:
            x, layer_kv = layer(x, rope, kv_cache, attn_metadata)
            new_kv.append(layer_kv)
        return x, stack_new_kv(new_kv)

    def regroup_tensors(self, tensors, missing=None):
        """transformers' experts ([E, D, 2I] gate then up, [E, I, D] down: already [in, out]) -> one stack each."""
        for name, array, source in tensors:
            match = re.match(r"^(.*\.layers\.\d+\.feed_forward\.experts)\.(gate_up_proj|down_proj)$", name)
            if match is None:
                yield name, array, source
            elif match[2] == "down_proj":
                yield f"{match[1]}.down_proj", np.asarray(array), source
            else:
                gate, up = np.split(np.asarray(array), 2, axis=-1)
                yield f"{match[1]}.gate_proj", gate, source
                yield f"{match[1]}.up_proj", up, source

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        layers = int(hf.num_hidden_layers)
        flags = list(hf.no_rope_layers)
        types = list(getattr(hf, "layer_types", None) or ["full_attention"] * layers)
        if len(flags) != layers or len(types) != layers:
            raise ValueError(f"no_rope_layers / layer_types must have one entry per layer ({layers})")
        unknown = sorted(set(types) - {"full_attention", "chunked_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported by the {architecture} port")
        chunk = getattr(hf, "attention_chunk_size", None)
        chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention") if chunk else ()
        moe = MoeOptions(num_experts=int(hf.num_local_experts), top_k=int(hf.num_experts_per_tok),
                         intermediate_size=int(hf.intermediate_size), renormalize=False,
                         sparse_layers=tuple(int(i) for i in hf.moe_layers))  # fmt: skip
        temperature = (float(hf.floor_scale), float(hf.attn_scale)) if hf.attn_temperature_tuning else None
        options = {
            "moe": moe.as_option(), "nope_layers": tuple(i for i, f in enumerate(flags) if not f), "chunked_layers": chunked,
            "chunk_size": int(chunk) if chunk else None, "l2_qk_norm": bool(hf.use_qk_norm), "temperature": temperature,
        }  # fmt: skip
        return model_config_from_hf(hf_config, architecture, intermediate_size=int(hf.intermediate_size_mlp),
                                    rope_interleaved=True, sliding_windows=(), options=options)  # fmt: skip

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        moe = MoeOptions.of(cfg)
        specs = decoder_specs(cfg.tie_word_embeddings)
        for i, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            specs |= attention_specs(cfg, hf, ours)
            ff, mine = f"{hf}.feed_forward", f"{ours}.mlp"
            if i not in moe.sparse_layers:
                specs |= projection_specs(ff, mine, bias=False)
                continue
            specs[f"{ff}.router.weight"] = WeightSpec(f"{mine}.gate.kernel", transpose=True)
            specs |= {f"{ff}.experts.{p}": WeightSpec(f"{mine}.experts.{p}.kernel") for p in ("gate_proj", "up_proj", "down_proj")}
            specs |= projection_specs(f"{ff}.shared_expert", f"{mine}.shared_expert", bias=False)
        return specs


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The language model of a Llama 4 image-text checkpoint (its names and head tying); the registered class,
    models/vision/llama4.py's, adds the vision model and the projector."""

    CHECKPOINT_RENAMES = (
        (r"^language_model\.model\.", "model."),  # the 4.x spelling, as published
        (r"^model\.language_model\.", "model."),
        (r"^language_model\.lm_head\.", "lm_head."),
    )
    SKIPPED_TENSORS = (ROTARY_CACHE, VISION)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        """The head is tied as transformers ties it here: by the text config's flag (the language model holds it)."""
        cfg = Llama4ForCausalLM.config_from_hf(hf_config, architecture)
        return dataclasses.replace(cfg, tie_word_embeddings=bool(getattr(text_config(hf_config), "tie_word_embeddings", False)))
