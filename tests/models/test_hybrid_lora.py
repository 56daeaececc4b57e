"""LoRA on hybrid models (models/lora.py with the ports' `lora_projections`): adapters written by PEFT on the attention
layers' and MLPs' projections, against transformers + PEFT in float32 (logits within 1e-4, greedy tokens equal), two
adapters and the base model mixed in one ragged prefill and the decode steps after it; an adapter on the linear
layers' own projections is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from jaxpaged.models import lora
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, hf_logits, random_prompts, save_hf_model
from tests.models.test_hybrid_models import CASES, hybrid_hf_model
from tests.models.test_lora import MAX_RANK, LoRAStaticRunner, write_peft_adapter

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# family -> its MLP projections (Nemotron-H's MLP blocks have no gate)
FAMILIES = {"qwen3.5-dense-tied": ["gate_proj", "up_proj", "down_proj"], "nemotron-h": ["up_proj", "down_proj"]}
DECODE_TOKENS = 4


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    config_cls, kwargs, _ = CASES[request.param]
    base = hybrid_hf_model(config_cls(**kwargs))
    root = tmp_path_factory.mktemp(request.param)
    adapters = {"attention-r4": (4, 8, ATTENTION), "all-r8": (8, 16, ATTENTION + FAMILIES[request.param])}
    refs, paths = {}, {}
    for i, (name, (rank, alpha, targets)) in enumerate(adapters.items()):
        paths[name] = str(root / name)
        refs[name] = write_peft_adapter(base, paths[name], rank, alpha, targets, False, seed=10 + i)
    return base, save_hf_model(base, root / "base"), refs, paths


def test_adapters_on_attention_and_mlp_match_peft(family):
    base, folder, refs, paths = family
    loaded = load_model(str(folder), dtype="float32")
    adapters = [lora.load_adapter(name, path, loaded.config, lora.LORA_TARGETS, MAX_RANK) for name, path in paths.items()]
    runner = LoRAStaticRunner(loaded, adapters)
    names = [*paths, None]  # slot per prompt; None: the base model
    runner.seq_slots = np.array([-1 if n is None else list(paths).index(n) for n in names], np.int32)
    prompts = random_prompts(256, [19, 33, 7], seed=3)
    outputs, logits = runner.generate(prompts, DECODE_TOKENS, return_prompt_logits=True)
    for name, prompt, got_logits, got_tokens in zip(names, prompts, logits, outputs):
        ref = base if name is None else refs[name]
        assert name is None or np.abs(hf_logits(ref, prompt) - hf_logits(base, prompt)).max() > 1e-2  # it matters
        np.testing.assert_allclose(got_logits, hf_logits(ref, prompt), atol=1e-4, rtol=0, err_msg=str(name))
        assert got_tokens == hf_greedy(ref, prompt, DECODE_TOKENS), name


def test_an_adapter_on_the_linear_layers_is_refused(family, tmp_path):
    base, folder, _, _ = family
    cfg = load_model(str(folder), dtype="float32").config
    linear = ["in_proj_qkv"] if "linear_attention" in (cfg.option("layer_types") or ()) else ["in_proj"]
    write_peft_adapter(base, tmp_path / "linear", 4, 8, ATTENTION + linear, False, seed=3)
    with pytest.raises(ValueError, match=f"target_modules .*{linear[0]}"):
        lora.load_adapter("linear", str(tmp_path / "linear"), cfg, lora.LORA_TARGETS, MAX_RANK)


def test_the_engine_serves_an_adapter_beside_the_base_model(family):
    """Through LLM with enable_lora: chunked prefill and decode with the adapter, then without, each equal to PEFT."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.lora import LoRARequest

    base, folder, refs, paths = family
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8, max_model_len=128,
              enable_lora=True, max_lora_rank=MAX_RANK, log_level="WARNING")  # fmt: skip
    prompts = random_prompts(256, [9, 30], seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name, ref in (("all-r8", refs["all-r8"]), (None, base)):
        request = None if name is None else LoRARequest(name, 1, paths[name])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=request, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts], name
