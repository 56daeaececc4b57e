"""gpu_report.py's report: the JSON of every stage's results, and the short Markdown summary the run prints last,
one line per figure a goal of issue 33 (and issues 44 and 48 after it) asks for.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / f"{stem}.md").write_text(summary_table(report))


def _f(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _workload_lines(stage: dict, hf: dict | None, prefix: str) -> list[str]:
    """A cold stage's ceilings, workload against the floor and transformers, and traced decode step."""
    if not stage.get("workload") and not stage.get("rates"):
        return []
    lines = []
    rates = stage.get("rates", {})
    lines.append(prefix + f"copy {_f(rates.get('copy_gbs'))} GB/s, matmul {_f(rates.get('matmul_tflops'))} TFLOP/s")
    w = stage.get("workload")
    if w:
        floor = (f"{100 * w['of_roofline']:.1f}% of the floor ({w['roofline_tok_s']:.0f} tok/s)" if "of_roofline" in w
                 else "floor not measured")  # fmt: skip
        lines.append(prefix + f"workload: {w['requests']} requests, {w['output_tokens']} output tokens in {w['seconds']:.1f} s = "
                     f"**{w['tok_s']:.0f} tok/s**, {floor}; {w['steps']} steps, {w['ms_per_step']:.2f} ms a step; "
                     f"compiles after warm-up {w['compiles_after_warmup']}")
        lines.append(prefix + "host ms a step (wall): " + ", ".join(f"{k} {v:.2f}" for k, v in w["host_ms_per_step"].items()))
        lines.append(prefix + "device calls, host ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in w["calls_ms_per_step"].items()))
    if hf and w:
        lines.append(prefix + f"transformers continuous batching: {hf['tok_s']:.0f} tok/s; jaxpaged is {w['tok_s'] / hf['tok_s']:.1f}x")
    prof = stage.get("decode_profile")
    if prof:
        lines.append(prefix + f"decode at {prof['rows']} rows: {prof['ms_per_step']:.2f} ms a step, host CPU "
                     f"{prof['host_cpu_ms_total']:.2f} ms (" + ", ".join(f"{k} {v:.2f}" for k, v in prof['host_cpu_ms_per_step'].items()) + ")")
        trace = prof.get("trace")
        if trace:
            lines.append(prefix + "device per step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in trace["per_step_ms"].items())
                         + f"; busy {100 * trace['busy_fraction']:.1f}% of the span, idle gaps {trace['idle_ms_per_step']:.3f} ms a step")
        elif prof.get("trace_error"):
            lines.append(prefix + f"trace: {prof['trace_error']}")
    return lines


def _mla_lines(mla: dict | None) -> list[str]:
    """The mla stage: each side's attention and KV bytes a token, then per batch the kernel's decode against the
    pure-JAX path's and whether their greedy tokens agree (a side's runs alone while the other has not run)."""
    if not mla:
        return []
    lines, compared = [], {row["batch"] for row in mla["summary"]}
    for side, s in mla["sides"].items():
        kv = s["kv_bytes_per_token"]
        lines.append(f"MLA {side} side ({s['attention']}, {mla['model']}, {mla['dtype']}): KV {kv} bytes a token "
                     f"(formula {mla['formula_bytes_per_token']}), expanded K/V would be {mla['expanded_bytes_per_token']} "
                     f"(x{mla['expanded_bytes_per_token'] / kv:.1f}); compiles after warm-up {s.get('compiles_after_warmup')}")
        for r in s["runs"]:
            if r["batch"] not in compared:
                lines.append(f"MLA {side} at batch {r['batch']}: decode {_f(r['decode_tok_s'], '{:.0f}')} tok/s, step "
                             f"{_f(r['decode_step_ms'], '{:.2f}')} ms; the whole run {r['tok_s']:.0f} tok/s")
    for row in mla["summary"]:
        k, r, t = row["kernel"], row["reference"], row["tokens"]
        first = t["first_divergence"]
        agree = ("greedy tokens equal" if t["equal"] else f"greedy tokens {t['identical_requests']} of {t['requests']} requests "
                 f"equal, the first difference at request {first['request']}, token {first['token']}" if first else "greedy tokens differ")
        lines.append(f"MLA at batch {row['batch']} ({mla['prompt_len']}-token prompts, up to {mla['output_tokens']} out): kernel decode "
                     f"{_f(k['decode_tok_s'], '{:.0f}')} tok/s, step {_f(k['decode_step_ms'], '{:.2f}')} ms, against the "
                     f"pure-JAX path's {_f(r['decode_tok_s'], '{:.0f}')} tok/s, {_f(r['decode_step_ms'], '{:.2f}')} ms "
                     f"(x{_f(row['kernel_over_reference_decode_tok_s'], '{:.2f}')}); whole runs {k['tok_s']:.0f} / {r['tok_s']:.0f} tok/s; "
                     f"{agree}")  # fmt: skip
    return lines


def _mxfp4_kept(moe: dict) -> bool:
    """Whether a moe stage's MoE engine kept its MXFP4 experts 4-bit (its memory plan says so)."""
    return "MXFP4 experts kept 4-bit" in ((moe.get("memory_plan") or {}).get("moe") or "")


def _mxfp4_line(name: str, moe: dict) -> str:
    """How a moe stage from an MXFP4 checkpoint held its experts, and the weight bytes of both sides."""
    how = "experts kept 4-bit (the grouped GEMM decodes them)" if _mxfp4_kept(moe) else f"experts dequantized once at load ({moe.get('moe_kernel', 'loop')})"
    weights = moe.get("weight_bytes") or {}
    dense = weights.get("dense")
    sizes = "" if weights.get("moe") is None else (
        f"; weights {weights['moe'] / 1e6:.1f} MB against the dense model's {_f(None if dense is None else dense / 1e6)} MB")
    return f"{name}: MXFP4 checkpoint, {how}{sizes}"


def summary_table(report: dict) -> str:
    """The short table the run prints last: what each goal of issue 33 asks, and what was measured."""
    st = report["stages"]
    env = report["env"]
    cold, warm = st.get("cold", {}), st.get("warm", {})
    device = cold.get("device", {})
    lines = [f"# gpu_report: {device.get('kind', '?')}, {env.get('date')}, jax {env.get('jax')}, "
             f"transformers {env.get('transformers')}, torch {env.get('torch')}", ""]  # fmt: skip
    imports = st.get("weights", {}).get("imports")
    if imports:
        lines.append("a fresh process's imports, s: " + (", ".join(f"{k} {v:.2f}" for k, v in imports.items())
                                                       if "error" not in imports else imports["error"][-300:]))
    for name in [n for n in st if n.startswith(("cold", "fp16"))]:
        lines += _workload_lines(st[name], st.get("hf_cb", {}).get("hf_cb"), "" if name == "cold" else f"{name}: ")
    for key, label in (("cold_start", "cold start"), ("warm_start", "warm start")):
        s = cold.get(key) or warm.get(key)
        if s:
            ph = s["phases_s"]
            later = s.get("all_buckets_compiled_after_warmup_began_s")
            parts = ("weights", "config", "build", "tokenizer")
            rest = ph["load"] - sum(ph.get(k, 0.0) for k in parts) if "load" in ph else None
            lines.append(f"{label}: ready {s['ready_s']:.1f} s (backend {_f(ph.get('backend'))}, load {_f(ph.get('load'))} of which "
                         + ", ".join(f"{k} {_f(ph.get(k))}" for k in parts) + f", rest {_f(rest)}, "
                         f"warm-up {_f(ph.get('warmup'))}; "
                         f"weights {_f(s.get('weights_read_gbs'), '{:.2f}')} GB/s), first token {s['first_token_s']:.2f} s, "
                         f"{s['executables_loaded']} executables loaded, {s['executables_compiled']} compiled"
                         + (f"; the other buckets compiled {later:.1f} s after warm-up began" if later else ""))
    for name in [n for n in st if n.startswith("probe")]:
        probe = st[name].get("probe")
        if probe:
            import dispatch_probe

            lines.append(("" if name == "probe" else f"{name}: ") + dispatch_probe.table(probe))
    for name in ("spec", "lora"):
        for row in st.get(name, {}).get(name, []):
            lines.append(f"{name}: " + ", ".join(f"{k} {_f(v, '{:.3g}') if isinstance(v, float) else v}" for k, v in row.items()))
    for name in ("gemm", "gemm_cublas"):
        gemm = st.get(name, {}).get("gemm")
        if not gemm:
            continue
        if gemm.get("torch_copy_gbs"):
            lines.append(f"{name}: device copy, JAX {gemm['copy_gbs']:.0f} GB/s, torch {gemm['torch_copy_gbs']:.0f} GB/s")
        lines.append(f"{name}: decode matmuls at {gemm['rows']} rows, weight bytes per second over the copy's "
                     f"({gemm['copy_gbs']:.0f} GB/s), jax [K,N] / jax [N,K] / torch: " + ", ".join(
                     f"{k} {_f(r.get('jax_kn_of_copy'), '{:.0%}')}/{_f(r.get('jax_nk_of_copy'), '{:.0%}')}/"
                     f"{_f(r.get('torch_of_copy'), '{:.0%}')}" for k, r in gemm["shapes"].items()))
    for name in ("moe", "moe_kernel", "moe_gpt_oss", "moe_gpt_oss_mxfp4"):
        moe = st.get(name, {}).get(name)
        label = "GPT-OSS MoE" if moe and moe.get("family") == "gpt_oss" else "MoE"
        kernel = moe.get("moe_kernel", "loop") if moe else ""
        if moe and moe.get("mxfp4"):
            kernel += ", MXFP4 experts " + ("4-bit" if _mxfp4_kept(moe) else "dequantized")
        if not moe:  # cut short: the runs it finished
            for run in st.get(name, {}).get("runs", ()):
                lines.append(f"{name} (stopped before its summary): {run['side']} at batch {run['batch']} {run['tok_s']:.0f} tok/s, "
                             f"step {run['step_ms']:.1f} ms")  # fmt: skip
        for row in moe["summary"] if moe else ():
            lines.append(f"{label} ({kernel}) at batch {row['batch']}: {row['moe']['tok_s']:.0f} tok/s against the dense model's "
                         f"{row['dense']['tok_s']:.0f} (x{row['moe_over_dense_tok_s']:.2f}); step {row['moe']['step_ms']:.1f} ms; "
                         f"compiles after warm-up {moe['compiles_after_warmup']}")
        if moe and moe.get("mxfp4"):
            lines.append(_mxfp4_line(name, moe))
    lines += _mla_lines(st.get("mla", {}).get("mla"))
    att = st.get("attention", {}).get("attention")
    if att:
        for g in att["goals"]:
            lines.append(f"attention {g.get('name', '')}: {_f(g.get('of_copy_bw'), '{:.1%}')} of copy bandwidth "
                         f"(goal {g.get('min_of_copy_bw', 0):.0%}), passed {g.get('passed')}")
    if st.get("attention_sweep", {}).get("attention_sweep"):
        import bench_attention

        lines += [bench_attention.sweep_line(row) for row in st["attention_sweep"]["attention_sweep"]["rows"]]
    for name, stage in st.items():
        if stage.get("error") or stage.get("rc") not in (0, None):
            lines.append(f"stage {name}: rc {stage.get('rc')} {stage.get('error', '')}")
    if report["dropped"]:
        lines.append("dropped: " + "; ".join(report["dropped"]))
    return "\n".join(lines) + "\n"
