"""Hugging Face Hub model ids: resolved through huggingface_hub's cache, offline, as on a machine with no network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jaxpaged.models import hub

from tests import REPO
from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

PROMPT = [5, 9, 14, 3, 77, 21]
ENGINE = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=16, block_size=8,
              dtype="float32", precompile=False)
REVISIONS = {"main": "a" * 40, "v2": "b" * 40}


def _hub_cache(root: Path, folders: dict[str, Path]) -> Path:
    """huggingface_hub's layout: models--org--tiny/{refs/<name>, snapshots/<commit>/...}, one ref per revision."""
    repo = root / "models--org--tiny"
    for ref, folder in folders.items():
        commit = REVISIONS[ref]
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        shutil.copytree(folder, repo / "snapshots" / commit)
    return root


@pytest.fixture(scope="module")
def two_revisions(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    config = tiny_llama_config(num_key_value_heads=2)
    folders = {ref: save_hf_model(random_hf_model(config, seed=i), base / ref) for i, ref in enumerate(REVISIONS)}
    return folders, _hub_cache(base / "cache", folders)


def _greedy(model: str, revision: str | None = None) -> list[int]:
    from jaxpaged import LLM, SamplingParams

    llm = LLM(model, revision=revision, log_level="WARNING", **ENGINE)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)


OFFLINE_SCRIPT = """
import json
from tests.models.test_hub import _greedy
out = {"main": _greedy("org/tiny"), "v2": _greedy("org/tiny", revision="v2")}
for name, rev in (("org/absent", None), ("org/tiny", "v3")):
    try:
        _greedy(name, rev)
        out[name + (rev or "")] = "loaded"
    except (FileNotFoundError, ValueError) as exc:
        out[name + (rev or "")] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(out))
"""


def test_hub_ids_load_offline_from_the_cache_and_match_the_local_folders(two_revisions, tmp_path):
    folders, cache = two_revisions
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", JAXPAGED_CACHE_DIR=str(tmp_path / "jp"),
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert got["main"] == _greedy(str(folders["main"]))
    assert got["v2"] == _greedy(str(folders["v2"]))
    assert got["main"] != got["v2"]  # the revision really chose the other weights
    absent = got["org/absent"]
    assert absent.startswith("FileNotFoundError") and "'org/absent'" in absent
    assert "not in the Hugging Face cache" in absent and "HF_HUB_OFFLINE" in absent and "hf download org/absent" in absent
    assert got["org/tinyv3"].startswith("FileNotFoundError") and "revision 'v3'" in got["org/tinyv3"]


def test_an_id_is_fetched_with_safetensors_only(two_revisions, monkeypatch):
    """Online, the id and revision go to snapshot_download, whose patterns admit no pickle checkpoint."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    folders, _ = two_revisions
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(folders["v2"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert _greedy("org/tiny", revision="v2") == _greedy(str(folders["v2"]))
    (repo_id, kwargs), = calls
    assert repo_id == "org/tiny" and kwargs["revision"] == "v2"
    files = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors",
             "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
             "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja",
             "pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "model.pt", "consolidated.pth", "flax_model.msgpack",
             "model.ckpt", "tf_model.h5", "model.gguf", "onnx/model.onnx"]
    fetched = set(filter_repo_objects(files, allow_patterns=kwargs["allow_patterns"]))
    assert fetched == {f for f in files if f.endswith((".json", ".safetensors", ".model", ".txt", ".jinja"))}


def test_what_counts_as_a_hub_id(tmp_path):
    (tmp_path / "org").mkdir()
    assert hub.is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and hub.is_hub_id("gpt2")
    for local in (str(tmp_path / "org"), "./model", "~/model", "/abs/path", "model.gguf", "dir/config.json", "a/b/c"):
        assert not hub.is_hub_id(local), local


def test_a_revision_with_a_local_path_is_refused(two_revisions):
    from jaxpaged.models.loader import load_model

    folders, _ = two_revisions
    with pytest.raises(ValueError, match="revision"):
        load_model(str(folders["main"]), revision="v2")
