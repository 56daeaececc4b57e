"""Orbax checkpoints (issue 47 step 3): a Flax NNX state written in the test by orbax-checkpoint itself, loaded by
LLM(path) with its HF config beside it or named, from a Tunix-style CheckpointManager root (item model_params, the
latest step) under a trainer's names through checkpoint_mapping; greedy tokens then transformers'; unknown and missing
leaves named (tensor parallelism: test_orbax_tensor_parallel.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from flax import nnx
from jaxpaged import LLM, SamplingParams
from jaxpaged.models.loader import load_model

from tests.hf_reference import hf_greedy, random_prompts

ocp = pytest.importorskip("orbax.checkpoint")

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=8, num_kv_blocks=64, log_level="WARNING")
PROMPTS = random_prompts(256, [6, 15], seed=41)
MAX_TOKENS = 6


def _save(folder, tree) -> None:
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(folder, tree)
    checkpointer.wait_until_finished()


def _tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def port_state(model_dir):
    """The port's NNX state as a trainer holding a jaxpaged port would save it (nnx.state of the module)."""
    return nnx.state(load_model(model_dir).model)


def test_nnx_state_beside_its_config_and_named(model_dir, hf_model, port_state, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(f"{model_dir}/config.json", run / "config.json")  # as a trainer keeps it beside its checkpoints
    _save(run / "ckpt", port_state)
    want = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(str(run / "ckpt"), dtype="float32", **ENGINE)
    assert _tokens(llm) == want and llm.get_stats()["num_compiles_after_warmup"] == 0
    _save(tmp_path / "alone", port_state)
    with pytest.raises(FileNotFoundError, match="hf_config"):
        LLM(str(tmp_path / "alone"), dtype="float32", **ENGINE)
    assert _tokens(LLM(str(tmp_path / "alone"), hf_config=model_dir, dtype="bfloat16", **ENGINE))  # cast as it loads


def test_trainer_names_in_a_checkpoint_manager(model_dir, hf_model, tmp_path):
    """HF-layout tensors under a trainer's names, saved as Tunix's CheckpointManager saves them (a Composite with a
    model_params item, several steps); the latest step loads through checkpoint_mapping."""
    weights = {name.replace(".", "/"): t.detach().numpy() for name, t in hf_model.state_dict().items()}
    trainer = {"policy": {name: np.asarray(x) for name, x in weights.items()}, "rng_counter": np.zeros((), np.uint32)}
    manager = ocp.CheckpointManager(tmp_path / "ckpts", item_names=("model_params",))
    for step, scale in ((1, 0.5), (3, 1.0)):  # the first, with other values, must not be the one loaded
        tree = {**trainer, "policy": {k: v * scale for k, v in trainer["policy"].items()}}
        manager.save(step, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
    manager.wait_until_finished()
    manager.close()

    def mapping(name):
        return None if name == "rng_counter" else name.removeprefix("policy.").replace("/", ".")

    llm = LLM(str(tmp_path / "ckpts"), hf_config=model_dir, checkpoint_mapping=mapping, dtype="float32", **ENGINE)
    assert _tokens(llm) == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    with pytest.raises(ValueError, match="rng_counter"):  # a leaf nobody explained
        LLM(str(tmp_path / "ckpts"), hf_config=model_dir, checkpoint_mapping=lambda n: n.removeprefix("policy.").replace("/", "."),
            dtype="float32", **ENGINE)  # fmt: skip
    with pytest.raises(ValueError, match="lacks 1 parameter.*layers.1.mlp.up_proj.kernel"):
        LLM(str(tmp_path / "ckpts"), hf_config=model_dir, dtype="float32", **ENGINE,
            checkpoint_mapping=lambda n: None if n in ("rng_counter", "policy.model/layers/1/mlp/up_proj/weight") else mapping(n))  # fmt: skip
    with pytest.raises(ValueError, match="hf_config applies to Orbax checkpoints"):
        LLM(model_dir, hf_config=model_dir, **ENGINE)
