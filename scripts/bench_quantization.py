"""Quantization schemes side by side, in one run: weight bytes, KV tokens a fixed KV budget holds, throughput,
perplexity on a fixed text and greedy agreement with the float model.

Every scheme is one engine on the same model: float32 (the reference), bfloat16, weights quantized at load (int8,
fp8; w8a8-*: with activations quantized too), the GGUF as stored (Q4_1/Q8_0 for the built-in model) and the KV
cache in int8 or fp8, alone or combined. A
GGUF model is first exported to an HF folder of its dequantized weights (scripts/export_hf.py), which every scheme
but "gguf" loads, so all of them start from the same floats.

- weights: bytes of the parameters on the device (scales included);
- KV: blocks and tokens --kv-budget-mb holds at the scheme's bytes per token;
- throughput: the engine issue's workload (--num-requests, lengths in --min-len..--max-len, greedy, EOS ignored),
  output tokens per second, with the machine's load around it (scripts/machine_load.py) and a busy flag;
- perplexity: exp(mean NLL) of scripts/data/public_domain_text.txt, in --window-token windows (prompt logprobs),
  and the mean |logprob difference| per token against float32;
- agreement: --agree-prompts greedy continuations of --agree-tokens tokens from prefixes of the text: the share of
  outputs identical to float32's, and the mean share of each output's tokens before the first difference.

    python scripts/bench_quantization.py --json docs/data/bench_quantization_cpu.json           # the built-in model
    python scripts/bench_quantization.py --model llama_config.json --schemes float32,int8,kv-int8  # random weights

--matmuls times one projection's matmul alone, per row count: in XLA float32, the int8 or fp8 weight dequantized
into the dot (weight-only, what `ChannelLinear` does) and the 8-bit dot with activations quantized per row too
(W8A8: `ChannelLinear(activations=True)`, what `quantize_activations` runs), the choice the quantization issue asks
to measure; on a CPU where it builds, also the native packed matmul
(platforms/cpu/matmul.cc) over float32, int8 and fp8 panels (what the engine runs with matmul_backend "native").
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import re
import sys
import tempfile
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import machine_load  # noqa: E402 - the sibling script's module (this folder is on sys.path when run as a file)
import provenance  # noqa: E402
from workload import Stopwatch, median_seconds, random_prompts, uniform_requests  # noqa: E402

log = logging.getLogger("bench")
TEXT = Path(__file__).with_name("data") / "public_domain_text.txt"

# name -> LLM keyword arguments; "gguf" loads the GGUF itself, every other scheme the exported floats
SCHEMES = {
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "kv-fp8": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "int8+kv-int8": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "int8"},
    "fp8+kv-fp8": {"dtype": "float32", "quantization": "fp8", "kv_cache_dtype": "fp8"},
    "gguf+kv-int8": {"dtype": "float32", "quantization": "gguf", "kv_cache_dtype": "int8"},
    "w8a8-int8": {"dtype": "float32", "quantization": "int8", "quantize_activations": True},
    "w8a8-fp8": {"dtype": "float32", "quantization": "fp8", "quantize_activations": True},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf (default: the built-in model), an HF folder or a config.json")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, from {', '.join(SCHEMES)}")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--reference", default="float32", help="the scheme the others are compared with, run first (default: float32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="step token budget (default: the platform's)")
    p.add_argument("--dtype", default="float32", help="the compute dtype of every scheme but float32, the reference "
                   "(default float32; bfloat16 on a GPU/TPU, where a bfloat16 scheme is what quantization is weighed against)")
    p.add_argument("--kv-budget-mb", type=float, default=64.0, help="KV pool size every scheme gets (default: 64)")
    p.add_argument("--window-tokens", type=int, default=256)
    p.add_argument("--agree-prompts", type=int, default=16)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--settle-s", type=float, default=60.0, help="wait up to this long for the load to drop before each scheme")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--matmuls", action="store_true", help="only time one matmul per method and row count (see above)")
    p.add_argument("--matmul-shape", default="576,1536", help="with --matmuls: K,N of the weight (default: the built-in model's MLP)")
    p.add_argument("--matmul-rows", default="1,8,64,256", help="with --matmuls: the row counts")
    p.add_argument("--matmul-dtype", default="float32", help="with --matmuls: the activations' dtype")
    args = p.parse_args(argv)
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown:
        p.error(f"unknown scheme(s) {unknown}; choose from {', '.join(SCHEMES)}")
    return args


def sources(model: str | None, workdir: Path) -> tuple[str, str | None]:
    """(the float source every scheme loads, the GGUF the "gguf" schemes load, or None)."""
    from jaxpaged.models.builtin import builtin_gguf_path

    import export_hf

    path = Path(model) if model else Path(builtin_gguf_path())
    if path.suffix == ".json":  # random weights, drawn once (a 1B model's take 10-20 s) and loaded by every scheme
        log.info("writing %s's random weights to an HF folder", path.name)
        return str(export_hf.export_random(str(path), workdir / "random")), None
    if path.suffix != ".gguf":
        return str(path), None

    log.info("exporting %s to an HF folder of its dequantized weights", path.name)
    return str(export_hf.export(str(path), workdir / "hf")), str(path)


def kv_blocks(llm_config, kv_cache_dtype: str, dtype: str, budget_bytes: float, block_size: int) -> int:
    from jaxpaged.pallas_kernels.kv_quant import kv_bytes_per_token_head

    cfg = llm_config
    per_block = cfg.num_layers * 2 * cfg.num_kv_heads * block_size * kv_bytes_per_token_head(cfg.head_dim, kv_cache_dtype, dtype)
    return max(1, int(budget_bytes // per_block))


def model_shape(source: str, kwargs: dict):
    """The model's ModelConfig (layers, KV heads, head dim, vocab): read from its config.json where it has one
    (a probe engine would load the weights once more), else from a probe engine with one KV block."""
    from jaxpaged import LLM

    config = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
    if config.suffix == ".json" and config.exists():
        from jaxpaged.models.loader import model_config

        return model_config(config)
    probe_kwargs = {k: v for k, v in kwargs.items() if k != "max_num_batched_tokens"}
    probe = LLM(model=source, num_kv_blocks=1, max_num_seqs=1, max_num_batched_tokens=16, precompile=False, **probe_kwargs)
    return probe.engine.loaded.config


def text_tokens(tokenizer, vocab: int) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode(TEXT.read_text())
    # a random-weight model without a tokenizer: a fixed random text
    return random_prompts(1, 1500, 10, vocab - 10, seed=0)[0]


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    """bench_throughput's uniform draw (scripts/workload.py), prompts and outputs over --min-len..--max-len."""
    lengths = (args.min_len, args.max_len)
    return uniform_requests(args.num_requests, lengths, lengths, vocab, args.seed)


def perplexity(llm, tokens: list[int], window: int) -> tuple[float, list[float]]:
    """exp(mean NLL) over the text in windows (each window's first token has no logprob), and every logprob."""
    from jaxpaged import SamplingParams

    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    logprobs = []
    for w, out in zip(windows, outs):
        for tok, entry in zip(w[1:], out.prompt_logprobs[1:]):
            logprobs.append(entry[tok].logprob)
    return math.exp(-float(np.mean(logprobs))), logprobs


def greedy(llm, tokens: list[int], args) -> list[list[int]]:
    from jaxpaged import SamplingParams

    step = max(1, (len(tokens) - 64) // args.agree_prompts)
    prompts = [{"prompt_token_ids": tokens[i * step : i * step + 32]} for i in range(args.agree_prompts)]
    params = SamplingParams(max_tokens=args.agree_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    def prefix(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(1, len(b))

    return {"identical_share": float(np.mean([a == b for a, b in zip(outputs, reference)])),
            "mean_prefix_share": float(np.mean([prefix(a, b) for a, b in zip(outputs, reference)]))}  # fmt: skip


def throughput(llm, reqs) -> tuple[float, int, float]:
    from jaxpaged import SamplingParams

    llm.generate([{"prompt_token_ids": reqs[0][0][:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in reqs]
    with Stopwatch() as run:
        outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in reqs], params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / run.seconds, tokens, run.seconds


def run_scheme(name: str, args, float_source: str, gguf: str | None, reference: dict | None) -> dict:
    from flax import nnx

    from jaxpaged import LLM
    from jaxpaged.models.weights import param_bytes

    kwargs = dict(SCHEMES[name])
    if name != "float32" and "dtype" in kwargs and name != "bfloat16":
        kwargs["dtype"] = args.dtype
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    source = gguf if name.startswith("gguf") else float_source
    if source is None:
        raise SystemExit(f"scheme {name} needs a GGUF model")
    block_size = 16
    cfg = model_shape(source, kwargs)
    blocks = kv_blocks(cfg, kwargs.get("kv_cache_dtype", "auto"), kwargs["dtype"], args.kv_budget_mb * 1e6, block_size)
    llm = LLM(model=source, num_kv_blocks=blocks, block_size=block_size, max_num_seqs=args.max_num_seqs,
              max_model_len=max(args.window_tokens, 2 * args.max_len, 32 + args.agree_tokens) + 16, **kwargs)  # fmt: skip
    runner = llm.engine.runner
    record = {"scheme": name, "engine": kwargs, "source": source, "weight_bytes": param_bytes(nnx.state(runner.state)),
              "kv_blocks": blocks, "kv_tokens": blocks * block_size, "kv_block_bytes": runner.block_bytes}  # fmt: skip
    tokens = text_tokens(llm.get_tokenizer() if hasattr(llm, "get_tokenizer") else llm.engine.tokenizer, cfg.vocab_size)
    record["perplexity"], logprobs = perplexity(llm, tokens, args.window_tokens)
    outputs = greedy(llm, tokens, args)
    if reference is not None:
        record["mean_abs_logprob_diff"] = float(np.mean(np.abs(np.asarray(logprobs) - np.asarray(reference["logprobs"]))))
        record["agreement"] = agreement(outputs, reference["outputs"])
    if not args.skip_throughput:
        machine_load.settle(args.settle_s, machine_load.cores(), log=log.info)
        with machine_load.SideWatch(name) as watch:
            record["tok_s"], record["output_tokens"], record["seconds"] = throughput(llm, workload(args, cfg.vocab_size))
        record["load"] = watch.record
    log.info("%s: %s", name, {k: v for k, v in record.items() if k not in ("engine", "load")})
    return record | {"_logprobs": logprobs, "_outputs": outputs}


def table(records: list[dict]) -> str:
    base = records[0]
    lines = [f"{'scheme':<14}{'weights MB':>11}{'x':>6}{'KV tokens':>11}{'x':>6}{'tok/s':>8}{'x':>6}{'ppl':>8}"
             f"{'|dlogp|':>9}{'same out':>9}{'prefix':>8}"]  # fmt: skip
    for r in records:
        agree = r.get("agreement", {"identical_share": 1.0, "mean_prefix_share": 1.0})
        tok_s = r.get("tok_s")
        lines.append(
            f"{r['scheme']:<14}{r['weight_bytes'] / 1e6:>11.1f}{base['weight_bytes'] / r['weight_bytes']:>6.2f}"
            f"{r['kv_tokens']:>11d}{r['kv_tokens'] / base['kv_tokens']:>6.2f}"
            + (f"{tok_s:>8.1f}{tok_s / base['tok_s']:>6.2f}" if tok_s else f"{'-':>8}{'-':>6}")
            + f"{r['perplexity']:>8.3f}{r.get('mean_abs_logprob_diff', 0.0):>9.4f}"
            f"{agree['identical_share']:>9.0%}{agree['mean_prefix_share']:>8.0%}"
        )
    return "\n".join(lines)


def time_matmuls(k: int = 576, n: int = 1536, rows=(1, 8, 64, 256), iters: int = 50, dtype: str = "float32") -> list[dict]:
    """Median ms of one [rows, k] x [k, n] matmul per method (the built-in model's MLP up-projection by default),
    activations in `dtype`: the float weight; int8 and fp8 weights dequantized into the dot (weight-only, what
    ChannelLinear does); and 8-bit dots with the activations quantized per row too (W8A8: XLA's int8 dot, and an
    fp8 x fp8 dot, which XLA hands to the fp8 tensor cores on GPUs that have them); on a CPU, float32 activations,
    also the native packed matmul over each weight (int8 and fp8 decoded in the kernel)."""
    import jax
    import jax.numpy as jnp
    from jaxpaged.models.quantization import ChannelLinear

    rng = np.random.default_rng(0)
    act = jnp.dtype(dtype)
    q = jnp.asarray(rng.integers(-127, 128, (k, n)).astype(np.int8))
    scale = jnp.asarray(rng.random(n).astype(np.float32) / 100)
    w = (q.astype(jnp.float32) * scale).astype(act)
    f8 = jnp.asarray(rng.normal(size=(k, n)).astype(np.float32)).astype(jnp.float8_e4m3fn)

    int8, fp8 = (SimpleNamespace(kernel=kernel, scale=scale) for kernel in (q, f8))  # what a Linear holds
    methods = {act.name: lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32),
               "int8 weight-only": partial(ChannelLinear().apply, int8), "int8 dot (W8A8)": partial(ChannelLinear(True).apply, int8),
               "fp8 weight-only": partial(ChannelLinear().apply, fp8), "fp8 dot (W8A8)": partial(ChannelLinear(True).apply, fp8),
               "fp8 dot f8 (W8A8)": partial(ChannelLinear(True, "float8").apply, fp8)}  # fmt: skip
    methods.update(native_matmuls(w, q, f8, scale) if act == jnp.float32 else {})
    out = []
    for r in rows:
        x = jnp.asarray(rng.normal(size=(r, k)).astype(np.float32)).astype(act)
        for name, f in methods.items():
            try:
                g = jax.jit(f).lower(x).compile()  # compiled once: timed below, and its HLO read for the dots
                g(x).block_until_ready()
            except Exception as e:  # noqa: BLE001 - a device without the dot: reported, the others still timed
                out.append({"rows": r, "method": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"rows {r:>5}  {name:<18} unsupported: {out[-1]['error'][:100]}")
                continue
            # warm-up untimed: a CPU call's first dozens of runs measured up to 3x slower
            seconds = median_seconds(g, x, iters=iters, warmup=max(3, iters // 5))
            dots = dot_operand_types(g.as_text())
            out.append({"rows": r, "method": name, "ms": seconds * 1e3, "dots": dots})
            print(f"rows {r:>5}  {name:<18} {out[-1]['ms']:.3f} ms   dot operands: {', '.join(dots) or '-'}")
    return out


HLO_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (\w+)\[")
HLO_OPERAND = re.compile(r"(?:(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+)?%([\w.\-]+)")
HLO_DOT = re.compile(r"= (?:\([^)]*\)|\w+\[[^\]]*\](?:\{[^}]*\})?) (dot|custom-call)\(([^)]*)\)(.*)$")  # a GEMM returns a tuple


def dot_operand_types(hlo: str) -> list[str]:
    """What each matmul of a compiled program multiplies, from its optimized HLO: "s8 x s8" for an int8 dot,
    "f8e4m3fn x f8e4m3fn (__cublas$lt$matmul$f8)" where XLA:GPU took the fp8 GEMM, "f32 x f32" where the 8-bit
    weight was widened first. The check that a W8A8 method really runs on 8-bit units."""
    types = {}
    for line in hlo.splitlines():
        m = HLO_DEFINITION.match(line)
        if m:
            types[m.group(1)] = m.group(2)
    found = []
    for line in hlo.splitlines():
        m = HLO_DOT.search(line)
        if not m:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', m.group(3))
        if m.group(1) == "custom-call" and not (target and re.search("gemm|matmul", target.group(1), re.I)):
            continue
        # each operand printed with its shape ("s8[4,64]{1,0} %p") or only by name ("%p")
        operands = HLO_OPERAND.findall(m.group(2))[:2]
        kinds = [dtype or types.get(name, "?") for dtype, name in operands]
        found.append(" x ".join(kinds) + (f" ({target.group(1)})" if target else ""))
    return found


def native_matmuls(w, q, f8, scale) -> dict:
    """The native CPU matmul over the same weights, packed once as the engine packs them (none where it does not
    build, or off the CPU)."""
    import jax

    from jaxpaged.platforms.cpu import matmul as cpu_matmul

    if jax.default_backend() != "cpu" or not cpu_matmul.available():
        return {}
    n = w.shape[1]
    packed = {name: cpu_matmul.pack(v) for name, v in (("float32", w), ("int8", q), ("fp8", f8))}
    return {"native float32": lambda x: cpu_matmul.packed_matmul(x, packed["float32"], n),
            "native int8": lambda x: cpu_matmul.packed_matmul(x, packed["int8"], n, scale),
            "native fp8": lambda x: cpu_matmul.packed_matmul(x, packed["fp8"], n, scale)}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    import jax

    if args.matmuls:
        before = machine_load.load1()
        k, n = (int(v) for v in args.matmul_shape.split(","))
        rows = tuple(int(v) for v in args.matmul_rows.split(","))
        results = time_matmuls(k, n, rows, dtype=args.matmul_dtype)
        print(f"load average before {before:.2f}, after {machine_load.load1():.2f} on {machine_load.cores()} cores")
        if args.json:
            Path(args.json).write_text(json.dumps({"date": provenance.today(), "jax": jax.__version__,
                                                   "device": jax.devices()[0].device_kind, "matmuls": results,
                                                   "load": [before, machine_load.load1()]}, indent=1))  # fmt: skip
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        float_source, gguf = sources(args.model, Path(tmp))
        schemes = [args.reference] + [s for s in args.schemes if s != args.reference]
        if gguf is None:
            schemes = [s for s in schemes if not s.startswith("gguf")]
        records, reference = [], None
        meta = {"date": provenance.today(), "jax": jax.__version__, "device": jax.devices()[0].device_kind,
                "cpu": machine_load.cpu_model(), "cores": machine_load.cores(), "python": platform.python_version(),
                "args": {k: v for k, v in vars(args).items()}}  # fmt: skip
        for name in schemes:
            record = run_scheme(name, args, float_source, gguf, reference)
            if reference is None:
                reference = {"logprobs": record["_logprobs"], "outputs": record["_outputs"]}
            records.append({k: v for k, v in record.items() if not k.startswith("_")})
            print(table(records), flush=True)  # after each scheme: a run cut short still reports the ones done
            if args.json:
                Path(args.json).write_text(json.dumps({"meta": meta, "schemes": records}, indent=1))
    for line in machine_load.busy_lines({r["scheme"]: r["load"] for r in records if "load" in r}):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
