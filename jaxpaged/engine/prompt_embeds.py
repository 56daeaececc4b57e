"""Prompts given as embeddings (vLLM's EmbedsPrompt, `enable_prompt_embeds`): `{"prompt_embeds": [T, hidden]}`.

The engine keeps such a prompt as T placeholder token ids (PLACEHOLDER_ID) beside its rows, so the scheduler, the
KV cache and preemption treat it as any prompt of T tokens; each step carries the rows of the prompt positions it
computes, which replace the table's embeddings there (worker/input_batch.py, CausalLM.forward). The placeholders
never leave the engine: a RequestOutput reports no prompt token ids, penalties count generated tokens only and
detokenizing starts fresh, as vLLM's.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io

import numpy as np

PLACEHOLDER_ID = 0  # the token id a prompt embedding's position holds for the scheduler (never embedded)
_FLOAT_NAMES = ("bfloat16", "float16", "float32", "float64")


@dataclasses.dataclass(eq=False)
class PromptEmbeds:
    """A request's prompt embeddings, in the model's dtype (shared by its sequences: n > 1, preemption's recompute)."""

    rows: np.ndarray  # [T, hidden]

    def __len__(self) -> int:
        return self.rows.shape[0]

    def block_salt(self, start: int, count: int) -> bytes:
        """What a KV block over positions [start, start + count) hashes beside its placeholder ids: the SHA-256 of its
        prompt rows' bytes. Prefix caching stays on for embeds prompts (vLLM hashes them too): an embeds block can
        then match only a block of the same vectors after the same prefix, never a token prompt's (whose blocks carry
        no salt), while two requests sending the same embeddings share their K/V."""
        stop = min(start + count, len(self))
        if start >= stop:
            return b""
        return b"emb:" + hashlib.sha256(self.rows[start:stop].tobytes()).digest()


def _as_numpy(value) -> np.ndarray:
    """numpy, a JAX array or a torch tensor (any float dtype: bfloat16 read through float32) as numpy."""
    module = type(value).__module__
    if module.startswith("torch"):
        value = value.detach().to("cpu")
        if value.is_floating_point():
            value = value.float()
        return value.numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prompt_embeds must be an array [T, hidden] (got {type(value).__name__})") from exc


def check_prompt_embeds(value, hidden_size: int, dtype, max_model_len: int | None = None) -> PromptEmbeds:
    """The prompt's rows in the model's `dtype`: [T, hidden] or a batch of one [1, T, hidden] (as vLLM squeezes it),
    a float dtype, finite, 1 <= T <= max_model_len (None: unchecked). Anything else is a ValueError naming
    prompt_embeds."""
    if isinstance(value, (str, bytes, list, tuple, dict)) or value is None:
        raise ValueError(f"prompt_embeds must be an array [T, hidden] (numpy, JAX or torch), got {type(value).__name__}")
    array = _as_numpy(value)
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2:
        raise ValueError(f"prompt_embeds must have shape [T, hidden] (or [1, T, hidden]); got {list(array.shape)}")
    if array.dtype.name not in _FLOAT_NAMES:
        raise ValueError(f"prompt_embeds must hold floats (got {array.dtype.name})")
    length, hidden = array.shape
    if hidden != hidden_size:
        raise ValueError(f"prompt_embeds has hidden size {hidden}; this model's is {hidden_size}")
    if length == 0:
        raise ValueError("prompt_embeds must not be empty (it has 0 rows)")
    if max_model_len is not None:
        _check_length(length, max_model_len)
    as_float = array.astype(np.float32)
    if not np.isfinite(as_float).all():
        raise ValueError("prompt_embeds holds non-finite values (NaN or infinity)")
    rows = np.ascontiguousarray(as_float.astype(np.dtype(dtype)))
    rows.flags.writeable = False
    return PromptEmbeds(rows)


def _check_length(length: int, max_model_len: int) -> None:
    if length > max_model_len:
        raise ValueError(f"prompt_embeds has {length} rows, more than max_model_len ({max_model_len}); "
                         "truncate_prompt_tokens=-1 keeps its last max_model_len")  # fmt: skip


def load_prompt_embeds(data: str):
    """The server's field: base64 of a torch.save'd tensor, read with torch.load(weights_only=True) as vLLM reads it
    (no pickled code runs) -> a CPU tensor. ValueError naming prompt_embeds when it cannot be read or torch is
    missing."""
    try:
        import torch
    except ImportError:
        raise ValueError("prompt_embeds needs torch installed on the server (it reads torch.save'd tensors)") from None
    if not isinstance(data, str):
        raise ValueError("prompt_embeds must be a base64 string (or a list of them)")
    try:
        raw = base64.b64decode(data, validate=True)
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"prompt_embeds is not valid base64: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever torch.load raises on bad bytes is the client's error
        raise ValueError(f"prompt_embeds could not be loaded as a torch.save'd tensor: {type(exc).__name__}: {exc}") from None
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"prompt_embeds must hold a tensor (got {type(tensor).__name__})")
    return tensor.to_dense() if tensor.is_sparse else tensor


def check_prompt_embeds_engine(loaded, pooling: bool) -> None:
    """enable_prompt_embeds on a model that cannot take them is refused at start-up, naming the flag."""
    model = type(loaded.model)
    if pooling:
        raise ValueError("enable_prompt_embeds: not supported with runner 'pooling' (generating models only)")
    if getattr(loaded.model, "vision_spec", None) is not None or not getattr(model, "takes_prompt_embeds", lambda: False)():
        raise ValueError(f"enable_prompt_embeds: {loaded.config.architecture} does not take prompt embeddings (only "
                         "models whose input is the token embedding alone do: Llama, Mistral, Qwen2/3, Phi-3, Mixtral, "
                         "GPT-J, GPT-NeoX and alike; not Gemma, GPT-2, OPT, BLOOM or vision-language models)")  # fmt: skip


def prompt_embeds_of(prompt, params, engine) -> PromptEmbeds | None:
    """A generate request's prompt embeddings, checked (and cut as truncate_prompt_tokens asks), or None for a prompt
    of another kind. ValueError naming prompt_embeds (or the option it conflicts with) for one that cannot run."""
    if not (isinstance(prompt, dict) and "prompt_embeds" in prompt):
        return None
    if not engine.config.enable_prompt_embeds:
        raise ValueError("prompt_embeds needs an engine started with enable_prompt_embeds=True (--enable-prompt-embeds)")
    for key in ("prompt_token_ids", "prompt", "multi_modal_data"):
        if prompt.get(key) is not None:
            raise ValueError(f"prompt_embeds cannot be combined with {key} in one prompt")
    if params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs is not supported with prompt_embeds (the prompt has no tokens to score)")
    if params.use_beam_search:
        raise ValueError("use_beam_search is not supported with prompt_embeds")
    embeds = check_prompt_embeds(prompt["prompt_embeds"], engine.loaded.config.hidden_size, engine.runner.dtype)
    keep = params.truncate_prompt_tokens
    if keep is not None:  # vLLM's: the last `keep` rows (-1: the last max_model_len)
        keep = engine.max_model_len if keep == -1 else keep
        if len(embeds) > keep:
            embeds = PromptEmbeds(embeds.rows[-keep:])
    _check_length(len(embeds), engine.max_model_len)
    return embeds
