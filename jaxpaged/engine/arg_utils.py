"""The model and engine flags both CLIs take (generate and serve), derived from EngineConfig's fields so the flags,
`LLM(**kwargs)` and the config cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from jaxpaged.config import EngineConfig


def cli_fields() -> list[dataclasses.Field]:
    """The EngineConfig fields that are flags: those declared with `option(...)`."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("help")]


# vLLM's short spellings of these flags
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
               "quantization": "-q"}  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser, precompile: bool = True) -> None:
    """`precompile` is this CLI's default: the server compiles every bucket at start-up, generate on first use."""
    groups: dict[str, Any] = {}
    for f in cli_fields():
        if f.metadata["group"] not in groups:
            groups[f.metadata["group"]] = p.add_argument_group(f.metadata["group"])
        group = groups[f.metadata["group"]]
        flag, default = "--" + f.name.replace("_", "-"), precompile if f.name == "precompile" else f.default
        kwargs: dict[str, Any] = {"default": default, "help": f.metadata["help"], "dest": f.name}
        kind = str(f.type)
        if kind in ("bool", "bool | None"):  # None: left to the platform
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = int if kind.startswith("int") else float if kind.startswith("float") else str
        if f.metadata["choices"]:
            kwargs["choices"] = list(f.metadata["choices"])
        group.add_argument(flag, *([SHORT_FLAGS[f.name]] if f.name in SHORT_FLAGS else []), **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's (and LLM's) keyword arguments from the flags above."""
    return {f.name: getattr(args, f.name) for f in cli_fields()}
