"""A checkpoint's tiktoken tokenizer shipped as remote code (Kimi K2, Moonlight: `tiktoken.model` and a
`TikTokenTokenizer` in `tokenization_kimi.py` / `tokenization_moonshot.py`) as a transformers fast tokenizer, built
without running the checkpoint's code.

The BPE ranks come from `tiktoken.model` (tiktoken's format: `base64-token rank` a line), read here, so the `tiktoken`
package is not needed; transformers' `TikTokenConverter` turns them into a byte-level BPE with the checkpoint's
pre-tokenizer pattern. That pattern (`pat_str`) and `num_reserved_special_tokens` are read from the tokenizer's
Python file as a syntax tree (ast: string literals and a `"|".join([...])` of them), never imported or executed; where
the file is missing or says something else, Kimi's published pattern is used (a warning says so). The special tokens
follow the remote class: every id from the end of the base vocabulary through its reserved range is a special token,
named by tokenizer_config.json's `added_tokens_decoder` or `<|reserved_token_{id}|>`; bos/eos/unk/pad and the chat
template (chat_template.jinja over tokenizer_config.json's) come from the folder's files.
"""

from __future__ import annotations

import ast
import base64
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger("jaxpaged.tokenizer")

VOCAB_FILE = "tiktoken.model"
# Kimi K2's and Moonlight's pat_str (tokenization_kimi.py, tokenization_moonshot.py): Han runs apart, letters with
# an optional contraction, digits in threes, punctuation, whitespace
KIMI_PATTERN = "|".join(  # noqa: FLY002 - the file's own spelling, one alternative a line
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)  # fmt: skip
KIMI_RESERVED = 256  # the remote class's num_reserved_special_tokens; its special ids run 2 past them
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def remote_tiktoken_class(folder: Path) -> str | None:
    """The "module.Class" of the remote-code tiktoken tokenizer `folder`'s tokenizer_config.json maps AutoTokenizer to,
    where the folder holds tiktoken.model and no tokenizer.json; else None."""
    if not (folder / VOCAB_FILE).exists() or (folder / "tokenizer.json").exists():
        return None
    config = _tokenizer_config(folder)
    ref = (config.get("auto_map") or {}).get("AutoTokenizer")
    ref = next((r for r in ref if r), None) if isinstance(ref, (list, tuple)) else ref
    if not isinstance(ref, str) or "tiktoken" not in ref.lower():
        return None
    return ref.split("--")[-1]  # "other/repo--module.Class": the module is that repo's


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"could not read {path}: {exc}") from exc


def read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's file format: one `base64(token bytes) rank` a line (tiktoken.load.load_tiktoken_bpe's reading)."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as exc:
            raise ValueError(f"could not read {path}, line {number}: {exc}") from exc
    return ranks


def _literal_string(node: ast.AST) -> str | None:
    """A string constant, or `"sep".join([constants...])`, evaluated from the tree; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))):  # fmt: skip
        parts = [_literal_string(e) for e in node.args[0].elts]
        if all(isinstance(p, str) for p in parts):
            return node.func.value.value.join(parts)
    return None


def class_constants(source: str, class_name: str | None) -> dict:
    """`pat_str` and `num_reserved_special_tokens` as the class body (or the module) assigns them, read from the
    source's syntax tree; nothing in it runs."""
    tree = ast.parse(source)
    bodies = [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name] + [tree.body]
    found = {}
    for body in bodies:
        for stmt in body:
            target, value = None, None
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                target, value = stmt.targets[0].id, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                target, value = stmt.target.id, stmt.value
            if target == "pat_str" and "pat_str" not in found and (text := _literal_string(value)) is not None:
                found["pat_str"] = text
            elif (target == "num_reserved_special_tokens" and target not in found and isinstance(value, ast.Constant)
                  and type(value.value) is int):  # fmt: skip
                found[target] = value.value
    return found


def _remote_constants(folder: Path, ref: str) -> dict:
    module, _, class_name = ref.rpartition(".")
    path = folder / f"{module.replace('.', '/')}.py"
    try:
        found = class_constants(path.read_text(encoding="utf-8"), class_name)
    except (OSError, SyntaxError, ValueError) as exc:
        logger.warning("could not read %s (%s): using Kimi's pre-tokenizer pattern", path, exc)
        return {}
    if "pat_str" not in found:
        logger.warning("%s assigns no literal pat_str: using Kimi's pre-tokenizer pattern", path)
    return found


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def load_tiktoken_folder(folder: Path, ref: str):
    """A transformers fast tokenizer equal to `ref`'s remote-code tiktoken tokenizer on `folder`'s files."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    t0 = time.perf_counter()
    config = _tokenizer_config(folder)
    constants = _remote_constants(folder, ref)
    pattern = constants.get("pat_str", KIMI_PATTERN)
    ranks = read_bpe_ranks(folder / VOCAB_FILE)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{folder / VOCAB_FILE}: the ranks are not 0..{len(ranks) - 1}, each once")

    class _Converter(TikTokenConverter):  # the ranks read above, not through the tiktoken package
        @staticmethod
        def load_tiktoken_bpe(_):
            return ranks

    backend = _Converter(vocab_file=str(folder / VOCAB_FILE), pattern=pattern).converted()
    # the special ids, as the remote class builds them: the base vocabulary's end through its reserved range (and
    # any later id added_tokens_decoder names), each named by added_tokens_decoder or a reserved name
    added = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
    base = len(ranks)
    if any(i < base for i in added):
        raise ValueError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder names ids inside the BPE vocabulary "
                         f"(< {base})")  # fmt: skip
    end = max([base + constants.get("num_reserved_special_tokens", KIMI_RESERVED) + 2, *(i + 1 for i in added)])
    specials = []
    for i in range(base, end):
        t = added.get(i, {"content": f"<|reserved_token_{i}|>"})
        t = t if isinstance(t, dict) else {"content": str(t)}
        specials.append(AddedToken(t["content"], single_word=t.get("single_word", False), lstrip=t.get("lstrip", False),
                                   rstrip=t.get("rstrip", False), normalized=False, special=t.get("special", True)))  # fmt: skip
    backend.add_special_tokens(specials)
    for i, t in enumerate(specials, base):
        if backend.token_to_id(t.content) != i:
            raise ValueError(f"{folder}: special token {t.content!r} should be id {i} (a name given twice?)")
    kwargs = {k: _content(config[k]) for k in SPECIAL_KEYS if _content(config.get(k))}
    for key, name in kwargs.items():
        if backend.token_to_id(name) is None:
            raise ValueError(f"{folder / 'tokenizer_config.json'}: its {key} {name!r} is not a token of {VOCAB_FILE} "
                             "or added_tokens_decoder")  # fmt: skip
    template_file = folder / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.exists() else config.get("chat_template")
    if template:
        kwargs["chat_template"] = template
    if isinstance(config.get("model_max_length"), int):
        kwargs["model_max_length"] = config["model_max_length"]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **kwargs)
    tokenizer.name_or_path = str(folder)
    logger.info("tokenizer: %s's %s (%d BPE ranks, %d special tokens) read without its code (%s), in %.1fs", folder.name,
                VOCAB_FILE, base, len(specials), ref, time.perf_counter() - t0)  # fmt: skip
    return tokenizer
