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
