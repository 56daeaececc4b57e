"""A mixture-of-experts model beside a dense one with the same active parameters, on the same machine, in one run.

The pair (random weights, float32), chosen by --family:

- qwen3_moe (the default): a Qwen3-MoE-shaped model (--experts experts of --expert-size features, top --top-k) and a
  dense Qwen3 of the same hidden size, layers and heads whose MLP is top-k x expert-size wide, so a token passes
  through as many weights in both (the router's hidden x experts per layer aside, reported).
- gpt_oss: a GPT-OSS-shaped model (`GptOssForCausalLM`: q/k/v/o biases, a learned sink logit per head, layers
  alternating sliding (--sliding-window, 128 as in the released models) and full attention, YaRN RoPE as released
  (factor 32 over 4096 positions, theta 150000), a router with a bias choosing --top-k of --experts experts of
  --expert-size features, each with biases and the clamped SwiGLU) and a dense Qwen2 (`Qwen2ForCausalLM`) of the same
  attention shape: q/k/v biases, the same heads, the same sliding/full layer types, window and RoPE, and a SiLU-gated
  MLP top-k x expert-size wide without biases. What the dense side lacks: the sinks (heads per layer), o_proj's bias
  (hidden per layer), the router (hidden x experts + experts per layer, and its top-k and softmax) and the active
  experts' biases (top-k x (2 x expert-size + hidden) per layer); its activation is SiLU, not the clamped SwiGLU.
  Qwen2 is the dense architecture closest to GPT-OSS's attention: Llama has o_proj's bias too but no per-layer
  windows, and a window changes what the engine does (its own KV cache group, windowed attention).

Each side is driven through `jaxpaged.LLM`'s engine with --batch-sizes requests of --prompt-len random tokens and
--output-tokens greedy tokens each (EOS ignored). The sides alternate, their order flipped every round, for --rounds
rounds, so both share the machine's noise; each run records the load around it (scripts/machine_load.py). Reported
per side and batch size: the median output tokens/s and engine step time, and MoE / dense. --moe-kernel picks how the
MoE's layers run their experts (EngineConfig.moe_kernel: loop, or triton, the GPU's grouped-GEMM kernel, interpreted
on a CPU); it is passed to both sides' engines (the dense model has no expert to run) and recorded in the JSON.

--mxfp4 (with --family gpt_oss) gives the MoE side the released models' checkpoint format instead of a bare
config.json: an HF folder whose config.json says `quantization_config: {quant_method: mxfp4}` and whose
model.safetensors holds every expert weight as MXFP4 `_blocks`/`_scales` (uniform random 4-bit codes, scales near
1/sqrt(inner features) so activations stay finite) and every other tensor as random bfloat16 (write_mxfp4_folder).
With --moe-kernel triton the engine keeps those experts 4-bit (the grouped GEMM decodes them); with --moe-kernel
loop it dequantizes them once at load: the A/B of the 4-bit path. The dense side is unchanged. The JSON records
`mxfp4` and each side's weight bytes and memory plan, where the 4-bit saving shows.

--prefill measures prompts instead: by default 8 requests of 512 tokens, max_tokens=1, prefix caching off, timed as
prompt tokens/s; --max-num-batched-tokens sets the step's token budget (the engine's default: 256 on CPU), which
decides how full the MoE's expert tiles get.

    python scripts/bench_moe.py --json docs/data/moe_vs_dense_cpu_2026-11-26.json
    python scripts/bench_moe.py --prefill --max-num-batched-tokens 2048 --json docs/data/moe_prefill_cpu.json
    python scripts/bench_moe.py --family gpt_oss --experts 32 --expert-size 256 --top-k 4 --json gpt_oss.json
    python scripts/bench_moe.py --family gpt_oss --mxfp4 --moe-kernel triton --json gpt_oss_mxfp4.json

From Python, `main(argv, on_run=f)` calls f with each timed run's record as it ends (the JSON is written at the end
only), so a caller stopped part-way keeps the runs it finished (scripts/gpu_report.py's moe stages).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine_load  # noqa: E402 - the sibling script's module (this folder is on sys.path when run as a file)
import provenance  # noqa: E402
from workload import Stopwatch, random_prompts  # noqa: E402

log = logging.getLogger("bench")
SIDES = ("moe", "dense")
FAMILIES = ("qwen3_moe", "gpt_oss")
DECODE_DEFAULTS = {"batch_sizes": "1,16", "prompt_len": 32, "output_tokens": 256}
PREFILL_DEFAULTS = {"batch_sizes": "8", "prompt_len": 512, "output_tokens": 1}
MXFP4_GROUP = 32  # values a scale (models/mxfp4.py GROUP)
MXFP4_EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # GptOssExperts' [E, in, out] weights
E2M1_RMS = 2.926  # the root mean square of e2m1's 16 values, each code equally likely


def parse_args(argv=None) -> argparse.Namespace:
    from jaxpaged.config import MOE_KERNEL_CHOICES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe", help="the MoE's architecture and its dense "
                   "counterpart: qwen3_moe (against Qwen3) or gpt_oss (against Qwen2 with GPT-OSS's attention shape); "
                   "default: qwen3_moe")  # fmt: skip
    p.add_argument("--hidden", type=int, default=512, help="hidden size of both models (default: 512)")
    p.add_argument("--layers", type=int, default=8, help="(default: 8)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default: 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="(default: 4)")
    p.add_argument("--head-dim", type=int, default=64, help="(default: 64)")
    p.add_argument("--experts", type=int, default=16, help="experts per MoE layer (default: 16)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    p.add_argument("--expert-size", type=int, default=512, help="each expert's intermediate size; the dense MLP is "
                   "top-k x this wide (default: 512)")  # fmt: skip
    p.add_argument("--vocab", type=int, default=8192, help="(default: 8192)")
    p.add_argument("--sliding-window", type=int, default=128, help="--family gpt_oss: the window of every other layer "
                   "(default: 128, as in the released GPT-OSS models)")  # fmt: skip
    p.add_argument("--prefill", action="store_true", help="time prompt tokens/s of long prompts and max_tokens=1 "
                   "(prefix caching off) instead of decoding; changes the three defaults below")  # fmt: skip
    p.add_argument("--batch-sizes", default=None, help="concurrent requests per run, comma-separated (default: 1,16; "
                   "8 with --prefill)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default: 32; 512 with --prefill)")
    p.add_argument("--output-tokens", type=int, default=None, help="greedy tokens per request (default: 256; 1 with --prefill)")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="EngineConfig.max_num_batched_tokens of both "
                   "sides (default: the engine's)")  # fmt: skip
    p.add_argument("--dtype", default="float32", help="both sides' weights and compute (default: float32)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="each side's KV pool (both are held at once: on a "
                   "GPU each would otherwise size its pool from the free memory; default: the engine's)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="times each (side, batch size) runs, sides alternating (default: 3)")
    p.add_argument("--matmul-backend", default="auto", help="EngineConfig.matmul_backend of both sides (default: auto)")
    p.add_argument("--moe-kernel", choices=MOE_KERNEL_CHOICES, default="loop", help="EngineConfig.moe_kernel of both "
                   "sides: loop (the expert loop) or triton (the GPU's grouped-GEMM kernel; on a CPU interpreted) "
                   "(default: loop)")  # fmt: skip
    p.add_argument("--mxfp4", action="store_true", help="--family gpt_oss only: the MoE side loads an MXFP4 checkpoint "
                   "(random 4-bit experts, bfloat16 elsewhere), kept 4-bit with --moe-kernel triton, dequantized once "
                   "with loop; --hidden and --expert-size must be multiples of 32")  # fmt: skip
    p.add_argument("--settle-s", type=float, default=30.0, help="wait up to this long for the load to drop before each run")
    p.add_argument("--json", default=None, help="write the configs, every run and the summary here")
    args = p.parse_args(argv)
    defaults = PREFILL_DEFAULTS if args.prefill else DECODE_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if args.top_k > args.experts or min(args.batch_sizes, default=0) < 1:
        p.error("--top-k must be at most --experts, and every batch size at least 1")
    if args.mxfp4 and args.family != "gpt_oss":
        p.error(f"--mxfp4 needs --family gpt_oss (MXFP4 checkpoints are GPT-OSS's; got --family {args.family})")
    if args.mxfp4 and (args.hidden % MXFP4_GROUP or args.expert_size % MXFP4_GROUP):
        p.error(f"--mxfp4 needs --hidden and --expert-size to be multiples of {MXFP4_GROUP} (an MXFP4 block's values; "
                f"got {args.hidden} and {args.expert_size})")  # fmt: skip
    return args


def config_pair(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int,
                expert_size: int, vocab: int, max_positions: int = 2048, family: str = "qwen3_moe",
                sliding_window: int = 128) -> tuple[dict, dict]:  # fmt: skip
    """(MoE config.json, dense config.json), equal but for the MLP, the dense one top_k x expert_size wide, so both
    have the same active parameters apart from what parameter_counts reports as `not_in_dense`.

    qwen3_moe: Qwen3-MoE and Qwen3 (only the router differs); gpt_oss: GPT-OSS and Qwen2 (see the module docstring)."""
    if family == "gpt_oss":
        return gpt_oss_pair(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            experts=experts, top_k=top_k, expert_size=expert_size, vocab=vocab,
                            max_positions=max_positions, sliding_window=sliding_window)  # fmt: skip
    if family != "qwen3_moe":
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    shared = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    moe = dict(shared, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=experts,
               num_experts_per_tok=top_k, moe_intermediate_size=expert_size, intermediate_size=top_k * expert_size,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    dense = dict(shared, model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=top_k * expert_size)
    return moe, dense


# released GPT-OSS's RoPE: YaRN stretching 4096 positions 32 times (max_position_embeddings 131072)
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}  # fmt: skip


def gpt_oss_pair(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int,
                 expert_size: int, vocab: int, max_positions: int = 2048, sliding_window: int = 128) -> tuple[dict, dict]:  # fmt: skip
    """(GPT-OSS config.json, dense Qwen2 config.json with the same attention shape, windows and RoPE)."""
    shared = {
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": max(max_positions, 131072),
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0,
        "sliding_window": sliding_window, "rope_parameters": dict(GPT_OSS_ROPE),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }  # fmt: skip
    moe = dict(shared, model_type="gpt_oss", architectures=["GptOssForCausalLM"], attention_bias=True,
               num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=expert_size,
               swiglu_alpha=1.702, swiglu_limit=7.0, output_router_logits=False)  # fmt: skip
    dense = dict(shared, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                 max_window_layers=layers, intermediate_size=top_k * expert_size, hidden_act="silu")  # fmt: skip
    return moe, dense


def parameter_counts(config: dict) -> dict:
    """Parameters of a config_pair config: total, active per token (the experts a token does not use left out), the
    router's share of the active ones, and `not_in_dense`: the active parameters the dense counterpart has no match
    for, by kind (for Qwen3-MoE the router; for GPT-OSS also the sinks, o_proj's bias and the active experts' biases),
    so active - sum(not_in_dense.values()) is the dense side's active count."""
    h, layers, vocab, d = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"], config["head_dim"]
    heads = config["num_attention_heads"]
    q, kv = heads * d, config["num_key_value_heads"] * d
    kind = config["model_type"]
    attention = h * q + 2 * h * kv + q * h  # q, k, v, o
    if kind in ("qwen3", "qwen3_moe"):
        attention += 2 * d  # the q/k norms
    if kind in ("qwen2", "gpt_oss"):
        attention += q + 2 * kv  # q/k/v biases
    per_layer = attention + 2 * h  # and the two RMSNorms
    outer = vocab * h * (1 if config.get("tie_word_embeddings") else 2) + h  # embeddings, LM head, final norm
    if kind in ("qwen3", "qwen2"):
        mlp = 3 * h * config["intermediate_size"]
        total = outer + layers * (per_layer + mlp)
        return {"total": total, "active": total, "router": 0, "not_in_dense": {}}
    if kind == "qwen3_moe":
        expert, experts, k = 3 * h * config["moe_intermediate_size"], config["num_experts"], config["num_experts_per_tok"]
        router = h * experts
        total = outer + layers * (per_layer + router + experts * expert)
        return {"total": total, "active": outer + layers * (per_layer + router + k * expert), "router": layers * router,
                "not_in_dense": {"router": layers * router}}  # fmt: skip
    if kind != "gpt_oss":
        raise ValueError(f"no parameter count for model_type {kind!r}")
    i, experts, k = config["intermediate_size"], config["num_local_experts"], config["num_experts_per_tok"]
    sinks, o_bias = heads, h
    per_layer += sinks + o_bias
    router = h * experts + experts  # weight and bias
    expert_bias = 2 * i + h  # gate_up's and down's
    expert = 3 * h * i + expert_bias
    total = outer + layers * (per_layer + router + experts * expert)
    active = outer + layers * (per_layer + router + k * expert)
    extra = {"router": layers * router, "sinks": layers * sinks, "o_proj_bias": layers * o_bias,
             "expert_biases": layers * k * expert_bias}  # fmt: skip
    return {"total": total, "active": active, "router": layers * router, "not_in_dense": extra}


def write_configs(args, folder: Path) -> dict[str, Path]:
    moe, dense = config_pair(
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        experts=args.experts, top_k=args.top_k, expert_size=args.expert_size, vocab=args.vocab,
        max_positions=max(2048, args.prompt_len + args.output_tokens + 16), family=args.family,
        sliding_window=args.sliding_window,
    )  # fmt: skip
    paths = {}
    for side, config in zip(SIDES, (moe, dense)):
        (folder / side).mkdir(parents=True, exist_ok=True)
        paths[side] = folder / side / "config.json"  # a bare config.json: the engine draws random weights
        paths[side].write_text(json.dumps(config, indent=1))
    if getattr(args, "mxfp4", False):
        write_mxfp4_folder(paths["moe"])
    return paths


def model_path(paths: dict[str, Path], side: str) -> Path:
    """What the side's engine loads: its folder where a checkpoint sits beside the config.json, else the bare config."""
    folder = paths[side].parent
    return folder if (folder / "model.safetensors").exists() else paths[side]


def mxfp4_scale_center(inner: int) -> int:
    """The E8M0 scale (2^(s - 127)) that gives uniform random e2m1 codes a root mean square of about 1/sqrt(inner):
    a layer's outputs then about as large as its inputs."""
    import math

    return int(min(127, max(100, round(127 - math.log2(E2M1_RMS * math.sqrt(inner))))))


def write_mxfp4_folder(config_path: Path, seed: int = 0) -> dict[str, tuple]:
    """Turn the bare GPT-OSS config.json at config_path into an MXFP4 checkpoint beside it: config.json gets
    `quantization_config: {quant_method: mxfp4}` (transformers' modules_to_not_convert, as the released models), and
    model.safetensors every expert weight X [E, in, out] as X_blocks uint8 [E, out, in / 32, 16] (uniform random
    codes) and X_scales uint8 [E, out, in / 32] (mxfp4_scale_center(in) +- 1), every other tensor random bfloat16
    in its HF name (models/loader.py random_checkpoint, the experts not drawn). -> {expert weight: its [E, in, out]}."""
    import ml_dtypes
    import numpy as np
    from jaxpaged.models.loader import random_checkpoint
    from safetensors.numpy import save_file

    _, tensors = random_checkpoint(config_path, draw=lambda name: not name.endswith(MXFP4_EXPERT_WEIGHTS))
    rng = np.random.default_rng(seed)
    out, experts = {}, {}
    for name, value in tensors.items():
        if not name.endswith(MXFP4_EXPERT_WEIGHTS):
            out[name] = np.asarray(value).astype(ml_dtypes.bfloat16)
            continue
        e, inner, rows = experts[name] = tuple(value)
        groups = inner // MXFP4_GROUP
        center = mxfp4_scale_center(inner)
        out[name + "_blocks"] = rng.integers(0, 256, size=(e, rows, groups, 16), dtype=np.uint8)
        out[name + "_scales"] = rng.integers(center - 1, center + 2, size=(e, rows, groups), dtype=np.uint8)
    if not experts:
        raise ValueError(f"{config_path}: no expert weights ({', '.join(MXFP4_EXPERT_WEIGHTS)}) to write as MXFP4")
    save_file(out, str(config_path.parent / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads(config_path.read_text())
    hf_config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    config_path.write_text(json.dumps(hf_config, indent=1))
    return experts


def make_llm(path: Path, args):
    from jaxpaged import LLM

    extra = {"enable_prefix_caching": False} if args.prefill else {}  # every round's prompts are the same
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_kv_blocks:
        extra["num_kv_blocks"] = args.num_kv_blocks
    return LLM(str(path), dtype=args.dtype, max_num_seqs=max(args.batch_sizes), matmul_backend=args.matmul_backend,
               moe_kernel=args.moe_kernel, max_model_len=args.prompt_len + args.output_tokens + 16, log_level="WARNING",
               **extra)  # fmt: skip


def weight_record(llm) -> dict:
    """The engine's weights on the device: {"bytes": the runner's parameters' bytes, "plan": its memory plan (how they
    are stored: "MXFP4 experts kept 4-bit ..." where they are)}; None for what the engine does not tell."""
    from jaxpaged.models.weights import param_bytes

    runner = llm.engine.runner
    state, plan = getattr(runner, "state", None), getattr(runner, "memory_plan", None)
    return {"bytes": None if state is None else param_bytes(state), "plan": None if plan is None else plan()}


def prompts(args, batch: int) -> list[list[int]]:
    return random_prompts(batch, args.prompt_len, 2, args.vocab, seed=batch)  # the same prompts for both sides


def run_once(llm, args, batch: int, max_tokens: int) -> dict:
    """One batch through the engine, step by step: prompt and output tokens, steps and seconds; tok_s counts the
    prompt tokens with --prefill, the output tokens otherwise."""
    from jaxpaged import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for ids in prompts(args, batch):
        engine.add_request(None, {"prompt_token_ids": ids}, params)
    steps, tokens, clock = 0, 0, Stopwatch()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        steps += 1
    seconds = clock.seconds
    counted = batch * args.prompt_len if args.prefill else tokens
    return {"prompt_tokens": batch * args.prompt_len, "output_tokens": tokens, "steps": steps, "seconds": seconds,
            "tok_s": counted / seconds, "step_ms": 1e3 * seconds / steps}  # fmt: skip


def summary(runs: list[dict], batch_sizes: list[int]) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        row = {"batch": batch}
        for side in SIDES:
            mine = [r for r in runs if r["side"] == side and r["batch"] == batch]
            row[side] = {"tok_s": statistics.median(r["tok_s"] for r in mine), "step_ms": statistics.median(r["step_ms"] for r in mine),
                         "busy_runs": sum(r["load"]["busy"] for r in mine), "runs": len(mine),
                         "load_before": [round(r["load"]["loadavg_1min"]["before"], 2) for r in mine]}  # fmt: skip
        row["moe_over_dense_tok_s"] = row["moe"]["tok_s"] / row["dense"]["tok_s"]
        rows.append(row)
    return rows


def table(rows: list[dict], unit: str = "tok/s") -> str:
    w = len(unit) + 7
    lines = [f"{'batch':>5}{'MoE ' + unit:>{w}}{'dense ' + unit:>{w}}{'MoE/dense':>11}{'MoE step ms':>13}{'dense step ms':>15}"]
    for r in rows:
        lines.append(f"{r['batch']:>5}{r['moe']['tok_s']:>{w}.1f}{r['dense']['tok_s']:>{w}.1f}{r['moe_over_dense_tok_s']:>11.2f}"
                     f"{r['moe']['step_ms']:>13.1f}{r['dense']['step_ms']:>15.1f}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None, on_run=None) -> int:
    """on_run: called with each timed run's record ({"side", "batch", "round", ...run_once's keys, "load"}) as it ends."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        with Stopwatch() as written:
            paths = write_configs(args, Path(tmp))
        if args.mxfp4:
            log.info("moe: MXFP4 checkpoint written in %.1fs", written.seconds)
        configs = {side: json.loads(paths[side].read_text()) for side in SIDES}
        counts = {side: parameter_counts(configs[side]) for side in SIDES}
        log.info("parameters: %s", counts)
        llms = {}
        for side in SIDES:
            with Stopwatch() as warm:
                llms[side] = make_llm(model_path(paths, side), args)
                for batch in args.batch_sizes:  # untimed: every step shape of the workload, and first-use costs
                    run_once(llms[side], args, batch, 4)
            log.info("%s: loaded and warmed up in %.1fs", side, warm.seconds)
    runs = []
    for round_ in range(args.rounds):
        order = SIDES if round_ % 2 == 0 else SIDES[::-1]
        for batch in args.batch_sizes:
            for side in order:
                machine_load.settle(args.settle_s, machine_load.cores(), log=log.info)
                with machine_load.SideWatch(side) as watch:
                    run = run_once(llms[side], args, batch, args.output_tokens)
                runs.append({"side": side, "batch": batch, "round": round_, **run, "load": watch.record})
                if on_run is not None:
                    on_run(runs[-1])
                log.info("round %d, batch %d, %s: %.1f tok/s, %.1f ms a step, load before %.2f", round_, batch, side,
                         run["tok_s"], run["step_ms"], watch.record["loadavg_1min"]["before"])  # fmt: skip
    compiles = {side: llms[side].engine.num_compiles_after_warmup for side in SIDES}
    weights = {side: weight_record(llms[side]) for side in SIDES}
    rows = summary(runs, args.batch_sizes)
    extra = counts["moe"]["not_in_dense"]
    print(f"active parameters: MoE ({args.family}) {counts['moe']['active'] / 1e6:.3f}M of {counts['moe']['total'] / 1e6:.2f}M, "
          f"dense ({configs['dense']['model_type']}) {counts['dense']['active'] / 1e6:.3f}M; the MoE's without a dense "
          f"match: " + ", ".join(f"{name} {n / 1e3:.1f}K" for name, n in extra.items()))  # fmt: skip
    print(table(rows, "prompt tok/s" if args.prefill else "tok/s"))
    if all(w["bytes"] is not None for w in weights.values()):
        how = {side: (w["plan"] or "").partition(";")[0].partition(" MB ")[2] for side, w in weights.items()}  # "(dtype, ...)"
        print(f"weights: MoE{' (MXFP4 checkpoint)' if args.mxfp4 else ''} {weights['moe']['bytes'] / 1e6:.1f} MB "
              f"{how['moe']}, dense {weights['dense']['bytes'] / 1e6:.1f} MB {how['dense']}")  # fmt: skip
    for line in machine_load.busy_lines({f"{r['side']} batch {r['batch']} round {r['round']}": r["load"] for r in runs}):
        print(line)
    if any(compiles.values()):
        print(f"WARNING: compiles after warm-up: {compiles}")
    if args.json:
        out = {"date": provenance.today(), "cpu": machine_load.cpu_model(), "cores": machine_load.cores(),
               "jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "python": platform.python_version(),
               "args": vars(args), "moe_kernel": args.moe_kernel, "mxfp4": args.mxfp4, "configs": configs,
               "parameters": counts, "weight_bytes": {side: weights[side]["bytes"] for side in SIDES},
               "memory_plan": {side: weights[side]["plan"] for side in SIDES},
               "compiles_after_warmup": compiles,
               "matmul_backend": {side: llms[side].engine.runner.matmul_backend for side in SIDES},
               "summary": rows, "runs": runs}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
