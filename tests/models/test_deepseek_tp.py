"""DeepSeek-V3 (MLA) on 4 CPU devices: heads split (q_b_proj, kv_b_proj column-parallel, o_proj row-parallel), the
latent's projections and its cache whole on every device (one copy of each token's latent per device), experts split
two per device; greedy tokens equal transformers'. As in test_moe_expert_parallel.py, the first test re-runs this
file in a subprocess with 4 simulated devices."""

from __future__ import annotations

from tests.multi_device import needs_devices, reference_family, rerun_with_devices


def test_deepseek_tensor_parallel_suite_on_four_cpu_devices():
    rerun_with_devices(__file__)


@needs_devices
def test_four_devices_split_heads_and_replicate_the_latent(tmp_path_factory):
    from jaxpaged import LLM, SamplingParams
    from tests.models.test_deepseek import _configs

    folder, prompts, expected = reference_family({}, "deepseek-v3", _configs()["v3"], tmp_path_factory, [3, 17, 30], 12)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              tensor_parallel_size=4, log_level="WARNING")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
    runner = llm.engine.runner
    attn = runner.state["layers"][1]["self_attn"]
    for name, split in (("q_b_proj", True), ("kv_b_proj", True), ("o_proj", True), ("q_a_proj", False),
                        ("kv_a_proj_with_mqa", False)):  # fmt: skip
        kernel = attn[name]["kernel"][...]
        assert all(s.data.size == kernel.size // (4 if split else 1) for s in kernel.addressable_shards), name
    # the cache: one latent row per token on each device (its KV-head axis holds a copy per device)
    cache = runner.kv_cache
    assert cache.shape[3] == 4 and all(s.data.shape[3] == 1 for s in cache.addressable_shards)
    assert all(s.data.shape[-1] * 2 == 32 + 16 for s in cache.addressable_shards)
    experts = runner.state["layers"][1]["mlp"]["experts"]["down_proj"]["kernel"][...]
    assert all(s.data.shape[0] == 2 for s in experts.addressable_shards)  # 8 experts, 2 per device


@needs_devices
def test_the_mla_tpu_kernel_runs_per_device():
    """The MLA TPU kernel (pallas_kernels/mla_tpu.py, interpreted) under shard_map on 4 devices, each with its 4 of 16
    heads and its own copy of the latent cache: equal to the pure-JAX path on one device."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jaxpaged.pallas_kernels.mla import mla_attention
    from jaxpaged.pallas_kernels.mla_tpu import tpu_mla_cached

    from tests.kernels.test_mla_tpu_kernel import CACHED, NEW, _args

    args = _args(np.random.default_rng(1), 16, 64, 16, CACHED, NEW, sum(NEW) + 4, jnp.float32)
    want = np.asarray(mla_attention(*args[:7], 1, args[8], args[9]))
    cache = jnp.broadcast_to(args[6], args[6].shape[:3] + (4,) + args[6].shape[4:])  # a copy per device
    absorbed = functools.partial(tpu_mla_cached, interpret=True)
    with jax.set_mesh(Mesh(np.array(jax.devices()[:4]), ("model",))):
        got = jax.jit(lambda *a: mla_attention(*a[:7], 1, a[7], args[9], tp=4, absorbed=absorbed))(*args[:6], cache, args[8])
    live = sum(NEW)
    np.testing.assert_allclose(np.asarray(got)[:live], want[:live], rtol=0, atol=2e-5)
