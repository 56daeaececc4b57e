"""DeepSeek-V3 through the engine with the MLA TPU kernel (pallas_kernels/mla_tpu.py) interpreted on the CPU. No
engine test runs the Mosaic attention kernel (the CPU platform's "pallas" is the Triton one, interpreted), so this one
has the CPU platform hand out MosaicAttention(interpret=True) for "pallas", as the TPU platform hands out the compiled
one: the model then runs the absorbed part in the Mosaic kernel (its own tests check it against the pure-JAX path)."""

from __future__ import annotations

import pytest

from tests.hf_reference import hf_greedy, random_prompts
from tests.models.test_deepseek import VOCAB, _saved

pytest.importorskip("torch")


def test_engine_with_the_mla_tpu_kernel_interpreted(tmp_path_factory, monkeypatch):
    """Greedy tokens equal transformers' through 8-token chunks (a prompt's later chunks read its earlier ones
    absorbed) and decode, over blocks of 16; nothing compiles after warm-up."""
    from jaxpaged.pallas_kernels import MosaicAttention, mla_tpu

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.platforms.cpu.platform import CpuPlatform

    chosen = CpuPlatform.attention_backend
    monkeypatch.setattr(CpuPlatform, "attention_backend", lambda self, requested, head_dim, batch_invariant=False: (
        MosaicAttention(interpret=True) if requested == "pallas" else chosen(self, requested, head_dim, batch_invariant)))  # fmt: skip
    calls = []  # the kernel's calls while the model is traced (the pure-JAX path would make none)
    kernel = mla_tpu.tpu_mla_cached
    monkeypatch.setattr(mla_tpu, "tpu_mla_cached", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    hf, folder = _saved("v3-kernel", tmp_path_factory)
    prompts = random_prompts(VOCAB, [21, 5], seed=4)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=8, block_size=16,
              attention_backend="pallas", log_level="WARNING")  # fmt: skip
    assert isinstance(llm.engine.loaded.model.layers[0].self_attn.backend, MosaicAttention)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert calls and all(kw == {"interpret": True} for kw in calls)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0


def test_the_tpu_platform_picks_the_kernel_and_the_step_exports_with_it(tmp_path):
    """The TPU platform, given a DeepSeek-V3 config (its "auto" backend: the Mosaic one, chosen by the RoPE key's 64),
    builds a model whose step, exported for "tpu" from this host, launches the MLA kernel compiled (a Mosaic call, not
    Pallas' interpreted loops), one kernel for every layer, in its smallest and largest bucket."""
    import jax
    import transformers
    from jax import export
    from jaxpaged.models.loader import load_model
    from jaxpaged.pallas_kernels import MosaicAttention

    from jaxpaged import platforms
    from jaxpaged.config import EngineConfig
    from jaxpaged.worker.bucket_compiles import abstract as _abstract
    from jaxpaged.worker.model_runner import ModelRunner
    from tests.exporting import MOSAIC_CALL, kernel_bodies, kernel_calls

    config = transformers.DeepseekV3Config(vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
                                           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=16,
                                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                                           q_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                           max_position_embeddings=512)  # fmt: skip
    config.to_json_file(tmp_path / "config.json")
    loaded = load_model(str(tmp_path / "config.json"), dtype="bfloat16", platform=platforms.get("tpu"), use_cache=False)
    assert loaded.model.layers[0].self_attn.backend == MosaicAttention(interpret=False)
    engine = EngineConfig(platform="tpu", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                          precompile=False)  # fmt: skip
    runner = ModelRunner(loaded, engine, max_model_len=256)
    for bucket in {runner.buckets[0], runner.buckets[-1]}:  # a decode-sized step and a prefill-sized one
        args = jax.tree_util.tree_map(_abstract, runner._forward_args(runner.input_batch.blank(bucket), None))
        module = export.export(runner._forward, platforms=["tpu"])(*args).mlir_module()
        assert len(kernel_bodies(module, (MOSAIC_CALL,))) == 1 and "mla_absorbed_tpu" in module, f"bucket {bucket}"
        assert kernel_calls(module, (MOSAIC_CALL,))
