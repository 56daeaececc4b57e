"""The multi-token-prediction layer a checkpoint ships, one module over the families whose layer vLLM runs as `mtp`.

Every family's layer is the same dataflow around one of the target's own decoder layers (its block): at position t
the embedding of token t+1 and the target's final hidden state h_t are normalized apart, concatenated and projected
back to the model width, run through the block at position t (its own one-layer KV cache), then the final norm and
a head give the logits of token t+2. What differs is where the checkpoint keeps it and three details vLLM follows:

- DeepSeek-V3 and GLM-4.5 (`model.layers.{num_hidden_layers}.*`: enorm, hnorm, eh_proj, the block, shared_head.norm
  and optionally shared_head.head): the embedding is zeroed at position 0, and the chain continues from the block's
  output before shared_head.norm (vLLM's deepseek_mtp.py, glm4_moe_mtp.py);
- Qwen3-Next and Qwen3.5 (`mtp.*`: pre_fc_norm_embedding, pre_fc_norm_hidden, fc, `mtp.layers.0` a full-attention
  layer, mtp.norm; the target's lm_head): zero-centred (1 + w) norms, no masking, and the chain continues from the
  output after mtp.norm (vLLM's qwen3_next_mtp.py, qwen3_5_mtp.py).

The block is built by the target's own class (`decoder_layer`) as the layer 0 of a one-layer config: full attention
(KV layer 0), MoE where the checkpoint's block has experts, so its weight names are the target's for layer 0.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.models.accounting import TensorLedger
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.hybrid import ZeroCenteredRMSNorm
from jaxpaged.models.layers import Linear, RMSNorm, rope_table, stack_new_kv
from jaxpaged.models.loader import DTYPES, LoadedModel, _safetensors_files
from jaxpaged.models.moe import MoeOptions, regroup_expert_tensors
from jaxpaged.models.safetensors_io import open_files, tensors_in_order
from jaxpaged.models.weights import WeightSpec, linear_specs, load_tensors_into
from jaxpaged.pallas_kernels.state_cache import HybridCache

OWN_EMBEDDING = ("the MTP layer's copy of the embedding ({prefix}embed_tokens): the checkpoints share the target's, "
                 "which the layer reads")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MtpLayout:
    """Where a family's checkpoint keeps its first MTP layer ({n}: num_hidden_layers) and how vLLM runs it."""

    prefix: str  # every tensor of the layer
    block: str  # its decoder layer's tensors
    enorm: str
    hnorm: str
    proj: str
    norm: str
    head: str | None  # its own head, where the checkpoint has one (else the target's lm_head)
    zero_centred: bool  # (1 + w) RMSNorms
    mask_first: bool  # the embedding zeroed at position 0
    chain_normed: bool  # the chained hidden state is the output after `norm` (else before)
    count: tuple[str, ...]  # config fields saying how many MTP layers there are (absent: the tensors decide)


NEXTN = MtpLayout("model.layers.{n}.", "model.layers.{n}.", "enorm", "hnorm", "eh_proj", "shared_head.norm",
                  "shared_head.head", False, True, False, ("mtp_layers",))  # fmt: skip
QWEN_MTP = MtpLayout("mtp.", "mtp.layers.0.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", None,
                     True, False, True, ())  # fmt: skip
LAYOUTS = {
    "DeepseekV3ForCausalLM": NEXTN,
    "Glm4MoeForCausalLM": NEXTN,
    "Qwen3NextForCausalLM": QWEN_MTP,
    "Qwen3_5ForCausalLM": QWEN_MTP,
    "Qwen3_5MoeForCausalLM": QWEN_MTP,
    "Qwen3_5ForConditionalGeneration": QWEN_MTP,
    "Qwen3_5MoeForConditionalGeneration": QWEN_MTP,
}


def block_config(cfg: ModelConfig, sparse: bool) -> ModelConfig:
    """cfg as a one-layer model whose layer 0 is the MTP block: full attention at KV layer 0, MoE where `sparse`."""
    options = dict(cfg.options)
    if options.get("moe") is not None:
        options["moe"] = dataclasses.replace(MoeOptions.of(cfg), sparse_layers=(0,) if sparse else ()).as_option()
    if "layer_types" in options:
        options["layer_types"] = ("full_attention",)
    kv_layers = None if cfg.kv_layers is None else (0,)
    return dataclasses.replace(cfg, num_layers=1, kv_layers=kv_layers, sliding_windows=(), options=tuple(options.items()))


class MtpLayer(nnx.Module):
    """enorm, hnorm, eh_proj (each family's names: MtpLayout), the block (`block_cls(cfg, 0, ...)`, its KV layer 0),
    the final norm and, where the checkpoint has one, its own head."""

    def __init__(self, cfg: ModelConfig, layout: MtpLayout, block_cls, *, dtype, attention, sparse: bool, own_head: bool,
                 hybrid: bool = False):  # fmt: skip
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = ZeroCenteredRMSNorm if layout.zero_centred else RMSNorm
        self.config = cfg
        self.layout = layout
        self.num_experts = MoeOptions.of(cfg).num_experts if sparse else 0
        self.enorm = norm(d, eps=eps, dtype=dtype)
        self.hnorm = norm(d, eps=eps, dtype=dtype)
        self.eh_proj = Linear(2 * d, d, bias=False, dtype=dtype)
        self.mtp_block = block_cls(block_config(cfg, sparse), 0, dtype=dtype, attention=attention)
        self.hybrid = hybrid  # a hybrid port's layer (models/hybrid.py): (x, rope, cache, attn, rows) -> (x, kv, states)
        self.final_norm = norm(d, eps=eps, dtype=dtype)
        self.head = Linear(d, cfg.vocab_size, bias=False, dtype=dtype) if own_head else None

    def regroup_tensors(self, tensors, missing=None):
        return regroup_expert_tensors(tensors, self.num_experts, missing) if self.num_experts else tensors

    def _block_input(self, embeds, hidden, positions, attn_metadata):
        """The block's input and RoPE table: eh_proj(concat(enorm(embedding), hnorm(hidden)))."""
        cfg = self.config
        if self.layout.mask_first:  # vLLM: the embedding is unused at position 0
            embeds = jnp.where((positions == 0)[:, None], jnp.zeros_like(embeds), embeds)
        x = self.eh_proj(jnp.concatenate([self.enorm(embeds), self.hnorm(hidden.astype(embeds.dtype))], axis=-1))
        dim = cfg.rotary_dim or cfg.head_dim
        rope = rope_table(cfg.rope, positions, dim, attn_metadata, interleaved=cfg.rope_interleaved)
        return x, rope

    def new_kv(self, embeds, hidden, positions, kv_cache, attn_metadata):
        """This step's K/V alone, for the layer's cache while nothing is proposed: the block's attention input and its
        K/V projections (both layer kinds pre-norm their attention: input_layernorm, self_attn); the attention's
        output, the MLP and the head are never used, so XLA computes none of them."""
        x, rope = self._block_input(embeds, hidden, positions, attn_metadata)
        _, kv = self.mtp_block.self_attn(self.mtp_block.input_layernorm(x), rope, kv_cache, attn_metadata)
        return stack_new_kv([kv])

    def __call__(self, embeds, hidden, positions, kv_cache, attn_metadata):
        """-> (the hidden state the next guess chains from [T, D], this step's K/V for the layer's cache)."""
        x, rope = self._block_input(embeds, hidden, positions, attn_metadata)
        if self.hybrid:
            x, kv, _ = self.mtp_block(x, rope, HybridCache(kv_cache, {}), attn_metadata, None)
        else:
            x, kv = self.mtp_block(x, rope, kv_cache, attn_metadata)
        return (self.final_norm(x) if self.layout.chain_normed else x), stack_new_kv([kv])

    def embed(self, ids, target) -> jax.Array:
        return target.embed_tokens(ids)  # (the checkpoints' own copies of it are the target's: OWN_EMBEDDING)

    def greedy(self, x, target) -> jax.Array:
        return jnp.argmax(self.logits(x, target), axis=-1)

    def logits(self, x, target) -> jax.Array:
        h = x if self.layout.chain_normed else self.final_norm(x)
        return self.head(h).astype(jnp.float32) if self.head is not None else target.compute_logits(h)


def mtp_weight_specs(target_cls, cfg: ModelConfig, layout: MtpLayout, *, sparse: bool,
                     own_head: bool) -> dict[str, WeightSpec]:  # fmt: skip
    """The checkpoint names of the first MTP layer -> MtpLayer's paths: the block's as the target names its layer 0
    (moved under the layout's block prefix), plus the layer's own tensors."""
    n = cfg.num_layers
    pre, block = layout.prefix.format(n=n), layout.block.format(n=n)
    specs = {}
    for name, spec in target_cls.weight_specs(block_config(cfg, sparse)).items():
        if name.startswith("model.layers.0."):
            paths = tuple("mtp_block." + p.removeprefix("layers.0.") for p in spec.paths)
            path = paths[0] if len(paths) == 1 else paths
            specs[block + name.removeprefix("model.layers.0.")] = dataclasses.replace(spec, path=path)
    specs[f"{pre}{layout.enorm}.weight"] = WeightSpec("enorm.scale")
    specs[f"{pre}{layout.hnorm}.weight"] = WeightSpec("hnorm.scale")
    specs |= linear_specs(f"{pre}{layout.proj}", "eh_proj", bias=False)
    specs[f"{pre}{layout.norm}.weight"] = WeightSpec("final_norm.scale")
    if own_head:
        specs[f"{pre}{layout.head}.weight"] = WeightSpec("head.kernel", transpose=True)
    return specs


def _refuse(why: str) -> ValueError:
    return ValueError(f"speculative_config.method 'mtp': {why}")


def load_mtp_layer(loaded: LoadedModel, attention) -> MtpLayer:
    """The checkpoint's first MTP layer, read from its safetensors (the target's load skips it); a ValueError naming
    speculative_config where the model has none or jaxpaged cannot run it."""
    cfg = loaded.config
    layout = LAYOUTS.get(cfg.architecture)
    if layout is None:
        raise _refuse(f"not supported for {cfg.architecture} (supported: {', '.join(LAYOUTS)})")
    declared = [int(cfg.option(name) or 0) for name in layout.count if cfg.option(name) is not None]
    if declared and not any(declared):
        raise _refuse(f"{loaded.source} has no multi-token-prediction layers (num_nextn_predict_layers is 0)")
    if getattr(loaded.hf_config, "quantization_config", None):
        raise _refuse("not supported for a quantized checkpoint yet")
    folder = Path(loaded.source)
    prefix, block = layout.prefix.format(n=cfg.num_layers), layout.block.format(n=cfg.num_layers)
    where = open_files(_safetensors_files(folder)) if folder.is_dir() else {}
    where = {name: f for name, f in where.items() if name.startswith(prefix)}
    if not where:
        raise _refuse(f"{loaded.source} has no multi-token-prediction layers (no {prefix}* tensors)")
    sparse = f"{block}mlp.gate.weight" in where  # MoE where the checkpoint's block has a router (vLLM decides alike)
    own_head = layout.head is not None and f"{prefix}{layout.head}.weight" in where
    dtype = DTYPES[loaded.dtype]
    target_cls = type(loaded.model)
    layer = MtpLayer(cfg, layout, target_cls.decoder_layer, dtype=dtype, attention=attention, sparse=sparse,
                     own_head=own_head, hybrid=hasattr(loaded.model, "state_spec"))  # fmt: skip
    ledger = TensorLedger(((rf"^{re.escape(prefix)}embed_tokens\.", OWN_EMBEDDING.format(prefix=prefix)),))
    specs = mtp_weight_specs(target_cls, cfg, layout, sparse=sparse, own_head=own_head)
    load_tensors_into(layer, specs, tensors_in_order(where), dtype, ledger=ledger)
    return layer
