"""JaxpagedRollout: jaxpaged as Tunix's rollout engine (issue 47), `ClusterConfig(rollout_engine=JaxpagedRollout)`.

Tunix builds it with its own arguments (`rollout_actor`, `tokenizer`, `mesh`, `rollout_config`) and calls `generate`,
`get_per_token_logps`, `update_params`, `pad_id`, `eos_id` and `model`. The engine's model is made from the
trainer's: an HF config from the Tunix model's config (Llama 3, Qwen2/2.5 and Qwen3, the families both have), its
weights from the trainer's arrays through Tunix's own mapping for the model (`BACKEND_MAPPINGS["vllm_jax"]`: names,
transpose keys, hooks), each then reshaped into the port's layout (Tunix's einsum kernels, `[D, N, H]`, are the port's
`[D, N * H]`) inside the engine's one update program. `update_params` is `LLM.update_weights` with the same mapping
(nothing through the host: it runs under Tunix's `transfer_guard("disallow_explicit")`), `get_per_token_logps` is
`LLM.get_per_token_logps`, and `generate` turns `RolloutConfig` into `SamplingParams` and the outputs into
`RolloutOutput` as Tunix's vanilla engine lays them out (left-padded prompt tokens, completions up to their first
EOS, text, logprobs).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.utils.extras import require

require("tunix", "JaxpagedRollout")
from tunix.generate import mappings as tunix_mappings  # noqa: E402
from tunix.generate import tokenizer_adapter  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

logger = logging.getLogger("jaxpaged.rl")

BACKEND = "vllm_jax"  # the mapping Tunix keeps for JAX engines with HF module names: the one read here
FAMILIES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def family_of(model: nnx.Module) -> str:
    """The Tunix model family (its package under tunix.models), or a ValueError naming what is supported."""
    match = re.match(r"tunix\.models\.(\w+)\.", type(model).__module__ + ".")
    family = match.group(1) if match else None
    if family not in FAMILIES:
        raise ValueError(f"rollout_actor: a Tunix {type(model).__name__} ({type(model).__module__}) has no jaxpaged port; "
                         f"JaxpagedRollout serves Tunix's {', '.join(FAMILIES)} models")  # fmt: skip
    return family


def hf_config(model: nnx.Module, tokenizer, max_position_embeddings: int) -> dict:
    """The HF config.json (as a dict) of a Tunix model: the same arithmetic in jaxpaged's port (default RoPE, RMSNorm
    as x * w, no embedding scale), and the tokenizer's special ids."""
    family, c = family_of(model), model.config
    params = {name for name, _ in _flat(nnx.state(model, nnx.Param))}
    tied = bool(getattr(c, "weight_tying", getattr(c, "use_tied_embedding", False)))
    config = {
        "architectures": [FAMILIES[family]], "model_type": {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family],
        "vocab_size": int(c.vocab_size), "hidden_size": int(c.embed_dim), "intermediate_size": int(c.hidden_dim),
        "num_hidden_layers": int(c.num_layers), "num_attention_heads": int(c.num_heads),
        "num_key_value_heads": int(c.num_kv_heads), "head_dim": int(c.head_dim), "rope_theta": rope_theta(model),
        "rms_norm_eps": float(c.norm_eps), "tie_word_embeddings": tied, "max_position_embeddings": int(max_position_embeddings),
        "hidden_act": "silu", "bos_token_id": _maybe(tokenizer.bos_id), "eos_token_id": _maybe(tokenizer.eos_id),
        "pad_token_id": _maybe(tokenizer.pad_id),
    }  # fmt: skip
    if family == "llama3":
        config.update(attention_bias=False, mlp_bias=False)
    if family == "qwen3":
        config["attention_bias"] = any(name.endswith("attn.q_bias") for name in params)
    if getattr(c, "num_experts", None):
        raise ValueError("rollout_actor: Tunix's Qwen3 MoE is not served by JaxpagedRollout yet (dense models only)")
    return config


def rope_theta(model: nnx.Module) -> float:
    """The RoPE base the Tunix model computes with: google-tunix 0.1.7's Llama 3 and Qwen3 attention call apply_rope
    without the config's rope_theta, so its default (1e6) is what runs, whatever the config says; the engine must
    compute the same."""
    module = sys.modules[type(model).__module__]
    attention, rope = getattr(module, "Attention", None), getattr(module, "apply_rope", None)
    if attention is not None and rope is not None and "rope_theta" not in inspect.getsource(attention):
        default = inspect.signature(rope).parameters.get("rope_theta")
        if default is not None and default.default is not inspect.Parameter.empty:
            if float(default.default) != float(model.config.rope_theta):
                logger.info("%s computes RoPE with base %g (apply_rope's default), not its config's %g: so does the engine",
                            type(model).__name__, default.default, model.config.rope_theta)  # fmt: skip
            return float(default.default)
    return float(model.config.rope_theta)


def _maybe(getter) -> int | None:
    try:
        value = getter()
    except Exception:  # noqa: BLE001 - a tokenizer without that id
        return None
    return None if value is None or value < 0 else int(value)


def _flat(state) -> list[tuple[str, jax.Array]]:
    from jaxpaged.worker.weight_update import dotted

    return [(dotted(kp), x) for kp, x in jax.tree_util.tree_flatten_with_path(state)[0]]


def port_path(name: str) -> str:
    """An HF-style module name as Tunix's mappings give it (tpu-inference's or HF's) -> the port's parameter path."""
    name = name.removeprefix("model.")
    special = {"embed.embedding": "embed_tokens.embedding", "embed_tokens.weight": "embed_tokens.embedding",
               "lm_head": "lm_head.kernel", "lm_head.weight": "lm_head.kernel"}  # fmt: skip
    if name in special:
        return special[name]
    module, _, leaf = name.rpartition(".")
    if leaf == "weight":
        leaf = "scale" if module.rsplit(".", 1)[-1].endswith("norm") else "kernel"
    return f"{module}.{leaf}"


class TunixMapping:
    """Tunix's parameter names -> the engine's, with a function per tensor: Tunix's transpose and hook, then the port's
    shape. The functions are made once per name, so an update's program is compiled once and reused."""

    def __init__(self, mapping: tunix_mappings.MappingConfig, shapes: dict[str, tuple[int, ...]]):
        self.rules = [(re.compile("^" + re.escape(src).replace(r"\*", r"(\d+)") + "$"), dst)
                      for src, (dst, _) in (mapping.to_hf_mappings or {}).items()]  # fmt: skip
        self.transpose_keys = mapping.to_hf_transpose_keys or {}
        self.hooks = mapping.to_hf_hook_fns or {}
        self.shapes = shapes  # the port's parameter shapes, by path
        self._cache: dict[str, tuple[str, Any] | None] = {}

    def __call__(self, name: str):
        if name not in self._cache:
            self._cache[name] = self._resolve(name)
        return self._cache[name]

    def _resolve(self, name: str):
        for pattern, dst in self.rules:
            m = pattern.match(name)
            if m is None:
                continue
            target = dst
            for group in m.groups():
                target = target.replace("*", group, 1)
            path = port_path(target)
            shape = self.shapes.get(path)
            if shape is None:
                return path, None  # the engine names it unknown, with the rest
            axes = self._transpose(name)
            hook = self.hooks.get(name)

            def fn(x, axes=axes, hook=hook, shape=shape):
                if axes is not None:
                    x = jnp.transpose(x, axes)
                if hook is not None:
                    x = hook(x)
                return x.reshape(shape)

            return path, fn
        return name  # not in Tunix's mapping: the engine names it unknown

    def _transpose(self, name: str):
        """Tunix's rule (generate/utils.py _apply_transpose): the last key, the whole key, or a wildcard pattern."""
        last = name.rsplit(".", 1)[-1]
        for key in (last, name):
            if key in self.transpose_keys and "lora" not in key:
                return self.transpose_keys[key]
        for key, axes in self.transpose_keys.items():
            if "*" in key and re.match("^" + re.escape(key).replace(r"\*", ".*") + "$", name):
                return axes
        return None


def _dtype_name(dtype) -> str:
    return {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16",
            jnp.dtype(jnp.float16): "float16"}.get(jnp.dtype(dtype), "float32")  # fmt: skip


class JaxpagedRollout(base_rollout.BaseRollout):
    """Tunix's rollout interface over a jaxpaged engine made from the trainer's model."""

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: jax.sharding.Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, **engine_kwargs):  # fmt: skip
        """engine_kwargs: EngineConfig fields (max_num_seqs, max_num_batched_tokens, ...) and log_level, as LLM takes
        them; the rest comes from rollout_config (dtype, max_model_len from kv_cache_size or the prompt and completion
        lengths)."""
        from jaxpaged import platforms
        from jaxpaged.config import EngineConfig
        from jaxpaged.engine.data_parallel import make_engine
        from jaxpaged.entrypoints.llm import LLM
        from jaxpaged.models.loader import LoadedModel, _build, _config_json, _port_config
        from jaxpaged.utils.logging_utils import setup_logging
        from jaxpaged.worker.weight_update import LoadedLayout, fill_model

        setup_logging(engine_kwargs.pop("log_level", "INFO"))
        self._actor = rollout_actor
        self._tokenizer = tokenizer if isinstance(tokenizer, tokenizer_adapter.TokenizerAdapter) else \
            tokenizer_adapter.TokenizerAdapter(tokenizer)  # fmt: skip
        self.mesh = mesh
        self.rollout_config = rollout_config or base_rollout.RolloutConfig()
        rc = self.rollout_config
        max_len = max(int(rc.kv_cache_size), int(rc.max_prompt_length) + int(rc.max_tokens_to_generate) + 1)
        params = nnx.state(rollout_actor, nnx.Param)
        dtype = _dtype_name(rc.data_type or jax.tree_util.tree_leaves(params)[0].dtype)
        config_dict = hf_config(rollout_actor, self._tokenizer, max_len)
        self._folder = tempfile.TemporaryDirectory(prefix="jaxpaged-rollout-")
        config_path = Path(self._folder.name) / "config.json"
        config_path.write_text(json.dumps(config_dict))
        kwargs = {"dtype": dtype, "max_model_len": max_len, "enable_prefix_caching": True, **engine_kwargs}
        config = EngineConfig(model=str(config_path), **kwargs)
        platform = platforms.get(config.platform)
        platform.prepare(config)
        hf = _config_json(config_path)
        cls, cfg = _port_config(hf)
        choose = functools.partial(platform.attention_backend, config.attention_backend, batch_invariant=config.batch_invariant)
        model = _build(cls, cfg, dtype, choose)
        layout = LoadedLayout.of_model(model, cfg)
        shapes = {path: tuple(a.shape) for path, a in zip(layout.paths, layout.avals)}
        mapping_config = tunix_mappings.MappingConfig.build(mapping_obj=rc.rollout_mapping_config, model=rollout_actor, backend=BACKEND)
        self._mapping = TunixMapping(mapping_config, shapes)
        device = jax.devices()[0]
        fill_model(model, cfg, self._named(params), what=f"Tunix {type(rollout_actor).__name__}",
                   sharding=lambda path, shape: jax.sharding.SingleDeviceSharding(device))  # fmt: skip
        loaded = LoadedModel(model, cfg, hf, None, str(config_path), dtype)
        self.llm = LLM.from_engine(make_engine(config, loaded))
        self._seed = 0
        logger.info("JaxpagedRollout: %s as jaxpaged's %s (%s, max_model_len %d)", type(rollout_actor).__name__,
                    cfg.architecture, dtype, max_len)  # fmt: skip

    def _named(self, params) -> list[tuple]:
        """Tunix's parameters as update_weights names them: (name, engine name, array, fn)."""
        named = []
        for name, array in _flat(params):
            target = self._mapping(name)
            target, fn = target if isinstance(target, tuple) else (target, None)
            named.append((name, target, array, fn))
        return named

    # -- Tunix's interface ----------------------------------------------------------------------------

    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs) -> base_rollout.RolloutOutput:
        """Completions of every prompt in one continuous batch, laid out as Tunix's vanilla engine lays them out."""
        from jaxpaged import SamplingParams

        rc = rollout_config
        ids = [self._tokenize(p) for p in prompts]
        longest = max(len(x) for x in ids)
        width = rc.max_prompt_length if rc.max_prompt_length and rc.max_prompt_length >= longest else 1 << (longest - 1).bit_length()
        eos = list(rc.eos_tokens) if rc.eos_tokens else [self.eos_id()]
        greedy = rc.top_p is None or not rc.temperature
        seed = self._seed_of(rc.seed)
        pad = self.pad_id()
        # what Tunix's models attend to: every prompt token but the pad id's (a BOS that is the pad id too included)
        text = [[t for t in x if t != pad] or x for x in ids]
        # GRPO repeats each prompt G times in a row: one request with n = G computes the prompt once and forks it
        # (sample j of a group seeded seed + its row, so the tokens are those of one request per row)
        groups: list[list[int]] = []
        for i, x in enumerate(text):
            if groups and text[groups[-1][0]] == x:
                groups[-1].append(i)
            else:
                groups.append([i])
        params = [
            SamplingParams(
                n=len(group), max_tokens=int(rc.max_tokens_to_generate), temperature=0.0 if greedy else float(rc.temperature),
                top_p=1.0 if greedy or rc.top_p is None else float(rc.top_p),
                top_k=0 if greedy or not rc.top_k or rc.top_k < 0 else int(rc.top_k), seed=seed + group[0],
                stop_token_ids=eos, ignore_eos=True, logprobs=0 if rc.return_logprobs else None,
            )
            for group in groups
        ]  # fmt: skip
        grouped = self.llm.generate([{"prompt_token_ids": text[g[0]]} for g in groups], params, use_tqdm=False)
        completions = [c for out in grouped for c in sorted(out.outputs, key=lambda c: c.index)]
        left_padded = np.full((len(ids), width), pad, np.int32)
        for row, x in zip(left_padded, ids):
            row[width - len(x):] = x
        tokens, logprobs = [], []
        for completion in completions:
            toks = list(completion.token_ids)
            cut = next((i for i, t in enumerate(toks) if t in eos), len(toks))  # up to the first EOS, as Tunix's
            tokens.append(np.asarray(toks[:cut], np.int32))
            if rc.return_logprobs:
                logprobs.append([d[t].logprob for d, t in zip(completion.logprobs[:cut], toks[:cut])])
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=[], tokens=tokens,
            left_padded_prompt_tokens=left_padded, logprobs=logprobs if rc.return_logprobs else None,
        )  # fmt: skip

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        """Tunix's padded [B, P] prompts and [B, C] completions, scored by the engine's steps: [B, C] float32."""
        scores = self.llm.get_per_token_logps(np.asarray(prompt_tokens), np.asarray(completion_tokens), pad_id=self.pad_id())
        return jnp.asarray(scores)

    def update_params(self, params, filter_types=None) -> None:
        """The trainer's new parameters into the engine, in place (no host transfer, no recompile): Tunix's names
        through its mapping, the arrays copied (the trainer may donate its own to its next step)."""
        if filter_types is not None and any(getattr(t, "__name__", "") == "LoRAParam" for t in filter_types):
            raise NotImplementedError("update_params: LoRA-trained Tunix models are not served by JaxpagedRollout yet; "
                                      "train the full model or merge the adapters first")  # fmt: skip
        named = self._named(params)
        self.llm.update_weights({name: array for name, _, array, _ in named}, mapping=self._mapping, copy=True,
                                in_flight="abort")  # fmt: skip

    def pad_id(self) -> int:
        return int(self._tokenizer.pad_id())

    def eos_id(self) -> int:
        return int(self._tokenizer.eos_id())

    def model(self) -> nnx.Module:
        """The engine's model (the port over its own weights, which share no array with the trainer's: Tunix then
        syncs weights after every step)."""
        runner = self.llm.engine.runner
        return nnx.merge(runner.graphdef, runner.state)

    # -- helpers ----------------------------------------------------------------------------------------

    def _tokenize(self, text: str) -> list[int]:
        """As Tunix's sampler tokenizes: BOS (where the tokenizer has one) before the text, never twice."""
        text = text.decode() if isinstance(text, bytes) else str(text)  # numpy's strings, as Tunix's batches hold them
        ids = list(self._tokenizer.encode(text))
        bos = _maybe(self._tokenizer.bos_id)
        return [int(t) for t in self._tokenizer.dedup_bos_ids(([bos] if bos else []) + ids)]

    def _seed_of(self, seed) -> int:
        """RolloutConfig.seed (None, an int, or a JAX key) as the engine's seed; None draws a new one each call."""
        if seed is None:
            self._seed += 1 << 20
            return self._seed
        if isinstance(seed, int):
            return seed
        data = np.asarray(jax.random.key_data(seed) if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) else seed)
        return int(np.uint32(data.ravel()[-1]))

    def close(self) -> None:
        self._folder.cleanup()

