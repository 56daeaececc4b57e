"""JaxpagedRollout (issue 47 steps 5-6): jaxpaged behind Tunix's rollout interface, built from a tiny random Tunix
model (Llama 3, Qwen2, Qwen3): greedy tokens equal Tunix's own sampler, per-token logprobs Tunix's
compute_per_token_logps within 1e-4 in float32, outputs laid out as Tunix's vanilla engine lays them out,
update_params under Tunix's transfer guards; and Tunix's GRPOLearner (its RLCluster, reward function and trainer)
training 3 steps with rollout_engine=JaxpagedRollout, the engine checked against the trainer's model after every
weight sync."""

from __future__ import annotations

import functools

import numpy as np
import pytest

tunix = pytest.importorskip("tunix", reason="google-tunix is not installed: pip install -e '.[rl]' (docs/rl.md)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate import tokenizer_adapter  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout, vanilla_rollout  # noqa: E402

from jaxpaged.rl import JaxpagedRollout  # noqa: E402
from jaxpaged.rl.tunix_rollout import family_of  # noqa: E402

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=32, block_size=8, num_kv_blocks=64, log_level="WARNING")
PROMPTS = ["ab", "hello world", "é日"]
MAX_TOKENS = 8
GREEDY = dict(max_tokens_to_generate=MAX_TOKENS, temperature=0.0, top_p=None, max_prompt_length=16, kv_cache_size=64)
SHAPE = dict(num_layers=2, vocab_size=272, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2,
             norm_eps=1e-5)  # fmt: skip


def tunix_model(family: str, seed: int = 0, **overrides) -> nnx.Module:
    """A tiny random Tunix model; weights doubled, so that greedy choices are clear of ties."""
    import importlib

    module = importlib.import_module(f"tunix.models.{family}.model")
    config = module.ModelConfig(**{**SHAPE, "rope_theta": 10_000, **overrides})
    cls = {"llama3": "Llama3", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    model = getattr(module, cls)(config, rngs=nnx.Rngs(seed))
    nnx.update(model, jax.tree.map(lambda x: x * 2.0 if x.ndim >= 2 else x + 0.1, nnx.state(model, nnx.Param)))
    return model


@pytest.fixture(scope="module")
def tokenizer(cycle_model_dir):
    from transformers import AutoTokenizer

    return tokenizer_adapter.TokenizerAdapter(AutoTokenizer.from_pretrained(str(cycle_model_dir)))


def compare(rollout: JaxpagedRollout, model: nnx.Module, tokenizer) -> tuple[bool, float]:
    """(greedy tokens equal Tunix's sampler on `model`, the largest logprob difference from Tunix's own)."""
    config = base_rollout.RolloutConfig(**GREEDY)
    c = model.config
    reference = vanilla_rollout.VanillaRollout(model, tokenizer, base_rollout.CacheConfig(
        cache_size=64, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim))  # fmt: skip
    ours, theirs = rollout.generate(PROMPTS, config), reference.generate(PROMPTS, config)
    assert np.array_equal(ours.left_padded_prompt_tokens, theirs.left_padded_prompt_tokens)
    same = [list(map(int, a)) for a in ours.tokens] == [list(map(int, b)) for b in theirs.tokens]
    completions = np.full((len(PROMPTS), MAX_TOKENS), tokenizer.pad_id(), np.int32)
    for row, tokens in zip(completions, theirs.tokens):
        row[: len(tokens)] = tokens
    prompts = jnp.asarray(theirs.left_padded_prompt_tokens)
    mine = np.asarray(rollout.get_per_token_logps(prompts, jnp.asarray(completions)))
    graphdef, state = nnx.split(model)
    want = np.asarray(common.compute_per_token_logps(graphdef, state, prompts, jnp.asarray(completions),
                                                     pad_id=tokenizer.pad_id(), eos_id=tokenizer.eos_id()))  # fmt: skip
    mask = completions != tokenizer.pad_id()
    return same, float(np.abs(mine - want)[mask].max())


@pytest.mark.parametrize("family, overrides", [("llama3", {"weight_tying": True}), ("qwen2", {}), ("qwen3", {})])
def test_rollout_equals_tunix_and_syncs_under_its_guards(family, overrides, tokenizer):
    model = tunix_model(family, **overrides)
    rollout = JaxpagedRollout(rollout_actor=model, tokenizer=tokenizer, mesh=None,
                              rollout_config=base_rollout.RolloutConfig(**GREEDY), **ENGINE)  # fmt: skip
    same, diff = compare(rollout, model, tokenizer)
    assert same and diff < 1e-4, (family, diff)
    # the trainer's step: new weights, synced as RLCluster.sync_weights does it on the CPU
    nnx.update(model, jax.tree.map(lambda x: x * 1.1, nnx.state(model, nnx.Param)))
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        rollout.update_params(nnx.state(model, nnx.Param), (nnx.Param,))
    same, diff = compare(rollout, model, tokenizer)
    assert same and diff < 1e-4, (family, diff)
    assert rollout.llm.get_stats()["num_compiles_after_warmup"] == 0
    assert rollout.pad_id() == tokenizer.pad_id() and rollout.eos_id() == tokenizer.eos_id()


def test_outputs_are_laid_out_as_tunix_lays_them_out(tokenizer):
    """Sampled (temperature, top-p, seed), with logprobs: completions cut before their first EOS, text decoded from
    them, one logprob per token and each the score of its token; the same seed gives the same completions."""
    model = tunix_model("llama3")
    config = base_rollout.RolloutConfig(max_tokens_to_generate=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7,
                                        max_prompt_length=16, kv_cache_size=64, return_logprobs=True)  # fmt: skip
    rollout = JaxpagedRollout(rollout_actor=model, tokenizer=tokenizer, rollout_config=config, **ENGINE)
    out = rollout.generate(PROMPTS, config)
    assert out.left_padded_prompt_tokens.shape == (len(PROMPTS), 16) and out.logits == []
    eos = tokenizer.eos_id()
    for tokens, text, logprobs in zip(out.tokens, out.text, out.logprobs):
        assert eos not in tokens.tolist() and len(logprobs) == len(tokens) and text == tokenizer.decode(tokens.tolist())
    again = rollout.generate(PROMPTS, config)
    assert [t.tolist() for t in again.tokens] == [t.tolist() for t in out.tokens]
    completions = np.full((len(PROMPTS), MAX_TOKENS), tokenizer.pad_id(), np.int32)
    for row, tokens in zip(completions, out.tokens):
        row[: len(tokens)] = tokens
    scores = np.asarray(rollout.get_per_token_logps(jnp.asarray(out.left_padded_prompt_tokens), jnp.asarray(completions)))
    for b, logprobs in enumerate(out.logprobs):
        np.testing.assert_allclose(scores[b, : len(logprobs)], logprobs, atol=1e-4)


def test_what_it_does_not_serve_is_named(tokenizer):
    with pytest.raises(ValueError, match="rollout_actor"):
        family_of(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    rollout = JaxpagedRollout(rollout_actor=tunix_model("qwen3"), tokenizer=tokenizer,
                              rollout_config=base_rollout.RolloutConfig(**GREEDY), **ENGINE)  # fmt: skip
    with pytest.raises(NotImplementedError, match="LoRA"):
        rollout.update_params({}, (nnx.LoRAParam,))


def test_grpo_trains_three_steps_with_jaxpaged_rollouts(tokenizer):
    """Tunix's GRPOLearner on its own RLCluster, reward function and trainer; after every weight sync the engine's
    greedy tokens and per-token logprobs equal those of the trainer's model (Tunix's sampler and
    compute_per_token_logps), and the synced weights moved."""
    model = tunix_model("llama3")
    checks = []

    class Checked(JaxpagedRollout):
        synced = False

        def update_params(self, params, filter_types=None):
            super().update_params(params, filter_types)
            self.synced = True  # checked outside Tunix's transfer guards: at the next generate, or after training

        def generate(self, prompts, rollout_config, **kwargs):
            if self.synced:
                self.check()
            return super().generate(prompts, rollout_config, **kwargs)

        def check(self):
            self.synced = False
            trained = self._actor  # the trainer's model: RLCluster's rollout_actor where the meshes are one
            norm = float(np.asarray(nnx.state(trained, nnx.Param)["final_norm"]["w"][...]).sum())
            checks.append((*compare(self, trained, tokenizer), norm))

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = {rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh, rl_cluster_lib.Role.ROLLOUT: mesh}
    cluster = rl_cluster_lib.RLCluster(actor=model, tokenizer=tokenizer.tokenizer, cluster_config=rl_cluster_lib.ClusterConfig(
        role_to_mesh=roles, rollout_engine=functools.partial(Checked, **ENGINE),
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optax.sgd(0.1), eval_every_n_steps=1000, max_steps=3),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=MAX_TOKENS, temperature=1.0, top_p=1.0,
                                                  max_prompt_length=16, kv_cache_size=64),
    ))  # fmt: skip

    def reward(prompts, completions, **kwargs):  # more "a"s, fewer other characters
        return [float(c.count("a")) - 0.1 * len(c) for c in completions]

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward,
                                       algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.0))  # fmt: skip
    learner.train([{"prompts": ["ab", "hello"]} for _ in range(3)])
    assert cluster.rollout._actor is cluster.actor_trainer.model
    cluster.rollout.check()
    assert cluster.global_steps == 3 and len(checks) == 3
    for same, diff, _ in checks:
        assert same and diff < 1e-4, checks
    assert len({norm for _, _, norm in checks}) == 3  # the trainer moved the weights every step
    assert cluster.rollout.llm.get_stats()["num_compiles_after_warmup"] == 0
