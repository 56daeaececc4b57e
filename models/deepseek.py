"""DeepSeek-V2/V3 (transformers' DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Kimi K2 and Moonlight are V3), as
transformers 5.24's modeling code computes them:

- multi-head latent attention (MLA): q through q_proj, or V3's low-rank q_a_proj -> q_a_layernorm -> q_b_proj
  (`q_lora_rank`); one latent per token (kv_a_proj_with_mqa -> kv_a_layernorm, `kv_lora_rank` wide) and one RoPE key
  shared by the heads (`qk_rope_head_dim`); kv_b_proj up-projects the latent to each head's k_nope and value. The
  paged cache holds only [latent, k_pe] per token and layer (pallas_kernels/mla.py: this step's keys attend in the
  expanded form, the cached context in the absorbed one);
- RoPE on interleaved pairs (V2's complex rotation; V3's `rope_interleave`, whose de-interleaved output is the same
  pairs reordered in q and k alike, so every score is equal), or rotate-half (V3, rope_interleave false); YaRN with
  its mscale in cos/sin, and the softmax scale qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2;
- MoE after `first_k_dense_replace` dense layers: routed experts through models/moe.py's grouped loop, the shared
  experts (n_shared_experts x moe_intermediate_size, no gate) always added; the router (moe.grouped_route): V2
  softmax scores, greedy or group-limited (a group's best score); V3 sigmoid scores plus e_score_correction_bias for
  choosing, groups ranked by their top-2 sum, weights renormalized (norm_topk_prob); both scaled by
  routed_scaling_factor.

DeepSeek-V3.2 (DeepseekV32ForCausalLM) is V3 plus DeepSeek Sparse Attention: a lightning indexer per layer picks the
`index_topk` cached tokens each query attends to. While a sequence is no longer than index_topk every visible token is
picked, so V3's dense MLA is exactly the model's attention; past it, it is not. The indexer's tensors are skipped
unread and the model's context (max_position_embeddings, which bounds max_model_len) is capped at index_topk.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, model_config_from_hf, text_config
from jaxpaged.models.layers import (
    REFERENCE_ATTENTION,
    CausalLM,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    _param,
    apply_rope,
    module_list,
)
from jaxpaged.models.mixtral import MoeDecoderLayer
from jaxpaged.models.moe import (
    EXPERT_PROJECTIONS,
    ExpertLoop,
    Experts,
    MoeOptions,
    RouterOptions,
    SparseMoeBlock,
    expert_kernel_name,
    grouped_route,
    regroup_expert_tensors,
)  # fmt: skip
from jaxpaged.models.weights import (
    WeightSpec,
    decoder_specs,
    layer_prefixes,
    linear_specs,
    projection_specs,
    scale_specs,
)
from jaxpaged.pallas_kernels import AttentionBackend, MosaicAttention, TritonAttention
from jaxpaged.pallas_kernels.attention import TP_AXIS, tp_size
from jaxpaged.pallas_kernels.mla import latent_planes, mla_attention

MTP_LAYERS = ("the multi-token-prediction layer (model.layers.{num_hidden_layers}.*: enorm, hnorm, eh_proj, "
              "shared_head and a decoder layer; a draft head for speculative decoding): not part of the model; "
              "DeepSeek-V3's and GLM-4.5's are read apart by speculative method 'mtp' only")
INDEXER = ("DeepSeek-V3.2's sparse-attention indexer (self_attn.indexer.*: wq_b, wk, k_norm, weights_proj): not run; "
           "dense MLA is the model's attention while a sequence fits index_topk, at which max_model_len is capped")
V32_CONTEXT = ("DeepSeek-V3.2 runs here as dense MLA, which equals its sparse attention (each query's top "
               "index_topk={topk} tokens) only while a sequence is at most index_topk tokens; past it the dense path "
               "is not the model's attention, so max_model_len is at most index_topk ({topk})")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them without the config's eps


@dataclasses.dataclass(frozen=True)
class MlaOptions:
    """The MLA sizes of a ModelConfig (kept in its `options`)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    scale: float = 1.0  # on q.k: qk_head_dim^-0.5, times YaRN's mscale_all_dim correction squared

    @staticmethod
    def of(cfg: ModelConfig) -> MlaOptions:
        return MlaOptions(**dict(cfg.option("mla")))

    @property
    def latent_width(self) -> int:
        """Values a token's cache row holds per layer: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def expanded_width(self, num_heads: int) -> int:
        """Values per token and layer the same attention would cache expanded (every head's K and V)."""
        return num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class LatentUpProjection(nnx.Module):
    """kv_b_proj's kernel [R, H * (N + V)], read whole as W_UK and W_UV (not a Linear: the CPU's packed panels or a
    quantized layout would hide the per-head halves the absorbed form needs)."""

    def __init__(self, rank: int, out_features: int, *, dtype):
        self.kernel = _param((rank, out_features), dtype)


class MlaAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        if getattr(attention, "batch_invariant", False):
            raise ValueError("batch_invariant: not supported for multi-head latent attention (DeepSeek-V2/V3): its "
                             "attention folds this step's keys before the cached ones, as the reference does")  # fmt: skip
        mla = MlaOptions.of(cfg)
        d, h = cfg.hidden_size, cfg.num_heads
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = Linear(d, mla.q_lora_rank, bias=cfg.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, h * qk, bias=False, dtype=dtype)
            self.q_proj = None
        else:
            self.q_proj = Linear(d, h * qk, bias=False, dtype=dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(d, mla.latent_width, bias=cfg.attention_bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = LatentUpProjection(mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), dtype=dtype)
        self.o_proj = Linear(h * mla.v_head_dim, d, bias=cfg.attention_bias, dtype=dtype)
        self.layer = layer
        self.mla = mla
        self.num_heads = h
        self.interleaved = cfg.rope_interleaved
        self.backend = attention  # Pallas: the absorbed part in pallas_kernels/mla_gpu.py (Triton) or mla_tpu.py (Mosaic)

    def __call__(self, x, rope, kv_cache, attn_metadata):
        mla, h, t = self.mla, self.num_heads, x.shape[0]
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(t, h, nope + mla.qk_rope_head_dim)
        q_nope, q_pe = q[..., :nope], apply_rope(q[..., nope:], rope, interleaved=self.interleaved)
        latent = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(latent[:, :rank])
        k_pe = apply_rope(latent[:, None, rank:], rope, interleaved=self.interleaved)[:, 0]
        w = self.kv_b_proj.kernel[...].reshape(rank, h, nope + mla.v_head_dim)
        w_uk, w_uv = w[..., :nope], w[..., nope:]
        n = tp_size()
        absorbed = None  # the cached context's absorbed attention: a kernel where the platform picked Pallas
        if isinstance(self.backend, TritonAttention):
            from jaxpaged.pallas_kernels.mla_gpu import gpu_mla_cached

            absorbed = functools.partial(gpu_mla_cached, interpret=self.backend.interpret)
        elif isinstance(self.backend, MosaicAttention):
            from jaxpaged.pallas_kernels import mla_tpu

            if mla_tpu.takes(kv_cache):  # else (blocks under 16 tokens, an 8-bit cache) the pure-JAX path
                absorbed = functools.partial(mla_tpu.tpu_mla_cached, interpret=self.backend.interpret)
        out = mla_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, kv_cache, self.layer, attn_metadata, mla.scale,
                            tp=n, tp_axis=TP_AXIS, absorbed=absorbed)  # fmt: skip
        k, v = latent_planes(c_kv, k_pe)
        if n > 1:  # one copy of the latent per device (the cache's KV-head axis, split over the mesh)
            k, v = (jnp.broadcast_to(a, (t, n, a.shape[-1])) for a in (k, v))
        return self.o_proj(out.reshape(t, h * mla.v_head_dim)), (k, v)


class DeepseekMoeBlock(SparseMoeBlock):
    """The router `gate` (and V3's `e_score_correction_bias`), the routed `experts` and the always-on `shared_experts`."""

    def __init__(self, cfg: ModelConfig, moe: MoeOptions, *, dtype):
        router = RouterOptions(**dict(cfg.option("router")))
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False, dtype=dtype)
        self.gate.keep_float = True  # routing decides which weights run: never quantized
        self.e_score_correction_bias = _param((moe.num_experts,), jnp.float32) if router.correction_bias else None
        self.experts = Experts(moe, cfg.hidden_size, act=cfg.hidden_act, dtype=dtype)
        shared = dataclasses.replace(cfg, intermediate_size=moe.shared_expert_size, mlp_bias=False)
        self.shared_experts = GatedMLP(shared, dtype=dtype) if moe.shared_expert_size else None
        self.shared_expert = self.shared_expert_gate = None
        self.top_k = moe.top_k
        self.renormalize = router.renormalize
        self.router = router
        self.expert_loop = ExpertLoop()

    def __call__(self, x: jax.Array, num_valid=None) -> jax.Array:
        logits = self.gate(x.astype(jnp.float32)).astype(jnp.float32)  # in float32, as transformers' router
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]
        weights, ids = grouped_route(logits, self.top_k, self.router, bias)
        out = self.experts_output(x, ids, weights, num_valid)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(MoeDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        super().__init__(cfg, layer, dtype=dtype, attention=attention, attention_cls=MlaAttention, moe_cls=DeepseekMoeBlock)


class DeepseekForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE,)
    decoder_layer = DeepseekDecoderLayer  # (cfg, layer, *, dtype, attention): also the MTP layer's block (spec_decode)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = module_list([self.decoder_layer(cfg, i, dtype=dtype, attention=attention) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, cfg.hidden_size, dtype)

    @staticmethod
    def kernel_head_dim(cfg: ModelConfig) -> int:
        """The head dim the platform chooses an attention backend by: the RoPE key's (a power of two, so a GPU or TPU
        picks its Pallas kernel) when the GPU's MLA kernel takes this latent (every segment of a plane 16 wide or
        more: every released MLA model's 288), else the cache's half-row (the reference then, or an explicit "pallas"
        refused). The TPU's kernel takes any half-row (padded to 128 lanes), and checks its block size at the call."""
        from jaxpaged.pallas_kernels.mla_gpu import MIN_ROWS, segments  # Pallas is imported only where used

        if min(size for _, size in segments(cfg.head_dim)) >= MIN_ROWS:
            return MlaOptions.of(cfg).qk_rope_head_dim
        return cfg.head_dim

    def regroup_tensors(self, tensors, missing=None):
        return regroup_expert_tensors(tensors, MoeOptions.of(self.config).num_experts, missing)

    @staticmethod
    def unread_tensors(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        """V3's multi-token-prediction layers (`num_nextn_predict_layers`, stored as the layers after the last:
        `model.layers.61.*` in DeepSeek-V3/R1), skipped before they are read: never dequantized, their experts never
        stacked on the host."""
        first, count = cfg.num_layers, int(cfg.option("mtp_layers", 0))
        rules = ((r"(^|\.)self_attn\.indexer\.", INDEXER),) if cfg.option("index_topk") else ()
        if not count:
            return rules
        return rules + ((rf"^model\.layers\.({'|'.join(str(i) for i in range(first, first + count))})\.", MTP_LAYERS),)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        hf = text_config(hf_config)
        mla = mla_options_from_hf(hf)
        if (mla.latent_width) % 2:
            raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {mla.latent_width} must be even (the latent cache "
                             "row is stored as two halves)")  # fmt: skip
        v32 = architecture == "DeepseekV32ForCausalLM"  # V3 and its sparse attention's indexer (not run)
        v3 = v32 or architecture == "DeepseekV3ForCausalLM"
        experts = int(hf.n_routed_experts)
        layers = int(hf.num_hidden_layers)
        first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
        sparse = tuple(range(first_dense, layers))
        if mlp_types := getattr(hf, "mlp_layer_types", None):  # V3.2's "dense"/"sparse" a layer
            sparse = tuple(i for i, t in enumerate(mlp_types) if t == "sparse")
        moe = MoeOptions(
            num_experts=experts, top_k=int(hf.num_experts_per_tok), intermediate_size=int(hf.moe_intermediate_size),
            renormalize=bool(v3 and hf.norm_topk_prob),
            shared_expert_size=int(hf.moe_intermediate_size) * int(getattr(hf, "n_shared_experts", 0) or 0),
            sparse_layers=sparse,
        )  # fmt: skip
        router = router_options_from_hf(hf, v3, moe)
        mtp = int(getattr(hf, "num_nextn_predict_layers", None) or getattr(hf, "num_mtp_layers", None) or 0)
        options = {"mla": _as_option(mla), "moe": moe.as_option(), "router": _as_option(router), "mtp_layers": mtp}
        if v32:  # the engine reads context_limit: why max_model_len stops at max_position_embeddings (see V32_CONTEXT)
            topk = int(hf.index_topk)
            options |= {"index_topk": topk, "context_limit": V32_CONTEXT.format(topk=topk)}
        cfg = model_config_from_hf(
            hf, architecture, num_kv_heads=1, head_dim=mla.latent_width // 2, rotary_dim=mla.qk_rope_head_dim,
            rope_interleaved=bool(getattr(hf, "rope_interleave", True)) if v3 and not v32 else True,  # V3.2: always
            attention_out_bias=None, options=options,
        )  # fmt: skip
        if v32:
            cfg = dataclasses.replace(cfg, max_position_embeddings=min(cfg.max_position_embeddings, topk))
        return cfg

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        moe, mla = MoeOptions.of(cfg), MlaOptions.of(cfg)
        router = RouterOptions(**dict(cfg.option("router")))
        specs = decoder_specs(cfg.tie_word_embeddings)
        for i, hf, ours in layer_prefixes(cfg.num_layers):
            specs |= scale_specs(hf, ours)
            a, b = f"{hf}.self_attn", f"{ours}.self_attn"
            if mla.q_lora_rank:
                specs |= linear_specs(f"{a}.q_a_proj", f"{b}.q_a_proj", bias=cfg.attention_bias)
                specs[f"{a}.q_a_layernorm.weight"] = WeightSpec(f"{b}.q_a_layernorm.scale")
                specs |= linear_specs(f"{a}.q_b_proj", f"{b}.q_b_proj", bias=False)
            else:
                specs |= linear_specs(f"{a}.q_proj", f"{b}.q_proj", bias=False)
            specs |= linear_specs(f"{a}.kv_a_proj_with_mqa", f"{b}.kv_a_proj_with_mqa", bias=cfg.attention_bias)
            specs[f"{a}.kv_a_layernorm.weight"] = WeightSpec(f"{b}.kv_a_layernorm.scale")
            specs[f"{a}.kv_b_proj.weight"] = WeightSpec(f"{b}.kv_b_proj.kernel", transpose=True)
            specs |= linear_specs(f"{a}.o_proj", f"{b}.o_proj", bias=cfg.attention_bias)
            specs |= deepseek_moe_specs(moe, router, i, hf, ours)
        return specs


def deepseek_moe_specs(moe: MoeOptions, router: RouterOptions, layer: int, hf: str, ours: str,
                       bias: str = "gate.e_score_correction_bias") -> dict[str, WeightSpec]:  # fmt: skip
    """A DeepseekMoeBlock layer's MLP tensors (a dense GatedMLP's where the layer is not sparse), shared by the ports
    that reuse it (GLM-4.5, MiniMax-M2); bias: where the checkpoint keeps e_score_correction_bias under `mlp.`."""
    mlp = f"{ours}.mlp"
    if layer not in moe.sparse_layers:
        return projection_specs(f"{hf}.mlp", mlp, bias=False)
    specs = {f"{hf}.mlp.gate.weight": WeightSpec(f"{mlp}.gate.kernel", transpose=True)}
    if router.correction_bias:
        specs[f"{hf}.mlp.{bias}"] = WeightSpec(f"{mlp}.e_score_correction_bias")
    for proj in EXPERT_PROJECTIONS:
        specs[expert_kernel_name(hf, proj)] = WeightSpec(f"{mlp}.experts.{proj}.kernel")
    if moe.shared_expert_size:  # DeepSeek's shared_experts (plural), with no gate of their own
        specs |= projection_specs(f"{hf}.mlp.shared_experts", f"{mlp}.shared_experts", bias=False)
    return specs


def _as_option(options) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(dataclasses.asdict(options).items()))


def mla_options_from_hf(hf) -> MlaOptions:
    nope, rope_dim = int(hf.qk_nope_head_dim), int(hf.qk_rope_head_dim)
    scale = (nope + rope_dim) ** -0.5
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    q_lora = getattr(hf, "q_lora_rank", None)
    return MlaOptions(int(hf.kv_lora_rank), nope, rope_dim, int(hf.v_head_dim), int(q_lora) if q_lora else None, float(scale))


def router_options_from_hf(hf, v3: bool, moe: MoeOptions) -> RouterOptions:
    """V3: sigmoid, correction bias, groups by top-2 sum (always); V2: softmax, groups by max only when topk_method
    is group_limited_greedy."""
    groups = int(getattr(hf, "n_group", None) or 1)
    limited = v3 or getattr(hf, "topk_method", "greedy") == "group_limited_greedy"
    if not limited:
        groups = 1
    if moe.num_experts % groups:
        raise ValueError(f"n_group={groups} does not divide n_routed_experts={moe.num_experts}")
    return RouterOptions(
        scoring="sigmoid" if v3 else "softmax", correction_bias=v3, num_groups=groups,
        topk_groups=int(getattr(hf, "topk_group", None) or groups) if groups > 1 else 1,
        group_score="top2_sum" if v3 else "max", renormalize=moe.renormalize,
        scaling=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
    )  # fmt: skip
