"""logit_bias, allowed_token_ids and bad_words (vLLM's SamplingParams) on the cycle model, whose next-token logits
are known exactly (tests/cycle_model.py: MARGIN at the current token's successor, 0 everywhere else), so every
greedy output is checked against a reference written here, and sampled ones against the set they must stay in."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.cycle_model import CYCLE, MARGIN, successor


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(cycle_model_dir, request):
    return LLM(str(cycle_model_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, block_size=8,
               max_model_len=256, async_scheduling=request.param, log_level="WARNING")  # fmt: skip


def _vocab(llm) -> int:
    return llm.engine.loaded.config.vocab_size


def reference(llm, prompt: list[int], count: int, bias=None, allowed=None, bad=()) -> list[int]:
    """Greedy tokens with the controls applied as vLLM does: the allowed mask, bad words' bans, then the bias."""
    out, tok = [], prompt[-1]
    for _ in range(count):
        scores = np.zeros(_vocab(llm))
        scores[successor(tok)] = MARGIN
        if allowed is not None:
            keep = np.full_like(scores, -np.inf)
            keep[allowed] = 0
            scores += keep
        for word in bad:
            if len(word) == 1 or out[len(out) - len(word) + 1 :] == list(word[:-1]):
                scores[word[-1]] = -np.inf
        for t, b in (bias or {}).items():
            scores[t] += b
        tok = int(np.argmax(scores))  # the first maximum, as the sampler's
        out.append(tok)
    return out


def _tokens(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = [[CYCLE[0]], [10, 20, CYCLE[3]], [ord("a")], [5]]


def test_logit_bias_moves_the_greedy_choice(llm):
    """+5 beats the successor's margin of 4, +3 does not: the biased token wins only where it should."""
    b, c = ord("b"), CYCLE[2]
    for bias in ({b: 5.0}, {b: 3.0}, {c: 5.0, successor(c): -10.0}, {t: -100.0 for t in CYCLE}):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias=bias)
        assert _tokens(llm, PROMPTS, params) == [reference(llm, p, 12, bias=bias) for p in PROMPTS], bias
    assert _tokens(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={b: 5.0}))[0] == [b] * 3


def test_allowed_token_ids_greedy_and_sampled(llm):
    allowed = [ord("a"), CYCLE[2], 7]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)
    assert _tokens(llm, PROMPTS, greedy) == [reference(llm, p, 10, allowed=allowed) for p in PROMPTS]
    sampled = SamplingParams(temperature=1.5, n=4, seed=3, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampled, use_tqdm=False)
    seen = {t for o in outs for c in o.outputs for t in c.token_ids}
    assert seen <= set(allowed) and len(seen) == 3  # random, and inside the set


def test_allowed_token_ids_leave_the_logprobs_raw(llm):
    """As vLLM: the logprob reported is the model's own, not renormalised over the allowed ids."""
    forced = 7  # never a successor: its raw logit is 0
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, allowed_token_ids=[forced], logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    want = -math.log(math.exp(MARGIN) + _vocab(llm) - 1)
    assert list(out.outputs[0].token_ids) == [forced] * 4
    for step in out.outputs[0].logprobs:
        assert step[forced].logprob == pytest.approx(want, abs=1e-3)


def test_bad_words_ban_the_last_token_after_the_rest(llm):
    """"ab" (two tokens) bans b only right after a; "é" (two bytes) likewise; "a" (one token) always bans a."""
    tokenizer = llm.get_tokenizer()
    for words in (["ab"], ["é"], ["a"], ["ab", " é", "日"]):
        ids = [tokenizer.encode(w.lstrip(), add_special_tokens=False) for w in words]
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=words)
        got = _tokens(llm, PROMPTS, params)
        assert got == [reference(llm, p, 20, bad=[tuple(i) for i in ids]) for p in PROMPTS], words
        for out in got:
            for word in ids:
                assert not any(out[j : j + len(word)] == word for j in range(len(out))), (words, out)
    plain = _tokens(llm, [[ord(" ")]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert plain == [ord("a"), ord("b"), CYCLE[0]]  # what "ab" changes, had it not been banned


def test_controls_beside_plain_requests_change_only_their_own(llm):
    prompts = PROMPTS * 2
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    controlled = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logit_bias={7: 9.0}),
                  SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=["ab"])]  # fmt: skip
    params = [plain if i % 2 else controlled[i // 2 % 2] for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs, strict=True):
        bias, bad = sp.logit_bias, [(ord("a"), ord("b"))] if sp.bad_words else ()
        assert list(out.outputs[0].token_ids) == reference(llm, p, 10, bias=bias, bad=bad)
    stats = llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("params, match", [
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
])  # fmt: skip
def test_ids_outside_the_vocabulary_are_refused_and_serving_goes_on(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2, **params), use_tqdm=False)
    assert _tokens(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3))[0] == reference(llm, PROMPTS[0], 3)


@pytest.mark.parametrize("params, match", [
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words="ab"), "bad_words"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words=["x"] * 65), "bad_words"),
    (dict(use_beam_search=True, temperature=0.0, n=2, logit_bias={1: 1.0}), "logit_bias"),
])  # fmt: skip
def test_bad_values_name_their_parameter(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)
