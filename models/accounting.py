"""Every checkpoint tensor accounted for: read into a parameter, skipped for a stated reason, or an error.

A tensor nothing reads and no rule explains means the checkpoint and the port disagree (issue 49: an untied head the
loader never read gave plausible wrong tokens), as does a parameter the checkpoint lacks; both are one ValueError
naming the tensors. What a port knowingly does not run (a vision tower, a rotary cache) is skipped by its
`SKIPPED_TENSORS` rules and listed once, at INFO, with the reason.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger("jaxpaged.loader")

# (pattern searched in a checkpoint name, why it is not loaded): rules ports list in SKIPPED_TENSORS
ROTARY_CACHE = (r"(^|\.)rotary_emb\.inv_freq$", "the rotary cache: recomputed from the config")
CAUSAL_MASK = (r"(^|\.)(attn|attention)\.(masked_)?bias$", "causal-mask buffers: the attention masks itself")
SHOWN = 20  # names an error lists before "and N more"


def shown(names: list[str]) -> str:
    extra = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {extra} more" if extra > 0 else "")


def compact(names: Iterable[str]) -> str:
    """Names with their numbered parts folded, `layers.{0-26}.mlp.fc1.weight` for 27 names: names alike but for
    their numbers become one, each number's place showing the values it takes among them."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    for name in names:
        key = re.sub(r"(?<=\.)\d+(?=\.)", "#", name)
        groups.setdefault(key, []).append(tuple(int(n) for n in re.findall(r"(?<=\.)\d+(?=\.)", name)))
    parts = []
    for key, numbers in sorted(groups.items()):
        for position in range(key.count("#")):
            key = key.replace("#", _ranges(sorted({n[position] for n in numbers})), 1)
        parts.append(key)
    return ", ".join(parts)


def _ranges(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    runs, start = [], values[0]
    for prev, cur in zip(values, values[1:]):
        if cur != prev + 1:
            runs.append((start, prev))
            start = cur
    runs.append((start, values[-1]))
    return "{" + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "}"


class TensorLedger:
    """What a load did with each checkpoint tensor that no parameter took: skipped (by a rule, or told so by the
    loader: a tied head's copy, a format's activation scales) or unknown."""

    def __init__(self, rules: Iterable[tuple[str, str]] = ()):
        self.rules = [(re.compile(pattern), why) for pattern, why in rules]
        self.named: dict[str, str] = {}  # name -> why, for tensors the loader knows it will not read
        self.skipped: dict[str, list[str]] = {}  # reason -> names
        self.unknown: list[str] = []
        self.stand_ins: dict[str, list[str]] = {}  # a missing parameter's name -> the checkpoint tensors it lacks
        self.closed: dict[str, tuple[str, ...]] = {}  # what close() logged

    def explain(self, name: str, why: str) -> None:
        """`name`, should no parameter read it, is skipped for `why`."""
        self.named[name] = why

    def skip_unread(self, where: dict, rules: Iterable[tuple[str, str]]) -> dict:
        """`where` ({checkpoint name: file}) less the names a rule matches, each skipped for its reason without
        being read: what no parameter could take and would cost to read (a layer past the model's, its experts
        stacked on the host)."""
        rules = [(re.compile(pattern), why) for pattern, why in rules]
        if not rules:
            return where
        kept = {}
        for name, file in where.items():
            why = next((why for pattern, why in rules if pattern.search(name)), None)
            if why is None:
                kept[name] = file
            else:
                self.skip(name, why)
        return kept

    def missing_as(self, name: str, tensors: list[str]) -> None:
        """Should `name` (a parameter's spec, e.g. stacked experts) be missing, name `tensors` instead."""
        self.stand_ins[name] = tensors

    def skip(self, name: str, why: str) -> None:
        self.skipped.setdefault(why, []).append(name)

    def unused(self, name: str, source: str) -> None:
        why = self.named.get(name) or next((why for pattern, why in self.rules if pattern.search(name)), None)
        if why is None:
            self.unknown.append(f"{name} ({Path(source).name})")
        else:
            self.skip(name, why)

    def close(self, missing: Iterable[str], model: str) -> dict[str, tuple[str, ...]]:
        """Raise naming the unknown and missing tensors; else log each skip reason once -> {reason: names}."""
        missing = sorted(tensor for name in missing for tensor in self.stand_ins.get(name, [name]))
        problems = []
        if self.unknown:
            problems.append(f"{len(self.unknown)} tensor(s) that no parameter of the model reads and no rule explains: "
                            f"{shown(sorted(self.unknown))}")  # fmt: skip
        if missing:
            problems.append(f"{len(missing)} tensor(s) the model needs are missing: {shown(missing)}")
        if problems:
            raise ValueError(f"the checkpoint does not fit the {model} port: {'; '.join(problems)}")
        for why, names in self.skipped.items():
            logger.info("not loaded, %s: %d tensor(s) %s", why, len(names), compact(names))
        self.closed = {why: tuple(names) for why, names in self.skipped.items()}
        return self.closed
