"""gpu_report.py's mla stage (issue 48 step 5): multi-head latent attention on the device, the MLA GPU kernel against
the pure-JAX MLA path on a DeepSeek-V2-Lite-shaped model, with their greedy tokens compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from workload import Stopwatch, random_prompts

if TYPE_CHECKING:
    from gpu_report import Partial


# DeepSeek-V2-Lite's released config.json (deepseek-ai/DeepSeek-V2-Lite: MLA with kv_lora_rank 512 + qk_rope_head_dim
# 64, 16 heads, no q low-rank path; 64 routed experts of 1408, top 6, two shared; the first layer dense), its 27 layers
# cut to 4: a bare config.json, so the engine draws random weights
MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 4,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400,
}  # fmt: skip
# --tiny: scripts/mla_kv_bytes.py's tiny DeepSeek-V3 (transformers.DeepseekV3Config's other defaults)
MLA_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
            "v_head_dim": 24, "qk_nope_head_dim": 32, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
            "num_experts_per_tok": 2}  # fmt: skip
# (side, attention_backend): the platform's default (on a GPU the MLA Triton kernel, pallas_kernels/mla_gpu.py), then
# the pure-JAX MLA path (ReferenceAttention: MlaAttention runs pallas_kernels/mla.py's absorbed form in JAX)
MLA_SIDES = (("kernel", "auto"), ("reference", "reference"))


def _mla_run(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Greedy requests through the engine step by step, timed in two windows: the prompts' steps (until every request
    is past its prompt), then the decode steps with the whole batch decoding, until the first request has its
    max_tokens; the others are then aborted, so the batch never drains through smaller step shapes (each a compile
    with precompile off). Each request's tokens (an aborted one's as far as it got), and the compiles during the run."""
    from jaxpaged import RequestOutputKind, SamplingParams
    from jaxpaged.utils import compile_monitor

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    sched, tokens, compiles = engine.scheduler, {}, compile_monitor.compile_count()
    steps, clock, prefill, decode = 0, Stopwatch(), None, None  # (seconds, steps, tokens) at each window's end
    past_prompts = False

    def sampled() -> int:  # tokens sampled so far (not those still in flight on the device)
        return sum(len(t) for t in tokens.values()) + sum(r.num_sampled_tokens for r in sched.running)

    while engine.has_unfinished_requests():
        finished = [o for o in engine.step() if o.finished]
        steps += 1
        tokens |= {o.request_id: list(o.outputs[0].token_ids) for o in finished}
        if prefill is None and past_prompts:  # a step later: with async scheduling the last prompt step is queued, not run
            prefill = (clock.seconds, steps, sampled())
        past_prompts = not sched.waiting and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in sched.running)
        if finished and decode is None:
            decode = (clock.seconds, steps, sampled())
            for rid in ids:
                if rid not in tokens:
                    aborted = engine.abort_request_with_output(rid)
                    tokens[rid] = [t for t in aborted.outputs[0].token_ids if t >= 0] if aborted else []  # no placeholders
    seconds = clock.seconds
    prefill = prefill or (seconds, steps, 0)
    decode = decode or (seconds, steps, sum(len(t) for t in tokens.values()))
    window_s, window_steps, window_tokens = decode[0] - prefill[0], decode[1] - prefill[1], decode[2] - prefill[2]
    if window_steps <= 0:  # a request done before every prompt was: no step had the whole batch decoding
        window_s = window_steps = window_tokens = 0
    return {"batch": len(prompts), "output_tokens": sum(len(t) for t in tokens.values()), "seconds": seconds, "steps": steps,
            "tok_s": sum(len(t) for t in tokens.values()) / seconds, "prefill_s": prefill[0], "prefill_steps": prefill[1],
            "decode_tokens": window_tokens, "decode_steps": window_steps, "decode_s": window_s,
            "decode_tok_s": window_tokens / window_s if window_s > 0 and window_tokens else None,
            "decode_step_ms": 1e3 * window_s / window_steps if window_steps else None,
            "compiles": compile_monitor.compile_count() - compiles, "tokens": [tokens[i] for i in ids]}  # fmt: skip


def first_divergence(a: list[list[int]], b: list[list[int]]) -> dict:
    """Two sides' greedy tokens, request by request, over the tokens both have (an aborted request's may stop a step
    apart): how many requests agree, and the earliest token that differs."""
    first, identical = None, 0
    for i, (x, y) in enumerate(zip(a, b)):
        at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
        identical += at is None
        if at is not None and (first is None or at < first["token"]):
            first = {"request": i, "token": at}
    return {"equal": first is None and len(a) == len(b), "identical_requests": identical, "requests": len(a),
            "compared_tokens": sum(min(len(x), len(y)) for x, y in zip(a, b)), "first_divergence": first}  # fmt: skip


def stage_mla(args, out: Partial) -> None:
    """Issue 48 step 5: multi-head latent attention on this device. A DeepSeek-V2-Lite-shaped random model (MLA_CONFIG:
    its released shape, 4 layers, the first dense) in bfloat16 decodes at batch 1 and 64 (prompts of 1000 random
    tokens, up to 128 greedy tokens, EOS ignored, prefix caching off) with the platform's default attention (on a GPU
    the MLA Triton kernel) and then with attention_backend "reference" (the pure-JAX MLA path): tok/s and step ms of
    the decode steps with the whole batch decoding (after every prompt, until the first request has its 128 tokens:
    the rest are aborted there, _mla_run), the whole run's tok/s, the engine's kv_bytes_per_token beside the same
    attention's expanded K/V (scripts/mla_kv_bytes.py), and whether the two sides' greedy tokens are equal (else the
    first that differs: bfloat16 sums in another order may). Each batch runs once untimed first (its step shapes
    compiled on first use: precompile off), and again if its timed run still compiled. --tiny: a tiny DeepSeek-V3,
    float32, on the CPU (both sides the pure-JAX path there, unless the CPU platform picks otherwise)."""
    import gc

    import jax
    import jax.numpy as jnp
    import mla_kv_bytes
    import numpy as np
    import transformers

    from jaxpaged import LLM

    tiny = args.tiny
    folder = Path(args.work) / ("mla-tiny" if tiny else "mla-v2-lite")
    folder.mkdir(parents=True, exist_ok=True)
    if tiny:
        config = transformers.DeepseekV3Config(**MLA_TINY)
        config.architectures = ["DeepseekV3ForCausalLM"]
        config.save_pretrained(folder)
    else:
        (folder / "config.json").write_text(json.dumps(MLA_CONFIG, indent=1))
    hf = transformers.AutoConfig.from_pretrained(folder)
    dtype = "float32" if tiny else args.dtype
    # --tiny: two prompts over the CPU's 256-token step budget, so the second's prompt ends a step later (the abort)
    batches, prompt_len, output_tokens = ((1, 2), 160, 8) if tiny else ((1, 64), 1000, 128)
    latent, expanded = mla_kv_bytes.bytes_per_token(hf.architectures[0], hf, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(0)  # one generator for every batch: each batch's prompts follow the one before's
    prompts = {b: random_prompts(b, prompt_len, 10, hf.vocab_size - 10, seed=rng) for b in batches}
    result = {"model": "DeepSeek-V3 (tiny)" if tiny else "DeepSeek-V2-Lite shape, 4 layers", "config": json.loads((folder / "config.json").read_text()),
              "dtype": dtype, "prompt_len": prompt_len, "output_tokens": output_tokens, "device": jax.devices()[0].device_kind,
              "formula_bytes_per_token": latent, "expanded_bytes_per_token": expanded, "sides": {}, "summary": []}  # fmt: skip
    out["mla"] = result
    tokens = {}
    for side, backend in MLA_SIDES:
        start = Stopwatch()
        llm = LLM(str(folder / "config.json"), dtype=dtype, attention_backend=backend, max_num_seqs=max(batches),
                  max_model_len=prompt_len + output_tokens + 16, num_kv_blocks=256 if tiny else 8192,
                  enable_prefix_caching=False, precompile=False, log_level="WARNING")  # fmt: skip
        engine = llm.engine
        chosen = engine.loaded.model.layers[0].self_attn.backend
        # MlaAttention runs the cached context in a kernel for these two backends (Mosaic's where it takes the cache)
        path = {"TritonAttention": "the MLA Triton kernel", "MosaicAttention": "the MLA Mosaic kernel"}.get(type(chosen).__name__, "pure JAX")
        entry = {"attention_backend": backend, "attention": f"{type(chosen).__name__}: {path}",
                 "kv_bytes_per_token": llm.get_stats()["kv_bytes_per_token"], "start_s": start.seconds, "runs": []}  # fmt: skip
        result["sides"][side] = entry
        out["mla"] = result
        for batch in batches:
            batch_clock = Stopwatch()
            # untimed: long enough that the whole batch decodes together, so the timed run's step shapes are met
            prompt_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
            _mla_run(engine, prompts[batch], min(output_tokens, prompt_steps + 8), f"w{batch}-")
            run = _mla_run(engine, prompts[batch], output_tokens, f"t{batch}-")
            if run["compiles"]:
                run = {**_mla_run(engine, prompts[batch], output_tokens, f"r{batch}-"), "retimed_after_compiles": run["compiles"]}
            run["warmup_and_runs_s"] = batch_clock.seconds
            tokens[side, batch] = run.pop("tokens")
            entry["runs"].append(run)
            entry["compiles_after_warmup"] = engine.num_compiles_after_warmup
            if side != MLA_SIDES[0][0] and (MLA_SIDES[0][0], batch) in tokens:
                mine, theirs = run, next(r for r in result["sides"][MLA_SIDES[0][0]]["runs"] if r["batch"] == batch)
                figures = lambda r: {k: r[k] for k in ("decode_tok_s", "decode_step_ms", "tok_s", "compiles")}
                ratio = theirs["decode_tok_s"] / mine["decode_tok_s"] if theirs["decode_tok_s"] and mine["decode_tok_s"] else None
                result["summary"].append({"batch": batch, "kernel": figures(theirs), "reference": figures(mine),
                                          "kernel_over_reference_decode_tok_s": ratio,
                                          "tokens": first_divergence(tokens[MLA_SIDES[0][0], batch], tokens[side, batch])})  # fmt: skip
            out["mla"] = result
        del llm, engine
        gc.collect()
