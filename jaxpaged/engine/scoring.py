"""Per-token logprobs of given completions (issue 47), as an RL trainer's `get_per_token_logps` wants them: each
prompt + completion is one request asking for its prompt logprobs (and one sampled token, dropped), so the scoring
runs through the engine's own compiled steps, batched as any requests are (on a GPU through the separate `prompt`
executable: no conditional in the step), chunked where long, and in batch-invariant mode independent of what else
is in the batch.

Padded arrays are read as Tunix's `compute_per_token_logps` reads them: pad tokens, wherever they are, are not part
of the text (positions count the others only); a trailing pad position of a completion gets the logprob of the pad
token after all the text, as Tunix computes it there (the first trailing EOS of a row whose pad id is its EOS id is
such a position, and counts in the loss); a pad between tokens gets 0. Returns float32 [B, C] on the host.
"""

from __future__ import annotations

import numpy as np

from jaxpaged.sampling_params import SamplingParams

# one sampled token is the engine's least; greedy, so it costs no sampling work
SCORING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)


def _rows(tokens, name: str) -> list[list[int]]:
    if hasattr(tokens, "ndim"):
        array = np.asarray(tokens)
        if array.ndim != 2:
            raise ValueError(f"{name} must be a [batch, length] array or a list of token lists (got shape {array.shape})")
        return [[int(t) for t in row] for row in array]
    rows = [list(map(int, row)) for row in tokens]
    return rows


def scoring_requests(prompt_tokens, completion_tokens, pad_id: int | None = None) -> tuple[list[list[int]], list[int], int, list[list[int]]]:
    """-> (each row's token ids to score, where its completion starts, the width C of the result, the completion
    positions each scored token fills). Without pad_id the rows are taken as they are (lists of any lengths)."""
    prompts, completions = _rows(prompt_tokens, "prompt_tokens"), _rows(completion_tokens, "completion_tokens")
    if len(prompts) != len(completions):
        raise ValueError(f"prompt_tokens has {len(prompts)} rows and completion_tokens {len(completions)}")
    width = max((len(c) for c in completions), default=0)
    sequences, starts, slots = [], [], []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        text = [t for t in prompt if t != pad_id] if pad_id is not None else prompt
        if not text:
            raise ValueError(f"prompt_tokens row {i} holds no token but padding: a completion needs a prompt to follow")
        seq, filled, pad_at = list(text), [], []
        for j, token in enumerate(completion):
            if pad_id is not None and token == pad_id:
                pad_at.append(j)  # the pad after everything before it: scored at the end, once
            else:
                seq.append(token)
                filled.append([j])
        if pad_at:
            # pads between tokens see the text before them: only trailing ones share the end's context
            trailing = [j for j in pad_at if j > (max((f[0] for f in filled), default=-1))]
            seq.append(pad_id)
            filled.append(trailing)
        sequences.append(seq)
        starts.append(len(text))
        slots.append(filled)
    return sequences, starts, width, slots


def logps_from_outputs(outputs, starts: list[int], width: int, slots: list[list[list[int]]]) -> np.ndarray:
    """[B, C] float32: each scored token's prompt logprob at the completion positions it fills, 0 elsewhere."""
    out = np.zeros((len(outputs), width), np.float32)
    for b, (request, start, filled) in enumerate(zip(outputs, starts, slots)):
        entries = request.prompt_logprobs  # [None, position 1, ...]: the logprob of token p given tokens < p
        ids = request.prompt_token_ids
        for k, positions in enumerate(filled):
            entry = entries[start + k]
            value = entry[ids[start + k]].logprob
            for j in positions:
                out[b, j] = value
    return out


def per_token_logps(generate, prompt_tokens, completion_tokens, pad_id: int | None = None, **kwargs) -> np.ndarray:
    """generate(prompts, params, **kwargs) -> outputs in order (LLM.generate): every row scored in one batch."""
    sequences, starts, width, slots = scoring_requests(prompt_tokens, completion_tokens, pad_id)
    outputs = generate([{"prompt_token_ids": s} for s in sequences], SCORING_PARAMS, **kwargs)
    return logps_from_outputs(outputs, starts, width, slots)

