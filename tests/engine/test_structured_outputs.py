"""Structured outputs (JSON schema, JSON object, regex, choice, Lark grammar) on the tiny cycle model.

Unconstrained, the cycle model writes its fixed byte cycle (greedy) or noise (temperature 1), so an
output that parses is the grammar's doing. Its tokenizer is byte-level: one token per byte.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.worker.sampler import apply_bitmask
from tests.structured_cases import CHOICES, GRAMMAR, REGEX, SCHEMA


@pytest.fixture(scope="module")
def llm(cycle_model_dir):
    return LLM(str(cycle_model_dir), dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=8,
               max_model_len=512, log_level="WARNING")  # fmt: skip


def _params(temperature: float, n: int = 1, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, n=n, seed=7, max_tokens=200,
                          structured_outputs=StructuredOutputsParams(**constraint))  # fmt: skip


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text), text
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)


CONSTRAINTS = {"json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES},
               "grammar": {"grammar": GRAMMAR}}  # fmt: skip


def _assert_all_blocks_back(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0


def _mixed_batch(llm: LLM):
    """Every kind, greedy and sampled, n = 1 and n = 3, beside free requests."""
    prompts, params, kinds = [], [], []
    for kind, constraint in CONSTRAINTS.items():
        for temperature, n in ((0.0, 1), (1.0, 3)):
            prompts.append(f"give me {kind}")
            params.append(_params(temperature, n, **constraint))
            kinds.append(kind)
        prompts.append("free")
        params.append(SamplingParams(temperature=1.0, max_tokens=12, seed=3))
        kinds.append(None)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, kind, p in zip(outs, kinds, params):
        assert len(out.outputs) == p.n
        for completion in out.outputs:
            if kind is None:
                assert len(completion.token_ids) == 12
                continue
            assert completion.finish_reason == "stop", (kind, completion.text)
            _check(kind, completion.text)
    return outs


def test_every_kind_in_a_mixed_batch_greedy_sampled_and_n(llm):
    _mixed_batch(llm)
    _assert_all_blocks_back(llm)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_json_object(llm):
    # json_object allows any key, which a near-uniform model rarely closes: the samples that end in time must parse
    params = SamplingParams(temperature=1.0, n=8, seed=1, max_tokens=48,
                            structured_outputs=StructuredOutputsParams(json_object=True))  # fmt: skip
    (out,) = llm.generate(["an object"], params, use_tqdm=False)
    stopped = [c for c in out.outputs if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        _check("json_object", c.text)
    _assert_all_blocks_back(llm)


def test_under_forced_preemption(cycle_model_dir):
    tiny_pool = LLM(str(cycle_model_dir), dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, block_size=8,
                    max_model_len=512, num_kv_blocks=40, log_level="WARNING")  # fmt: skip
    prompts = [f"request {i} " * 8 for i in range(12)]
    kinds = list(CONSTRAINTS) * 3
    params = [_params(1.0, 1, **CONSTRAINTS[k]) for k in kinds]
    outs = tiny_pool.generate(prompts, params, use_tqdm=False)
    for out, kind in zip(outs, kinds):
        assert out.outputs[0].finish_reason == "stop"
        _check(kind, out.outputs[0].text)
    assert tiny_pool.get_stats()["num_preemptions"] > 0
    _assert_all_blocks_back(tiny_pool)
    assert tiny_pool.get_stats()["num_compiles_after_warmup"] == 0


@pytest.mark.parametrize(
    "constraint, field",
    [
        ({"json": {"type": "not-a-type"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "(ab"}, "structured_outputs.regex"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_refused_and_serving_continues(llm, constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], _params(0.0, **constraint), use_tqdm=False)
    (out,) = llm.generate(["x"], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    _assert_all_blocks_back(llm)


def test_params_validation():
    with pytest.raises(ValueError, match="exactly one.*regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="structured_outputs.structural_tag is not supported"):
        StructuredOutputsParams(json_object=True, structural_tag="{}")
    with pytest.raises(ValueError, match="structured_outputs.whitespace_pattern applies to json"):
        StructuredOutputsParams(regex="a", whitespace_pattern=" ")
    with pytest.raises(ValueError, match="structured_outputs.disable_any_whitespace must be a bool"):
        StructuredOutputsParams(json_object=True, disable_any_whitespace="yes")


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
def test_beam_search_under_a_constraint(llm, kind):
    """Every hypothesis of every beam follows the constraint and ends there (finish "stop"); the scores are the
    model's logprobs renormalised over the allowed tokens, so they stay finite."""
    width = 3
    params = SamplingParams(temperature=0.0, use_beam_search=True, best_of=width, n=width, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(**CONSTRAINTS[kind]))  # fmt: skip
    (out,) = llm.generate([f"beams of {kind}"], params, use_tqdm=False)
    assert len(out.outputs) == width
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == width, texts
    for c in out.outputs:
        assert c.finish_reason == "stop", (kind, c.text)
        assert np.isfinite(c.cumulative_logprob) and c.cumulative_logprob <= 0
        _check(kind, c.text)
    if kind == "choice":  # width 3 over three choices: the search must find each of them, best first
        assert sorted(texts) == sorted(CHOICES)
    _assert_all_blocks_back(llm)


def test_beam_search_choice_scores_are_the_renormalised_logprobs(llm):
    """A beam's score is the sum of its tokens' logprobs under the masked distribution: the choice greedy decoding
    writes is among the beams, with the cumulative logprob greedy reports for it, and no beam scores better
    than the best."""
    constraint = StructuredOutputsParams(choice=CHOICES)
    params = SamplingParams(temperature=0.0, use_beam_search=True, best_of=3, n=3, max_tokens=50, structured_outputs=constraint)
    (beams,) = llm.generate(["pick"], params, use_tqdm=False)
    scores = [c.cumulative_logprob for c in beams.outputs]
    assert scores == sorted(scores, reverse=True)
    greedy_params = SamplingParams(temperature=0.0, max_tokens=50, logprobs=0, structured_outputs=constraint)
    (greedy,) = llm.generate(["pick"], greedy_params, use_tqdm=False)
    g = greedy.outputs[0]
    by_text = {c.text: c.cumulative_logprob for c in beams.outputs}
    assert g.text in by_text
    assert np.isclose(by_text[g.text], g.cumulative_logprob, atol=1e-4)
    assert scores[0] >= g.cumulative_logprob - 1e-4


def test_logprobs_under_a_constraint_exclude_forbidden_tokens(llm):
    """As vLLM: logprobs are of the masked distribution, renormalised over the allowed tokens; a forbidden token
    that makes the top list comes back as -inf."""
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=5,
                            structured_outputs=StructuredOutputsParams(regex="[ab]{3}"))  # fmt: skip
    (out,) = llm.generate(["x"], params, use_tqdm=False)
    c = out.outputs[0]
    assert re.fullmatch("[ab]{3}", c.text)
    for token, entry in zip(c.token_ids[:3], c.logprobs[:3]):
        finite = {t: lp.logprob for t, lp in entry.items() if np.isfinite(lp.logprob)}
        assert set(finite) <= {ord("a"), ord("b")}, entry
        assert np.isclose(np.logaddexp.reduce(list(finite.values())), 0.0, atol=1e-4)  # they sum to one
        assert token in finite


def test_json_options(llm):
    """vLLM's disable_additional_properties closes every object; whitespace_pattern allows that whitespace."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = StructuredOutputsParams(json=open_schema, disable_additional_properties=True)
    for out in llm.generate(["j"] * 4, SamplingParams(temperature=1.0, seed=1, max_tokens=100, structured_outputs=closed),
                            use_tqdm=False):  # fmt: skip
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"a"}, value
    spaced = StructuredOutputsParams(json=open_schema, whitespace_pattern="[ ]{2}", disable_additional_properties=True)
    (out,) = llm.generate(["k"], SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=spaced), use_tqdm=False)
    text = out.outputs[0].text
    assert json.loads(text)["a"] is not None
    assert re.sub(r'"[^"]*"', "", text).replace("  ", "").count(" ") == 0, text  # any whitespace comes in pairs


def test_compiled_grammars_are_cached(llm):
    manager = llm.engine.structured_outputs
    llm.generate(["a", "b"], [_params(0.0, regex="z+"), _params(1.0, regex="z+")], use_tqdm=False)
    before = manager.num_cached
    llm.generate(["c"], _params(0.0, regex="z+"), use_tqdm=False)
    assert manager.num_cached == before


def test_apply_bitmask_unpacks_bits_per_row():
    logits = np.zeros((2, 40), np.float32)
    mask = np.zeros((2, 2), np.int32)
    mask[0, 0] = 1 << 3
    mask[0, 1] = 1 << 2  # token 34
    mask[1] = -1
    out = np.asarray(apply_bitmask(logits, mask))
    assert np.flatnonzero(out[0] == 0).tolist() == [3, 34]
    assert (out[1] == 0).all()
