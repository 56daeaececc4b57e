"""A vision-language model's steps hold no conditional where XLA:GPU would read one back to the host (docs/design.md,
"No host waits inside a step"): Gemma 3's forward with its image inputs (the Triton kernel with image spans) and its
encoder at every patch-count bucket, Qwen2.5-VL's window ViT, exported for cuda from this CPU host by the runner the
GPU platform configures."""

from __future__ import annotations

import jax
import pytest
from jax import export
from jaxpaged import platforms
from jaxpaged.config import EngineConfig
from jaxpaged.models.loader import load_model
from jaxpaged.worker.bucket_compiles import abstract as _abstract
from jaxpaged.worker.model_runner import ModelRunner

from tests.exporting import TRITON_CALLS, export_checks, kernel_calls, lowering_for

vlm = pytest.importorskip("tests.vlm_models")


def _bare(folder, config, processor):
    """A bare config.json (random weights) beside the model's processor."""
    config.to_json_file(folder / "config.json")
    processor.save_pretrained(folder)
    return folder / "config.json"


def _runner(config_file) -> ModelRunner:
    config = EngineConfig(platform="gpu", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=32,
                          precompile=False)  # fmt: skip
    loaded = load_model(str(config_file), dtype="bfloat16", platform=platforms.get("gpu"), use_cache=False)
    return ModelRunner(loaded, config, max_model_len=256)


def _no_conditional(module: str, what) -> None:
    assert "stablehlo.case" not in module and "stablehlo.if" not in module, what


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_vlm_steps_export_for_cuda_without_conditionals(family, tmp_path):
    if family == "gemma3":
        config = vlm.gemma3_config()
        runner = _runner(_bare(tmp_path, config, vlm.gemma3_processor(config)))
    else:
        runner = _runner(_bare(tmp_path, vlm.qwen2_5_vl_config(), vlm.qwen_vl_processor()))
    assert runner.mm is not None
    for bucket in runner.buckets:
        args = jax.tree_util.tree_map(_abstract, runner._forward_args(runner.input_batch.blank(bucket), None))
        with lowering_for("cuda"):
            module = export.export(runner._forward, platforms=["cuda"], **export_checks("cuda"))(*args).mlir_module()
        _no_conditional(module, bucket)
        if family == "gemma3":  # head_dim 16: the Triton kernel, with the image spans' operand
            assert kernel_calls(module, TRITON_CALLS), bucket
    mm = runner.mm
    for bucket in mm.buckets:
        batch = mm.adapter.blank(bucket)
        dst = jax.ShapeDtypeStruct((mm.adapter.rows_for(bucket),), "int32")
        args = (jax.tree_util.tree_map(_abstract, runner.state), _abstract(mm.array),
                jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch), dst)  # fmt: skip
        with lowering_for("cuda"):
            module = export.export(mm._encode, platforms=["cuda"], **export_checks("cuda"))(*args).mlir_module()
        _no_conditional(module, f"encoder bucket {bucket}")
        assert "stablehlo.while" not in module, f"encoder bucket {bucket}: a loop"  # (full attention's chunks unrolled)
