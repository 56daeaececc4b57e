"""GPT-OSS (transformers' GptOssForCausalLM, model_type gpt_oss), as transformers 5.24's modeling code computes it:

- attention: q/k/v/o with biases, GQA, YaRN RoPE, and a learned sink logit per head that joins each row's softmax
  denominator (no value): `Attention.sinks`, threaded to every kernel (pallas_kernels/reference.py defines it);
- layers alternate sliding (`sliding_window`, 128 in the released models) and full attention (`layer_types`): the
  engine gives them KV cache groups, so sliding layers hold only about a window of blocks;
- MoE on every layer: a router with a bias, top-k of its logits softmaxed over the k chosen; experts with biases,
  `gate_up_proj` [E, D, 2I] interleaved (gate = columns 0, 2, .., up = 1, 3, ..), split at load into our gate/up
  stacks, and the clamped SwiGLU (moe.expert_glu); models/moe.py's grouped expert loop runs them;
- MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, the released ones): `*_blocks` / `*_scales` stay 4-bit
  where the engine's expert loop is the grouped-GEMM kernel (moe_kernel="triton": compiled on a GPU, interpreted on a
  CPU; pallas_kernels/moe_gemm.py decodes them in its inner loop; not yet run on a GPU), and are dequantized once at
  load to the engine's dtype for every other loop (models/mxfp4.py; Platform.keeps_mxfp4 decides).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import REFERENCE_ATTENTION, Attention, CausalLM, Embedding, Linear, RMSNorm, _param, module_list
from jaxpaged.models.llama import attention_specs
from jaxpaged.models.mixtral import MoeDecoderLayer
from jaxpaged.models.moe import ExpertLoop, Experts, MoeOptions, SparseMoeBlock, moe_options_from_hf
from jaxpaged.models.weights import WeightSpec, decoder_specs, layer_prefixes, scale_specs
from jaxpaged.pallas_kernels import AttentionBackend


class GptOssRMSNorm(RMSNorm):
    """weight * x_normed in float32, rounded once (transformers keeps GPT-OSS's norms in float32)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * h).astype(x.dtype)


class GptOssMoeBlock(SparseMoeBlock):
    """`router` (with a bias): top-k of the logits, softmax over those k; `experts` with biases and clamped SwiGLU."""

    def __init__(self, cfg: ModelConfig, moe: MoeOptions, *, dtype):
        self.router = Linear(cfg.hidden_size, moe.num_experts, bias=True, dtype=dtype)
        self.router.keep_float = True  # routing decides which weights run: never quantized
        self.experts = Experts(moe, cfg.hidden_size, act=("clamped_swiglu", *cfg.option("swiglu")), dtype=dtype, bias=True)
        self.shared_expert = self.shared_expert_gate = None
        self.top_k = moe.top_k
        self.renormalize = False
        self.expert_loop = ExpertLoop()

    def __call__(self, x: jax.Array, num_valid=None) -> jax.Array:
        logits = self.router(x).astype(jnp.float32)
        values, ids = jax.lax.top_k(logits, self.top_k)
        return self.experts_output(x, ids.astype(jnp.int32), jax.nn.softmax(values, axis=-1), num_valid)


class GptOssDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, layer, dtype=dtype, attention=attention)
        self.self_attn.sinks = nnx.data(_param((cfg.num_heads,), dtype))  # a static None on other ports
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.mlp = GptOssMoeBlock(cfg, MoeOptions.of(cfg), dtype=dtype)


class GptOssForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([GptOssDecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = GptOssRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        moe = moe_options_from_hf(hf, num_experts=int(hf.num_local_experts), renormalize=False,
                                  intermediate_size=int(hf.intermediate_size))  # fmt: skip
        swiglu = (float(getattr(hf, "swiglu_alpha", 1.702)), float(getattr(hf, "swiglu_limit", 7.0)))
        return model_config_from_hf(hf, architecture, options={"moe": moe.as_option(), "swiglu": swiglu})

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = decoder_specs(cfg.tie_word_embeddings)
        for _, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            specs |= attention_specs(cfg, hf, ours)
            specs[f"{hf}.self_attn.sinks"] = WeightSpec(f"{ours}.self_attn.sinks")
            specs[f"{hf}.mlp.router.weight"] = WeightSpec(f"{ours}.mlp.router.kernel", transpose=True)
            specs[f"{hf}.mlp.router.bias"] = WeightSpec(f"{ours}.mlp.router.bias")
            ex, mine = f"{hf}.mlp.experts", f"{ours}.mlp.experts"
            gate_up = (f"{mine}.gate_proj", f"{mine}.up_proj")
            # [E, D, 2I] and [E, 2I], already [in, out]: gate and up interleaved along the last axis
            specs[f"{ex}.gate_up_proj"] = WeightSpec(tuple(f"{p}.kernel" for p in gate_up), split=deinterleave)
            specs[f"{ex}.gate_up_proj_bias"] = WeightSpec(tuple(f"{p}.bias" for p in gate_up), split=deinterleave)
            specs[f"{ex}.down_proj"] = WeightSpec(f"{mine}.down_proj.kernel")
            specs[f"{ex}.down_proj_bias"] = WeightSpec(f"{mine}.down_proj.bias")
        return specs


def deinterleave(fused):
    """GptOssExperts' gate_up [..., 2I] -> (gate [..., I], up [..., I]): gate the even columns, up the odd. A host
    array's halves made contiguous (the loader's); a JAX one's sliced as they are (traced: update_weights' program)."""
    if isinstance(fused, np.ndarray):
        return np.ascontiguousarray(fused[..., ::2]), np.ascontiguousarray(fused[..., 1::2])
    return fused[..., ::2], fused[..., 1::2]
