"""A chat template given by the user (vLLM's --chat-template): a file's contents, or the Jinja text itself.

Resolved as vLLM resolves it, so vLLM command lines mean the same here: a file that opens is read; otherwise a value
holding Jinja's characters ({, } or a newline) is the template; anything else is a path that failed to open, which
is an error naming the flag rather than a template of one word.
"""

from __future__ import annotations

JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None, flag: str = "--chat-template") -> str | None:
    """The template's text (None: none given); ValueError naming `flag` for an unreadable path or an empty value."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{flag} must be a file path or a Jinja template (got {value!r})")
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the value, never a path
        if not any(c in value for c in JINJA_CHARS):
            reason = getattr(exc, "strerror", None) or exc
            raise ValueError(f"{flag} {value!r} looks like a file path, but it could not be opened ({reason}); "
                             "give a readable file or the template's Jinja text") from None  # fmt: skip
        return value
    if not text.strip():
        raise ValueError(f"{flag} {value!r}: the file is empty")
    return text
