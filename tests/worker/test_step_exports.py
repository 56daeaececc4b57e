"""The model's jitted forward pass lowers for an accelerator with the compiled kernel in it (not Pallas'
interpreted loops), and with one kernel per bucket whatever the number of layers: the layer is a runtime
operand. Exported from this CPU host for "cuda" (and "tpu") by the runner the GPU (TPU) platform configures."""

from __future__ import annotations

import jax
import pytest
import transformers
from jax import export
from jaxpaged import platforms
from jaxpaged.config import EngineConfig
from jaxpaged.models.loader import load_model
from jaxpaged.worker.bucket_compiles import abstract as _abstract
from jaxpaged.worker.model_runner import ModelRunner

from tests.exporting import MOSAIC_CALL, TRITON_CALLS, export_checks, kernel_bodies, kernel_calls, lowering_for

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A bare config.json (random weights; no torch needed): head_dim 64, a size the Pallas kernels take, GQA 4:2."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=NUM_LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    folder = tmp_path_factory.mktemp("llama")
    config.to_json_file(folder / "config.json")
    return folder / "config.json"


def _runner(model_dir, platform: str) -> ModelRunner:
    config = EngineConfig(platform=platform, dtype="bfloat16", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                          precompile=False)  # fmt: skip
    loaded = load_model(str(model_dir), dtype="bfloat16", platform=platforms.get(platform), use_cache=False)
    assert loaded.model.layers[0].self_attn.backend.name == "pallas" and not loaded.model.layers[0].self_attn.backend.interpret
    return ModelRunner(loaded, config, max_model_len=256)


def _exported_steps(runner: ModelRunner, platform: str):
    for bucket in runner.buckets:  # decode-sized and prefill-sized steps: different launches
        args = jax.tree_util.tree_map(_abstract, runner._forward_args(runner.input_batch.blank(bucket), None))
        with lowering_for(platform):
            yield bucket, export.export(runner._forward, platforms=[platform], **export_checks(platform))(*args).mlir_module()


@pytest.mark.parametrize("platform,targets", [("cuda", TRITON_CALLS), ("tpu", (MOSAIC_CALL,))])
def test_the_step_exports_with_one_compiled_kernel_per_bucket(model_dir, platform, targets):
    runner = _runner(model_dir, "gpu" if platform == "cuda" else "tpu")
    assert len(runner.buckets) > 1
    for bucket, module in _exported_steps(runner, platform):
        assert kernel_calls(module, targets), f"bucket {bucket}: no compiled kernel in the step"
        # one kernel, called by every layer: the layer index is an operand, not part of the kernel
        assert len(kernel_bodies(module, targets)) == 1, f"bucket {bucket}: a kernel per layer"


def test_a_gpu_step_holds_no_conditional(model_dir):
    """XLA:GPU runs a conditional by reading its predicate back to the host (docs/design.md, "No host waits inside
    a step"): the forward, the prompt-logprobs step and the warm samplers the GPU platform configures, exported for
    cuda, hold none."""
    runner = _runner(model_dir, "gpu")
    for bucket, module in _exported_steps(runner, "cuda"):
        assert "stablehlo.case" not in module and "stablehlo.if" not in module, f"bucket {bucket}"
    step = runner.input_batch.blank(runner.buckets[-1])
    forward_args = jax.tree_util.tree_map(_abstract, runner._forward_args(step, None))
    hidden = jax.eval_shape(runner._forward, *forward_args)[1]
    prompt = (forward_args[0], hidden, jax.ShapeDtypeStruct(hidden.shape[:1], "int32"))
    sampling = jax.tree_util.tree_map(_abstract, runner._sampling_args(step.sampling))
    logits = jax.eval_shape(runner._forward, *forward_args)[0]
    calls = [(runner._prompt, prompt)] + [
        (runner._samplers.jitted(plan), (logits, *sampling, _abstract(runner._no_sampled))) for plan in runner._samplers.warm_plans
    ]
    for jitted, args in calls:
        with lowering_for("cuda"):
            module = export.export(jitted, platforms=["cuda"], **export_checks("cuda"))(*args).mlir_module()
        assert "stablehlo.case" not in module and "stablehlo.if" not in module
