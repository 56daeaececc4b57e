"""Speculative method "eagle3": an EAGLE-3 head (spec_decode/eagle3.py) beside a tiny Llama target. The streams the
target hands the head equal transformers' hidden_states at the head's layer ids; the head's outputs and guesses for
positions 0..T-1, from those streams (fc) and from its own chained outputs, equal a torch reference written from vLLM's
Eagle3LlamaForCausalLM (both checkpoint layouts, its own embedding or the target's, d2t, norm_before_residual);
greedy output unchanged through batches, n = 2, chunked prefill and preemption; a head built to know the token after
next has every guess accepted; blocks all back, nothing compiled after warm-up; bad heads refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model
from jaxpaged.spec_decode.eagle3 import load_eagle3_head
from jaxpaged.spec_decode.mtp import attention_backend

from tests.hf_reference import hf_greedy, random_hf_model, random_prompts
from tests.spec_decode.mtp_checkpoints import (
    SUCC, VOCAB, _cycle_embeddings, assert_clean, assert_walks_the_cycle_and_accepts_all, generate_tokens, walk_cycle,
)  # fmt: skip

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

D, LAYERS, HEADS, KV, HD, FF, DRAFT_VOCAB = 64, 8, 4, 2, 16, 96, 160
TARGET = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
              num_key_value_heads=KV, head_dim=HD, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
              bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)  # fmt: skip
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, block_size=4, num_kv_blocks=64, dtype="float32", log_level="WARNING")
EPS = 1e-5


def eagle3_spec(folder, k: int, disable_by_batch_size: int = 64) -> dict:
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": k, "disable_by_batch_size": disable_by_batch_size}


def head_tensors(seed: int = 3, own_embedding: bool = False) -> dict:
    """A random head in EAGLE-3's own names (midlayer.*), with d2t mapping its DRAFT_VOCAB tokens into the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: 0.1 * torch.randn(*shape, generator=g)  # noqa: E731
    w = {"fc.weight": r(D, 3 * D), "norm.weight": 1 + r(D), "lm_head.weight": r(DRAFT_VOCAB, D),
         "midlayer.input_layernorm.weight": 1 + r(D), "midlayer.hidden_norm.weight": 1 + r(D),
         "midlayer.post_attention_layernorm.weight": 1 + r(D), "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * D),
         "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * D), "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * D),
         "midlayer.self_attn.o_proj.weight": r(D, HEADS * HD), "midlayer.mlp.gate_proj.weight": r(FF, D),
         "midlayer.mlp.up_proj.weight": r(FF, D), "midlayer.mlp.down_proj.weight": r(D, FF)}  # fmt: skip
    chosen = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # the draft vocabulary, in target ids
    w["d2t"] = chosen - torch.arange(DRAFT_VOCAB)
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, chosen, True)
    if own_embedding:
        w["embed_tokens.weight"] = r(VOCAB, D)
    return w


def write_head(folder, w: dict, *, speculators: bool = False, **config) -> None:
    """EAGLE-3's layout (config LlamaForCausalLMEagle3, midlayer.*) or the speculators one (Eagle3Speculator,
    transformer_layer_config, layers.0.*)."""
    folder.mkdir(parents=True, exist_ok=True)
    layer = dict(hidden_size=D, intermediate_size=FF, num_hidden_layers=1, num_attention_heads=HEADS,
                 num_key_value_heads=KV, head_dim=HD, rms_norm_eps=EPS, rope_theta=10000.0, max_position_embeddings=512,
                 vocab_size=VOCAB)  # fmt: skip
    if speculators:
        w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
        meta = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
                "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": False, **config}  # fmt: skip
    else:
        meta = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": DRAFT_VOCAB, **config}
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3-target")
    hf = random_hf_model(transformers.LlamaConfig(**TARGET), std=0.1)
    hf.save_pretrained(folder)
    return folder, hf


def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def torch_eagle3(w: dict, target_hf, ids, hidden, *, norm_before_residual: bool = False):
    """vLLM's Eagle3LlamaForCausalLM over positions 0..T-1 (causal), in torch: -> (output before norm, guesses)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

    m = lambda name: w["midlayer." + name]  # noqa: E731
    with torch.no_grad():
        ids, h = torch.as_tensor(ids), torch.as_tensor(hidden)
        e = (w["embed_tokens.weight"] if "embed_tokens.weight" in w else target_hf.model.embed_tokens.weight)[ids]
        h = h @ w["fc.weight"].T if h.shape[-1] == 3 * D else h
        hn = _rms(h, m("hidden_norm.weight"))
        residual = hn if norm_before_residual else h
        x = torch.cat([_rms(e, m("input_layernorm.weight")), hn], -1)
        t = len(ids)
        q = (x @ m("self_attn.q_proj.weight").T).view(1, t, HEADS, HD).transpose(1, 2)
        k = (x @ m("self_attn.k_proj.weight").T).view(1, t, KV, HD).transpose(1, 2)
        v = (x @ m("self_attn.v_proj.weight").T).view(1, t, KV, HD).transpose(1, 2)
        cos, sin = LlamaRotaryEmbedding(transformers.LlamaConfig(**TARGET))(x[None], torch.arange(t)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = repeat_kv(k, HEADS // KV), repeat_kv(v, HEADS // KV)
        s = (q @ k.transpose(-1, -2)) * HD**-0.5 + torch.full((t, t), float("-inf")).triu(1)
        a = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(t, HEADS * HD) @ m("self_attn.o_proj.weight").T
        residual = residual + a
        y = _rms(residual, m("post_attention_layernorm.weight"))
        pre = residual + (torch.nn.functional.silu(y @ m("mlp.gate_proj.weight").T) * (y @ m("mlp.up_proj.weight").T)) @ m("mlp.down_proj.weight").T
        draft = (_rms(pre, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
        return pre.numpy(), (draft + w["d2t"][draft]).numpy()


def ours(loaded, layer, ids, hidden):
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape

    t = len(ids)
    cache = jnp.zeros(kv_cache_shape(1, KV, 8, 8, HD), jnp.float32)
    attn = AttentionMetadata(*map(jnp.asarray, (np.arange(t, dtype=np.int32), np.arange(8, dtype=np.int32)[None],
                                                np.array([t], np.int32), np.array([0, t], np.int32))))  # fmt: skip
    out, _ = layer(layer.embed(jnp.asarray(ids, jnp.int32), loaded.model), jnp.asarray(hidden), jnp.arange(t, dtype=jnp.int32), cache, attn)
    return np.asarray(out), np.asarray(layer.greedy(out, loaded.model))


def test_the_targets_streams_are_transformers_hidden_states(target):
    """forward_with_aux: the stream entering layers 2, 4 and 5 (vLLM's default for 8 layers) is transformers'
    hidden_states[2], [4] and [5]; the final hidden states and the K/V are forward's."""
    import jax.numpy as jnp

    from jaxpaged.pallas_kernels import AttentionMetadata, kv_cache_shape

    folder, hf = target
    loaded = load_model(str(folder), dtype="float32")
    (ids,) = random_prompts(VOCAB, [19], seed=4)
    t, cfg = len(ids), loaded.config
    cache = jnp.zeros(kv_cache_shape(cfg.num_kv_layers, KV, 8, 8, HD), jnp.float32)
    attn = AttentionMetadata(*map(jnp.asarray, (np.arange(t, dtype=np.int32), np.arange(8, dtype=np.int32)[None],
                                                np.array([t], np.int32), np.array([0, t], np.int32))))  # fmt: skip
    args = (jnp.asarray(ids, jnp.int32), jnp.arange(t, dtype=jnp.int32), cache, attn)
    final, kv, aux = loaded.model.forward_with_aux(*args, (2, 4, 5))
    want_final, want_kv = loaded.model.forward(*args)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(want_final))
    np.testing.assert_array_equal(np.asarray(kv), np.asarray(want_kv))
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (2, 4, 5)], -1).numpy()
    np.testing.assert_allclose(np.asarray(aux), want, atol=1e-5)


@pytest.mark.parametrize("layout, own_embedding, norm_before_residual", [
    ("eagle3", False, False), ("speculators", True, True),
])  # fmt: skip
def test_the_head_matches_the_torch_reference(target, tmp_path, layout, own_embedding, norm_before_residual):
    """From the target's streams (through fc) and from the head's own outputs (a chain: no fc), at positions 0..20:
    the output before norm within 1e-4, the guesses (draft ids mapped by d2t) equal."""
    folder, hf = target
    w = head_tensors(own_embedding=own_embedding)
    write_head(tmp_path / "head", w, speculators=layout == "speculators", norm_before_residual=norm_before_residual)
    loaded = load_model(str(folder), dtype="float32")
    head = load_eagle3_head(str(tmp_path / "head"), loaded, attention_backend(loaded.model))
    assert head.aux_layers == (2, 4, 5) and (head.layer.embed_tokens is not None) == own_embedding
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, 21)
    for width in (3 * D, D):
        hidden = rng.standard_normal((21, width)).astype(np.float32)
        want_out, want_ids = torch_eagle3(w, hf, ids, hidden, norm_before_residual=norm_before_residual)
        got_out, got_ids = ours(loaded, head.layer, ids, hidden)
        np.testing.assert_allclose(got_out, want_out, atol=1e-4, rtol=1e-4)
        assert got_ids.tolist() == want_ids.tolist()
        assert set(got_ids.tolist()) <= set((torch.arange(DRAFT_VOCAB) + w["d2t"]).tolist())


def test_greedy_unchanged_through_batches_chunks_and_preemption(target, tmp_path):
    folder, hf = target
    write_head(tmp_path / "head", head_tensors(), eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    rng = np.random.default_rng(2)
    prompts = random_prompts(VOCAB, rng.integers(3, 40, size=6).tolist(), seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True, n=2 if i % 4 == 3 else 1)
              for i, m in enumerate(rng.integers(5, 25, size=6).tolist())]  # fmt: skip
    hf.generation_config.eos_token_id = None
    expected = [[hf_greedy(hf, p, s.max_tokens)] * s.n for p, s in zip(prompts, params)]
    llm = LLM(str(folder), speculative_config=eagle3_spec(tmp_path / "head", 2), **{**ENGINE, "num_kv_blocks": 20})
    assert llm.engine.runner.aux_layers == (1, 3, 6)
    assert generate_tokens(llm, prompts, params) == expected
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    assert_clean(llm)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3"])
def test_greedy_unchanged_beside_other_targets(family, tmp_path):
    """GPT-OSS (sliding and full layers in KV cache groups of their own, the head's cache on the global group's
    tables; sinks, MoE; 4 layers: default ids (2, 2, 1), one stream twice) and Qwen3 (q/k norms): the streams come
    through their own layers' segments."""
    if family == "gpt_oss":
        from tests.models.test_gpt_oss import CONFIG

        config = transformers.GptOssConfig(**{**CONFIG, "num_hidden_layers": 4})
    else:
        config = transformers.Qwen3Config(**{**TARGET, "num_hidden_layers": 4})
    hf = random_hf_model(config, std=0.1)
    hf.save_pretrained(tmp_path / "target")
    write_head(tmp_path / "head", head_tensors())
    prompts = random_prompts(VOCAB, [5, 21, 34], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    hf.generation_config.eos_token_id = None
    guesses = {}
    for one_table in ((False, True) if family == "gpt_oss" else (False,)):
        llm = LLM(str(tmp_path / "target"), speculative_config=eagle3_spec(tmp_path / "head", 2),
                  disable_hybrid_kv_cache_manager=one_table, **ENGINE)  # fmt: skip
        assert (llm.engine.runner.kv_groups is not None) == (family == "gpt_oss" and not one_table)
        made, propose = guesses.setdefault(one_table, []), llm.engine.spec.proposer.propose
        llm.engine.spec.proposer.propose = lambda *a: made.append(propose(*a)) or made[-1]
        assert generate_tokens(llm, prompts, [params] * 3) == [[hf_greedy(hf, p, 14)] for p in prompts]
        assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
        assert_clean(llm)
    # the head's cache on the global group's tables reads what it reads on one table (prompts past the window: a
    # windowed group's tables, whose blocks go back, would give other guesses)
    assert len(guesses) == 1 or guesses[False] == guesses[True]


def test_the_gpu_path_keeps_the_streams_beside_the_prompts_hidden_states(target, tmp_path, monkeypatch):
    """As on a GPU (prompt logprobs their own executable, the forward's second output the final hidden states beside
    the kept streams): the tokens and prompt logprobs of the CPU's path, guesses made."""
    from jaxpaged.platforms.cpu.platform import ComputedOnce, CpuPlatform

    folder, _ = target
    write_head(tmp_path / "head", head_tensors())
    spec = eagle3_spec(tmp_path / "head", 2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(VOCAB, [9, 23], seed=6)]
    want = LLM(str(folder), speculative_config=spec, **ENGINE).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(CpuPlatform, "device_conditionals", False)
    monkeypatch.setattr(ComputedOnce, "__call__", lambda self, compute, operand: compute())
    llm = LLM(str(folder), speculative_config=spec, cache_dir=str(tmp_path / "cache"), **ENGINE)
    assert llm.engine.runner._prompt_apart
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose([next(iter(d.values())).logprob for d in a.prompt_logprobs[1:]],
                                   [next(iter(d.values())).logprob for d in b.prompt_logprobs[1:]], atol=1e-5)  # fmt: skip
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert_clean(llm)


def test_a_head_that_knows_the_token_after_next_is_always_accepted(tmp_path):
    """The target walks a cycle (every layer's output zero: each stream is the token's embedding e_x); the head reads
    the first stream through fc = [I, 0, 0], adds nothing (o_proj, down_proj zero) and its head maps rms(e_x) to the
    token two on, its rows permuted by d2t. A misaligned stream, row, position or mapping would guess otherwise."""
    hf = random_hf_model(transformers.LlamaConfig(**TARGET), std=0.1)
    g = torch.Generator().manual_seed(4)
    e = _cycle_embeddings(hf, g)
    walk_cycle(hf.named_parameters(), 1.0)
    hf.save_pretrained(tmp_path / "target")
    w = head_tensors()
    perm = torch.randperm(VOCAB, generator=g)  # draft row j stands for target id perm[j]
    w["d2t"], w["t2d"] = perm - torch.arange(VOCAB), torch.ones(VOCAB, dtype=torch.bool)
    w["lm_head.weight"] = e[torch.from_numpy(np.argsort(SUCC[SUCC]))][perm].clone()
    w["fc.weight"] = torch.cat([torch.eye(D), torch.zeros(D, 2 * D)], dim=1)
    for name in ("norm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight"):
        w[name] = torch.ones(D)
    w["midlayer.self_attn.o_proj.weight"].zero_()
    w["midlayer.mlp.down_proj.weight"].zero_()
    write_head(tmp_path / "head", w, draft_vocab_size=VOCAB)
    llm = LLM(str(tmp_path / "target"), speculative_config=eagle3_spec(tmp_path / "head", 1), **ENGINE)
    assert_walks_the_cycle_and_accepts_all(llm)


@pytest.mark.parametrize("change, words", [
    (lambda head: (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]})), "not an EAGLE-3 head"),
    (lambda head: _patch_config(head, eagle_aux_hidden_state_layer_ids=[1, 2, 8]), "layer ids in 0..7"),
    (lambda head: _patch_config(head, num_hidden_layers=2), "heads of one layer"),
    (lambda head: _patch_config(head, vocab_size=300), "vocabulary"),
])  # fmt: skip
def test_bad_heads_are_refused(target, tmp_path, change, words):
    write_head(tmp_path / "head", head_tensors())
    change(tmp_path / "head")
    with pytest.raises(ValueError, match=f"speculative_config.method 'eagle3'.*{words}"):
        LLM(str(target[0]), speculative_config=eagle3_spec(tmp_path / "head", 2), **ENGINE)


def test_eagle3_needs_a_head_folder(target):
    with pytest.raises(ValueError, match="speculative_config.model is required for method 'eagle3'"):
        LLM(str(target[0]), speculative_config={"method": "eagle3", "num_speculative_tokens": 2}, **ENGINE)
    with pytest.raises(ValueError, match="not a local folder"):
        LLM(str(target[0]), speculative_config=eagle3_spec("/no/such/head", 2), **ENGINE)


def _patch_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
