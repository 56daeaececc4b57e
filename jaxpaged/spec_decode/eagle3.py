"""The `eagle3` draft: an EAGLE-3 head (a separate checkpoint trained for one target), as vLLM's Eagle3LlamaForCausalLM
runs it, through the MTP proposer's shadow step and chained guesses (spec_decode/mtp.py).

The target keeps, for every token of its step, the residual stream entering three of its layers (`aux_layers`: the
head's `eagle_aux_hidden_state_layer_ids`, else vLLM's default (2, L // 2, L - 3); id i is the output of layer i - 1,
0 the embedding) concatenated: [T, 3 * D] (CausalLM.forward_with_aux). At position t the head takes that h_t
through `fc` (3D -> D), and the embedding of token t+1: its one Llama layer attends from concat(input_layernorm(e),
hidden_norm(h)) (q/k/v read 2D), the residual being h (or hidden_norm(h) with `norm_before_residual`), then the MLP;
`norm` and its own `lm_head` over a draft vocabulary give token t+2, mapped to the target's by `d2t` (target id =
draft id + d2t[draft id]). A chained guess feeds the layer's output before `norm` (D wide: no fc) as the next h.

Checkpoints: EAGLE-3's own layout (`midlayer.*`, config `LlamaForCausalLMEagle3`) and the speculators layout
(`layers.0.*`, config `Eagle3Speculator` with `transformer_layer_config`); an embedding is read where the head has
one, else the target's is shared. Safetensors only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.models.accounting import TensorLedger
from jaxpaged.models.config import ModelConfig
from jaxpaged.models.layers import Attention, CausalLM, Embedding, GatedMLP, Linear, RMSNorm, rope_table, stack_new_kv
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.loader import DTYPES, LoadedModel, _safetensors_files
from jaxpaged.models.safetensors_io import open_files, tensors_in_order
from jaxpaged.models.weights import WeightSpec, linear_specs, load_tensors_into, projection_specs

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
UNUSED = (r"^t2d$", "the target-to-draft vocabulary mask: the draft's guesses are mapped by d2t alone")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice for a head that names none: the streams entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def _refuse(why: str) -> ValueError:
    return ValueError(f"speculative_config.method 'eagle3': {why}")


class Eagle3Layer(nnx.Module):
    """fc, the embedding where the head has its own, the layer (2D-wide q/k/v), norm, lm_head, d2t."""

    def __init__(self, cfg: ModelConfig, target_hidden: int, draft_vocab: int, *, dtype, attention, own_embedding: bool,
                 norm_before_residual: bool, maps_vocab: bool):  # fmt: skip
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.hidden_size, self.aux_width = d, 3 * target_hidden
        self.kv_dims = (cfg.num_kv_heads, cfg.head_dim)
        self.fc = Linear(3 * target_hidden, d, bias=False, dtype=dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, d, dtype=dtype) if own_embedding else None
        self.input_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.hidden_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.self_attn = Attention(dataclasses.replace(cfg, hidden_size=2 * d), 0, dtype=dtype, attention=attention)
        self.self_attn.o_proj = Linear(cfg.num_heads * cfg.head_dim, d, bias=cfg.out_bias, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(cfg, dtype=dtype)
        self.norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.lm_head = Linear(d, draft_vocab, bias=False, dtype=dtype)
        self.d2t = nnx.Param(jnp.zeros(draft_vocab, jnp.int32)) if maps_vocab else None
        self.norm_before_residual = norm_before_residual

    def embed(self, ids, target: CausalLM) -> jax.Array:
        return (self.embed_tokens if self.embed_tokens is not None else target.embed_tokens)(ids)

    def _attention_input(self, embeds, hidden, positions, attn_metadata):
        """(concat(input_layernorm(e), hidden_norm(h)), the residual, the RoPE table); h through fc when it is the
        target's [T, 3D] streams, as it is when the layer reads a chained guess's output [T, D]."""
        cfg = self.config
        hidden = hidden.astype(embeds.dtype)
        if hidden.shape[-1] == self.aux_width and self.aux_width != self.hidden_size:
            hidden = self.fc(hidden)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = jnp.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        rope = rope_table(cfg.rope, positions, cfg.rotary_dim or cfg.head_dim, attn_metadata, interleaved=cfg.rope_interleaved)
        return x, residual, rope

    def new_kv(self, embeds, hidden, positions, kv_cache, attn_metadata):
        """This step's K/V alone (no guess wanted): the attention's output, the MLP and the head go unused."""
        x, _, rope = self._attention_input(embeds, hidden, positions, attn_metadata)
        _, kv = self.self_attn(x, rope, kv_cache, attn_metadata)
        return stack_new_kv([kv])

    def __call__(self, embeds, hidden, positions, kv_cache, attn_metadata):
        """-> (the output before `norm`, which the next guess chains from [T, D]; this step's K/V)."""
        x, residual, rope = self._attention_input(embeds, hidden, positions, attn_metadata)
        out, kv = self.self_attn(x, rope, kv_cache, attn_metadata)
        residual = residual + out
        return residual + self.mlp(self.post_attention_layernorm(residual)), stack_new_kv([kv])

    def greedy(self, x, target: CausalLM) -> jax.Array:
        """The target-vocabulary id of each row's most likely draft token."""
        ids = jnp.argmax(self.lm_head(self.norm(x)).astype(jnp.float32), axis=-1).astype(jnp.int32)
        return ids if self.d2t is None else ids + self.d2t[...][ids]


@dataclasses.dataclass(frozen=True)
class Eagle3Head:
    """A head read from its folder: the layer and the target layers whose input streams it reads."""

    layer: Eagle3Layer
    aux_layers: tuple[int, ...]


def _configs(folder: Path, target: LoadedModel) -> tuple[dict, dict]:
    """(the head's config.json, its layer's Llama config) from either layout."""
    path = folder / "config.json"
    if not path.is_file():
        raise _refuse(f"{folder} has no config.json (speculative_config.model: an EAGLE-3 head's folder)")
    config = json.loads(path.read_text())
    arch = (config.get("architectures") or [""])[0]
    if arch not in ARCHITECTURES:
        raise _refuse(f"{folder} holds a {arch or 'model without architectures'}, not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
    layer = dict(config.get("transformer_layer_config") or config)
    layer.setdefault("vocab_size", target.config.vocab_size)
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise _refuse(f"heads of one layer are supported ({folder}: {layer['num_hidden_layers']})")
    return config, layer


def load_eagle3_head(spec_model: str, target: LoadedModel, attention) -> Eagle3Head:
    """The head in `spec_model` (a local folder) for `target`; a ValueError naming speculative_config otherwise."""
    import transformers

    if type(target.model).forward is not CausalLM.forward or hasattr(target.model, "state_spec"):
        raise _refuse(f"not supported for {target.config.architecture} (its streams are read through the shared "
                      "forward, which it does not run, or runs with linear-attention state)")  # fmt: skip
    folder = Path(spec_model)
    if not folder.is_dir():
        raise _refuse(f"speculative_config.model {spec_model!r} is not a local folder")
    config, layer_config = _configs(folder, target)
    cfg = LlamaForCausalLM.config_from_hf(transformers.LlamaConfig(**layer_config), "LlamaForCausalLM")
    if cfg.vocab_size != target.config.vocab_size:
        raise _refuse(f"the head's vocabulary ({cfg.vocab_size}) is not the target's ({target.config.vocab_size})")
    target_hidden = int(config.get("target_hidden_size") or target.config.hidden_size)
    if target_hidden != target.config.hidden_size:
        raise _refuse(f"the head reads streams {target_hidden} wide; the target's are {target.config.hidden_size}")
    n = target.config.num_layers
    aux = tuple(int(i) for i in (config.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(n)))
    if len(aux) != 3 or not all(0 <= i < n for i in aux):
        raise _refuse(f"eagle_aux_hidden_state_layer_ids must be 3 layer ids in 0..{n - 1} (got {list(aux)})")
    where = open_files(_safetensors_files(folder))
    names = {_canonical(name) for name in where}
    draft_vocab = int(config.get("draft_vocab_size") or layer_config.get("draft_vocab_size") or cfg.vocab_size)
    layer = Eagle3Layer(cfg, target_hidden, draft_vocab, dtype=DTYPES[target.dtype], attention=attention,
                        own_embedding="embed_tokens.weight" in names, maps_vocab="d2t" in names,
                        norm_before_residual=bool(config.get("norm_before_residual", False)))  # fmt: skip
    specs = _weight_specs(cfg, own_embedding=layer.embed_tokens is not None)
    tensors = ((_canonical(name), array, source) for name, array, source in tensors_in_order(where))
    floats, d2t = [], None
    for name, array, source in tensors:
        if name == "d2t":
            d2t = np.asarray(array).astype(np.int64)
        else:
            floats.append((name, array, source))
    load_tensors_into(layer, specs, floats, DTYPES[target.dtype], ledger=TensorLedger((UNUSED,)))
    if d2t is not None:
        if d2t.shape != (draft_vocab,) or (np.arange(draft_vocab) + d2t >= cfg.vocab_size).any():
            raise _refuse(f"d2t must map each of the {draft_vocab} draft tokens into the target's vocabulary")
        layer.d2t[...] = jnp.asarray(d2t, jnp.int32)
    return Eagle3Head(layer, aux)


def _canonical(name: str) -> str:
    """A head's tensor name in the speculators layout: `midlayer.` is `layers.0.`, and no `model.` prefix."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _weight_specs(cfg: ModelConfig, *, own_embedding: bool) -> dict[str, WeightSpec]:
    specs = {f"layers.0.{n}.weight": WeightSpec(f"{n}.scale") for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    specs["norm.weight"] = WeightSpec("norm.scale")
    specs |= linear_specs("fc", "fc", bias=False) | linear_specs("lm_head", "lm_head", bias=False)
    for p in ("q_proj", "k_proj", "v_proj"):
        specs |= linear_specs(f"layers.0.self_attn.{p}", f"self_attn.{p}", bias=cfg.attention_bias)
    specs |= linear_specs("layers.0.self_attn.o_proj", "self_attn.o_proj", bias=cfg.out_bias)
    specs |= projection_specs("layers.0.mlp", "mlp", bias=cfg.mlp_bias)
    if own_embedding:
        specs["embed_tokens.weight"] = WeightSpec("embed_tokens.embedding")
    return specs
