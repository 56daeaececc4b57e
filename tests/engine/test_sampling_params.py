"""SamplingParams: vLLM's defaults, every out-of-range value refused with its field named, normalisations."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from jaxpaged.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    SamplingType,
)

INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", MAX_N + 1),
    ("n", 1.0),
    ("n", True),
    ("n", "2"),
    ("n", None),
    ("best_of", 0),
    ("best_of", 1.5),
    ("best_of", True),
    ("temperature", -1.0),
    ("temperature", -1e-9),
    ("temperature", math.inf),
    ("temperature", math.nan),
    ("temperature", "0.5"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", "1"),
    ("top_p", False),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", 2.0),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("min_p", "0"),
    ("presence_penalty", -2.1),
    ("presence_penalty", 2.1),
    ("presence_penalty", math.inf),
    ("presence_penalty", True),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", 3),
    ("frequency_penalty", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", "1.1"),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.0),
    ("seed", True),
    ("seed", "42"),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", ["x"] * (MAX_STOP_STRINGS + 1)),
    ("stop", "x" * (MAX_STOP_STRING_LEN + 1)),
    ("stop", [1]),
    ("stop", 5),
    ("stop", [None]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, -5]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
    ("stop_token_ids", "12"),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("early_stopping", "bogus"),  # refused even without beam search
    ("min_tokens", -1),
    ("min_tokens", 17),  # above the default max_tokens=16
    ("min_tokens", 1.0),
    ("min_tokens", None),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", "5"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", 0),
    ("use_beam_search", 1),
    ("length_penalty", math.inf),
    ("length_penalty", math.nan),
    ("length_penalty", "1"),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_invalid_value_names_its_field(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    assert "got" in str(err.value)


def test_message_names_the_range():
    with pytest.raises(ValueError, match=r"temperature must be >= 0 \(got -1.0\)"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens=4 \(got 5\)"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match=r"best_of must be None or >= n=3 \(got 2\)"):
        SamplingParams(n=3, best_of=2)


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos) == (None, [], [], False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert (p.skip_special_tokens, p.include_stop_str_in_output, p.use_beam_search, p.length_penalty) == (
        True,
        False,
        False,
        1.0,
    )
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy
    assert not p.has_penalties and not p.uses_truncation


VALID = [
    dict(n=MAX_N),
    dict(n=4, best_of=4),
    dict(temperature=0),
    dict(temperature=2),
    dict(temperature=1e6),
    dict(top_p=1e-6),
    dict(top_p=1),
    dict(top_k=1),
    dict(top_k=10**6),
    dict(top_k=np.int64(5)),
    dict(min_p=0),
    dict(min_p=1),
    dict(presence_penalty=-2, frequency_penalty=2),
    dict(repetition_penalty=1e-3),
    dict(repetition_penalty=5),
    dict(seed=0),
    dict(seed=2**63 - 1),
    dict(stop=["a"] * MAX_STOP_STRINGS),
    dict(stop="x" * MAX_STOP_STRING_LEN),
    dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
    dict(stop_token_ids=(0, np.int32(7))),
    dict(max_tokens=None, min_tokens=10**6),
    dict(max_tokens=1),
    dict(max_tokens=8, min_tokens=8),
    dict(logprobs=0, prompt_logprobs=0),
    dict(logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS),
    dict(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
    dict(length_penalty=-3.5),
]


@pytest.mark.parametrize("kwargs", VALID, ids=[repr(k)[:40] for k in VALID])
def test_valid_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        got = getattr(p, name)
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name == "stop_token_ids":
            value = [int(v) for v in value]
        assert got == value


def test_top_k_disabled_spellings_normalise_to_zero():
    for value in (0, -1, None):
        assert SamplingParams(top_k=value).top_k == 0


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    ids = SamplingParams(stop_token_ids=(np.int64(3), 4)).stop_token_ids
    assert ids == [3, 4] and all(type(t) is int for t in ids)


def test_numbers_normalise_to_python_types():
    p = SamplingParams(temperature=1, top_p=np.float32(0.5), top_k=np.int32(3), presence_penalty=1)
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.presence_penalty) is float
    assert type(p.top_k) is int and p.top_k == 3


def test_greedy_below_eps_and_truncation_reset():
    for t in (0.0, 1e-6, 9.9e-6):
        p = SamplingParams(temperature=t, top_k=5, top_p=0.5, min_p=0.2)
        assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
        assert (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)
    p = SamplingParams(temperature=1e-5, top_k=5)
    assert not p.is_greedy and p.top_k == 5


def test_sampling_type_and_helpers():
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties
    assert SamplingParams(top_k=2).uses_truncation
    assert SamplingParams(top_p=0.9).uses_truncation
    assert SamplingParams(min_p=0.1).uses_truncation


def test_replace_revalidates():
    p = SamplingParams(stop="x", top_k=-1)
    q = dataclasses.replace(p, temperature=0.5)
    assert q.stop == ["x"] and q.top_k == 0 and q.temperature == 0.5
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)


@pytest.mark.parametrize("kwargs", [dict(n=2, best_of=3), dict(best_of=2)])
def test_best_of_sampling_not_supported(kwargs):
    with pytest.raises(NotImplementedError, match="use_beam_search"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(use_beam_search=True), "temperature"),
        (dict(use_beam_search=True, temperature=0, early_stopping="sometimes"), "early_stopping"),
        (dict(use_beam_search=True, temperature=0, stop=["x"]), "stop"),
        (dict(use_beam_search=True, temperature=0, logprobs=2), "logprobs"),
        (dict(use_beam_search=True, temperature=0, repetition_penalty=1.2), "repetition_penalty"),
        (dict(use_beam_search=True, temperature=0, n=3, best_of=2), "best_of"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_beam_search_width_defaults_to_n():
    p = SamplingParams(use_beam_search=True, temperature=0, n=3, length_penalty=0.5, early_stopping="never")
    assert (p.best_of, p.length_penalty, p.early_stopping) == (3, 0.5, "never")


def test_clone_is_an_equal_independent_copy():
    """vLLM's SamplingParams.clone(): equal, and its lists are its own."""
    p = SamplingParams(n=2, temperature=0.7, seed=5, stop=["x"], stop_token_ids=[3], logprobs=2)
    q = p.clone()
    assert q == p and q is not p and q.stop is not p.stop and q.stop_token_ids is not p.stop_token_ids
    q.stop.append("y")
    q.stop_token_ids.append(4)
    assert p.stop == ["x"] and p.stop_token_ids == [3] and q != p
