"""The two OpenAI logprobs shapes on hand-made entries: completions' dict holds the sampled token beside the top k
(k+1 entries when it is not among them, as vLLM), chat's list the top k alone."""

from __future__ import annotations

from jaxpaged.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from jaxpaged.outputs import CompletionOutput, Logprob


class _Bytes:
    def __call__(self, token_id: int, decoded: str) -> list[int]:
        return list(decoded.encode())


def _entry(sampled_rank: int | None) -> dict[int, Logprob]:
    """As the output processor builds it: the sampled token (id 9) first, then the top 2 by rank."""
    return {9: Logprob(-5.0, sampled_rank, "s"), 1: Logprob(-0.1, 1, "a"), 2: Logprob(-2.0, 2, "b")}


def _output(entries: list[dict[int, Logprob]]) -> CompletionOutput:
    return CompletionOutput(index=0, text="s" * len(entries), token_ids=[9] * len(entries), cumulative_logprob=None,
                            logprobs=entries)


def test_completions_top_logprobs_keep_the_sampled_token_outside_the_top_k():
    lists, _ = completion_logprobs(_output([_entry(7), _entry(None)]), 0, 2, 2, 0)
    assert lists["top_logprobs"] == [{"s": -5.0, "a": -0.1, "b": -2.0}] * 2
    assert list(lists["top_logprobs"][0]) == ["s", "a", "b"]  # the sampled token first, as vLLM's dict


def test_completions_top_logprobs_with_the_sampled_token_inside_or_k_0():
    inside = {1: Logprob(-0.1, 1, "a"), 2: Logprob(-2.0, 2, "b")}
    lists, _ = completion_logprobs(CompletionOutput(0, "a", [1], None, [inside]), 0, 1, 2, 0)
    assert lists["top_logprobs"] == [{"a": -0.1, "b": -2.0}]
    lists, _ = completion_logprobs(_output([_entry(7)]), 0, 1, 0, 0)
    assert lists["top_logprobs"] == [{"s": -5.0}]  # logprobs=0: the sampled token alone, not {}


def test_chat_top_logprobs_are_the_top_k_alone():
    [item] = chat_logprobs(_output([_entry(7)]), 0, 1, 2, _Bytes())
    assert item["token"] == "s" and item["logprob"] == -5.0
    assert [t["token"] for t in item["top_logprobs"]] == ["a", "b"]
