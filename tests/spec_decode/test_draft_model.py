"""Speculative decoding with a draft model: the target drafting for itself accepts everything; other drafts of the
same vocabulary change no greedy token (mixed batches, n > 1, preemption); the draft's blocks all come back."""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.arg_utils import add_engine_args, engine_kwargs
from jaxpaged.spec_decode.config import SpeculativeConfig
from jaxpaged.spec_decode.draft_model import _DraftSeq
from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config
from tests.spec_decode.test_spec_decode import ENGINE, _tokens, _workload


# The proposer tests' engines: 16-token steps (buckets 4, 8, 16) of at most 4 sequences (one sampler shape)
SMALL = {**ENGINE, "max_num_seqs": 4, "max_num_batched_tokens": 16}


def _draft(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def noisy_dir(hf_model, tmp_path_factory):
    """The target with a little noise on every weight: a draft that agrees with it most of the time, not always."""
    import torch

    model = copy.deepcopy(hf_model)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.005 * torch.randn_like(p))
    return str(save_hf_model(model, tmp_path_factory.mktemp("noisy-draft")))


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """Another random model, smaller in every dimension (1 layer, hidden 32, 1 KV head), with the target's vocabulary."""
    cfg = tiny_llama_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    return str(save_hf_model(random_hf_model(cfg, seed=3), tmp_path_factory.mktemp("small-draft")))


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    """A random Mistral with a 12-token window on every layer: the draft's blocks behind it go back as it advances."""
    import transformers

    cfg = transformers.MistralConfig(**{**tiny_llama_config().to_dict(), "sliding_window": 12, "max_position_embeddings": 256})
    return str(save_hf_model(random_hf_model(cfg, seed=4), tmp_path_factory.mktemp("windowed-draft")))


@pytest.fixture(scope="module")
def dynamic_dir(tmp_path_factory):
    """A random Llama with dynamic NTK RoPE: its steps carry each row's RoPE length (core/rope_regime.py)."""
    cfg = tiny_llama_config(max_position_embeddings=256, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    return str(save_hf_model(random_hf_model(cfg, seed=6), tmp_path_factory.mktemp("dynamic-draft")))


@pytest.fixture(scope="module")
def base(model_dir):
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def noisy_spec(model_dir, noisy_dir):
    """The target drafted for by the noisy model (k = 3): the mixed-batch, sampled and abort tests share it, each
    leaving it with nothing running or held."""
    return LLM(model_dir, speculative_config=_draft(noisy_dir), **ENGINE)


@pytest.fixture(scope="module")
def tight_spec(model_dir, small_dir):
    """A tight target pool (16 blocks) and a 16-token step budget, the small draft guessing 2: the preemption and
    step-budget tests share it."""
    return LLM(model_dir, speculative_config=_draft(small_dir, k=2),
               **{**ENGINE, "num_kv_blocks": 16, "max_num_batched_tokens": 16, "max_num_seqs": 8})  # fmt: skip


def _assert_clean(llm: LLM) -> None:
    """Nothing held by the target or the draft, nothing compiled after warm-up."""
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["spec_decode_draft_blocks_used"] == 0 and not llm.engine.spec.proposer.seqs, stats
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_compiles_after_warmup"] == 0


def test_draft_state_knows_the_guesses_that_came_true():
    seq = _DraftSeq(start=4, fed=[7, 8, 9])
    assert seq.known([1, 2, 3, 4, 7, 8, 5, 6]) == 6  # guesses 7, 8 kept; 9 was rejected (5 came instead)
    assert seq.known([1, 2, 3, 4, 7, 8, 9, 2, 3]) == 7
    assert seq.known([1, 2, 3, 4, 5]) == 4
    assert _DraftSeq().known([1, 2]) == 0


@pytest.mark.parametrize("draft", ["small_dir", "windowed_dir", "dynamic_dir"])
def test_guesses_are_the_drafts_own_greedy_tokens_after_rejections_and_long_prompts(model_dir, draft, request):
    """The proposer against the draft model run as an ordinary engine: its guesses for a sequence are the draft's
    greedy continuation of it, whatever the sequence's earlier guesses turned into (kept, rejected and corrected,
    all kept plus a bonus token), and for prompts longer than a step's budget; a windowed draft and one with
    length-dependent RoPE too."""
    draft = request.getfixturevalue(draft)
    spec = LLM(model_dir, speculative_config=_draft(draft, k=4), **SMALL)
    proposer = spec.engine.spec.proposer
    alone = LLM(draft, **SMALL)

    def greedy(tokens, k):
        params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
        return alone.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0].outputs[0].token_ids

    rng = np.random.default_rng(7)
    a, b, c = (rng.integers(2, 256, size=n).tolist() for n in (13, 40, 5))  # b: over the 16-token step budget
    assert proposer.propose([a, b], [4, 3], ["a", "b"]) == [greedy(a, 4), greedy(b, 3)]
    ga = greedy(a, 4)
    wrong = (ga[2] + 1) % 256
    a2 = a + ga[:2] + [wrong]  # guess 3 rejected: the target's token instead
    b2 = b + greedy(b, 3) + [9]  # all kept, then the bonus token
    assert proposer.propose([c, a2, b2], [2, 4, 1], ["c", "a", "b"]) == [greedy(c, 2), greedy(a2, 4), greedy(b2, 1)]
    assert proposer.seqs["a"].known(a2 + greedy(a2, 4)) == len(a2) + 3  # every guess fed but the last
    if proposer.kv.sliding_window is not None:  # b's blocks wholly behind the window went back
        assert proposer.kv.num_released("b") > 0
    proposer.release(["a", "b", "c"])
    assert spec.get_stats()["spec_decode_draft_blocks_used"] == 0 and not proposer.seqs


def test_the_target_drafting_for_itself_accepts_every_guess(model_dir, base):
    spec = LLM(model_dir, speculative_config=_draft(model_dir, k=4), **ENGINE)
    prompts, params = _workload(8, seed=11)
    assert _tokens(spec, prompts, params) == _tokens(base, prompts, params)
    stats = spec.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 50, stats
    assert stats["spec_decode_acceptance_rate"] == 1.0, stats
    _assert_clean(spec)


def test_greedy_identical_with_a_different_draft_in_a_mixed_batch(noisy_spec, base):
    """Requests with logprobs (not speculating), n = 2, and short max_tokens (a smaller k near the end), in one
    batch; again, with the prefix cache serving the target and the draft starting over."""
    spec = noisy_spec
    prompts, params = _workload(10, seed=1)
    expected = _tokens(base, prompts, params)
    compiled = len(spec.engine.spec.proposer.runner._compiled)
    assert _tokens(spec, prompts, params) == expected
    stats = spec.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    assert stats["spec_decode_accepted_per_position"][-1] > 0, stats  # some proposals were accepted whole
    _assert_clean(spec)
    assert _tokens(spec, prompts, params) == expected
    assert spec.get_stats()["prefix_cache_hits"] > 0
    assert len(spec.engine.spec.proposer.runner._compiled) == compiled  # the draft's buckets, all from warm-up
    _assert_clean(spec)


def test_greedy_identical_under_preemption_with_a_smaller_draft(tight_spec, base, monkeypatch):
    """A tight target pool preempts; a 16-token step budget chunks the draft's catch-up of long prompts too."""
    prompts, params = _workload(10, seed=3)
    expected = _tokens(base, prompts, params)
    tight = tight_spec
    engine, proposer = tight.engine, tight.engine.spec.proposer
    preempted = set()  # sequences whose draft blocks went back while they waited to run again
    release = proposer.release
    monkeypatch.setattr(proposer, "release", lambda ids: preempted.update(set(ids) & {r.seq_id for r in engine.scheduler.waiting})
                        or release(ids))  # fmt: skip
    assert _tokens(tight, prompts, params) == expected
    stats = tight.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    # short prompts and long answers: the pool runs dry while sequences decode, so the preempted ones had drafts
    short = [p[:8] for p in prompts[:6]]
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    assert _tokens(tight, short, [long] * 6) == _tokens(base, short, [long] * 6)
    assert preempted, "no preempted sequence held draft blocks"
    _assert_clean(tight)


def test_sampled_requests_are_reproducible_and_release_their_draft_blocks(noisy_spec):
    spec = noisy_spec
    prompts, _ = _workload(3, seed=5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=16, ignore_eos=True) for s in range(3)]
    first = _tokens(spec, prompts, params)
    assert _tokens(spec, prompts, params) == first
    assert spec.get_stats()["spec_decode_num_accepted_tokens"] > 0
    _assert_clean(spec)


def test_an_aborted_request_gives_its_draft_blocks_back(noisy_spec):
    engine = noisy_spec.engine
    prompts, _ = _workload(2, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while engine.get_stats()["spec_decode_draft_blocks_used"] == 0:
        engine.step()
    engine.abort_request("r0")
    assert "r0#0" not in engine.spec.proposer.seqs and "r1#0" in engine.spec.proposer.seqs
    engine.abort_request("r1")
    assert engine.get_stats()["spec_decode_draft_blocks_used"] == 0
    _assert_clean(noisy_spec)


def test_a_draft_of_another_vocabulary_is_a_value_error_naming_the_field(model_dir, tmp_path):
    cfg = tiny_llama_config(vocab_size=300, num_hidden_layers=1, max_position_embeddings=256)
    other = str(save_hf_model(random_hf_model(cfg), tmp_path / "other-vocab"))
    with pytest.raises(ValueError, match=r"speculative_config\.model .*vocabulary of 300 tokens.* 256"):
        LLM(model_dir, speculative_config=_draft(other), **ENGINE)


@pytest.mark.parametrize("bad", [{"method": "draft_model", "num_speculative_tokens": 2},
                                 {"method": "draft_model", "num_speculative_tokens": 2, "model": 3}])  # fmt: skip
def test_draft_model_without_a_model_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.parse(bad)


def test_the_clis_flag_takes_a_draft_model():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    value = {"method": "draft_model", "model": "some/draft", "num_speculative_tokens": 5}
    args = parser.parse_args(["--speculative-config", json.dumps(value)])
    parsed = SpeculativeConfig.parse(engine_kwargs(args)["speculative_config"])
    assert (parsed.method, parsed.model, parsed.num_speculative_tokens) == ("draft_model", "some/draft", 5)
    assert SpeculativeConfig.parse({"model": "some/draft", "num_speculative_tokens": 2}).method == "draft_model"


def test_draft_steps_stay_in_the_runners_buckets(tight_spec, monkeypatch):
    """Catch-up steps of many long prompts are cut to the step budget (16 tokens): each dispatched step fits a bucket."""
    spec = tight_spec
    proposer = spec.engine.spec.proposer
    sizes = []
    dispatch = proposer.runner.dispatch
    monkeypatch.setattr(proposer.runner, "dispatch", lambda step, *a, **kw: sizes.append(step.input_ids.shape[0])
                        or dispatch(step, *a, **kw))  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 256, size=40).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sizes and max(sizes) <= 16 and set(sizes) <= set(proposer.runner.buckets), sizes
    assert spec.get_stats()["num_compiles_after_warmup"] == 0
