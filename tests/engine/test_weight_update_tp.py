"""update_weights on a 4-way tensor-parallel engine (issue 47): the model's 2 KV heads widened to one per device, the
weights split over the mesh; new weights given on one device are resharded onto it in the update's program, and the
engine then greedy-decodes as transformers does with them; sleep and wake_up put the shards back where they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.hf_reference import hf_greedy, random_hf_model, random_prompts
from tests.multi_device import needs_devices, rerun_with_devices

PROMPTS = random_prompts(256, [6, 13], seed=61)


def test_with_devices():
    rerun_with_devices(__file__)


@needs_devices
def test_tensor_parallel_update_and_sleep(hf_model, model_dir):
    from jaxpaged import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=4, max_num_seqs=4, max_num_batched_tokens=16, block_size=8,
              num_kv_blocks=64, log_level="WARNING")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def tokens():
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    assert tokens() == [hf_greedy(hf_model, p, 5) for p in PROMPTS]
    other = random_hf_model(hf_model.config, seed=12)
    one = jax.devices()[0]
    llm.update_weights({name: jax.device_put(jnp.asarray(t.detach().numpy()), one) for name, t in other.state_dict().items()})
    assert tokens() == [hf_greedy(other, p, 5) for p in PROMPTS]
    state = llm.engine.runner.state
    shardings = [x.sharding for x in jax.tree_util.tree_leaves(state)]
    assert all(len(s.device_set) == 4 for s in shardings)
    llm.sleep(1)
    llm.wake_up()
    assert [x.sharding for x in jax.tree_util.tree_leaves(llm.engine.runner.state)] == shardings
    assert tokens() == [hf_greedy(other, p, 5) for p in PROMPTS]
    assert llm.get_stats()["num_compiles_after_warmup"] == 0
