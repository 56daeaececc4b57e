"""Hugging Face Hub model ids ("org/name") -> a local snapshot folder, through huggingface_hub.

huggingface_hub owns the cache layout (`HF_HOME`, `HF_HUB_CACHE`), `HF_HUB_OFFLINE`, revisions and tokens;
we ask it for configs, tokenizer files and safetensors only, so no pickle checkpoint is ever fetched.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("jaxpaged.hub")

# tiktoken.model and tokenization_*.py: a remote-code tiktoken tokenizer's vocabulary and the file its pre-tokenizer
# pattern is read from as text (models/tiktoken_folder.py; never imported nor run)
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "tiktoken.model", "tokenization_*.py", "*.tiktoken", "*.txt",
             "*.jinja"]  # fmt: skip
LOCAL_SUFFIXES = (".gguf", ".json")  # names of local files, never repo ids


def is_hub_id(name: str) -> bool:
    """True for a string that can only mean a hub repo: no such local path, and a valid repo id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(name).expanduser().exists() or name.endswith(LOCAL_SUFFIXES) or name.startswith((".", "~", "/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot_folder(repo_id: str, revision: str | None = None) -> str:
    """The local folder of `repo_id` at `revision`, downloading what is missing unless the hub is offline."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES)
    except RevisionNotFoundError:
        raise ValueError(f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub") from None
    except GatedRepoError:
        raise ValueError(
            f"model {repo_id!r} is gated: accept its terms on huggingface.co and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local path nor a repository on the Hugging Face Hub "
            "(for a private one, log in with `hf auth login` or set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise FileNotFoundError(
            f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}. "
            f"Download it where there is a network (`hf download {repo_id}`) into that cache, or point "
            "HF_HUB_CACHE at a cache that has it, or pass a local folder"
        ) from None
    logger.info("model %s: %s", where, folder)
    return folder
