"""The order test files go to xdist's workers in: the longest first, so the run does not end with one worker on a
long file while the other idles (xdist's own reorder, by test count, sent the one-test GRPO notebook last).

Durations come from file_durations.txt (seconds per file from one full run; files not in it go after those in it, in
collection order). Regenerate it after a run with `--junitxml`: `python -m tests.scheduling run.xml`.
"""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

TABLE = Path(__file__).with_name("file_durations.txt")


@functools.cache
def file_seconds() -> dict[str, float]:
    """{path relative to the repository: seconds}; empty without the table."""
    if not TABLE.exists():
        return {}
    out = {}
    for line in TABLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, path = line.split()
            out[path] = float(seconds)
    return out


def longest_files_first(items: list) -> None:
    """Reorders pytest's items in place: files by their recorded seconds, longest first; a file's tests keep
    their order. Stable, so every worker collects the same order, as xdist requires."""
    seconds = file_seconds()
    rank = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        rank.setdefault(path, (-seconds.get(path, 0.0), len(rank)))
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


def write_table(junit_xml: str) -> None:
    """file_durations.txt from a JUnit XML report of a full run."""
    import xml.etree.ElementTree as ET

    per_file: collections.Counter = collections.Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        per_file[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time", 0))
    lines = [f"{seconds:.0f} {path}" for path, seconds in per_file.most_common() if seconds >= 1]
    TABLE.write_text("# seconds per test file in one full run (tests/scheduling.py orders files by it)\n"
                     + "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    write_table(sys.argv[1])
