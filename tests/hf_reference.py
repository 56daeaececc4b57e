"""Tiny random-weight transformers models and their outputs: the reference the ports must match."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

torch = __import__("pytest").importorskip("torch", reason="torch (the dev extra) is the reference model")
import transformers  # noqa: E402


def tiny_llama_config(**overrides) -> transformers.LlamaConfig:
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def random_hf_model(config, seed: int = 0, std: float = 0.15, model_cls=None):
    """Every parameter random (biases and norms too), so no mapping mistake can hide behind a zero or a one;
    `model_cls` for a class AutoModelForCausalLM does not make from the config (an image-text model)."""
    torch.manual_seed(seed)
    if model_cls is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = model_cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_hf_model(model, folder: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().numpy()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt):].tolist()


def random_prompts(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=n).tolist() for n in lengths]


def engine_matches_transformers(hf, folder, vocab: int, **llm_kwargs):
    """Through jaxpaged.LLM: 16-token chunks, a pool small enough to preempt, prompts sharing prefixes: greedy tokens
    equal transformers', with preemptions and prefix-cache hits, nothing compiled after warm-up, every KV block back.
    -> the LLM, for a family's own checks."""
    from jaxpaged import LLM, SamplingParams

    prompts = random_prompts(vocab, [45, 5, 30, 23, 38, 12], seed=4)
    prompts += [prompts[0][:33] + [7, 8], prompts[2]]  # shared prefixes
    max_tokens = [12, 20, 15, 9, 18, 11, 10, 6]
    llm = LLM(str(folder), **{"dtype": "float32", "max_num_seqs": 6, "max_num_batched_tokens": 16, "block_size": 4,
                              "num_kv_blocks": 40, "log_level": "WARNING", **llm_kwargs})  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    return llm


def with_quantized_inputs(model, kind: str):
    """A copy of an HF model whose every Linear but the head quantizes its input per token first (int8: rounded to
    max|x| / 127 steps; fp8: e4m3 at max|x| / 448), in float32: what quantize_activations computes."""
    model = copy.deepcopy(model)

    def quantize(_, args):
        x = args[0]
        amax = x.abs().amax(dim=-1, keepdim=True)
        if kind == "int8":
            scale = (amax / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
            return (torch.round(x / scale).clamp(-127, 127) * scale,)
        scale = (amax / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
        return ((x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale,)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(quantize)
    return model


# -- HF computing with the weights a loaded jaxpaged model holds -----------------------------------


def port_module(model, hf_name: str):
    """The jaxpaged module at an HF module path ("model.layers.0.mlp.down_proj")."""
    obj = model
    for part in hf_name.removeprefix("model.").split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def device_weight(layer) -> np.ndarray:
    """The [out, in] float32 weight a loaded Linear computes with, from what the device holds (read before an
    engine repacks it for the CPU's native matmul)."""
    import jax.numpy as jnp

    from jaxpaged.models.quantization import ChannelLinear, GroupLinear

    if isinstance(layer.method, ChannelLinear):
        w = np.asarray(layer.kernel[...]).astype(np.float32) * np.asarray(layer.scale[...]).astype(np.float32)
    elif isinstance(layer.method, GroupLinear):
        w = np.asarray(layer.method.weight(layer, jnp.float32))
    else:
        w = np.asarray(layer.kernel[...]).astype(np.float32)
    return w.T


def dequantized_hf(hf, deq: dict):
    """A copy of an HF model whose named Linears take the [out, in] weights in `deq`."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, w in deq.items():
            ref.get_submodule(name).weight.copy_(torch.from_numpy(np.array(w)))
    return ref
