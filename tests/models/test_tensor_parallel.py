"""Tensor parallelism on 4 CPU devices: TP=2 and TP=4 give TP=1's greedy tokens (and transformers'),
each device holds 1/N of every sharded weight and of the KV array, and bad sizes are clear errors. Each family and
quantized case runs at one of the two sizes (the other size is covered by another family or case); TP=4 over 2 KV
heads (each KV head replicated on two devices) is covered by llama-gqa2, the int8 cache and the Q4_0 weights.

The device count must be fixed before JAX starts, and the rest of the suite runs on one device, so
in a normal run the first test re-runs this file in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4; the others run only there (or when you run the
file yourself with that flag).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.multi_device import DEVICES, needs_devices, reference_family, rerun_with_devices


def test_tp_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


def test_cli_has_the_flag():
    from jaxpaged.entrypoints.generate import build_parser

    assert build_parser().parse_args(["--tensor-parallel-size", "2", "hi"]).tensor_parallel_size == 2


# -- below: only with 4 devices ------------------------------------------------------------------

VOCAB = 256
PROMPT_LENGTHS = [3, 11, 29, 40]
MAX_TOKENS = 24


def _llm(folder, n, backend="reference", **kw):
    from jaxpaged import LLM

    return LLM(
        str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8,
        tensor_parallel_size=n, attention_backend=backend, log_level="WARNING", **kw,
    )  # fmt: skip


def _greedy(llm, prompts):
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _families():
    import transformers

    from tests.hf_reference import tiny_llama_config

    return {
        # GQA with 2 KV heads: TP=4 replicates each KV head on two devices
        "llama-gqa2": tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
        # multi-query (one KV head), fused QKV split at load time, parallel attention/MLP
        "falcon-mqa": transformers.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
            new_decoder_architecture=False, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
        ),
        # ALiBi: each device's heads keep their own slopes
        "bloom-alibi": transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=0),
        # windowed and global layers: KV cache groups, each group's tables under shard_map
        "qwen2-hybrid-window": transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, sliding_window=8, use_sliding_window=True,
            max_window_layers=0, layer_types=["sliding_attention", "full_attention"] * 2, bos_token_id=0, eos_token_id=1,
        ),
    }  # fmt: skip


_PREPARED: dict = {}


def _prepare(name, tmp_path_factory):
    """(checkpoint folder, prompts, transformers' greedy tokens), once per family."""
    return reference_family(_PREPARED, name, _families()[name], tmp_path_factory, PROMPT_LENGTHS, MAX_TOKENS, VOCAB)


# one size per family: llama-gqa2 at 4 (2 KV heads replicated to 4; at 2 in the fused_kv_write and 8-bit tests),
# falcon-mqa at 2 (its one KV head replicated; at 4 in test_fused_projections_tp.py), bloom-alibi at 4 (one head and
# its slope a device; at 2 with the Pallas kernel below), qwen2-hybrid-window at 2 (KV cache groups under shard_map)
FAMILY_SIZES = [("llama-gqa2", 4), ("falcon-mqa", 2), ("bloom-alibi", 4), ("qwen2-hybrid-window", 2)]


@needs_devices
@pytest.mark.parametrize("name,n", FAMILY_SIZES)
def test_tp2_and_tp4_equal_tp1_token_for_token(name, n, tmp_path_factory):
    """Equal to transformers' greedy tokens, which one device gives too (tests/models/test_model_families.py, test_llama_parity.py)."""
    folder, prompts, expected = _prepare(name, tmp_path_factory)
    llm = _llm(folder, n)
    assert _greedy(llm, prompts) == expected, f"tensor_parallel_size={n} differs"
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    _assert_split_1_over_n(llm.engine.runner, n)
    assert (llm.engine.runner.kv_groups is not None) == ("hybrid" in str(folder))


def _assert_split_1_over_n(runner, n):
    """From the arrays' shardings: each device holds 1/n of every sharded weight and of the KV array."""
    from jaxpaged.models.sharding import TP_AXIS

    sharded = replicated = 0
    per_device = {d: 0 for d in runner.mesh.devices.flat}
    for leaf in jax.tree_util.tree_leaves(runner.state):
        assert len(leaf.addressable_shards) == n
        split = TP_AXIS in jax.tree_util.tree_leaves(tuple(leaf.sharding.spec))
        for shard in leaf.addressable_shards:
            assert shard.data.size == (leaf.size // n if split else leaf.size)
            if split:
                per_device[shard.device] += shard.data.nbytes
        if split:
            sharded += leaf.nbytes
        else:
            replicated += leaf.nbytes
    assert all(b == sharded // n for b in per_device.values())
    assert replicated < 0.05 * (sharded + replicated)  # norms and position tables only
    cache = runner.kv_cache
    assert cache.shape[3] % n == 0
    assert all(s.data.shape[3] == cache.shape[3] // n for s in cache.addressable_shards)


@needs_devices
def test_pallas_kernel_under_shard_map(tmp_path_factory):
    """The kernel (interpret mode here) per device under shard_map, on BLOOM (so with ALiBi): same tokens."""
    folder, prompts, expected = _prepare("bloom-alibi", tmp_path_factory)
    assert _greedy(_llm(folder, 2, backend="pallas"), prompts) == expected


@needs_devices
def test_fused_kv_write_keeps_the_cache_split(tmp_path_factory):
    """fused_kv_write at TP=2: the step's executable returns the donated cache split by KV head as it came in."""
    folder, prompts, expected = _prepare("llama-gqa2", tmp_path_factory)
    llm = _llm(folder, 2, fused_kv_write=True)
    assert _greedy(llm, prompts) == expected
    assert ("step", 8) in llm.engine.runner._compiled and llm.get_stats()["num_compiles_after_warmup"] == 0
    _assert_split_1_over_n(llm.engine.runner, 2)


@needs_devices
def test_head_count_that_does_not_divide_is_a_clear_error(tmp_path):
    from tests.hf_reference import random_hf_model, save_hf_model, tiny_llama_config

    config = tiny_llama_config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    folder = save_hf_model(random_hf_model(config), tmp_path / "six-heads")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide .*num_attention_heads=6"):
        _llm(folder, 4)
    with pytest.raises(ValueError, match="only 4"):
        _llm(folder, 8)
    assert len(np.unique([d.id for d in jax.devices()])) == DEVICES


@needs_devices
@pytest.mark.parametrize("scheme,n", [("int8-w8a8", 2), ("gguf-q4_0", 4)])
def test_quantized_weights_split_like_their_kernels(scheme, n, tmp_path):
    """Scales and offsets split with their kernels (a packed 4-bit kernel on its halved input axis too): TP=n gives
    TP=1's tokens. The int8 case quantizes activations too (a row-parallel layer's per-token scale is a max over its
    split input), which covers weight-only int8's splits as well: only the dot differs. Q4_0 at TP=4 splits its
    packed blocks finest and replicates the 2 quantized KV heads; int8 at TP=2 splits them (and int8 scales are
    replicated at TP=4 in test_fused_projections_tp.py)."""
    from jaxpaged import LLM

    from tests.gguf_writer import write_llama_gguf
    from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

    hf = random_hf_model(tiny_llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=256), std=0.05)  # fmt: skip
    if scheme == "int8-w8a8":
        source, quantization = save_hf_model(hf, tmp_path / "m"), "int8"
    else:
        source, quantization = write_llama_gguf(hf, tmp_path / "q.gguf", quant="Q4_0"), "gguf"
    activations = scheme.endswith("w8a8")
    prompts = random_prompts(VOCAB, PROMPT_LENGTHS, seed=5)

    def run(tp):
        llm = LLM(str(source), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=8, tensor_parallel_size=tp,
                  attention_backend="reference", quantization=quantization, quantize_activations=activations,
                  log_level="WARNING")  # fmt: skip
        assert ("x 8-bit activations" in llm.engine.runner.memory_plan()) == activations
        return _greedy(llm, prompts), llm

    single, _ = run(1)
    tokens, llm = run(n)
    assert tokens == single, f"tensor_parallel_size={n} differs"
    kernel = llm.engine.runner.state["layers"][0]["mlp"]["down_proj"]["kernel"][...]
    assert all(s.data.shape[0] == kernel.shape[0] // n for s in kernel.addressable_shards)  # row-parallel, split


@needs_devices
@pytest.mark.parametrize("kv_cache_dtype,n,backend", [("int8", 4, "reference"), ("fp8", 2, "pallas")])
def test_quantized_kv_cache_splits_with_its_scales(kv_cache_dtype, n, backend, tmp_path_factory):
    """An 8-bit cache and its scales split by KV head (TP=4 over 2 KV heads: widened to 4): TP=n gives TP=1's
    tokens (the Pallas kernel per device at TP=2), and nothing compiles after warm-up. The split does not depend
    on the 8-bit format (QuantizedKV holds either), so int8 runs at TP=4 and fp8 at TP=2."""
    from jaxpaged.pallas_kernels.kv_quant import QuantizedKV

    folder, prompts, _ = _prepare("llama-gqa2", tmp_path_factory)
    single = _greedy(_llm(folder, 1, kv_cache_dtype=kv_cache_dtype), prompts)
    llm = _llm(folder, n, backend, kv_cache_dtype=kv_cache_dtype)
    assert _greedy(llm, prompts) == single, f"tensor_parallel_size={n} differs"
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    cache = llm.engine.runner.kv_cache
    assert isinstance(cache, QuantizedKV) and cache.data.dtype.itemsize == 1 and cache.kind == kv_cache_dtype
    heads = cache.shape[3]
    assert all(s.data.shape[3] == heads // n for s in cache.data.addressable_shards)
    assert all(s.data.shape[3] == heads // n for s in cache.scale.addressable_shards)


@needs_devices
def test_one_device_executables_load_on_a_many_device_host(tmp_path_factory):
    """TP=1 on a host with 4 devices: a warm start's stored executables are loaded for the one device the engine
    uses (loaded onto all four, they asked for four shards and the first step failed)."""
    from jaxpaged import LLM

    folder, prompts, expected = _prepare("llama-gqa2", tmp_path_factory)
    cache = tmp_path_factory.mktemp("executables")
    runs = []
    for _ in range(2):
        # block size 16: programs no earlier test compiled in this process (only a program's first compile is stored)
        llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=8, block_size=16,
                  attention_backend="reference", cache_dir=str(cache), log_level="WARNING")  # fmt: skip
        runs.append((_greedy(llm, prompts), llm.engine.runner.executables.num_loaded))
    assert runs[0] == (expected, 0)
    assert runs[1][0] == expected and runs[1][1] > 0


@needs_devices
def test_a_pooling_engine_under_tp_equals_transformers_and_one_device(tmp_path_factory):
    """runner pooling: the pooled sums come back replicated; TP 4 gives transformers' normalized mean of the final
    hidden states, which one device gives too (tests/engine/test_pooling.py)."""
    import transformers

    from tests.engine.test_pooling import reference
    from tests.hf_reference import torch

    folder, prompts, _ = _prepare("llama-gqa2", tmp_path_factory)
    four = _llm(folder, 4, runner="pooling", pooler_config={"pooling_type": "MEAN"})
    got = [o.outputs.data for o in four.encode([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    want = [reference(hf, p, "MEAN") for p in prompts]
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-5, rtol=0)
    assert four.get_stats()["num_compiles_after_warmup"] == 0
