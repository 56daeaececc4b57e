"""notebooks/quickstart.ipynb, executed top to bottom in a real python3 kernel on CPU with the built-in model.

The notebook starts a server and a benchmark, so this takes a few minutes; it runs once per module and
every test below reads the executed cells' outputs.
"""

from __future__ import annotations

import ast
import base64
import os
import re
import time

import pytest
from jaxpaged.models.builtin import builtin_gguf_path

from tests import REPO

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"

try:
    builtin_gguf_path()
except FileNotFoundError as exc:
    pytest.skip(f"the notebook runs the built-in model: {exc}", allow_module_level=True)


@pytest.fixture(scope="module")
def executed():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:
        # the kernel (and the server it starts) import this checkout, on the CPU, whatever else is installed
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        mp.setenv("JAX_PLATFORMS", "cpu")
        client = NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(REPO)}})
        t0 = time.monotonic()
        client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
        print(f"notebook executed in {time.monotonic() - t0:.0f}s")
    return nb


def cell(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def stdout(nb, tag: str) -> str:
    return "".join(o.get("text", "") for o in cell(nb, tag).outputs if o.output_type == "stream" and o.name == "stdout")


def quoted_after(text: str, label: str) -> list[str]:
    """The Python string literals printed after `label` (the notebook prints generated text with !r)."""
    values = [ast.literal_eval(m) for m in re.findall(rf"{re.escape(label)}(\'.*\'|\".*\")$", text, re.MULTILINE)]
    assert values, f"no {label!r} line in:\n{text}"
    return values


def test_every_cell_ran_without_error(executed):
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert "Colab: False" in stdout(executed, "setup")


def test_offline_generate_and_chat(executed):
    generated = quoted_after(stdout(executed, "generate"), " -> ")
    assert len(generated) == 3 and all(text.strip() for text in generated)
    assert "Paris" in generated[0]  # greedy SmolLM2-135M-Instruct on "The capital of France is"
    for i in range(2):  # n=2 sampled choices
        assert quoted_after(stdout(executed, "generate"), f"sample {i}: ")[0].strip()
    chat = stdout(executed, "chat")
    assert quoted_after(chat, "chat -> ")[0].strip()
    assert re.search(r"num_compiles_after_warmup: 0$", chat, re.MULTILINE)  # get_stats() printed, nothing recompiled


def test_structured_outputs_parse(executed):
    import json

    out = stdout(executed, "structured")
    value = json.loads(quoted_after(out, "structured -> ")[0])
    assert set(value) == {"city", "country"} and all(isinstance(v, str) for v in value.values())
    assert quoted_after(out, "choice -> ")[0] in ("yes", "no")
    assert re.search(r"parsed -> Capital\(city='[^']*', country='[^']*'\)", stdout(executed, "openai-structured"))


def test_server_answered_the_openai_client(executed):
    assert re.search(r"server pid \d+ healthy on http://127\.0\.0\.1:\d+", stdout(executed, "server"))
    assert "Paris" in quoted_after(stdout(executed, "openai-chat"), "chat completion -> ")[0]
    streamed = stdout(executed, "openai-stream")
    assert int(re.search(r"streamed (\d+) chunks", streamed).group(1)) > 1
    assert quoted_after(streamed, "chunks -> ")[0].strip()
    assert quoted_after(stdout(executed, "openai-completion"), "completion -> ")[0].strip()


def test_benchmark_ran_and_plots_shown(executed):
    points = re.findall(r"concurrency\s+(\d+):\s+([\d.]+) output tok/s", stdout(executed, "plot"))
    assert [int(c) for c, _ in points] == [1, 2, 4, 8] and all(float(v) > 0 for _, v in points)
    images = [
        o.data["image/png"]
        for o in cell(executed, "plot").outputs
        if o.output_type == "display_data" and "image/png" in o.data
    ]
    assert len(images) == 2
    for image in images:
        data = base64.b64decode(image)
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_server_stopped(executed):
    assert "server stopped, exit code" in stdout(executed, "stop")
    pid = int(re.search(r"server pid (\d+)", stdout(executed, "server")).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone, not left running after the notebook


def test_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
