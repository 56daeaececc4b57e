"""Gemma 4 (text), as transformers 5.24's modeling_gemma4.py computes Gemma4ForCausalLM and the language model of
Gemma4ForConditionalGeneration:

- embeddings times sqrt(hidden_size); RMSNorm as x * w in float32 (not Gemma 3's 1 + w), v_norm without a scale;
  sandwich norms around attention and MLP; a learned `layer_scalar` multiplying each layer's output;
- attention scale 1 (q and k are RMS-normed), sliding layers (`layer_types`, 5:1 by default) beside full layers
  that have their own head dim (`global_head_dim`), KV-head count (`num_global_key_value_heads` with
  `attention_k_eq_v`, whose value is the key projection before its norm) and RoPE ("proportional": the first
  `partial_rotary_factor` of the angles rotate, frequencies over the whole head dim; the rest pass through);
- per-layer input embeddings (PLE): a [vocab, layers * P] table times sqrt(P), plus the embeddings projected and
  normed per layer, scaled by 1/sqrt(2); each layer gates its slice into the residual stream after its MLP;
- KV sharing: the last `num_kv_shared_layers` layers compute no K/V; each reads the K/V of the last earlier layer of
  its type. Here they get no cache at all: `ModelConfig.kv_layers` lists the layers that keep K/V (the cache's
  first axis, and the only layers in `sliding_windows`, hence in the KV cache groups), and a sharing layer attends
  to its source's cache entry and this step's K/V;
- MoE (`enable_moe_block`): a dense MLP and a routed expert block side by side, each with its own norms; the router
  RMS-normalizes without a scale, multiplies by a learned scale and 1/sqrt(hidden), softmaxes, renormalizes the
  top-k and multiplies each by its expert's `per_expert_scale`; experts run on models/moe.py's grouped loop;
- the final logit soft-cap, in both the text-only and the image-text model.

One KV array serves every layer, so it has the largest head dim and KV-head count of any layer: a layer with fewer
KV heads repeats them (as tensor parallelism does), one with a smaller head dim is zero-padded (q too; scores and
outputs are unchanged, the padded output features are dropped). The padding falls on the sliding layers, whose
groups hold about a window of blocks. Images: models/vision/gemma4.py.

Tensor parallelism (models/sharding.py, option "layer_kv_shapes"): query heads, each layer's K/V projections, the
MLPs and the experts split as in other ports, the cache on its KV-head axis; a layer with fewer KV heads than devices
has its K/V projection's heads repeated to one a device at load, the others split; the per-head q/k norms, the PLE
tables and projections, routers and the vision tower stay whole on every device. A layer whose KV heads neither
divide nor are divided by the device count is refused. Not supported: pipeline parallelism, bidirectional
attention ("all") and audio (the audio tower is skipped); images and videos: models/vision/gemma4.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxpaged.models.accounting import ROTARY_CACHE
from jaxpaged.models.config import ModelConfig, RopeConfig, head_tied, model_config_from_hf, rope_from_hf, text_config
from jaxpaged.models.layers import (
    REFERENCE_ATTENTION,
    CausalLM,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    _param,
    activation,
    apply_rope,
    module_list,
    rope_table,
    rotary_table,
)  # fmt: skip
from jaxpaged.models.moe import ExpertLoop, Experts, MoeOptions, SparseMoeBlock
from jaxpaged.models.weights import WeightSpec, linear_specs
from jaxpaged.pallas_kernels import AttentionBackend, AttentionSpec, paged_attention, stack_new_kv

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}  # fmt: skip
SHARED_KV_WEIGHTS = (
    r"\.layers\.\d+\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.",
    "K/V projections of layers that read an earlier layer's K/V (num_kv_shared_layers): never run, as in transformers",
)


class Gemma4RMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) * w in float32, rounded once; `scaled=False` (v_norm, the router's norm): no w."""

    def __init__(self, features: int, *, eps: float, dtype, scaled: bool = True):
        self.scale = _param((features,), dtype) if scaled else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        if self.scale is not None:
            h = h * self.scale[...].astype(jnp.float32)
        return h.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What one layer's attention looks like (ModelConfig option "layers", one per layer)."""

    kind: str  # SLIDING or FULL
    head_dim: int
    kv_heads: int
    kv_index: int  # the cache entry it writes (its own) or reads (a sharing layer: its source's)
    shares_kv: bool  # reads an earlier layer's K/V, computes none
    k_eq_v: bool  # the value is the key projection (full layers under attention_k_eq_v)


def _layers(cfg: ModelConfig) -> tuple[LayerShape, ...]:
    return cfg.option("layers")


class Gemma4Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        shape = _layers(cfg)[layer]
        d, h, hd, kv = cfg.hidden_size, cfg.num_heads, shape.head_dim, shape.kv_heads
        bias = cfg.attention_bias
        self.q_proj = Linear(d, h * hd, bias=bias, dtype=dtype)
        self.q_norm = Gemma4RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(h * hd, d, bias=bias, dtype=dtype)
        own = not shape.shares_kv
        self.k_proj = Linear(d, kv * hd, bias=bias, dtype=dtype) if own else None
        self.v_proj = Linear(d, kv * hd, bias=bias, dtype=dtype) if own and not shape.k_eq_v else None
        self.k_norm = Gemma4RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype) if own else None
        self.v_norm = Gemma4RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype, scaled=False)
        self.shape = (h, hd, kv)
        self.cache_shape = (cfg.num_kv_heads, cfg.head_dim)  # the KV array's, which every layer's K/V is padded to
        self.kv_index = shape.kv_index
        self.spec = AttentionSpec(1.0, cfg.sliding_windows[shape.kv_index])  # q and k are normed: no 1/sqrt(d)
        self.backend = attention

    def __call__(self, x, rope, kv_cache, attn_metadata, shared_kv=None):
        """shared_kv: the source layer's (k, v) of this step, already in the cache's shape, for a sharing layer."""
        (h, hd, kv), (cache_heads, cache_dim), t = self.shape, self.cache_shape, x.shape[0]
        pad = lambda a: a if hd == cache_dim else jnp.pad(a, ((0, 0), (0, 0), (0, cache_dim - hd)))
        q = apply_rope(self.q_norm(self.q_proj(x).reshape(t, h, hd)), rope)
        if self.k_proj is None:
            k, v = shared_kv
        else:
            # kv heads, or (tensor parallelism: models/sharding.py) each repeated to one a device, n in all; the
            # cache then holds max(cache_heads, n), which either count divides
            raw = self.k_proj(x).reshape(t, -1, hd)
            v = raw if self.v_proj is None else self.v_proj(x).reshape(t, -1, hd)
            k, v = apply_rope(self.k_norm(raw), rope), self.v_norm(v)
            kv = raw.shape[1]
            cache_heads = max(cache_heads, kv)
            if kv != cache_heads:  # head j of the cache holds this layer's KV head j // (cache_heads / kv)
                k, v = (jnp.repeat(a, cache_heads // kv, axis=1) for a in (k, v))
            k, v = pad(k), pad(v)
        out = paged_attention(pad(q), k, v, kv_cache, self.kv_index, attn_metadata, self.spec, backend=self.backend)
        return self.o_proj(out[..., :hd].reshape(t, h * hd)), (None if self.k_proj is None else (k, v))


class Gemma4MoeBlock(SparseMoeBlock):
    """The routed half of a Gemma 4 MoE layer (the dense MLP beside it is the layer's `mlp`)."""

    def __init__(self, cfg: ModelConfig, moe: MoeOptions, *, dtype):
        d = cfg.hidden_size
        self.router_norm = Gemma4RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, scaled=False)
        self.router_proj = Linear(d, moe.num_experts, bias=False, dtype=dtype)
        self.router_proj.keep_float = True  # routing decides which weights run: never quantized
        self.router_scale = _param((d,), dtype)
        self.per_expert_scale = _param((moe.num_experts,), dtype)
        self.experts = Experts(moe, d, act=cfg.hidden_act, dtype=dtype)
        self.shared_expert = self.shared_expert_gate = None
        self.top_k = moe.top_k
        self.renormalize = True
        self.expert_loop = ExpertLoop()
        self.root_size = d**-0.5

    def __call__(self, router_in: jax.Array, x: jax.Array, num_valid=None) -> jax.Array:
        """router_in: the layer's residual stream (transformers routes on it); x: the experts' normed input."""
        h = self.router_norm(router_in) * self.router_scale[...] * self.root_size
        probs = jax.nn.softmax(self.router_proj(h).astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * jnp.take(self.per_expert_scale[...].astype(jnp.float32), ids, axis=0)
        return self.experts_output(x, ids.astype(jnp.int32), weights, num_valid)


class Gemma4DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, dtype, attention: AttentionBackend):
        shape = _layers(cfg)[layer]
        norm = lambda n=cfg.hidden_size: Gemma4RMSNorm(n, eps=cfg.rms_norm_eps, dtype=dtype)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(cfg, layer, dtype=dtype, attention=attention)
        wide = 2 if shape.shares_kv and cfg.option("double_wide_mlp") else 1  # use_double_wide_mlp: sharing layers
        self.mlp = GatedMLP(dataclasses.replace(cfg, intermediate_size=wide * cfg.intermediate_size), dtype=dtype)
        moe = cfg.option("moe")
        self.moe = Gemma4MoeBlock(cfg, MoeOptions.of(cfg), dtype=dtype) if moe else None
        self.post_feedforward_layernorm_1 = norm() if moe else None
        self.post_feedforward_layernorm_2 = norm() if moe else None
        self.pre_feedforward_layernorm_2 = norm() if moe else None
        ple = cfg.option("ple_size", 0)
        self.per_layer_input_gate = Linear(cfg.hidden_size, ple, bias=False, dtype=dtype) if ple else None
        self.per_layer_projection = Linear(ple, cfg.hidden_size, bias=False, dtype=dtype) if ple else None
        self.post_per_layer_input_norm = norm() if ple else None
        self.layer_scalar = _param((1,), dtype)
        self.kind = shape.kind
        self.act = cfg.hidden_act

    def __call__(self, x, per_layer_input, rope, kv_cache, attn_metadata, shared_kv):
        attn, new_kv = self.self_attn(self.input_layernorm(x), rope, kv_cache, attn_metadata, shared_kv)
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:  # the dense MLP and the experts side by side, both off x
            routed = self.moe(x, self.pre_feedforward_layernorm_2(x), num_valid=attn_metadata.query_start_loc[-1])
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input_gate is not None:
            gated = activation(self.act)(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar[...], new_kv


class Gemma4ForCausalLM(CausalLM):
    SKIPPED_TENSORS = (ROTARY_CACHE, SHARED_KV_WEIGHTS)

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attention: AttentionBackend = REFERENCE_ATTENTION):
        self.config = cfg
        d, n = cfg.hidden_size, cfg.num_layers
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype)
        self.layers = module_list([Gemma4DecoderLayer(cfg, i, dtype=dtype, attention=attention) for i in range(n)])
        self.norm = Gemma4RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.init_head(cfg, d, dtype)
        ple = cfg.option("ple_size", 0)
        self.embed_tokens_per_layer = Embedding(cfg.option("ple_vocab_size"), n * ple, dtype=dtype) if ple else None
        self.per_layer_model_projection = Linear(d, n * ple, bias=False, dtype=dtype) if ple else None
        self.per_layer_projection_norm = Gemma4RMSNorm(ple, eps=cfg.rms_norm_eps, dtype=dtype) if ple else None
        # transformers keeps each scale as a float32 tensor and casts it to the weights' dtype
        self.normalizer = float(np.float32(math.sqrt(d)))
        self.ple_normalizer = float(np.float32(math.sqrt(ple))) if ple else 1.0

    def embed(self, input_ids, positions):
        x = self.embed_tokens(input_ids)
        return x * jnp.asarray(self.normalizer, x.dtype)

    def per_layer_inputs(self, input_ids, x):
        """[T, layers, P]: (norm(project(x) / sqrt(D)) + table[ids] * sqrt(P)) / sqrt(2), transformers' PLE."""
        t, n = x.shape[0], self.config.num_layers
        table = self.embed_tokens_per_layer(input_ids)
        table = (table * jnp.asarray(self.ple_normalizer, table.dtype)).reshape(t, n, -1)
        projected = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        return (self.per_layer_projection_norm(projected.reshape(t, n, -1)) + table) * 2.0**-0.5

    def forward(self, input_ids, positions, kv_cache, attn_metadata):
        """As CausalLM's; the new K/V only of the layers that keep it (cfg.kv_layers), in that order."""
        return self.run(input_ids, self.embed(input_ids, positions), positions, kv_cache, attn_metadata)

    def run(self, input_ids, x, positions, kv_cache, attn_metadata):
        """The layers over embeddings x; the per-layer inputs read input_ids and x. key_ends (an image's tokens
        seeing each other: models/vision/gemma4.py) reach the sliding layers only, as transformers' masks."""
        cfg = self.config
        ple = None if self.embed_tokens_per_layer is None else self.per_layer_inputs(input_ids, x)
        ropes = dict(cfg.option("ropes"))
        tables = self.shared(lambda: {kind: _rope_table(ropes[kind], positions, attn_metadata) for kind in ropes}, positions)
        causal = attn_metadata if attn_metadata.key_ends is None else dataclasses.replace(attn_metadata, key_ends=None)
        latest: dict[str, tuple] = {}  # kind -> the K/V of the last layer of that kind that computed one
        new_kv = []
        for i, layer in enumerate(self.layers):
            md = attn_metadata if layer.kind == SLIDING else causal
            x, kv = layer(x, None if ple is None else ple[:, i], tables[layer.kind], kv_cache, md, latest.get(layer.kind))
            if kv is not None:
                new_kv.append(kv)
                latest[layer.kind] = kv
        return self.norm(x), stack_new_kv(new_kv)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        logits = super().compute_logits(hidden)
        cap = self.config.option("final_logit_softcapping")
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def regroup_tensors(self, tensors, missing=None):
        """transformers' fused experts ([E, 2I, D] gate then up, [E, D, I] down) -> our [E, in, out] stacks."""
        for name, array, source in tensors:
            match = re.match(r"^(.*\.layers\.\d+\.experts)\.(gate_up_proj|down_proj)$", name)
            if match is None:
                yield name, array, source
                continue
            w = np.asarray(array)
            if match[2] == "down_proj":
                yield f"{match[1]}.down_proj", np.swapaxes(w, 1, 2), source
            else:
                gate, up = np.split(w, 2, axis=1)
                yield f"{match[1]}.gate_proj", np.swapaxes(gate, 1, 2), source
                yield f"{match[1]}.up_proj", np.swapaxes(up, 1, 2), source

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        return gemma4_config(hf_config, architecture)

    @staticmethod
    def weight_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
        specs = {"model.embed_tokens.weight": WeightSpec("embed_tokens.embedding"), "model.norm.weight": WeightSpec("norm.scale")}
        if not cfg.tie_word_embeddings:
            specs["lm_head.weight"] = WeightSpec("lm_head.kernel", transpose=True)
        ple = cfg.option("ple_size", 0)
        if ple:
            specs["model.embed_tokens_per_layer.weight"] = WeightSpec("embed_tokens_per_layer.embedding")
            specs |= linear_specs("model.per_layer_model_projection", "per_layer_model_projection", bias=False)
            specs["model.per_layer_projection_norm.weight"] = WeightSpec("per_layer_projection_norm.scale")
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if cfg.option("moe"):
            norms += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"]
        if ple:
            norms += ["post_per_layer_input_norm"]
        for i, shape in enumerate(_layers(cfg)):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            specs[f"{hf}.layer_scalar"] = WeightSpec(f"{ours}.layer_scalar")
            for norm in norms:
                specs[f"{hf}.{norm}.weight"] = WeightSpec(f"{ours}.{norm}.scale")
            projections = ["q_proj", "o_proj"] + ([] if shape.shares_kv else ["k_proj"] + ([] if shape.k_eq_v else ["v_proj"]))
            for proj in projections:
                specs |= linear_specs(f"{hf}.self_attn.{proj}", f"{ours}.self_attn.{proj}", bias=cfg.attention_bias)
            for norm in ["q_norm"] + ([] if shape.shares_kv else ["k_norm"]):
                specs[f"{hf}.self_attn.{norm}.weight"] = WeightSpec(f"{ours}.self_attn.{norm}.scale")
            for proj in ("gate_proj", "up_proj", "down_proj"):
                specs |= linear_specs(f"{hf}.mlp.{proj}", f"{ours}.mlp.{proj}", bias=False)
            if ple:
                for proj in ("per_layer_input_gate", "per_layer_projection"):
                    specs |= linear_specs(f"{hf}.{proj}", f"{ours}.{proj}", bias=False)
            if cfg.option("moe"):
                specs |= linear_specs(f"{hf}.router.proj", f"{ours}.moe.router_proj", bias=False)
                specs[f"{hf}.router.scale"] = WeightSpec(f"{ours}.moe.router_scale")
                specs[f"{hf}.router.per_expert_scale"] = WeightSpec(f"{ours}.moe.per_expert_scale")
                for proj in ("gate_proj", "up_proj", "down_proj"):  # as regroup_tensors names the stacks
                    specs[f"{hf}.experts.{proj}"] = WeightSpec(f"{ours}.moe.experts.{proj}.kernel")
        return specs


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The language model of a Gemma 4 image-text(-audio) checkpoint (`model.language_model.*`), its towers and
    their embedders skipped: the base of models/vision/gemma4.py's port, which reads the vision tower. Its head is
    tied by the top-level `tie_word_embeddings`, as transformers reads it."""

    CHECKPOINT_RENAMES = ((r"^model\.language_model\.", "model."),)
    SKIPPED_TENSORS = (  # the towers first: their own k_proj/v_proj would match the shared-K/V rule
        ROTARY_CACHE,
        (r"^model\.(vision_tower|embed_vision|audio_tower|embed_audio)\.",
         "the vision and audio towers and their embedders: not ported, prompts are text"),
        SHARED_KV_WEIGHTS,
    )  # fmt: skip

    def forward(self, input_ids, positions, kv_cache, attn_metadata):
        ids = self.text_ids(input_ids)
        return self.run(ids, self.embed(ids, positions), positions, kv_cache, attn_metadata)

    def text_ids(self, input_ids, image_rows=None):
        """input_ids with the image, video and audio placeholders as the pad token (and image_rows >= 0: the
        tokens an image's embeddings replace), as transformers' image-text model embeds them, wherever they come
        from (a generated placeholder too)."""
        placeholders, pad = self.config.option("placeholders")
        hit = jnp.isin(input_ids, jnp.asarray(placeholders, input_ids.dtype))
        if image_rows is not None:
            hit |= image_rows >= 0
        return jnp.where(hit, pad, input_ids)

    @staticmethod
    def config_from_hf(hf_config, architecture: str) -> ModelConfig:
        cfg = gemma4_config(hf_config, architecture)
        ids = (getattr(hf_config, name, None) for name in ("image_token_id", "video_token_id", "audio_token_id"))
        placeholders = (tuple(int(i) for i in ids if i is not None), int(text_config(hf_config).pad_token_id or 0))
        return dataclasses.replace(cfg, options=tuple(sorted(dict(cfg.options, placeholders=placeholders).items())))


# -- the config -----------------------------------------------------------------------------------


def _rope_table(rope, positions, attn_metadata):
    """(cos, sin) over a layer kind's whole head dim: proportional RoPE's own frequencies, else the shared table."""
    if rope[0] == "proportional":
        return rotary_table(positions, np.asarray(rope[1], np.float32))
    _, config, head_dim = rope
    return rope_table(config, positions, head_dim, attn_metadata)


def _rope(params: dict, head_dim: int, max_pos: int):
    """A layer kind's RoPE: ("proportional", inv_freq) computed as transformers does (the first
    int(partial_rotary_factor * head_dim / 2) frequencies over head_dim, zeros after, all / factor), or
    ("table", RopeConfig, head_dim) for the types rope_table knows (over the whole head dim, as transformers'
    default RoPE for Gemma 4 ignores partial_rotary_factor)."""
    if params.get("rope_type", "default") == "proportional":
        theta, factor = float(params["rope_theta"]), float(params.get("factor", 1.0))
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        rotated = 1.0 / (theta ** (np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim))
        inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)]).astype(np.float32) / factor
        return ("proportional", tuple(float(f) for f in inv.astype(np.float32)))
    return ("table", rope_from_hf(types.SimpleNamespace(rope_parameters=params, max_position_embeddings=max_pos)), head_dim)


def _layer_attr(text, i: int, name: str):
    """A layer's value of `name`: transformers 5.24 resolves global layers' head dim and KV heads per layer
    (`per_layer_config`, from `global_head_dim` / `num_global_key_value_heads`)."""
    try:
        return getattr(text.per_layer_config[i], name)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return getattr(text, name)


class _Homogeneous:
    """The text config's attributes with the per-layer ones (head_dim, num_key_value_heads), which transformers
    refuses to read globally, as None: model_config_from_hf's defaults, which gemma4_config overrides."""

    get_text_config = None  # text_config(view) is the view

    def __init__(self, text, tied: bool):
        self.text, self.tie_word_embeddings = text, tied

    def __getattr__(self, name):
        try:
            return getattr(self.text, name)
        except Exception as exc:  # transformers' AmbiguousGlobalPerLayerAttributeError
            if type(exc).__name__ == "AmbiguousGlobalPerLayerAttributeError":
                return None
            raise


def gemma4_config(hf_config, architecture: str) -> ModelConfig:
    text = text_config(hf_config)
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError(f"use_bidirectional_attention='all' ({architecture}): bidirectional Gemma 4 models are not "
                         "supported; jaxpaged serves causal language models")  # fmt: skip
    n = int(text.num_hidden_layers)
    kinds = list(text.layer_types)
    shared = int(getattr(text, "num_kv_shared_layers", 0) or 0)
    first_shared = n - shared
    if shared and not set(kinds[first_shared:]) <= set(kinds[:first_shared]):
        raise ValueError(f"{architecture}: num_kv_shared_layers={shared} leaves a layer type no earlier layer computes K/V for")
    kv_layers = tuple(range(first_shared))
    k_eq_v = bool(getattr(text, "attention_k_eq_v", False))
    head_dims = [int(_layer_attr(text, i, "head_dim")) for i in range(n)]
    kv_heads = [int(_layer_attr(text, i, "num_key_value_heads")) for i in range(n)]
    source = {kind: max(i for i in kv_layers if kinds[i] == kind) for kind in set(kinds[:first_shared])}
    layers = tuple(
        LayerShape(kinds[i], head_dims[i], kv_heads[i], i if i < first_shared else source[kinds[i]], i >= first_shared,
                   k_eq_v and kinds[i] == FULL)
        for i in range(n)
    )  # fmt: skip
    cache_heads, cache_dim = max(kv_heads), max(head_dims)
    if any(cache_heads % h for h in kv_heads):
        raise ValueError(f"{architecture}: KV-head counts {sorted(set(kv_heads))} must divide the largest")
    params = {**DEFAULT_ROPE, **dict(getattr(text, "rope_parameters", None) or {})}
    max_pos = int(text.max_position_embeddings)
    ropes = {kind: _rope(dict(params[kind]), next(s.head_dim for s in layers if s.kind == kind), max_pos)
             for kind in set(kinds)}  # fmt: skip
    ple = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
    options = {
        "layers": layers,
        "ropes": tuple(sorted(ropes.items())),
        "ple_size": ple,
        "ple_vocab_size": int(getattr(text, "vocab_size_per_layer_input", 0) or text.vocab_size) if ple else 0,
        "double_wide_mlp": bool(getattr(text, "use_double_wide_mlp", False)),
        # an image's tokens see each other on the sliding layers (Gemma 4's larger models; models/vision/gemma4.py)
        "bidirectional_images": getattr(text, "use_bidirectional_attention", None) == "vision",
        "final_logit_softcapping": None if text.final_logit_softcapping is None else float(text.final_logit_softcapping),
        # tensor parallelism checks and widens each layer's KV heads on its own (models/sharding.py)
        "layer_kv_shapes": tuple((s.kv_heads, s.head_dim) for s in layers),
        "no_pipeline_parallel": f"{architecture} is not cut into stages (a layer sharing K/V reads an earlier "
                                "layer's, which another stage's cache would hold)",
    }
    if getattr(text, "enable_moe_block", False):
        e, k = int(text.num_experts), int(text.top_k_experts)
        options["moe"] = MoeOptions(e, k, int(text.moe_intermediate_size), True, 0, tuple(range(n))).as_option()
    window = int(text.sliding_window)
    return model_config_from_hf(
        _Homogeneous(text, head_tied(hf_config)), architecture, hidden_act=str(text.hidden_activation), head_dim=cache_dim, num_kv_heads=cache_heads,
        rope=RopeConfig(theta=10_000.0), qk_norm=False, kv_layers=kv_layers,
        sliding_windows=tuple(window if kinds[i] == SLIDING else None for i in kv_layers), options=options,
    )  # fmt: skip
