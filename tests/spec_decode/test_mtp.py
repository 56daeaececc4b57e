"""Speculative method "mtp" on a tiny DeepSeek-V3 with one MTP layer saved as DeepSeek names it: the layer's logits
against transformers' DeepseekV3DecoderLayer/RMSNorm and torch ops; greedy output unchanged (batches, n = 2, chunked
prefill, preemption); layers built to predict the token after next accept every guess (the token path: k = 3; the
hidden-state path with the layer's own head: k = 1); blocks all back, nothing compiled after warm-up; bad configs."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model
from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape
from jaxpaged.spec_decode.mtp import load_mtp_layer

from tests.hf_reference import random_hf_model, random_prompts

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

VOCAB, D, N = 256, 64, 2  # N target layers; the MTP layer is model.layers.2
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=D, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
    kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32, num_experts_per_tok=2, n_routed_experts=8,
    first_k_dense_replace=1, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
)  # fmt: skip
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, block_size=8, log_level="WARNING")
CYCLE = np.random.default_rng(9).permutation(VOCAB)  # succ(CYCLE[i]) = CYCLE[i + 1]
SUCC = np.empty(VOCAB, np.int64)
SUCC[CYCLE] = np.roll(CYCLE, -1)


def _mtp_model(folder, *, construct: str | None = None, own_head: bool = False):
    """A random V3 of N + 1 layers saved as N layers plus the MTP layer (config: num_hidden_layers N,
    num_nextn_predict_layers 1) and its own tensors in mtp.safetensors. construct "tokens": attention and MLP outputs
    zero everywhere and lm_head(norm(embed(x))) = succ(x), eh_proj reading the token only, so the layer proposes
    succ(next token) = the token after next; "hidden": eh_proj reading the hidden state only and its own head two
    steps along the cycle. -> (the HF model of N + 1 layers, the MTP tensors)."""
    cfg = transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=N + 1, num_nextn_predict_layers=0)
    hf = random_hf_model(cfg, std=0.1)
    g = torch.Generator().manual_seed(4)
    rand = lambda *shape: 0.1 * torch.randn(*shape, generator=g)  # noqa: E731
    pre = f"model.layers.{N}."
    mtp = {pre + "enorm.weight": 1 + rand(D), pre + "hnorm.weight": 1 + rand(D), pre + "eh_proj.weight": rand(D, 2 * D),
           pre + "shared_head.norm.weight": 1 + rand(D)}  # fmt: skip
    if construct is not None:
        with torch.no_grad():
            e = torch.randn(VOCAB, D, generator=g)
            hf.model.embed_tokens.weight.copy_(e)
            pred = np.argsort(SUCC)  # pred[succ(x)] = x
            hf.lm_head.weight.copy_(e[torch.from_numpy(pred)])  # logits[y] = <e_pred(y), rms(e_x)>: top at succ(x)
            for name, p in hf.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) or "norm" in name:
                    p.copy_(torch.zeros_like(p) if "norm" not in name else torch.ones_like(p))
        for name in ("enorm", "hnorm", "shared_head.norm"):
            mtp[pre + name + ".weight"] = torch.ones(D)
        eye, zero = torch.eye(D), torch.zeros(D, D)
        mtp[pre + "eh_proj.weight"] = torch.cat([eye, zero] if construct == "tokens" else [zero, eye], dim=1)
        if construct == "hidden":  # h_t = rms(e_{x_t}): the head maps it two steps on
            mtp[pre + "shared_head.head.weight"] = e[torch.from_numpy(np.argsort(SUCC[SUCC]))].clone()
    elif own_head:
        mtp[pre + "shared_head.head.weight"] = rand(VOCAB, D)
    mtp[pre + "embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    hf.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(folder / "mtp.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": N, "num_nextn_predict_layers": 1}))
    return hf, mtp


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    return folder, *_mtp_model(folder)


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 64}


def test_the_layer_matches_transformers_modules(tmp_path):
    """Logits of the layer for (hidden state, next token) pairs at positions 0..T-1 against DeepseekV3DecoderLayer
    and DeepseekV3RMSNorm loaded with its weights, enorm/hnorm/eh_proj/concat in torch, float32 (own head too)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    hf, mtp = _mtp_model(tmp_path, own_head=True)
    loaded = load_model(str(tmp_path), dtype="float32")
    layer = load_mtp_layer(loaded, loaded.model.layers[0].self_attn.backend)
    assert layer.head is not None
    t, pre, eps = 21, f"model.layers.{N}.", hf.config.rms_norm_eps
    rng = np.random.default_rng(0)
    hidden, ids = rng.standard_normal((t, D)).astype(np.float32), rng.integers(0, VOCAB, t)

    def norm(name):
        module = DeepseekV3RMSNorm(D, eps)
        module.weight.data.copy_(mtp[pre + name + ".weight"])
        return module

    with torch.no_grad():
        block = hf.model.layers[N]  # transformers' DeepseekV3DecoderLayer(config, layer_idx=2): the MTP block
        e = hf.model.embed_tokens(torch.from_numpy(ids))
        e[0] = 0  # vLLM: the embedding at position 0 is masked
        x = torch.cat([norm("enorm")(e), norm("hnorm")(torch.from_numpy(hidden))], -1) @ mtp[pre + "eh_proj.weight"].T
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x[None], pos))
        out = out[0] if isinstance(out, tuple) else out
        want = (norm("shared_head.norm")(out[0]) @ mtp[pre + "shared_head.head.weight"].T).numpy()
    cfg = loaded.config
    cache = jnp.zeros(kv_cache_shape(1, cfg.num_kv_heads, 4, 8, cfg.head_dim), jnp.float32)
    attn = AttentionMetadata(*map(jnp.asarray, (np.arange(t, dtype=np.int32), np.arange(4, dtype=np.int32)[None],
                                                np.array([t], np.int32), np.array([0, t], np.int32))))  # fmt: skip
    embeds = loaded.model.embed_tokens(jnp.asarray(ids, jnp.int32))
    got, _ = layer(embeds, jnp.asarray(hidden), jnp.arange(t, dtype=jnp.int32), cache, attn)
    np.testing.assert_allclose(np.asarray(layer.logits(got, loaded.model)), want, atol=1e-4, rtol=1e-4)


def _workload(count: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = random_prompts(VOCAB, rng.integers(3, 40, size=count).tolist(), seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, n=2 if i % 4 == 3 else 1)
              for i, m in enumerate(rng.integers(5, 25, size=count).tolist())]  # fmt: skip
    return prompts, params


def _tokens(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_clean(llm) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0 and not llm.engine.spec.proposer.records
    assert stats["num_compiles_after_warmup"] == 0


def test_greedy_unchanged_through_batches_chunks_and_preemption(random_mtp):
    folder = str(random_mtp[0])
    prompts, params = _workload(6, seed=2)
    expected = _tokens(LLM(folder, **ENGINE), prompts, params)
    llm = LLM(folder, speculative_config=_mtp(2), **{**ENGINE, "num_kv_blocks": 11, "max_num_batched_tokens": 16})
    assert _tokens(llm, prompts, params) == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    _assert_clean(llm)


@pytest.mark.parametrize("construct, k", [("tokens", 3), ("hidden", 1)])
def test_a_layer_that_knows_the_token_after_next_is_always_accepted(construct, k, tmp_path):
    """Any misalignment (the token t instead of t + 1, the wrong row's hidden state or position, a chain step fed the
    wrong guess) proposes something else, and these tokens are then rejected."""
    _mtp_model(tmp_path, construct=construct)
    llm = LLM(str(tmp_path), speculative_config=_mtp(k), **ENGINE)
    prompts = [[int(x) for x in CYCLE[s : s + n]] for s, n in ((0, 5), (40, 12), (90, 3))]
    outs = _tokens(llm, prompts, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 3)
    for prompt, [out] in zip(prompts, outs):  # the target itself walks the cycle
        assert out == [int(SUCC[x]) for x in [prompt[-1], *out[:-1]]]
    stats = llm.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0, stats
    _assert_clean(llm)


@pytest.mark.parametrize("change, words", [
    ({"num_speculative_tokens": 8}, "below max_num_seqs"),
    ({"model": "x"}, "needs no model"),
])  # fmt: skip
def test_bad_mtp_configs_are_refused(random_mtp, change, words):
    with pytest.raises(ValueError, match=f"speculative_config.*{words}"):
        LLM(str(random_mtp[0]), speculative_config={**_mtp(2), **change}, **ENGINE)


def test_a_model_without_mtp_layers_is_refused(tmp_path):
    cfg = transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=N, num_nextn_predict_layers=0)
    random_hf_model(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="speculative_config.method 'mtp'.*no multi-token-prediction"):
        LLM(str(tmp_path), speculative_config=_mtp(2), **ENGINE)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(tmp_path), speculative_config=_mtp(2), pipeline_parallel_size=2, **ENGINE)
