"""Write a GGUF (default: the built-in SmolLM2-135M-Instruct) as an HF folder that every baseline loads.

vLLM needs an HF folder (config.json, tokenizer files, model.safetensors); jaxpaged and transformers
load it too, so the three systems run identical float32 weights and one tokenizer. The conversion is
jaxpaged's own GGUF reader (models/gguf_io.py), the one the engine uses on the .gguf itself.

    python scripts/export_hf.py /work/smollm2-hf
    python scripts/bench_throughput.py --model /work/smollm2-hf ...
    python scripts/export_hf.py --random scripts/configs/llama-3.2-1b.json /tmp/llama-1b  # random weights

The folder is large (about 0.5 GB for SmolLM2): keep it outside the repository.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's `models`


def hf_names(hf_config) -> list[str]:
    """The parameter names transformers expects for this config (an empty model on the meta device)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return list(model.state_dict())


def export(gguf_path: str, out: Path) -> Path:
    """config.json, generation_config.json, tokenizer files and a float32 model.safetensors in `out`."""
    from jaxpaged.models import gguf_io

    reader = gguf_io.open_gguf(gguf_path)
    hf_config = gguf_io.gguf_hf_config(reader, gguf_path)
    tensors = {name: a for name, a, _ in gguf_io.gguf_tensors(reader, gguf_path, hf_names(hf_config), hf_config)}
    write_folder(out, hf_config, tensors)
    gguf_io.gguf_tokenizer(reader, gguf_path).save_pretrained(out)
    return out


def export_random(config_json: str, out: Path) -> Path:
    """The random float32 weights jaxpaged makes for a bare config.json, written once as an HF folder (no
    tokenizer): engines that load it start from the same floats without drawing 1B random numbers each."""
    from jaxpaged.models.loader import random_checkpoint

    hf_config, tensors = random_checkpoint(config_json)
    return write_folder(out, hf_config, tensors)


def write_folder(out: Path, hf_config, tensors: dict) -> Path:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf_config.dtype = "float32"
    hf_config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})  # "pt": transformers' check
    # no sampling defaults in the folder: every system gets its sampling from the request alone
    gen = {k: getattr(hf_config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if getattr(hf_config, k, None) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def check(folder: Path, n_tokens: int, dtype: str = "float32") -> list[int]:
    """Greedy tokens of jaxpaged and transformers from the folder, one prompt; raises if they differ."""
    import torch
    import transformers

    from jaxpaged import LLM, SamplingParams

    if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        ids = tokenizer.encode("The river flows past the old bridge and the garden, where")
    else:  # random weights: any token ids
        ids = list(range(11, 27))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n_tokens, min_new_tokens=n_tokens)
    theirs = out[0, len(ids) :].tolist()
    llm = LLM(model=str(folder), dtype=dtype)
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0.0)
    ours = list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids)
    if ours != theirs:
        raise SystemExit(f"greedy tokens differ:\n jaxpaged     {ours}\n transformers {theirs}")
    return ours


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder to write (created)")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--random", default=None, metavar="CONFIG_JSON",
                   help="instead write the random weights jaxpaged makes for this bare config.json (no tokenizer)")
    p.add_argument("--check", type=int, metavar="N", default=0, help="then check that jaxpaged and transformers give the same N greedy tokens from it")
    args = p.parse_args(argv)
    from jaxpaged.models.builtin import builtin_gguf_path

    if args.random and args.gguf:
        p.error("--random and --gguf exclude each other")
    out = export_random(args.random, Path(args.out)) if args.random else export(args.gguf or builtin_gguf_path(), Path(args.out))
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    if args.check:
        print(f"jaxpaged and transformers agree on {args.check} greedy tokens: {check(out, args.check)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
