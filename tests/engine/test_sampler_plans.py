"""No host waits inside a step (issue 44): where a lax.cond reads its predicate back (a GPU), the step's executables
hold none. Run here on the CPU with the GPU platform's choice forced: the forward and every sampler lower without a
conditional, prompt logprobs come from their own executable, a step needing a plan not compiled yet runs FULL while
it compiles in the background, and every request's tokens and logprobs equal those of the engine deciding on the
device, with nothing compiled on the step path and every KV block back."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.platforms.cpu.platform import ComputedOnce, CpuPlatform
from jaxpaged.worker.sampler import FULL, GREEDY, SamplerPlan
from jaxpaged.worker.sampler_plans import sampler_name
from tests.hf_reference import hf_greedy, random_prompts

VOCAB = 256


def _llm(folder, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_seqs": 4, "max_num_batched_tokens": 16, "block_size": 8, "log_level": "WARNING", **kw}
    return LLM(folder, **kw)


@pytest.fixture(scope="module")
def dynamic_llm(model_dir):
    return _llm(model_dir)


@pytest.fixture(scope="module")
def static_llm(model_dir, tmp_path_factory, dynamic_llm):
    """An engine built as on a GPU: conditionals off the device, the pool sized after the samplers' workspace (its
    own executable folder: the RoPE patch below is not part of a stored executable's key). The device-deciding engine
    is built first, unpatched."""
    patch = pytest.MonkeyPatch()
    patch.setattr(CpuPlatform, "device_conditionals", False)
    patch.setattr(CpuPlatform, "reserve_step_workspace", True)
    patch.setattr(ComputedOnce, "__call__", lambda self, compute, operand: compute())  # RoPE's table as on a GPU
    try:
        yield _llm(model_dir, cache_dir=str(tmp_path_factory.mktemp("static-executables")))
    finally:
        patch.undo()


def _requests(prompts):
    """Every sampler feature, one request each, in one batch (seeded, so both engines draw the same noise)."""
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=1, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.2),  # fmt: skip
        SamplingParams(temperature=0.7, seed=3, min_tokens=6, max_tokens=12, prompt_logprobs=2, min_p=0.05),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={5: 3.0, prompts[4][-1]: -50.0}),
        SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True, allowed_token_ids=[3, 9, 27, 81],
                       logprobs=2),  # fmt: skip
    ]


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs], outs


def _no_conditional(executable) -> bool:
    return "conditional(" not in executable.as_text()


def test_greedy_equals_transformers_with_no_cond_in_any_step(static_llm, hf_model):
    prompts = random_prompts(VOCAB, [5, 23, 9], seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs, _ = _run(static_llm, prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model, p, 16) for p in prompts]
    runner = static_llm.engine.runner
    names = {name for name, _ in runner._compiled}
    assert {"forward", "prompt", sampler_name(GREEDY), sampler_name(FULL)} <= names and "sample" not in names, names
    for (name, _), executable in runner._compiled.items():
        if name in ("forward", "prompt") or name.startswith("sample"):
            assert _no_conditional(executable), name
    stats = static_llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_used"] == 0


def test_every_feature_gives_the_device_deciding_engines_tokens(static_llm, dynamic_llm):
    assert static_llm.engine.runner._prompt_apart and not dynamic_llm.engine.runner._prompt_apart
    prompts = random_prompts(VOCAB, [7, 19, 12, 30, 9, 14], seed=5)
    params = _requests(prompts)
    (static, static_outs), (dynamic, dynamic_outs) = _run(static_llm, prompts, params), _run(dynamic_llm, prompts, params)
    assert [o.token_ids for o in static] == [o.token_ids for o in dynamic]
    for a, b in zip(static, dynamic):  # sampled tokens' logprobs, where asked
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys()
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-5 for k in x)
    prompt_a, prompt_b = static_outs[3].prompt_logprobs, dynamic_outs[3].prompt_logprobs
    assert prompt_a is not None and len(prompt_a) == len(prompts[3]) and prompt_a[0] is None
    for x, y in zip(prompt_a[1:], prompt_b[1:]):
        assert x.keys() == y.keys() and all(abs(x[k].logprob - y[k].logprob) < 1e-5 for k in x)
    stats = static_llm.get_stats()
    assert stats["num_compiles_after_warmup"] == 0 and stats["kv_blocks_used"] == 0


def test_a_new_plan_runs_full_until_its_own_compiles(static_llm):
    """Seeded sampling without truncation, penalties or logprobs: a plan no warm-up compiled. Its first steps run
    FULL; once compiled in the background it runs its own, and the tokens are the same either way."""
    runner = static_llm.engine.runner
    plan = SamplerPlan(constrained=False, suppress=False, bias=False, penalty=False, random=True, top=False, logprobs=False, draft=False)
    rows = runner.bucket_for(1)[1]
    assert (sampler_name(plan), rows) not in runner._compiled
    prompt = random_prompts(VOCAB, [9], seed=6)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)
    first, _ = _run(static_llm, prompt, params)
    runner.finish_background_compiles()
    assert (sampler_name(plan), rows) in runner._compiled
    again, _ = _run(static_llm, prompt, params)
    assert first[0].token_ids == again[0].token_ids
    assert static_llm.get_stats()["num_compiles_after_warmup"] == 0


def test_the_workspace_kept_covers_the_largest_sampler(static_llm):
    runner = static_llm.engine.runner
    analysis = runner._compiled[sampler_name(FULL), runner.bucket_for(runner.buckets[-1])[1]].memory_analysis()
    assert analysis.temp_size_in_bytes > 0
    assert runner._workspace_bytes() >= analysis.temp_size_in_bytes + analysis.output_size_in_bytes
