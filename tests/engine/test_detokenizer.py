"""IncrementalDetokenizer: streamed pieces equal a full decode, UTF-8 safety, stop strings.

Three tokenizers built in-process (a small byte-level BPE, the same wrapped by transformers, and a
Llama-2-style SentencePiece with byte fallback) plus the built-in SmolLM2 one when installed.
"""

from __future__ import annotations

import random
import string

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from jaxpaged.engine.detokenizer import INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET, IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Stop here: END of story, and more text after.",
    "Hello, world! Once upon a time, in a small village, there lived a cat who sat on the mat.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The capital of France is Paris. Water boils at 100 degrees. List three colors: red, green, blue.",
] * 20
FRAGMENTS = [
    "Hello", " world", ",", ".", " the", " cat", " sat", "\n", "\n\n", "  ", "\t", "123", " 3.14",
    " héllo", " wörld", " 日本語", "中文", " 🚀", "🙂", "👩‍👩‍👧", " €5", "ñ", " Ω≈ç", "<|im_end|>", "<|im_start|>",
    " STOP", "END", "!", "?", " don't", " i.e.",
]
MULTIBYTE = "日本語🚀🙂👩‍👩‍👧€"


def byte_bpe() -> Tokenizer:
    """Byte-level BPE with a tiny vocabulary: every non-ASCII character takes several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def sentencepiece_like() -> Tokenizer:
    """Llama-2's decoder chain: "▁" for spaces, byte fallback, and the first leading space stripped."""
    words = "The cat sat on the mat Hello world".split()
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [(c, -5.0) for c in string.ascii_letters + string.digits + string.punctuation]
    vocab += [("▁", -4.0)] + [("▁" + w, -1.0) for w in words]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


@pytest.fixture(scope="module")
def smollm2():
    from jaxpaged.models.builtin import builtin_gguf_path
    from jaxpaged.models.gguf_io import gguf_tokenizer, open_gguf

    try:
        path = builtin_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(f"built-in SmolLM2 tokenizer absent ({exc})")
    return gguf_tokenizer(open_gguf(path), path)


@pytest.fixture(scope="module")
def raw_bpe() -> Tokenizer:
    return byte_bpe()


@pytest.fixture(scope="module")
def hf_bpe(raw_bpe):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=raw_bpe, eos_token="<|im_end|>")


@pytest.fixture(params=["raw_bpe", "hf_bpe", "smollm2"])
def byte_level(request):
    """Every byte-level tokenizer: raw `tokenizers`, transformers-wrapped, and SmolLM2's."""
    return request.getfixturevalue(request.param)


def encode(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    return list(ids.ids if hasattr(ids, "ids") else ids)


def decode(tok, ids: list[int], skip: bool = True) -> str:
    return tok.decode(ids, skip_special_tokens=skip)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Pushes every id, then flushes; returns all the pieces (flush's last)."""
    return [detok.push(i) for i in ids] + [detok.flush()]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25))) for _ in range(n)]
    return texts + [MULTIBYTE, " " + MULTIBYTE + " end", "🚀" * 5]


def stop_reference(text: str, stops, include: bool) -> tuple[str, str | None]:
    """The text a stop string leaves: the first stop to complete (earliest end, then earliest start)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[1], best[0])):
            best = (i, i + len(s), s)
    if best is None:
        return text, None
    return text[: best[1] if include else best[0]], best[2]


def check_stop_stream(tok, ids: list[int], stops, include: bool = False, skip: bool = True) -> IncrementalDetokenizer:
    """Streams ids with stop strings; checks the pieces against the reference at every step."""
    expected, reason = stop_reference(decode(tok, ids, skip), stops, include)
    detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include, skip_special_tokens=skip)
    shown = ""
    for token in ids:
        was_finished = detok.finished
        piece = detok.push(token)
        assert not (was_finished and piece), "text returned after the stop string"
        shown += piece
        assert expected.startswith(shown), f"returned {shown!r}, which is not a prefix of {expected!r}"
        assert detok.output_text == shown and detok.text.startswith(shown)
    shown += detok.flush()
    assert shown == expected == detok.text == detok.output_text
    assert detok.finished == (reason is not None) and detok.stop_reason == reason
    return detok


def token_spans(tok, ids: list[int]) -> list[tuple[int, int]]:
    """Each token's character span in the decoded text (for ASCII text, where tokens are whole chars)."""
    ends = [len(decode(tok, ids[: k + 1])) for k in range(len(ids))]
    return list(zip([0] + ends[:-1], ends))


# --- streamed text equals the full decode -------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode(byte_level, skip):
    held = 0
    for text in random_texts(60, seed=1):
        ids = encode(byte_level, text)
        detok = IncrementalDetokenizer(byte_level, skip_special_tokens=skip)
        pieces = stream(detok, ids)
        assert "".join(pieces) == decode(byte_level, ids, skip) == detok.text, text
        assert not any("\ufffd" in p for p in pieces), (text, pieces)
        held += pieces[:-1].count("")
    assert held, "no character was split across tokens, so UTF-8 holding went untested"


def test_stream_equals_full_decode_sentencepiece():
    tok = sentencepiece_like()
    for text in random_texts(60, seed=2):
        ids = encode(tok, text)
        pieces = stream(IncrementalDetokenizer(tok), ids)
        assert "".join(pieces) == decode(tok, ids), text
        assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_arbitrary_ids_equal_full_decode(byte_level, skip):
    """A model may sample invalid byte sequences; after flush the stream still equals decode (U+FFFD and all)."""
    rng = random.Random(3)
    vocab = byte_level.get_vocab_size() if isinstance(byte_level, Tokenizer) else len(byte_level)
    for _ in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        assert "".join(stream(IncrementalDetokenizer(byte_level, skip_special_tokens=skip), ids)) == decode(byte_level, ids, skip)


def test_multibyte_characters_are_held_until_complete(byte_level):
    assert len(encode(byte_level, "🚀")) > 1, "precondition: 🚀 spans several tokens"
    for char in MULTIBYTE:
        ids = encode(byte_level, char)
        detok = IncrementalDetokenizer(byte_level)
        pieces = [detok.push(i) for i in ids]
        assert pieces == [""] * (len(ids) - 1) + [char], (char, pieces)
        assert detok.flush() == ""


def test_incomplete_character_at_the_end_flushes_as_replacement(raw_bpe):
    ids = encode(raw_bpe, "ok 🚀")[:-1]
    detok = IncrementalDetokenizer(raw_bpe)
    assert "".join(detok.push(i) for i in ids) == "ok "
    assert detok.flush() == decode(raw_bpe, ids)[len("ok ") :] == "\ufffd"


def test_decode_window_stays_short(raw_bpe):
    """O(1) per token: each decode sees the previous piece's tokens and the new one, not the whole output."""

    class Counting:
        def __init__(self, tok):
            self.tok, self.sizes = tok, []

        def decode(self, ids, **kwargs):
            self.sizes.append(len(ids))
            return self.tok.decode(ids, **kwargs)

    counting = Counting(raw_bpe)
    ids = encode(raw_bpe, " ".join(CORPUS[:8]))
    assert len(ids) > 200
    prompt = encode(raw_bpe, "Once upon a time, in a small village,")
    detok = IncrementalDetokenizer(counting, prompt_token_ids=prompt)
    assert "".join(stream(detok, ids)) == decode(raw_bpe, prompt + ids)[len(decode(raw_bpe, prompt)) :]
    assert max(counting.sizes) <= INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 1
    assert len(counting.sizes) <= 2 * len(ids) + 2


# --- special tokens and the prompt as context -----------------------------------------------------


def test_skip_special_tokens_both_ways(byte_level):
    ids = encode(byte_level, "Hi<|im_end|> there<|im_start|>")
    assert len(ids) > 3 and any(decode(byte_level, [i], skip=False) == "<|im_end|>" for i in ids)
    assert "".join(stream(IncrementalDetokenizer(byte_level), ids)) == "Hi there"
    kept = IncrementalDetokenizer(byte_level, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "Hi<|im_end|> there<|im_start|>"
    # A special token between the bytes of one character neither breaks it nor shows up.
    rocket = encode(byte_level, "🚀")
    if len(rocket) > 1:
        end = encode(byte_level, "<|im_end|>")
        ids = rocket[:1] + end + rocket[1:]
        assert "".join(stream(IncrementalDetokenizer(byte_level), ids)) == "🚀"


def test_the_token_that_ends_the_output_adds_no_text(byte_level):
    """As vLLM: the EOS or stop token that ends the output is counted but not shown, even with special tokens kept;
    before min_tokens it is ordinary text (it cannot end the output there), and one that does not end it stays."""
    end = encode(byte_level, "<|im_end|>")
    assert len(end) == 1
    ids = encode(byte_level, "Hi there") + end
    for push_many in (False, True):
        detok = IncrementalDetokenizer(byte_level, skip_special_tokens=False, stop_token_ids=end)
        text = detok.push_many(ids) + detok.flush() if push_many else "".join(stream(detok, ids))
        assert text == detok.text == "Hi there" and detok.num_tokens == len(ids)
    early = IncrementalDetokenizer(byte_level, skip_special_tokens=False, stop_token_ids=end, min_tokens=len(ids) + 1)
    assert "".join(stream(early, ids)) == "Hi there<|im_end|>"
    assert "".join(stream(IncrementalDetokenizer(byte_level, skip_special_tokens=False), ids)) == "Hi there<|im_end|>"


def test_include_stop_str_in_output_shows_the_token_that_ends_the_output(byte_level):
    """As vLLM's detokenizer: with include_stop_str_in_output the EOS or stop token that ends the output is rendered
    like any other token (a special one only with skip_special_tokens off), streamed or decoded at once."""
    end = encode(byte_level, "<|im_end|>")
    dot = encode(byte_level, ".")
    assert len(end) == len(dot) == 1
    ids = encode(byte_level, "Hi there")
    for push_many in (False, True):
        for stop_ids, skip, want in ((dot, True, "Hi there."), (end, False, "Hi there<|im_end|>"), (end, True, "Hi there")):
            detok = IncrementalDetokenizer(byte_level, skip_special_tokens=skip, stop_token_ids=stop_ids,
                                           include_stop_str_in_output=True)  # fmt: skip
            text = detok.push_many(ids + stop_ids) + detok.flush() if push_many else "".join(stream(detok, ids + stop_ids))
            assert text == detok.text == want and detok.num_tokens == len(ids) + 1


def test_prompt_gives_the_first_token_its_leading_space():
    """SentencePiece strips the text's first space: alone, "▁sat" reads "sat"; after a prompt, " sat"."""
    tok = sentencepiece_like()
    ids = encode(tok, "The cat sat on the mat")
    prompt, output = ids[:2], ids[2:]
    assert decode(tok, prompt) == "The cat" and decode(tok, output[:1]) == "sat"
    assert "".join(stream(IncrementalDetokenizer(tok), output)) == "sat on the mat"
    seeded = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert seeded.push(output[0]) == " sat"
    assert "".join(stream(seeded, output[1:])) == " on the mat"
    assert seeded.text == " sat on the mat"


def test_prompt_context_matches_decoding_prompt_and_output_together(byte_level):
    rng = random.Random(4)
    for text in random_texts(30, seed=5):
        ids = encode(byte_level, text)
        split = rng.randint(0, len(ids))
        prompt, output = ids[:split], ids[split:]
        prompt_text = decode(byte_level, prompt)
        if prompt_text.endswith("\ufffd"):
            continue  # the prompt itself ends inside a character
        detok = IncrementalDetokenizer(byte_level, prompt_token_ids=prompt)
        assert "".join(stream(detok, output)) == decode(byte_level, ids)[len(prompt_text) :], text


def test_chat_prompt_then_answer(smollm2):
    from jaxpaged.utils.text import chat_prompt_ids

    prompt = chat_prompt_ids(smollm2, [{"role": "user", "content": "What is the capital of France?"}])
    answer = encode(smollm2, "Paris is the capital of France. 🇫🇷") + [smollm2.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(smollm2, prompt_token_ids=prompt)
    pieces = stream(detok, answer)
    assert "".join(pieces) == "Paris is the capital of France. 🇫🇷" and "\ufffd" not in "".join(pieces)


# --- stop strings ---------------------------------------------------------------------------------

SENTENCE = "The quick brown fox jumps over the lazy dog. Stop here: END of story, and more text after."


@pytest.mark.parametrize("include", [False, True])
def test_stop_inside_one_token(byte_level, include):
    ids = encode(byte_level, SENTENCE)
    for start, end in token_spans(byte_level, ids):
        inner = SENTENCE[start + 1 : end - 1].strip()
        if len(inner) >= 2 and SENTENCE.find(inner[:2]) > start:
            stop = inner[:2]
            break
    else:
        pytest.fail("precondition: no token of 4+ characters")
    detok = check_stop_stream(byte_level, ids, [stop], include)
    assert detok.stop_reason == stop


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("width", [2, 3])
def test_stop_spanning_tokens(byte_level, include, width):
    ids = encode(byte_level, SENTENCE)
    spans = token_spans(byte_level, ids)
    for k in range(len(spans) - width + 1):
        (s0, e0), (s1, e1) = spans[k], spans[k + width - 1]
        if e0 - s0 >= 2 and e1 - s1 >= 2:
            stop = SENTENCE[e0 - 1 : s1 + 1]  # last char of the first token .. first char of the last
            if SENTENCE.find(stop) == e0 - 1:
                break
    else:
        pytest.fail(f"precondition: no {width} tokens to span")
    detok = check_stop_stream(byte_level, ids, [stop], include)
    assert detok.text == (SENTENCE[: s1 + 1] if include else SENTENCE[: e0 - 1])


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_the_very_start(byte_level, include):
    ids = encode(byte_level, SENTENCE)
    detok = IncrementalDetokenizer(byte_level, stop=["The q"], include_stop_str_in_output=include)
    pieces = stream(detok, ids)
    assert "".join(pieces) == ("The q" if include else "") == detok.text
    assert detok.finished and detok.stop_reason == "The q"


def test_no_stop_string_before_min_tokens(byte_level):
    """As vLLM: a stop string completed by one of the first min_tokens tokens does not end the output."""
    ids = encode(byte_level, SENTENCE)
    through_dot = next(k for k in range(1, len(ids) + 1) if "." in byte_level.decode(ids[:k]))
    for min_tokens, want in ((0, ""), (1, SENTENCE[: SENTENCE.index(".")]), (through_dot, SENTENCE[: SENTENCE.index("END")])):
        detok = IncrementalDetokenizer(byte_level, stop=["The", ".", "END"], min_tokens=min_tokens)
        pieces = stream(detok, ids)
        assert detok.finished and detok.text == want == "".join(pieces), min_tokens


def test_earliest_stop_wins(byte_level):
    ids = encode(byte_level, SENTENCE)
    for stops in (["END", "lazy"], ["lazy", "END"], ["more", "END", "fox j"]):
        check_stop_stream(byte_level, ids, stops)
    detok = check_stop_stream(byte_level, ids, ["END", "ver the", "Stop"])
    assert detok.stop_reason == "ver the" and detok.text == "The quick brown fox jumps o"
    # Overlapping stops: the one completed first in the text wins, however tokens split it.
    detok = check_stop_stream(byte_level, ids, ["brown fox", "own"])
    assert detok.stop_reason == "own" and detok.text == "The quick br"


def test_stop_with_multibyte_text_and_special_tokens(byte_level):
    ids = encode(byte_level, "Answer: 日本語 🚀 done<|im_end|> after")
    check_stop_stream(byte_level, ids, ["本語 🚀"])
    check_stop_stream(byte_level, ids, ["🚀 d"], include=True)
    check_stop_stream(byte_level, ids, ["<|im_end|>"], skip=False)
    detok = check_stop_stream(byte_level, ids, ["<|im_end|>"], skip=True)
    assert not detok.finished  # skipped special tokens are not text, so they never match


def test_random_stops(byte_level):
    rng = random.Random(6)
    for text in random_texts(40, seed=7):
        ids = encode(byte_level, text)
        full = decode(byte_level, ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            if full and rng.random() < 0.8:
                i = rng.randrange(len(full))
                stops.append(full[i : i + rng.randint(1, 6)])
            else:
                stops.append(rng.choice(["never", "STOP!", "zz", "\n\n\n"]))
        check_stop_stream(byte_level, ids, stops, include=rng.random() < 0.5)


def push_segments(tok, detok: IncrementalDetokenizer, segments: list[str]) -> list[str]:
    """Pushes each segment's tokens; returns the text shown so far after each segment."""
    shown, after = "", []
    for segment in segments:
        shown += "".join(detok.push(i) for i in encode(tok, segment))
        after.append(shown)
    return after


def test_partial_stop_is_held_then_released(raw_bpe):
    detok = IncrementalDetokenizer(raw_bpe, stop=["STOP"])
    shown = push_segments(raw_bpe, detok, ["Hello", " wor", "ld ST", "OR", "Y S"])
    assert shown == ["Hello", "Hello wor", "Hello world ", "Hello world STOR", "Hello world STORY "]
    assert detok.text == "Hello world STORY S" and not detok.finished
    assert detok.flush() == "S" and detok.text == detok.output_text == "Hello world STORY S"
    assert detok.stop_reason is None


def test_partial_stop_completes(raw_bpe):
    detok = IncrementalDetokenizer(raw_bpe, stop=["STOP", "</answer>"])
    shown = push_segments(raw_bpe, detok, ["Hi </ans", "wer", "> ST", "OP and more"])
    assert shown == ["Hi ", "Hi ", "Hi ", "Hi "]
    assert detok.finished and detok.stop_reason == "</answer>" and detok.text == "Hi "
    assert detok.push(encode(raw_bpe, "x")[0]) == "" and detok.flush() == ""


def test_include_stop_holds_nothing(raw_bpe):
    detok = IncrementalDetokenizer(raw_bpe, stop=["STOP"], include_stop_str_in_output=True)
    shown = push_segments(raw_bpe, detok, ["Hello ST", "OP and more"])
    assert shown == ["Hello ST", "Hello STOP"] and detok.stop_reason == "STOP"


def test_errors(raw_bpe):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(raw_bpe, stop=["ok", ""])
    detok = IncrementalDetokenizer(raw_bpe, stop="x")
    assert detok.stop == ("x",)
    detok.flush()
    with pytest.raises(RuntimeError, match="after flush"):
        detok.push(0)
