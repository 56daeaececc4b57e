"""Gemma 4 under tensor parallelism on 4 CPU devices (as in test_model_families_2026_tp.py, the first test re-runs this
file in a subprocess with 4 simulated devices): tests/models/test_gemma4.py's dense model (PLE, shared K/V, 2 KV
heads on every layer) and MoE model (1 KV head on its full layers, 2 on its sliding ones, 4 experts) at TP 4, each
layer's KV heads repeated to one a device; the image-text model of tests/vlm_models.py (bidirectional image spans,
`attention_k_eq_v` with one KV head on its full layers) at TP 2 with an image, its sliding layers' 2 KV heads split
and its full layers' one repeated, the tower whole on each device. Greedy tokens equal transformers', nothing
compiles after warm-up. A layer whose KV heads cannot be split or repeated evenly is a ValueError; the released
31B's and 26B-A4B's head counts (on tiny widths) are accepted at N = 2, 4 and 8."""

from __future__ import annotations

import pytest

from tests.multi_device import needs_devices, rerun_with_devices

# (case, devices, the cache's KV heads, {layer: its k_proj's columns}: its KV heads, repeated to one a device where
# fewer, times its head dim: 32 on the full layers (2 and 5), 16 on the sliding ones)
TP_CASES = [("dense-ple-shared-kv", 4, 4, {0: 4 * 16, 5: 4 * 32}), ("moe-k-eq-v", 4, 4, {0: 4 * 16, 2: 4 * 32})]


def test_gemma4_tensor_parallel_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


def test_a_layer_whose_kv_heads_cannot_split_is_refused(tmp_path):
    """6 query heads, 6 experts and 6 KV heads on the sliding layers split 2 or 3 ways; the full layers' 3 split 3
    ways but neither split 2 ways nor repeat to 2."""
    from jaxpaged.models.loader import model_config
    from jaxpaged.models.sharding import check_divisible

    from tests.models.test_gemma4 import _moe

    _moe(num_attention_heads=6, num_key_value_heads=6, num_global_key_value_heads=3, num_experts=6,
         intermediate_size=96).save_pretrained(tmp_path)
    cfg = model_config(tmp_path / "config.json")
    check_divisible(cfg, 3)  # 3 divides 6 and 3
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide .*some layers' 3 KV heads"):
        check_divisible(cfg, 2)


@pytest.mark.parametrize("heads,sliding_kv,full_kv", [(32, 16, 4), (16, 8, 2)])
def test_the_released_head_counts_split_two_four_and_eight_ways(heads, sliding_kv, full_kv, tmp_path):
    """31B's heads (dense: 32 query, 16 KV on sliding layers, 4 on full ones, attention_k_eq_v) and 26B-A4B's (MoE:
    16, 8, 2; 128 experts of 704), on tiny widths: N = 2, 4 and 8 are accepted, the cache holding max(16 or 8, N)."""
    from jaxpaged.models.loader import model_config
    from jaxpaged.models.sharding import check_divisible, replicate_kv_heads

    from tests.models.test_gemma4 import _dense, _moe

    shape = dict(num_attention_heads=heads, num_key_value_heads=sliding_kv, num_global_key_value_heads=full_kv,
                 attention_k_eq_v=True, intermediate_size=128)  # fmt: skip
    config = _moe(**shape, num_experts=128, moe_intermediate_size=704) if heads == 16 else _dense(**shape)
    config.save_pretrained(tmp_path)
    cfg = model_config(tmp_path / "config.json")
    assert sorted({kv for kv, _ in cfg.option("layer_kv_shapes")}) == [full_kv, sliding_kv]
    for n in (2, 4, 8):
        check_divisible(cfg, n)
        assert replicate_kv_heads({}, cfg, n)[1].num_kv_heads == max(sliding_kv, n)


@needs_devices
@pytest.mark.parametrize("case,n,cache_heads,k_columns", TP_CASES)
def test_devices_split_heads_and_repeat_each_layers_kv_heads(case, n, cache_heads, k_columns, tmp_path_factory):
    from jaxpaged import LLM, SamplingParams

    from tests.hf_reference import hf_greedy, random_prompts, save_hf_model
    from tests.models.test_gemma4 import CASES, VOCAB, _hf_model

    hf = _hf_model(CASES[case][0]())
    folder = save_hf_model(hf, tmp_path_factory.mktemp(case))
    prompts = random_prompts(VOCAB, [3, 17, 30], seed=5)  # past the sliding window of 8
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              tensor_parallel_size=n, log_level="WARNING")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    runner = llm.engine.runner
    assert runner.kv_cache.shape[3] == cache_heads and runner.model_config.num_kv_heads == cache_heads
    assert all(s.data.shape[3] == cache_heads // n for s in runner.kv_cache.addressable_shards)
    q = runner.state["layers"][1]["self_attn"]["q_proj"]["kernel"][...]
    assert all(s.data.size == q.size // n for s in q.addressable_shards)
    for layer, columns in k_columns.items():
        k = runner.state["layers"][layer]["self_attn"]["k_proj"]["kernel"][...]
        assert k.shape[1] == columns and all(s.data.shape[1] == columns // n for s in k.addressable_shards)
    if "moe" in case:  # 4 experts, one a device
        experts = runner.state["layers"][1]["moe"]["experts"]["down_proj"]["kernel"][...]
        assert all(s.data.shape[0] == 4 // n for s in experts.addressable_shards)


@needs_devices
def test_tp2_image_text_model_with_an_image_equals_transformers(tmp_path):
    import jax
    from jaxpaged import LLM, SamplingParams

    from tests.vlm_models import gemma4_checkpoint, hf_inputs, hf_vlm_greedy, images

    hf, processor, folder = gemma4_checkpoint(tmp_path, bidirectional=True, seed=1, attention_k_eq_v=True,
                                              num_global_key_value_heads=1)  # fmt: skip
    text, picture = "<bos>Describe <|image|> briefly.", images((40, 30), seed=2)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, max_num_seqs=2, max_num_batched_tokens=96,
              num_kv_blocks=64, log_level="WARNING")  # fmt: skip
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}},
                          SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert list(out.outputs[0].token_ids) == hf_vlm_greedy(hf, hf_inputs(processor, text, picture), 8)
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    runner = llm.engine.runner
    assert runner.kv_cache.shape[3] == 2 and all(s.data.shape[3] == 1 for s in runner.kv_cache.addressable_shards)
    for layer, columns in {0: 2 * 16, 2: 2 * 32}.items():  # a sliding layer's 2 heads split, a full layer's 1 repeated
        k = runner.state["layers"][layer]["self_attn"]["k_proj"]["kernel"][...]
        assert k.shape[1] == columns and all(s.data.shape[1] == columns // 2 for s in k.addressable_shards)
    tower = [x for x in jax.tree_util.tree_leaves(runner.state["vision_tower"]) if x.ndim == 2]  # whole on each device
    assert tower and all(s.data.shape == x.shape for x in tower for s in x.addressable_shards)
