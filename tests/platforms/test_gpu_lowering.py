"""The whole step lowers for each GPU generation the GPU platform supports, with that card's choices: Colab's T4
(7.5: no bfloat16, 64 KiB of shared memory), A100 (8.0), L4 (8.9) and H100 (9.0). Run on a host without a GPU,
the card faked where the platform and Pallas' Triton lowering read it."""

from __future__ import annotations

import jax
import pytest
import transformers
from jax import export
from jaxpaged.config import EngineConfig
from jaxpaged.models.loader import load_model
from jaxpaged.pallas_kernels.gpu_attention import SHARED_MEMORY_MARGIN, launch_config, shared_memory_estimate
from jaxpaged.platforms import gpu
from jaxpaged.worker.bucket_compiles import abstract as _abstract
from jaxpaged.worker.model_runner import ModelRunner

from tests.exporting import GPUS, TRITON_CALLS, export_checks, kernel_calls, lowering_for


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    folder = tmp_path_factory.mktemp("llama")
    config.to_json_file(folder / "config.json")
    return folder / "config.json"


@pytest.fixture(params=sorted(GPUS), ids=lambda cc: f"cc{cc}")
def card(request, monkeypatch):
    """The GPU platform sees this card as the first local GPU."""
    card = GPUS[request.param]
    monkeypatch.setattr(gpu, "_first_gpu", lambda: card)
    return card


def _runner(model_dir, kv_cache_dtype: str):
    config = EngineConfig(platform="gpu", dtype="auto", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64, max_num_seqs=8,
                          max_num_batched_tokens=64, precompile=False)  # fmt: skip
    loaded = load_model(str(model_dir), dtype=config.dtype, platform=gpu.GpuPlatform(), use_cache=False)
    return ModelRunner(loaded, config, max_model_len=256), loaded.model.layers[0].self_attn.backend


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_every_bucket_lowers_for_the_card_in_its_dtype(model_dir, card, kv_cache_dtype):
    runner, kernel = _runner(model_dir, kv_cache_dtype)
    assert kernel.name == "pallas" and not kernel.interpret
    assert kernel.shared_memory == gpu.SHARED_MEMORY_KIB[card.compute_capability] * 1024
    assert kernel.num_cores == card.core_count
    no_bfloat16 = card.compute_capability < "8.0"
    assert jax.numpy.dtype(runner.dtype).name == ("float16" if no_bfloat16 else "bfloat16")
    for bucket in runner.buckets:  # decode- and prefill-sized launches
        args = jax.tree_util.tree_map(_abstract, runner._forward_args(runner.input_batch.blank(bucket), None))
        with lowering_for("cuda", card):
            module = export.export(runner._forward, platforms=["cuda"], **export_checks("cuda"))(*args).mlir_module()
        assert kernel_calls(module, TRITON_CALLS), f"bucket {bucket}: no compiled kernel"
        # a T4 has no bfloat16 units: nothing in its step computes in bfloat16
        assert ("bf16" in module) != no_bfloat16, f"bucket {bucket}"


def test_each_cards_launches_fit_its_shared_memory(card):
    memory = gpu.SHARED_MEMORY_KIB[card.compute_capability] * 1024
    for head_dim in (64, 128, 256):
        for tokens, seqs in ((8, 8), (2048, 64)):
            launch = launch_config(tokens, seqs, head_dim, 2, shared_memory=memory, num_cores=card.core_count,
                                   num_kv_heads=8)  # fmt: skip
            used = shared_memory_estimate(launch.rows, launch.kv_chunk, head_dim, 2, launch.num_stages)
            assert used <= memory * SHARED_MEMORY_MARGIN, (card, head_dim, tokens, launch)


def test_the_triton_lowering_sees_the_card_shown():
    """A kernel that casts to float8 lowers for an L4 (8.9) and is refused for an A100 (8.0), which has no fp8: the
    lowerings above really were for each card, not for a default one."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def to_fp8(x_ref, o_ref):
        o_ref[...] = x_ref[...].astype(jax.numpy.float8_e4m3fn)

    out = jax.ShapeDtypeStruct((16,), jax.numpy.float8_e4m3fn)
    cast = jax.jit(lambda x: pl.pallas_call(to_fp8, out_shape=out, compiler_params=plgpu.CompilerParams())(x))
    arg = jax.ShapeDtypeStruct((16,), jax.numpy.float32)
    with lowering_for("cuda", GPUS["8.9"]):
        assert kernel_calls(export.export(cast, platforms=["cuda"], **export_checks("cuda"))(arg).mlir_module(), TRITON_CALLS)
    with lowering_for("cuda", GPUS["8.0"]), pytest.raises(Exception, match="(?i)float8|fp8|e4m3"):
        export.export(cast, platforms=["cuda"], **export_checks("cuda"))(arg)
