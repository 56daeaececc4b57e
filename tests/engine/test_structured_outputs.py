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
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(temperature=0, use_beam_search=True, best_of=2,
                       structured_outputs=StructuredOutputsParams(regex="a"))  # fmt: skip


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
