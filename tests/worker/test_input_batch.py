"""The input batch keeps a row per scheduler slot on the host between steps (block tables, sampling constants) and
computes positions, slots and offsets in numpy: every step it packs must equal the step packed row by row from the
scheduler's output and the KV cache manager's tables (the definition), and its sampling metadata the row-wise
build's, through forks with copy-on-write, prefix-cache hits, preemptions, chunked prefill and slots taken again
by other sequences."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.kv_cache_manager import slot_mapping
from jaxpaged.worker.packing import Packed
from tests.hf_reference import random_hf_model, random_prompts, save_hf_model, tiny_llama_config

VOCAB = 256


def reference_step(output, kv, t: int, s: int, table_width: int, block_size: int) -> dict[str, np.ndarray]:
    """A step's arrays row by row, straight from each scheduled sequence's block table (the definition)."""
    ids, positions, slots = np.zeros(t, np.int32), np.zeros(t, np.int32), np.full(t, -1, np.int32)
    tables, seq_lens = np.zeros((s, table_width), np.int32), np.zeros(s, np.int32)
    query_start_loc, logit_rows, prev_rows = np.zeros(s + 1, np.int32), np.zeros(s, np.int32), np.full(t, -1, np.int32)
    cursor = 0
    for j, item in enumerate(output.scheduled):
        req, start, n = item.request, item.start, item.num_tokens
        table = kv.block_table(req.seq_id)
        if item.prev_row < 0 or n > 1:
            ids[cursor : cursor + n] = req.tokens_at(start, n)
        if item.prev_row >= 0:
            prev_rows[cursor + n - 1] = item.prev_row
        positions[cursor : cursor + n] = np.arange(start, start + n)
        slots[cursor : cursor + n] = slot_mapping(table, start, n, block_size)
        tables[j, : len(table)] = table
        seq_lens[j] = start + n
        cursor += n
        query_start_loc[j + 1] = cursor
        logit_rows[j] = cursor - 1
    query_start_loc[len(output.scheduled) + 1 :] = cursor
    return {"input_ids": ids, "positions": positions, "slot_mapping": slots, "block_tables": tables, "seq_lens": seq_lens,
            "query_start_loc": query_start_loc, "logit_rows": logit_rows, "prev_rows": prev_rows}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = random_hf_model(tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    return str(save_hf_model(hf, tmp_path_factory.mktemp("tiny-llama-batch")))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_packed_step_equals_the_row_by_row_definition(model_dir, async_scheduling):
    # a small pool (preemptions), few sequences a step (the host table's rows run out and are handed back),
    # n > 1 (forks, copy-on-write), a repeated prompt (prefix-cache hits), a small token budget (chunked prefill)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, block_size=8, num_kv_blocks=20,
              async_scheduling=async_scheduling, log_level="WARNING")  # fmt: skip
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    builder = runner.input_batch
    build, checked, occupants = builder.build, [], {}

    def checking_build(output, with_sampling=True):
        step = build(output, with_sampling)
        t, s = runner.bucket_for(output.num_tokens)
        want = reference_step(output, scheduler.kv, t, s, runner.table_width, runner.block_size)
        got = {**dataclasses.asdict(step.attention), "input_ids": step.input_ids, "positions": step.positions,
               "logit_rows": step.logit_rows, "prev_rows": step.prev_rows if step.prev_rows is not None else np.full(t, -1)}
        for name, array in want.items():
            np.testing.assert_array_equal(got[name], array, err_msg=name)
        if with_sampling:  # from the slots' constants, or row by row: the same values
            rowwise = builder.sampling(output, t)
            for field in dataclasses.fields(rowwise):
                np.testing.assert_array_equal(getattr(step.sampling, field.name), getattr(rowwise, field.name), err_msg=field.name)
        for item in output.scheduled:
            occupants.setdefault(item.request.slot, set()).add(item.request.seq_id)
        checked.append(len(output.scheduled))
        return step

    builder.build = checking_build
    prompts = random_prompts(VOCAB, [5, 17, 40, 9, 23, 33, 2, 60, 12, 31], seed=3)
    prompts += [prompts[2] + [5, 6, 7]] * 2  # its first blocks are cached by then
    params = [SamplingParams(n=1 + i % 3, temperature=0.8 if i % 4 else 0.0, top_p=0.9 if i % 5 == 1 else 1.0, seed=i,
                             max_tokens=12 + 3 * i, ignore_eos=True, logprobs=1 if i == 6 else None)
              for i in range(len(prompts))]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(c.finish_reason == "length" for o in outs for c in o.outputs)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert len(checked) > 50 and any(len(seqs) > 1 for seqs in occupants.values())  # slots passed on
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_packed_arrays_come_back_whole_inside_jit():
    import jax

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Knobs:
        scale: np.ndarray
        seeds: np.ndarray
        flag: np.ndarray
        missing: object = None

    rng = np.random.default_rng(0)
    tree = (rng.integers(-5, 5, (3, 4)).astype(np.int32),
            Knobs(rng.standard_normal(5).astype(np.float32), np.array([0, 2**32 - 1, 7], np.uint32), np.array(True)),
            np.zeros((0,), np.int32))  # fmt: skip
    packed = Packed.of(tree)
    assert packed.data.dtype == np.int32 and packed.data.shape == (12 + 5 + 3 + 1,)
    back = jax.jit(lambda p: p.unpack())(packed)
    for got, want in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    assert back[1].missing is None
    with pytest.raises(TypeError, match="float64"):
        Packed.of((np.zeros(2),))
