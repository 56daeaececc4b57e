"""The docs stay true: configuration.md documents every option the code has (and none it lacks), and every
relative link in README.md and docs/*.md points at a file (and, for markdown, a heading) that exists.

Options are read from the code itself: the fields of EngineConfig, SamplingParams and BeamSearchParams,
LLM's constructor, and every long option string of the two CLIs' argparse parsers.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from jaxpaged.config import EngineConfig
from jaxpaged.engine.beam_search import BeamSearchParams
from jaxpaged.entrypoints.generate import build_parser as generate_parser
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.entrypoints.serve import build_parser as serve_parser
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from tests import REPO as ROOT

CONFIG_DOC = ROOT / "docs" / "configuration.md"


DATACLASS_SECTIONS = {
    "## EngineConfig": EngineConfig,
    "## SamplingParams": SamplingParams,
    "## BeamSearchParams": BeamSearchParams,
    "## StructuredOutputsParams": StructuredOutputsParams,
}
CLI_SECTIONS = {
    "## python -m jaxpaged.generate": generate_parser,
    "## python -m jaxpaged.serve": serve_parser,
}
LLM_SECTION = "## LLM(...)"


def _doc() -> str:
    return CONFIG_DOC.read_text(encoding="utf-8")


def _section(heading: str) -> str:
    """The text under `heading` (a whole line of configuration.md), up to the next heading of level 1 or 2."""
    lines = _doc().splitlines()
    assert heading in lines, f"docs/configuration.md has no heading {heading!r}"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(r"#{1,2} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def _rows(section: str) -> list[list[str]]:
    """The body rows of every table in the section, as lists of cells (header and separator rows dropped)."""
    lines = section.splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            continue  # separator
        if i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            continue  # header
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _documented(section: str) -> dict[str, str]:
    """name in a row's first cell -> the whole row, for every backticked name there."""
    return {name: " | ".join(row) for row in _rows(section) for name in _backticked(row[0])}


def _literal(value, cli: bool = False) -> str | None:
    """How a default is written in the tables, or None when it is described in words instead."""
    if value is None or value is dataclasses.MISSING or isinstance(value, bool) and cli:
        return None
    if isinstance(value, str):
        return value if cli else f'"{value}"'
    return repr(value)


def _long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: action for action in parser._actions for opt in action.option_strings if opt.startswith("--")}


def test_configuration_doc_names_every_option_in_code():
    """The requirement as stated: each field and flag, backticked as in code, appears in configuration.md."""
    doc = _doc()
    names = [f.name for cls in DATACLASS_SECTIONS.values() for f in dataclasses.fields(cls)]
    names += [p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "kwargs")]
    flags = [opt for build in CLI_SECTIONS.values() for opt in _long_options(build())]
    missing = [f"`{n}`" for n in names + flags if f"`{n}`" not in doc]
    assert not missing, f"docs/configuration.md does not mention {', '.join(missing)}"


@pytest.mark.parametrize("heading", list(DATACLASS_SECTIONS))
def test_dataclass_tables_match_the_fields(heading):
    cls = DATACLASS_SECTIONS[heading]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    documented = _documented(_section(heading))
    missing = sorted(set(fields) - set(documented))
    assert not missing, f"{heading}: fields without a row: {missing}"
    unknown = sorted(set(documented) - set(fields))
    assert not unknown, f"{heading}: rows for fields {cls.__name__} does not have: {unknown}"
    for name, field in fields.items():
        literal = _literal(field.default)
        if literal is not None:
            assert f"`{literal}`" in documented[name], f"{heading}: {name}'s row should give its default `{literal}`"


def test_llm_table_matches_the_constructor():
    params = {name: p for name, p in inspect.signature(LLM.__init__).parameters.items() if name != "self"}
    documented = _documented(_section(LLM_SECTION))
    expected = {("**kwargs" if p.kind is p.VAR_KEYWORD else name) for name, p in params.items()} | {"log_level"}
    missing = sorted(expected - set(documented))
    assert not missing, f"LLM(...): arguments without a row: {missing}"
    unknown = sorted(set(documented) - expected)
    assert not unknown, f"LLM(...): rows for arguments LLM does not take: {unknown}"
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    for name, p in params.items():
        if p.kind is p.VAR_KEYWORD:
            continue
        assert name in fields, f"LLM's {name} is not an EngineConfig field"
        literal = _literal(p.default)
        if literal is not None:
            assert f"`{literal}`" in documented[name], f"LLM(...): {name}'s row should give its default `{literal}`"
    # **kwargs is documented as taking every EngineConfig field LLM does not name
    kwargs_row = documented["**kwargs"]
    for name in sorted(fields - set(params)):
        assert f"`{name}`" in kwargs_row, f"LLM(...): the **kwargs row should list `{name}`"


@pytest.mark.parametrize("heading", list(CLI_SECTIONS))
def test_cli_tables_match_the_parsers(heading):
    options = _long_options(CLI_SECTIONS[heading]())
    documented = {name: row for name, row in _documented(_section(heading)).items() if name.startswith("--")}
    missing = sorted(set(options) - set(documented))
    assert not missing, f"{heading}: flags without a row: {missing}"
    unknown = sorted(set(documented) - set(options))
    assert not unknown, f"{heading}: rows for flags the parser does not have: {unknown}"
    for flag, action in options.items():
        if flag == "--api-key":
            continue  # its default is read from $JAXPAGED_API_KEY
        literal = _literal(action.default, cli=True)
        if literal is not None and action.default is not argparse.SUPPRESS:
            assert f"`{literal}`" in documented[flag], f"{heading}: {flag}'s row should give its default `{literal}`"


# -- links -------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _without_fences(text: str) -> str:
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)


def _prose(text: str) -> str:
    """Markdown without fenced code blocks and inline code, where a link is only text."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    for line in _without_fences(path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files(path):
    broken = []
    for target in LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{path.relative_to(ROOT)} has broken links: {', '.join(broken)}"
