"""Tiny checkpoints with an MTP layer as each family saves it, and what the `mtp` tests share.

`nextn_checkpoint`: DeepSeek-V3 / GLM-4.5, the layer as `model.layers.{N}.*` (a random model of N + 1 layers saved
as N layers plus the MTP layer's own tensors). `qwen_mtp_checkpoint`: Qwen3-Next / Qwen3.5, the layer as `mtp.*`
(a transformers decoder layer of the target's kind under `mtp.layers.0.`).

construct "tokens": a target that walks a random cycle of the vocabulary (every attention and MLP output zero,
lm_head(norm(embed(x))) = succ(x)) and an MTP layer reading only the token through a zero block, so it proposes
succ(next token) = the token after next; "hidden" (nextn only): it reads only the hidden state, its own head two
steps along the cycle.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.hf_reference import random_hf_model
from tests.models.test_hybrid_models import hybrid_hf_model

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

VOCAB, D = 256, 64
CYCLE = np.random.default_rng(9).permutation(VOCAB)  # succ(CYCLE[i]) = CYCLE[i + 1]
SUCC = np.empty(VOCAB, np.int64)
SUCC[CYCLE] = np.roll(CYCLE, -1)
ZEROED = ("o_proj.weight", "o_proj.bias", "out_proj.weight", "down_proj.weight", "experts.down_proj")


def _rand(g):
    return lambda *shape: 0.1 * torch.randn(*shape, generator=g)


def walk_cycle(named_params, one: float, residual: float = 0.0) -> None:
    """Every attention, linear-attention and MLP output zero (or times `residual`) and every norm `one` (1, or 0 for
    (1 + w) norms) but Gated DeltaNet's gated norm (1-centred, inside the layer)."""
    with torch.no_grad():
        for name, p in named_params:
            if "norm" in name and "linear_attn.norm" not in name:
                p.fill_(one)
            elif name.endswith(ZEROED):
                p.mul_(residual)


def _cycle_embeddings(hf, g):
    """Random embeddings and lm_head rows e[pred(y)]: logits[y] = <e_pred(y), rms(e_x)>, top at succ(x)."""
    e = torch.randn(VOCAB, D, generator=g)
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(e)
        if hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
            hf.lm_head.weight.copy_(e[torch.from_numpy(np.argsort(SUCC))])
    return e


def _save(hf, folder, mtp: dict, **config) -> None:
    hf.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(folder / "mtp.safetensors"))
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, **config}))


def nextn_checkpoint(folder, config_cls, config: dict, n: int, *, construct: str | None = None, own_head: bool = False,
                     residual: float = 0.0):  # fmt: skip
    """A random model of n + 1 layers saved as n layers plus the MTP layer model.layers.{n}.* (num_nextn_predict_layers
    1) and its own tensors in mtp.safetensors; `residual` as qwen_mtp_checkpoint's (the MTP block's outputs stay zero).
    -> (the HF model of n + 1 layers, the MTP tensors)."""
    hf = random_hf_model(config_cls(**config, num_hidden_layers=n + 1, num_nextn_predict_layers=0), std=0.1)
    g = torch.Generator().manual_seed(4)
    rand = _rand(g)
    pre = f"model.layers.{n}."
    mtp = {pre + "enorm.weight": 1 + rand(D), pre + "hnorm.weight": 1 + rand(D), pre + "eh_proj.weight": rand(D, 2 * D),
           pre + "shared_head.norm.weight": 1 + rand(D)}  # fmt: skip
    if construct is not None:
        e = _cycle_embeddings(hf, g)
        walk_cycle(hf.named_parameters(), 1.0, residual)
        walk_cycle(hf.model.layers[n].named_parameters(), 1.0)
        for name in ("enorm", "hnorm", "shared_head.norm"):
            mtp[pre + name + ".weight"] = torch.ones(D)
        eye, zero = torch.eye(D), torch.zeros(D, D)
        mtp[pre + "eh_proj.weight"] = torch.cat([eye, zero] if construct == "tokens" else [zero, eye], dim=1)
        if construct == "hidden":  # h_t = rms(e_{x_t}): the head maps it two steps on
            mtp[pre + "shared_head.head.weight"] = e[torch.from_numpy(np.argsort(SUCC[SUCC]))].clone()
    elif own_head:
        mtp[pre + "shared_head.head.weight"] = rand(VOCAB, D)
    mtp[pre + "embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    _save(hf, folder, mtp, num_hidden_layers=n, num_nextn_predict_layers=1)
    return hf, mtp


def qwen_mtp_checkpoint(folder, config, block_index: int, *, construct: str | None = None, residual: float = 0.0):
    """A random Qwen3-Next/Qwen3.5 text model with mtp.* beside it: the block is transformers' decoder layer
    `block_index` of the same config (a full-attention layer of the kind the MTP layer is), random, its norms
    zero-centred as the model's. construct "tokens" with `residual`: the target's layers' outputs are kept, scaled
    by it, so its greedy path leaves the cycle where they outweigh it (5: 10 of 48 tokens) and guesses fail there.
    -> (the HF model, the HF block, the MTP tensors)."""
    hf = hybrid_hf_model(config)
    g = torch.Generator().manual_seed(5)
    rand = _rand(g)
    block = type(hf.model.layers[block_index])(config, block_index).float().eval()
    with torch.no_grad():
        for p in block.parameters():  # (its norms zero-centred too)
            p.copy_(rand(*p.shape))
    mtp = {"mtp.pre_fc_norm_embedding.weight": rand(D), "mtp.pre_fc_norm_hidden.weight": rand(D),
           "mtp.fc.weight": rand(D, 2 * D), "mtp.norm.weight": rand(D)}  # fmt: skip
    if construct is not None:
        _cycle_embeddings(hf, g)
        walk_cycle(hf.named_parameters(), 0.0, residual)
        walk_cycle(block.named_parameters(), 0.0)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            mtp[f"mtp.{name}.weight"] = torch.zeros(D)
        mtp["mtp.fc.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1)
    mtp |= {f"mtp.layers.0.{k}": v.detach().clone() for k, v in block.state_dict().items()}
    _save(hf, folder, mtp)
    return hf, block, mtp


def mtp_spec(k: int, disable_by_batch_size: int = 64) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": disable_by_batch_size}


def generate_tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_clean(llm) -> None:
    """Every block back, nothing running or held by the proposer, nothing compiled after warm-up."""
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0 and not llm.engine.spec.proposer.records
    assert stats["num_compiles_after_warmup"] == 0


def cycle_prompts() -> list[list[int]]:
    return [[int(x) for x in CYCLE[s : s + n]] for s, n in ((0, 5), (40, 12), (90, 3))]


def assert_walks_the_cycle_and_accepts_all(llm, max_tokens=(16, 16, 16)) -> None:
    """The constructed target walks the cycle; an MTP layer that knows the token after next has every guess of these
    requests accepted (a misaligned token, row, position or chained input would propose something else)."""
    from jaxpaged import SamplingParams

    before = llm.get_stats()
    prompts = cycle_prompts()
    outs = generate_tokens(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    for prompt, [out] in zip(prompts, outs):
        assert out == [int(SUCC[x]) for x in [prompt[-1], *out[:-1]]]
    stats = llm.get_stats()
    drafts, accepted = (stats[k] - before[k] for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    assert drafts > 0 and accepted == drafts, stats
    assert_clean(llm)


def walk_the_cycle_exactly(llm, hf) -> None:
    """A target built with `residual` made to walk the cycle exactly: its embedding 100 times larger (update_weights;
    every layer reads it through a norm, so their outputs are 100 times smaller beside it)."""
    llm.update_weights({"model.embed_tokens.weight": 100 * hf.model.embed_tokens.weight.detach().numpy()})


def hf_norm(norm_cls, weight, eps: float):
    """A transformers RMSNorm module holding `weight`."""
    module = norm_cls(D, eps)
    module.weight.data.copy_(weight)
    return module


def hf_mtp_reference(hf, block, enorm, hnorm, proj, final_norm, head, ids, hidden, *, mask_first: bool):
    """What vLLM's MTP layer computes, in torch with transformers' modules: norms, concat, projection, the block at
    positions 0..T-1 (causal), the final norm and the head -> (the output after the final norm, logits)."""
    t = len(ids)
    with torch.no_grad():
        e = hf.model.embed_tokens(torch.from_numpy(np.asarray(ids)))
        if mask_first:
            e[0] = 0  # vLLM: the embedding at position 0 is masked
        x = torch.cat([enorm(e), hnorm(torch.from_numpy(hidden))], -1) @ proj.T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x[None], pos))
        normed = final_norm((out[0] if isinstance(out, tuple) else out)[0])
        return normed.numpy(), head(normed).numpy()


def our_mtp(loaded, layer, ids, hidden):
    """The loaded MtpLayer over the same positions 0..T-1 from an empty cache -> (its chained output, logits)."""
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape

    t, cfg = len(ids), loaded.config
    cache = jnp.zeros(kv_cache_shape(1, cfg.num_kv_heads, 4, 8, cfg.head_dim), jnp.float32)
    attn = AttentionMetadata(*map(jnp.asarray, (np.arange(t, dtype=np.int32), np.arange(4, dtype=np.int32)[None],
                                                np.array([t], np.int32), np.array([0, t], np.int32))))  # fmt: skip
    embeds = loaded.model.embed_tokens(jnp.asarray(ids, jnp.int32))
    out, _ = layer(embeds, jnp.asarray(hidden), jnp.arange(t, dtype=jnp.int32), cache, attn)
    return np.asarray(out), np.asarray(layer.logits(out, loaded.model))


def assert_matches_transformers_path(hf, prompts, outs) -> None:
    """Each greedy output is transformers' argmax at every position and its logprobs transformers' (1e-4), in one
    forward over prompt + output: a state or cache entry left from a rejected guess would move them."""
    for prompt, out in zip(prompts, outs):
        ids = [int(t) for t in out.token_ids]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
        assert lp.argmax(-1).tolist() == ids
        got = [step[t].logprob for step, t in zip(out.logprobs, ids)]
        np.testing.assert_allclose(got, lp[range(len(ids)), ids].numpy(), atol=1e-4, rtol=1e-4)


def random_pairs(t: int = 21):
    """(hidden states [t, D] float32, token ids [t]) for the layer's positions 0..t-1."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((t, D)).astype(np.float32), rng.integers(0, VOCAB, t)
