"""Structured outputs with speculative decoding: proposals are cut at the first token the grammar refuses, every
verifying row gets the mask of the grammar advanced by the proposals before it, and the output is what it is without
speculation (greedy) or still parses (sampled, n > 1). On the tiny cycle model (tests/cycle_model.py), whose
constrained output repeats itself, so prompt lookup finds it in a prompt that already holds it."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.test_structured_outputs import CONSTRAINTS, _check
from tests.spec_decode.test_spec_decode import _assert_clean

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=8, max_model_len=512,
              log_level="WARNING")  # fmt: skip


@pytest.fixture(scope="module")
def engines(cycle_model_dir):
    return LLM(str(cycle_model_dir), **ENGINE), LLM(str(cycle_model_dir), speculative_config=NGRAM, **ENGINE)


def _params(constraint: dict, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(**constraint), **kw)


@pytest.mark.parametrize("kind", [*CONSTRAINTS, "json_object"])
def test_greedy_constrained_output_unchanged_and_proposals_accepted(engines, kind):
    base, spec = engines
    params = _params(CONSTRAINTS.get(kind, {"json_object": True}), temperature=0.0)
    first = base.generate([f"give me {kind}"], params, use_tqdm=False)[0].outputs[0].text
    prompt = first.encode()[-150:].decode(errors="ignore")  # the answer it is about to give, for prompt lookup
    want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    before = spec.get_stats()
    got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    if got.finish_reason == "stop":  # json_object's cycle of key characters runs to max_tokens
        _check(kind, got.text)
    after = spec.get_stats()
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"], kind
    _assert_clean(spec)


def test_a_proposal_is_cut_where_the_grammar_refuses_it(engines):
    """The grammar's own check: a regex answer "ab-0" takes "ab-" then digits, so of the proposal "-12x" it keeps
    "-12", and the mask of a row after "-1" allows digits and not "-"."""
    import numpy as np

    from jaxpaged.worker.sampler import bitmask_words

    _, spec = engines
    manager = spec.engine.structured_outputs
    state = manager.new_state(StructuredOutputsParams(regex=r"ab-\d{1,3}"))
    for token in b"ab":
        assert state.accept(token)
    assert state.valid_prefix(list(b"-12x")) == 3
    assert state.valid_prefix(list(b"x")) == 0
    row = np.zeros(bitmask_words(manager.vocab_size), np.int32)
    view = state.after(list(b"-1"))
    assert view.num_consumed == 4
    view.fill_bitmask(row)
    allowed = {t for t in range(256) if (row[t // 32] >> (t % 32)) & 1}
    assert allowed >= set(b"0123456789") and ord("-") not in allowed and ord("x") not in allowed
    assert state.num_consumed == 2 and state.valid_prefix(list(b"-123")) == 4  # the matcher itself did not move


def test_sampled_and_n_constrained_requests_speculate_and_still_parse(engines):
    _, spec = engines
    prompts, params, kinds = [], [], []
    for kind, constraint in CONSTRAINTS.items():
        prompts.append(f"give me {kind} " * 3)
        params.append(_params(constraint, temperature=1.0, n=3, seed=11))
        kinds.append(kind)
    prompts.append("free")
    params.append(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    kinds.append(None)
    before = spec.get_stats()
    outs = spec.generate(prompts, params, use_tqdm=False)
    for out, kind in zip(outs, kinds):
        for completion in out.outputs:
            if kind is not None:
                assert completion.finish_reason == "stop", (kind, completion.text)
                _check(kind, completion.text)
    assert spec.get_stats()["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    _assert_clean(spec)
